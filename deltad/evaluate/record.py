"""The evaluator's records in Redis, beside the model's release state.

==================================  ==========================================================
key (``deltad:{model}:eval:...``)   value
==================================  ==========================================================
``verdict:<generation>:<step>``     the first :class:`Verdict` reached on that step (SET NX:
                                    replicas adopt it, so they never disagree); 7 days
``verdicts``                        list, newest first: the last 200 verdicts (JSON)
``released_unix``                   when an evaluator last released (the minimum interval)
``rolled_back``                     set: the canary groups an evaluator rolled back (unpinned
                                    at the next release)
``groups``                          set: the evaluators' own canary groups (never rolled back)
``alive:<consumer>``                an evaluator's heartbeat (TTL): status says when none is
``lock``                            held (SET NX PX) while one replica reads the release state
                                    and acts on a verdict: replicas act one at a time
==================================  ==========================================================
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import redis

from deltad.errors import OffsetStoreError
from deltad.evaluate.verdict import Verdict
from deltad.keys import RedisKeys

#: verdicts kept in the ``verdicts`` list
KEEP_VERDICTS = 200
VERDICT_TTL_S = 7 * 86400


class VerdictStore:
    """Verdicts and the evaluators' shared state of one model in Redis."""

    def __init__(self, client: Any, model: str) -> None:
        self.r = client
        self.model = model
        self.base = RedisKeys(model).evaluators()

    def key(self, *parts: object) -> str:
        return ":".join([self.base, *(str(p) for p in parts)])

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except (redis.RedisError, OSError) as e:
            raise OffsetStoreError(f"evaluator records: redis: {e}") from e

    def get(self, generation: int, step: int) -> Verdict | None:
        raw = self._call(self.r.get, self.key("verdict", generation, step))
        return Verdict.from_json(raw) if raw else None

    def put_first(self, v: Verdict) -> tuple[Verdict, bool]:
        """Record ``v`` unless a verdict on its step is recorded: ``(the recorded one, True if
        it is ``v``)``."""
        k = self.key("verdict", v.generation, v.step)
        won = self._call(self.r.set, k, v.to_json(), nx=True, ex=VERDICT_TTL_S)
        if not won:
            got = self.get(v.generation, v.step)
            if got is not None:
                return got, False
        pipe = self.r.pipeline(transaction=False)
        pipe.lpush(self.key("verdicts"), v.to_json())
        pipe.ltrim(self.key("verdicts"), 0, KEEP_VERDICTS - 1)
        self._call(pipe.execute)
        return v, True

    def recent(self, n: int = 20) -> list[Verdict]:
        """The newest ``n`` verdicts, newest first."""
        raw = self._call(self.r.lrange, self.key("verdicts"), 0, max(0, n - 1))
        return [Verdict.from_json(x) for x in raw]

    def released_unix(self) -> float:
        raw = self._call(self.r.get, self.key("released_unix"))
        return float(raw) if raw else 0.0

    def mark_released(self, when: float) -> None:
        self._call(self.r.set, self.key("released_unix"), repr(when))

    def rolled_back(self) -> set[str]:
        return {x.decode() if isinstance(x, bytes) else x
                for x in self._call(self.r.smembers, self.key("rolled_back"))}  # fmt: skip

    def add_rolled_back(self, group: str) -> None:
        self._call(self.r.sadd, self.key("rolled_back"), group)

    def clear_rolled_back(self, group: str) -> None:
        self._call(self.r.srem, self.key("rolled_back"), group)

    def add_group(self, group: str) -> None:
        self._call(self.r.sadd, self.key("groups"), group)

    def groups(self) -> set[str]:
        """The canary groups of evaluators (no failure rolls them back)."""
        return {x.decode() if isinstance(x, bytes) else x
                for x in self._call(self.r.smembers, self.key("groups"))}  # fmt: skip

    def heartbeat(self, consumer: str, ttl_s: float, info: dict[str, Any]) -> None:
        self._call(self.r.set, self.key("alive", consumer), json.dumps(info), px=int(ttl_s * 1000))

    def alive(self) -> dict[str, dict[str, Any]]:
        """The evaluators whose heartbeat has not expired: ``{consumer: info}``."""
        out = {}
        prefix = self.key("alive", "")
        for k in self._call(lambda: list(self.r.scan_iter(match=prefix + "*", count=100))):
            name = (k.decode() if isinstance(k, bytes) else k)[len(prefix) :]
            raw = self._call(self.r.get, k)
            if raw:
                out[name] = json.loads(raw)
        return out

    @contextlib.contextmanager
    def lock(self, ttl_s: float = 10.0, wait_s: float = 15.0) -> Iterator[bool]:
        """Hold the evaluators' action lock (yields False if it could not be had within
        ``wait_s``: act later); released only if still ours."""
        token = uuid.uuid4().hex
        k = self.key("lock")
        deadline = time.monotonic() + wait_s
        got = False
        while True:
            got = bool(self._call(self.r.set, k, token, nx=True, px=int(ttl_s * 1000)))
            if got or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        try:
            yield got
        finally:
            if got:
                with contextlib.suppress(redis.RedisError, OSError):
                    self.r.eval(
                        "if redis.call('get', KEYS[1]) == ARGV[1] then "
                        "return redis.call('del', KEYS[1]) end return 0",
                        1, k, token,
                    )  # fmt: skip
