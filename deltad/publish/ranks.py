"""Cross-rank agreement: the publisher's few collectives, and the one rule for a failure."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from deltad.errors import SpoolError
from deltad.publish.stats import PublisherStats


class RankGroup:
    """The ranks that publish together (``process_group``, default the world group if
    torch.distributed is up; one rank alone otherwise). Every collective it issues is
    counted in ``stats.collectives``."""

    def __init__(self, process_group: Any, stats: PublisherStats) -> None:
        self._pg = process_group
        self._stats = stats
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        self._device = torch.device("cpu")
        if self.distributed and dist.get_backend(process_group) == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())

    def all_reduce_max(self, *values: int) -> list[int]:
        """Element-wise MAX of ``values`` over the ranks: one all-reduce."""
        return self.all_reduce_max_async(*values).result()

    def all_reduce_max_async(self, *values: int) -> PendingMax:
        """The same all-reduce, issued now and waited for by :meth:`PendingMax.result`: the
        publish does not wait for the slowest rank to reach it."""
        if not self.distributed:
            return PendingMax(list(values))
        self._stats.collectives += 1
        t = torch.tensor(values, dtype=torch.int64, device=self._device)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._pg, async_op=True)
        return PendingMax(t, work)

    def broadcast(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        if not self.distributed:
            return value
        self._stats.collectives += 1
        t = torch.tensor([value], dtype=torch.int64, device=self._device)
        dist.broadcast(t, src=dist.get_global_rank(self._pg, 0) if self._pg else 0, group=self._pg)
        return int(t.item())

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank if any rank failed (so no rank hangs in a later collective)."""
        if self.all_reduce_max(1 if error else 0)[0]:
            if error is not None:
                raise error
            raise SpoolError(f"{what} failed on another rank")


class PendingMax:
    """An all-reduce MAX in flight (or, with one rank, its values); :meth:`result` waits once."""

    def __init__(self, values: torch.Tensor | list[int], work: Any = None) -> None:
        self._values = values
        self._work = work

    def result(self) -> list[int]:
        """The reduced values, waiting for every rank to have issued the all-reduce."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        if isinstance(self._values, torch.Tensor):
            self._values = [int(x) for x in self._values.tolist()]
        return list(self._values)
