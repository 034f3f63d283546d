"""Per-consumer state: cursors, pulls and leases in Redis, owed rows of top-k consumers."""
