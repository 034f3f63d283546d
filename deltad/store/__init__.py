"""Redis plumbing shared by the sidecar, the consumer library and the demo (one import place).

The code lives by concern:

* :mod:`deltad.store.client`: :func:`connect` / :func:`client_for` / :func:`answers` for any
  offset-store URL (plain, TLS, unix, Sentinel, Cluster), and the error classification a
  retry needs (:func:`is_transient`, :func:`is_auth_error`);
* :mod:`deltad.store.embedded`: :class:`EmbeddedRedis`, the private ``redis-server`` process the
  sidecar runs by default (start or reuse, heal, stop);
* :mod:`deltad.store.datadir`: :class:`RedisDataDir`, that server's private files (config,
  secret, socket, URL, pid).
"""

from __future__ import annotations

from deltad.store.client import answers, client_for, connect, is_auth_error, is_transient
from deltad.store.client import redact_url as _redact
from deltad.store.datadir import DISABLED_COMMANDS, RedisDataDir
from deltad.store.embedded import EmbeddedRedis, redis_server_binary

__all__ = [
    "DISABLED_COMMANDS",
    "EmbeddedRedis",
    "RedisDataDir",
    "_redact",
    "answers",
    "client_for",
    "connect",
    "is_auth_error",
    "is_transient",
    "redis_server_binary",
]
