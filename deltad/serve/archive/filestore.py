"""The archive on a shared file system (``file:///mount/path``): create-once by hard link,
compare-and-swap under an exclusive lock.

An object is written to a hidden temp file beside its key, fsynced, then hard-linked to its
key: ``link`` fails if the key exists, so two writers never replace each other's object and a
reader never sees half of one. The manifest's compare-and-swap holds ``flock`` on a lock
file beside it while it compares the current bytes' tag and renames the new bytes in.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import xxhash

from deltad.segment.spool import fsync_dir
from deltad.serve.archive.store import (
    ArchiveError,
    ArchiveUnavailable,
    ObjectStore,
    Versioned,
    check_key,
)


def _tag(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


class FileStore(ObjectStore):
    """Objects as files under ``root`` (created if missing)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _fail(self, what: str, key: str, e: OSError) -> ArchiveError:
        if e.errno in (errno.ENOENT, errno.ENOTDIR) and not self.root.is_dir():
            return ArchiveUnavailable(f"{self.url}: not mounted? ({what} {key}: {e})")
        if e.errno in (errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.ENOSPC):
            return ArchiveUnavailable(f"{self.url}: {what} {key}: {e}")
        return ArchiveError(f"{self.url}: {what} {key}: {e}")

    def put_if_absent(self, key: str, src: Path) -> bool:
        dest = self._path(key)
        tmp = ""
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=dest.parent)
            with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
                while chunk := f.read(1 << 20):
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            try:
                os.link(tmp, dest)
            except FileExistsError:
                return False
            fsync_dir(dest.parent)
            return True
        except OSError as e:
            raise self._fail("put", key, e) from e
        finally:
            if tmp:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                return f.read() if length is None else f.read(length)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise self._fail("get", key, e) from e

    def size(self, key: str) -> int | None:
        try:
            return os.stat(self._path(key)).st_size
        except FileNotFoundError:
            if not self.root.is_dir():
                raise ArchiveUnavailable(f"{self.url}: not mounted?") from None
            return None
        except OSError as e:
            raise self._fail("stat", key, e) from e

    def list(self, prefix: str) -> Iterator[str]:
        base = self.root / prefix if prefix else self.root
        if prefix and not base.is_dir():
            return
        for dirpath, _, names in os.walk(base):
            rel = os.path.relpath(dirpath, self.root)
            for n in names:
                if n.startswith(".tmp-") or n.endswith(".lock"):
                    continue
                yield n if rel == "." else f"{rel}/{n}"

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:
            raise self._fail("delete", key, e) from e

    def read_versioned(self, key: str) -> Versioned | None:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._fail("read", key, e) from e
        return Versioned(data, _tag(data))

    def compare_and_swap(self, key: str, data: bytes, expected: str | None) -> str | None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise self._fail("lock", key, e) from e
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cur = self.read_versioned(key)
            if (cur.tag if cur is not None else None) != expected:
                return None
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            fsync_dir(path.parent)
            return _tag(data)
        except OSError as e:
            raise self._fail("swap", key, e) from e
        finally:
            os.close(lock)
