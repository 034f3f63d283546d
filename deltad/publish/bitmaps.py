"""Touched-row bitmaps: one bool per local row, marked by lookups, swapped and read out at a drain.

Per feature key, the slice of ids it owns (``offset_per_key()``, cached by the input dist)
goes ``mask.index_fill_(0, ids, True)`` into its shard's bitmap (on CPU ~10x faster than
``mask[ids] = True``): a scatter per key instead of the per-step ``torch.unique`` of TorchRec's
own tracker; memory is one byte per local row (two with deferred drains: a clean spare is
swapped in, the marked one is read by :meth:`DrainedRows.resolve`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deltad.publish.shards import TrackedShard


@dataclass(eq=False)
class Bitmap:
    """One bool bitmap per shard of a lookup, as views of one flat tensor."""

    flat: torch.Tensor  # bool, concatenation of the shards' bitmaps
    masks: list[torch.Tensor]  # views of ``flat``, one per shard
    key_masks: list[torch.Tensor]  # per key of the features: its shard's bitmap


@dataclass(eq=False)
class LookupBitmaps:
    """One lookup (sharding type) of a sharded module: its shards and their bitmaps.

    ``active`` takes the marks; a drain swaps in a clean spare and hands the marked one to a
    :class:`DrainedRows`, whose ``resolve()`` (maybe on another thread) reads, clears and
    returns it to ``spares``.
    """

    shards: list[TrackedShard]
    key_shard: list[int]  # per key of the features: index of its shard
    #: (ids, offset per key) of the last ``lookahead`` lookups
    history: deque[tuple[torch.Tensor, list[int]]]
    active: Bitmap = field(init=False)
    spares: list[Bitmap] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.active = self.new_bitmap()

    def new_bitmap(self) -> Bitmap:
        sizes = [s.shard.rows for s in self.shards]
        flat = torch.zeros(sum(sizes), dtype=torch.bool, device=self.shards[0].weight.device)
        masks = list(flat.split(sizes))
        return Bitmap(flat, masks, [masks[i] for i in self.key_shard])

    def swap(self) -> Bitmap:
        """Make a clean bitmap active; return the one that was."""
        with self.lock:
            fresh = self.spares.pop() if self.spares else None
        old, self.active = self.active, fresh if fresh is not None else self.new_bitmap()
        return old

    def give_back(self, bitmap: Bitmap) -> None:
        """A resolved (cleared) bitmap becomes a spare again."""
        with self.lock:
            self.spares.append(bitmap)

    def read_and_clear(self, bitmap: Bitmap) -> list[tuple[TrackedShard, torch.Tensor]]:
        """(shard, sorted unique local row ids) of ``bitmap``, which is then all clear."""
        out = [
            (s, mask.nonzero().view(-1)) for s, mask in zip(self.shards, bitmap.masks, strict=True)
        ]
        bitmap.flat.zero_()
        return out

    def remark_history(self) -> None:
        """Mark the last ``lookahead`` lookups again (they stay owed after a drain)."""
        for values, offsets in self.history:
            self.mark(values, offsets)

    def mark(self, values: torch.Tensor, offsets: list[int]) -> None:
        """Set the bits of the ids of one lookup (key ``i`` owns ``values[o[i]:o[i+1]]``)."""
        for i, mask in enumerate(self.active.key_masks):
            if offsets[i + 1] > offsets[i]:
                ids = values[offsets[i] : offsets[i + 1]].to(torch.int64)
                mask.index_fill_(0, ids, True)


class DrainedRows:
    """The rows one drain took, read out of their bitmaps only when :meth:`resolve` is called.

    The drain itself only swaps bitmaps (constant time; with a fold thread, not even that on
    the training loop's clock: the swap is queued behind the lookups still being folded); the
    ``nonzero()`` over every local row and the clearing happen in :meth:`resolve`, which any
    thread may call, exactly once.
    """

    def __init__(
        self,
        parts: list[tuple[LookupBitmaps, Bitmap]] | None = None,
        *,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        self._parts = parts
        self._error: BaseException | None = None
        self._alive = alive  # the fold thread that fills in ``parts``, if any
        self._ready = threading.Event()
        self._resolved = False
        if parts is not None:
            self._ready.set()
        #: Seconds :meth:`resolve` took (0 until it ran).
        self.resolve_s = 0.0

    def _fill(self, parts: list[tuple[LookupBitmaps, Bitmap]]) -> None:
        self._parts = parts
        self._ready.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    @torch.no_grad()
    def resolve(self) -> list[tuple[TrackedShard, torch.Tensor]]:
        """(shard, sorted unique local row ids) for every local shard; clears the bitmaps.

        Waits for the fold thread to reach this drain; raises if folding failed (the drained
        rows are then unknown) or the thread is gone.
        """
        if self._resolved:
            raise RuntimeError("DrainedRows.resolve() may be called only once")
        self._resolved = True
        t0 = time.perf_counter()
        # Bounded: the fold thread reaches every queued drain unless it stopped.
        while not self._ready.wait(timeout=1.0):
            if self._alive is not None and not self._alive():
                raise RuntimeError("the tracker's fold thread stopped before this drain")
        if self._error is not None:
            raise RuntimeError(f"folding tracked ids failed: {self._error}") from self._error
        parts, self._parts = self._parts, None
        assert parts is not None
        out: list[tuple[TrackedShard, torch.Tensor]] = []
        for lookup, bitmap in parts:
            out += lookup.read_and_clear(bitmap)
            lookup.give_back(bitmap)
        self.resolve_s = time.perf_counter() - t0
        return out
