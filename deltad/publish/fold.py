"""The tracker's fold thread: lookups' ids scattered into the bitmaps off the training loop, in order."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from deltad.publish.stats import TrackerStats

log = logging.getLogger(__name__)


class FoldThread:
    """Runs the tracker's folds (and the bitmap swaps between them) in order, off the loop;
    small folds run in place when nothing is queued (:meth:`run_or_submit`).

    Bounded: at most ``max_pending`` calls wait; the training loop's hook blocks beyond that
    (the thread is behind). The first failure is kept in ``error``; the calls after it still
    run (a drain queued behind it reports it instead of rows missing the failed lookup's).
    """

    def __init__(self, max_pending: int, stats: TrackerStats) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=max_pending)
        self.error: BaseException | None = None
        # calls handed to the thread, and of those the ones it has finished (each written by
        # one thread only; equal: the thread has nothing left, every effect is visible)
        self._submitted = 0
        self._finished = 0
        self._stats = stats  # background_s: this thread's CPU time
        self._thread = threading.Thread(target=self._run, name="deltad-fold", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], None]) -> None:
        """Queue ``call`` behind the calls before it (blocks while ``max_pending`` wait)."""
        self._submitted += 1
        self._queue.put(call)

    def run_or_submit(self, call: Callable[[], None], small: bool) -> None:
        """Run a ``small`` call here, on the caller's thread, when the thread has nothing left
        to run (so the order is kept); queue it otherwise. Waking the thread for a lookup of a
        few hundred ids costs more than the fold: measured here, ~60 us of the caller's time
        and ~90 us of the thread's per hand-off against ~25 us folded in place
        (``knobs.FOLD_INLINE_MAX_IDS``). A failure is kept in ``error`` either way."""
        if small and self._finished == self._submitted:
            self._call(call)
        else:
            self.submit(call)

    def _call(self, call: Callable[[], None]) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread
                call()
        except BaseException as e:
            log.error("folding tracked ids: %s", e)
            if self.error is None:
                self.error = e

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Run what is queued, then end the thread (joined unless called from it)."""
        if self.alive():
            self._queue.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout_s)

    def _run(self) -> None:
        while (call := self._queue.get()) is not None:
            c0 = time.thread_time()
            self._call(call)
            del call  # a queued call holds the tracker: let it go before the next get()
            self._stats.background_s += time.thread_time() - c0
            self._finished += 1
