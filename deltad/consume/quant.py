"""Apply windows to a TorchRec *quantized inference model*, in place, while it serves.

The model is what ``torchrec.inference.modules.quantize_embeddings`` builds (see
:func:`quantize_model`): every ``torchrec.quant`` EmbeddingBagCollection / EmbeddingCollection
keeps its tables in fbgemm ``IntNBitTableBatchedEmbeddingBagsCodegen`` modules (TBEs), several
tables per TBE, each table a run of rows in the TBE's ``weights_host`` byte buffer. A row is

* int8 / int4: fp16 scale, fp16 bias, then the codes (``dim`` bytes, or ``dim / 2`` bytes two
  codes a byte), zero padded to fbgemm's row alignment (16 bytes on CPU);
* fp16 / fp32: the values, padded likewise.

:class:`QuantApplier` finds each table's rows as a ``[num_rows, row_bytes]`` uint8 view of
that buffer (``split_embedding_weights_with_scale_bias(0)``; the quant module's state_dict
shares the same storage; :mod:`deltad.consume.tbe`), packs float rows exactly as torchrec's
quantization does (``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`` for int8 / int4, a cast
for fp16 / fp32; see :func:`pack_rows`, which is :func:`deltad.wire.pack_rows`, the sidecar's
packer), and copies whole rows in with ``index_copy_`` (as 16- or 4-byte words;
:mod:`deltad.consume.inplace`). Bytes and forward outputs are
therefore equal to quantizing the updated float tables from scratch. Rows that arrive
already packed (``ShardUpdate.packed``, a pull in :func:`packed_wire_dtype`: uint8, the
table's row layout above, with any zero padding) are copied as they are; a packed
pull sends the shards it cannot pack (column-wise shards) as fp32 values, handled below.

Bit-exactness needs the trainer's float values: pull with wire dtype ``fp32`` (or ``fp16``
for fp16 tables, or packed rows). Rows that travelled as ``int8`` / ``bf16`` arrive
already rounded, and re-quantizing them is close to, not equal to, torchrec's bytes.
A packed wire dtype must be the table's own layout (:func:`packed_wire_dtype`: packed-int8
for int8 tables, packed-int4 for int4, packed-fp16 for fp16): other packed rows would be
copied in as bytes of another layout, so a window of them raises ConfigError before
anything is written (:meth:`QuantApplier.check_wire_dtype` checks pull options up front).

Column shards (column-wise sharded tables, one shard per rank): an int8 / int4 row is
quantized over the full row and cannot be decoded back exactly, so the applier keeps a float
*shadow* of such a table (allocated on its first column shard: 4 bytes per element plus a
1-byte "known" mask) holding the newest value of every column. A column shard updates the
shadow; each row it touches is packed from the shadow and written once every column of it
has been received at least once (until then, :attr:`QuantApplier.pending_rows`, the model
serves that row's previous bytes). With rows, one aligned pull completes every touched row;
with top-k, ranks pick their rows independently and the shadow lets a row be re-packed from
its newest columns whichever rank sends next, so once nothing is owed every row is exact.
fp16 / fp32 rows decode exactly: a column shard is merged with the row as served and
written at once, no shadow.

What a forward observes mid-apply (:class:`~deltad.types.ApplyConsistency`): a forward runs
inside :meth:`QuantApplier.serving` (a shared read lock; several forwards run at once); the
applier packs every row *before* it takes the write lock, then

* ``CHUNK`` (default): takes the write lock once per chunk of ``chunk_rows`` rows. A forward
  waits at most one chunk's copy (microseconds to a millisecond) and sees every row either
  wholly old or wholly new, never torn; rows of one window may be mixed old and new, and the
  dense weights (written in one chunk of their own, after the rows) may be one version
  behind the rows for the duration of the apply.
* ``WINDOW``: holds the write lock for the whole window's copy (rows then dense). A forward
  sees none or all of a window and waits for the whole copy.

Writers wait for forwards in flight and new forwards wait for a waiting writer (writer
preference), so an apply is never starved by a stream of forwards.

Managed-collision tables (torchrec's ``QuantManagedCollisionEmbedding(Bag)Collection``: the
quantized tables behind a float MCH remapper; see :mod:`deltad.consume.mc`): a window's raw
ids rebuild the remapper's lookup buffers (``_mch_sorted_raw_ids``,
``_mch_remapped_ids_mapping``), computed outside the lock and copied in one write-lock hold
*together with the rows of every slot whose raw id changed* (with ``CHUNK`` as with
``WINDOW``). So a forward maps each raw id either with the old map to the old slot's row as
it was, or with the new map to the new slot's row as the window sets it: never a slot's new
row under its old raw id, or the reverse. Rows of slots that keep their raw id are written
chunk by chunk like any table's (old or new per row); a resync streamed into a stage writes all
of a managed-collision table's rows in that hold. A resync of a managed-collision table is
not streamed into a stage (:meth:`ResyncStage.open` declines it): it is assembled with its
raw ids and applied as one window (its rows cost twice their size during a bootstrap).

Streamed resyncs (:meth:`QuantApplier.stage`, used by ``DeltaConsumer.sync(applier.apply)``):
a resync window's whole-row shards are packed chunk by chunk, as they arrive, into a staging
copy of each table's rows (``[num_rows, row_bytes]`` uint8, pages touched only where rows are
written, plus a 1-byte written mask per row); the serving rows are untouched until ``apply``
copies the written rows in, under the same consistency as any window (``CHUNK``: write lock
per ``chunk_rows`` rows; ``WINDOW``: one hold for the whole window). A stream that breaks
discards the staging copy. Column shards still take the assembled path (the shadow above).

Sharded quantized models: torchrec 1.8 cannot shard a quantized model for inference on a
CPU-only build (``shard_quant_model(..., compute_device="cpu")`` asserts CUDA); see
``tests/test_quant_applier.py::test_shard_quant_model_needs_cuda``. The applier therefore
handles unsharded quantized modules, which is how a CPU predictor serves them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from deltad.consume.appliers import Applier, ResyncStage, plan_dense, row_run, stages_of
from deltad.consume.inplace import ApplyStats, ServingLock, copy_rows, write_window
from deltad.consume.mc import IdentityUpdates, Remapper, identities_of, remappers
from deltad.consume.tbe import (
    SCALE_BIAS_BYTES,
    QuantTable,
    data_row_bytes,
    dense_state,
    pack_rows,
    packed_wire_dtype,
    quant_tables,
    quantize_model,
    serve_torch_dtype,
    table_rows,
)
from deltad.consume.window import INPUT_ERRORS, RankDelta, ShardUpdate, refused
from deltad.errors import ConfigError, ConsumerError, UnsupportedModelError
from deltad.types import ApplyConsistency, Shard, WireDtype

__all__ = [  # the tables (deltad.consume.tbe) and the writing (deltad.consume.inplace) too
    "SCALE_BIAS_BYTES",
    "ApplyStats",
    "QuantApplier",
    "QuantTable",
    "ServingLock",
    "data_row_bytes",
    "pack_rows",
    "packed_wire_dtype",
    "quant_tables",
    "quantize_model",
    "serve_torch_dtype",
]

_R = TypeVar("_R")


@dataclass
class _Shadow:
    """Float copy of an int table fed by column shards: newest values, columns received."""

    values: torch.Tensor  # float32 [num_rows, dim]
    known: torch.Tensor  # bool [num_rows, dim]


class QuantApplier(Applier):
    """Writes windows into a quantized TorchRec inference model while it serves forwards.

    ``model`` is the quantized model (:func:`quantize_model`); its tables are found by name.
    Dense weights are its other state_dict entries (by state_dict name). Forwards run inside
    :meth:`serving` (or through :meth:`serve`); see the module docstring for what they see.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        consistency: ApplyConsistency = ApplyConsistency.CHUNK,
        chunk_rows: int = 4096,
        lock_timeout_s: float = 60.0,
    ) -> None:
        super().__init__()
        if chunk_rows < 1:
            raise ConfigError("chunk_rows must be >= 1")
        self.model = model
        self.consistency = ApplyConsistency(consistency)
        self.chunk_rows = chunk_rows
        self.serving_lock = ServingLock(lock_timeout_s)
        self._apply_mutex = threading.Lock()  # one writer at a time
        self._tables = quant_tables(model)
        if not self._tables:
            raise UnsupportedModelError("no torchrec.quant EmbeddingBagCollection / Collection")
        self._dense = dense_state(model)
        self._shadows: dict[str, _Shadow] = {}
        #: managed-collision tables: their remappers (rebuilt from the windows' raw ids)
        self._remappers = remappers(model)
        self.stats = ApplyStats()

    # -- the Applier seam ---------------------------------------------------------------

    def table(self, name: str, num_rows: int, dim: int, *, resync: bool) -> torch.Tensor:
        return self._table(name, num_rows, dim).rows

    def stage(self) -> ResyncStage:
        """Resync rows streamed into staging copies (see the module docstring)."""
        return _QuantStage(self)

    def tables(self) -> dict[str, torch.Tensor]:
        """``{table: uint8 [num_rows, row_bytes]}`` views of the serving rows (not copies)."""
        return {n: t.rows for n, t in self._tables.items()}

    @property
    def quant_tables(self) -> dict[str, QuantTable]:
        return dict(self._tables)

    @property
    def dense_names(self) -> list[str]:
        return sorted(self._dense)

    def check_wire_dtype(
        self, wire_dtype: WireDtype | str, tables: Sequence[str] | None = None
    ) -> None:
        """ConfigError unless rows of ``wire_dtype`` can go into ``tables`` (None: every
        table): a packed wire dtype must be each table's own row layout
        (:func:`packed_wire_dtype`); float wire dtypes are quantized on apply. ``apply``
        checks every window so; call it with ``PullOptions.wire_dtype`` to fail before a pull."""
        try:
            wire = WireDtype(wire_dtype)
        except ValueError:
            raise ConfigError(f"wire dtype {wire_dtype!r} is not a wire dtype") from None
        if not wire.packed:
            return
        for name in sorted(self._tables) if tables is None else tables:
            t = self._tables.get(name)
            if t is None:
                continue  # the window's checks refuse an unknown table
            want = packed_wire_dtype(t.dtype)
            if want is not wire:
                use = want.value if want.packed else "fp32 (or fp16)"
                raise ConfigError(
                    f"table {name}: {wire.value} rows are not the layout of its "
                    f"{t.dtype.value} rows (they would be copied in as they are): pull with "
                    f"wire dtype {use}"
                )

    @property
    def remappers(self) -> dict[str, Remapper]:
        """``{table: Remapper}`` of the managed-collision tables (see :mod:`deltad.consume.mc`)."""
        return dict(self._remappers)

    @property
    def pending_rows(self) -> int:
        """Rows with some but not all columns received (int tables of column-wise shards)."""
        return sum(
            int((sh.known.any(dim=1) & ~sh.known.all(dim=1)).sum()) for sh in self._shadows.values()
        )

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self.serving_lock.read():
            yield

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Run a forward inside this: it never sees a torn row (see the module docstring)."""
        with self.serving_lock.read(), torch.inference_mode():
            yield

    def serve(self, fn: Callable[..., _R]) -> Callable[..., _R]:
        """``fn`` (e.g. ``model.forward``) wrapped in :meth:`serving`."""

        def wrapped(*args: Any, **kwargs: Any) -> _R:
            with self.serving():
                return fn(*args, **kwargs)

        return wrapped

    # -- applying -----------------------------------------------------------------------

    def apply(self, deltas: Sequence[RankDelta]) -> int:
        """Write every shard update (and each delta's ``dense``) of ``deltas``; return rows written.

        Every shard update is checked before anything is written; rows are packed outside the lock.
        """
        with self._apply_mutex:
            t0 = time.perf_counter()
            stages = stages_of(deltas, self)
            try:
                self._check_wire(deltas)
                staged: list[tuple[QuantTable, torch.Tensor | None, torch.Tensor]] = []
                idents = IdentityUpdates.new()
                for st in stages:
                    st.prepare()
                    assert isinstance(st, _QuantStage)
                    staged += st.copies()
                plan = self._plan(deltas, idents)
                id_plans = {  # a map no slot of which changed is not rewritten
                    k: p for k, p in idents.plan(self._remappers).items() if p.changed.numel()
                }
                dense: dict[str, torch.Tensor] = {}
                for d in deltas:
                    dense.update(getattr(d, "dense", None) or {})
                dense_plan = plan_dense(self._dense, dense)
            except INPUT_ERRORS as e:  # nothing written: the window is refused whole
                for st in stages:
                    st.discard("apply failed its checks")
                raise refused(e) from e
            except BaseException:
                for st in stages:
                    st.discard("apply failed its checks")
                raise
            for t, _, _ in staged:  # a base restarts the table: columns seen before are void
                self._shadows.pop(t.name, None)
            t1 = time.perf_counter()
            stats = write_window(
                plan, dense_plan, staged, id_plans, remappers=self._remappers,
                lock=self.serving_lock, consistency=self.consistency, chunk_rows=self.chunk_rows,
            )  # fmt: skip
            for st in stages:
                st.commit()
            stats.pack_s = t1 - t0
            self.stats = stats
            return stats.rows

    def apply_dense(self, state: Mapping[str, torch.Tensor]) -> int:
        """Copy ``state`` (state_dict names) into the model's dense params/buffers, at once."""
        with self._apply_mutex:
            plan = plan_dense(self._dense, state)
            stats = write_window(
                [], plan, remappers=self._remappers, lock=self.serving_lock,
                consistency=self.consistency, chunk_rows=self.chunk_rows,
            )  # fmt: skip
            return stats.dense

    def _check_wire(self, deltas: Sequence[RankDelta]) -> None:
        """ConfigError if a window's packed rows (assembled or staged) are not in their
        table's layout (see :meth:`check_wire_dtype`)."""
        for d in deltas:
            wire = getattr(d, "wire_dtype", None)
            if wire is None or not WireDtype(wire).packed:
                continue
            names = {s.shard.table for s in d.shards if getattr(s, "packed", None) is not None}
            st = getattr(d, "stage", None)
            if isinstance(st, _QuantStage):
                names |= st.packed_tables
            self.check_wire_dtype(wire, sorted(names))

    def _table(self, name: str, num_rows: int, dim: int) -> QuantTable:
        t = self._tables.get(name)
        if t is None:
            raise ConsumerError(f"table {name!r} is not in the inference model")
        if (t.num_rows, t.dim) != (num_rows, dim):
            raise ConsumerError(
                f"table {name}: served shape ({t.num_rows}, {t.dim}) != sent ({num_rows}, {dim})"
            )
        return t

    def _check(self, d: RankDelta | None, s: ShardUpdate) -> QuantTable:
        t = self._table(s.shard.table, s.shard.num_rows, s.shard.dim)
        if not 0 <= s.shard.col_start < s.shard.col_end <= s.shard.dim:
            raise ConsumerError(
                f"table {s.shard.table}: bad column range {s.shard.col_start}:{s.shard.col_end}"
            )
        n = s.ids.numel()
        raw_ids, evicted = identities_of(s)
        if t.name in self._remappers:
            if raw_ids is None or raw_ids.shape != (n,):
                raise ConsumerError(
                    f"table {t.name} is managed-collision: its rows need raw ids aligned with "
                    f"their slots (sent {None if raw_ids is None else tuple(raw_ids.shape)})"
                )
            if not s.shard.covers_full_row:
                raise ConsumerError(
                    f"table {t.name} is managed-collision: column shards are not supported"
                )
        elif raw_ids is not None or evicted is not None:
            raise ConsumerError(
                f"table {t.name}: raw ids sent for a table the serving model has no "
                f"managed-collision module for"
            )
        packed = getattr(s, "packed", None)
        if packed is not None:
            if (s.shard.col_start, s.shard.col_end) != (0, s.shard.dim):
                raise ConsumerError(f"table {s.shard.table}: packed rows must cover every column")
            if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[0] != n:
                raise ConsumerError(
                    f"table {s.shard.table}: packed rows must be uint8 [{n}, bytes]"
                )
            if packed.shape[1] < t.data_bytes or (
                packed.shape[1] > t.row_bytes and packed[:, t.row_bytes :].any()
            ):
                raise ConsumerError(
                    f"table {s.shard.table}: packed rows of {packed.shape[1]} bytes, the table's "
                    f"{t.dtype.value} rows have {t.data_bytes} ({t.row_bytes} aligned; more "
                    f"only as zero padding)"
                )
        elif s.values is None:
            raise ConsumerError(
                f"rank {d.rank}: table {s.shard.table} has no values (form {d.form.value})"
                if d is not None
                else f"table {s.shard.table}: no values"
            )
        elif s.values.shape != (n, s.shard.width):
            raise ConsumerError(
                f"table {s.shard.table}: values {tuple(s.values.shape)} != ({n}, {s.shard.width})"
            )
        if n and (int(s.ids.min()) < 0 or int(s.ids.max()) >= s.shard.num_rows):
            raise ConsumerError(
                f"table {s.shard.table}: row id out of range [0, {s.shard.num_rows})"
            )
        return t

    def _plan(
        self, deltas: Sequence[RankDelta], idents: IdentityUpdates
    ) -> list[tuple[QuantTable, torch.Tensor, torch.Tensor]]:
        """Checked and packed ``(table, ids, rows)`` writes (column shards merged); the
        managed-collision tables' identities go into ``idents``."""
        full: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        partial: dict[str, list[ShardUpdate]] = {}
        resynced: set[str] = set()
        checked: list[tuple[QuantTable, ShardUpdate]] = []
        for d in deltas:
            for s in d.shards:
                checked.append((self._check(d, s), s))
                if d.resync:
                    resynced.add(s.shard.table)
        for name in resynced:  # a base restarts the table: columns seen before are void
            self._shadows.pop(name, None)
        for t, s in checked:
            if t.name in self._remappers:
                raw_ids, evicted = identities_of(s)
                idents.add(t.name, s.ids, raw_ids, evicted)
            if s.ids.numel() == 0:
                continue
            ids = s.ids.to(dtype=torch.int64, device="cpu")
            packed = getattr(s, "packed", None)
            if packed is not None:
                full.setdefault(t.name, []).append((ids, table_rows(t, packed)))
            elif (s.shard.col_start, s.shard.col_end) == (0, s.shard.dim):
                assert s.values is not None
                full.setdefault(t.name, []).append((ids, t.pack(s.values)))
                sh = self._shadows.get(t.name)
                if sh is not None:  # keep a shadow (column-sliced before) current
                    sh.values[ids] = s.values.to(torch.float32)
                    sh.known[ids] = True
            else:
                partial.setdefault(t.name, []).append(s)
        for name, updates in partial.items():
            t = self._tables[name]
            ids, values = self._merge_columns(t, updates)
            if ids.numel():
                full.setdefault(name, []).append((ids, t.pack(values)))
        plan = []
        for name, parts in full.items():
            t = self._tables[name]
            ids = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
            rows = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
            plan.append((t, ids, rows))
        return plan

    def _merge_columns(
        self, t: QuantTable, updates: list[ShardUpdate]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``(ids, float values)`` of ``updates`` whose every column is known."""
        ids = torch.unique(torch.cat([s.ids.to(torch.int64) for s in updates]))  # sorted
        if not t.quantized:  # fp rows decode exactly: merge with the row as served
            values = t.decode(ids)
            for s in updates:
                assert s.values is not None
                pos = torch.searchsorted(ids, s.ids.to(torch.int64))
                values[pos, s.shard.col_start : s.shard.col_end] = s.values.to(torch.float32)
            return ids, values
        sh = self._shadows.get(t.name)
        if sh is None:
            sh = _Shadow(
                torch.zeros(t.num_rows, t.dim, dtype=torch.float32),
                torch.zeros(t.num_rows, t.dim, dtype=torch.bool),
            )
            self._shadows[t.name] = sh
        for s in updates:
            assert s.values is not None
            rows = s.ids.to(torch.int64)
            sh.values[rows, s.shard.col_start : s.shard.col_end] = s.values.to(torch.float32)
            sh.known[rows, s.shard.col_start : s.shard.col_end] = True
        ids = ids[sh.known[ids].all(dim=1)]
        return ids, sh.values[ids]


class _QuantStage(ResyncStage):
    """A :class:`QuantApplier`'s stage: per table a staging copy of its rows and a mask of
    the rows written; whole-row shards only (column shards stay in the window)."""

    def __init__(self, applier: QuantApplier) -> None:
        super().__init__(applier)
        self._applier = applier
        #: name -> (table, staging rows uint8 [num_rows, row_bytes], written bool [num_rows])
        self._bufs: dict[str, tuple[QuantTable, torch.Tensor, torch.Tensor]] = {}
        #: tables whose rows were announced packed (their wire dtype is checked at apply)
        self.packed_tables: set[str] = set()

    def _open(self, shard: Shard, packed_row_bytes: int) -> bool:
        t = self._applier._table(shard.table, shard.num_rows, shard.dim)
        if not shard.covers_full_row:
            return False  # the shadow of the assembled path merges columns
        if t.name in self._applier._remappers:
            return False  # assembled: its raw ids come with the window, rows and map at once
        if packed_row_bytes and packed_row_bytes < t.data_bytes:
            raise ConsumerError(
                f"table {t.name}: packed rows of {packed_row_bytes} bytes, the table's "
                f"{t.dtype.value} rows have {t.data_bytes}"
            )
        if packed_row_bytes:
            self.packed_tables.add(t.name)
        if t.name not in self._bufs:
            self._bufs[t.name] = (
                t,
                torch.empty(t.num_rows, t.row_bytes, dtype=torch.uint8),
                torch.zeros(t.num_rows, dtype=torch.bool),
            )
        return True

    def _write(self, update: ShardUpdate) -> int:
        entry = self._bufs.get(update.shard.table)
        if entry is None:
            raise ConsumerError(f"table {update.shard.table}: rows of a slice not announced")
        t, buf, written = entry
        self._applier._check(None, update)
        n = update.ids.numel()
        if n == 0:
            return 0
        ids = update.ids.to(dtype=torch.int64, device="cpu")
        if update.packed is not None:
            rows = table_rows(t, update.packed)
        else:
            assert update.values is not None
            rows = t.pack(update.values)
        start = row_run(ids)
        if start is not None:  # a base's rows come in order: one block copy
            buf[start : start + n].copy_(rows)
            written[start : start + n] = True
        else:
            copy_rows(buf, ids, rows)
            written[ids] = True
        return n

    def copies(self) -> list[tuple[QuantTable, torch.Tensor | None, torch.Tensor]]:
        """``(table, ids or None: every row, staging rows)``: the rows to copy in."""
        out: list[tuple[QuantTable, torch.Tensor | None, torch.Tensor]] = []
        for t, buf, written in self._bufs.values():
            out.append((t, None if bool(written.all()) else written.nonzero().squeeze(1), buf))
        return out

    def commit(self) -> None:
        """The applier copied :meth:`copies` in: release the staging copies."""
        with self._lock:
            self.installed = True
            self._release()

    def _release(self) -> None:
        self._bufs = {}
