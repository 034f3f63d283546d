"""Where a decided window comes from: a generation diff, a rollback, the window cache, a build."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from deltad.config import ServerConfig
from deltad.errors import SpoolError
from deltad.serve.index.log import LogSnapshot, SegmentLog
from deltad.serve.index.runs import RunCache
from deltad.serve.index.spill import SpillStore
from deltad.serve.metrics import SidecarMetrics
from deltad.serve.state.owed import OwedStore
from deltad.serve.windows.cache import WindowCache
from deltad.serve.windows.decide import WindowDecision
from deltad.serve.windows.encoded import EncodedWindow
from deltad.serve.windows.gendiff import GenerationDiffs
from deltad.serve.windows.packed import PackedStore
from deltad.serve.windows.plan import build_window
from deltad.serve.windows.rollback import RollbackWindows
from deltad.serve.windows.spec import WindowSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourcedWindow:
    """The window that serves a decision, and what it took."""

    win: EncodedWindow
    #: from a cache (this pull merged nothing)
    hit: bool
    #: the decision as served: a lost owed file or a rollback that cannot be made resyncs
    decision: WindowDecision
    spec: WindowSpec


class WindowSource:
    """The windows of one rank's log and the caches they come from: the window cache, pre-merged
    runs, packed rows, the spilled base, generation diffs and rollback windows."""

    def __init__(
        self, config: ServerConfig, seglog: SegmentLog, owed: OwedStore, metrics: SidecarMetrics
    ) -> None:
        self.owed = owed
        self.cache = WindowCache(config.window_cache_entries, config.window_cache_bytes)
        self.runs = RunCache(config.run_cache_bytes)
        self.packed = PackedStore(config.packed_cache_bytes)
        self.gendiff = GenerationDiffs(seglog, owed, metrics, self.cache)
        # bootstraps bigger than the window cache start from a spilled merged base
        self.spill = SpillStore(seglog.layout.model_dir / ".spill", config.spill_max_bytes)
        self.rollbacks = RollbackWindows(self.cache)

    def window(
        self, consumer: str, snap: LogSnapshot, shape: WindowSpec, decision: WindowDecision
    ) -> SourcedWindow:
        """The window of ``decision`` over ``snap`` for ``consumer`` (``shape``: the request's
        form, tables and limits), loading the rows owed to it. Planned only: its chunks are
        merged and encoded as the stream reads them (see build_window)."""
        gen = snap.generation
        diff, diff_hit, decision = self.gendiff.window(consumer, snap, shape, decision)
        owed = {}
        if decision.rollback_to is not None and not decision.resync:
            try:
                if decision.owed_token:
                    owed = self.owed.load(consumer, decision.owed_token, gen)
                diff, diff_hit = self.rollbacks.window(snap, shape, decision, owed)
                owed = {}
            except SpoolError as e:
                log.warning("%s: rollback from the base: %s", consumer, e)
                decision = decision.resynced(f"rollback to step {decision.rollback_to}: {e}")
        if decision.owed_token and diff is None:
            try:
                owed = self.owed.load(consumer, decision.owed_token, gen)
            except SpoolError as e:
                # The rows owed to it are unknown (file lost or corrupt): the consumer
                # gets the full tables again, never a window missing them.
                log.warning("%s: resync from the base: %s", consumer, e)
                decision = decision.resynced("owed rows lost")
        to_step = decision.to_step
        spec = replace(
            shape, resync=decision.resync, from_seq=decision.from_seq, to_seq=decision.to_seq
        )
        # (a base window that the window cache cannot keep: from the spilled base)
        spill = self.spill if spec.resync and snap.base.nbytes > self.cache.max_bytes else None
        if diff is not None:
            win, hit = diff, diff_hit
        elif owed:
            win, hit = (
                build_window(
                    snap, spec, to_step, owed, kept=False, runs=self.runs, packed=self.packed
                ),
                False,
            )
        else:
            win, hit = self.cache.get(
                spec,
                lambda kept: build_window(
                    snap,
                    spec,
                    to_step,
                    {},
                    kept=kept,
                    runs=self.runs,
                    spill=spill,
                    packed=self.packed,
                ),
            )
        return SourcedWindow(win, hit, decision, spec)
