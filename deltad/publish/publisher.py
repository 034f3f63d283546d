"""The trainer-side publisher: at each step boundary, the tracker's touched rows become a segment.

Call :meth:`SegmentPublisher.start` once before training (writes the generation manifest and
the **base** segment), :meth:`SegmentPublisher.maybe_publish` right after every optimizer
step, and :meth:`SegmentPublisher.close` at the end. Every rank runs the same calls; the
publish decision is identical on all ranks and needs no collective on a step that does not
publish (:mod:`deltad.publish.schedule`, time-based publishing included); each publish
all-reduces one small tensor (:mod:`deltad.publish.ranks`), so that a segment that failed to
write on any rank raises on all of them together (and, time-based, to agree on the next
publish's step). That all-reduce is waited for at the next call, a training step later
(:meth:`SegmentPublisher._settle`): the loop does not wait in it for a slower rank. With
background copies and gloo the copier issues it, on a process group of the publisher's own
(:meth:`deltad.publish.ranks.RankGroup.open_side_group`); otherwise the publish does.

The data path of one publish: drain the tracker (the cut) and, on rank 0, take the dense
state (:mod:`deltad.publish.dense`) in the loop; take the managed-collision identities and
copy the rows (:mod:`deltad.publish.copier`); write the segment (:mod:`deltad.publish.writer`).

What the training loop pays, per segment
----------------------------------------
* **CPU weights** (``PublisherConfig.copy_in_background``, the default): only the drain, a
  swap of the tracker's bitmaps (queued behind the tracker's fold thread). A *copier* thread
  then issues the all-reduce, reads the ids out of the drained bitmaps and copies the rows
  while the next step's forward runs. The cut stays consistent because nothing may
  update a tracked row before that copy is done: the tracker runs
  :meth:`SegmentPublisher.wait_copied` as an update barrier in every backward, when the
  gradient of a lookup's output is ready, which is before the embedding kernel's backward
  (where the fused optimizer writes the rows) and before any optimizer step. In the plain
  loop and TrainPipelineBase/SparseDist the next forward runs first, so the barrier rarely
  waits. TrainPipelineFusedSparseDist and TrainPipelineSemiSync run the *lookup* of batch
  N+1 before step N's update, but the writes of step N+1 still happen in a backward after
  this publish: a lookup's hook is registered at lookup time and checks for a pending copy
  when its backward runs, so the barrier holds there too (those pipelines need a GPU, where
  the copy is asynchronous on the device stream anyway).
* **Managed-collision tables** (see :mod:`deltad.publish.mc`): eviction rewrites rows in the
  *forward* (the MC module's compute), and the slot -> raw id maps change there too, so the
  tracker runs the same barrier at the start of each MC compute as well. Their rows are
  copied like any other, and their slots' identities (a copy of each MC shard's slot -> raw
  id map, diffed against the last one) are taken by the copier before it copies; without
  background copies, in the loop at the publish call.
* **Device weights**, or a tracker without update barriers: the drain and an
  ``index_select`` copy in the loop (on a GPU: a gather on the device and an asynchronous
  copy into pinned buffers).
* **Dense state** (rank 0, ``PublisherConfig.publish_dense``): one clone in the loop.

Either way a background *writer* thread checksums and writes the file (bounded queue, so a
slow disk blocks the loop instead of piling up copies). A write that fails never stops
training: the rank publishes a fresh base once it can (see :meth:`SegmentPublisher.publish`).
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deltad.config import PublisherConfig, TrackerConfig, clip
from deltad.errors import ConfigError, SpoolError
from deltad.publish.copier import CopierThread, CopyRequest, RowCopier, pack
from deltad.publish.dense import DenseCapture
from deltad.publish.generation import open_generation
from deltad.publish.mc import SlotIdentities
from deltad.publish.ranks import PendingMax, RankGroup
from deltad.publish.schedule import PublishSchedule, RebaseSchedule
from deltad.publish.shards import TrackedShard
from deltad.publish.stats import PublisherStats, SegmentStats
from deltad.publish.tracker import DeltaTracker
from deltad.publish.writer import SegmentWriter
from deltad.segment.spool import SpoolLayout
from deltad.types import SegmentKind

__all__ = ["PublisherStats", "SegmentPublisher", "SegmentStats"]

#: the largest step a segment holds (a signed 64-bit integer)
_MAX_STEP = (1 << 63) - 1


class SegmentPublisher:
    """Publishes one rank's segments: base at :meth:`start`, deltas, a final one at close.

    ``tracker`` defaults to a :class:`DeltaTracker` attached to ``model`` with the config's
    ``train_loop`` and ``fqns_to_skip``; one passed in must track that same train loop.
    ``process_group`` is the group the ranks agree in (default: the world group, if
    torch.distributed is up).
    """

    def __init__(
        self,
        model: nn.Module,
        config: PublisherConfig,
        *,
        tracker: DeltaTracker | None = None,
        process_group: Any = None,
    ) -> None:
        if not isinstance(config, PublisherConfig):
            raise ConfigError(
                f"SegmentPublisher(model, config, *, tracker=None): config must be a "
                f"PublisherConfig, not {type(config).__name__}"
            )
        self.config = config
        self.model = model
        #: the publisher attached the tracker itself, so close() detaches it (one passed in
        #: is the caller's to detach)
        self._owns_tracker = tracker is None
        if tracker is None:
            tracker = DeltaTracker(
                model, TrackerConfig(train_loop=config.train_loop, fqns_to_skip=config.fqns_to_skip)
            )
        loop = getattr(getattr(tracker, "config", None), "train_loop", config.train_loop)
        if loop is not config.train_loop:
            raise ConfigError(
                f"the tracker tracks train loop {loop.value}, the publisher config says "
                f"{config.train_loop.value}: set PublisherConfig.train_loop"
            )
        self.tracker = tracker
        self.layout = SpoolLayout(config.spool_dir, config.model)
        self.stats = PublisherStats()
        self._ranks = RankGroup(process_group, self.stats)
        self.rank = self._ranks.rank
        self.world_size = self._ranks.world_size
        self.generation: int | None = None
        self._seq = 0
        #: the highest step given so far (start, maybe_publish, publish): steps never decrease
        self._last_step = 0
        self._schedule = PublishSchedule(config.every_steps, config.every_seconds, self.rank)
        self._rebase = RebaseSchedule(self.layout, self.rank, config.rebase_retry_s)
        self._agree_s = 0.0  # the last publish's all-reduce (SegmentStats.agree_s)
        #: the last publish's all-reduce, waited for at the next call (:meth:`_settle`)
        self._agreement: _Agreement | None = None
        self._dense = DenseCapture(model, tracker, config, self.rank)
        self._closed = False
        self._final = False
        self._rows = RowCopier()
        self._writer = SegmentWriter(config, self.rank, self.world_size, self.stats)
        # Background copies (see the module docstring): drains go to the copier thread,
        # which hands the jobs it packed to the writer, in order.
        self._copier: CopierThread | None = None

    # -- public API -------------------------------------------------------------------------

    def start(self, step: int = 0) -> int:
        """Choose the generation, write its manifest and this rank's base segment.

        The generation is larger than every one already in the spool: ``config.generation``
        if it is (else SpoolError on every rank, the spool untouched), or by default a
        time-based id (``time.time_ns()``, or the newest + 1 if that is larger); see
        :func:`deltad.publish.generation.open_generation`.
        """
        if self.generation is not None:
            raise SpoolError("publisher already started")
        if self._closed:
            raise SpoolError("publisher is closed")
        self._last_step = 0
        self._check_step(step)
        gen = open_generation(
            self._ranks, self.layout, self.config, step=step, tables=self.tracker.tables
        )
        self.generation = self._writer.generation = gen
        # The base is written synchronously, straight from the weights (training has not
        # started, so no copy is needed); every rank agrees it succeeded before training.
        self.tracker.drain()  # the base holds every row; earlier lookups are covered
        self.tracker.flush_caches()  # rows a device cache holds, into the weights read below
        t0 = time.perf_counter()
        shards = self.tracker.shards
        stats = self._reserve(step, SegmentKind.BASE)
        values = [s.weight.detach() for s in shards]
        job = pack(stats, shards, _all_rows(shards), values, self._identities(), base=True)
        job.dense = self._take_dense(stats, force=True)
        job.stats.stall_s = time.perf_counter() - t0
        self._writer.write(job)
        failed = self._writer.error
        if failed is None and self._writer.write_failed:
            failed = SpoolError(f"writing the base segment failed: {self.stats.last_write_error}")
        self._ranks.agree(failed, "writing the base segment")
        self._schedule.started(step)
        self._writer.start()
        background = self._copies_in_background()
        # with a side group, the copier issues each publish's all-reduce (see publish)
        self._ranks.open_side_group(wanted=background)
        if background:
            self._copier = CopierThread(self._rows, self._writer)
            self.tracker.add_update_barrier(self.wait_copied, armed=self._copier.copying)
        return gen

    def _copies_in_background(self) -> bool:
        """Background copies need CPU weights (a device gather is asynchronous already) and a
        tracker that can hold back weight updates until a copy is done."""
        return (
            self.config.copy_in_background
            and hasattr(self.tracker, "add_update_barrier")
            and hasattr(self.tracker, "drain_deferred")
            and all(s.weight.device.type == "cpu" for s in self.tracker.shards)
        )

    def wait_copied(self) -> None:
        """Block until every row copy started so far has read the weights.

        The tracker calls it in each backward before any tracked row is updated, when that
        backward's forward found a copy in flight (``CopierThread.copying``). Call it
        yourself before writing embedding weights outside a backward pass (a checkpoint
        load, a manual edit) while the publisher runs; a no-op without background copies.
        """
        waited = self._copier.wait() if self._copier is not None else 0.0
        if waited:
            self.stats.barrier_wait_s += waited
            self.stats.barrier_waits += 1

    def dense_tensors(self) -> dict[str, torch.Tensor]:
        """The model's dense parameters and buffers (live, not copies), named as in the
        unwrapped model's ``state_dict`` (see :meth:`deltad.publish.dense.DenseCapture.tensors`)."""
        return self._dense.tensors()

    def maybe_publish(self, step: int) -> SegmentStats | None:
        """Publish a delta segment if one is due at this step; call after every optimizer step.

        ``step`` is an int, not below the step of the previous call (the same step again
        publishes nothing new); ConfigError otherwise, before anything is written."""
        self._check_open()
        # the common case in two comparisons (this runs every training step)
        if type(step) is not int or not self._last_step <= step <= _MAX_STEP:
            step = self._check_step(step)
        self._last_step = step
        t0 = time.perf_counter()
        self.stats.calls += 1
        self._settle()  # the previous publish's agreement: the next step is known from here
        due = self._schedule.due(step)
        self.stats.decide_s += time.perf_counter() - t0
        return self.publish(step) if due else None

    def publish(self, step: int) -> SegmentStats:
        """Drain the tracker and publish the touched rows as the next delta segment now.

        Every rank must call it at the same step (each writes its own segment). A segment
        that failed to write (spool full, I/O error) does not stop training: it is counted
        (``stats.write_errors``) and logged, later deltas of the rank are dropped, and a
        publish at most every ``rebase_retry_s`` writes a fresh base of the rank instead
        (rank-local, no collective), which covers every row; so does a sidecar's
        ``rebase.request``. Any other failure (the writer's or the copier's) raises
        SpoolError on every rank at once, at the publisher's next call (the next
        ``maybe_publish``, ``publish`` or ``close``): see :meth:`_settle`.

        ``step`` is an int, not below the step of any earlier call; ConfigError otherwise,
        before anything is written.
        """
        self._check_open()
        step = self._check_step(step)
        t0 = time.perf_counter()
        self._settle()
        # The previous copy is long done unless the writer is behind (backpressure); a wait
        # here is part of this publish's stall. Its failure goes into this publish's
        # agreement (raised on every rank at the next call), not one publish later.
        if self._copier is not None:
            self._copier.wait()
        error = None
        if self._writer.error is not None:
            error = SpoolError(f"writing a segment failed: {self._writer.error}")
            error.__cause__ = self._writer.error
        elif self._copier is not None and not self._copier.alive():
            error = SpoolError("the publisher's copier thread stopped")
        # One all-reduce, waited for at the next call: any rank failed, and (time-based)
        # rank 0's next publish step. With a copier and a side group (gloo), the copier
        # issues it, first thing for this segment, off the loop; else it is issued now.
        a0 = time.perf_counter()
        pending = self._ranks.all_reduce_max_later(
            1 if error else 0, self._schedule.predict_next(step)
        )
        self._agree_s = time.perf_counter() - a0
        stats = self._publish_now(step, t0, pending)
        self._agreement = _Agreement(pending, error, stats)
        return stats

    def _settle(self) -> float:
        """Wait for the last publish's all-reduce, take the agreed next step, and raise if
        any rank failed.

        The all-reduce is issued at the publish and waited for here, at the publisher's next
        call, so the loop never waits in it for a slower rank: by then every rank has gone
        through a whole training step (whose own collectives every rank joins after its
        publish), so the result is in. A rank that found a failure at that publish still
        published (a dead copier or writer drops the segment, harmlessly) and trained one
        more step with the others; every rank raises here together, so none is left alone
        in the trainer's next collective. The wait is added to the publish's ``agree_s``
        and returned; the caller's own clock counts it on the loop (``decide_s`` in
        ``maybe_publish``, ``stall_s`` in ``publish``).
        """
        agreement, self._agreement = self._agreement, None
        if agreement is None:
            return 0.0
        t0 = time.perf_counter()
        failed, nxt = agreement.pending.result()
        waited = time.perf_counter() - t0
        agreement.stats.agree_s += waited
        if failed:
            if agreement.error is not None:
                raise agreement.error
            raise SpoolError("writing a segment failed on another rank")
        self._schedule.agreed(nxt)
        return waited

    def _publish_now(self, step: int, t0: float, pending: PendingMax) -> SegmentStats:
        """The publish itself: a fresh base if one is owed, else a delta of the drained rows.
        ``pending`` (its all-reduce) is handed to the copier, which issues it."""
        assert self.generation is not None
        if self._rebase.due(self.generation, self._writer.write_failed):
            return self._publish_base(step, t0, pending)
        if self._copier is not None:
            stats = self._reserve(step, SegmentKind.DELTA)
            dense = self._take_dense(stats, force=self._final)
            # The drain last, at the same cut (nothing between changes the model): it wakes
            # the fold thread, whose Python work would contend for the GIL with the loop's.
            deferred = self.tracker.drain_deferred()
            # From here on, backward passes and MC computes wait for the copy: the MC
            # shards' identities are taken by the copier too, at this same cut (an MC
            # compute, where the slot maps change, waits for the copy first).
            self._copier.submit(
                CopyRequest(
                    deferred, stats, dense, take_identities=self._identities, before=pending.issue
                )
            )
            stats.stall_s = time.perf_counter() - t0
            return stats
        drained = self.tracker.drain()
        identities = self._identities()
        self.tracker.flush_caches()  # UVM-caching kernels: cached rows into the weights first
        stats = self._reserve(step, SegmentKind.DELTA)
        dense = self._take_dense(stats, force=self._final)
        job = self._rows.copy_job(drained, stats, identities)
        job.dense = dense
        self._writer.put(job)  # blocks while max_pending_writes segments wait (backpressure)
        stats.stall_s = time.perf_counter() - t0
        return stats

    def _publish_base(self, step: int, t0: float, pending: PendingMax) -> SegmentStats:
        """A fresh base of this rank's shards now (rank-local: no collective). It covers every
        segment before it, so the sidecar serves from it and drops those."""
        self._rebase.taken()
        self.stats.rebases += 1
        deferred = None
        if self._copier is not None:
            deferred = self.tracker.drain_deferred()  # resolved (and dropped) by the copier
        else:
            self.tracker.drain()
            self.tracker.flush_caches()
        identities = self._identities()
        shards = self.tracker.shards
        values = [s.weight.detach().clone() for s in shards]
        stats = self._reserve(step, SegmentKind.BASE)
        job = pack(stats, shards, _all_rows(shards), values, identities, base=True)
        job.dense = self._take_dense(stats, force=True)  # a base carries the dense state too
        if self._copier is not None:
            self._copier.submit(CopyRequest(deferred, stats, job=job, before=pending.issue))
        else:
            self._writer.put(job)
        stats.stall_s = time.perf_counter() - t0
        return stats

    def close(self, step: int) -> None:
        """Publish a final segment at ``step``, wait for every write, stop the writer, and
        detach the tracker the publisher attached (not one passed in), so the model can get
        a new publisher. ``step`` is an int, not below the step of any earlier call
        (ConfigError otherwise, before anything is written; the publisher stays open).
        Closing again, or a publisher never started, only detaches (no segment)."""
        if self._closed or self.generation is None:
            self._closed = True
            self._detach()
            return
        step = self._check_step(step)
        try:
            self._close(step)
        finally:
            self._detach()  # the last drain is done: nothing needs the hooks any more

    def _close(self, step: int) -> None:
        try:
            self._final = True  # the last segment always carries the dense state
            self.publish(step)
            # its failure, if any, is raised here on every rank
            self.stats.decide_s += self._settle()
        finally:
            self._closed = True
            if self._copier is not None:  # its last jobs reach the writer before it stops
                self._copier.stop()
                self.tracker.remove_update_barrier(self.wait_copied)
            self._writer.stop()
            self._rows.clear()
            self._ranks.close()  # its last all-reduce was waited for by _settle above
        if self._writer.error is not None:
            err = self._writer.error
            raise SpoolError(f"writing a segment failed: {err}") from err
        if self._writer.write_failed:  # a last try, synchronously, in case there is room now
            self._publish_base_now(step)
            if self._writer.write_failed:
                raise SpoolError(
                    f"rank {self.rank}: the spool stayed unwritable, the rows since the last "
                    f"written segment are not published: {self.stats.last_write_error}"
                )

    def _detach(self) -> None:
        """Remove the hooks of the tracker the publisher attached (idempotent)."""
        if self._owns_tracker:
            self._owns_tracker = False
            self.tracker.detach()

    # -- internals --------------------------------------------------------------------------

    def _publish_base_now(self, step: int) -> None:
        """A fresh base written synchronously, straight from the weights (at close)."""
        self.tracker.drain()
        identities = self._identities()
        shards = self.tracker.shards
        stats = self._reserve(step, SegmentKind.BASE)
        self.stats.rebases += 1
        values = [s.weight.detach() for s in shards]
        self._writer.write(pack(stats, shards, _all_rows(shards), values, identities, base=True))

    def _identities(self) -> dict[TrackedShard, SlotIdentities]:
        """The MC shards' identities at this cut (the tracker's, if it keeps any)."""
        take = getattr(self.tracker, "take_identities", None)
        return take() if take is not None else {}

    def _take_dense(self, stats: SegmentStats, *, force: bool) -> dict[str, torch.Tensor] | None:
        """Rank 0: a copy of the dense state now (this segment's cut) if one is due."""
        dense = self._dense.take(stats, force=force)
        if dense is not None:
            assert self.generation is not None
            stats.dense_path = self.layout.dense_path(self.generation, self.rank, stats.seq)
        return dense

    def _check_step(self, step: object) -> int:
        """``step`` as an int if it is one (not a bool), in 0..2**63-1 and not below the last
        step given, which it becomes; else ConfigError (a float step would be written into a
        segment the sidecar refuses, a step going back would stall the consumers)."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise ConfigError(
                f"step must be an int (the trainer's step count), not {clip(step, 32)} "
                f"({type(step).__name__})"
            )
        value = int(step)
        if not 0 <= value <= _MAX_STEP:
            raise ConfigError(f"step must be in 0..{_MAX_STEP}, not {value}")
        if value < self._last_step:
            raise ConfigError(
                f"step {value} is below the last step given ({self._last_step}): steps must "
                "not decrease"
            )
        self._last_step = value
        return value

    def _check_open(self) -> None:
        if self.generation is None:
            raise SpoolError("publisher not started: call start(step) first")
        if self._closed:
            raise SpoolError("publisher is closed")

    def _reserve(self, step: int, kind: SegmentKind) -> SegmentStats:
        """Assign the next segment's seq and path (in the loop, so seqs follow publishes)."""
        assert self.generation is not None
        seq = self._seq
        stats = SegmentStats(
            seq=seq,
            step=step,
            kind=kind,
            rows=0,
            nbytes=0,
            stall_s=0.0,
            path=self.layout.segment_path(self.generation, self.rank, seq),
        )
        stats.agree_s, self._agree_s = self._agree_s, 0.0
        self._seq += 1
        self._schedule.segment(step)
        self.stats.segments.append(stats)
        return stats


@dataclass
class _Agreement:
    """A publish's all-reduce in flight: this rank's own failure, and the segment it was for."""

    pending: PendingMax
    error: SpoolError | None
    stats: SegmentStats


def _all_rows(shards: list[TrackedShard]) -> list[torch.Tensor]:
    """Every global row id of each shard (a base lists them all)."""
    return [torch.arange(s.shard.row_start, s.shard.row_end, dtype=torch.int64) for s in shards]
