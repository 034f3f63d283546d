"""The embedded Redis's data directory: its private files (config, secret, socket, URL, pid).

Everything :class:`~deltad.store.embedded.EmbeddedRedis` keeps on disk, written 0600 into a 0700
directory of this user: ``secret`` (the random password), ``embedded.url`` (the URL with it),
``redis.conf``, ``redis.pid``, ``socket.dir`` (where the socket lives when the directory's
path is too long for one), and the server's own ``redis.log`` and append-only files.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

from deltad.errors import OffsetStoreError

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


class RedisDataDir:
    """The files of one embedded server in ``path``; the socket path and the password stay
    the same across restarts, so every client's URL stays valid."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    @property
    def url_file(self) -> Path:
        """``embedded.url``: the server's URL with its password, for the spool's other users."""
        return self.path / "embedded.url"

    @property
    def log_file(self) -> Path:
        """``redis.log``: the server's own log."""
        return self.path / "redis.log"

    def create(self) -> None:
        """Create the directory 0700, or check that it is a real directory of ours."""
        _private_dir(self.path)

    def lock_file(self, name: str) -> int:
        """An open descriptor of the lock file ``name`` (0600) in the directory, to ``flock``."""
        return os.open(self.path / name, os.O_RDWR | os.O_CREAT, 0o600)

    @property
    def socket_path(self) -> Path:
        """The unix socket: in the directory, or if that path is too long for a socket, in a
        private directory under the temp dir with an unpredictable name (``mkdtemp``, 0700),
        recorded in ``socket.dir`` so every sidecar of the spool and every restart finds the
        same one. A recorded directory that is gone or not ours is replaced by a new one:
        nobody can pre-create the name and stop the sidecar from starting."""
        sock = self.path.resolve() / "redis.sock"
        if len(str(sock)) <= _MAX_SOCKET_PATH:
            return sock
        record = self.path / "socket.dir"
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

    def secret(self) -> str:
        """The server's password: read from ``secret`` (which must be a 0600 file of this
        user), or made and written there the first time."""
        path = self.path / "secret"
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

    def url(self) -> str:
        """The server's URL (``unix://...?db=0&password=...``)."""
        secret = self.secret()
        return f"unix://{self.socket_path}?db=0&password={secret}"

    def config(self, secret: str, *, admin_commands: bool) -> str:
        """The text of ``redis.conf``: unix socket only, append-only with ``appendfsync
        always``, the password, and (unless ``admin_commands``) :data:`DISABLED_COMMANDS`
        renamed away."""
        sock = self.socket_path
        data = self.path.resolve()
        lines = [
            "port 0",
            f'unixsocket "{sock}"',
            "unixsocketperm 700",
            f'dir "{data}"',
            "appendonly yes",
            "appendfsync always",
            'save ""',
            "daemonize no",
            "protected-mode yes",
            f'logfile "{data / "redis.log"}"',
            f"requirepass {secret}",
        ]
        if not admin_commands:
            lines += [f'rename-command {c} ""' for c in DISABLED_COMMANDS]
        return "\n".join(lines) + "\n"

    def prepare_start(self, *, admin_commands: bool) -> Path:
        """Ready the files for a new server and return its ``redis.conf``: the socket's
        private directory, no dead server's socket, the config, every data file 0600."""
        sock = self.socket_path
        if sock.parent != self.path.resolve():
            _private_dir(sock.parent)
        sock.unlink(missing_ok=True)  # a dead server's socket
        secret = self.secret()
        conf = self.path / "redis.conf"
        _write_private(conf, self.config(secret, admin_commands=admin_commands))
        for f in self.path.iterdir():  # data files of older versions: 0600 too
            if f.is_file() and not f.is_symlink():
                os.chmod(f, 0o600)
        return conf

    def write_url(self, url: str) -> None:
        """Record the server's URL in ``embedded.url``."""
        _write_private(self.url_file, url)

    def write_pid(self, pid: int) -> None:
        """Record the running server's pid in ``redis.pid``."""
        _write_private(self.path / "redis.pid", str(pid))

    def pid(self) -> int | None:
        """The pid recorded in ``redis.pid``, if any."""
        try:
            return int((self.path / "redis.pid").read_text())
        except (OSError, ValueError):
            return None
