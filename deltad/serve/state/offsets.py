"""Per-consumer cursors, pulls, leases and the rank registry in Redis (keys: deltad.keys).

Every call retries connection failures a bounded number of times with exponential backoff and
then raises :class:`~deltad.errors.OffsetStoreError` (:mod:`deltad.serve.state.redis_calls`);
nothing is ever reset on failure. Commit is one Lua script: forward-only (except the commit of a
rollback window, which moves the cursor back to the rollback's step), only for the pull this
server issued to that consumer.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from typing import Any

from deltad.config import SENTINEL_SCHEMES, clip, options_min_replicas
from deltad.errors import StaleCursorError
from deltad.keys import RedisKeys
from deltad.redisutil import connect
from deltad.serve.state.redis_calls import RedisCalls

#: Pull records of consumers that never commit disappear after this.
PULL_TTL_MS = 7 * 24 * 3600 * 1000

_COMMIT = """
local function gt(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end
if redis.call('HGET', KEYS[1], 'pull_id') == ARGV[1] then
  -- a repeat: a write all the same, so that a WAIT after it (Sentinel's min_replicas)
  -- covers the first commit's write too, whichever connection made that one
  redis.call('HSET', KEYS[1], 'updated_unix', ARGV[5])
  return 'same'
end
local p = redis.call('HMGET', KEYS[2], 'pull_id', 'generation', 'seq', 'step',
                     'owed_token', 'owed_rows', 'rollback_epoch', 'rollback')
if not p[1] then
  if redis.call('EXISTS', KEYS[1]) == 0 then return 'no_consumer' end
  return 'unknown_pull'
end
if p[1] ~= ARGV[1] then return 'unknown_pull' end
if p[2] ~= ARGV[2] or p[3] ~= ARGV[3] or p[4] ~= ARGV[4] then return 'mismatch' end
local c = redis.call('HMGET', KEYS[1], 'generation', 'seq', 'rollback_epoch')
local epoch = tonumber(p[7] or '0') or 0
if c[1] then
  if gt(c[1], p[2]) then return 'old_generation' end
  -- a cursor moves back only for the rollback window this server issued (p[8] = '1')
  if c[1] == p[2] and tonumber(c[2]) > tonumber(p[3]) and p[8] ~= '1' then return 'behind' end
  local held = tonumber(c[3] or '0') or 0
  if held > epoch then epoch = held end
end
redis.call('HSET', KEYS[1], 'generation', p[2], 'seq', p[3], 'step', p[4], 'pull_id', p[1],
           'owed_token', p[5], 'owed_rows', p[6], 'updated_unix', ARGV[5],
           'rollback_epoch', tostring(epoch))
redis.call('DEL', KEYS[2])
return 'ok'
"""

_HEARTBEAT = """
if redis.call('SISMEMBER', KEYS[2], ARGV[2]) == 0 then return -1 end
local ttl = redis.call('HGET', KEYS[3], ARGV[2]) or ARGV[1]
redis.call('SET', KEYS[1], ttl, 'PX', ttl)
redis.call('HSET', KEYS[4], ARGV[2], ARGV[3])
return tonumber(ttl)
"""

# KEYS: lease, consumers, lease_ttl, seen, then cursor:<c>:<r> and pull:<c>:<r> of every rank.
# ARGV: consumer, cutoff (unix). Forget the consumer only if its lease is gone and it was last
# heard of before the cutoff (checked here, atomically, not just by the caller).
_FORGET = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local seen = redis.call('HGET', KEYS[4], ARGV[1])
if seen and tonumber(seen) >= tonumber(ARGV[2]) then return 0 end
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


class CommitRejected(StaleCursorError):
    """A commit the store refused; ``reason`` is one of the Lua script's answers:
    no_consumer, unknown_pull, mismatch, old_generation, behind."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class StoredCursor:
    """A committed cursor as stored in ``cursor:<consumer>:<rank>``."""

    generation: int
    seq: int
    step: int
    pull_id: str = ""
    owed_token: str = ""
    owed_rows: int = 0
    updated_unix: float = 0.0
    #: the newest rollback order (ReleaseState.rollback.epoch) this consumer followed on
    #: this rank (or was at or before the order's step when it pulled)
    rollback_epoch: int = 0


@dataclass(frozen=True)
class PendingPull:
    """A pull issued but not yet committed (``pull:<consumer>:<rank>``)."""

    pull_id: str
    generation: int
    seq: int
    step: int
    owed_token: str = ""
    owed_rows: int = 0
    #: the rollback order in force for this consumer when it pulled (its commit records it)
    rollback_epoch: int = 0
    #: a rollback window: its commit may move the cursor back (and only its commit)
    rollback: bool = False


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _cursor(raw: dict[Any, Any]) -> StoredCursor | None:
    if not raw:
        return None
    d = {_s(k): _s(v) for k, v in raw.items()}
    return StoredCursor(
        generation=int(d["generation"]),
        seq=int(d["seq"]),
        step=int(d["step"]),
        pull_id=d.get("pull_id", ""),
        owed_token=d.get("owed_token", ""),
        owed_rows=int(d.get("owed_rows", "0") or 0),
        updated_unix=float(d.get("updated_unix", "0") or 0),
        rollback_epoch=int(d.get("rollback_epoch", "0") or 0),
    )


def _pull(raw: dict[Any, Any]) -> PendingPull | None:
    if not raw:
        return None
    d = {_s(k): _s(v) for k, v in raw.items()}
    return PendingPull(
        d["pull_id"],
        int(d["generation"]),
        int(d["seq"]),
        int(d["step"]),
        d.get("owed_token", ""),
        int(d.get("owed_rows", "0") or 0),
        int(d.get("rollback_epoch", "0") or 0),
        d.get("rollback", "") == "1",
    )


class OffsetStore:
    """Cursors, pulls and leases of one model's consumers."""

    def __init__(
        self,
        client: Any,  # redis.Redis (plain or Sentinel's master) or RedisCluster
        model: str,
        *,
        attempts: int = 5,
        backoff_s: float = 0.05,
        url: str = "",
        min_replicas: int = 0,
    ) -> None:
        self.client = client
        #: How every call reaches Redis: retries, errors, replica acknowledgement.
        self.calls = RedisCalls(
            client, attempts=attempts, backoff_s=backoff_s, url=url, min_replicas=min_replicas
        )
        self.keys = RedisKeys(model)
        self._commit = client.register_script(_COMMIT)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._forget = client.register_script(_FORGET)
        self._admit = client.register_script(_ADMIT)

    @classmethod
    def from_url(cls, url: str, model: str, **kw: Any) -> OffsetStore:
        """Connect (bounded retries) and wrap; OffsetStoreError if Redis does not answer.
        A Sentinel URL waits for ``min_replicas`` (default 1) replicas on every commit."""
        scheme, _, rest = url.partition("://")
        if scheme in SENTINEL_SCHEMES:
            given = options_min_replicas(rest.partition("?")[2])
            kw.setdefault("min_replicas", 1 if given is None else given)
        return cls(connect(url, socket_timeout_s=2.0), model, url=url, **kw)

    @property
    def min_replicas(self) -> int:
        """Replicas that must hold a commit before it is acknowledged (Redis WAIT)."""
        return self.calls.min_replicas

    # --- cursors and pulls ---------------------------------------------------------------

    def get_cursor(self, consumer: str, rank: int) -> StoredCursor | None:
        return self.cursors([consumer], rank)[consumer]

    def cursors(self, consumers: list[str], rank: int) -> dict[str, StoredCursor | None]:
        """Committed cursors of ``consumers`` on ``rank`` (one round trip)."""

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for c in consumers:
                pipe.hgetall(self.keys.cursor(c, rank))
            return list(pipe.execute())

        raws = self.calls.retry("get_cursor", run) if consumers else []
        return {c: _cursor(raw) for c, raw in zip(consumers, raws, strict=True)}

    def record_pull(self, consumer: str, rank: int, pull: PendingPull) -> None:
        """Remember the pull just issued (replacing any earlier uncommitted one)."""
        key = self.keys.pull(consumer, rank)
        mapping: dict[str | bytes | bytearray | memoryview | int | float, Any] = {
            "pull_id": pull.pull_id,
            "generation": str(pull.generation),
            "seq": str(pull.seq),
            "step": str(pull.step),
            "owed_token": pull.owed_token,
            "owed_rows": str(pull.owed_rows),
            "rollback_epoch": str(pull.rollback_epoch),
            "rollback": "1" if pull.rollback else "0",
        }

        def run() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(key)
            pipe.hset(key, mapping=mapping)
            pipe.pexpire(key, PULL_TTL_MS)
            pipe.sadd(self.keys.consumers(), consumer)
            pipe.hset(self.keys.seen(), consumer, repr(time.time()))
            pipe.execute()

        self.calls.retry("record_pull", run)

    def pending_pulls(self, consumers: list[str], rank: int) -> dict[str, PendingPull | None]:
        """The uncommitted pulls of ``consumers`` on ``rank`` (one round trip)."""

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for c in consumers:
                pipe.hgetall(self.keys.pull(c, rank))
            return list(pipe.execute())

        raws = self.calls.retry("pending_pulls", run) if consumers else []
        return {c: _pull(raw) for c, raw in zip(consumers, raws, strict=True)}

    def commit(
        self, consumer: str, rank: int, *, pull_id: str, generation: int, seq: int, step: int
    ) -> StoredCursor:
        """Atomically commit the pull ``pull_id``; CommitRejected if it may not be."""
        keys = [self.keys.cursor(consumer, rank), self.keys.pull(consumer, rank)]
        args = [pull_id, str(generation), str(seq), str(step), repr(time.time())]
        replicas = -1
        written_on = ""

        def run() -> Any:
            nonlocal replicas, written_on
            if not self.min_replicas:
                return self._commit(keys=keys, args=args)
            # WAIT counts the writes of its own connection: one pipeline, one connection; the
            # INFO on it names the node that took the write (its run id)
            pipe = self.client.pipeline(transaction=False)
            self._commit(keys=keys, args=args, client=pipe)
            pipe.wait(self.min_replicas, 1000)
            pipe.info("server")
            answer, replicas, info = pipe.execute()
            written_on = str(info.get("run_id", ""))
            return answer

        answer = _s(self.calls.retry("commit", run))
        if answer not in ("ok", "same"):
            raise CommitRejected(
                answer,
                _REJECT_MESSAGES[answer].format(
                    consumer=consumer, rank=rank, pull_id=clip(pull_id, 40)
                ),
            )
        self.calls.check_replicated(int(replicas), written_on)
        stored = self.get_cursor(consumer, rank)
        assert stored is not None
        return stored

    # --- leases and consumers ------------------------------------------------------------

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
        raw = self.calls.retry("consumers", lambda: self.client.smembers(self.keys.consumers()))
        return sorted(_s(c) for c in raw)

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
            if v is None:
                self.calls.retry(
                    "seen", functools.partial(self.client.hsetnx, seen_key, c, repr(now))
                )
            elif float(_s(v)) <= now - idle_s:
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

    def pins(self, rank: int, generation: int) -> list[int]:
        """Seqs that live consumers of ``generation`` stand on: committed cursors and pending
        pulls. An expired-lease consumer pins nothing."""
        names = self.consumers()
        live = [c for c, left in self.lease_remaining(names).items() if left > 0]
        recs: list[StoredCursor | PendingPull | None] = [
            *self.cursors(live, rank).values(),
            *self.pending_pulls(live, rank).values(),
        ]
        return sorted({r.seq for r in recs if r is not None and r.generation == generation})

    def behind_rollback(
        self, rank: int, generation: int, to_step: int, epoch: int, group: str
    ) -> bool:
        """Whether a live consumer matching ``group`` still has to follow the rollback order
        (``to_step``, ``epoch``) on ``rank``: its committed cursor is of ``generation``, past
        ``to_step``, and has not recorded ``epoch``."""
        import fnmatch

        names = [c for c in self.consumers() if fnmatch.fnmatchcase(c, group)]
        live = [c for c, left in self.lease_remaining(names).items() if left > 0]
        return any(
            cur is not None
            and cur.generation == generation
            and cur.step > to_step
            and cur.rollback_epoch < epoch
            for cur in self.cursors(live, rank).values()
        )

    # --- rank registry -------------------------------------------------------------------

    def register_rank(self, rank: int, endpoint: str, generation: int | None) -> None:
        value = json.dumps(
            {"endpoint": endpoint, "generation": generation, "updated_unix": time.time()}
        )
        self.calls.retry(
            "register_rank", lambda: self.client.hset(self.keys.ranks(), str(rank), value)
        )

    def ranks(self) -> dict[int, dict[str, Any]]:
        """rank -> {endpoint, generation, updated_unix} of every registered sidecar."""
        raw = self.calls.retry("ranks", lambda: self.client.hgetall(self.keys.ranks()))
        return {int(_s(k)): json.loads(_s(v)) for k, v in raw.items()}


_REJECT_MESSAGES = {
    "no_consumer": "consumer {consumer!r} has no cursor and no pull on rank {rank}",
    "unknown_pull": "pull {pull_id} is not the last pull issued to {consumer!r} on rank "
    "{rank} (superseded by a newer pull, or already replaced by a later commit)",
    "mismatch": "cursor does not match pull {pull_id} of {consumer!r}: send the cursor "
    "back exactly as received",
    "old_generation": "cursor of {consumer!r} is of an older generation than the committed one",
    "behind": "cursor of {consumer!r} is behind the committed one on rank {rank}",
}
