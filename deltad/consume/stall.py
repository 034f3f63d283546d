"""Streams that stop moving: a GetDelta stream is bounded by the time between its messages,
not by its length.

A whole-stream deadline either cuts a predictor's bootstrap of a big shard short (a 30 s
deadline never lets a stream of more than 30 s finish, so every retry starts over and the
predictor never serves) or, set long enough for the biggest bootstrap, lets a stalled stream
hang that long. :class:`Watched` gives a stream two bounds instead: no message for ``stall_s``
cancels it (:class:`StalledStream`, a retryable DEADLINE_EXCEEDED), and the call's own gRPC
deadline bounds it as a whole. One daemon thread watches every stream of the process and
sleeps while none is watched.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc


class StalledStream(grpc.RpcError):
    """A stream cancelled because no message came for ``stall_s`` seconds. Its code is
    DEADLINE_EXCEEDED (retried as one)."""

    def __init__(self, stall_s: float, received: int) -> None:
        super().__init__(f"no message for {stall_s:g} s")
        self.stall_s = stall_s
        self.received = received

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return (
            f"the stream stalled: no message for {self.stall_s:g} s (rpc_deadline_s) after "
            f"{self.received} message(s)"
        )


class _Watched:
    __slots__ = ("call", "fired", "last", "limit", "received")

    def __init__(self, call: Any, limit: float) -> None:
        self.call = call
        self.limit = limit
        self.last = time.monotonic()
        self.received = 0
        self.fired = False


class _Watchdog:
    """Cancels the watched calls whose last message is older than their limit."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._watched: set[_Watched] = set()
        self._thread: threading.Thread | None = None

    def add(self, w: _Watched) -> None:
        with self._cond:
            self._watched.add(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="deltad-stalls", daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, w: _Watched) -> None:
        with self._cond:
            self._watched.discard(w)

    def _run(self) -> None:
        while True:  # (a daemon: lives as long as the process; asleep while nothing is watched)
            with self._cond:
                while not self._watched:
                    self._cond.wait()
                now = time.monotonic()
                due = [w for w in self._watched if now - w.last >= w.limit]
                for w in due:
                    w.fired = True
                    self._watched.discard(w)
                # (a message since only makes the next due time later: wake, look again)
                nxt = min((w.last + w.limit for w in self._watched), default=now + 1.0)
            for w in due:
                w.call.cancel()
            with self._cond:
                self._cond.wait(timeout=min(1.0, max(0.01, nxt - time.monotonic())))

    def reset_in_child(self) -> None:
        """After a fork: the child has no watchdog thread (and no watched stream) yet."""
        self._cond = threading.Condition()
        self._watched = set()
        self._thread = None


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG.reset_in_child)


class Watched:
    """A gRPC response stream under watch, cancelled once no message came for ``stall_s``
    seconds (counted from now, then from each message read): iterate :meth:`messages`, then
    :meth:`close`; :meth:`stalled` turns the error of a cancelled stream into
    :class:`StalledStream`."""

    def __init__(self, call: Any, stall_s: float) -> None:
        self._w = _Watched(call, stall_s)
        _WATCHDOG.add(self._w)

    def messages(self) -> Iterator[Any]:
        w = self._w
        for m in w.call:
            w.last = time.monotonic()
            w.received += 1
            yield m

    def stalled(self, e: grpc.RpcError) -> grpc.RpcError:
        """``e``, or :class:`StalledStream` if the watchdog cancelled the stream."""
        if self._w.fired:
            return StalledStream(self._w.limit, self._w.received)
        return e

    def close(self) -> None:
        _WATCHDOG.remove(self._w)
