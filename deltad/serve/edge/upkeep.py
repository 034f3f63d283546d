"""The sidecar's periodic work (spool poll and registry, gate, forget sweep, ...), each loop on its own thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from deltad import knobs
from deltad.config import ServerConfig
from deltad.errors import DeltadError, OffsetStoreError
from deltad.perf import page_out_libraries, trim_heap
from deltad.serve.edge.gate import Gate
from deltad.serve.edge.health import SidecarHealth
from deltad.serve.edge.service import DeltaServicer
from deltad.serve.index.restore import restore_points
from deltad.serve.memory import rss_bytes
from deltad.serve.metrics import SidecarMetrics
from deltad.serve.ratelog import RateLimitedLog
from deltad.serve.rollout import gate_open
from deltad.serve.state.offsets import OffsetStore
from deltad.serve.state.owed import OwedStore

log = logging.getLogger(__name__)

#: Re-register the endpoint in Redis this often (and on every generation change).
REGISTRY_REFRESH_S = 10.0


class Upkeep:
    """One sidecar's periodic duties, each run by :meth:`spawn` on a daemon thread until
    ``stop`` is set (a duty's DeltadError is logged in one line, anything else with its
    traceback; the loop goes on)."""

    def __init__(
        self,
        config: ServerConfig,
        servicer: DeltaServicer,
        store: OffsetStore,
        owed: OwedStore,
        gate: Gate,
        health: SidecarHealth,
        metrics: SidecarMetrics,
        endpoint: str,
        stop: threading.Event,
    ) -> None:
        self.config = config
        self.servicer = servicer
        self.log = servicer.log
        self.store = store
        self.owed = owed
        self.gate = gate
        self.health = health
        self.metrics = metrics
        self.endpoint = endpoint
        self._stop = stop
        self._threads: list[threading.Thread] = []
        self._registered = 0.0
        #: when this sidecar last wrote its registry entry (None: not yet)
        self._written_unix: float | None = None
        #: a relay's upkeep (set by its server): no registry conflicts (see register_endpoint)
        self.relay = False
        self._conflicts = RateLimitedLog(every_s=300.0, logger=log)
        self._trimmed_at = -1.0  # the last stream end whose freed heap was handed back
        self._paged_out_at = -1.0  # the last stream end after which the libraries were paged out

    def spawn(self, name: str, fn: Callable[[], object], interval: float) -> None:
        """Run ``fn`` every ``interval`` seconds on a thread named ``name``."""

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

    def trim_idle(self) -> bool:
        """Once no GetDelta stream has run for ``knobs.IDLE_HEAP_TRIM_S``, give back, once per
        idle spell, what a busy sidecar keeps resident for the next pull: the free heap malloc
        keeps (``knobs.IDLE_HEAP_TRIM_MIN_BYTES`` or more; the next pull faults its pages in
        again, ~0.1 s per GB) and, with ``knobs.IDLE_PAGE_OUT_LIBRARIES``, the loaded
        libraries' code pages (mostly libtorch's start-up; the next pull reads back the few
        it runs). An idle sidecar holds its log and the runtime it uses, not the high-water
        mark of its last bootstraps. True if anything was given back."""
        after = knobs.IDLE_HEAP_TRIM_S
        streams = self.servicer.streams
        if after <= 0 or streams.idle_s() < after:
            return False
        spell = streams.last_release
        before = rss_bytes()
        done: list[str] = []
        if spell != self._trimmed_at:
            free = self.metrics.memory.heap_free_growth()  # (resident: none trimmed since)
            if free >= max(1, knobs.IDLE_HEAP_TRIM_MIN_BYTES):
                self._trimmed_at = spell
                trim_heap()
                self.metrics.memory.heap_trimmed()
                self.metrics.idle_heap_trims.inc()
                done.append(f"{free / 1e6:.0f} MB of free heap")
        if knobs.IDLE_PAGE_OUT_LIBRARIES and spell != self._paged_out_at:
            self._paged_out_at = spell
            if page_out_libraries():
                self.metrics.idle_page_outs.inc()
                done.append("the libraries' code pages")
        if not done:
            return False
        log.info(
            "idle %.0f s: handed %s back (RSS %.0f -> %.0f MB)",
            streams.idle_s(), " and ".join(done), before / 1e6, rss_bytes() / 1e6,
        )  # fmt: skip
        return True

    def join(self) -> None:
        """Wait for the loops to end (after ``stop`` was set)."""
        for t in self._threads:
            t.join(timeout=10)
        self._threads.clear()

    def register_endpoint(self, merging: tuple[int, int] | None = None) -> None:
        """Record this rank's endpoint, generation and restore points in the offset store's
        registry (``merging``: with the (first_seq, seq) of a merge about to run taken as
        done); say so (a warning, ``deltad_registry_conflicts_total``) when another sidecar
        wrote this rank's entry since this one last did."""
        snap = self.log.snapshot()
        # (a relay tier's replicas register one rank in one Redis on purpose: the last wins)
        if self._written_unix is not None and not self.relay:
            other = self.store.ranks().get(self.config.rank)
            if (
                other is not None
                and other.get("endpoint") != self.endpoint
                and isinstance(other.get("updated_unix"), int | float)
                and other["updated_unix"] > self._written_unix
            ):
                self.metrics.registry_conflicts.inc()
                self._conflicts.warning(
                    "another sidecar (%s, generation %s) registers model %r rank %d in this "
                    "Redis too: two deployments under one --model share its consumers' "
                    "cursors, leases and release state, and predictors that look sidecars up "
                    "in Redis find either one. Give each deployment its own --model or its own "
                    "Redis (database)",
                    str(other.get("endpoint"))[:200], other.get("generation"),
                    self.config.model, self.config.rank,
                )  # fmt: skip
        self._written_unix = time.time()
        self.store.register_rank(
            self.config.rank,
            self.endpoint,
            snap.generation if snap is not None else None,
            restore_points(snap, merging) if snap is not None else None,
        )
        self._registered = time.monotonic()

    def poll(self) -> None:
        """Index new segments; re-register on a generation change or every
        ``REGISTRY_REFRESH_S`` (refreshing the lag gauges with it)."""
        before = self.log.snapshot()
        self.log.refresh()
        snap = self.log.snapshot()
        if snap is not None:
            self.metrics.head_seq.set(snap.head.seq)
        # (a new generation, or a new base in this one: a fresh base after a quarantine or a
        # gap drops steps, and the other ranks' rollout controls read this rank's restore
        # points from its registry entry)
        moved = (before is None) != (snap is None) or (
            before is not None
            and snap is not None
            and (before.generation, before.base.seq) != (snap.generation, snap.base.seq)
        )
        if moved or time.monotonic() - self._registered > REGISTRY_REFRESH_S:
            try:
                self.register_endpoint()
                self.servicer.consumer_infos()  # refreshes the lag gauges
            except OffsetStoreError as e:
                log.warning("cannot refresh registry: %s", e)
                self._registered = time.monotonic()

    def gate_check(self) -> bool:
        """Refresh the gate's gauge and health detail; True while a gate failure holds."""
        snap = self.log.snapshot()
        held = False
        if snap is not None:
            state = self.servicer.windows.rollout.state()
            # this rank's gate, or another rank's failure in the model's release state: the
            # hold is model-wide, and so are the probe and the gauge on every rank
            held = (
                self.servicer.windows.gate_cap(state, snap.generation) is not None
                or gate_open(state, snap.generation) is not None
            )
            self.metrics.gate_held.set(1 if held else 0)
            self.metrics.rollout_held.set(1 if state.held else 0)
            self.metrics.release_step.set(-1 if state.release_step is None else state.release_step)
        if not self._stop.is_set():
            self.health.set_gate_held(held)
        return held

    def forget_idle(self) -> list[str]:
        """One forget sweep: consumers silent past ``forget_after_s`` (every rank's Redis
        state), then this rank's owed files that no cursor or pull refers to any more."""
        cfg = self.config
        snap = self.log.snapshot()
        # (ranks registered for this generation or the one before: a world that shrank
        # leaves cursors on the ranks it lost; an entry of anything else counts for nothing)
        gens = {x.generation for x in (snap, self.log.previous()) if x is not None}
        registered = [r for r, e in self.store.ranks().items() if e.get("generation") in gens]
        world = max(
            snap.manifest.world_size if snap is not None else 1,
            max(registered, default=0) + 1,
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
