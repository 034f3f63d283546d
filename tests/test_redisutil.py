"""The embedded Redis server keeps committed data across kill -9 and is reused, not doubled."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltad.errors import OffsetStoreError
from deltad.store import EmbeddedRedis, connect


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


def test_embedded_server_dies_with_its_parent(tmp_path: Path) -> None:
    """A SIGKILLed owner leaves no orphaned redis-server (and the data is still there)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = (
        "import sys, time\n"
        "from deltad.store import EmbeddedRedis, connect\n"
        f"s = EmbeddedRedis({str(tmp_path / 'r')!r}); url = s.start()\n"
        "connect(url).set('k', 'v')\n"
        "print(s.proc.pid, url, flush=True); time.sleep(60)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    pid_s, _url = owner.stdout.readline().split()
    owner.kill()
    owner.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(int(pid_s), 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(int(pid_s), signal.SIGKILL)
        raise AssertionError("redis-server outlived its owner")
    again = EmbeddedRedis(tmp_path / "r")
    try:
        assert connect(again.start()).get("k") == b"v"
        assert again.proc is not None  # the stale url file did not fool it
    finally:
        again.stop()


def test_a_database_index_the_server_lacks_is_said_at_once_not_unreachable(
    redis_server: EmbeddedRedis,
) -> None:
    url = redis_server.url.replace("db=0", "db=99")
    assert "db=99" in url
    with pytest.raises(OffsetStoreError) as err:
        connect(url, attempts=5)
    assert "DB index is out of range" in str(err.value)
    assert "unreachable" not in str(err.value)
