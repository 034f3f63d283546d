"""The sidecar's index of one rank's log: the log, pre-merged runs, merges, retention, the spilled base."""
