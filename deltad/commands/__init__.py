"""The `deltad` command line by role: the entry and its subcommands (:mod:`.main`), and the
operators' commands that talk to running sidecars: `deltad status` (:mod:`.status`), `deltad
rollout` (:mod:`.rollout`) and the health probe (:mod:`.healthcheck`)."""
