"""A warning that a busy path may hit at any rate (every refused call, every bad request),
logged at most once per interval with a count of the ones left out."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

#: seconds between two warnings of one :class:`RateLimitedLog`
LOG_EVERY_S = 10.0


class RateLimitedLog:
    """At most one warning per ``every_s`` seconds, counting the ones left out."""

    def __init__(self, every_s: float = LOG_EVERY_S, logger: logging.Logger | None = None) -> None:
        self._log = logger or log
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._skipped = 0

    def warning(self, msg: str, *args: object) -> bool:
        """Log it unless one was logged less than ``every_s`` ago; True if logged."""
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_s:
                self._skipped += 1
                return False
            skipped, self._skipped, self._last = self._skipped, 0, now
        self._log.warning(msg + " (%d more like it not logged)", *args, skipped)
        return True
