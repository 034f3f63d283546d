"""Managed-collision (ZCH) tables on the trainer: which slots changed identity, and when.

A sharded ``ManagedCollisionEmbeddingCollection`` / ``ManagedCollisionEmbeddingBagCollection``
(TorchRec 1.8) holds, per rank, one row-wise shard of each table (the only sharding TorchRec
offers for them: ``ManagedCollisionCollectionSharder.sharding_types`` is ``row_wise``) and,
beside it, the table's ``MCHManagedCollisionModule`` for that shard. The MCH maps raw ids to
the shard's slots (global row ids ``_output_global_offset + local``) through two buffers,
``_mch_sorted_raw_ids`` and ``_mch_remapped_ids_mapping``: slot ``mapping[i]`` holds raw id
``sorted[i]`` (``EMPTY_RAW_ID`` = int64 max for an empty slot). :func:`slot_raw_ids` turns that
into one int64 per slot.

Where things happen in a training step (TorchRec 1.8, read from the source and tested):

* **input dist** (``ShardedManagedCollisionCollection.input_dist``): raw ids are bucketized
  to the rank that owns their hash range and sent there. Pure: no MCH state changes.
* **compute** (``BaseShardedManagedCollisionEmbeddingCollection.compute``, in the forward):
  the MCH ``profile`` records the batch's raw ids (LRU / LFU metadata, ``_current_iter``) and,
  every ``eviction_interval`` forwards, admits ids and evicts others (rewriting
  ``_mch_sorted_raw_ids`` / ``_mch_remapped_ids_mapping``); ``evict()`` then returns the slots
  whose identity changed, and the module **resets their rows and optimizer state in the
  forward**; then the inner EC / EBC looks the remapped slots up (``compute()``, so the
  post-lookup tracker hooks of TorchRec never fire; deltad hooks the lookup modules).
* **backward**: the fused optimizer updates the looked-up slots' rows, as for any table.

So the whole remapper and every row of step N+1 only change inside step N+1's forward (in
compute) and backward. With ``TrainPipelineSparseDist`` the pipeline runs batch N+1's *input
dist* during step N (before the publish of step N), which touches no MC state; its compute
runs in the forward of ``progress()`` N+1, after the publish. A segment published between two
steps therefore holds the state after step N's update and before step N+1 changed anything,
remapper included, provided that the copy of step N's rows (which the publisher may take on
a background thread) is done before step N+1's compute resets rows: the tracker runs the
update barrier at the start of the MC compute as well as before each backward.
(``TrainPipelineFusedSparseDist`` / ``SemiSync`` run N+1's forward before step N's update:
refused for MC tables, and GPU-only anyway.)

Identities per publish: :class:`McShardState` keeps each shard's slot -> raw id map as of the
last publish and the slots eviction reset since then; :meth:`McShardState.take` diffs the
current map against it. A slot is owed when its raw id changed or its row was reset (an id
evicted and re-admitted to the same slot between two publishes leaves the map unchanged but
the row re-initialized); evicted raw ids are the old map's ids no longer held by any slot.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from deltad.errors import UnsupportedModelError
from deltad.mch import slot_raw_of
from deltad.types import EMPTY_RAW_ID


def managed_collision_types() -> tuple[type, type] | None:
    """(sharded MC-EC / MC-EBC base class, sharded ManagedCollisionCollection), or None for a
    TorchRec without managed collision."""
    try:
        from torchrec.distributed.mc_embedding_modules import (
            BaseShardedManagedCollisionEmbeddingCollection,
        )
        from torchrec.distributed.mc_modules import ShardedManagedCollisionCollection
    except ImportError:
        return None
    return BaseShardedManagedCollisionEmbeddingCollection, ShardedManagedCollisionCollection


def mch_type() -> Any:
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    return MCHManagedCollisionModule


@torch.no_grad()
def slot_raw_ids(mch: Any) -> torch.Tensor:
    """The raw id each slot of ``mch``'s shard holds (int64 per local slot, a new tensor);
    ``EMPTY_RAW_ID`` for an empty slot."""
    sorted_raw: torch.Tensor = mch._mch_sorted_raw_ids
    mapping: torch.Tensor = mch._mch_remapped_ids_mapping
    return slot_raw_of(sorted_raw.cpu(), mapping.cpu(), int(mch._output_global_offset))


class SlotMap:
    """An MC shard's slot -> raw id map at one cut: copies of its MCH buffers, taken in the
    training loop (two copies); the map itself (a scatter over every slot) is computed when
    first read, by the publisher's copy or writer thread, off the step."""

    def __init__(self, mch: Any) -> None:
        sorted_raw: torch.Tensor = mch._mch_sorted_raw_ids
        mapping: torch.Tensor = mch._mch_remapped_ids_mapping
        # (copies: the next forward changes the buffers in place; on a device, one copy each)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = (
            sorted_raw.to("cpu", copy=True),
            mapping.to("cpu", copy=True),
        )
        self._offset = int(mch._output_global_offset)
        self._map: torch.Tensor | None = None
        # (read by the copy and writer threads, at times at once: a map is one segment's
        # "now" and the next one's "before")
        self._lock = threading.Lock()

    @property
    def tensor(self) -> torch.Tensor:
        """The raw id of every local slot (``EMPTY_RAW_ID``: empty)."""
        with self._lock:
            if self._map is None:
                assert self._buffers is not None
                self._map = slot_raw_of(*self._buffers, self._offset)
                self._buffers = None  # (the map replaces them)
            return self._map


@dataclass(frozen=True)
class SlotIdentities:
    """One shard's identities at a publish (all int64, on the CPU).

    Taken in the training loop at the cut as copies only (the map now and at the last
    publish, as :class:`SlotMap` copies of the MCH buffers, and the reset slots); the maps
    and the diff (``changed``, ``evicted``) are computed where first read, by the publisher's
    copy or writer thread, off the step."""

    now: SlotMap
    before: SlotMap
    #: The slots whose rows eviction reset since the last publish.
    reset: torch.Tensor

    @property
    def slots(self) -> torch.Tensor:
        """The raw id of every local slot now (``EMPTY_RAW_ID``: empty)."""
        return self.now.tensor

    @property
    def last(self) -> torch.Tensor:
        """The map at the last publish."""
        return self.before.tensor

    @functools.cached_property
    def _diff(self) -> torch.Tensor:
        return self.slots != self.last

    @functools.cached_property
    def changed(self) -> torch.Tensor:
        """Sorted local slots whose raw id changed, or whose row eviction reset, since the
        last publish: owed to this segment with their (re-initialized) rows."""
        return (self._diff | self.reset).nonzero().view(-1)

    @functools.cached_property
    def evicted(self) -> torch.Tensor:
        """Ascending unique raw ids held at the last publish and by no slot now."""
        old = self.last[self._diff]
        old = old[old != EMPTY_RAW_ID]
        return torch.unique(old[~torch.isin(old, self.slots)])


@dataclass(eq=False)
class McShardState:
    """The slot -> raw id map of one MC shard at the last publish, and the slots reset since."""

    mch: Any
    rows: int
    _last: SlotMap = field(init=False)
    reset: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self._last = SlotMap(self.mch)
        self.reset = torch.zeros(self.rows, dtype=torch.bool)

    @property
    def last(self) -> torch.Tensor:
        """The map at the last publish."""
        return self._last.tensor

    @torch.no_grad()
    def mark_reset(self, local: torch.Tensor) -> None:
        """Eviction re-initialized these local slots' rows (in the forward)."""
        if local.numel():
            self.reset.index_fill_(0, local.to(device="cpu", dtype=torch.int64), True)

    @torch.no_grad()
    def take(self) -> SlotIdentities:
        """The identities now against the last take (the maps and the diff are computed when
        first read); this becomes the last."""
        cur = SlotMap(self.mch)
        taken = SlotIdentities(cur, self._last, self.reset.clone())
        self._last = cur
        self.reset.zero_()
        return taken


def check_mch(mch: Any, where: str, row_start: int, rows: int) -> None:
    """Raise unless ``mch`` is an MCH module mapping onto exactly this shard's rows."""
    if not isinstance(mch, mch_type()):
        raise UnsupportedModelError(
            f"{where}: managed-collision module {type(mch).__name__} is not an "
            "MCHManagedCollisionModule (the only kind deltad tracks)"
        )
    if int(mch._output_global_offset) != row_start or int(mch._zch_size) != rows:
        raise UnsupportedModelError(
            f"{where}: the MCH module maps onto slots {mch._output_global_offset}+"
            f"{mch._zch_size}, the local shard holds rows {row_start}+{rows}"
        )


def union_sorted(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sorted unique union of two int64 id tensors."""
    if b.numel() == 0:
        return a
    if a.numel() == 0:
        return b
    return torch.unique(torch.cat([a.to(b.device), b]))
