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

Streamed resyncs (bootstrap memory): a resync window carries every row of its tables, so
assembling it and then writing it costs twice the tables. :meth:`Applier.stage` (the one hook
for this) returns a :class:`ResyncStage`: the consumer library (``DeltaConsumer.sync`` /
``pull(applier=...)``) writes each RowChunk of a resync window into the stage's tables as it
arrives, one chunk's rows at a time, and :meth:`Applier.apply` installs the stage with the rest
of the window (the windows carry it in ``RankDelta.stage``). A stage is installed whole or
not at all: a broken stream, a failed check or a dropped multi-rank pull discards it and the
held tables never saw any of it. Appliers whose ``stage()`` returns None (the default, e.g.
:class:`TorchRecApplier`) get assembled windows as before.

Managed-collision tables (:mod:`deltad.consume.mc`): an update's ``raw_ids`` (the raw id each
listed slot now holds) go into the applier's slot map of the table -- for
:class:`TorchRecApplier` the float MC-EC / MC-EBC's remapper buffers, for
:class:`TensorDictApplier` a plain :class:`~deltad.consume.mc.SlotMap` (:meth:`Applier.slot_maps`)
-- planned with the window's checks and installed under the same lock as its rows: a reader
inside ``reading()`` sees a slot's row and its raw id from the same window.

Dense state (``RankDelta.dense``: the trainer's parameters and buffers outside its tables, at
the window's step): :class:`TorchRecApplier` copies it into the model's other state_dict
entries, checked with the window's rows and written after them under the same lock (as
:class:`~deltad.consume.quant.QuantApplier` does), so a reader inside ``reading()`` sees rows
and dense weights of one step. :class:`TensorDictApplier` holds tables only and ignores it.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from deltad.consume.mc import IdentityUpdates, Remapper, SlotMap, identities_of, remappers
from deltad.consume.window import INPUT_ERRORS, RankDelta, ResyncStage, ShardUpdate, refused
from deltad.errors import ConfigError, ConsumerError
from deltad.types import Shard


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

    def stage(self) -> ResyncStage | None:
        """A new stage to stream one pull's resync windows into, or None (the default): this
        applier takes assembled windows only. See :class:`ResyncStage`."""
        return None

    def _begin(self) -> None:
        """A window's checks start: tables ``table`` allocates now are staged, not held."""
        return None  # tables that are never replaced (TorchRecApplier) stage nothing

    def _install(self) -> None:
        """Every shard update passed its checks: the staged tables replace the held ones."""
        return None  # tables that are never replaced (TorchRecApplier) stage nothing

    def _discard(self) -> None:
        """A shard update failed its checks: the staged tables are dropped, the held ones stay."""
        return None  # tables that are never replaced (TorchRecApplier) stage nothing

    #: Refuse a window whose identities contradict the held map (an evicted raw id still
    #: held, ...); False: the window's identities win (see :meth:`SlotMap.plan`).
    strict_identities = True

    def slot_maps(self) -> dict[str, SlotMap]:
        """The managed-collision tables' slot -> raw id maps, by table (none by default)."""
        return {}

    def _slot_map(self, table: str, num_rows: int, sent: bool) -> SlotMap | None:
        """The slot map ``table``'s raw ids go into (``sent``: the update has raw ids; None:
        the table has no identities here). Default: the maps of :meth:`slot_maps`."""
        return self.slot_maps().get(table)

    def apply(self, deltas: Sequence[RankDelta]) -> int:
        """Write every shard update of ``deltas`` atomically; return the number of rows written.

        A window that fails a check (:class:`~deltad.errors.WindowRefused`) is not applied at
        all: the tables, slot maps and dense state keep what they held."""
        with self.lock:
            plan: list[tuple[torch.Tensor, ShardUpdate]] = []
            stages = stages_of(deltas, self)
            self._begin()
            try:
                idents = IdentityUpdates.new()
                maps: dict[str, SlotMap] = {}
                for st in stages:
                    st.prepare()
                    if isinstance(st, _TensorStage):  # raw ids of streamed chunks
                        for name in st.identities.tables():
                            m = self._identity_target(name, st.table_rows[name], True)
                            assert m is not None
                            maps[name] = m
                        idents.extend(st.identities)
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
                        raw_ids, evicted = identities_of(s)
                        m = self._identity_target(
                            s.shard.table, s.shard.num_rows, raw_ids is not None
                        )
                        if m is not None:
                            maps[s.shard.table] = m
                            idents.add(s.shard.table, s.ids, raw_ids, evicted)
                        plan.append((t, s))
                id_plans = idents.plan(maps, strict=self.strict_identities)
                dense_plan = self._plan_dense(deltas)
            except INPUT_ERRORS as e:  # nothing written: the window is refused whole
                self._discard()
                for st in stages:
                    st.discard("apply failed its checks")
                raise refused(e) from e
            except BaseException:
                self._discard()
                for st in stages:
                    st.discard("apply failed its checks")
                raise
            rows = 0
            with torch.no_grad():
                for st in stages:  # before the rest: other ranks' rows may go on top
                    rows += st.rows
                    st.commit()
                self._install()
                for t, s in plan:
                    rows += _write(t, s)
                for name, p in id_plans.items():
                    maps[name].install(p)
                self._installed_maps(maps)
                for target, value in dense_plan:  # after the rows, as QuantApplier does
                    target.copy_(value)
            return rows

    def _identity_target(self, table: str, num_rows: int, sent: bool) -> SlotMap | None:
        """The slot map an update of ``table`` goes into (``sent``: it has raw ids; None: an
        ordinary table); ConsumerError if one side has identities and the other not."""
        m = self._slot_map(table, num_rows, sent)
        if m is None:
            if sent:
                raise ConsumerError(
                    f"table {table}: raw ids sent for a table the serving model has no "
                    f"managed-collision module for"
                )
            return None
        if not sent:
            raise ConsumerError(
                f"table {table} is managed-collision: its rows need raw ids aligned with "
                f"their slots"
            )
        return m

    def _installed_maps(self, maps: dict[str, SlotMap]) -> None:
        """The window's slot maps were installed (new ones are held from now on)."""
        return None

    def _plan_dense(self, deltas: Sequence[RankDelta]) -> list[tuple[torch.Tensor, Any]]:
        """``(target, value)`` copies of the windows' dense states (checked; ConsumerError
        for one the tables' holder cannot take). Default: none, the dense state is not
        applied (an applier of tables only)."""
        return []


def stages_of(deltas: Sequence[RankDelta], applier: Applier) -> list[ResyncStage]:
    """The distinct stages ``deltas`` were streamed into; ConsumerError if one belongs to
    another applier (its rows would be lost)."""
    out: list[ResyncStage] = []
    for d in deltas:
        st = getattr(d, "stage", None)
        if st is None or any(st is x for x in out):
            continue
        if not isinstance(st, ResyncStage) or st.applier is not applier:
            raise ConsumerError(
                f"rank {d.rank}: this window was staged into another applier (pull(applier=) "
                f"and apply must use the same one)"
            )
        out.append(st)
    return out


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
    start = row_run(ids)
    if start is not None:  # a base's rows come in order: a plain copy
        target[start : start + n].copy_(values)
    else:
        target.index_copy_(0, ids, values)
    return n


def row_run(ids: torch.Tensor) -> int | None:
    """``ids[0]`` if ``ids`` are ``ids[0], ids[0] + 1, ...`` (rows in order, as a base sends
    them: copied as one block instead of row by row), else None."""
    n = ids.numel()
    if n < 2:
        return int(ids[0]) if n == 1 else None
    start = int(ids[0])
    if int(ids[-1]) - start != n - 1:
        return None
    return start if bool((ids[1:] - ids[:-1] == 1).all()) else None


class TensorDictApplier(Applier):
    """Tables kept as a plain ``{name: 2-D tensor}`` dict.

    Tables missing from the dict are allocated (zeros, ``dtype``) on first sight; a resync
    whose shape differs from the held table replaces it with a new one. Either takes effect
    only with the window: one that fails its checks leaves the held tables as they were.
    Tables (and ``dtype``) must be floating-point: rows are written into them as they are
    (ConfigError otherwise, at construction).

    Tables only: the dense state a window carries (``RankDelta.dense``, on rank 0's window:
    ``PullResult.dense``) is not applied; load it into your model yourself, or use
    :class:`TorchRecApplier` / :class:`~deltad.consume.quant.QuantApplier`, which apply it.
    """

    def __init__(
        self, tables: dict[str, torch.Tensor] | None = None, *, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ConfigError(f"TensorDictApplier: dtype {dtype} is not a floating-point dtype")
        for name, t in (tables or {}).items():
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"TensorDictApplier: table {name!r} is not a tensor")
            if not t.dtype.is_floating_point:
                raise ConfigError(
                    f"TensorDictApplier: table {name!r} has dtype {t.dtype}, not a "
                    f"floating-point dtype: rows would be truncated into it"
                )
        self._tables: dict[str, torch.Tensor] = tables if tables is not None else {}
        self._staged: dict[str, torch.Tensor] = {}
        self.dtype = dtype
        #: managed-collision tables (a map from the first update with raw ids; a resync
        #: streamed into a stage brings no raw ids, so a map may lack identities: not strict)
        self._maps: dict[str, SlotMap] = {}
        self.strict_identities = False

    def slot_maps(self) -> dict[str, SlotMap]:
        return dict(self._maps)

    def _slot_map(self, table: str, num_rows: int, sent: bool) -> SlotMap | None:
        m = self._maps.get(table)
        if m is None and not sent:
            return None
        if m is None or m.size != num_rows:  # held only once the window passed its checks
            return SlotMap.empty(table, num_rows)
        return m

    def _installed_maps(self, maps: dict[str, SlotMap]) -> None:
        self._maps.update(maps)

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

    def stage(self) -> ResyncStage:
        """Resync rows streamed into staged tables (see :class:`ResyncStage`)."""
        return _TensorStage(self)


#: rows per copy when a staged table's written rows go into a held one
_COPY_ROWS = 65536


class _TensorStage(ResyncStage):
    """A :class:`TensorDictApplier`'s stage. A table the applier does not hold (or holds in
    another shape) is staged as a new zero table and installed as it is, as ``apply`` does with
    an assembled resync; a held table of the same shape is staged in a scratch tensor whose
    written cells (rows x the shard's columns, tracked per column range) are copied into the
    held table in place at install, so the rows a window does not carry keep their values and
    references to the held tensor stay valid, exactly as an assembled resync writes it."""

    def __init__(self, applier: TensorDictApplier) -> None:
        super().__init__(applier)
        self._applier = applier
        self._fresh: dict[str, torch.Tensor] = {}
        #: name -> (scratch, held)
        self._over: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        #: (name, col_start, col_end) -> bool [num_rows]: rows written (tables in _over)
        self._written: dict[tuple[str, int, int], torch.Tensor] = {}
        #: raw ids of the managed-collision chunks written here, and their tables' rows
        self.identities = IdentityUpdates.new()
        self.table_rows: dict[str, int] = {}

    def _target(self, name: str) -> torch.Tensor | None:
        t = self._fresh.get(name)
        return t if t is not None else self._over[name][0] if name in self._over else None

    def _open(self, shard: Shard, packed_row_bytes: int) -> bool:
        if packed_row_bytes:  # packed rows are for QuantApplier: apply refuses them as before
            return False
        if shard.table in self._applier._maps:  # managed-collision: assembled with its raw ids
            return False
        name, shape = shard.table, (shard.num_rows, shard.dim)
        t = self._target(name)
        if t is None:
            held = self._applier._tables.get(name)
            if held is None or tuple(held.shape) != shape:
                dtype = self._applier.dtype if held is None else held.dtype
                self._fresh[name] = t = torch.zeros(*shape, dtype=dtype)
            else:
                t = torch.empty_like(held)  # pages are touched only where rows are written
                self._over[name] = (t, held)
        if tuple(t.shape) != shape:
            raise ConsumerError(f"table {name}: staged shape {tuple(t.shape)} != sent {shape}")
        key = (name, shard.col_start, shard.col_end)
        if name in self._over and key not in self._written:
            self._written[key] = torch.zeros(shard.num_rows, dtype=torch.bool)
        return True

    def _write(self, update: ShardUpdate) -> int:
        s = update.shard
        t = self._target(s.table)
        if t is None:
            raise ConsumerError(f"table {s.table}: rows of a slice the header did not announce")
        _check(t, update)
        raw_ids, evicted = identities_of(update)
        if raw_ids is not None or evicted is not None:
            with self._lock:
                self.identities.add(s.table, update.ids, raw_ids, evicted)
                self.table_rows[s.table] = s.num_rows
        with torch.no_grad():
            n = _write(t, update)
        mask = self._written.get((s.table, s.col_start, s.col_end))
        if mask is not None and n:
            mask[update.ids] = True
        return n

    def prepare(self) -> None:
        super().prepare()
        for name, (_, held) in self._over.items():
            if self._applier._tables.get(name) is not held:
                raise ConsumerError(f"table {name} was replaced while its resync was staged")
        self._applier._staged.update(self._fresh)  # installed with the window

    def commit(self) -> None:
        for (name, a, b), mask in self._written.items():
            scratch, held = self._over[name]
            ids = mask.nonzero().squeeze(1)
            whole = (a, b) == (0, held.shape[1])
            if ids.numel() == held.shape[0] and whole:
                held.copy_(scratch)
                continue
            src = scratch if whole else scratch[:, a:b]
            dst = held if whole else held[:, a:b]
            for i in range(0, ids.numel(), _COPY_ROWS):
                part = ids[i : i + _COPY_ROWS]
                dst.index_copy_(0, part.to(dst.device), src.index_select(0, part.to(src.device)))
        with self._lock:
            self.installed = True
            self._release()

    def _release(self) -> None:
        self._fresh, self._over, self._written = {}, {}, {}
        self.identities, self.table_rows = IdentityUpdates.new(), {}


class TorchRecApplier(Applier):
    """Writes into an unsharded TorchRec inference model, in place.

    Every ``EmbeddingCollection`` (``embeddings[table].weight``) and
    ``EmbeddingBagCollection`` (``embedding_bags[table].weight``) inside ``module`` (or
    ``module`` itself) provides its tables by name. Unknown tables or other shapes raise
    ConsumerError: the inference model's layout is fixed. A managed-collision table (inside a
    float MC-EC / MC-EBC) also has its MCH remapper rebuilt from the windows' raw ids (the
    float serving path of MC models; forwards inside ``reading()``).

    Dense weights are the module's other state_dict entries and buffers (by state_dict name,
    a DMP's ``module.`` prefix accepted): a window's dense state (``RankDelta.dense``) is
    copied into them, cast to their dtype, after the rows and under the same lock, as
    :class:`~deltad.consume.quant.QuantApplier` does; a dense tensor the module lacks, or of
    another shape, fails the window's checks (ConsumerError, nothing written).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self._tables = torchrec_tables(module)
        if not self._tables:
            raise ConsumerError("no EmbeddingCollection / EmbeddingBagCollection in the module")
        #: managed-collision tables: the float MCH modules' remappers (put in eval mode)
        self._remappers = remappers(module)
        self._dense = float_dense_state(module)

    @property
    def dense_names(self) -> list[str]:
        """state_dict names of the dense weights a window's dense state is copied into."""
        return sorted(self._dense)

    def _plan_dense(self, deltas: Sequence[RankDelta]) -> list[tuple[torch.Tensor, Any]]:
        state: dict[str, torch.Tensor] = {}
        for d in deltas:
            state.update(getattr(d, "dense", None) or {})
        return plan_dense(self._dense, state)

    def apply_dense(self, state: Mapping[str, torch.Tensor]) -> int:
        """Copy ``state`` (state_dict names) into the dense weights under the lock; return
        the number of tensors written."""
        with self.lock:
            plan = plan_dense(self._dense, state)
            with torch.no_grad():
                for target, value in plan:
                    target.copy_(value)
            return len(plan)

    def slot_maps(self) -> dict[str, SlotMap]:
        return dict(self._remappers)

    @property
    def remappers(self) -> dict[str, Remapper]:
        return dict(self._remappers)

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


def float_dense_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict entries (and non-persistent buffers) of an unsharded float model outside
    its EC / EBC and managed-collision modules, by state_dict name (the tensors, shared): what
    the trainer publishes as its dense state (see :mod:`deltad.publish.dense`)."""
    from torchrec.modules.embedding_modules import (
        EmbeddingBagCollection,
        EmbeddingCollection,
    )
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection
    from torchrec.modules.mc_modules import ManagedCollisionCollection

    kinds = (
        EmbeddingBagCollection,
        EmbeddingCollection,
        BaseManagedCollisionEmbeddingCollection,
        ManagedCollisionCollection,
    )
    skip = tuple(f"{fqn}." for fqn, m in module.named_modules() if isinstance(m, kinds))
    if "." in skip:  # the module is itself one: nothing dense
        return {}
    out: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if not name.startswith(skip):
            out[name] = value.data if isinstance(value, torch.nn.Parameter) else value
    for name, buf in module.named_buffers():
        if name not in out and not name.startswith(skip):
            out[name] = buf
    return out


def plan_dense(
    targets: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]
) -> list[tuple[torch.Tensor, Any]]:
    """``(target, value)`` copies of ``state`` (state_dict names; a DMP's ``module.`` prefix
    is accepted) into ``targets``, values cast to the targets' dtype and device;
    ConsumerError for a name ``targets`` lacks or a shape that differs."""
    plan: list[tuple[torch.Tensor, Any]] = []
    for name, value in state.items():
        target = targets.get(name)
        if target is None and name.startswith("module."):
            target = targets.get(name[len("module.") :])
        if target is None:
            raise ConsumerError(f"dense weight {name!r} is not in the serving model")
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(target.shape):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
            raise ConsumerError(f"dense weight {name}: sent {shape}, served {tuple(target.shape)}")
        plan.append((target, value.detach().to(device=target.device, dtype=target.dtype)))
    return plan
