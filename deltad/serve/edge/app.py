"""SidecarServer: one rank's gRPC server, assembled from its parts, started and stopped.

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
file and the TLS files without a restart (deltad.serve.edge.credentials). Its periodic work
(spool poll, registry, gate, retention, forget sweep) is deltad.serve.edge.upkeep.

Without ``redis_url`` it runs an EmbeddedRedis in the spool (locked down: unix socket,
password, dangerous commands off), shared by every sidecar of the spool: it outlives any one
sidecar's crash, the last sidecar to stop shuts it down, and every sidecar's watchdog
restarts it within ``REDIS_PROBE_S`` + its start time if it dies (its append-only file keeps
the data; socket and password stay the same, so no URL goes stale). Health answers
NOT_SERVING while the offset store does not answer (``deltad_redis_up`` 0), SERVING again
once it does. The health service ``deltad.v1.Gate`` answers NOT_SERVING while the validation
gate holds (deltad.serve.index.gate).

Health (deltad.serve.edge.health): the server ("") and ``deltad.v1.DeltaService`` answer
readiness: SERVING unless a dependency fails (:meth:`SidecarServer.set_problem`: the offset
store, the embedded Redis that cannot restart, a relay's upstream that refuses it); the reason
is in Status (``health_reason``) and in one log line per change.
:data:`~deltad.commands.healthcheck.LIVENESS_SERVICE` answers liveness: SERVING while the process
serves at all, whatever its dependencies do (restarting the sidecar cannot fix Redis, and
would throw its caches away).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from deltad import knobs, wire
from deltad.channels import server_ping_options
from deltad.config import ServerConfig
from deltad.errors import ConfigError, DeltadError, OffsetStoreError, SpoolError
from deltad.segment.spool import SpoolLayout
from deltad.serve.edge.credentials import (
    CREDENTIALS_WATCH_S,
    ServerCredentials,
    check_tls_files,
)
from deltad.serve.edge.gate import Gate
from deltad.serve.edge.health import GATE_HEALTH, OffsetStoreProbe, SidecarHealth
from deltad.serve.edge.rollout_rpc import RolloutControl
from deltad.serve.edge.service import SERVICE_NAME, DeltaServicer, handlers
from deltad.serve.edge.upkeep import REGISTRY_REFRESH_S, Upkeep
from deltad.serve.index.gate import GateFailure, SegmentGate
from deltad.serve.index.log import SegmentLog
from deltad.serve.index.restore import restorable, restorable_steps, unrestorable
from deltad.serve.index.retention import Retention

if TYPE_CHECKING:
    from deltad.serve.archive.sidecar import SidecarArchive
from deltad.serve.metrics import RpcMetricsInterceptor, SidecarMetrics
from deltad.serve.rollout import gate_failed
from deltad.serve.state.offsets import OffsetStore
from deltad.serve.state.owed import OwedStore
from deltad.serve.state.release import FollowedRollout, RolloutSource, RolloutStore, RolloutView
from deltad.store import EmbeddedRedis

__all__ = [
    "CREDENTIALS_WATCH_S",
    "GATE_HEALTH",
    "REDIS_PROBE_S",
    "REGISTRY_REFRESH_S",
    "SidecarServer",
    "check_tls_files",
]

log = logging.getLogger(__name__)

#: listen hosts only this machine reaches (any other without tokens is warned about)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


def machine_name() -> str:
    """The name other machines may reach this one by, for the endpoint a sidecar listening on
    every address registers: its FQDN, else its host name when the FQDN is a loopback name
    (``getfqdn()`` is "localhost" where /etc/hosts maps the host name to 127.0.0.1)."""
    for name in (socket.getfqdn(), socket.gethostname()):
        if name and name not in LOOPBACK_HOSTS and not name.startswith("localhost"):
            return name
    return "localhost"


#: Probe the offset store this often (health, gauge, embedded restart).
REDIS_PROBE_S = 0.5
#: Check this often whether an idle sidecar should give back its free heap and its libraries' code
#: pages (knobs.IDLE_HEAP_TRIM_S, Upkeep.trim_idle).
IDLE_TRIM_CHECK_S = 2.0


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
        #: the rank lock of the spool (deltad.segment.spool.SpoolLayout.lock_rank; -1: none)
        self._rank_lock = -1
        self._server: grpc.Server | None = None
        self._stop = threading.Event()
        #: liveness, readiness (with the reasons it fails) and the gate's health service
        self.health = SidecarHealth()
        self.credentials = ServerCredentials(config)
        self.store: OffsetStore
        self.log: SegmentLog
        self.servicer: DeltaServicer
        self.retention: Retention
        self.gate: Gate
        self.upkeep: Upkeep
        self.redis_probe: OffsetStoreProbe
        #: the object store archive (deltad.serve.archive; None without --archive)
        self.archive: SidecarArchive | None = None

    def start(self) -> SidecarServer:
        """Index the spool, connect Redis, bind and start serving; raises DeltadError."""
        cfg = self.config
        root = Path(cfg.spool_dir)
        if not root.is_dir() and not root.parent.is_dir():  # (a typo: make nothing there)
            raise ConfigError(
                f"--spool {root}: neither it nor its parent directory exists (the sidecar "
                "creates the spool directory itself at most)"
            )
        self.layout.ensure_writable()
        self._rank_lock = self.layout.lock_rank(cfg.rank)  # (let go by stop)
        try:
            if cfg.archive_url is not None:  # an empty spool is restored before anything
                from deltad.serve.archive.sidecar import SidecarArchive

                self.archive = SidecarArchive(cfg, self.layout)
                if not self.relay:
                    self.archive.restore()
            if cfg.redis_url is None:
                self._embedded = EmbeddedRedis(self.layout.redis_dir, outlive_owner=True)
                self.redis_url = self._embedded.start()
            else:
                self.redis_url = cfg.redis_url
            self._start(cfg)
        except BaseException:
            self.stop(0)
            raise
        return self

    def _start(self, cfg: ServerConfig) -> None:
        self._assemble(cfg)
        server = self._bind(cfg)
        self.upkeep = Upkeep(
            cfg, self.servicer, self.store, self.owed, self.gate, self.health, self.metrics,
            self.endpoint, self._stop,
        )  # fmt: skip
        self.upkeep.relay = self.relay
        if self.rollout_store is not None:  # (a relay's Redis holds no evaluator records)
            from deltad.serve.state.evaluators import EvaluatorView

            view = EvaluatorView(self.store.client, cfg.model)
            self.servicer.status.evaluators = view.state_json
            self.metrics.track(
                "deltad_evaluators_alive",
                "Canary evaluators of the model alive (deltad evaluate: records unexpired in Redis)",
                view.alive,
            )
            self.metrics.track(
                "deltad_evaluator_verdict_age_seconds",
                "Seconds since an evaluator's newest verdict (-1: none ever recorded): while it "
                "grows, nothing new is released",
                view.verdict_age_s,
            )
        if self.archive is not None:
            uploader = self.archive.start(self.log, self.metrics, self._release_json)
            bound = cfg.archive_lag_bound_s
            self.retention.archive_pin = lambda gen: uploader.retention_pin(gen, bound)
            self.servicer.status.archive_lag = self.archive.lag
            self.upkeep.spawn("deltad-archive-health", self.check_archive, 1.0)
        self._server = server
        server.start()
        self.health.serve()
        self.gate_check()
        if cfg.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve_http(
                    cfg.metrics_port, cfg.metrics_listen or cfg.listen.rsplit(":", 1)[0]
                )
            except OSError as e:
                raise ConfigError(f"cannot serve metrics on port {cfg.metrics_port}: {e}") from e
        up = self.upkeep
        up.register_endpoint()
        # The first INT8 pull would otherwise wait for fbgemm's import.
        warm = threading.Thread(target=wire.preload_quantizer, name="deltad-warm", daemon=True)
        warm.start()
        up.spawn("deltad-poll", up.poll, cfg.poll_interval_s)
        up.spawn("deltad-gate", self.gate_check, 0.5)
        # Streams stuck in a send (a client that stopped reading) past their deadline.
        up.spawn("deltad-deadlines", self.servicer.cancel_overdue, 0.5)
        up.spawn("deltad-retention", self.retain, cfg.retention_interval_s)
        self.redis_probe = OffsetStoreProbe(
            self.redis_url, self._embedded, self.health, self.metrics, self.store.calls
        )
        up.spawn("deltad-redis-probe", self.probe_redis, REDIS_PROBE_S)
        if self.credentials.start_watch():
            up.spawn("deltad-credentials", self.watch_credentials, CREDENTIALS_WATCH_S)
        if cfg.forget_after_s > 0:
            up.spawn("deltad-forget", self.forget_idle, cfg.forget_interval_s)
        up.spawn("deltad-idle-trim", up.trim_idle, IDLE_TRIM_CHECK_S)
        log.debug(
            "serving %s rank %d on %s", cfg.model, cfg.rank, self.endpoint
        )  # printed by the CLI

    def _assemble(self, cfg: ServerConfig) -> None:
        """The sidecar's parts: offset store, release state, log, owed rows, servicer,
        retention and the edge gate."""
        self.store = OffsetStore.from_url(self.redis_url, cfg.model)
        # the release state: the model's in Redis (a sidecar) or the upstream's (a relay)
        self.rollout_store: RolloutStore | None = None
        self.rollout: RolloutSource
        if self.relay:  # (kept in its spool: a restart applies the last state it knew)
            self.rollout = FollowedRollout(
                self.layout.sidecar_dir / f"release-state-rank{cfg.rank}.json"
            )
        else:
            self.rollout_store = RolloutStore(self.store.client, cfg.model, calls=self.store.calls)
            view = self.rollout = RolloutView(self.rollout_store)
            self.metrics.track_counter(
                "deltad_release_state_refused",
                "Distinct values of the release state in Redis refused as invalid (never "
                "applied: the last valid state stays in force; see the log, deltad status)",
                lambda: view.store.refused_values,
            )
            self.metrics.track(
                "deltad_release_state_refusing",
                "1 while the release state in Redis is refused as invalid, else 0",
                lambda: 1.0 if view.refused else 0.0,
            )
        self.log = SegmentLog(
            self.layout,
            cfg.rank,
            on_quarantine=lambda p, r: self.metrics.quarantined.inc(),
            on_rewrite=self._spool_lost,
            keep_previous_s=cfg.generation_keep_s,
            keep_previous_bytes=cfg.generation_keep_bytes,
            gate=SegmentGate(cfg.gate, self._gate_failed),
        )
        self.log.refresh()
        snap = self.log.snapshot()
        if snap is None:  # a trainer not started yet, or a mistyped --spool / --model / --rank
            world_now = self._spool_world_size()
            if world_now is not None and cfg.rank >= world_now:
                log.error(
                    "rank %d: the newest generation of model %r in %s has world size %d (ranks "
                    "0..%d): this sidecar serves nothing unless a trainer of more ranks "
                    "publishes there (a mistyped --rank?)",
                    cfg.rank, cfg.model, cfg.spool_dir, world_now, world_now - 1,
                )  # fmt: skip
            else:
                log.warning(
                    "no segment of model %r rank %d in %s yet: serving nothing until %s",
                    cfg.model, cfg.rank, cfg.spool_dir,
                    "the relay's first pull from its upstream" if self.relay
                    else "the trainer publishes there",
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
            consumers=self.store.consumers,
            peers_check=self._peers_check,
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
        self.retention.before_merge = self._before_merge
        if self.rollout_store is not None:  # (a relay follows its upstream's state)
            self.retention.fresh_release = self.rollout_store.get
        retention = self.retention
        self.metrics.track_counter(
            "deltad_retention_failures",
            "Retention merges that failed (a full disk, an unwritable spool): see the log",
            lambda: retention.failures,
        )
        store = self.store
        self.gate = Gate(
            self.credentials.tokens(),
            (lambda name: store.admits(name, cfg.max_consumers)) if cfg.max_consumers else None,
            max_consumers=cfg.max_consumers,
        )
        side = self.gate.side_streams
        self.metrics.track(
            "deltad_side_streams", "Open health-watch and reflection streams", lambda: side.active
        )
        self.metrics.track_counter(
            "deltad_side_streams_refused",
            "Health-watch and reflection streams refused: knob SIDE_STREAMS were open",
            lambda: side.refused,
        )

    def _spool_world_size(self) -> int | None:
        """The world size of the newest generation in the spool (None: none readable)."""
        gens = self.layout.generations()
        if not gens:
            return None
        try:
            return int(self.layout.read_manifest(gens[-1]).world_size)
        except (DeltadError, OSError, ValueError):
            return None

    def _bind(self, cfg: ServerConfig) -> grpc.Server:
        """The gRPC server (the DeltaService behind the metrics and the edge gate, health,
        reflection), bound to ``listen``: sets :attr:`port` and :attr:`endpoint`."""
        interceptors: list[grpc.ServerInterceptor] = [
            RpcMetricsInterceptor(self.metrics),
            self.gate,
        ]
        server = grpc.server(
            futures.ThreadPoolExecutor(
                # GetDelta calls waiting in line hold a worker too, and so do long-polling
                # Status calls (at most knobs.STATUS_WAITERS of them) and health-watch and
                # reflection streams (at most knobs.SIDE_STREAMS: the gate refuses more)
                max_workers=cfg.max_concurrent_streams
                + cfg.max_queued_streams
                + 8
                + knobs.STATUS_WAITERS
                + knobs.SIDE_STREAMS,
                thread_name_prefix="deltad-rpc",
            ),
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0),
                *server_ping_options(),
            ],
        )
        server.add_generic_rpc_handlers((handlers(self.servicer),))
        self.health.add_to(server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        try:
            creds = self.credentials.server_credentials()
            if creds is not None:
                self.port = server.add_secure_port(cfg.listen, creds)
            else:
                self.port = server.add_insecure_port(cfg.listen)
        except RuntimeError as e:
            raise ConfigError(f"cannot listen on {cfg.listen}: {e}") from e
        if not self.port:
            raise ConfigError(f"cannot listen on {cfg.listen}")
        host = cfg.listen.rsplit(":", 1)[0]
        if host not in LOOPBACK_HOSTS and self.credentials.tokens() is None:
            log.warning(
                "listening on %s with no tokens (--tokens-file): whoever reaches the port may "
                "call every RPC, the admin ones (Rollout, Forget) included",
                cfg.listen,
            )
        if host in ("", "0.0.0.0", "[::]"):
            host = machine_name()
            if cfg.advertise is None and host in LOOPBACK_HOSTS:
                log.warning(
                    "listening on %s but this machine's name is %r: predictors discovering "
                    "this sidecar in Redis get %s:%d; set --advertise HOST:PORT",
                    cfg.listen, host, host, self.port,
                )  # fmt: skip
        self.endpoint = cfg.advertise or f"{host}:{self.port}"
        return server

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

    def _peers_check(self, step: int) -> str:
        """Why another rank of this generation cannot restore ``step`` ("" if none says so),
        from the restore points each rank keeps in the registry (refreshed on every merge
        and new base); OffsetStoreError if the registry cannot be read."""
        snap = self.log.snapshot()
        if snap is None or snap.manifest.world_size <= 1:
            return ""
        # (OffsetStoreError propagates: the RPC answers UNAVAILABLE, as for any Redis outage)
        for r, entry in sorted(self.store.ranks().items()):
            if r == self.config.rank or r >= snap.manifest.world_size:
                continue
            why = unrestorable(entry.get("restore"), snap.generation, step)
            if why:
                return f"rank {r} cannot restore it: {why}"
        return ""

    def _before_merge(self, merging: tuple[int, int]) -> None:
        """Tell the registry the restore points a merge about to run leaves (see retain)."""
        try:
            self.upkeep.register_endpoint(merging)
        except OffsetStoreError as e:
            log.warning("cannot record the restore points before a merge: %s", e)

    def retain(self) -> bool:
        """One retention round. This rank's registry entry tells the other ranks' rollout
        controls the steps its log holds: before a merge as if it were done (an order
        accepted meanwhile could name a step the merge swallows), and after it as it is."""
        changed = self.retention.run_once()
        if changed:
            try:
                self.upkeep.register_endpoint()
            except OffsetStoreError as e:
                log.warning("cannot record the restore points after a merge: %s", e)
        return changed

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

    # --- what the parts do, asked of the server (CLI, relay, tests) ---------------------

    def reload_credentials(self) -> bool:
        """Re-read the tokens and TLS files (SIGHUP); see ServerCredentials.reload."""
        return self.credentials.reload(self.gate)

    def watch_credentials(self) -> bool:
        """Reload the credentials if a file changed on disk; see ServerCredentials.watch."""
        return self.credentials.watch(self.gate)

    @property
    def health_reason(self) -> str:
        """Why readiness is NOT_SERVING ("" while SERVING): every current problem."""
        return self.health.reason

    def set_problem(self, source: str, reason: str | None) -> None:
        """Record or clear a dependency's problem; see SidecarHealth.set_problem."""
        self.health.set_problem(source, reason)

    def probe_redis(self) -> bool:
        """One probe of the offset store; see OffsetStoreProbe.probe."""
        return self.redis_probe.probe()

    def gate_check(self) -> bool:
        """Refresh the gate's gauges and health; True while a gate failure holds."""
        return self.upkeep.gate_check()

    def check_archive(self) -> bool:
        """The archive's health from its lag; True while it is behind its bound."""
        return self.archive is not None and self.archive.check_health(self.health)

    def forget_idle(self) -> list[str]:
        """One forget sweep; see Upkeep.forget_idle."""
        return self.upkeep.forget_idle()

    def stop(self, grace: float | None = None) -> None:
        """Stop serving: NOT_SERVING, let streams finish for ``grace`` seconds, then cancel."""
        grace = self.config.grace_period_s if grace is None else grace
        self._stop.set()
        self.health.shutdown()
        servicer = getattr(self, "servicer", None)
        if servicer is not None:  # long polls answer now, not after the stores close
            servicer.status.close()
        if self._server is not None:
            self._server.stop(grace).wait(grace + 5)
        upkeep = getattr(self, "upkeep", None)
        if upkeep is not None:
            upkeep.join()
        if self.archive is not None:
            self.archive.stop()
        self.metrics.close()
        store = getattr(self, "store", None)
        if store is not None:
            store.client.close()
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None
        lock, self._rank_lock = self._rank_lock, -1
        if lock >= 0:
            os.close(lock)

    def _release_json(self) -> str | None:
        """The release state this server applies, as JSON; None while it is not known (a
        relay that has not heard its upstream's) or refused (an invalid one in Redis)."""
        source = self.rollout
        if not source.known or (isinstance(source, RolloutView) and source.refused):
            return None
        return source.state().to_json()

    def _spool_lost(self, rewritten: int) -> None:
        """The spool lost served files under this sidecar (the log wrote them back): count
        them, and hold the rank's lock again if its file went with them (else a second
        sidecar could start on this rank of the spool)."""
        self.metrics.spool_rewritten.inc(rewritten)
        lock = self._rank_lock
        try:
            same = (
                lock >= 0
                and os.fstat(lock).st_ino
                == os.stat(self.layout.rank_lock_path(self.config.rank)).st_ino
            )
        except OSError:
            same = False
        if same:
            return
        try:
            self._rank_lock = self.layout.lock_rank(self.config.rank)
        except SpoolError as e:
            log.error("the spool lost this sidecar's rank lock, and it cannot take it again: %s", e)
            return
        if lock >= 0:
            os.close(lock)
        log.warning("the spool lost this sidecar's rank lock: holding it again")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (True) or ``timeout`` passes (False)."""
        if self._server is None:
            return True
        return not self._server.wait_for_termination(timeout)
