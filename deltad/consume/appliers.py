"""Appliers: write decoded windows (:class:`deltad.consume.window.RankDelta`) into inference tables.

Every applier writes exactly the rows and columns it is given:
``table[ids, col_start:col_end] = values`` cast to the table's dtype, and nothing else.

Atomicity: a lock, not a double buffer. A window touches a small fraction of a table, so
copying whole tables (double buffering) would cost twice the memory of models whose tables
are the largest thing on the host, to protect a write that takes milliseconds. Instead
:meth:`Applier.apply` validates every shard update of every rank first (nothing is written if
any is bad), then writes all of them while holding :attr:`Applier.lock`; a reader that
looks rows up inside ``with applier.reading():`` sees either none or all of a window,
across all ranks of one aligned pull.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from deltad.consume.window import RankDelta, ShardUpdate
from deltad.errors import ConsumerError


class Applier(abc.ABC):
    """The seam between the consumer library and a predictor's tables."""

    def __init__(self) -> None:
        self.lock = threading.RLock()

    @abc.abstractmethod
    def table(self, name: str, num_rows: int, dim: int, *, resync: bool) -> torch.Tensor:
        """The 2-D tensor to write ``name`` into (may allocate; raises ConsumerError)."""

    def tables(self) -> dict[str, torch.Tensor]:
        """The tables as they are now, by name (for checks and snapshots)."""
        return {}

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold this while looking rows up: no window is half applied inside it."""
        with self.lock:
            yield

    def _begin(self) -> None:
        """A window's checks start: tables ``table`` allocates now are staged, not held."""
        return None  # tables that are never replaced (TorchRecApplier) stage nothing

    def _install(self) -> None:
        """Every shard update passed its checks: the staged tables replace the held ones."""
        return None  # tables that are never replaced (TorchRecApplier) stage nothing

    def _discard(self) -> None:
        """A shard update failed its checks: the staged tables are dropped, the held ones stay."""
        return None  # tables that are never replaced (TorchRecApplier) stage nothing

    def apply(self, deltas: Sequence[RankDelta]) -> int:
        """Write every shard update of ``deltas`` atomically; return the number of rows written."""
        with self.lock:
            plan: list[tuple[torch.Tensor, ShardUpdate]] = []
            self._begin()
            try:
                for d in deltas:
                    for s in d.shards:
                        if s.values is None:
                            raise ConsumerError(
                                f"rank {d.rank}: table {s.shard.table} has no values "
                                f"(form {d.form.value})"
                            )
                        t = self.table(
                            s.shard.table, s.shard.num_rows, s.shard.dim, resync=d.resync
                        )
                        _check(t, s)
                        plan.append((t, s))
            except BaseException:
                self._discard()
                raise
            self._install()
            rows = 0
            with torch.no_grad():
                for t, s in plan:
                    rows += _write(t, s)
            return rows


def _check(t: torch.Tensor, s: ShardUpdate) -> None:
    assert s.values is not None
    if t.dim() != 2 or t.shape[0] != s.shard.num_rows or t.shape[1] != s.shard.dim:
        raise ConsumerError(
            f"table {s.shard.table}: held shape {tuple(t.shape)} != sent ({s.shard.num_rows}, {s.shard.dim})"
        )
    if not 0 <= s.shard.col_start <= s.shard.col_end <= s.shard.dim:
        raise ConsumerError(
            f"table {s.shard.table}: bad column range {s.shard.col_start}:{s.shard.col_end}"
        )
    if s.values.shape != (s.ids.numel(), s.shard.width):
        raise ConsumerError(
            f"table {s.shard.table}: values {tuple(s.values.shape)} != ({s.ids.numel()}, {s.shard.width})"
        )
    if s.ids.numel() and (int(s.ids.min()) < 0 or int(s.ids.max()) >= s.shard.num_rows):
        raise ConsumerError(f"table {s.shard.table}: row id out of range [0, {s.shard.num_rows})")


def _write(t: torch.Tensor, s: ShardUpdate) -> int:
    assert s.values is not None
    n = s.ids.numel()
    if n == 0:
        return 0
    ids = s.ids.to(device=t.device, dtype=torch.int64)
    values = s.values.to(device=t.device, dtype=t.dtype)
    target = (
        t
        if (s.shard.col_start, s.shard.col_end) == (0, t.shape[1])
        else t[:, s.shard.col_start : s.shard.col_end]
    )
    target.index_copy_(0, ids, values)
    return n


class TensorDictApplier(Applier):
    """Tables kept as a plain ``{name: 2-D tensor}`` dict.

    Tables missing from the dict are allocated (zeros, ``dtype``) on first sight; a resync
    whose shape differs from the held table replaces it with a new one. Either takes effect
    only with the window: one that fails its checks leaves the held tables as they were.
    """

    def __init__(
        self, tables: dict[str, torch.Tensor] | None = None, *, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self._tables: dict[str, torch.Tensor] = tables if tables is not None else {}
        self._staged: dict[str, torch.Tensor] = {}
        self.dtype = dtype

    def table(self, name: str, num_rows: int, dim: int, *, resync: bool) -> torch.Tensor:
        t = self._staged.get(name)
        if t is not None:
            return t
        t = self._tables.get(name)
        if t is None or (resync and tuple(t.shape) != (num_rows, dim)):
            dtype = self.dtype if t is None else t.dtype
            t = torch.zeros(num_rows, dim, dtype=dtype)
            self._staged[name] = t  # held only once the whole window passed its checks
        return t

    def _begin(self) -> None:
        self._staged = {}

    def _install(self) -> None:
        self._tables.update(self._staged)
        self._staged = {}

    def _discard(self) -> None:
        self._staged = {}

    def tables(self) -> dict[str, torch.Tensor]:
        return self._tables


class TorchRecApplier(Applier):
    """Writes into an unsharded TorchRec inference model, in place.

    Every ``EmbeddingCollection`` (``embeddings[table].weight``) and
    ``EmbeddingBagCollection`` (``embedding_bags[table].weight``) inside ``module`` (or
    ``module`` itself) provides its tables by name. Unknown tables or other shapes raise
    ConsumerError: the inference model's layout is fixed.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self._tables = torchrec_tables(module)
        if not self._tables:
            raise ConsumerError("no EmbeddingCollection / EmbeddingBagCollection in the module")

    def table(self, name: str, num_rows: int, dim: int, *, resync: bool) -> torch.Tensor:
        try:
            return self._tables[name]
        except KeyError:
            raise ConsumerError(f"table {name!r} is not in the inference model") from None

    def tables(self) -> dict[str, torch.Tensor]:
        return dict(self._tables)


def torchrec_tables(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{table: weight}`` of every unsharded EC / EBC in ``module`` (weights, not copies)."""
    from torchrec.modules.embedding_modules import (
        EmbeddingBagCollection,
        EmbeddingCollection,
    )

    out: dict[str, torch.Tensor] = {}
    for m in module.modules():
        bank: Mapping[str, torch.nn.Module]
        if isinstance(m, EmbeddingCollection):
            bank = m.embeddings
        elif isinstance(m, EmbeddingBagCollection):
            bank = m.embedding_bags
        else:
            continue
        for name, emb in bank.items():
            if name in out:
                raise ConsumerError(f"table {name!r} appears twice in the inference model")
            weight = emb.weight
            assert isinstance(weight, torch.Tensor)
            out[name] = weight
    return out
