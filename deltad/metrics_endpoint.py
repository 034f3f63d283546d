"""One Prometheus ``/metrics`` HTTP endpoint over a registry: the sidecar's
(deltad.serve.metrics), the predictor's (consumers.metrics) and the evaluator's
(deltad.evaluate.promex) metrics each own one."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, start_http_server


class MetricsEndpoint:
    """A registry and, once :meth:`serve_http` is called, the HTTP server exposing it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._http: Any = None

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Expose /metrics on ``port`` (0: any free port) at ``addr`` (brackets of an IPv6
        address are dropped); returns the port."""
        self._http, _ = start_http_server(port, addr=addr.strip("[]"), registry=self.registry)
        return int(self._http.server_port)

    def close(self) -> None:
        """Stop the /metrics endpoint if one was started."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
