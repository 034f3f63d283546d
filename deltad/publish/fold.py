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
    """Runs the tracker's folds (and the bitmap swaps between them) in order, off the loop.

    Bounded: at most ``max_pending`` calls wait; the training loop's hook blocks beyond that
    (the thread is behind). The first failure is kept in ``error``; the calls after it still
    run (a drain queued behind it reports it instead of rows missing the failed lookup's).
    """

    def __init__(self, max_pending: int, stats: TrackerStats) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=max_pending)
        self.error: BaseException | None = None
        self._stats = stats  # background_s: this thread's CPU time
        self._thread = threading.Thread(target=self._run, name="deltad-fold", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], None]) -> None:
        self._queue.put(call)

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
            try:
                with torch.no_grad():  # grad mode is per thread
                    call()
            except BaseException as e:
                log.error("folding tracked ids: %s", e)
                if self.error is None:
                    self.error = e
            del call  # a queued call holds the tracker: let it go before the next get()
            self._stats.background_s += time.thread_time() - c0
