"""Consumer membership and leases in Redis: who is known, whose lease is live, forgetting.

A consumer becomes known on its first pull or registration (the ``consumers`` set, its
``seen`` time) and holds a lease it renews; one idle past its lease may be forgotten with its
cursors and pulls on every rank (keys: deltad.keys). Every call goes through
:class:`~deltad.serve.state.redis_calls.RedisCalls`.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from typing import Any

from deltad.config import NAME_PATTERN
from deltad.keys import RedisKeys
from deltad.serve.ratelog import RateLimitedLog
from deltad.serve.state.redis_calls import RedisCalls

log = logging.getLogger(__name__)

_HEARTBEAT = """
if redis.call('SISMEMBER', KEYS[2], ARGV[2]) == 0 then return -1 end
local ttl = tonumber(redis.call('HGET', KEYS[3], ARGV[2]) or '')
-- (a TTL deltad did not write, not a whole number of ms in 1..86400000: the default)
if not ttl or ttl < 1 or ttl > 86400000 or ttl ~= math.floor(ttl) then
  ttl = tonumber(ARGV[1])
end
ttl = string.format('%d', ttl)
redis.call('SET', KEYS[1], ttl, 'PX', ttl)
redis.call('HSET', KEYS[4], ARGV[2], ARGV[3])
return tonumber(ttl)
"""

# KEYS: lease, consumers, lease_ttl, seen, then cursor:<c>:<r> and pull:<c>:<r> of every rank.
# ARGV: consumer, cutoff (unix). Forget the consumer only if its lease is gone and it was last
# heard of before the cutoff (checked here, atomically, not just by the caller).
_FORGET = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local seen = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '')
if seen and seen >= tonumber(ARGV[2]) then return 0 end
for i = 5, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('SREM', KEYS[2], ARGV[1])
return 1
"""

# KEYS: consumers. ARGV: consumer, max. A known consumer, or room for one more (no write).
_ADMIT = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 1 end
if redis.call('SCARD', KEYS[1]) < tonumber(ARGV[2]) then return 1 end
return 0
"""


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _seconds(v: Any) -> float | None:
    """A time deltad wrote (``repr(time.time())``), or None (none, or not a finite number)."""
    if v is None:
        return None
    try:
        t = float(_s(v))
    except ValueError:
        return None
    return t if math.isfinite(t) else None


class ConsumerMembers:
    """The known consumers of one model and their leases (an OffsetStore's :attr:`members`)."""

    def __init__(self, client: Any, calls: RedisCalls, keys: RedisKeys) -> None:
        self.client = client
        self.calls = calls
        self.keys = keys
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._forget = client.register_script(_FORGET)
        self._admit = client.register_script(_ADMIT)
        self._bad_names = RateLimitedLog(logger=log)

    def register(self, consumer: str, ttl_s: float) -> None:
        """Create or renew the lease of ``consumer`` with ``ttl_s``."""
        ttl_ms = max(1, int(ttl_s * 1000))

        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.sadd(self.keys.consumers(), consumer)
            pipe.set(self.keys.lease(consumer), ttl_ms, px=ttl_ms)
            pipe.hset(self.keys.lease_ttl(), consumer, ttl_ms)
            pipe.hset(self.keys.seen(), consumer, repr(time.time()))
            pipe.execute()

        self.calls.retry("register", run)

    def heartbeat(self, consumer: str, default_ttl_s: float) -> float | None:
        """Renew the lease (with its registered TTL); None for an unknown consumer."""
        keys = [
            self.keys.lease(consumer),
            self.keys.consumers(),
            self.keys.lease_ttl(),
            self.keys.seen(),
        ]
        args = [str(max(1, int(default_ttl_s * 1000))), consumer, repr(time.time())]
        ttl = int(self.calls.retry("heartbeat", lambda: self._heartbeat(keys=keys, args=args)))
        return None if ttl < 0 else ttl / 1000.0

    def release(self, consumer: str) -> None:
        """End ``consumer``'s lease now (it stays known, with its cursors, until forgotten)."""
        self.calls.retry("release", lambda: self.client.delete(self.keys.lease(consumer)))

    def touch(self, consumer: str, default_ttl_s: float) -> None:
        """Register ``consumer`` if unknown, else renew its lease (GetDelta does this)."""
        if self.heartbeat(consumer, default_ttl_s) is None:
            self.register(consumer, default_ttl_s)

    def admits(self, consumer: str, max_consumers: int) -> bool:
        """Whether ``consumer`` is known or there is room for it below ``max_consumers``
        (one read-only script; concurrent first requests of new names may overshoot the
        limit by at most their number)."""
        keys, args = [self.keys.consumers()], [consumer, str(max_consumers)]
        return bool(int(self.calls.retry("admit", lambda: self._admit(keys=keys, args=args))))

    def consumers(self) -> list[str]:
        """Every known consumer, sorted (live or not). A name in the set that is none deltad
        takes (:data:`deltad.config.NAME_PATTERN`: written by someone else into its Redis) is
        left out with a warning now and then: it is listed, counted and exported nowhere."""
        raw = self.calls.retry("consumers", lambda: self.client.smembers(self.keys.consumers()))
        names = [_s(c) for c in raw]
        bad = [n for n in names if not NAME_PATTERN.fullmatch(n)]
        if bad:
            self._bad_names.warning(
                "%d name(s) in the consumer set in Redis are no consumer names deltad takes "
                "(%s): left out",
                len(bad), ", ".join(repr(n[:40]) for n in bad[:3]),
            )  # fmt: skip
        return sorted(n for n in names if NAME_PATTERN.fullmatch(n))

    def lease_remaining(self, consumers: list[str]) -> dict[str, float]:
        """Seconds left on each consumer's lease (0 when expired)."""

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for c in consumers:
                pipe.pttl(self.keys.lease(c))
            return list(pipe.execute())

        ttls = self.calls.retry("lease_remaining", run) if consumers else []
        return {c: max(0, int(t)) / 1000.0 for c, t in zip(consumers, ttls, strict=True)}

    def forget_idle(self, world_size: int, idle_s: float, *, limit: int = 100) -> list[str]:
        """Forget consumers whose lease expired and who were last heard of ``idle_s`` ago or
        more: their cursors and pulls on every rank, lease TTL and membership go. One that
        comes back is a new consumer (a full-table resync), never fed deltas on a state it no
        longer holds. At most ``limit`` per call; returns the names forgotten.

        A consumer with no ``seen`` time (from before it was kept) starts its clock now.
        """
        names = self.consumers()
        idle = [c for c, left in self.lease_remaining(names).items() if left <= 0]
        if not idle:
            return []
        now = time.time()
        seen_key = self.keys.seen()
        raw = self.calls.retry("seen", lambda: self.client.hmget(seen_key, idle))
        due: list[str] = []
        for c, v in zip(idle, raw, strict=True):
            seen = _seconds(v)
            if seen is None:  # none, or not a time deltad wrote: its clock starts now
                self.calls.retry(
                    "seen", functools.partial(self.client.hset, seen_key, c, repr(now))
                )
            elif seen <= now - idle_s:
                due.append(c)
        forgotten: list[str] = []
        ranks = range(max(1, world_size))
        for c in due[:limit]:
            keys = [self.keys.lease(c), self.keys.consumers(), self.keys.lease_ttl(), seen_key]
            keys += [self.keys.cursor(c, r) for r in ranks] + [self.keys.pull(c, r) for r in ranks]
            args = [c, repr(now - idle_s)]
            if int(
                self.calls.retry("forget", functools.partial(self._forget, keys=keys, args=args))
            ):
                forgotten.append(c)
        return forgotten

    def forget(self, consumer: str, world_size: int) -> bool:
        """Forget ``consumer`` now, live or not (an admin's request): cursors and pulls on
        every rank, lease, lease TTL, seen time and membership, in one transaction. False if
        it was not known."""
        ranks = range(max(1, world_size))
        keys = [self.keys.lease(consumer)]
        keys += [self.keys.cursor(consumer, r) for r in ranks]
        keys += [self.keys.pull(consumer, r) for r in ranks]

        def run() -> bool:
            pipe = self.client.pipeline(transaction=True)
            pipe.srem(self.keys.consumers(), consumer)
            pipe.delete(*keys)
            pipe.hdel(self.keys.lease_ttl(), consumer)
            pipe.hdel(self.keys.seen(), consumer)
            removed, deleted, *_ = pipe.execute()
            return bool(removed or deleted)

        return bool(self.calls.retry("forget", run))
