"""Signal handlers that take no lock: what a signal asks for runs in a watcher thread.

A Python signal handler runs in the main thread between two bytecodes, possibly while that
thread holds a lock: ``threading.Event.wait`` (pure Python) holds its condition's lock around
the wait. A handler that calls ``event.set()`` on that event then waits for a lock its own
thread holds, for good: a SIGTERM that would hang a pod until SIGKILL. So the handlers here
only put the signal number on a ``queue.SimpleQueue`` (a C implementation documented as
reentrant), and a daemon thread runs the actions.
"""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import FrameType

#: what a signal asks for, run in the watcher thread with the signal's number
Action = Callable[[int], object]


@contextmanager
def handle_signals(actions: Mapping[signal.Signals, Action]) -> Iterator[None]:
    """While the block runs, each signal in ``actions`` runs its action in a watcher thread
    (in the order they arrived); the previous handlers are restored on exit. From the main
    thread only (CPython installs handlers there); elsewhere it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    inbox: queue.SimpleQueue[int | None] = queue.SimpleQueue()

    def watch() -> None:
        while True:
            signum = inbox.get()
            if signum is None:
                return
            actions[signal.Signals(signum)](signum)

    def handler(signum: int, frame: FrameType | None) -> None:
        inbox.put_nowait(signum)  # no lock taken: reentrant

    watcher = threading.Thread(target=watch, name="deltad-signals", daemon=True)
    watcher.start()
    previous = {sig: signal.signal(sig, handler) for sig in actions}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        inbox.put_nowait(None)
        watcher.join(5.0)
