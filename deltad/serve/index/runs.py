"""Pre-merged runs of a rank's deltas, so a window's cost does not depend on its cursor.

The deltas of a snapshot (every entry after the base, oldest first, at positions 0..n-1) are
covered by power-of-two aligned runs: the run of size ``2**k`` at position ``p`` (``p`` a
multiple of ``2**k``) is the latest-value merge of deltas ``p .. p + 2**k - 1``. Any window
(a contiguous range of deltas) is the merge, oldest first, of at most ~2 log2 n such runs
(:func:`cover`), instead of one chunk per segment: a consumer at any cursor costs about one
pass over its window's rows, like a consumer at the head, and a merge of its chunks never
falls back to the slow many-chunk path.

Runs are built lazily (the first window that needs one merges it, from the runs one level
below when they are cached) and kept in an LRU under a byte budget. A run is identified by
the exact entries it covers (generation; first_seq, seq, path, size and creation time of
each), so a retention merge or a new generation simply stops hitting old runs, which age out; :meth:`RunCache.prune`
drops those of other generations at once. Merging merged runs is exact: the union of ids with
the latest value is associative, so a window built from runs is bit-equal to one merged from
its segments (tests/test_runs.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from deltad.segment.format import ShardRows
from deltad.serve.index.log import LogEntry
from deltad.serve.index.merge import merge_rows
from deltad.types import ShardKey

#: a window of at most this many entries is merged from its segments (a run does not pay)
DIRECT_MAX = 4

Part = dict[ShardKey, ShardRows]
RunId = tuple[int, tuple[tuple[int, int, str, int, float], ...]]


def cover(lo: int, hi: int) -> list[tuple[int, int]]:
    """Aligned power-of-two blocks ``(start, size)`` covering positions ``[lo, hi)``, in order:
    at each position the largest block aligned there that fits."""
    out = []
    p = lo
    while p < hi:
        size = p & -p if p else 1 << (hi - p).bit_length()
        while p + size > hi:
            size >>= 1
        out.append((p, size))
        p += size
    return out


def _run_id(generation: int, entries: Sequence[LogEntry]) -> RunId:
    # (a file rewritten under the same name and seqs differs in size or creation time)
    return generation, tuple(
        (e.first_seq, e.seq, str(e.path), e.nbytes, e.created_unix) for e in entries
    )


class RunCache:
    """LRU of merged runs under a byte budget; thread-safe, one build per run at a time."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[RunId, tuple[Part, int]] = OrderedDict()
        self._bytes = 0
        self._generation = -1
        self._building: dict[RunId, threading.Lock] = {}
        #: runs merged, and runs served from the cache (for tests and metrics)
        self.built = 0
        self.hits = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def window_parts(
        self, generation: int, deltas: Sequence[LogEntry], lo: int, hi: int
    ) -> list[Part]:
        """Parts for deltas ``[lo, hi)`` of a snapshot whose deltas are ``deltas``."""
        if hi - lo <= DIRECT_MAX or self.max_bytes <= 0:
            return [e.shards for e in deltas[lo:hi]]
        if generation != self._generation:
            self.prune(generation)
        return [
            deltas[p].shards if size == 1 else self._run(generation, deltas, p, size)
            for p, size in cover(lo, hi)
        ]

    def _get(self, rid: RunId) -> Part | None:
        with self._lock:
            hit = self._lru.get(rid)
            if hit is None:
                return None
            self._lru.move_to_end(rid)
            self.hits += 1
            return hit[0]

    def _run(self, generation: int, deltas: Sequence[LogEntry], p: int, size: int) -> Part:
        rid = _run_id(generation, deltas[p : p + size])
        hit = self._get(rid)
        if hit is not None:
            return hit
        with self._lock:
            gate = self._building.setdefault(rid, threading.Lock())
        with gate:  # concurrent windows needing one run merge it once
            hit = self._get(rid)
            if hit is not None:
                return hit
            try:
                half = size // 2
                # from the two halves (cached ones are reused, missing ones built and kept)
                lower = self._run(generation, deltas, p, half) if half > 1 else deltas[p].shards
                upper = (
                    self._run(generation, deltas, p + half, half)
                    if half > 1
                    else deltas[p + half].shards
                )
                merged: Part = {}
                for key in {**lower, **upper}:
                    cs = [c for c in (lower.get(key), upper.get(key)) if c is not None]
                    merged[key] = cs[0] if len(cs) == 1 else merge_rows(cs)
                nbytes = sum(
                    c.ids.nbytes
                    + c.values.nbytes
                    + (0 if c.raw_ids is None else c.raw_ids.nbytes)
                    + (0 if c.evicted is None else c.evicted.nbytes)
                    for c in merged.values()
                )
                self._put(rid, merged, nbytes)
            finally:
                with self._lock:
                    self._building.pop(rid, None)
        return merged

    def _put(self, rid: RunId, part: Part, nbytes: int) -> None:
        with self._lock:
            self.built += 1
            if nbytes > self.max_bytes:
                return
            old = self._lru.pop(rid, None)
            if old is not None:
                self._bytes -= old[1]
            self._lru[rid] = (part, nbytes)
            self._bytes += nbytes
            while self._bytes > self.max_bytes and self._lru:
                _, (_, n) = self._lru.popitem(last=False)
                self._bytes -= n

    def prune(self, generation: int) -> None:
        """Drop the runs of any other generation (a new generation replaced the log)."""
        with self._lock:
            self._generation = generation
            for rid in [r for r in self._lru if r[0] != generation]:
                self._bytes -= self._lru.pop(rid)[1]
