"""Managed-collision identities on the consumer side: which raw id each slot holds, and the
remapper lookup buffers of a served MCH module, rebuilt from it exactly as the trainer's are.

A torchrec ``MCHManagedCollisionModule`` maps a raw id to a slot with two buffers:
``_mch_sorted_raw_ids`` (the raw ids its slots hold, ascending; empty slots hold
:data:`~deltad.types.EMPTY_RAW_ID`) and ``_mch_remapped_ids_mapping`` (the slot of each,
``output_global_offset + local``); a raw id it does not find goes to its last slot. The
trainer's module re-sorts both with a *stable* ``argsort`` after every admission
(``_sort_mch_buffers``), starting from every slot empty and ``mapping = arange``; admission only
ever writes real raw ids over slots, so the empty slots keep their first order: ascending slot.
The buffers are therefore a pure function of the slot -> raw id map:
``order = argsort(slot_raw, stable=True)``, ``sorted = slot_raw[order]``,
``mapping = offset + order`` (:func:`lookup_buffers`), which is what a segment carries
(``ShardUpdate.raw_ids``, aligned with the slots ``ids``). :class:`SlotMap` keeps the map,
:class:`Remapper` binds one to a served module's buffers, :func:`remappers` finds them in a model.

Appliers plan an identity update (:meth:`SlotMap.plan`) with the rest of a window's checks and
install it (:meth:`SlotMap.install`) under the same lock as the rows (see
:mod:`deltad.consume.quant` for what a forward may observe).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deltad.errors import ConsumerError, UnsupportedModelError
from deltad.mch import lookup_buffers, slot_raw_of
from deltad.types import EMPTY_RAW_ID


@dataclass
class IdentityPlan:
    """A checked identity update of one table, computed outside any lock."""

    slot_raw: torch.Tensor  # the new slot -> raw id map (int64 [size])
    sorted_raw_ids: torch.Tensor
    mapping: torch.Tensor
    changed: torch.Tensor  # global slots whose raw id changed (int64, ascending)


class SlotMap:
    """The slot -> raw id map of one managed-collision table (``size`` slots from ``offset``)
    and its lookup buffers (:func:`lookup_buffers` of it)."""

    def __init__(self, table: str, slot_raw: torch.Tensor, offset: int = 0) -> None:
        self.table = table
        self.offset = offset
        self.slot_raw = slot_raw.to(torch.int64).clone()
        self._sorted, self._mapping = lookup_buffers(self.slot_raw, offset)

    @classmethod
    def empty(cls, table: str, size: int, offset: int = 0) -> SlotMap:
        return cls(table, torch.full((size,), EMPTY_RAW_ID, dtype=torch.int64), offset)

    @property
    def size(self) -> int:
        return int(self.slot_raw.numel())

    @property
    def sorted_raw_ids(self) -> torch.Tensor:
        """The raw ids held, ascending (empty slots last, in slot order)."""
        return self._sorted

    @property
    def mapping(self) -> torch.Tensor:
        """The global slot of each entry of :attr:`sorted_raw_ids`."""
        return self._mapping

    def plan(
        self,
        updates: Sequence[tuple[torch.Tensor, torch.Tensor]],
        evicted: Sequence[torch.Tensor] = (),
        *,
        strict: bool = True,
    ) -> IdentityPlan:
        """The map after ``updates`` (``(global slots, raw ids)`` pairs, in order: a later pair
        wins), checked: slots in range, raw ids non-negative, no raw id held by two slots, no
        ``evicted`` raw id still held. Raises ConsumerError; changes nothing.

        ``strict=False`` (a map that may lack identities, e.g. a plain slot map whose base was
        streamed without them): a slot the window does not list that holds a raw id the window
        gives another slot, or says evicted, is emptied instead of refused; a window that
        contradicts itself (a raw id it evicts given to a slot it lists) is still refused.

        The lookup buffers are sorted whole (:func:`lookup_buffers`): a merge of the changed
        entries into the held buffers measured no faster here (500 k slots, 8 k changed: ~30
        ms either way on one loaded core), and a sort cannot inherit a wrong order."""
        new = self.slot_raw.clone()
        listed = torch.zeros(self.size, dtype=torch.bool)
        for slots, raw in updates:
            slots = slots.to(device="cpu", dtype=torch.int64)
            raw = raw.to(device="cpu", dtype=torch.int64)
            if raw.shape != slots.shape:
                raise ConsumerError(
                    f"table {self.table}: {raw.numel()} raw ids for {slots.numel()} slots"
                )
            if not slots.numel():
                continue
            local = slots - self.offset
            if int(local.min()) < 0 or int(local.max()) >= self.size:
                raise ConsumerError(
                    f"table {self.table}: slot out of range [{self.offset}, "
                    f"{self.offset + self.size})"
                )
            if int(raw.min()) < 0:
                raise ConsumerError(f"table {self.table}: negative raw id {int(raw.min())}")
            new[local] = raw
            listed[local] = True
        if not strict:
            told = [r.to(device="cpu", dtype=torch.int64) for _, r in updates]
            told += [e.to(device="cpu", dtype=torch.int64) for e in evicted]
            if told:
                stale = torch.isin(new, torch.cat(told)) & ~listed & (new != EMPTY_RAW_ID)
                new[stale] = EMPTY_RAW_ID
        local_changed = (new != self.slot_raw).nonzero().view(-1)
        if local_changed.numel():
            sorted_raw, mapping = lookup_buffers(new, self.offset)
        else:
            sorted_raw, mapping = self.sorted_raw_ids, self.mapping
        held = sorted_raw[: int(torch.searchsorted(sorted_raw, EMPTY_RAW_ID))]
        if held.numel() > 1 and bool((held[1:] == held[:-1]).any()):
            dup = int(held[1:][held[1:] == held[:-1]][0])
            raise ConsumerError(f"table {self.table}: raw id {dup} held by two slots")
        # an evicted raw id must be held by no slot; not strict, by no slot the window lists
        # (the window contradicting itself is refused whatever the held map lacks)
        checked = held if strict else torch.sort(new[listed & (new != EMPTY_RAW_ID)]).values
        for ev in evicted:
            ev = ev.to(device="cpu", dtype=torch.int64)
            if not ev.numel() or not checked.numel():
                continue
            pos = torch.searchsorted(checked, ev).clamp(max=checked.numel() - 1)
            still = ev[checked[pos] == ev]
            if still.numel():
                raise ConsumerError(
                    f"table {self.table}: raw id {int(still[0])} evicted but still held by a slot "
                    f"(a slot's new identity is missing)"
                )
        return IdentityPlan(new, sorted_raw, mapping, local_changed + self.offset)

    def install(self, plan: IdentityPlan) -> None:
        """Take a planned map (must not fail: called under the serving lock)."""
        self.slot_raw = plan.slot_raw
        self._sorted, self._mapping = plan.sorted_raw_ids, plan.mapping


class Remapper(SlotMap):
    """The slot map of a served ``MCHManagedCollisionModule``: installing a plan also rewrites
    the module's lookup buffers in place (``copy_``; the module keeps its tensors)."""

    def __init__(self, table: str, module: torch.nn.Module) -> None:
        self.module = module
        offset = int(getattr(module, "_output_global_offset"))  # noqa: B009
        sorted_raw = _buffer(module, "_mch_sorted_raw_ids")
        mapping = _buffer(module, "_mch_remapped_ids_mapping")
        if sorted_raw.device.type != "cpu":
            raise UnsupportedModelError(f"table {table}: remapper buffers on {sorted_raw.device}")
        super().__init__(table, slot_raw_of(sorted_raw, mapping, offset), offset)

    def install(self, plan: IdentityPlan) -> None:
        with torch.no_grad():
            _buffer(self.module, "_mch_sorted_raw_ids").copy_(plan.sorted_raw_ids)
            _buffer(self.module, "_mch_remapped_ids_mapping").copy_(plan.mapping)
        super().install(plan)


def _buffer(module: torch.nn.Module, name: str) -> torch.Tensor:
    buf = getattr(module, name)
    if not isinstance(buf, torch.Tensor):
        raise UnsupportedModelError(f"{type(module).__name__}.{name} is not a tensor")
    return buf


def remappers(model: torch.nn.Module) -> dict[str, Remapper]:
    """``{table: Remapper}`` of every managed-collision table in ``model`` (float MC-EC / MC-EBC
    or the torchrec.quant MC modules ``quantize_embeddings`` builds from them). Puts the MCH
    modules in eval mode: a serving remapper never admits or evicts on its own (the trainer's
    identities arrive with the rows). Other managed-collision modules raise
    UnsupportedModelError."""
    from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule

    out: dict[str, Remapper] = {}
    for fqn, m in model.named_modules():
        if not isinstance(m, ManagedCollisionCollection):
            continue
        for table, mcm in m._managed_collision_modules.items():
            if not isinstance(mcm, MCHManagedCollisionModule):
                raise UnsupportedModelError(
                    f"{fqn}: table {table}: {type(mcm).__name__} is not supported (MCH only)"
                )
            if table in out:
                raise ConsumerError(f"table {table!r} has two remappers in the serving model")
            mcm.eval()
            out[table] = Remapper(table, mcm)
    return out


@dataclass
class IdentityUpdates:
    """A window's identities, gathered per table before they are planned."""

    slots: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]
    evicted: dict[str, list[torch.Tensor]]

    @classmethod
    def new(cls) -> IdentityUpdates:
        return cls({}, {})

    def add(
        self,
        table: str,
        ids: torch.Tensor,
        raw_ids: torch.Tensor | None,
        evicted: torch.Tensor | None,
    ) -> None:
        if raw_ids is not None:
            self.slots.setdefault(table, []).append((ids, raw_ids))
        if evicted is not None and evicted.numel():
            self.evicted.setdefault(table, []).append(evicted)

    def extend(self, other: IdentityUpdates) -> None:
        for t, pairs in other.slots.items():
            self.slots.setdefault(t, []).extend(pairs)
        for t, evs in other.evicted.items():
            self.evicted.setdefault(t, []).extend(evs)

    def tables(self) -> set[str]:
        return set(self.slots) | set(self.evicted)

    def plan(
        self, maps: dict[str, SlotMap] | dict[str, Remapper], *, strict: bool = True
    ) -> dict[str, IdentityPlan]:
        """Every table's plan (ConsumerError for identities of a table ``maps`` lacks; see
        :meth:`SlotMap.plan` for ``strict``)."""
        out: dict[str, IdentityPlan] = {}
        for table in sorted(self.tables()):
            m = maps.get(table)
            if m is None:
                raise ConsumerError(
                    f"table {table!r}: the window carries raw ids but the serving model has "
                    f"no managed-collision module for it"
                )
            out[table] = m.plan(
                self.slots.get(table, []), self.evicted.get(table, []), strict=strict
            )
        return out


def identities_of(update: object) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(raw_ids, evicted_raw_ids)`` of a ShardUpdate (None for ordinary tables)."""
    return getattr(update, "raw_ids", None), getattr(update, "evicted_raw_ids", None)


#: An MCH module's buffers a serving remapper uses; its others (eviction metadata such as
#: ``_mch_counts`` / ``_mch_last_access_iter``, ``_current_iter_tensor``) are the trainer's
#: bookkeeping for admission and eviction: they do not travel and a predictor never reads them.
LOOKUP_BUFFERS = ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping")


def training_only_state(model: torch.nn.Module) -> set[str]:
    """state_dict names of ``model``'s MCH buffers that serving does not use (see
    :data:`LOOKUP_BUFFERS`): what a comparison with the trainer's model leaves out."""
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    out: set[str] = set()
    prefixes = [
        f"{fqn}." for fqn, m in model.named_modules() if isinstance(m, MCHManagedCollisionModule)
    ]
    for name in model.state_dict():
        for p in prefixes:
            if name.startswith(p) and name[len(p) :] not in LOOKUP_BUFFERS:
                out.add(name)
    return out


def probe_forward(model: torch.nn.Module, table: str, raw: torch.Tensor) -> torch.Tensor:
    """The embeddings the (quantized or float) MC module holding ``table`` serves for raw ids
    ``raw`` of the table's first feature, one id per sample: ``[len(raw), dim]``. Run it where
    forwards run (e.g. inside ``QuantApplier.serving()``)."""
    from torchrec import KeyedJaggedTensor
    from torchrec.modules.mc_modules import ManagedCollisionCollection

    for m in model.modules():
        mcc = getattr(m, "_managed_collision_collection", None)
        if not isinstance(mcc, ManagedCollisionCollection):
            continue
        if table not in mcc._managed_collision_modules:
            continue
        feature = mcc._table_to_features[table][0]
        keys = list(mcc._feature_names)
        n = raw.numel()
        lengths = torch.cat([torch.full((n,), int(k == feature), dtype=torch.int64) for k in keys])
        kjt = KeyedJaggedTensor.from_lengths_sync(keys, raw.to(torch.int64), lengths)
        emb = m(kjt)[0]
        out: torch.Tensor = emb[feature].values() if isinstance(emb, dict) else emb[feature]
        return out
    raise ConsumerError(f"table {table!r}: no managed-collision module holds it")
