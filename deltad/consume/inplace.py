"""Writing a window into the serving tables in place, under the ServingLock a forward holds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from deltad.consume.mc import IdentityPlan, Remapper
from deltad.consume.tbe import QuantTable
from deltad.errors import ConsumerError
from deltad.types import ApplyConsistency


class ServingLock:
    """Shared (forwards) / exclusive (applier) lock with writer preference.

    Reads re-enter on the same thread. Every wait is bounded by ``timeout_s``.
    """

    def __init__(self, timeout_s: float = 60.0) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._local = threading.local()
        self.timeout_s = timeout_s

    def _wait(self, blocked: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while blocked():
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConsumerError(f"serving lock: {what} not acquired in {self.timeout_s}s")
            self._cond.wait(left)

    @contextmanager
    def read(self) -> Iterator[None]:
        """Hold while a forward looks rows up."""
        depth = getattr(self._local, "depth", 0)
        if depth:
            self._local.depth = depth + 1
            try:
                yield
            finally:
                self._local.depth = depth
            return
        with self._cond:
            self._wait(lambda: self._writer or self._writers_waiting > 0, "read")
            self._readers += 1
        self._local.depth = 1
        try:
            yield
        finally:
            self._local.depth = 0
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        """Hold while rows are copied in: no forward runs inside it."""
        with self._cond:
            self._writers_waiting += 1
            try:
                self._wait(lambda: self._writer or self._readers > 0, "write")
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


@dataclass
class ApplyStats:
    """What the last :meth:`~deltad.consume.quant.QuantApplier.apply` did."""

    rows: int = 0
    chunks: int = 0
    dense: int = 0
    identities: int = 0  # managed-collision tables whose remapper was rebuilt
    pack_s: float = 0.0
    copy_s: float = 0.0
    max_hold_s: float = 0.0  # longest write-lock hold: the longest a forward could wait


def write_window(
    plan: list[tuple[QuantTable, torch.Tensor, torch.Tensor]],
    dense: list[tuple[torch.Tensor, Any]],
    staged: Sequence[tuple[QuantTable, torch.Tensor | None, torch.Tensor]] = (),
    identities: Mapping[str, IdentityPlan] | None = None,
    *,
    remappers: Mapping[str, Remapper],
    lock: ServingLock,
    consistency: ApplyConsistency,
    chunk_rows: int,
) -> ApplyStats:
    """Copy ``staged`` (``(table, ids, staging rows)``: rows ``ids`` -- None: every row --
    of the staging copy) first, then ``plan`` (``(table, ids, rows)``), then ``dense``,
    chunk by chunk; install ``identities`` (managed-collision tables) in one write-lock
    hold with the rows of every slot whose raw id changed (all of a table's rows if it
    has staged rows), so a forward never pairs a raw id with another identity's row.
    ``chunk_rows`` rows a write-lock hold under ``consistency`` CHUNK; ``remappers`` install
    the identities."""
    stats = ApplyStats()
    identities = identities or {}
    #: (table, ids or a row range, rows, staged, joint): staged rows are gathered at copy
    #: time; joint rows are written in the identity hold
    chunks: list[tuple[QuantTable, torch.Tensor | slice, torch.Tensor, bool, bool]] = []
    staged_mc = {t.name for t, _, _ in staged if t.name in identities}
    for t, ids, rows in staged:
        joint = t.name in staged_mc
        if ids is None:  # every row: contiguous ranges, no index
            for i in range(0, t.num_rows, chunk_rows):
                r = slice(i, min(t.num_rows, i + chunk_rows))
                chunks.append((t, r, rows, True, joint))
            continue
        for i in range(0, ids.numel(), chunk_rows):
            chunks.append((t, ids[i : i + chunk_rows], rows, True, joint))
    for t, ids, rows in plan:
        idp = identities.get(t.name)
        parts: list[tuple[torch.Tensor, torch.Tensor, bool]] = [(ids, rows, False)]
        if t.name in staged_mc:
            parts = [(ids, rows, True)]
        elif idp is not None:
            mask = torch.isin(ids, idp.changed)
            parts = [(ids[~mask], rows[~mask], False), (ids[mask], rows[mask], True)]
        for pids, prows, in_hold in parts:
            for i in range(0, pids.numel(), chunk_rows):
                r = slice(i, i + chunk_rows)
                chunks.append((t, pids[r], prows[r], False, in_hold))
    t0 = time.perf_counter()

    def gather(
        c: tuple[QuantTable, torch.Tensor | slice, torch.Tensor, bool, bool],
    ) -> torch.Tensor:
        if not c[3]:
            return c[2]
        return c[2][c[1]] if isinstance(c[1], slice) else c[2].index_select(0, c[1])

    def copy_in(t: QuantTable, ids: torch.Tensor | slice, rows: torch.Tensor) -> None:
        if isinstance(ids, slice):
            t.rows[ids].copy_(rows)
            stats.rows += int(rows.shape[0])
        else:
            copy_rows(t.rows, ids, rows)
            stats.rows += int(ids.numel())
        stats.chunks += 1

    def copy_dense() -> None:
        for target, value in dense:
            target.copy_(value)
        stats.dense += len(dense)

    def install_identities() -> None:
        for name, idp in identities.items():
            remappers[name].install(idp)
        stats.identities += len(identities)

    with torch.no_grad():
        if consistency is ApplyConsistency.WINDOW:
            with lock.write():
                h = time.perf_counter()
                for c in chunks:
                    copy_in(c[0], c[1], gather(c))
                install_identities()
                copy_dense()
                stats.max_hold_s = time.perf_counter() - h
        else:
            for c in chunks:
                if c[4]:
                    continue
                rows = gather(c)  # outside the lock
                with lock.write():
                    h = time.perf_counter()
                    copy_in(c[0], c[1], rows)
                    stats.max_hold_s = max(stats.max_hold_s, time.perf_counter() - h)
            if identities:
                held = [(c[0], c[1], gather(c)) for c in chunks if c[4]]
                with lock.write():
                    h = time.perf_counter()
                    for t, where, rows in held:
                        copy_in(t, where, rows)
                    install_identities()
                    stats.max_hold_s = max(stats.max_hold_s, time.perf_counter() - h)
            if dense:
                with lock.write():
                    h = time.perf_counter()
                    copy_dense()
                    stats.max_hold_s = max(stats.max_hold_s, time.perf_counter() - h)
    stats.copy_s = time.perf_counter() - t0
    return stats


def copy_rows(target: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """``target[ids] = rows`` for uint8 rows, as the widest words both allow: 16 bytes
    (``complex128``: fbgemm rows are 16-byte aligned), else 4 bytes, else bytes. ``index_copy_``
    costs per element: measured (10 k rows of 80 B into 100 k, one thread) 16-byte words
    58-68 M rows/s, 4-byte words 37-48 M, bytes ~8 M. A copy moves bits as they are (no
    arithmetic, NaN payloads kept; checked in the tests)."""
    if not rows.is_contiguous():
        rows = rows.contiguous()
    for dtype, size in ((torch.complex128, 16), (torch.int32, 4)):
        if (
            target.shape[1] % size == 0
            and target.stride(0) % size == 0
            and target.data_ptr() % size == 0
            and rows.data_ptr() % size == 0
        ):
            target.view(dtype).index_copy_(0, ids, rows.view(dtype))
            return
    target.index_copy_(0, ids, rows)
