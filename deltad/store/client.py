"""Redis clients for the offset store: from any URL the config accepts, proven to answer.

:func:`connect` opens a client from a ``redis://`` / ``rediss://`` / ``unix://`` URL, a
Sentinel URL (``redis+sentinel://h1:26379,h2:26379/mymaster/0``: the master the sentinels
name, followed across failovers) or a Cluster URL (``redis+cluster://h1:7000,h2:7001``:
startup nodes) and proves it answers, with bounded retries and backoff (:func:`client_for`
opens one without the proof). The URLs are parsed and checked in :mod:`deltad.config`.
"""

from __future__ import annotations

import re
import time
from typing import Any

import redis
from redis.exceptions import RedisClusterException

from deltad.config import CLUSTER_SCHEMES, SENTINEL_SCHEMES, check_redis_url, parse_nodes_url
from deltad.errors import ConfigError, OffsetStoreError


def client_for(url: str, *, socket_timeout_s: float, health_check_interval: int = 0) -> Any:
    """A client for any URL :func:`~deltad.config.check_redis_url` accepts: ``redis.Redis``
    (plain, or the master of a Sentinel service, re-asked of the sentinels after a failover)
    or ``redis.cluster.RedisCluster``. Not yet proven to answer; ValueError on a bad URL."""
    scheme = url.partition("://")[0]
    timeouts: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": socket_timeout_s,
    }
    if scheme not in SENTINEL_SCHEMES + CLUSTER_SCHEMES:
        return redis.Redis.from_url(url, health_check_interval=health_check_interval, **timeouts)
    u = parse_nodes_url(url)
    tls: dict[str, Any] = {}
    if u.tls:
        tls = {"ssl": True}
        if "ssl_ca_certs" in u.options:
            tls["ssl_ca_certs"] = u.options["ssl_ca_certs"]
    auth: dict[str, Any] = {"username": u.username, "password": u.password}
    if u.kind == "cluster":
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in u.nodes],
            **auth,
            **tls,
            **timeouts,
        )
    from redis.sentinel import Sentinel

    sentinel_kw: dict[str, Any] = dict(timeouts, **tls)
    if "sentinel_password" in u.options:
        sentinel_kw["password"] = u.options["sentinel_password"]
    if "sentinel_username" in u.options:
        sentinel_kw["username"] = u.options["sentinel_username"]
    sentinel = Sentinel(list(u.nodes), sentinel_kwargs=sentinel_kw, **timeouts)
    return sentinel.master_for(
        u.service, db=u.db, health_check_interval=health_check_interval, **auth, **tls, **timeouts
    )


def answers(url: str, *, timeout_s: float = 0.5) -> bool:
    """Whether the Redis at ``url`` answers a PING within ``timeout_s``."""
    try:
        c = client_for(url, socket_timeout_s=timeout_s)
        try:
            return bool(c.ping())
        finally:
            c.close()
    except (redis.RedisError, RedisClusterException, OSError, ValueError, ConfigError):
        return False


def connect(
    url: str,
    *,
    attempts: int = 5,
    backoff_s: float = 0.1,
    socket_timeout_s: float = 5.0,
) -> Any:
    """A client for ``url`` that has answered a PING, or OffsetStoreError after retries.

    A malformed URL is a ConfigError; a refused password or another answer no retry changes
    (a database index the server does not have) an OffsetStoreError at once, saying what
    the server answered, not "unreachable"."""
    check_redis_url(url)
    last: Exception | None = None
    delay = backoff_s
    for _ in range(max(1, attempts)):
        try:
            client = client_for(url, socket_timeout_s=socket_timeout_s, health_check_interval=30)
            client.ping()
            return client
        except redis.AuthenticationError as e:
            raise OffsetStoreError(f"redis at {redact_url(url)} refused authentication: {e}") from e
        except redis.ResponseError as e:
            if is_auth_error(e):
                raise OffsetStoreError(
                    f"redis at {redact_url(url)} refused authentication: {e}"
                ) from e
            if not is_transient(e):
                raise OffsetStoreError(f"redis at {redact_url(url)} answered: {e}") from e
            last = e
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        except (redis.RedisError, RedisClusterException, OSError) as e:
            last = e
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
    raise OffsetStoreError(
        f"redis at {redact_url(url)} unreachable after {attempts} attempts: {last}"
    )


def is_transient(e: redis.ResponseError) -> bool:
    """Whether a Redis error answer may go away by itself (a cluster or replica that is
    failing over, a server loading its data): worth a retry."""
    if isinstance(e, redis.exceptions.ClusterDownError | redis.exceptions.TryAgainError):
        return True
    return str(e).startswith(("MASTERDOWN", "LOADING", "CLUSTERDOWN", "TRYAGAIN", "READONLY"))


def is_auth_error(e: BaseException) -> bool:
    """Whether ``e`` is Redis refusing the credentials (never transient: not retried)."""
    if isinstance(e, redis.AuthenticationError):
        return True
    text = str(e)
    return isinstance(e, redis.ResponseError) and (
        text.startswith(("NOAUTH", "WRONGPASS")) or "already authenticated" in text
    )


def redact_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    url = re.sub(r"([?&]password=)[^&]*", r"\1***", url)
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
