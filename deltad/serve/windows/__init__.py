"""GetDelta windows: the window decision, merges into windows, encoding, generation diffs, stream limits."""
