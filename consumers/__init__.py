"""The predictor side: appliers that write deltas into inference tables; the reference predictor."""
