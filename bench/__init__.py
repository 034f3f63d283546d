"""deltad benchmarks: every figure is a ratio against a baseline measured in the same run.

Run ``deltad bench`` (or ``python -m bench.run``) from the repository root; see
``bench/README.md`` for what each benchmark measures and the recorded results.
"""
