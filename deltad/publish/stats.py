"""What publishing costs: per segment, totals over a publisher's life, and the tracker's hooks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from deltad.types import SegmentKind


@dataclass
class SegmentStats:
    """What one segment cost. ``stall_s`` is time the training loop spent; ``write_s`` not."""

    seq: int
    step: int
    kind: SegmentKind
    rows: int
    nbytes: int
    stall_s: float  # in the loop: issuing the error all-reduce, drain (+ copy and waiting
    # for a write slot if not copied in the background)
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
    #: The publish's all-reduce (the failure flag and the next time-based publish's step):
    #: issuing it (part of ``stall_s``) plus waiting for its result at the publisher's next
    #: call, a step later (part of that call's ``PublisherStats.decide_s`` or ``stall_s``).
    agree_s: float = 0.0


@dataclass
class PublisherStats:
    """Totals over a publisher's life, for benchmarks."""

    segments: list[SegmentStats] = field(default_factory=list)
    #: Time spent deciding whether to publish (a comparison with the agreed step: no
    #: collective), with the wait for the last publish's all-reduce at the call after it.
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
class TrackerStats:
    """Time the tracker spent inside the training loop (for overhead benchmarks)."""

    lookups: int = 0  # post-lookup hook calls that recorded ids
    update_hooks: int = 0  # update-barrier hooks registered on lookup outputs (all lookups)
    record_s: float = 0.0  # in the post-lookup hook (stashing ids)
    fold_s: float = 0.0  # in the post-odist hook (folding ids, or handing them to the thread)
    drain_s: float = 0.0  # in drain() (last fold, nonzero, reset, re-mark)
    #: in the backward passes' update hooks, the barriers they run included (the publisher's
    #: wait for a background copy is also its ``PublisherStats.barrier_wait_s``)
    backward_s: float = 0.0
    #: CPU seconds of the fold thread (folds and swaps off the loop; 0 without one).
    background_s: float = 0.0

    @property
    def forward_s(self) -> float:
        """What the hooks added to forward passes."""
        return self.record_s + self.fold_s

    @property
    def hooks_s(self) -> float:
        """What the tracker's hooks added to the training loop (forward and backward; with the
        barriers' waits, which the publisher also counts as its own)."""
        return self.forward_s + self.backward_s
