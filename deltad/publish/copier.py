"""Row copies: a drain's touched rows copied into pooled buffers, in the loop or on the copier thread.

With CPU weights (``PublisherConfig.copy_in_background``, the default) the loop only drains
(a swap of the tracker's bitmaps); the *copier* thread then reads the ids out of the drained
bitmaps and copies the rows (``index_select`` into pooled buffers) while the next step's
forward runs, and hands the packed segment to the writer. The cut stays consistent because
nothing may update a tracked row before that copy is done: the tracker runs
:meth:`CopierThread.wait` (through ``SegmentPublisher.wait_copied``) as an update barrier in
every backward and at the start of each managed-collision compute (see
:mod:`deltad.publish.publisher`). Device weights are copied in the loop (:class:`RowCopier`):
a gather on the device and an asynchronous copy into pinned buffers.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltad import knobs
from deltad.buffers import BufferPool
from deltad.errors import SpoolError
from deltad.publish.bitmaps import DrainedRows
from deltad.publish.mc import SlotIdentities, union_sorted
from deltad.publish.shards import TrackedShard
from deltad.publish.stats import SegmentStats
from deltad.publish.writer import SegmentJob, SegmentWriter
from deltad.segment.format import ShardRows

log = logging.getLogger(__name__)


def pack(
    stats: SegmentStats,
    shards: list[TrackedShard],
    ids: list[torch.Tensor],
    values: list[torch.Tensor],
    identities: dict[TrackedShard, SlotIdentities] | None = None,
    *,
    base: bool = False,
) -> SegmentJob:
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
    return SegmentJob(stats, rows, ready)


class RowCopier:
    """Copies drained rows out of the shards' weights into pooled host buffers.

    A job's buffers are referenced by the job until its segment is written, so one still
    queued is never handed out again (see :class:`deltad.buffers.BufferPool`)."""

    def __init__(self) -> None:
        self.pool = BufferPool(
            max_bytes=knobs.COPY_POOL_MAX_BYTES,
            min_bytes=0,
            granule=knobs.COPY_POOL_GRANULE,
            headroom=knobs.COPY_POOL_HEADROOM,
        )

    def copy_job(
        self,
        drained: list[tuple[TrackedShard, torch.Tensor]],
        stats: SegmentStats,
        identities: dict[TrackedShard, SlotIdentities] | None = None,
    ) -> SegmentJob:
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
        values = [self.copy_rows(s, local) for s, local in drained]
        # free buffers no copy of this round used go back to the allocator
        self.pool.end_round()
        return pack(stats, shards, ids, values, identities)

    def copy_rows(self, shard: TrackedShard, local: torch.Tensor) -> torch.Tensor:
        """Copy rows ``local`` of the shard's weights (a pooled host buffer if configured)."""
        weight = shard.weight.detach()
        if not knobs.REUSE_COPY_BUFFERS or local.numel() == 0:
            return weight.index_select(0, local)
        # Pinned for device weights, so the copy below is a real async DMA.
        out = self.pool.take(
            (local.numel(), weight.size(1)), weight.dtype, pin_memory=weight.device.type == "cuda"
        )
        if weight.device.type == "cpu":
            torch.index_select(weight, 0, local, out=out)
        else:  # gather on the device, then an async copy into the pinned buffer (see pack)
            out.copy_(weight.index_select(0, local), non_blocking=True)
        return out

    def clear(self) -> None:
        """Free every pooled buffer."""
        self.pool.clear()


@dataclass
class CopyRequest:
    """A drain waiting for the copier thread: its rows are read out and copied there."""

    drained: DrainedRows | None
    stats: SegmentStats
    dense: dict[str, torch.Tensor] | None = None
    #: A job already packed (a fresh base): forwarded to the writer in order.
    job: SegmentJob | None = None
    #: Managed-collision shards' identities, taken by the copier first (the MC computes wait
    #: for the copy, so the slot maps are still those of the cut): the publisher's
    #: ``_identities``.
    take_identities: Callable[[], dict[TrackedShard, SlotIdentities]] | None = None
    #: Run first, off the loop: the publish's all-reduce issued (``PendingMax.issue``).
    before: Callable[[], None] | None = None


class CopierThread:
    """Copies each submitted drain's rows off the loop, then queues its job for ``writer``,
    in order; a failure is kept in ``writer.error`` (nothing more is written)."""

    def __init__(self, rows: RowCopier, writer: SegmentWriter) -> None:
        self.rows = rows
        self.writer = writer
        self._queue: queue.Queue[CopyRequest | None] = queue.Queue()
        self._copies = threading.Condition()
        self._submitted = 0
        self._done = 0
        self.thread = threading.Thread(target=self._run, name="deltad-copier", daemon=True)
        self.thread.start()

    def submit(self, request: CopyRequest) -> None:
        """Queue a copy; from here on, :meth:`wait` (the update barrier) waits for it."""
        with self._copies:
            self._submitted += 1
        self._queue.put(request)

    def copying(self) -> bool:
        """Whether a copy submitted so far may still read the weights (then :meth:`wait`
        blocks). Only :meth:`submit` makes it true, so on the thread that submits it stays
        false until that thread's next submit."""
        return self._done < self._submitted

    def wait(self) -> float:
        """Wait for every copy submitted so far; return the seconds waited (0: none)."""
        with self._copies:
            if self._done >= self._submitted:
                return 0.0
            t0 = time.perf_counter()
            target = self._submitted
            # Bounded: the copier counts every request done, even a failed one; and if it
            # died anyway, stop waiting (the error is raised at the next publish).
            while self._done < target and self.alive():
                self._copies.wait(timeout=1.0)
            return time.perf_counter() - t0 or 1e-9

    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self.thread.is_alive()

    def stop(self) -> None:
        """Copy what is queued (its last jobs reach the writer), then end the thread."""
        self._queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        """Read and copy each request's rows, then queue it for the writer."""
        while (req := self._queue.get()) is not None:
            job = None
            if req.before is not None:
                req.before()  # never raises (an issue's failure is raised on the loop)
            try:
                t0, c0 = time.perf_counter(), time.thread_time()
                # every time: the next take diffs from this one
                identities = req.take_identities() if req.take_identities is not None else {}
                # resolving also returns the bitmaps to the tracker
                drained = req.drained.resolve() if req.drained is not None else []
                if req.job is not None:
                    job = req.job  # a fresh base: its rows are copied already
                elif self.writer.error is None:  # after a failure nothing more is written
                    job = self.rows.copy_job(drained, req.stats, identities)
                    job.dense = req.dense
                req.stats.copy_s = time.perf_counter() - t0
                req.stats.copy_cpu_s = time.thread_time() - c0
            except BaseException as e:
                log.error("copying the rows of segment %s: %s", req.stats.seq, e)
                self.writer.error = e
            finally:
                with self._copies:  # the weights are read: updates may go on
                    self._done += 1
                    self._copies.notify_all()
            if job is not None:
                self.writer.put(job)  # blocks while the writer is behind (backpressure)
