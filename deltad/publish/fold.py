"""The tracker's fold thread: lookups' ids scattered into the bitmaps off the training loop, in order."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from deltad.publish.stats import TrackerStats

log = logging.getLogger(__name__)

#: a call the thread runs: a function and its arguments
_Call = tuple[Callable[..., None], tuple[Any, ...]]


class FoldThread:
    """Runs the tracker's folds (and the bitmap swaps between them) in order, off the loop.

    Lookups are handed over in batches (:meth:`defer`): the training loop's hook only appends
    to a list, and the thread is woken once per ``batch_ids`` ids, or when a swap is queued
    behind them (:meth:`submit`). Waking the thread costs the loop ~60 us per hand-off here,
    more than folding a small lookup in place (~25 us, an ``index_fill_`` per feature key); a
    batch costs one wake for many lookups, and folding nothing in the hook costs the loop
    nothing at all (stop 45: the hooks were 1.8 % of a 26 ms step, most of it folds).

    Bounded: at most ``max_pending`` calls or batches wait; the training loop's hook blocks
    beyond that (the thread is behind), and a batch holds at most ``batch_ids`` ids plus one
    lookup's. The first failure is kept in ``error``; the calls after it still run (a drain
    queued behind it reports it instead of rows missing the failed lookup's).
    """

    def __init__(self, max_pending: int, stats: TrackerStats, batch_ids: int = 0) -> None:
        # each batch: calls as (function, its arguments)
        self._queue: queue.Queue[list[_Call] | None] = queue.Queue(maxsize=max_pending)
        self.error: BaseException | None = None
        # calls handed to the thread, and of those the ones it has finished (each written by
        # one thread only; equal: the thread has nothing left, every effect is visible)
        self._submitted = 0
        self._finished = 0
        #: lookups deferred and not yet handed over (the training loop's thread only)
        self._batch: list[_Call] = []
        self._batch_ids = 0
        self._batch_max = batch_ids
        self._stats = stats  # background_s: this thread's CPU time
        self._thread = threading.Thread(target=self._run, name="deltad-fold", daemon=True)
        self._thread.start()

    def defer(self, ids: int, fn: Callable[..., None], *args: Any) -> None:
        """Add ``fn(*args)``, a fold of ``ids`` ids, to the batch; hand the batch over once
        it holds ``batch_ids`` ids. It runs after every call deferred or submitted before it.
        (The lookup hook's one call per lookup: no closure is made on the loop.)"""
        self._batch.append((fn, args))
        self._batch_ids += ids
        if self._batch_ids >= self._batch_max:
            self.flush()

    @property
    def deferred(self) -> int:
        """Lookups deferred and not yet handed to the thread."""
        return len(self._batch)

    def flush(self) -> None:
        """Hand the deferred folds to the thread (blocks while ``max_pending`` wait)."""
        if self._batch:
            batch, self._batch, self._batch_ids = self._batch, [], 0
            self._submitted += len(batch)
            self._queue.put(batch)

    def submit(self, call: Callable[[], None]) -> None:
        """Queue ``call`` behind every call deferred or submitted before it (blocks while
        ``max_pending`` wait)."""
        self.flush()
        self._submitted += 1
        self._queue.put([(call, ())])

    def _call(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread
                fn(*args)
        except BaseException as e:
            log.error("folding tracked ids: %s", e)
            if self.error is None:
                self.error = e

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Run what is deferred or queued, then end the thread (joined unless called from it)."""
        if self.alive():
            self.flush()
            self._queue.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout_s)

    def _run(self) -> None:
        while (calls := self._queue.get()) is not None:
            c0 = time.thread_time()
            for fn, args in calls:
                self._call(fn, args)
            n = len(calls)
            # a queued call holds the tracker: let it go before the next get()
            calls = fn = args = None  # type: ignore[assignment]
            self._stats.background_s += time.thread_time() - c0
            self._finished += n
