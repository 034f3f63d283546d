"""The release state read from a JSON file (``deltad serve --release-state-file F``).

A stand-in source of :class:`deltad.serve.rollout.ReleaseState` for a sidecar or relay whose
rollout state is not in Redis (tests, a single host, an operator editing one file): the file
holds ``ReleaseState.to_json()``; it is re-read when its size or modification time changes
(checked at most every ``every_s`` seconds). A missing file is the default state (the head
released); an unreadable or malformed one keeps the last good state and is logged once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from deltad.serve.rollout import ReleaseState

log = logging.getLogger(__name__)


class ReleaseFile:
    """A callable provider of the release state in ``path`` (SidecarServer.set_release)."""

    def __init__(self, path: Path, every_s: float = 0.1) -> None:
        self.path = Path(path)
        self.every_s = every_s
        self._lock = threading.Lock()
        self._state = ReleaseState()
        self._stamp: tuple[int, int] | None = None
        self._checked = -1e18
        self._error = ""

    def __call__(self) -> ReleaseState:
        now = time.monotonic()
        if now - self._checked < self.every_s:
            return self._state
        with self._lock:
            self._checked = now
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                self._stamp, self._state = None, ReleaseState()
                return self._state
            except OSError as e:
                self._warn(f"cannot stat {self.path}: {e}")
                return self._state
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return self._state
            try:
                state = ReleaseState.from_json(self.path.read_bytes())
            except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
                self._warn(f"cannot read the release state in {self.path}: {e}")
                return self._state
            self._stamp, self._state, self._error = stamp, state, ""
            log.info("release state from %s: %s", self.path, state.to_json())
            return state

    def state(self) -> ReleaseState:
        """The same (the rollout controls' ``RolloutSource`` protocol)."""
        return self()

    def _warn(self, message: str) -> None:
        if message != self._error:
            log.warning("%s (keeping the last state)", message)
            self._error = message
