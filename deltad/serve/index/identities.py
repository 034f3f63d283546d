"""Managed-collision identities across a rank's log: no segment is served that would leave a
raw id held by two slots, or an evicted raw id still held.

A segment alone shows only the slots it lists (:func:`deltad.segment.validate.check_identities`
checks those when the file is indexed). Whether a raw id it gives a slot is still held by a slot
it does *not* list, or whether a raw id it says evicted is, depends on the log before it. An
:class:`IdentityLedger` keeps, per managed-collision shard of the rank, the slot -> raw id map at
the newest entry it accepted (the base's map with every later segment's ``raw_ids`` applied in
order, as a consumer builds it) and checks each new entry of the served run against it before
the log publishes the entry. A segment it refuses is quarantined like any corrupt file (never
served; the publisher is asked for a fresh base, whose map replaces the ledger's).

Without this, one such segment reaches every predictor, whose appliers refuse the window (a
map with a raw id twice cannot be installed), so no predictor can move past it until the
trainer writes a fresh base.

Cost: one int64 per slot of the rank's managed-collision shards, and per entry that changes
identities one sort of the shard's held raw ids (what a consumer's remapper does per window).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deltad.types import EMPTY_RAW_ID, ShardKey

if TYPE_CHECKING:
    from deltad.serve.index.files import LogEntry


@dataclass
class _ShardMap:
    """One managed-collision shard's slot -> raw id map (local slots) and its held raw ids,
    sorted, with the local slot of each."""

    row_start: int
    slot_raw: torch.Tensor
    held: torch.Tensor
    held_slots: torch.Tensor

    @classmethod
    def of(cls, row_start: int, slot_raw: torch.Tensor) -> _ShardMap:
        m = cls(row_start, slot_raw, slot_raw[:0], slot_raw[:0])
        m.resort()
        return m

    def resort(self) -> None:
        order = torch.argsort(self.slot_raw)
        held = self.slot_raw[order]
        n = int(torch.searchsorted(held, EMPTY_RAW_ID))
        self.held, self.held_slots = held[:n], order[:n]

    def holders(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(raw ids, local slots)``: the entries of ``raw`` a slot holds now, and which."""
        if not raw.numel() or not self.held.numel():
            return raw[:0], raw[:0]
        pos = torch.searchsorted(self.held, raw).clamp(max=self.held.numel() - 1)
        hit = self.held[pos] == raw
        return raw[hit], self.held_slots[pos[hit]]


class IdentityLedger:
    """The slot -> raw id maps of one rank's managed-collision shards along its served log
    (see the module docstring). Not thread-safe: the segment log calls it under its lock."""

    def __init__(self) -> None:
        self._generation: int | None = None
        self._base: LogEntry | None = None
        self._seq = -1  # the newest entry the maps are at
        self._maps: dict[ShardKey, _ShardMap] = {}

    def check(self, generation: int, run: Sequence[LogEntry]) -> tuple[int, str] | None:
        """Bring the maps to the end of ``run`` (a base, then contiguous entries); None if
        every entry is consistent, else ``(index in run, reason)`` of the first that is not
        (the maps stay at the entry before it)."""
        if not run:
            return None
        base = run[0]
        if (
            generation != self._generation
            or self._base is None
            or base.seq > self._seq
            or not any(e.seq == self._seq for e in run)
        ):
            self._reset(generation, base)
        elif base is not self._base and base.seq == self._seq:
            self._reset(generation, base)  # a merged base at the maps' entry: the same maps
        for i, e in enumerate(run):
            if e.seq <= self._seq:
                continue
            if e.first_seq != self._seq + 1:  # an entry straddling the maps' (a merge)
                if self._seq == base.seq:
                    return i, f"segment {e.first_seq}..{e.seq} does not follow {self._seq}"
                self._reset(generation, base)
                return self.check(generation, run)  # (once: from the base, contiguous)
            why = self._apply(e)
            if why is not None:
                return i, why
            self._seq = e.seq
        return None

    def _reset(self, generation: int, base: LogEntry) -> None:
        self._generation, self._base, self._seq = generation, base, base.seq
        self._maps = {}
        for key, c in base.shards.items():
            if c.raw_ids is None:
                continue
            n = c.shard.row_end - c.shard.row_start
            slot_raw = torch.full((n,), EMPTY_RAW_ID, dtype=torch.int64)
            slot_raw[c.ids - c.shard.row_start] = c.raw_ids
            self._maps[key] = _ShardMap.of(c.shard.row_start, slot_raw)

    def _apply(self, e: LogEntry) -> str | None:
        """Check ``e``'s identities against the maps; apply them if consistent, else say why
        (and change nothing)."""
        planned: list[tuple[_ShardMap, torch.Tensor, torch.Tensor]] = []
        for key, c in e.shards.items():
            if c.raw_ids is None:
                continue
            m = self._maps.get(key)
            if m is None:
                return f"shard {c.shard.table}: identities of a shard its base does not have"
            local = c.ids - m.row_start
            listed = torch.zeros(m.slot_raw.numel(), dtype=torch.bool)
            listed[local] = True
            given = c.raw_ids[c.raw_ids != EMPTY_RAW_ID]
            raw, slots = m.holders(given)
            kept = ~listed[slots]
            if bool(kept.any()):
                r, s = int(raw[kept][0]), int(slots[kept][0]) + m.row_start
                return (
                    f"shard {c.shard.table}: raw id {r} given to a slot while slot {s}, "
                    f"which the segment does not list, still holds it"
                )
            if c.evicted is not None and c.evicted.numel():
                raw, slots = m.holders(c.evicted)
                kept = ~listed[slots]
                if bool(kept.any()):
                    r, s = int(raw[kept][0]), int(slots[kept][0]) + m.row_start
                    return (
                        f"shard {c.shard.table}: raw id {r} evicted while slot {s}, which the "
                        f"segment does not list, still holds it"
                    )
            planned.append((m, local, c.raw_ids))
        for m, local, raw_ids in planned:
            changed = bool((m.slot_raw[local] != raw_ids).any())
            m.slot_raw[local] = raw_ids
            if changed:
                m.resort()
        return None
