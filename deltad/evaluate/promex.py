"""The evaluator's Prometheus metrics, on its own ``--metrics-port``.

``deltad_eval_ne{model,set,copy}`` and ``deltad_eval_calibration{model,set,copy}`` (copy:
candidate or release; set: golden or progressive) of the newest verdict,
``deltad_eval_verdicts_total{model,verdict}``, ``deltad_eval_verdict_seconds{model}`` (from
a step's publish to its verdict), ``deltad_eval_step{model}`` and
``deltad_eval_release_step{model}`` (the steps of the newest verdict).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from deltad.evaluate.verdict import Verdict
from deltad.metrics_endpoint import MetricsEndpoint


class EvalMetrics(MetricsEndpoint):
    """Counters and gauges of one evaluator; :meth:`observe` takes each verdict."""

    def __init__(self, model: str) -> None:
        super().__init__(CollectorRegistry())
        self.model = model
        r = self.registry
        self.ne = Gauge("deltad_eval_ne", "NE of the newest verdict", ["model", "set", "copy"],
                        registry=r)  # fmt: skip
        self.cal = Gauge(
            "deltad_eval_calibration", "Calibration of the newest verdict",
            ["model", "set", "copy"], registry=r,
        )  # fmt: skip
        self.verdicts = Counter(
            "deltad_eval_verdicts", "Verdicts reached or adopted", ["model", "verdict"],
            registry=r,
        )  # fmt: skip
        for v in ("pass", "fail"):
            self.verdicts.labels(model, v)
        self.seconds = Histogram(
            "deltad_eval_verdict_seconds", "Seconds from a step's publish to its verdict",
            ["model"], registry=r,
            buckets=(0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60, 300),
        )  # fmt: skip
        self.step = Gauge("deltad_eval_step", "Step of the newest verdict", ["model"], registry=r)
        self.release_step = Gauge(
            "deltad_eval_release_step", "Release step of the newest verdict", ["model"],
            registry=r,
        )  # fmt: skip

    def observe(self, v: Verdict) -> None:
        m = self.model
        self.verdicts.labels(m, v.verdict).inc()
        if v.published_unix and v.decided_unix >= v.published_unix:
            self.seconds.labels(m).observe(v.decided_unix - v.published_unix)
        self.step.labels(m).set(v.step)
        self.release_step.labels(m).set(v.release_step)
        for s in v.sets:
            for copy, vals in (("candidate", s.candidate), ("release", s.release)):
                if "ne" in vals:
                    self.ne.labels(m, s.name, copy).set(vals["ne"])
                if "calibration" in vals:
                    self.cal.labels(m, s.name, copy).set(vals["calibration"])
