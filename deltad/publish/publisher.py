"""The trainer-side publisher: turns the tracker's touched rows into segments in the spool.

Call :meth:`SegmentPublisher.start` once before training (writes the generation manifest and
the **base** segment), :meth:`SegmentPublisher.maybe_publish` right after every optimizer
step, and :meth:`SegmentPublisher.close` at the end. Every rank runs the same calls; the
publish decision is identical on all ranks and needs no collective on a step that does not
publish; each publish all-reduces one small tensor, so that a segment that failed to write on
any rank raises on all of them together (and, time-based, to agree on the next publish's step).

Time-based publishing (``every_seconds``) off the step
------------------------------------------------------
The ranks agree *in advance* on the step of the next time-based publish: at each publish, rank
0 predicts it from its measured step time (the steps since the previous publish over the
seconds they took: the first step at which ``every_seconds`` will have passed), and the value
rides the publish's own all-reduce (``[failed, next step]``, MAX; the other ranks send -1).
``maybe_publish(step)`` is then ``step >= next`` on every rank: a pure function of the step,
like ``every_steps``, so uneven step times across ranks cannot make them disagree, and no step
that does not publish issues a collective. The first time-based publish after :meth:`start`
comes at the first step (nothing is measured yet); each publish re-measures, so a change of
pace is followed one interval later. A loop that slows down after a prediction publishes
late by that much (bound it with ``every_steps`` as well; both set: whichever comes first).

Where the publish runs does not change (the same ``maybe_publish(step)`` call after step
``step``'s optimizer step), so the drain point stays what it is for step-based publishing
under every pipeline: the plain loop and TrainPipelineBase/SparseDist (run here) call it
between steps; TrainPipelineFusedSparseDist and TrainPipelineSemiSync (GPU only) have already
started batch ``step + 1``'s lookup there, but its row writes happen in a backward after this
call, behind the update barrier (below). Only *whether* a step publishes is decided
differently, and deciding it earlier (at the previous publish) instead of at the call changes
no cut: the publish at step ``n`` is the same drain at the same point, and every rank drains
at the same ``n`` (previously a per-step all-reduce made that so; now the agreed ``n`` does).

What the training loop pays, per segment
----------------------------------------
* **CPU weights** (``PublisherConfig.copy_in_background``, the default): only the error
  all-reduce and the drain, a swap of the tracker's bitmaps (queued behind the tracker's fold
  thread). A *copier* thread then reads the ids out of the drained bitmaps and copies the rows (``index_select`` into pooled buffers) while the next step's
  forward runs. The cut stays consistent because nothing may update a tracked row before
  that copy is done: the tracker runs :meth:`SegmentPublisher.wait_copied` as an update
  barrier in every backward, when the gradient of a lookup's output is ready, which is
  before the embedding kernel's backward (where the fused optimizer writes the rows) and
  before any optimizer step. In the plain loop and TrainPipelineBase/SparseDist the next
  forward runs first, so the barrier rarely waits. TrainPipelineFusedSparseDist and
  TrainPipelineSemiSync run the *lookup* of batch N+1 before step N's update, but the
  writes of step N+1 still happen in a backward after this publish: a lookup's hook is
  registered at lookup time and checks for a pending copy when its backward runs, so the
  barrier holds there too (those pipelines need a GPU, where the copy is asynchronous on
  the device stream anyway).
* **Managed-collision tables** (see :mod:`deltad.publish.mc`): their slots' identities are
  taken in the loop at the publish call (a copy of each MC shard's slot -> raw id map,
  diffed against the last one); their rows are copied like any other, but eviction rewrites
  rows in the *forward* (the MC module's compute), so the tracker runs the same barrier at
  the start of each MC compute as well.
* **Device weights**, or a tracker without update barriers: the drain and an
  ``index_select`` copy in the loop (on a GPU: a gather on the device and an asynchronous
  copy into pinned buffers).

Either way a background *writer* thread checksums and writes the file (bounded queue, so a
slow disk blocks the loop instead of piling up copies).

Dense state (``PublisherConfig.publish_dense``)
-----------------------------------------------
Rank 0 also writes the model's dense parameters and buffers (everything outside the tracked
sharded EC / EBC modules, named as in the unwrapped model's ``state_dict``: DMP / DDP
prefixes removed) as ``dense-<seq>`` next to its segment ``seq`` of the same step, *before*
that segment (a sidecar that sees segment ``seq`` finds its dense state). They are cloned in
the loop at the publish call, which is the segment's cut: ``maybe_publish(step)`` runs after
step ``step``'s optimizer step (dense parameters are written there, synchronously, and the
fused optimizer wrote the rows in that step's backward) and before step ``step + 1``'s
forward. The clone cannot be left to the copier thread behind the update barrier: the
barrier guards only the backward, and a forward may write dense state (BatchNorm running
statistics are buffers updated in the forward). Replicated (DDP) parameters are equal on
every rank after the step, so rank 0's copy is the model's. The cost is one memcpy of the
dense state per dense publish (``SegmentStats.dense_s``); encoding and writing happen in the
writer thread.
slow disk blocks the loop instead of piling up copies). A write that fails never stops
training: the rank publishes a fresh base once it can (see :meth:`SegmentPublisher.publish`).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deltad import knobs
from deltad.buffers import BufferPool
from deltad.config import PublisherConfig, TrackerConfig
from deltad.errors import ConfigError, SpoolError
from deltad.publish.mc import SlotIdentities, managed_collision_types, union_sorted
from deltad.publish.tracker import (
    DeltaTracker,
    DrainedRows,
    TrackedShard,
    _sharded_types,
    clean_fqn,
)
from deltad.segment.format import ShardRows, encode_dense, write_dense, write_segment
from deltad.segment.spool import GenerationManifest, SpoolLayout
from deltad.types import SegmentKind

log = logging.getLogger(__name__)


def _sharded_tensor_types() -> tuple[type, ...]:
    """Tensor types that hold one shard of a sharded tensor (never dense state)."""
    types: list[type] = []
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        types.append(ShardedTensor)
    except ImportError:
        pass
    try:
        from torch.distributed.tensor import DTensor

        types.append(DTensor)
    except ImportError:
        pass
    return tuple(types)


#: The largest generation id: generations travel as int64 (collectives, segment headers).
_MAX_GENERATION = 2**63 - 1


@dataclass
class SegmentStats:
    """What one segment cost. ``stall_s`` is time the training loop spent; ``write_s`` not."""

    seq: int
    step: int
    kind: SegmentKind
    rows: int
    nbytes: int
    stall_s: float  # in the loop: the error all-reduce, drain (+ copy and waiting for a
    # write slot if not copied in the background)
    write_s: float = 0.0  # in the writer thread (filled in when written)
    write_cpu_s: float = 0.0  # CPU time of the writer thread on it (checksum, write, fsync)
    path: Path | None = None
    #: In the copier thread (background copies only; ``rows`` / ``nbytes`` are filled in
    #: then too): reading the drained ids and copying the rows, wall and CPU seconds.
    copy_s: float = 0.0
    copy_cpu_s: float = 0.0
    #: Rank 0: the dense state taken with this segment (bytes of its tensors; 0 for none),
    #: the loop's time cloning it (part of ``stall_s``) and its file.
    dense_bytes: int = 0
    dense_s: float = 0.0
    dense_path: Path | None = None
    #: Of ``stall_s``: the publish's all-reduce (the failure flag and the next time-based
    #: publish's step), mostly waiting for the slowest rank to reach it.
    agree_s: float = 0.0


@dataclass
class PublisherStats:
    """Totals over a publisher's life, for benchmarks."""

    segments: list[SegmentStats] = field(default_factory=list)
    #: Time spent deciding whether to publish (a comparison with the agreed step: no
    #: collective; the next step is agreed inside the publish, counted in its ``stall_s``).
    decide_s: float = 0.0
    calls: int = 0
    #: Collectives the publisher issued (all-reduces and broadcasts), all in the loop: at
    #: start, and one per publish; none on a step that does not publish.
    collectives: int = 0
    #: Time backward passes waited at the update barrier for a background copy, and how
    #: many of them had to wait.
    barrier_wait_s: float = 0.0
    barrier_waits: int = 0
    #: Segment writes that failed (spool full, I/O error); training went on, the rows stayed
    #: owed to a fresh base. ``last_write_error`` says why.
    write_errors: int = 0
    last_write_error: str = ""
    #: Deltas not written because an earlier write failed (a fresh base covers their rows).
    skipped_segments: int = 0
    #: Fresh bases published after a failed write or at a sidecar's request.
    rebases: int = 0

    @property
    def stall_s(self) -> float:
        """Everything the training loop spent on publishing."""
        return self.decide_s + self.barrier_wait_s + sum(s.stall_s for s in self.segments)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @property
    def dense_bytes(self) -> int:
        return sum(s.dense_bytes for s in self.segments)

    @property
    def write_s(self) -> float:
        return sum(s.write_s for s in self.segments)

    @property
    def write_cpu_s(self) -> float:
        return sum(s.write_cpu_s for s in self.segments)


@dataclass
class _CopyRequest:
    """A drain waiting for the copier thread: its rows are read out and copied there."""

    drained: DrainedRows | None
    stats: SegmentStats
    dense: dict[str, torch.Tensor] | None = None
    #: A job already packed (a fresh base): forwarded to the writer in order.
    job: _Job | None = None
    #: Managed-collision shards' identities, taken in the loop at the segment's cut.
    identities: dict[TrackedShard, SlotIdentities] = field(default_factory=dict)


@dataclass
class _Job:
    """A segment for the writer: its reserved stats (seq, step, kind, path) and its rows."""

    stats: SegmentStats
    shards: list[ShardRows]
    ready: Any = None  # a CUDA event to wait for before reading device-to-host copies
    #: rank 0: the dense state cloned at this segment's cut, written before the segment
    dense: dict[str, torch.Tensor] | None = None


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
        self._pg = process_group
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self._distributed else 0
        self.world_size = dist.get_world_size(process_group) if self._distributed else 1
        self._device = torch.device("cpu")
        if self._distributed and dist.get_backend(process_group) == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.generation: int | None = None
        self.stats = PublisherStats()
        self._seq = 0
        self._last_step = 0
        self._last_time = 0.0
        #: time-based publishing: the step of the next publish, agreed by every rank at the
        #: previous one (None: not started, or every_seconds is off)
        self._next_timed: int | None = None
        self._agree_s = 0.0  # the last publish's all-reduce (SegmentStats.agree_s)
        self._last_dense_step: int | None = None
        self._dense_skip: tuple[str, ...] | None = None
        self._last_dense_time = 0.0
        self._closed = False
        self._final = False
        self._error: BaseException | None = None
        # A write failed (set by the writer): deltas are skipped until a fresh base is written.
        self._write_failed = False
        self._last_rebase = -float("inf")
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=config.max_pending_writes)
        # Touched-row copies (see deltad.buffers): a job's buffers are referenced by the job
        # until its segment is written, so one still queued is never handed out again.
        self._pool = BufferPool(
            max_bytes=knobs.COPY_POOL_MAX_BYTES,
            min_bytes=0,
            granule=knobs.COPY_POOL_GRANULE,
            headroom=knobs.COPY_POOL_HEADROOM,
        )
        self._thread: threading.Thread | None = None
        # Background copies (see the module docstring): requests go to the copier thread,
        # which hands the jobs it packed to the writer, in order.
        self._copy_queue: queue.Queue[_CopyRequest | None] = queue.Queue()
        self._copier: threading.Thread | None = None
        self._copies = threading.Condition()
        self._copies_submitted = 0
        self._copies_done = 0

    # -- collectives ------------------------------------------------------------------------

    def _all_reduce_max(self, value: int) -> int:
        return self._all_reduce_max_n(value)[0]

    def _all_reduce_max_n(self, *values: int) -> list[int]:
        """Element-wise MAX of ``values`` over the ranks: one all-reduce."""
        if not self._distributed:
            return list(values)
        self.stats.collectives += 1
        t = torch.tensor(values, dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._pg)
        return [int(x) for x in t.tolist()]

    def _broadcast(self, value: int) -> int:
        if not self._distributed:
            return value
        self.stats.collectives += 1
        t = torch.tensor([value], dtype=torch.int64, device=self._device)
        dist.broadcast(t, src=dist.get_global_rank(self._pg, 0) if self._pg else 0, group=self._pg)
        return int(t.item())

    def _agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank if any rank failed (so no rank hangs in a later collective)."""
        if self._all_reduce_max(1 if error else 0):
            if error is not None:
                raise error
            raise SpoolError(f"{what} failed on another rank")

    # -- public API -------------------------------------------------------------------------

    def start(self, step: int = 0) -> int:
        """Choose the generation, write its manifest and this rank's base segment.

        The generation is larger than every one already in the spool: ``config.generation``
        if it is (else SpoolError on every rank, the spool untouched), or by default a
        time-based id (``time.time_ns()``, or the newest + 1 if that is larger).
        """
        if self.generation is not None:
            raise SpoolError("publisher already started")
        error: BaseException | None = None
        try:
            self.layout.ensure_writable()
        except SpoolError as e:
            error = e
        self._agree(error, "preparing the spool")
        gen = self._choose_generation()
        # Every rank writes the manifest, the same bytes: a spool shared by all ranks gets one
        # file (atomic renames of identical content), and a spool per host (a pod per rank,
        # each with its own sidecar) gets the manifest its sidecar needs to serve the rank.
        created_ns = self._broadcast(time.time_ns())
        try:
            self.layout.write_manifest(
                GenerationManifest(
                    model=self.config.model,
                    generation=gen,
                    world_size=self.world_size,
                    start_step=step,
                    created_unix=created_ns / 1e9,
                    tables=tuple(self.tracker.tables),
                ),
                fsync=self.config.fsync,
            )
        except SpoolError as e:
            error = e
        self._agree(error, "writing the generation manifest")  # also: manifest before segments
        self.generation = gen
        # The base is written synchronously, straight from the weights (training has not
        # started, so no copy is needed); every rank agrees it succeeded before training.
        self.tracker.drain()  # the base holds every row; earlier lookups are covered
        self.tracker.flush_caches()  # rows a device cache holds, into the weights read below
        t0 = time.perf_counter()
        shards = self.tracker.shards
        ids = [torch.arange(s.shard.row_start, s.shard.row_end, dtype=torch.int64) for s in shards]
        stats = self._reserve(step, SegmentKind.BASE)
        job = self._package(
            stats, shards, ids, [s.weight.detach() for s in shards], self._identities(), base=True
        )
        job.dense = self._take_dense(stats, force=True)
        job.stats.stall_s = time.perf_counter() - t0
        self._write(job)
        failed = self._error
        if failed is None and self._write_failed:
            failed = SpoolError(f"writing the base segment failed: {self.stats.last_write_error}")
        self._agree(failed, "writing the base segment")
        if self.config.every_seconds > 0:
            self._next_timed = step + 1  # nothing measured yet: the first step publishes
        self._thread = threading.Thread(target=self._writer, name="deltad-writer", daemon=True)
        self._thread.start()
        if self._copies_in_background():
            self.tracker.add_update_barrier(self.wait_copied)
            self._copier = threading.Thread(
                target=self._copy_loop, name="deltad-copier", daemon=True
            )
            self._copier.start()
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

        The tracker calls it in each backward before any tracked row is updated. Call it
        yourself before writing embedding weights outside a backward pass (a checkpoint
        load, a manual edit) while the publisher runs; a no-op without background copies.
        """
        waited = self._await_copies()
        if waited:
            self.stats.barrier_wait_s += waited
            self.stats.barrier_waits += 1

    def _await_copies(self) -> float:
        """Wait for every copy submitted so far; return the seconds waited (0: none)."""
        with self._copies:
            if self._copies_done >= self._copies_submitted:
                return 0.0
            t0 = time.perf_counter()
            target = self._copies_submitted
            # Bounded: the copier counts every request done, even a failed one; and if it
            # died anyway, stop waiting (the error is raised at the next publish).
            while self._copies_done < target and self._copier_alive():
                self._copies.wait(timeout=1.0)
            return time.perf_counter() - t0 or 1e-9

    def _copier_alive(self) -> bool:
        return self._copier is not None and self._copier.is_alive()

    def _choose_generation(self) -> int:
        """The new run's generation, the same on every rank, or SpoolError on every rank.

        It must be larger than every generation already in the spool: a reused id would
        overwrite that run's manifest and first segments while its later segments stay
        (two runs mixed in one log), and a smaller one is never served (the sidecar only
        switches to a larger generation). Every rank reports the largest it sees (one
        shared spool, or one per host) and all of them agree on the maximum; rank 0's
        choice (the requested id, or the clock but past that maximum) is broadcast; then
        every rank checks it against the maximum alike, so a refusal is raised on all ranks
        with the same message and none is left waiting in a collective.
        """
        requested = self.config.generation
        newest: int | None = None
        error: BaseException | None = None
        try:
            if requested is not None and not 0 <= requested <= _MAX_GENERATION:
                raise SpoolError(f"generation {requested} is out of range 0..{_MAX_GENERATION}")
            newest = max(self.layout.generations(), default=None)
            if newest is not None and newest >= _MAX_GENERATION:
                raise SpoolError(
                    f"generation {newest} in {self.layout.model_dir} leaves no larger id: "
                    "move that generation out of the spool"
                )
        except SpoolError as e:
            error = e
        self._agree(error, "choosing the generation")
        newest = self._all_reduce_max(-1 if newest is None else newest)
        gen = requested if requested is not None else max(time.time_ns(), newest + 1)
        gen = self._broadcast(gen)
        if gen <= newest:  # only a requested id can be; the same on every rank
            raise SpoolError(
                f"generation {gen} is not newer than generation {newest}, which already "
                f"exists in {self.layout.model_dir}: a restart is a new generation (reusing "
                f"an id would mix two runs in one log, a smaller one is never served); pass "
                f"generation {newest + 1} or larger (--generation), or none for a time-based "
                f"one past it"
            )
        return gen

    def maybe_publish(self, step: int) -> SegmentStats | None:
        """Publish a delta segment if one is due at this step; call after every optimizer step."""
        self._check_open()
        t0 = time.perf_counter()
        self.stats.calls += 1
        cfg = self.config
        due = cfg.every_steps > 0 and step - self._last_step >= cfg.every_steps
        if self._next_timed is not None and step >= self._next_timed:
            due = True  # the step every rank agreed on at the last publish: no collective
        self.stats.decide_s += time.perf_counter() - t0
        return self.publish(step) if due else None

    def publish(self, step: int) -> SegmentStats:
        """Drain the tracker and publish the touched rows as the next delta segment now.

        Every rank must call it at the same step (each writes its own segment). A segment
        that failed to write (spool full, I/O error) does not stop training: it is counted
        (``stats.write_errors``) and logged, later deltas of the rank are dropped, and a
        publish at most every ``rebase_retry_s`` writes a fresh base of the rank instead
        (rank-local, no collective), which covers every row; so does a sidecar's
        ``rebase.request``. Any other failure (the copier) raises SpoolError here on every
        rank at once: one all-reduce per segment, so that no rank is left waiting in the
        trainer's next collective.
        """
        self._check_open()
        t0 = time.perf_counter()
        # The previous copy is long done unless the writer is behind (backpressure); a wait
        # here is part of this publish's stall. Its failure is reported now, not one later.
        self._await_copies()
        error = None
        if self._error is not None:
            error = SpoolError(f"writing a segment failed: {self._error}")
            error.__cause__ = self._error
        elif self._copier is not None and not self._copier_alive():
            error = SpoolError("the publisher's copier thread stopped")
        # one all-reduce: any rank failed, and (time-based) rank 0's next publish step
        a0 = time.perf_counter()
        failed, nxt = self._all_reduce_max_n(1 if error else 0, self._predict_next(step))
        self._agree_s = time.perf_counter() - a0
        if failed:
            if error is not None:
                raise error
            raise SpoolError("writing a segment failed on another rank")
        if self.config.every_seconds > 0:
            self._next_timed = nxt
        if self._rebase_due():
            return self._publish_base(step, t0)
        if self._copier is not None:
            deferred = self.tracker.drain_deferred()
            identities = self._identities()
            stats = self._reserve(step, SegmentKind.DELTA)
            dense = self._take_dense(stats, force=self._final)
            with self._copies:  # from here on, backward passes (and MC computes) wait for it
                self._copies_submitted += 1
            self._copy_queue.put(_CopyRequest(deferred, stats, dense, identities=identities))
            stats.stall_s = time.perf_counter() - t0
            return stats
        drained = self.tracker.drain()
        identities = self._identities()
        self.tracker.flush_caches()  # UVM-caching kernels: cached rows into the weights first
        stats = self._reserve(step, SegmentKind.DELTA)
        dense = self._take_dense(stats, force=self._final)
        job = self._copy_job(drained, stats, identities)
        job.dense = dense
        self._queue.put(job)  # blocks while max_pending_writes segments wait (backpressure)
        stats.stall_s = time.perf_counter() - t0
        return stats

    def _predict_next(self, step: int) -> int:
        """Rank 0, time-based: the first step after ``step`` at which ``every_seconds`` will
        have passed since now, at the pace of the steps since the previous publish (the
        other ranks, or without every_seconds: -1, which the MAX ignores)."""
        every = self.config.every_seconds
        if every <= 0 or self.rank != 0:
            return -1
        steps = step - self._last_step
        elapsed = time.monotonic() - self._last_time
        if steps <= 0 or elapsed <= 0:
            return step + 1
        per_step = elapsed / steps
        return step + max(1, math.ceil(every / per_step - 1e-9))

    def _rebase_due(self) -> bool:
        """Whether this publish writes a fresh base: after a failed write, or when the
        sidecar asked for one (``rebase.request``), at most every ``rebase_retry_s``."""
        assert self.generation is not None
        request = self.layout.rebase_request_path(self.generation, self.rank)
        asked = request.exists()
        if not (asked or self._write_failed):
            return False
        if time.monotonic() - self._last_rebase < self.config.rebase_retry_s:
            return False
        if asked:
            log.warning("rank %d: the sidecar asked for a fresh base", self.rank)
            try:
                request.unlink()
            except OSError:
                pass
        return True

    def _publish_base(self, step: int, t0: float) -> SegmentStats:
        """A fresh base of this rank's shards now (rank-local: no collective). It covers every
        segment before it, so the sidecar serves from it and drops those."""
        self._last_rebase = time.monotonic()
        self.stats.rebases += 1
        deferred = None
        if self._copier is not None:
            deferred = self.tracker.drain_deferred()  # resolved (and dropped) by the copier
        else:
            self.tracker.drain()
            self.tracker.flush_caches()
        identities = self._identities()
        shards = self.tracker.shards
        ids = [torch.arange(s.shard.row_start, s.shard.row_end, dtype=torch.int64) for s in shards]
        values = [s.weight.detach().clone() for s in shards]
        stats = self._reserve(step, SegmentKind.BASE)
        job = self._package(stats, shards, ids, values, identities, base=True)
        job.dense = self._take_dense(stats, force=True)  # a base carries the dense state too
        if self._copier is not None:
            with self._copies:
                self._copies_submitted += 1
            self._copy_queue.put(_CopyRequest(deferred, stats, job=job))
        else:
            self._queue.put(job)
        stats.stall_s = time.perf_counter() - t0
        return stats

    def close(self, step: int) -> None:
        """Publish a final segment at ``step``, wait for every write, stop the writer."""
        if self._closed or self.generation is None:
            self._closed = True
            return
        try:
            self._final = True  # the last segment always carries the dense state
            self.publish(step)
        finally:
            self._closed = True
            if self._copier is not None:  # its last jobs reach the writer before the None
                self._copy_queue.put(None)
                self._copier.join()
                self.tracker.remove_update_barrier(self.wait_copied)
            self._queue.put(None)
            if self._thread is not None:
                self._thread.join()
            self._pool.clear()
        self._check_error()
        if self._write_failed:  # a last try, synchronously, in case there is room now
            self._last_rebase = -float("inf")
            self._closed = False
            self._publish_base_now(step)
            self._closed = True
            if self._write_failed:
                raise SpoolError(
                    f"rank {self.rank}: the spool stayed unwritable, the rows since the last "
                    f"written segment are not published: {self.stats.last_write_error}"
                )

    def _publish_base_now(self, step: int) -> None:
        self.tracker.drain()
        identities = self._identities()
        shards = self.tracker.shards
        ids = [torch.arange(s.shard.row_start, s.shard.row_end, dtype=torch.int64) for s in shards]
        stats = self._reserve(step, SegmentKind.BASE)
        self.stats.rebases += 1
        values = [s.weight.detach() for s in shards]
        self._write(self._package(stats, shards, ids, values, identities, base=True))

    # -- internals --------------------------------------------------------------------------

    def _identities(self) -> dict[TrackedShard, SlotIdentities]:
        """The MC shards' identities at this cut (the tracker's, if it keeps any)."""
        take = getattr(self.tracker, "take_identities", None)
        return take() if take is not None else {}

    def _copy_job(
        self,
        drained: list[tuple[TrackedShard, torch.Tensor]],
        stats: SegmentStats,
        identities: dict[TrackedShard, SlotIdentities] | None = None,
    ) -> _Job:
        """Copy the drained rows (local ids per shard) into a job for the writer. A
        managed-collision shard also owes the slots whose identity changed (and whose rows
        eviction reset) since the last segment."""
        identities = identities or {}
        drained = [
            (s, union_sorted(local, identities[s].changed) if s in identities else local)
            for s, local in drained
        ]
        shards = [s for s, _ in drained]
        ids = [local + s.shard.row_start for s, local in drained]
        values = [self._copy_rows(s, local) for s, local in drained]
        # free buffers no copy of this round used go back to the allocator
        self._pool.end_round()
        return self._package(stats, shards, ids, values, identities)

    def _copy_loop(self) -> None:
        """The copier thread: read and copy each request's rows, then queue it for the writer."""
        while (req := self._copy_queue.get()) is not None:
            job = None
            try:
                t0, c0 = time.perf_counter(), time.thread_time()
                # resolving also returns the bitmaps to the tracker
                drained = req.drained.resolve() if req.drained is not None else []
                if req.job is not None:
                    job = req.job  # a fresh base: its rows are copied already
                elif self._error is None:  # after a failure nothing more is written
                    job = self._copy_job(drained, req.stats, req.identities)
                    job.dense = req.dense
                req.stats.copy_s = time.perf_counter() - t0
                req.stats.copy_cpu_s = time.thread_time() - c0
            except BaseException as e:
                log.error("copying the rows of segment %s: %s", req.stats.seq, e)
                self._error = e
            finally:
                with self._copies:  # the weights are read: updates may go on
                    self._copies_done += 1
                    self._copies.notify_all()
            if job is not None:
                self._queue.put(job)  # blocks while the writer is behind (backpressure)

    def _copy_rows(self, shard: TrackedShard, local: torch.Tensor) -> torch.Tensor:
        """Copy rows ``local`` of the shard's weights (a pooled host buffer if configured)."""
        weight = shard.weight.detach()
        if not knobs.REUSE_COPY_BUFFERS or local.numel() == 0:
            return weight.index_select(0, local)
        # Pinned for device weights, so the copy below is a real async DMA.
        out = self._pool.take(
            (local.numel(), weight.size(1)), weight.dtype, pin_memory=weight.device.type == "cuda"
        )
        if weight.device.type == "cpu":
            torch.index_select(weight, 0, local, out=out)
        else:  # gather on the device, then an async copy into the pinned buffer (see _job)
            out.copy_(weight.index_select(0, local), non_blocking=True)
        return out

    def dense_tensors(self) -> dict[str, torch.Tensor]:
        """The model's dense parameters and buffers (live, not copies), named as in the
        unwrapped model's ``state_dict``: everything outside the tracked sharded EC / EBC
        modules, and no ShardedTensor / DTensor (those are sharded, not replicated)."""
        if self._dense_skip is None:  # the sharded modules do not change: found once
            # A sharded MC-EC / MC-EBC's own buffers (the MCH remapper, per rank) travel as
            # identities in the segments, never as (replicated) dense state.
            sharded_modules = _sharded_types() + (managed_collision_types() or ())
            self._dense_skip = tuple(
                f"{clean_fqn(fqn)}."
                for fqn, mod in self.model.named_modules()
                if isinstance(mod, sharded_modules)
            ) + tuple(f"{t.module}." for t in self.tracker.tables)
        skip = self._dense_skip
        sharded = _sharded_tensor_types()
        out: dict[str, torch.Tensor] = {}
        named = [*self.model.named_parameters(), *self.model.named_buffers()]
        for raw, t in named:
            name = clean_fqn(raw)
            if name in out or name.startswith(skip) or isinstance(t, sharded):
                continue
            out[name] = t
        return out

    def _take_dense(self, stats: SegmentStats, *, force: bool) -> dict[str, torch.Tensor] | None:
        """Rank 0: a copy of the dense state now (this segment's cut) if one is due."""
        cfg = self.config
        if not cfg.publish_dense or self.rank != 0 or not isinstance(self.model, nn.Module):
            return None
        now = time.monotonic()
        last = self._last_dense_step
        due = force or last is None or (cfg.dense_every_steps == cfg.dense_every_seconds == 0)
        due = due or (
            cfg.dense_every_steps > 0 and stats.step - (last or 0) >= cfg.dense_every_steps
        )
        due = due or (
            cfg.dense_every_seconds > 0 and now - self._last_dense_time >= cfg.dense_every_seconds
        )
        if not due:
            return None
        t0 = time.perf_counter()
        live = self.dense_tensors()
        if not live:  # nothing but embedding tables: no dense states at all
            return None
        with torch.no_grad():
            dense = {n: t.detach().to("cpu", copy=True) for n, t in live.items()}
        assert self.generation is not None
        stats.dense_s = time.perf_counter() - t0
        stats.dense_bytes = sum(t.nbytes for t in dense.values())
        stats.dense_path = self.layout.dense_path(self.generation, self.rank, stats.seq)
        self._last_dense_step, self._last_dense_time = stats.step, now
        return dense

    def _check_open(self) -> None:
        if self.generation is None:
            raise SpoolError("publisher not started: call start(step) first")
        if self._closed:
            raise SpoolError("publisher is closed")

    def _check_error(self) -> None:
        if self._error is not None:
            err = self._error
            raise SpoolError(f"writing a segment failed: {err}") from err

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
        self._last_step = step
        self._last_time = time.monotonic()
        self.stats.segments.append(stats)
        return stats

    def _package(
        self,
        stats: SegmentStats,
        shards: list[TrackedShard],
        ids: list[torch.Tensor],
        values: list[torch.Tensor],
        identities: dict[TrackedShard, SlotIdentities] | None = None,
        *,
        base: bool = False,
    ) -> _Job:
        """The writer's job for a reserved segment; device rows start copying to host.

        ``identities``: each managed-collision shard's raw ids (the one held by each listed
        slot; ``ids`` are global slot ids) and the raw ids evicted since the last segment; a
        ``base`` lists every slot, so it carries the whole slot -> raw id map."""
        identities = identities or {}
        raw: list[torch.Tensor | None] = []
        evicted: list[torch.Tensor | None] = []
        for s, i in zip(shards, ids, strict=True):
            ident = identities.get(s)
            if s.mc is None:
                raw.append(None)
                evicted.append(None)
                continue
            if ident is None:
                raise SpoolError(
                    f"table {s.shard.table}: a managed-collision shard's slot raw ids were not taken"
                )
            raw.append(ident.slots if base else ident.slots[i.cpu() - s.shard.row_start])
            evicted.append(ident.evicted)
        ready = None
        if any(t.device.type == "cuda" for t in (*values, *ids)):
            values = [v.to("cpu", non_blocking=True) for v in values]
            ids = [i.to("cpu", non_blocking=True) for i in ids]
            ready = torch.cuda.Event()
            ready.record()
        rows = [
            ShardRows(s.shard, i, v, r, e)
            for s, i, v, r, e in zip(shards, ids, values, raw, evicted, strict=True)
        ]
        stats.rows = sum(i.numel() for i in ids)
        stats.nbytes = sum(i.nbytes + v.nbytes for i, v in zip(ids, values, strict=True))
        stats.nbytes += sum(t.nbytes for t in (*raw, *evicted) if t is not None)
        return _Job(stats, rows, ready)

    def _write(self, job: _Job) -> None:
        """Write one segment; a failure is kept in ``_error`` and stops all later writes."""
        assert self.generation is not None and job.stats.path is not None
        if self._error is not None:
            return  # a gap would break the log: write nothing after a failure
        if self._write_failed and job.stats.kind is SegmentKind.DELTA:
            self.stats.skipped_segments += 1  # after the gap: the fresh base covers its rows
            return
        try:
            if job.ready is not None:
                job.ready.synchronize()
            t0 = time.perf_counter()
            c0 = time.thread_time()
            if job.dense is not None and job.stats.dense_path is not None:
                # before the segment: a sidecar that sees segment seq finds its dense state
                data = encode_dense(
                    model=self.config.model,
                    generation=self.generation,
                    rank=self.rank,
                    seq=job.stats.seq,
                    step=job.stats.step,
                    tensors=job.dense,
                )
                write_dense(job.stats.dense_path, data, fsync=self.config.fsync)
            write_segment(
                job.stats.path,
                model=self.config.model,
                generation=self.generation,
                rank=self.rank,
                world_size=self.world_size,
                seq=job.stats.seq,
                step=job.stats.step,
                kind=job.stats.kind,
                shards=job.shards,
                first_seq=0 if job.stats.kind is SegmentKind.BASE else None,
                fsync=self.config.fsync,
            )
            job.stats.write_s = time.perf_counter() - t0
            job.stats.write_cpu_s = time.thread_time() - c0
            if self._write_failed:
                log.warning("rank %d: fresh base seq %d written", self.rank, job.stats.seq)
                self._write_failed = False
        except (SpoolError, OSError) as e:
            # The trainer goes on: the rows stay owed (a fresh base at a later publish covers
            # them), memory stays bounded (later deltas are dropped, not queued).
            self.stats.write_errors += 1
            self.stats.last_write_error = str(e)
            log.error("segment %s not written, a fresh base will follow: %s", job.stats.path, e)
            self._write_failed = True
        except BaseException as e:
            log.error("segment %s: %s", job.stats.path, e)
            self._error = e

    def _writer(self) -> None:
        nice = knobs.WRITER_NICE
        if nice:
            # Linux: PRIO_PROCESS with a thread id renices that thread only. The training
            # loop's intra-op threads then win the cores; the writer runs in their gaps.
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except (OSError, AttributeError) as e:
                log.debug("cannot renice the writer thread: %s", e)
        while (job := self._queue.get()) is not None:
            try:
                self._write(job)
            finally:
                del job  # its copy buffers are free for the pool again
