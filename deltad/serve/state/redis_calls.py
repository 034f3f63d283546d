"""The offset store's calls to Redis: bounded retries, one error type, commits its replicas hold."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.exceptions import RedisClusterException

from deltad.errors import OffsetStoreError
from deltad.store import _redact

T = TypeVar("T")

log = logging.getLogger(__name__)

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
    ) -> None:
        self.client = client
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.url = url
        #: Replicas that must hold a commit before it is acknowledged (Redis WAIT): a
        #: Sentinel failover promotes a replica, which then has every acknowledged cursor.
        self.min_replicas = min_replicas
        self._attached = True

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried while Redis is down or failing over; OffsetStoreError after
        the last attempt, or at once for an answer no retry changes."""
        delay = self.backoff_s
        last: Exception | None = None
        for attempt in range(self.attempts):
            try:
                return fn()
            except redis.AuthenticationError as e:  # a refused password is not transient
                where = _redact(self.url) if self.url else "redis"
                raise OffsetStoreError(f"offset store ({where}) refused authentication: {e}") from e
            except _TRANSIENT as e:
                # down, loading its data after a restart, a replica after a failover (Sentinel)
                # or a cluster moving or electing a slot's master
                last = e
                if attempt + 1 < self.attempts:
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
            except redis.RedisError as e:  # an answer no retry changes (OOM, MISCONF, ...)
                where = _redact(self.url) if self.url else "redis"
                raise OffsetStoreError(f"offset store ({where}) refused {what}: {e}") from e
        where = _redact(self.url) if self.url else "redis"
        raise OffsetStoreError(
            f"offset store ({where}) unavailable during {what} after {self.attempts} attempts: "
            f"{last}"
        )

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
