"""Per-consumer cursors, pulls and commits, and the rank registry, in Redis (keys: deltad.keys).

Consumer membership and leases are :mod:`deltad.serve.state.members` (``OffsetStore.members``).

Every call retries connection failures a bounded number of times with exponential backoff and
then raises :class:`~deltad.errors.OffsetStoreError` (:mod:`deltad.serve.state.redis_calls`);
nothing is ever reset on failure. Commit is one Lua script: forward-only (except the commit of a
rollback window, which moves the cursor back to the rollback's step), only for the pull this
server issued to that consumer.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from deltad.config import SENTINEL_SCHEMES, SERVER_RANGES, clip, options_min_replicas
from deltad.errors import StaleCursorError
from deltad.keys import RedisKeys
from deltad.serve.ratelog import RateLimitedLog
from deltad.serve.state.members import ConsumerMembers
from deltad.serve.state.redis_calls import RedisCalls
from deltad.store import connect

log = logging.getLogger(__name__)

_R = TypeVar("_R")
#: ranks past this are no sidecar's (the ``rank`` setting's bound)
MAX_RANKS = int(SERVER_RANGES["rank"].hi) + 1

#: How long one call waits for the offset store's answer (its client's socket timeout).
STORE_TIMEOUT_S = 2.0
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
local c = redis.call('HMGET', KEYS[1], 'generation', 'seq', 'rollback_epoch', 'step',
                     'owed_rows', 'pull_id', 'owed_token', 'updated_unix')
local epoch = tonumber(p[7] or '0') or 0
-- a cursor deltad did not write is taken as none, as the server that issued this pull took
-- it (offsets._cursor: the same rules), and this commit writes a good one
local function uint(v) return v == '0' or (v and string.match(v, '^[1-9]%d*$') ~= nil) end
local function sint(v) return v == '0' or (v and string.match(v, '^%-?[1-9]%d*$') ~= nil) end
local function opt(v) return not v or v == '' or uint(v) end
local function tok(v) return not v or v == '' or (#v <= 128 and string.match(v, '^[%w_%-]+$') ~= nil) end
local function num(v)
  return not v or v == '' or string.match(v, '^%-?%d+%.?%d*$') ~= nil
    or string.match(v, '^%-?%d+%.?%d*[eE][%-+]?%d+$') ~= nil
end
if c[1] and uint(c[1]) and sint(c[2]) and opt(c[3]) and sint(c[4]) and opt(c[5])
   and tok(c[6]) and tok(c[7]) and num(c[8]) then
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
    #: a rollback window (or a relay's resync before its cursor): its commit may move the
    #: cursor back (and only its commit)
    rollback: bool = False


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class MalformedRecord(ValueError):
    """A consumer's cursor or pull record in Redis that deltad did not write: a field missing,
    not an integer, or an owed-rows token that is not one deltad makes."""


#: a pull id or owed-rows token as deltad writes them (a uuid4's hex): at least nothing that
#: could leave the owed-rows directory as a file name
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")
#: integers and times as deltad writes them (``str(int)``, ``repr(time.time())``); the
#: commit's Lua script takes a cursor by the same rules (``_COMMIT``)
_UINT = re.compile(r"0|[1-9][0-9]*")
_SINT = re.compile(r"0|-?[1-9][0-9]*")
_TIME = re.compile(r"-?[0-9]+\.?[0-9]*([eE][-+]?[0-9]+)?")


def _fields(raw: dict[Any, Any]) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in raw.items()}


def _int(d: dict[str, str], name: str, default: str | None = None, *, signed: bool = False) -> int:
    v = d.get(name, default)
    if v is None:
        raise MalformedRecord(f"no {name}")
    if default is not None and v == "":
        v = default
    if not (_SINT if signed else _UINT).fullmatch(v):
        raise MalformedRecord(f"{name} {clip(v)} is not an integer deltad writes")
    return int(v)


def _token(d: dict[str, str], name: str, required: bool = False) -> str:
    v = d.get(name, "")
    if (v or required) and not _TOKEN.fullmatch(v):
        raise MalformedRecord(f"{name} {clip(v)} is not one deltad makes")
    return v


def _cursor(raw: dict[Any, Any]) -> StoredCursor | None:
    """The stored cursor (None: none); MalformedRecord if deltad did not write it."""
    if not raw:
        return None
    d = _fields(raw)
    when = d.get("updated_unix", "") or "0"
    if not _TIME.fullmatch(when):
        raise MalformedRecord(f"updated_unix {clip(when)} is not a time deltad writes")
    updated = float(when)
    return StoredCursor(
        generation=_int(d, "generation"),
        seq=_int(d, "seq", signed=True),
        step=_int(d, "step", signed=True),
        pull_id=_token(d, "pull_id"),
        owed_token=_token(d, "owed_token"),
        owed_rows=_int(d, "owed_rows", "0"),
        updated_unix=updated,
        rollback_epoch=_int(d, "rollback_epoch", "0"),
    )


def _pull(raw: dict[Any, Any]) -> PendingPull | None:
    """The pending pull (None: none); MalformedRecord if deltad did not write it."""
    if not raw:
        return None
    d = _fields(raw)
    return PendingPull(
        _token(d, "pull_id", required=True),
        _int(d, "generation"),
        _int(d, "seq", signed=True),
        _int(d, "step", signed=True),
        _token(d, "owed_token"),
        _int(d, "owed_rows", "0"),
        _int(d, "rollback_epoch", "0"),
        d.get("rollback", "") == "1",
    )


class OffsetStore:
    """Cursors, pulls and commits of one model's consumers; their membership and leases are
    :attr:`members` (a :class:`ConsumerMembers`), delegated to by the methods of the same name."""

    def __init__(
        self,
        client: Any,  # redis.Redis (plain or Sentinel's master) or RedisCluster
        model: str,
        *,
        attempts: int = 5,
        backoff_s: float = 0.05,
        url: str = "",
        min_replicas: int = 0,
        timeout_s: float = 2.0,
    ) -> None:
        self.client = client
        #: (consumer, rank, kind) of malformed records warned about (see _parsed)
        self._warned: set[tuple[str, int, str]] = set()
        self._bad_records = RateLimitedLog(logger=log)
        #: How every call reaches Redis: retries, errors, replica acknowledgement.
        self.calls = RedisCalls(
            client, attempts=attempts, backoff_s=backoff_s, url=url, min_replicas=min_replicas,
            timeout_s=timeout_s,
        )  # fmt: skip
        self.keys = RedisKeys(model)
        self._commit = client.register_script(_COMMIT)
        #: Consumer membership and leases (who is known, who is live, forgetting).
        self.members = ConsumerMembers(client, self.calls, self.keys)

    @classmethod
    def from_url(cls, url: str, model: str, **kw: Any) -> OffsetStore:
        """Connect (bounded retries) and wrap; OffsetStoreError if Redis does not answer.
        A Sentinel URL waits for ``min_replicas`` (default 1) replicas on every commit."""
        scheme, _, rest = url.partition("://")
        if scheme in SENTINEL_SCHEMES:
            given = options_min_replicas(rest.partition("?")[2])
            kw.setdefault("min_replicas", 1 if given is None else given)
        timeout_s = kw.pop("timeout_s", STORE_TIMEOUT_S)
        client = connect(url, socket_timeout_s=timeout_s)
        return cls(client, model, url=url, timeout_s=timeout_s, **kw)

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
        return {
            c: self._parsed(_cursor, raw, c, rank, "cursor")
            for c, raw in zip(consumers, raws, strict=True)
        }

    def _parsed(self, parse: Callable[[Any], _R | None], raw: Any, consumer: str, rank: int,
                what: str) -> _R | None:  # fmt: skip
        """``parse(raw)``; a record deltad did not write is taken as none (the consumer
        resyncs from the base, and its next pull and commit write good ones), with one
        warning per consumer, rank and kind of record while it stays bad."""
        key = (consumer, rank, what)
        try:
            got = parse(raw)
        except MalformedRecord as e:
            if key not in self._warned:
                if len(self._warned) >= 1024:  # (past that many: one line now and then)
                    self._bad_records.warning(
                        "the %s of consumer %r on rank %d in Redis is malformed (%s): taken "
                        "as none", what, consumer, rank, e,
                    )  # fmt: skip
                    return None
                self._warned.add(key)
                log.warning(
                    "the %s of consumer %r on rank %d in Redis is malformed (%s): taken as "
                    "none; the consumer is served from the base and its next %s replaces it",
                    what, consumer, rank, e, "commit" if what == "cursor" else "pull",
                )  # fmt: skip
            return None
        if self._warned:
            self._warned.discard(key)  # (good again: a new breakage is said again)
        return got

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
        return {
            c: self._parsed(_pull, raw, c, rank, "pending pull")
            for c, raw in zip(consumers, raws, strict=True)
        }

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

    # --- leases and consumers (see ConsumerMembers) -------------------------------------

    def register(self, consumer: str, ttl_s: float) -> None:
        """See :meth:`ConsumerMembers.register`."""
        self.members.register(consumer, ttl_s)

    def heartbeat(self, consumer: str, default_ttl_s: float) -> float | None:
        """See :meth:`ConsumerMembers.heartbeat`."""
        return self.members.heartbeat(consumer, default_ttl_s)

    def release(self, consumer: str) -> None:
        """See :meth:`ConsumerMembers.release`."""
        self.members.release(consumer)

    def touch(self, consumer: str, default_ttl_s: float) -> None:
        """See :meth:`ConsumerMembers.touch`."""
        self.members.touch(consumer, default_ttl_s)

    def admits(self, consumer: str, max_consumers: int) -> bool:
        """See :meth:`ConsumerMembers.admits`."""
        return self.members.admits(consumer, max_consumers)

    def consumers(self) -> list[str]:
        """See :meth:`ConsumerMembers.consumers`."""
        return self.members.consumers()

    def lease_remaining(self, consumers: list[str]) -> dict[str, float]:
        """See :meth:`ConsumerMembers.lease_remaining`."""
        return self.members.lease_remaining(consumers)

    def forget_idle(self, world_size: int, idle_s: float, *, limit: int = 100) -> list[str]:
        """See :meth:`ConsumerMembers.forget_idle`."""
        return self.members.forget_idle(world_size, idle_s, limit=limit)

    def forget(self, consumer: str, world_size: int) -> bool:
        """See :meth:`ConsumerMembers.forget`."""
        return self.members.forget(consumer, world_size)

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

    def live_cursors(self, rank: int) -> dict[str, StoredCursor]:
        """The committed cursors on ``rank`` of the consumers whose lease is alive."""
        names = self.consumers()
        live = [c for c, left in self.lease_remaining(names).items() if left > 0]
        return {c: cur for c, cur in self.cursors(live, rank).items() if cur is not None}

    # --- rank registry -------------------------------------------------------------------

    def register_rank(
        self,
        rank: int,
        endpoint: str,
        generation: int | None,
        restore: dict[str, Any] | None = None,
    ) -> None:
        """Record where ``rank``'s sidecar listens, its generation and (``restore``) the steps
        its log can restore (deltad.serve.index.restore.restore_points), for the other ranks'
        rollout controls."""
        entry: dict[str, Any] = {
            "endpoint": endpoint, "generation": generation, "updated_unix": time.time()
        }  # fmt: skip
        if restore is not None:
            entry["restore"] = restore
        value = json.dumps(entry)
        self.calls.retry(
            "register_rank", lambda: self.client.hset(self.keys.ranks(), str(rank), value)
        )

    def ranks(self) -> dict[int, dict[str, Any]]:
        """rank -> {endpoint, generation, updated_unix} of every registered sidecar (entries
        deltad did not write, or of a rank past any world size, are left out)."""
        raw = self.calls.retry("ranks", lambda: self.client.hgetall(self.keys.ranks()))
        out: dict[int, dict[str, Any]] = {}
        for k, v in raw.items():
            try:
                rank, entry = int(_s(k)), json.loads(_s(v))
            except ValueError:
                continue
            if 0 <= rank < MAX_RANKS and isinstance(entry, dict):
                out[rank] = entry
        return out


_REJECT_MESSAGES = {
    "no_consumer": "consumer {consumer!r} has no cursor and no pull on rank {rank}",
    "unknown_pull": "pull {pull_id} is not the last pull issued to {consumer!r} on rank "
    "{rank} (superseded by a newer pull, or already replaced by a later commit)",
    "mismatch": "cursor does not match pull {pull_id} of {consumer!r}: send the cursor "
    "back exactly as received",
    "old_generation": "cursor of {consumer!r} is of an older generation than the committed one",
    "behind": "cursor of {consumer!r} is behind the committed one on rank {rank}",
}
