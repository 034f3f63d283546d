"""The embedded offset store: locked down (unix socket in a 0700 dir, password, dangerous
commands disabled, 0600 files), restarted by the sidecars after kill -9 with its data, never
taken down by a sidecar's crash; health and the Redis-up gauge follow it. Real redis-server
processes, real kill -9."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.backoff import NoBackoff
from redis.retry import Retry
from serverkit import Client, SpoolWriter, server_config, wait_for
from spoolkit import child_env, read_serving_line, stop_process

from deltad.errors import OffsetStoreError
from deltad.serve.edge.app import SidecarServer
from deltad.store import DISABLED_COMMANDS, EmbeddedRedis, answers, connect

pytestmark = pytest.mark.timeout(180)


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_embedded_redis_is_locked_down(tmp_path: Path) -> None:
    r = EmbeddedRedis(tmp_path / "r")
    url = r.start()
    try:
        assert url.startswith("unix://") and "password=" in url
        c = connect(url)
        c.set("k", "v")
        for cmd in DISABLED_COMMANDS:
            with pytest.raises(redis.ResponseError, match="unknown command"):
                c.execute_command(cmd, "x")
        # the password is needed, and is not on the server's command line
        sock = str(r.socket_path)
        # (no retries: redis-py 8 retries NOAUTH, an AuthenticationError, for ~3.4 s)
        anon = redis.Redis(unix_socket_path=sock, socket_timeout=2, retry=Retry(NoBackoff(), 0))
        with pytest.raises(redis.RedisError, match=r"NOAUTH|Authentication|authenticated"):
            anon.get("k")
        pid = r.pid()
        assert pid is not None
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert url.split("password=")[1].encode() not in cmdline and b"--port" not in cmdline
        # private files: the directory 0700, the secret, URL, config and data files 0600
        assert _mode(r.data_dir) == 0o700 and _mode(r.socket_path.parent) == 0o700
        files = [f for f in r.data_dir.iterdir() if f.is_file() and not f.name.endswith(".sock")]
        assert {"secret", "embedded.url", "redis.conf"} <= {f.name for f in files}
        aof = [f for f in files if "aof" in f.name]
        assert aof and all(_mode(f) == 0o600 for f in files), {f.name: oct(_mode(f)) for f in files}
        # another local user reaches nothing (not the socket, not the secret)
        code = (
            "import os, socket, sys\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "try:\n"
            f"    socket.socket(socket.AF_UNIX).connect({sock!r}); print('connected')\n"
            "except OSError as e: print('refused', e.errno)\n"
            "try:\n"
            f"    open({str(r.data_dir / 'secret')!r}).read(); print('read')\n"
            "except OSError as e: print('refused', e.errno)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=30)  # fmt: skip
        if "Operation not permitted" in out.stderr:
            pytest.skip("cannot switch to uid nobody here")
        assert out.stdout.split("\n")[:2] == ["refused 13", "refused 13"], out
    finally:
        r.stop()


def test_a_wrong_password_is_not_retried_as_transient(tmp_path: Path) -> None:
    r = EmbeddedRedis(tmp_path / "r")
    url = r.start()
    try:
        nopass = url.split("?")[0]
        t0 = time.monotonic()
        with pytest.raises(OffsetStoreError, match="refused authentication"):
            connect(nopass, attempts=5, backoff_s=1.0)
        assert time.monotonic() - t0 < 1.0  # (redis-py retried NOAUTH for ~3.4 s)
        bad = url.split("password=")[0] + "password=guess-4711"
        t0 = time.monotonic()
        with pytest.raises(OffsetStoreError, match="refused authentication") as e:
            connect(bad, attempts=5, backoff_s=1.0)
        assert time.monotonic() - t0 < 1.0 and "guess-4711" not in str(e.value)
    finally:
        r.stop()


def test_kill_9_of_the_embedded_redis_heals_with_its_data(tmp_path: Path) -> None:
    SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", None)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        c.commit(c.pull("a"))
        assert srv._embedded is not None
        pid = srv._embedded.pid()
        assert pid is not None
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)

        def pulls() -> bool:
            try:
                return not c.pull("a").resync  # its committed cursor came back
            except grpc.RpcError:
                return False

        wait_for(pulls, 10, "the store back")
        back = time.monotonic() - t0
        assert srv._embedded.pid() != pid and srv.metrics.redis_restarts._value.get() == 1
        assert srv.metrics.redis_up._value.get() == 1
        print(f"embedded redis back {back:.2f} s after kill -9")
        assert back < 5
    finally:
        c.close()
        srv.stop(0)
    assert not answers(srv.redis_url)  # its last user shut it down


def test_health_is_not_serving_while_the_store_is_down(tmp_path: Path) -> None:
    SpoolWriter(tmp_path / "spool")
    ext = EmbeddedRedis(tmp_path / "ext")  # an external Redis: the sidecar cannot restart it
    ext.start()
    srv = SidecarServer(server_config(tmp_path / "spool", ext.url)).start()
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    health = health_pb2_grpc.HealthStub(ch)

    def status() -> int:
        return int(health.Check(health_pb2.HealthCheckRequest(), timeout=5).status)

    try:
        assert status() == health_pb2.HealthCheckResponse.SERVING
        ext.stop(kill=True)
        wait_for(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "down")
        assert srv.metrics.redis_up._value.get() == 0
        ext = EmbeddedRedis(tmp_path / "ext")
        ext.start()
        wait_for(lambda: status() == health_pb2.HealthCheckResponse.SERVING, 10, "up")
        assert srv.metrics.redis_up._value.get() == 1
    finally:
        ch.close()
        srv.stop(0)
        ext.stop()


def _serve(spool: Path, rank: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "serve", "--spool", str(spool), "--model", "m",
         "--rank", str(rank), "--listen", "127.0.0.1:0", "--grace-period", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
    )  # fmt: skip


@pytest.mark.slow
def test_no_sidecar_crash_takes_down_another_ranks_offset_store(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    for rank in (0, 1):
        SpoolWriter(spool, rank=rank, world_size=2)
    first = _serve(spool, 0)
    second: subprocess.Popen[str] | None = None
    store = EmbeddedRedis(spool / "m" / "redis")
    try:
        c0 = Client(read_serving_line(first, 60))
        second = _serve(spool, 1)
        c1 = Client(read_serving_line(second, 60))
        c1.commit(c1.pull("p"))
        pid = store.pid()
        first.send_signal(signal.SIGKILL)  # the sidecar that started the embedded Redis
        first.wait(10)
        for _ in range(3):  # rank 1's store never went away: same server, cursor kept
            d = c1.pull("p")
            assert not d.resync
            c1.commit(d)
            time.sleep(0.3)
        assert store.pid() == pid
        first = _serve(spool, 0)  # the restarted sidecar reuses it
        c0 = Client(read_serving_line(first, 60))
        c0.commit(c0.pull("p"))
        assert store.pid() == pid
        c0.close()
        c1.close()
    finally:
        stop_process(first)
        if second is not None:
            stop_process(second)
    url = (spool / "m" / "redis" / "embedded.url").read_text() if store.url_file.exists() else ""
    assert not url or not answers(url)  # the last sidecar to stop shut it down


def test_a_spool_too_long_for_a_socket_puts_it_in_a_private_unpredictable_dir(
    tmp_path: Path,
) -> None:
    """The old name (deltad-redis-<uid>-<hash of the spool>) could be pre-created by any
    local user to stop the sidecar from starting: the directory is now mkdtemp's, recorded in
    the data dir, and a recorded one that is not ours any more is replaced."""
    import hashlib
    import tempfile

    data = tmp_path / ("d" * 120) / "redis"
    digest = hashlib.sha256(str(data.resolve()).encode()).hexdigest()[:16]
    squatted = Path(tempfile.gettempdir()) / f"deltad-redis-{os.getuid()}-{digest}"
    squatted.mkdir(mode=0o755, exist_ok=True)  # what another user would pre-create
    try:
        r = EmbeddedRedis(data)
        r.start()
        try:
            sock = r.socket_path
            assert sock.parent != squatted and sock.parent.name.startswith("deltad-redis-")
            assert _mode(sock.parent) == 0o700 and sock.exists()
            assert redis.Redis.from_url(r.url, socket_timeout=2).ping()
            again = EmbeddedRedis(data)  # a second sidecar of the spool: the same socket
            assert again.socket_path == sock
            os.chmod(sock.parent, 0o755)  # no longer private: a new dir, not this one
            made = again.socket_path.parent
            assert made != sock.parent
        finally:
            r.stop()
    finally:
        squatted.rmdir()
        for d in {sock.parent, made}:
            shutil.rmtree(d, ignore_errors=True)
