"""Prometheus metrics of one predictor (`deltad consume --metrics-port`): what it serves, how
fresh, and what it could not apply. Own registry; every series carries ``model`` and
``consumer``. Updated once per pull from the pull's log line (:meth:`PredictorMetrics.observe`).
"""

from __future__ import annotations

from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from deltad.metrics_endpoint import MetricsEndpoint


class PullLine(Protocol):
    """What a pull's log line (``consumers.predictor.PullLogLine``) says that is counted."""

    refused: str | None
    missing: dict[int, str]
    rows: int
    bytes: int
    resync: bool
    step: int | None
    head_step: int | None
    step_lag: int | None
    caught_up: bool
    freshness_s: float | None


#: freshness buckets (seconds): segment created -> rows applied
FRESHNESS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)


class PredictorMetrics(MetricsEndpoint):
    """A predictor's counters and gauges; :meth:`serve_http` exposes them."""

    def __init__(self, model: str, consumer: str) -> None:
        super().__init__(CollectorRegistry())
        labels = {"model": model, "consumer": consumer}
        r = self.registry

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, list(labels), registry=r).labels(**labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        self.pulls = counter("deltad_predictor_pulls", "Pulls made")
        self.refused = counter(
            "deltad_predictor_refused_windows",
            "Pulls whose windows the applier refused (nothing of them applied; the predictor "
            "keeps serving what it held and asks for its full tables again after a backoff)",
        )
        self.incomplete = counter(
            "deltad_predictor_incomplete_pulls",
            "Pulls that left a rank unread (sidecar or relay not answering, ranks at other "
            "steps): nothing of them applied",
        )
        self.rows = counter("deltad_predictor_rows", "Rows applied")
        self.bytes = counter("deltad_predictor_received_bytes", "Payload bytes applied")
        self.resyncs = counter(
            "deltad_predictor_resyncs", "Pulls that replaced the tables whole (a bootstrap)"
        )
        self.served_step = gauge(
            "deltad_predictor_served_step", "Trainer step the predictor serves (-1: none yet)"
        )
        self.served_step.set(-1)
        self.head_step = gauge("deltad_predictor_head_step", "Newest step any rank published")
        self.step_lag = gauge("deltad_predictor_step_lag", "head_step - served_step")
        self.caught_up = gauge(
            "deltad_predictor_caught_up",
            "1 when the last pull served the newest step this predictor may have",
        )
        self.refusals_in_a_row = gauge(
            "deltad_predictor_refusals_in_a_row", "Windows refused since the last one applied"
        )
        self.freshness = Histogram(
            "deltad_predictor_freshness_seconds",
            "Segment created (trainer) -> its rows applied here",
            list(labels),
            buckets=FRESHNESS_BUCKETS,
            registry=r,
        ).labels(**labels)
        self._in_a_row = 0

    def observe(self, rec: PullLine) -> None:
        """Count one pull (its log line)."""
        self.pulls.inc()
        if rec.refused is not None:
            self.refused.inc()
            self._in_a_row += 1
        elif rec.rows or rec.resync:
            self._in_a_row = 0
        if rec.missing:
            self.incomplete.inc()
        self.rows.inc(rec.rows)
        self.bytes.inc(rec.bytes)
        if rec.resync:
            self.resyncs.inc()
        if rec.step is not None:
            self.served_step.set(rec.step)
        if rec.head_step is not None:
            self.head_step.set(rec.head_step)
        if rec.step_lag is not None:
            self.step_lag.set(rec.step_lag)
        self.caught_up.set(1 if rec.caught_up else 0)
        self.refusals_in_a_row.set(self._in_a_row)
        if rec.freshness_s is not None:
            self.freshness.observe(rec.freshness_s)
