"""The writer thread: each packed segment (its dense state first) checksummed and written, in order.

The queue is bounded (``PublisherConfig.max_pending_writes``), so a slow disk blocks the
training loop instead of piling up copies. A write that fails (spool full, I/O error) never
stops training: it is counted, later deltas are dropped, and the publisher writes a fresh base
once it can (see :meth:`deltad.publish.publisher.SegmentPublisher.publish`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from deltad import knobs
from deltad.config import PublisherConfig
from deltad.errors import SpoolError
from deltad.publish.stats import PublisherStats, SegmentStats
from deltad.segment.format import ShardRows, encode_dense, write_dense, write_segment
from deltad.types import SegmentKind

log = logging.getLogger(__name__)


@dataclass
class SegmentJob:
    """A segment for the writer: its reserved stats (seq, step, kind, path) and its rows."""

    stats: SegmentStats
    shards: list[ShardRows]
    ready: Any = None  # a CUDA event to wait for before reading device-to-host copies
    #: rank 0: the dense state cloned at this segment's cut, written before the segment
    dense: dict[str, torch.Tensor] | None = None


class SegmentWriter:
    """Writes one rank's segments of one generation: :meth:`write` at once, or :meth:`put`
    for the thread started by :meth:`start`.

    ``error`` holds the first failure that stops every later write (the copier's too);
    ``write_failed`` says a write failed and no fresh base has been written since.
    """

    def __init__(
        self, config: PublisherConfig, rank: int, world_size: int, stats: PublisherStats
    ) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.stats = stats
        #: set by the publisher once chosen, before the first write
        self.generation: int | None = None
        self.error: BaseException | None = None
        self.write_failed = False
        self.queue: queue.Queue[SegmentJob | None] = queue.Queue(maxsize=config.max_pending_writes)
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the writer thread."""
        self.thread = threading.Thread(target=self._run, name="deltad-writer", daemon=True)
        self.thread.start()

    def put(self, job: SegmentJob) -> None:
        """Queue ``job``; blocks while ``max_pending_writes`` segments wait (backpressure)."""
        self.queue.put(job)

    def stop(self) -> None:
        """Write what is queued, then end the thread."""
        self.queue.put(None)
        if self.thread is not None:
            self.thread.join()

    def write(self, job: SegmentJob) -> None:
        """Write one segment; a failure is kept in ``error`` and stops all later writes."""
        assert self.generation is not None and job.stats.path is not None
        if self.error is not None:
            return  # a gap would break the log: write nothing after a failure
        if self.write_failed and job.stats.kind is SegmentKind.DELTA:
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
            if self.write_failed:
                log.warning("rank %d: fresh base seq %d written", self.rank, job.stats.seq)
                self.write_failed = False
        except (SpoolError, OSError) as e:
            # The trainer goes on: the rows stay owed (a fresh base at a later publish covers
            # them), memory stays bounded (later deltas are dropped, not queued).
            self.stats.write_errors += 1
            self.stats.last_write_error = str(e)
            log.error("segment %s not written, a fresh base will follow: %s", job.stats.path, e)
            self.write_failed = True
        except BaseException as e:
            log.error("segment %s: %s", job.stats.path, e)
            self.error = e

    def _run(self) -> None:
        nice = knobs.WRITER_NICE
        if nice:
            # Linux: PRIO_PROCESS with a thread id renices that thread only. The training
            # loop's intra-op threads then win the cores; the writer runs in their gaps.
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except (OSError, AttributeError) as e:
                log.debug("cannot renice the writer thread: %s", e)
        while (job := self.queue.get()) is not None:
            try:
                self.write(job)
            finally:
                del job  # its copy buffers are free for the pool again
