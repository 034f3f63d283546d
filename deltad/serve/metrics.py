"""Prometheus metrics of one sidecar (own registry, so several servers can share a process)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class SidecarMetrics:
    """The sidecar's counters and gauges; ``serve_http(port)`` exposes them."""

    def __init__(self, model: str, rank: int) -> None:
        self.registry = CollectorRegistry()
        labels = {"model": model, "rank": str(rank)}
        r = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=r).labels(**labels)

        self.bytes_served = counter("deltad_bytes_served", "Payload bytes sent by GetDelta")
        self.rows_served = counter("deltad_rows_served", "Rows sent by GetDelta")
        self.pulls = counter("deltad_pulls", "GetDelta streams completed")
        self.cache_hits = counter("deltad_window_cache_hits", "Windows served from the cache")
        self.quarantined = counter(
            "deltad_quarantined_segments", "Segments that failed their checksum"
        )
        self.merge_seconds = Histogram(
            "deltad_window_merge_seconds",
            "Time to merge and encode one window",
            list(labels),
            registry=r,
            buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0),
        ).labels(**labels)
        self.active_streams = Gauge(
            "deltad_active_streams", "GetDelta streams in flight", list(labels), registry=r
        ).labels(**labels)
        self.head_seq = Gauge(
            "deltad_head_seq", "Newest served segment", list(labels), registry=r
        ).labels(**labels)
        self.redis_up = Gauge(
            "deltad_redis_up",
            "1 while the offset store (Redis) answers the sidecar's probe, else 0",
            list(labels),
            registry=r,
        ).labels(**labels)
        self.redis_restarts = counter(
            "deltad_redis_restarts", "Embedded Redis servers this sidecar restarted"
        )
        self.lag_segments = Gauge(
            "deltad_consumer_lag_segments",
            "Head seq minus the consumer's committed seq",
            [*labels, "consumer"],
            registry=r,
        )
        self.lag_seconds = Gauge(
            "deltad_consumer_lag_seconds",
            "Age of the oldest segment the consumer has not committed",
            [*labels, "consumer"],
            registry=r,
        )
        self._labels = labels
        self._lagging: set[str] = set()
        self._http: Any = None

    def set_lag(self, consumer: str, segments: int, seconds: float) -> None:
        self.lag_segments.labels(**self._labels, consumer=consumer).set(segments)
        self.lag_seconds.labels(**self._labels, consumer=consumer).set(seconds)
        self._lagging.add(consumer)

    def keep_lag_of(self, consumers: set[str]) -> None:
        """Drop the lag series of consumers not in ``consumers`` (forgotten ones), so that no
        alert fires on a consumer that no longer exists."""
        for gone in self._lagging - consumers:
            for gauge in (self.lag_segments, self.lag_seconds):
                try:
                    gauge.remove(*self._labels.values(), gone)
                except KeyError:
                    pass
        self._lagging &= consumers

    def serve_http(self, port: int, addr: str = "0.0.0.0") -> int:
        """Expose /metrics on ``port`` (0: any free port); returns the port."""
        self._http, _ = start_http_server(port, addr=addr, registry=self.registry)
        return int(self._http.server_port)

    def close(self) -> None:
        """Stop the /metrics endpoint if one was started."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
