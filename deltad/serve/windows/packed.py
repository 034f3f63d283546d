"""Pack once: the packed rows (packed-int8 / int4 / fp16) of the log's parts, made once per row
version rather than once per pull.

A window is a merge of *parts*: a log entry's shard (a segment, a retention merge) or a
pre-merged run of them (:mod:`deltad.serve.index.runs`). Packing is row-wise (each row's scale,
bias and codes depend on that row alone), so merging packed rows, latest value wins, gives the
same bytes as packing the merged float rows. :class:`PackedStore` keeps each part's rows packed
in a wire dtype and row alignment, made the first time a window needs them, under a byte budget
(``--packed-cache-bytes``; LRU); a window's chunks are then copies of packed rows, like an fp32
window's are copies of float rows, at any cursor, cached window or not.

A part is identified by its values tensor (the log entry's or the run's, which live as long as
the part does): an entry is dropped as soon as that tensor is freed (a retention merge, a new
generation, a run evicted), and an entry whose tensor is gone is never returned. A part larger
than the whole budget is not kept; its windows pack per chunk as before
(:func:`deltad.wire.pack_rows`).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch

from deltad import wire
from deltad.segment.format import ShardRows
from deltad.types import WireDtype

#: (id of the part's values tensor, wire dtype, row alignment)
PackKey = tuple[int, WireDtype, int]


class _Packed:
    __slots__ = ("alive", "nbytes", "rows", "source")

    def __init__(self, source: weakref.ref[torch.Tensor], rows: torch.Tensor) -> None:
        self.source = source
        self.rows = rows
        self.nbytes = rows.numel()
        self.alive = True


class PackedStore:
    """LRU of packed rows of parts under a byte budget; thread-safe, one packing per part at a
    time (concurrent windows needing one part's rows wait for the first one's)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.RLock()  # (a finalizer may run while a thread holds it)
        self._lru: OrderedDict[PackKey, _Packed] = OrderedDict()
        self._bytes = 0
        self._building: dict[PackKey, threading.Lock] = {}
        #: parts packed, packed parts reused, and rows packed (for tests and metrics)
        self.packed = 0
        self.hits = 0
        self.rows_packed = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the packed rows held."""
        return self._bytes

    def rows(self, part: ShardRows, dtype: WireDtype, alignment: int) -> torch.Tensor | None:
        """``part``'s rows packed in ``dtype`` (uint8 [n, row_bytes], read-only by contract):
        from the store, or packed now and kept; None if they would not fit the budget (or
        the part cannot be packed, e.g. a column-wise shard), when the caller packs per
        chunk."""
        s = part.shard
        if not dtype.packed or wire.packed_refusal(dtype, s.dim, s.col_start, s.col_end):
            return None
        n = part.ids.numel()
        row_bytes = wire.packed_row_bytes(s.dim, dtype, alignment)
        if n * row_bytes > self.max_bytes or part.values.shape != (n, s.dim):
            return None
        key = (id(part.values), dtype, alignment)
        hit = self._get(key, part.values)
        if hit is not None:
            return hit
        with self._lock:
            gate = self._building.setdefault(key, threading.Lock())
        with gate:
            hit = self._get(key, part.values)
            if hit is not None:
                return hit
            try:
                out = torch.empty(n, row_bytes, dtype=torch.uint8)
                wire.pack_rows(part.values, dtype, out)
                self._put(key, part.values, out)
            finally:
                with self._lock:
                    self._building.pop(key, None)
        return out

    def _get(self, key: PackKey, values: torch.Tensor) -> torch.Tensor | None:
        with self._lock:
            e = self._lru.get(key)
            if e is None:
                return None
            if e.source() is not values:  # (an id reused by another tensor)
                self._drop(key)
                return None
            self._lru.move_to_end(key)
            self.hits += 1
            return e.rows

    def _put(self, key: PackKey, values: torch.Tensor, rows: torch.Tensor) -> None:
        with self._lock:
            self.packed += 1
            self.rows_packed += rows.shape[0]
            self._drop(key)
            e = _Packed(weakref.ref(values), rows)
            while self._lru and self._bytes + e.nbytes > self.max_bytes:
                old, _ = next(iter(self._lru.items()))
                self._drop(old)
            self._lru[key] = e
            self._bytes += e.nbytes
        # freed with its part (not at the next eviction): a dead part's rows are never served
        weakref.finalize(values, self._forget, key, e)

    def _forget(self, key: PackKey, e: _Packed) -> None:
        with self._lock:
            if self._lru.get(key) is e:
                self._drop(key)

    def _drop(self, key: PackKey) -> None:
        e = self._lru.pop(key, None)
        if e is not None and e.alive:
            e.alive = False
            self._bytes -= e.nbytes

    def clear(self) -> None:
        """Drop every packed part."""
        with self._lock:
            for key in list(self._lru):
                self._drop(key)
