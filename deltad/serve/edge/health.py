"""The sidecar's health: what grpc.health.v1 answers (liveness, readiness, the gate) and the offset store probe behind readiness."""

from __future__ import annotations

import logging
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from deltad.commands.healthcheck import LIVENESS_SERVICE
from deltad.errors import DeltadError
from deltad.serve.edge.grpcutil import public_details
from deltad.serve.edge.service import SERVICE_NAME
from deltad.serve.metrics import SidecarMetrics
from deltad.serve.state.redis_calls import RedisCalls
from deltad.store import EmbeddedRedis, _redact, answers

log = logging.getLogger(__name__)

#: The health service that answers NOT_SERVING while the validation gate holds this server
#: (a step it failed is not released past; Status.gate_reason says why). The service itself
#: stays SERVING: predictors keep getting the last good step.
GATE_HEALTH = "deltad.v1.Gate"
#: The services that answer readiness: the server ("") and the DeltaService.
READINESS = ("", SERVICE_NAME)

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _no_paths(e: BaseException) -> str:
    """``e`` as text without the file name an OSError carries (kept short for Status)."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} (errno {e.errno})"
    return str(e)


class SidecarHealth:
    """The health servicer of one sidecar.

    Readiness is SERVING unless a dependency has a problem (:meth:`set_problem`, by source:
    "redis", "upstream", ...; :attr:`reason` joins them); :data:`LIVENESS_SERVICE` is SERVING
    while the process serves at all; :data:`GATE_HEALTH` is NOT_SERVING while the validation
    gate holds (:meth:`set_gate_held`). Nothing is answered before :meth:`serve` nor changed
    after :meth:`shutdown`.
    """

    def __init__(self) -> None:
        self.servicer = health.HealthServicer()
        self._problems: dict[str, str] = {}
        self._lock = threading.Lock()
        self._serving = False
        self._stopped = False
        self._gate_held: bool | None = None

    def add_to(self, server: grpc.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    def serve(self) -> None:
        """The server has started: liveness SERVING, readiness as the problems say."""
        self._serving = True
        self.servicer.set(LIVENESS_SERVICE, _SERVING)
        with self._lock:
            self._apply()

    def shutdown(self) -> None:
        """Every service NOT_SERVING from now on (graceful shutdown)."""
        self._stopped = True
        self.servicer.enter_graceful_shutdown()

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def reason(self) -> str:
        """Why readiness is NOT_SERVING ("" while SERVING): every current problem."""
        with self._lock:
            return "; ".join(self._problems[k] for k in sorted(self._problems))

    def set_problem(self, source: str, reason: str | None) -> None:
        """Record (``reason``) or clear (None) ``source``'s problem; readiness is SERVING
        only without any. Logs one line per change, never per repeat."""
        with self._lock:
            if self._problems.get(source) == reason:
                return
            if reason is None:
                self._problems.pop(source, None)
            else:
                self._problems[source] = reason
            self._apply()
            left = len(self._problems)
        if reason is not None:
            log.warning("NOT_SERVING: %s", reason)
        else:
            log.warning("%s: ok again%s", source, " (SERVING)" if not left else "")

    def _apply(self) -> None:
        if not self._serving or self._stopped:
            return
        status = _NOT_SERVING if self._problems else _SERVING
        for name in READINESS:
            self.servicer.set(name, status)

    def set_gate_held(self, held: bool) -> None:
        """:data:`GATE_HEALTH` NOT_SERVING while ``held`` (set on a change only)."""
        if self._serving and not self._stopped and self._gate_held != held:
            self.servicer.set(GATE_HEALTH, _NOT_SERVING if held else _SERVING)
            self._gate_held = held


#: How long one probe waits for the offset store's PING answer. A hung store (a stopped
#: redis-server) is NOT_SERVING after two such misses in a row: within ~2.5 s of the hang.
PROBE_TIMEOUT_S = 1.0


class OffsetStoreProbe:
    """Whether the offset store answers, for readiness ("redis") and ``deltad_redis_up``;
    an embedded Redis that died is restarted here (its restarts counted). While it does not
    answer, the store's calls (``calls``) make one attempt each, so RPCs that need it answer
    UNAVAILABLE at once, naming it."""

    def __init__(
        self,
        redis_url: str,
        embedded: EmbeddedRedis | None,
        health: SidecarHealth,
        metrics: SidecarMetrics,
        calls: RedisCalls | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.embedded = embedded
        self.health = health
        self.metrics = metrics
        self.calls = calls
        self.up = True
        metrics.redis_up.set(1)

    def probe(self) -> bool:
        """One probe of the offset store: restart a dead embedded server, set the gauge, the
        health status and :attr:`RedisCalls.down`; True if it answers. A miss is asked again
        at once (a loaded box may miss one answer): two in a row turn readiness NOT_SERVING."""
        why = ""
        up = False
        for _ in range(2):
            if answers(self.redis_url, timeout_s=PROBE_TIMEOUT_S):
                up = True
                break
            why = public_details(  # (an embedded store's socket path cut to its name)
                f"the offset store at {_redact(self.redis_url)} did not answer in "
                f"{PROBE_TIMEOUT_S:g} s"
            )
            if self.embedded is None or self.embedded.running():
                continue  # (hung, not dead: a second server on its files would corrupt them)
            try:
                if self.embedded.ensure():
                    self.metrics.redis_restarts.inc()
                up = answers(self.redis_url, timeout_s=PROBE_TIMEOUT_S)
            except (DeltadError, OSError) as e:  # e.g. ENOSPC writing its config: a full spool
                why = f"the embedded redis is down and cannot restart: {_no_paths(e)}"
            break
        self.metrics.redis_up.set(1 if up else 0)
        if self.calls is not None:
            self.calls.down = None if up else why
        if not self.health.stopped:
            self.health.set_problem("redis", None if up else why)
        self.up = up
        return up
