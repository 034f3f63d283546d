"""Pack once: the packed rows (packed-int8 / int4 / fp16) of the log's parts, made once per row
version rather than once per pull.

A window is a merge of *parts*: a log entry's shard (a segment, a retention merge) or a
pre-merged run of them (:mod:`deltad.serve.index.runs`). Packing is row-wise (each row's scale,
bias and codes depend on that row alone), so merging packed rows, latest value wins, gives the
same bytes as packing the merged float rows. :class:`PackedStore` keeps each part's rows packed
in a wire dtype and row alignment, made the first time a window needs them, under a byte budget
(``--packed-cache-bytes``); a window's chunks are then copies of packed rows, like an fp32
window's are copies of float rows, at any cursor, cached window or not.

The store degrades to packing per chunk (:func:`deltad.wire.pack_rows`, as with the store off),
never to packing more (issue 41 item 2):

* **The budget holds every packed row the store made.** An entry's rows are freed when it is
  evicted or its part is freed; :attr:`PackedStore.nbytes` (``deltad_packed_cache_bytes``)
  counts every entry from the moment its room is reserved, and never exceeds ``max_bytes``.
* **A pull never evicts what it uses.** The rows a window takes are *pinned* to it
  (:class:`Pins`, held by its :class:`~deltad.serve.windows.encoded.EncodedWindow` while it
  produces chunks, released when its last chunk is out). A part that does not fit beside the
  pinned ones is not packed whole: its window packs it per chunk. A window bigger than the
  budget so keeps a stable prefix of its shards packed, pull after pull, and packs the rest per
  chunk, instead of evicting the shards its next pull needs first (which made every pull pack
  every part whole: slower than the store off).
* **Admission by frequency.** Room is made by evicting idle entries (least recently used
  first) only for a part asked for more often than each of them (counts halved every so often:
  :data:`AGE_EVERY`; a part asked for once may replace another asked for once). Windows that
  take turns (three row alignments, two wire dtypes) under a
  budget that holds one of them keep the one there and pack the others per chunk, instead of
  each packing whole and evicting the other.

A part is identified by its values tensor (the log entry's or the run's, which live as long as
the part does): an entry is dropped as soon as that tensor is freed (a retention merge, a new
generation, a run evicted), and an entry whose tensor is gone is never returned. A part larger
than the whole budget is never kept.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from deltad import wire
from deltad.segment.format import ShardRows
from deltad.types import WireDtype

#: (id of the part's values tensor, wire dtype, row alignment)
PackKey = tuple[int, WireDtype, int]

#: the admission counts are halved after this many asks per kept entry (at least 64 asks)
AGE_EVERY = 8
#: counts kept at most (the oldest are aged away beyond it)
MAX_COUNTS = 4096

_serials = itertools.count(1)


class _Ask(NamedTuple):
    key: PackKey
    values: torch.Tensor
    n: int
    row_bytes: int

    @property
    def need(self) -> int:
        return self.n * self.row_bytes


class _Packed:
    __slots__ = ("alive", "key", "nbytes", "pins", "rows", "serial", "source")

    def __init__(self, key: PackKey, source: weakref.ref[torch.Tensor], nbytes: int) -> None:
        self.key = key
        self.source = source
        self.rows: torch.Tensor | None = None  # None while it is being packed
        self.nbytes = nbytes
        self.alive = True
        self.pins = 0
        self.serial = next(_serials)


class Pins:
    """The packed rows one window uses, pinned (never evicted) until :meth:`release`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[tuple[PackedStore, _Packed]] = []
        self._released = False

    def _add(self, store: PackedStore, e: _Packed) -> bool:
        """Pin ``e`` (store lock held); False once released (the window is done)."""
        with self._lock:
            if self._released:
                return False
            self._held.append((store, e))
        e.pins += 1
        return True

    def release(self) -> None:
        """Unpin everything (idempotent)."""
        with self._lock:
            held, self._held, self._released = self._held, [], True
        for store, e in held:
            store._unpin(e)


_current: contextvars.ContextVar[Pins | None] = contextvars.ContextVar(
    "deltad_packed_pins", default=None
)


@contextlib.contextmanager
def pinning(pins: Pins) -> Iterator[None]:
    """Rows taken from any :class:`PackedStore` in this block are pinned to ``pins``."""
    token = _current.set(pins)
    try:
        yield
    finally:
        _current.reset(token)


class PackedStore:
    """Packed rows of parts under a byte budget (see the module doc); thread-safe, one packing
    per part at a time (concurrent windows needing one part's rows wait for the first one's)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.RLock()  # (a finalizer may run while a thread holds it)
        self._built = threading.Condition(self._lock)  # an entry's rows packed (or dropped)
        self._lru: OrderedDict[PackKey, _Packed] = OrderedDict()
        self._bytes = 0
        self._counts: dict[PackKey, int] = {}
        self._asks = 0
        #: parts packed, packed parts reused, rows packed, parts refused (packed per chunk
        #: instead: no room beside pinned rows, or asked for less often than what is kept),
        #: and the most bytes held at once (for tests and metrics)
        self.packed = 0
        self.hits = 0
        self.rows_packed = 0
        self.refused = 0
        self.peak_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the packed rows held (and reserved for rows being packed)."""
        return self._bytes

    @property
    def entries(self) -> int:
        return len(self._lru)

    def _ask(self, part: ShardRows, dtype: WireDtype, alignment: int) -> _Ask | None:
        """What keeping ``part`` packed takes; None if it is never kept (see :meth:`rows`)."""
        s = part.shard
        if not dtype.packed or wire.packed_refusal(dtype, s.dim, s.col_start, s.col_end):
            return None
        n = part.ids.numel()
        row_bytes = wire.packed_row_bytes(s.dim, dtype, alignment)
        if n * row_bytes > self.max_bytes or part.values.shape != (n, s.dim):
            return None
        return _Ask((id(part.values), dtype, alignment), part.values, n, row_bytes)

    def rows(self, part: ShardRows, dtype: WireDtype, alignment: int) -> torch.Tensor | None:
        """``part``'s rows packed in ``dtype`` (uint8 [n, row_bytes], read-only by contract):
        from the store, or packed now and kept; None when the caller packs per chunk instead
        (no room for them, see the module doc, or the part cannot be packed, e.g. a
        column-wise shard). Rows returned inside :func:`pinning` stay until its pins are
        released."""
        got = self.rows_of([part], dtype, alignment)
        return None if got is None else got[0]

    def rows_of(
        self, parts: Sequence[ShardRows], dtype: WireDtype, alignment: int
    ) -> list[torch.Tensor] | None:
        """Every one of ``parts``' rows packed (see :meth:`rows`), or None, with nothing packed
        or evicted, unless all of them are kept or can be: the parts of one shard merged
        from several are used only together, and keeping some of them would hold budget that
        no pull uses."""
        asks = []
        for part in parts:
            a = self._ask(part, dtype, alignment)
            if a is None:
                return None
            asks.append(a)
        if sum(a.need for a in asks) > self.max_bytes:
            return None
        scope = _current.get()
        pins = Pins() if scope is None else scope
        mine: list[tuple[_Ask, _Packed]] = []
        try:
            with self._lock:
                entries: dict[PackKey, _Packed] = {}
                for a in asks:
                    self._count(a.key)
                    e = self._lookup(a.key, a.values)
                    if e is not None:
                        entries[a.key] = e
                        pins._add(self, e)  # (not a victim of the missing ones' room)
                missing = [a for a in asks if a.key not in entries]
                if missing:
                    need = sum(a.need for a in missing)
                    least = min(self._counts.get(a.key, 0) for a in missing)
                    if not self._room(need, least):
                        self.refused += 1
                        return None
                    for a in missing:
                        e = self._admit(a.key, a.values, a.need)
                        if e is None:  # (cannot happen after _room: refuse all the same)
                            for _, m in mine:
                                self._drop(m.key, m)
                            self._built.notify_all()
                            self.refused += 1
                            return None
                        entries[a.key] = e
                        pins._add(self, e)
                        mine.append((a, e))
            for a, e in mine:
                self._pack(a, e, dtype)
            out = []
            with self._lock:
                for a in asks:
                    e = entries[a.key]
                    while e.rows is None and e.alive:  # another thread packs it
                        self._built.wait(1.0)
                    if e.rows is None:  # (its packing failed there: per chunk here)
                        return None
                    out.append(e.rows)
                self.hits += len(asks) - len(mine)
            return out
        finally:
            if scope is None:
                pins.release()

    def _pack(self, a: _Ask, e: _Packed, dtype: WireDtype) -> None:
        """Pack ``a``'s rows into its reserved entry ``e`` (outside the lock)."""
        try:
            out = torch.empty(a.n, a.row_bytes, dtype=torch.uint8)
            wire.pack_rows(a.values, dtype, out)
        except BaseException:
            with self._lock:
                self._drop(a.key, e)
                self._built.notify_all()
            raise
        with self._lock:
            if e.alive:
                e.rows = out
                self.packed += 1
                self.rows_packed += a.n
            self._built.notify_all()

    # --- internals (lock held) ---

    def _lookup(self, key: PackKey, values: torch.Tensor) -> _Packed | None:
        e = self._lru.get(key)
        if e is None:
            return None
        if e.source() is not values:  # (an id reused by another tensor)
            self._drop(key, e)
            return None
        self._lru.move_to_end(key)
        return e

    def _count(self, key: PackKey) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1
        self._asks += 1
        if self._asks >= max(64, AGE_EVERY * len(self._lru)) or len(self._counts) > MAX_COUNTS:
            self._asks = 0
            self._counts = {k: c >> 1 for k, c in self._counts.items() if c > 1}

    def _evictable(self, k: PackKey, old: _Packed, mine: int) -> bool:
        """Whether idle ``old`` may make room for a part asked for ``mine`` times."""
        if old.pins or old.rows is None:
            return False
        theirs = self._counts.get(k, 0)
        return theirs < mine or theirs == mine == 1  # (one-offs replace one-offs)

    def _room(self, need: int, mine: int) -> bool:
        """Whether ``need`` bytes can be reserved for parts asked for ``mine`` times."""
        free = self.max_bytes - self._bytes
        if free >= need:
            return True
        for k, old in self._lru.items():
            if self._evictable(k, old, mine):
                free += old.nbytes
                if free >= need:
                    return True
        return False

    def _admit(self, key: PackKey, values: torch.Tensor, need: int) -> _Packed | None:
        """Reserve ``need`` bytes for ``key``'s rows, evicting idle entries asked for less
        often; None (nothing evicted) if that does not make room."""
        free = self.max_bytes - self._bytes
        victims: list[PackKey] = []
        if free < need:
            mine = self._counts.get(key, 0)
            for k, old in self._lru.items():
                if not self._evictable(k, old, mine):
                    continue
                victims.append(k)
                free += old.nbytes
                if free >= need:
                    break
            if free < need:
                return None
        for k in victims:
            self._drop(k, self._lru[k])
        e = _Packed(key, weakref.ref(values), need)
        self._lru[key] = e
        self._bytes += need
        self.peak_bytes = max(self.peak_bytes, self._bytes)
        # freed with its part (not at the next eviction): a dead part's rows are never served
        weakref.finalize(values, self._forget, key, e.serial)
        return e

    def _unpin(self, e: _Packed) -> None:
        with self._lock:
            e.pins -= 1

    def _forget(self, key: PackKey, serial: int) -> None:
        with self._lock:
            self._counts.pop(key, None)
            e = self._lru.get(key)
            if e is not None and e.serial == serial:
                self._drop(key, e)

    def _drop(self, key: PackKey, e: _Packed) -> None:
        if self._lru.get(key) is e:
            del self._lru[key]
        if e.alive:
            e.alive = False
            e.rows = None  # (a pull still streaming them holds its own reference)
            self._bytes -= e.nbytes

    def clear(self) -> None:
        """Drop every packed part (pulls streaming some keep their own references)."""
        with self._lock:
            for key, e in list(self._lru.items()):
                self._drop(key, e)
