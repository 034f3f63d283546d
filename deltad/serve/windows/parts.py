"""What a window is made of: the segments (or runs) merged into it, and its dense state."""

from __future__ import annotations

from deltad.segment.format import ShardRows
from deltad.serve.index.log import DenseEntry, LogSnapshot
from deltad.serve.index.runs import RunCache
from deltad.serve.index.spill import SpillStore
from deltad.serve.windows.merged import ranged
from deltad.serve.windows.spec import WindowSpec
from deltad.types import ShardKey


def window_parts(
    snap: LogSnapshot,
    spec: WindowSpec,
    runs: RunCache | None = None,
    spill: SpillStore | None = None,
) -> list[dict[ShardKey, ShardRows]]:
    """The chunks of the window ``spec`` over ``snap``, oldest first, as a list of parts (one
    per entry, or pre-merged runs of them from ``runs``): merged oldest first, they give the
    window. A resync window is the base and the deltas up to ``to_seq``; otherwise the entries
    holding segments in ``(from_seq, to_seq]`` (see :meth:`LogSnapshot.after`)."""
    entries = snap.entries
    if spec.resync:
        lo = 0
    else:
        lo = next((i for i, e in enumerate(entries) if e.seq > spec.from_seq), len(entries))
    hi = lo
    while hi < len(entries) and entries[hi].seq <= spec.to_seq:
        hi += 1
    head: list[dict[ShardKey, ShardRows]] = []
    if lo == 0 and hi > 1 and spill is not None and runs is not None:
        gen, deltas = snap.generation, entries[1:]
        direct = [entries[0].shards, *runs.window_parts(gen, deltas, 0, hi - 1)]
        if spill.only_when_merged and ranged(direct):
            return direct  # streamed range by range: one copy, no merge to save
        got = spill.base_parts(
            gen, entries, hi, lambda a, b: runs.window_parts(gen, deltas, a, b), ranged
        )
        if got is not None:
            return got
        return direct
    if lo == 0 and hi > 0:  # the base: whole, never part of a run
        head, lo = [entries[0].shards], 1
    if hi <= lo:
        return head
    if runs is None:
        return head + [e.shards for e in entries[lo:hi]]
    return head + runs.window_parts(snap.generation, entries[1:], lo - 1, hi - 1)


def window_dense(snap: LogSnapshot, spec: WindowSpec) -> DenseEntry | None:
    """The dense state a window carries: with ``spec.dense``, the newest one taken at or before
    the head's segment, if the consumer does not hold it yet (it is newer than the cursor, or
    the window is a resync)."""
    if not spec.dense:
        return None
    d = snap.dense_at(spec.to_seq)
    if d is None or (not spec.resync and d.seq <= spec.from_seq):
        return None
    return d
