"""The embedded Redis server keeps committed data across kill -9 and is reused, not doubled."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltad.errors import OffsetStoreError
from deltad.redisutil import EmbeddedRedis, connect


def test_data_survives_kill_and_restart(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "r")
    url = server.start()
    connect(url).hset("k", mapping={"seq": 41})
    server.stop(kill=True)  # SIGKILL: appendfsync always must have persisted the write
    again = EmbeddedRedis(tmp_path / "r")
    try:
        url2 = again.start()
        assert connect(url2).hget("k", "seq") == b"41"
    finally:
        again.stop()


def test_second_start_reuses_running_server(tmp_path: Path) -> None:
    first = EmbeddedRedis(tmp_path / "r")
    url = first.start()
    try:
        second = EmbeddedRedis(tmp_path / "r")
        assert second.start() == url
        assert second.proc is None  # nothing new was started
    finally:
        first.stop()


def test_unreachable_redis_is_a_clear_bounded_error() -> None:
    with pytest.raises(OffsetStoreError, match="unreachable after 2 attempts"):
        connect("redis://127.0.0.1:1/0", attempts=2, backoff_s=0.01, socket_timeout_s=0.2)
