"""The window cache: an LRU of encoded windows under a byte budget that holds the live ones too."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from deltad.serve.windows.encoded import EncodedWindow
from deltad.serve.windows.spec import WindowSpec

log = logging.getLogger(__name__)


class WindowCache:
    """LRU of encoded windows under a byte budget that holds the windows being streamed too;
    concurrent requests for one window build it once.

    A window being built is shared: the first request plans it and streams it while the
    producer fills it; requests arriving meanwhile read along (waiting for chunks not yet
    produced). Such a live window's bytes are reserved in the budget from the start (its
    :attr:`EncodedWindow.bound`, known once planned), evicting older cached windows if need
    be; a finished one stays in the LRU. A window that does not fit (bigger than the budget,
    or the budget is taken by live windows) is streamed without being kept: its one reader
    produces each chunk and drops it once sent, and nobody else shares it. So the cached
    and live windows' bytes (:attr:`nbytes`) never exceed ``max_bytes``.
    """

    def __init__(self, entries: int, max_bytes: int) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[WindowSpec, EncodedWindow] = OrderedDict()
        self._lru_bytes = 0
        self._live: dict[WindowSpec, EncodedWindow] = {}
        self._reserved = 0
        self._held: dict[int, int] = {}  # id(live window) -> bytes reserved for it
        self._building: dict[WindowSpec, threading.Lock] = {}
        self.hits = 0
        #: windows streamed without being kept (did not fit), and the most bytes held at once
        self.unkept = 0
        self.peak_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the cached windows plus those reserved for live (kept) ones."""
        return self._lru_bytes + self._reserved

    def _lookup(self, spec: WindowSpec) -> EncodedWindow | None:
        hit = self._lru.get(spec)
        if hit is not None:
            self._lru.move_to_end(spec)
        else:
            hit = self._live.get(spec)
        if hit is not None:
            self.hits += 1
        return hit

    def hold(self, nbytes: int) -> bool:
        """Count ``nbytes`` kept outside the LRU (cached generation diffs) against the budget,
        evicting older cached windows for room; False (nothing held) if they do not fit."""
        with self._lock:
            if nbytes > self.max_bytes or not self._evict(nbytes):
                return False
            self._reserved += nbytes
            self.peak_bytes = max(self.peak_bytes, self.nbytes)
            return True

    def release(self, nbytes: int) -> None:
        """Give back bytes taken by :meth:`hold`."""
        with self._lock:
            self._reserved -= nbytes

    def _evict(self, need: int) -> bool:
        """Drop the oldest cached windows until ``need`` more bytes fit (lock held)."""
        while self._lru and self._lru_bytes + self._reserved + need > self.max_bytes:
            _, old = self._lru.popitem(last=False)
            self._lru_bytes -= old.nbytes
        return self._lru_bytes + self._reserved + need <= self.max_bytes

    def get(
        self, spec: WindowSpec, build: Callable[[bool], EncodedWindow]
    ) -> tuple[EncodedWindow, bool]:
        """The window for ``spec`` and whether it came from the cache.

        ``build(kept)`` plans the window (see :func:`~deltad.serve.windows.plan.build_window`);
        ``kept`` is False when the cache is off (the one reader may drop chunks as it streams
        them).
        """
        if self.entries <= 0:
            return build(False), False
        with self._lock:
            hit = self._lookup(spec)
            if hit is not None:
                return hit, True
            gate = self._building.setdefault(spec, threading.Lock())
        with gate:  # a second caller waits here while the first one plans
            with self._lock:
                hit = self._lookup(spec)
                if hit is not None:
                    return hit, True
            try:
                win = build(True)
                with self._lock:
                    need = win.bound or 0
                    if need <= self.max_bytes and self._evict(need):
                        self._live[spec] = win
                        self._reserved += need
                        self._held[id(win)] = need
                        self.peak_bytes = max(self.peak_bytes, self.nbytes)
                    else:  # streamed by its one reader, chunks dropped as they are sent
                        win.kept = False
                        self.unkept += 1
            finally:
                with self._lock:
                    self._building.pop(spec, None)
        if win.kept:
            win.on_done(lambda w: self._done(spec, w))
        return win, False

    def abandon(self, spec: WindowSpec, win: EncodedWindow) -> None:
        """The caller that built ``win`` will not read it (its pull failed first): release
        its reservation unless somebody else reads it already (then it completes normally)."""
        with self._lock:
            if self._live.get(spec) is not win or win.done or win._readers:
                return
            del self._live[spec]
            self._reserved -= self._held.pop(id(win), 0)

    def _done(self, spec: WindowSpec, win: EncodedWindow) -> None:
        with self._lock:
            if self._live.get(spec) is win:
                del self._live[spec]
            held = self._held.pop(id(win), None)
            if held is None:  # abandoned: neither reserved nor cached any more
                return
            self._reserved -= held
            if win.bound is not None and win.nbytes > win.bound:  # a bug: it must hold
                log.error("window of %d bytes over its bound %d", win.nbytes, win.bound)
            if win.failed or win.nbytes > self.max_bytes or not self._evict(win.nbytes):
                return
            self._lru[spec] = win
            self._lru_bytes += win.nbytes
            while len(self._lru) > self.entries:
                _, old = self._lru.popitem(last=False)
                self._lru_bytes -= old.nbytes
            self.peak_bytes = max(self.peak_bytes, self.nbytes)
