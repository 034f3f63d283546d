"""The offset store's calls to Redis: bounded retries, one error type, commits its replicas hold.

A call made while answering an RPC (inside :func:`answer_by`) retries only while the answer
can still reach the caller before its deadline, and a store the sidecar's probe found down
(:attr:`RedisCalls.down`) gets one attempt: the caller hears UNAVAILABLE naming the store
that did not answer, not its own DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

import redis
from redis.exceptions import RedisClusterException

from deltad.errors import OffsetStoreError
from deltad.store import _redact

T = TypeVar("T")

log = logging.getLogger(__name__)

#: Time kept for the answer to reach the caller before its deadline.
ANSWER_MARGIN_S = 0.5
#: When the RPC being answered on this thread gives up (time.monotonic()); None: no deadline.
_answer_by: ContextVar[float | None] = ContextVar("deltad_answer_by", default=None)


@contextlib.contextmanager
def answer_by(remaining_s: float | None) -> Iterator[None]:
    """Calls to Redis inside the block stop retrying in time to answer within
    ``remaining_s`` (an RPC's ``context.time_remaining()``; None: no deadline)."""
    token = _answer_by.set(None if remaining_s is None else time.monotonic() + remaining_s)
    try:
        yield
    finally:
        _answer_by.reset(token)


def time_left() -> float | None:
    """Seconds until the RPC being answered gives up (None outside :func:`answer_by`)."""
    end = _answer_by.get()
    return None if end is None else end - time.monotonic()


#: Errors a retry may outlive.
_TRANSIENT = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.ReadOnlyError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    RedisClusterException,
    OSError,
)


class RedisCalls:
    """Runs calls on ``client`` (plain Redis, Sentinel's master or a cluster): connection
    failures are retried ``attempts`` times with exponential backoff, then every failure is
    an :class:`~deltad.errors.OffsetStoreError` (the URL's password redacted). With
    ``min_replicas`` it tells whether a write too few replicas acknowledged may be trusted."""

    def __init__(
        self,
        client: Any,
        *,
        attempts: int = 5,
        backoff_s: float = 0.05,
        url: str = "",
        min_replicas: int = 0,
        timeout_s: float = 2.0,
    ) -> None:
        self.client = client
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.url = url
        #: The client's socket timeout: how long one attempt waits for an answer.
        self.timeout_s = timeout_s
        #: Why the store is down, as the sidecar's probe last found it (None: it answers):
        #: calls then make one attempt each instead of retrying into the callers' deadlines.
        self.down: str | None = None
        #: Replicas that must hold a commit before it is acknowledged (Redis WAIT): a
        #: Sentinel failover promotes a replica, which then has every acknowledged cursor.
        self.min_replicas = min_replicas
        self._attached = True

    def retry(self, what: str, fn: Callable[[], T], *, attempts: int | None = None) -> T:
        """``fn()``, retried while Redis is down or failing over (``attempts`` times, default
        :attr:`attempts`); OffsetStoreError after the last attempt, or at once for an answer
        no retry changes. One attempt while :attr:`down`; inside :func:`answer_by`, no
        attempt that would outlast the caller."""
        delay = self.backoff_s
        last: Exception | None = None
        attempts = 1 if self.down else max(1, attempts or self.attempts)
        tried = 0
        for attempt in range(attempts):
            try:
                tried += 1
                return fn()
            except redis.AuthenticationError as e:  # a refused password is not transient
                raise OffsetStoreError(
                    f"offset store ({self.where}) refused authentication: {e}"
                ) from e
            except _TRANSIENT as e:
                # down, loading its data after a restart, a replica after a failover (Sentinel)
                # or a cluster moving or electing a slot's master
                last = e
                # (the probe found the store down meanwhile: no more waits on it)
                if attempt + 1 >= attempts or self.down or not self._time_for(delay):
                    break
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except redis.RedisError as e:  # an answer no retry changes (OOM, MISCONF, ...)
                raise OffsetStoreError(f"offset store ({self.where}) refused {what}: {e}") from e
        if isinstance(last, redis.TimeoutError):
            raise OffsetStoreError(
                f"the offset store at {self.where} did not answer in {self.timeout_s:g} s "
                f"({what}, {tried} attempt{'s' if tried > 1 else ''})"
            )
        raise OffsetStoreError(
            f"offset store ({self.where}) unavailable during {what} after {tried} "
            f"attempt{'s' if tried > 1 else ''}: {last}"
        )

    @property
    def where(self) -> str:
        """The store's URL without its password, for messages."""
        return _redact(self.url) if self.url else "redis"

    def _time_for(self, delay: float) -> bool:
        """Whether another attempt after ``delay`` can still be answered before the deadline
        of the RPC being answered (always, outside :func:`answer_by`)."""
        left = time_left()
        return left is None or left > delay + self.timeout_s + ANSWER_MARGIN_S

    def check_replicated(self, replicas: int, written_on: str) -> None:
        """OffsetStoreError (the caller retries) for a write that ``replicas`` replicas
        acknowledged on the node ``written_on`` (its run id) if that is too few to trust."""
        if not self.min_replicas or replicas >= self.min_replicas:
            return
        # The write reached too few replicas. If the node that took it is no longer the
        # master the sentinels name (a failover promoted a replica while we wrote), the
        # write may be lost with the old master: never acknowledge it. The consumer
        # retries; on the new master the commit is then made (or 'same') and waited for.
        if self._master_changed(written_on):
            raise OffsetStoreError(
                "the offset store's master changed during the commit (a failover): retry"
            )
        if self._replicas_attached():
            raise OffsetStoreError(
                f"commit reached {replicas} of the {self.min_replicas} replica(s) it must "
                "reach within 1 s (min_replicas): retry"
            )

    def _master_changed(self, run_id: str) -> bool:
        """Whether the sentinels name another master than the node ``run_id`` (or cannot say
        which: then the write is not trusted either). False without Sentinel."""
        pool = self.client.connection_pool
        manager = getattr(pool, "sentinel_manager", None)
        service = getattr(pool, "service_name", None)
        if manager is None or service is None:
            return False
        named: set[str] = set()
        for sentinel in manager.sentinels:  # every sentinel: one not yet told still names the old
            try:
                master = sentinel.sentinel_master(service)
            except Exception:  # that sentinel is down: ask the next
                continue
            flags = str(master.get("flags", ""))
            if "failover" in flags or "o_down" in flags or "s_down" in flags:
                return True  # a failover is under way: the old master's writes may be lost
            named.add(str(master.get("runid", "")))
        return not run_id or named != {run_id}

    def _replicas_attached(self) -> bool:
        """Whether the master has ``min_replicas`` replicas attached: a commit waits for them.
        With fewer (the replica just promoted has none until the lost node comes back) it
        cannot, and an acknowledged commit is only as durable as the master's append-only
        file, as with a single Redis: said once per change, in the log."""
        info = self.retry("replicas", lambda: self.client.info("replication"))
        attached = int(info.get("connected_slaves", 0)) >= self.min_replicas
        if attached != self._attached:
            self._attached = attached
            if not attached:
                log.warning(
                    "offset store: fewer than %d replica(s) attached: commits are acknowledged "
                    "without a replica until one is back",
                    self.min_replicas,
                )
        return attached
