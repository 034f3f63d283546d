"""Relays: a sidecar that mirrors an upstream sidecar's log and re-serves it."""
