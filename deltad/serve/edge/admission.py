"""The consumer limit at the edge: which consumer names may be served under ``max_consumers``."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Admission:
    """Asks ``admit(name)`` (the offset store: True for a name it knows, or one it may add
    below ``max_consumers``) and remembers up to ``max_consumers`` admitted names, so a known
    consumer costs no Redis round trip per pull. :meth:`forget` drops that memory (after
    consumers were forgotten, so a forgotten name is counted against the limit again)."""

    def __init__(self, admit: Callable[[str], bool], max_consumers: int) -> None:
        self._admit = admit
        self.max_consumers = max_consumers
        self._admitted: set[str] = set()
        self._lock = threading.Lock()

    def admits(self, name: str) -> bool:
        """Whether ``name`` may be served; OffsetStoreError if the store cannot tell."""
        if name in self._admitted:  # known: no Redis round trip on every pull
            return True
        if not self._admit(name):
            return False
        with self._lock:
            if len(self._admitted) < max(self.max_consumers, 1):
                self._admitted.add(name)
        return True

    def forget(self) -> None:
        """Drop the remembered names."""
        with self._lock:
            self._admitted.clear()
