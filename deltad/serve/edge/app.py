"""SidecarServer: the gRPC server of one rank with its log, offset store and background loops.

::

    srv = SidecarServer(ServerConfig(spool_dir=..., model="m", rank=0, listen="127.0.0.1:0"))
    srv.start()            # indexes the spool, connects Redis, binds, registers the endpoint
    srv.port, srv.endpoint # bound port, advertised host:port
    srv.stop(grace=5.0)    # or srv.wait() until stopped

Besides deltad.v1.DeltaService it serves grpc.health.v1 (no token needed) and server
reflection; TLS with ``tls_cert``/``tls_key`` (mTLS with ``tls_client_ca``); scoped
credentials from ``tokens_file`` (bearer tokens and mTLS identities, see deltad.serve.edge.auth),
checked with the consumer limit at the edge (deltad.serve.edge.gate); :meth:`reload_credentials`
(SIGHUP, or by itself within ``CREDENTIALS_WATCH_S`` of a file changing) re-reads the tokens
file and the TLS files without a restart.

Without ``redis_url`` it runs an EmbeddedRedis in the spool (locked down: unix socket,
password, dangerous commands off), shared by every sidecar of the spool: it outlives any one
sidecar's crash, the last sidecar to stop shuts it down, and every sidecar's watchdog
restarts it within ``REDIS_PROBE_S`` + its start time if it dies (its append-only file keeps
the data; socket and password stay the same, so no URL goes stale). Health answers
NOT_SERVING while the offset store does not answer (``deltad_redis_up`` 0), SERVING again
once it does. The health service ``deltad.v1.Gate`` answers NOT_SERVING while the validation
gate holds (deltad.serve.index.gate).

Health: the server ("") and ``deltad.v1.DeltaService`` answer readiness: SERVING unless a
dependency fails (:meth:`SidecarServer.set_problem`: the offset store, the embedded Redis
that cannot restart, a relay's upstream that refuses it); the reason is in Status
(``health_reason``) and in one log line per change. :data:`~deltad.healthcheck.LIVENESS_SERVICE`
answers liveness: SERVING while the process serves at all, whatever its dependencies do
(restarting the sidecar cannot fix Redis, and would throw its caches away).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from deltad import knobs, wire
from deltad.clientauth import file_stamp
from deltad.config import ServerConfig
from deltad.errors import ConfigError, DeltadError, OffsetStoreError
from deltad.healthcheck import LIVENESS_SERVICE
from deltad.redisutil import EmbeddedRedis, answers
from deltad.segment.spool import SpoolLayout
from deltad.serve.edge.auth import Credentials, load_tokens_file
from deltad.serve.edge.gate import Gate
from deltad.serve.edge.rollout_rpc import RolloutControl
from deltad.serve.edge.service import SERVICE_NAME, DeltaServicer, handlers
from deltad.serve.index.gate import GateFailure, SegmentGate
from deltad.serve.index.log import SegmentLog
from deltad.serve.index.restore import restorable, restorable_steps
from deltad.serve.index.retention import Retention
from deltad.serve.metrics import RpcMetricsInterceptor, SidecarMetrics
from deltad.serve.rollout import gate_failed
from deltad.serve.state.offsets import OffsetStore
from deltad.serve.state.owed import OwedStore
from deltad.serve.state.release import FollowedRollout, RolloutSource, RolloutStore, RolloutView

log = logging.getLogger(__name__)

#: Re-register the endpoint in Redis this often (and on every generation change).
REGISTRY_REFRESH_S = 10.0
#: Probe the offset store this often (health, gauge, embedded restart).
REDIS_PROBE_S = 0.5
#: Look for rewritten credential files (tokens, TLS) this often; a change reloads them as
#: SIGHUP does (mounted secrets rotate without a signal).
CREDENTIALS_WATCH_S = 1.0
#: The health service that answers NOT_SERVING while the validation gate holds this server
#: (a step it failed is not released past; Status.gate_reason says why). The service itself
#: stays SERVING: predictors keep getting the last good step.
GATE_HEALTH = "deltad.v1.Gate"


def check_tls_files(cert: Path, key: Path, ca: Path | None) -> None:
    """ConfigError unless ``cert`` and ``key`` are a matching PEM pair and ``ca`` (if any)
    holds PEM certificates: a bad file must not replace good ones (every later handshake
    would fail)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key)
        if ca is not None:
            ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"bad TLS files ({cert}, {key}, {ca}): {e}") from e


def _no_paths(e: BaseException) -> str:
    """``e`` as text without the file name an OSError carries (kept short for Status)."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} (errno {e.errno})"
    return str(e)


def _read(path: Any) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e


class SidecarServer:
    """One rank's sidecar; see the module docstring."""

    def __init__(self, config: ServerConfig, *, relay: bool = False) -> None:
        self.config = config
        #: a relay follows its upstream's release state (deltad.serve.relay) instead of Redis
        self.relay = relay
        self.layout = SpoolLayout(config.spool_dir, config.model)
        self.metrics = SidecarMetrics(config.model, config.rank)
        self.port = 0
        self.endpoint = ""
        self.metrics_port: int | None = None
        self.redis_url = ""
        self._embedded: EmbeddedRedis | None = None
        self._server: grpc.Server | None = None
        self._health: health.HealthServicer | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._registered = 0.0
        self._tls_lock = threading.Lock()
        self._tls_pending: grpc.ServerCertificateConfiguration | None = None
        self._credential_stamp: tuple[object, ...] = ()
        #: why readiness is NOT_SERVING, by source ("redis", "upstream", ...); empty: SERVING
        self._problems: dict[str, str] = {}
        self._health_lock = threading.Lock()
        self.store: OffsetStore
        self.log: SegmentLog
        self.servicer: DeltaServicer
        self.retention: Retention

    def start(self) -> SidecarServer:
        """Index the spool, connect Redis, bind and start serving; raises DeltadError."""
        cfg = self.config
        self.layout.ensure_writable()
        if cfg.redis_url is None:
            self._embedded = EmbeddedRedis(self.layout.redis_dir, outlive_owner=True)
            self.redis_url = self._embedded.start()
        else:
            self.redis_url = cfg.redis_url
        try:
            self._start(cfg)
        except BaseException:
            self.stop(0)
            raise
        return self

    def _start(self, cfg: ServerConfig) -> None:
        self.store = OffsetStore.from_url(self.redis_url, cfg.model)
        # the release state: the model's in Redis (a sidecar) or the upstream's (a relay)
        self.rollout_store: RolloutStore | None = None
        self.rollout: RolloutSource
        if self.relay:
            self.rollout = FollowedRollout()
        else:
            self.rollout_store = RolloutStore(self.store.client, cfg.model)
            self.rollout = RolloutView(self.rollout_store)
        self.log = SegmentLog(
            self.layout,
            cfg.rank,
            on_quarantine=lambda p, r: self.metrics.quarantined.inc(),
            keep_previous_s=cfg.generation_keep_s,
            keep_previous_bytes=cfg.generation_keep_bytes,
            gate=SegmentGate(cfg.gate, self._gate_failed),
        )
        self.log.refresh()
        snap = self.log.snapshot()
        if snap is None:  # a trainer not started yet, or a mistyped --spool / --model
            log.warning(
                "no segment of model %r rank %d in %s yet: serving nothing until the trainer "
                "publishes there",
                cfg.model, cfg.rank, cfg.spool_dir,
            )  # fmt: skip
        world = snap.manifest.world_size if snap is not None else 1
        owed = OwedStore(
            self.layout.sidecar_dir, cfg.model, cfg.rank, world,
            max_bytes=cfg.owed_max_bytes, max_consumer_bytes=cfg.owed_max_consumer_bytes,
        )  # fmt: skip
        self.owed = owed
        self.servicer = DeltaServicer(cfg, self.log, self.store, owed, self.metrics)
        self.servicer.windows.rollout = self.rollout
        self.servicer.rollout_control = RolloutControl(
            self.log,
            self.rollout,
            self.rollout_store,
            restore_window=self._restore_steps,
            restore_check=self._restore_check,
        )
        self.servicer.health_reason = lambda: self.health_reason
        self.metrics.track_sidecar(self.servicer, self.log)
        gate = self.log.gate
        if gate is not None:
            self.metrics.track(
                "deltad_gate_check_seconds",
                "Seconds the validation gate spent checking segments and dense states",
                lambda: gate.seconds,
            )
        self.retention = Retention(
            self.log,
            self.store,
            min_segments=cfg.merge_min_segments,
            max_bytes=knobs.MERGE_MAX_BYTES_PER_ROUND,
            restore_steps=cfg.restore_window_steps,
            restore_seconds=cfg.restore_window_s,
            release=self.rollout.state,
        )
        store = self.store
        self.gate = Gate(
            self._credentials(),
            (lambda name: store.admits(name, cfg.max_consumers)) if cfg.max_consumers else None,
            max_consumers=cfg.max_consumers,
        )
        interceptors: list[grpc.ServerInterceptor] = [
            RpcMetricsInterceptor(self.metrics),
            self.gate,
        ]
        server = grpc.server(
            futures.ThreadPoolExecutor(
                # GetDelta calls waiting in line hold a worker too, and so do long-polling
                # Status calls (at most knobs.STATUS_WAITERS of them)
                max_workers=cfg.max_concurrent_streams
                + cfg.max_queued_streams
                + 8
                + knobs.STATUS_WAITERS,
                thread_name_prefix="deltad-rpc",
            ),
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        server.add_generic_rpc_handlers((handlers(self.servicer),))
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        try:
            if cfg.tls_cert is not None and cfg.tls_key is not None:
                # dynamic: reload_credentials() swaps certificate, key and client CA for the
                # connections made after it (gRPC asks _tls_fetch at every handshake)
                creds = grpc.dynamic_ssl_server_credentials(
                    self._tls_configuration(),
                    self._tls_fetch,
                    require_client_authentication=cfg.tls_client_ca is not None,
                )
                self.port = server.add_secure_port(cfg.listen, creds)
            else:
                self.port = server.add_insecure_port(cfg.listen)
        except RuntimeError as e:
            raise ConfigError(f"cannot listen on {cfg.listen}: {e}") from e
        if not self.port:
            raise ConfigError(f"cannot listen on {cfg.listen}")
        host = cfg.listen.rsplit(":", 1)[0]
        if host in ("", "0.0.0.0", "[::]"):
            host = socket.getfqdn()
        self.endpoint = cfg.advertise or f"{host}:{self.port}"
        self._server = server
        server.start()
        self._health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self._apply_health()
        self._gate_held: bool | None = None
        self.gate_check()
        if cfg.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve_http(
                    cfg.metrics_port, cfg.metrics_listen or cfg.listen.rsplit(":", 1)[0]
                )
            except OSError as e:
                raise ConfigError(f"cannot serve metrics on port {cfg.metrics_port}: {e}") from e
        self._register_endpoint()
        # The first INT8 pull would otherwise wait for fbgemm's import.
        warm = threading.Thread(target=wire.preload_quantizer, name="deltad-warm", daemon=True)
        warm.start()
        self._spawn("deltad-poll", self._poll_loop, cfg.poll_interval_s)
        self._spawn("deltad-gate", self.gate_check, 0.5)
        # Streams stuck in a send (a client that stopped reading) past their deadline.
        self._spawn("deltad-deadlines", self.servicer.cancel_overdue, 0.5)
        self._spawn("deltad-retention", self._retention_loop, cfg.retention_interval_s)
        self._redis_up = True
        self._probe_fails = 0
        self.metrics.redis_up.set(1)
        self._spawn("deltad-redis-probe", self.probe_redis, REDIS_PROBE_S)
        if self._credential_files():
            self._credential_stamp = file_stamp(self._credential_files())
            self._spawn("deltad-credentials", self.watch_credentials, CREDENTIALS_WATCH_S)
        if cfg.forget_after_s > 0:
            self._spawn("deltad-forget", self.forget_idle, cfg.forget_interval_s)
        log.debug(
            "serving %s rank %d on %s", cfg.model, cfg.rank, self.endpoint
        )  # printed by the CLI

    def _restore_steps(self) -> tuple[int, int] | None:
        """(oldest, newest) step this rank's log can restore; None: no log yet."""
        snap = self.log.snapshot()
        return None if snap is None else restorable_steps(snap)

    def _restore_check(self, step: int) -> str:
        """Why this rank's log cannot restore ``step`` ("" if it can): asked before a rollback
        order is recorded (deltad.serve.index.restore)."""
        snap = self.log.snapshot()
        if snap is None:
            return "this sidecar has no log yet"
        return restorable(snap, step)

    def _credentials(self) -> Credentials | None:
        cfg = self.config
        creds = load_tokens_file(cfg.tokens_file) if cfg.tokens_file is not None else None
        if cfg.tokens:
            full = Credentials.full_access(cfg.tokens)
            if creds is None:
                return full
            return Credentials({**full.tokens, **creds.tokens}, creds.identities)
        return creds

    def _tls_configuration(self) -> grpc.ServerCertificateConfiguration:
        """The TLS files as one gRPC certificate configuration; ConfigError if one cannot
        be read, or the key does not match the certificate, or a file is not PEM."""
        cfg = self.config
        assert cfg.tls_cert is not None and cfg.tls_key is not None
        check_tls_files(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
        return grpc.ssl_server_certificate_configuration(
            [(_read(cfg.tls_key), _read(cfg.tls_cert))],
            root_certificates=_read(cfg.tls_client_ca) if cfg.tls_client_ca else None,
        )

    def _tls_fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's per-handshake question: a new configuration (once), or None: no change."""
        with self._tls_lock:
            new, self._tls_pending = self._tls_pending, None
        return new

    def _credential_files(self) -> list[Path | None]:
        cfg = self.config
        files = [cfg.tokens_file, cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca]
        return files if any(f is not None for f in files) else []

    def watch_credentials(self) -> bool:
        """Reload the credentials if a tokens or TLS file changed on disk since the last
        look (a broken new file is logged once, not every look); True if it reloaded."""
        stamp = file_stamp(self._credential_files())
        if stamp == self._credential_stamp:
            return False
        self._credential_stamp = stamp
        log.warning("credential files changed on disk: reloading")
        self.reload_credentials()
        return True

    def reload_credentials(self) -> bool:
        """Re-read ``tokens_file`` and the TLS certificate, key and client CA (SIGHUP); a bad
        file keeps the old credentials of its kind, logged. True if all new ones are in force
        (TLS: for connections made from now on)."""
        ok = True
        try:
            creds = self._credentials()
        except ConfigError as e:
            log.error("tokens file not reloaded, the previous credentials stay: %s", e)
            ok = False
        else:
            self.gate.set_credentials(creds)
            log.warning("credentials reloaded: %d", len(creds) if creds is not None else 0)
        if self.config.tls_cert is not None:
            try:
                tls = self._tls_configuration()
            except ConfigError as e:
                log.error("TLS files not reloaded, the previous ones stay: %s", e)
                return False
            with self._tls_lock:
                self._tls_pending = tls
            log.warning("TLS certificate, key and client CA reloaded (new connections)")
        return ok

    def _spawn(self, name: str, fn: Callable[[], object], interval: float) -> None:
        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    fn()
                except DeltadError as e:
                    log.warning("%s: %s", name, e)
                except Exception:
                    log.exception("%s failed", name)

        t = threading.Thread(target=loop, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    @property
    def health_reason(self) -> str:
        """Why readiness is NOT_SERVING ("" while SERVING): every current problem."""
        with self._health_lock:
            return "; ".join(self._problems[k] for k in sorted(self._problems))

    def set_problem(self, source: str, reason: str | None) -> None:
        """Record (``reason``) or clear (None) ``source``'s problem; readiness is SERVING
        only without any. Logs one line per change, never per repeat."""
        with self._health_lock:
            if self._problems.get(source) == reason:
                return
            if reason is None:
                self._problems.pop(source, None)
            else:
                self._problems[source] = reason
            self._apply_health()
            left = len(self._problems)
        if reason is not None:
            log.warning("NOT_SERVING: %s", reason)
        else:
            log.warning("%s: ok again%s", source, " (SERVING)" if not left else "")

    def _apply_health(self) -> None:
        if self._health is None or self._stop.is_set():
            return
        status = health_pb2.HealthCheckResponse.SERVING
        if self._problems:
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self._health.set(name, status)

    def probe_redis(self) -> bool:
        """One probe of the offset store: restart a dead embedded server, set the gauge and
        the health status; True if it answers."""
        up = answers(self.redis_url, timeout_s=1.0)
        why = "offset store unreachable"
        if not up and self._embedded is not None:
            try:
                if self._embedded.ensure():
                    self.metrics.redis_restarts.inc()
                up = answers(self.redis_url, timeout_s=1.0)
            except (DeltadError, OSError) as e:  # e.g. ENOSPC writing its config: a full spool
                why = f"the embedded redis is down and cannot restart: {_no_paths(e)}"
        # health flips only after two probes agree (a loaded box may miss one answer)
        self._probe_fails = 0 if up else self._probe_fails + 1
        if not up and self._probe_fails < 2:
            return False
        self.metrics.redis_up.set(1 if up else 0)
        if not self._stop.is_set():
            self.set_problem("redis", None if up else why)
        self._redis_up = up
        return up

    def _gate_failed(self, f: GateFailure) -> None:
        """The validation gate failed a step: count it, say it in the health detail (the
        ``GATE_HEALTH`` service NOT_SERVING while a failure stands) and hold the model (a
        sidecar writes the release state; a relay holds its own consumers only)."""
        self.metrics.gate_failures.inc()
        if self.rollout_store is None:
            return
        try:
            state = self.rollout_store.update(
                lambda s: gate_failed(
                    s,
                    generation=f.generation,
                    bad_step=f.step,
                    good_step=f.good_step,
                    reason=f"rank {self.config.rank} step {f.step}: {f.reason}",
                )
            )
        except OffsetStoreError as e:  # the local gate holds this rank regardless
            log.error("gate: cannot hold the model in the release state: %s", e)
            return
        if isinstance(self.rollout, RolloutView):
            self.rollout.set(state)

    def gate_check(self) -> bool:
        """Refresh the gate's gauge and health detail; True while a gate failure holds."""
        snap = self.log.snapshot()
        held = False
        if snap is not None:
            state = self.rollout.state()
            held = self.servicer.windows.gate_cap(state, snap.generation) is not None
            self.metrics.gate_held.set(1 if held else 0)
            self.metrics.rollout_held.set(1 if state.held else 0)
            self.metrics.release_step.set(-1 if state.release_step is None else state.release_step)
        if self._health is not None and not self._stop.is_set() and self._gate_held != held:
            self._health.set(
                GATE_HEALTH,
                health_pb2.HealthCheckResponse.NOT_SERVING
                if held
                else health_pb2.HealthCheckResponse.SERVING,
            )
            self._gate_held = held
        return held

    def _register_endpoint(self) -> None:
        snap = self.log.snapshot()
        self.store.register_rank(
            self.config.rank, self.endpoint, snap.generation if snap is not None else None
        )
        self._registered = time.monotonic()

    def _poll_loop(self) -> None:
        before = self.log.snapshot()
        self.log.refresh()
        snap = self.log.snapshot()
        if snap is not None:
            self.metrics.head_seq.set(snap.head.seq)
        generation_changed = (before is None) != (snap is None) or (
            before is not None and snap is not None and before.generation != snap.generation
        )
        if generation_changed or time.monotonic() - self._registered > REGISTRY_REFRESH_S:
            try:
                self._register_endpoint()
                self.servicer.consumer_infos()  # refreshes the lag gauges
            except OffsetStoreError as e:
                log.warning("cannot refresh registry: %s", e)
                self._registered = time.monotonic()

    def _retention_loop(self) -> None:
        self.retention.run_once()

    def forget_idle(self) -> list[str]:
        """One forget sweep: consumers silent past ``forget_after_s`` (every rank's Redis
        state), then this rank's owed files that no cursor or pull refers to any more."""
        cfg = self.config
        snap = self.log.snapshot()
        world = max(
            snap.manifest.world_size if snap is not None else 1,
            max(self.store.ranks(), default=0) + 1,
        )
        gone = self.store.forget_idle(world, cfg.forget_after_s)
        # any rank may have forgotten a name this one admitted before: count them afresh
        self.gate.forget_admitted()
        for name in gone:
            log.info("forgot consumer %r: silent for %.0f s", name, cfg.forget_after_s)

        def has_state(consumer: str) -> bool:
            r = cfg.rank
            return (
                self.store.get_cursor(consumer, r) is not None
                or self.store.pending_pulls([consumer], r)[consumer] is not None
            )

        # an owed file is written just before Redis records its pull: spare young files
        self.owed.sweep(has_state, min_age_s=max(60.0, min(cfg.forget_after_s, 3600.0)))
        return gone

    def stop(self, grace: float | None = None) -> None:
        """Stop serving: NOT_SERVING, let streams finish for ``grace`` seconds, then cancel."""
        grace = self.config.grace_period_s if grace is None else grace
        self._stop.set()
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        if self._server is not None:
            self._server.stop(grace).wait(grace + 5)
        for t in self._threads:
            t.join(timeout=10)
        self._threads.clear()
        self.metrics.close()
        store = getattr(self, "store", None)
        if store is not None:
            store.client.close()
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (True) or ``timeout`` passes (False)."""
        if self._server is None:
            return True
        return not self._server.wait_for_termination(timeout)
