"""One pull's window: choose the entries, merge, apply top-k / owed rows, encode; and the cache
of encoded windows that several consumers share."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from deltad import wire
from deltad.server.log import ChunkKey, LogSnapshot
from deltad.server.merge import SliceRows, merge_entries, plan_slice
from deltad.types import Form, WireDtype
from deltad.v1 import delta_pb2 as pb


@dataclass(frozen=True)
class WindowSpec:
    """Everything that decides a window's bytes (the cache key when no rows are owed)."""

    rank: int
    generation: int
    resync: bool
    from_seq: int  # cursor seq (-1 for a base window)
    to_seq: int
    form: Form
    dtype: WireDtype
    tables: tuple[str, ...]
    k: int
    fraction: float
    max_rows: int
    chunk_bytes: int


@dataclass
class EncodedWindow:
    """A window ready to stream: serialized header and chunks, and what stays owed."""

    header: bytes
    chunks: list[bytes]
    to_seq: int
    to_step: int
    rows: int
    payload_bytes: int
    merge_seconds: float
    owed: dict[ChunkKey, SliceRows] = field(default_factory=dict)

    @property
    def owed_rows(self) -> int:
        return sum(r.ids.numel() for r in self.owed.values())

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(len(c) for c in self.chunks)


def build_window(
    snap: LogSnapshot, spec: WindowSpec, to_step: int, owed: dict[ChunkKey, SliceRows]
) -> EncodedWindow:
    """Merge and encode the window ``spec`` over ``snap`` for a consumer owed ``owed``.

    ``to_seq`` may equal ``from_seq`` (nothing new): the owed rows are still served.

    A base window (resync) is always complete: top-k and max_rows do not apply to it, and
    rows owed from the previous generation are dropped.
    """
    t0 = time.perf_counter()
    keys = [k for k in snap.base.chunks if not spec.tables or k[0] in spec.tables]
    if spec.resync:
        owed = {}
        window = list(snap.upto(spec.to_seq))
    else:
        window = snap.after(spec.from_seq, spec.to_seq)
    complete = spec.resync or (spec.form is not Form.TOPK and not spec.max_rows and not owed)
    with_values = spec.form is not Form.IDS or not complete
    merged = merge_entries(window, keys, with_values=with_values)
    head_state = snap.upto(spec.to_seq)
    held_state = [] if spec.resync else snap.upto(spec.from_seq)
    budget = spec.max_rows if spec.max_rows and not spec.resync else None
    new_owed = {k: v for k, v in owed.items() if k not in keys}
    plan: list[tuple[SliceRows, int]] = []
    for key in keys:
        m, o = merged.get(key), owed.get(key)
        if m is None and o is None:
            continue
        if complete:
            assert m is not None
            plan.append((m, 0))
            continue
        ws = plan_slice(
            key,
            m,
            o,
            head_state=head_state,
            held_state=held_state,
            form=spec.form,
            k=spec.k,
            fraction=spec.fraction,
            budget=budget,
        )
        n_owed = 0 if ws.owed is None else ws.owed.ids.numel()
        if ws.owed is not None and n_owed:
            new_owed[key] = ws.owed
        if budget is not None:
            budget -= ws.rows.ids.numel()
        plan.append((ws.rows, n_owed))
    merge_seconds = time.perf_counter() - t0
    header = pb.DeltaHeader(
        rank=spec.rank,
        generation=spec.generation,
        resync=spec.resync,
        from_seq=-1 if spec.resync else spec.from_seq,
        to_seq=spec.to_seq,
        to_step=to_step,
        form=wire.form_to_pb(spec.form),
        dtype=wire.dtype_to_pb(spec.dtype),
    )
    chunks: list[bytes] = []
    payload = rows = 0
    for i, (r, n_owed) in enumerate(plan):
        header.slices.append(
            pb.TableSlice(
                table=r.table,
                num_rows=r.num_rows,
                dim=r.dim,
                col_start=r.col_start,
                col_end=r.col_end,
                count=r.ids.numel(),
                owed=n_owed,
            )
        )
        values = None if spec.form is Form.IDS else r.values
        for c in wire.encode_slice_chunks(i, r.ids, values, spec.dtype, spec.chunk_bytes):
            chunks.append(c)
            payload += len(c)
        rows += r.ids.numel()
    return EncodedWindow(
        header=wire.encode_header(header),
        chunks=chunks,
        to_seq=spec.to_seq,
        to_step=to_step,
        rows=rows,
        payload_bytes=payload,
        merge_seconds=merge_seconds,
        owed=new_owed,
    )


class WindowCache:
    """LRU of encoded windows; concurrent requests for one window build it once."""

    def __init__(self, entries: int, max_bytes: int) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[WindowSpec, EncodedWindow] = OrderedDict()
        self._building: dict[WindowSpec, threading.Lock] = {}
        self.hits = 0

    def get(
        self, spec: WindowSpec, build: Callable[[], EncodedWindow]
    ) -> tuple[EncodedWindow, bool]:
        """The window for ``spec`` and whether it came from the cache."""
        if self.entries <= 0:
            return build(), False
        with self._lock:
            hit = self._lru.get(spec)
            if hit is not None:
                self._lru.move_to_end(spec)
                self.hits += 1
                return hit, True
            gate = self._building.setdefault(spec, threading.Lock())
        with gate:  # a second caller waits here for the first one's result
            with self._lock:
                hit = self._lru.get(spec)
                if hit is not None:
                    self._lru.move_to_end(spec)
                    self.hits += 1
                    return hit, True
            try:
                win = build()
                if win.nbytes <= self.max_bytes:
                    with self._lock:
                        self._lru[spec] = win
                        total = sum(w.nbytes for w in self._lru.values())
                        while len(self._lru) > self.entries or total > self.max_bytes:
                            _, old = self._lru.popitem(last=False)
                            total -= old.nbytes
            finally:
                with self._lock:
                    self._building.pop(spec, None)
            return win, False
