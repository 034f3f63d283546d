"""Cross-rank agreement: the publisher's few collectives, and the one rule for a failure."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
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
        #: the publisher's own group, for all-reduces another thread issues (open_side_group)
        self._side: Any = None

    def open_side_group(self, wanted: bool) -> bool:
        """Open a process group of the publisher's own (a collective; every rank calls it).

        The per-publish all-reduce may then be issued by another thread (the copier, see
        :meth:`all_reduce_max_later`) while the training loop runs its own collectives on
        the trainer's group: collectives of one group must be issued in the same order on
        every rank, and the side group carries only these, issued in publish order. Opened
        only if every rank wants it (one all-reduce) and the backend is gloo (with NCCL the
        issue is an asynchronous kernel launch already); returns whether it is open."""
        if not self.distributed or self._side is not None:
            return self._side is not None
        if self.all_reduce_max(0 if wanted else 1)[0] or dist.get_backend(self._pg) != "gloo":
            return False
        ranks = dist.get_process_group_ranks(self._pg or dist.group.WORLD)
        self._side = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        return True

    def close(self) -> None:
        """Close the side group, if open (after the last all-reduce issued on it is done)."""
        side, self._side = self._side, None
        if side is not None:
            dist.destroy_process_group(side)

    def all_reduce_max(self, *values: int) -> list[int]:
        """Element-wise MAX of ``values`` over the ranks: one all-reduce."""
        return self.all_reduce_max_async(*values).result()

    def all_reduce_max_async(self, *values: int) -> PendingMax:
        """The same all-reduce, issued now and waited for by :meth:`PendingMax.result`: the
        publish does not wait for the slowest rank to reach it."""
        if not self.distributed:
            return PendingMax(list(values))
        self._stats.collectives += 1
        return PendingMax(*_issue_max(values, self._device, self._pg))

    def all_reduce_max_later(self, *values: int) -> PendingMax:
        """The same all-reduce, on the side group if one is open, issued by the first of
        :meth:`PendingMax.issue` (any thread: the copier) and :meth:`PendingMax.result`;
        without a side group, issued now (:meth:`all_reduce_max_async`)."""
        side = self._side
        if not self.distributed or side is None:
            return self.all_reduce_max_async(*values)
        self._stats.collectives += 1
        return PendingMax(
            list(values), issue=functools.partial(_issue_max, values, self._device, side)
        )

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


def _issue_max(
    values: tuple[int, ...], device: torch.device, group: Any
) -> tuple[torch.Tensor, Any]:
    """``values`` as a tensor and the asynchronous all-reduce MAX of it issued on ``group``."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    return t, dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)


class PendingMax:
    """An all-reduce MAX in flight (or, with one rank, its values); :meth:`result` waits once.

    One made with ``issue`` is not issued yet: the first of :meth:`issue` (another thread)
    and :meth:`result` issues it."""

    def __init__(
        self,
        values: torch.Tensor | list[int],
        work: Any = None,
        *,
        issue: Callable[[], tuple[torch.Tensor, Any]] | None = None,
    ) -> None:
        self._values = values
        self._work = work
        self._issue = issue
        self._issue_error: BaseException | None = None
        self._lock = threading.Lock()

    def issue(self) -> None:
        """Issue the all-reduce now if it is not yet (any thread; once). A failure is
        raised by :meth:`result`."""
        with self._lock:
            issue, self._issue = self._issue, None
            if issue is None:
                return
            try:
                self._values, self._work = issue()
            except BaseException as e:  # raised on the loop, by result()
                self._issue_error = e

    def result(self) -> list[int]:
        """The reduced values, waiting for every rank to have issued the all-reduce (this
        rank's is issued here if no other thread has yet)."""
        self.issue()
        if self._issue_error is not None:
            raise self._issue_error
        if self._work is not None:
            self._work.wait()
            self._work = None
        if isinstance(self._values, torch.Tensor):
            self._values = [int(x) for x in self._values.tolist()]
        return list(self._values)
