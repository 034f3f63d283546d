"""What a sidecar says of the model's canary evaluators in Status (``evaluator_state``): who is
alive and the newest verdicts, read from their records in Redis (deltad.evaluate.record) through
a short cache. Read as plain JSON: the sidecar never imports the evaluator (or torch)."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import redis

from deltad.keys import RedisKeys

log = logging.getLogger(__name__)

#: how stale the view may be (Status is called often: long polls, relays, predictors)
TTL_S = 1.0
#: verdicts in Status, newest first
SHOWN = 5
_FIELDS = ("generation", "step", "release_step", "verdict", "decided_unix", "by")


class EvaluatorView:
    """The evaluators' records of one model, re-read at most every ``ttl_s``; a Redis error
    keeps the last read (logged once per failing spell)."""

    def __init__(self, client: Any, model: str, ttl_s: float = TTL_S) -> None:
        self.r = client
        self.base = RedisKeys(model).evaluators()
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._json = ""
        self._read_at = -float("inf")
        self._failing = False
        #: of the last read: evaluators alive, and when the newest verdict was reached (None:
        #: no verdict ever recorded)
        self._alive = 0
        self._newest: float | None = None

    def state_json(self) -> str:
        """The JSON of ``evaluator_state`` ("" when no evaluator ever recorded anything)."""
        if time.monotonic() - self._read_at < self.ttl_s:
            return self._json
        with self._lock:
            if time.monotonic() - self._read_at < self.ttl_s:
                return self._json
            try:
                self._json = self._read()
                self._failing = False
            except (redis.RedisError, OSError, ValueError) as e:
                if not self._failing:
                    log.warning("evaluator records unreadable, the last read stays: %s", e)
                self._failing = True
            self._read_at = time.monotonic()
            return self._json

    def _read(self) -> str:
        raw = self.r.lrange(f"{self.base}:verdicts", 0, SHOWN - 1)
        verdicts = []
        for x in raw:
            d = json.loads(x)
            verdicts.append({k: d.get(k) for k in _FIELDS})
        prefix = f"{self.base}:alive:"
        alive = sorted(
            (k.decode() if isinstance(k, bytes) else str(k))[len(prefix) :]
            for k in self.r.scan_iter(match=prefix + "*", count=100)
        )
        self._alive = len(alive)
        decided = [float(v["decided_unix"]) for v in verdicts if v.get("decided_unix")]
        self._newest = max(decided) if decided else None
        if not verdicts and not alive:
            return ""
        return json.dumps({"alive": alive, "verdicts": verdicts}, separators=(",", ":"))

    def alive(self) -> int:
        """Evaluators alive now (their records in Redis unexpired), as last read."""
        self.state_json()
        return self._alive

    def verdict_age_s(self, now: float | None = None) -> float:
        """Seconds since the newest verdict was reached; -1 if none was ever recorded."""
        self.state_json()
        if self._newest is None:
            return -1.0
        return max(0.0, (time.time() if now is None else now) - self._newest)
