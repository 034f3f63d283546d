"""The canary evaluator (``deltad evaluate``): scores every step on labelled data before the
fleet gets it, and releases, holds or rolls back through the model's release state.

* :mod:`deltad.evaluate.labelled`: the labelled-example format, the holdout spool
  (:class:`~deltad.evaluate.labelled.HoldoutWriter`) and readers, for your own pipelines.
* :mod:`deltad.evaluate.metrics`: NE and calibration as TorchRec computes them, and the
  :class:`~deltad.evaluate.metrics.Metric` protocol for your own.
* :mod:`deltad.evaluate.scoring`: the :class:`~deltad.evaluate.scoring.Scorer` protocol (your
  model's predictions) and the reference ClickModel's.
* :mod:`deltad.evaluate.verdict`: thresholds and the verdict (a pure function).
* :mod:`deltad.evaluate.evaluator`: :class:`~deltad.evaluate.evaluator.CanaryEvaluator`.
* :mod:`deltad.evaluate.record`: verdicts in Redis; :mod:`deltad.evaluate.control`: the
  Rollout RPC; :mod:`deltad.evaluate.promex`: its Prometheus metrics; :mod:`deltad.evaluate.cli`.

Nothing is imported here (``deltad --help`` stays fast): import the submodules.
"""
