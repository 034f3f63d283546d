"""The lookup buffers of torchrec's MCH (zero-collision hashing) module as a slot -> raw id map,
and back: the one place both sides of the wire read that layout.

An ``MCHManagedCollisionModule`` keeps ``_mch_sorted_raw_ids`` (the raw ids its slots hold,
ascending; an empty slot holds :data:`~deltad.types.EMPTY_RAW_ID`) and
``_mch_remapped_ids_mapping`` (the global slot of each, ``offset + local``).
"""

from __future__ import annotations

import torch

from deltad.types import EMPTY_RAW_ID


def slot_raw_of(sorted_raw_ids: torch.Tensor, mapping: torch.Tensor, offset: int) -> torch.Tensor:
    """The slot -> raw id map (one int64 per local slot, a new tensor) held by the buffers."""
    out = torch.full_like(sorted_raw_ids, EMPTY_RAW_ID)
    out[mapping - offset] = sorted_raw_ids
    return out


def lookup_buffers(slot_raw: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_raw_ids, mapping)`` of an MCH module whose slot ``offset + i`` holds
    ``slot_raw[i]``: bit-equal to the trainer's module (empty slots in slot order)."""
    order = torch.argsort(slot_raw, stable=True)
    return slot_raw[order], order + offset
