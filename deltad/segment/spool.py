"""The spool directory layout shared by the trainer's publisher and the sidecar.

::

    <spool>/<model>/
        gen-<generation:020d>/
            generation.json              manifest, by every rank (same bytes: tables, world size)
            rank-<rank:05d>/
                seg-<seq:012d>.dseg      segments (see deltad.segment.format); .tmp-* are in flight
                dense-<seq:012d>.dseg    rank 0: dense parameters and buffers at segment seq
                rebase.request           the sidecar asks for a fresh base (a segment is lost)
        quarantine/                      segments whose checksum failed (moved by the sidecar)
        sidecar/                         sidecar-private state (owed rows of top-k consumers,
                                         rank-<rank>.lock: held by the sidecar serving that rank)
        redis/                           data dir of the embedded Redis server

Generations are integers; a larger one is newer. Only the trainer creates segment files and
only the sidecar rewrites (merges) or deletes them.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

from deltad.config import check_name
from deltad.errors import SpoolError

#: Exact ASCII names only (no other digits, no trailing newline): use ``fullmatch``.
SEGMENT_RE = re.compile(r"seg-([0-9]{12})\.dseg")
DENSE_RE = re.compile(r"dense-([0-9]{12})\.dseg")
GENERATION_RE = re.compile(r"gen-([0-9]{20})")
MANIFEST_NAME = "generation.json"


@dataclass(frozen=True)
class TableInfo:
    """A table as the trainer declared it (global shape, owning module, sharding)."""

    name: str
    num_rows: int
    dim: int
    dtype: str
    module: str  # fqn of the (sharded) EC / EBC that owns it
    kind: str  # "ec" or "ebc"
    sharding_type: str  # torchrec sharding type value, e.g. "row_wise"
    #: A managed-collision (ZCH) table: its rows are slots, and its segments carry each
    #: changed slot's raw id and the raw ids evicted (segment format version 3).
    managed_collision: bool = False


@dataclass(frozen=True)
class GenerationManifest:
    """Written per generation by every rank (the same bytes) before any of its segments: a
    spool shared by all ranks holds one, a spool per host holds its own."""

    model: str
    generation: int
    world_size: int
    start_step: int
    created_unix: float
    tables: tuple[TableInfo, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> GenerationManifest:
        d = json.loads(raw)
        d["tables"] = tuple(TableInfo(**t) for t in d["tables"])
        return cls(**d)


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    path: Path,
    data: bytes | Callable[[BinaryIO], None],
    *,
    fsync: bool = True,
    suffix: str = "",
) -> None:
    """Write ``path`` atomically: a temp file in the same directory (named ``.tmp-*suffix``),
    flushed and fsynced, renamed over ``path``, the directory fsynced; the temp file is
    removed on any failure. ``data`` is the bytes, or a function that streams them into the
    open file (so a large file need not be built in memory first). ``fsync=False`` skips
    both fsyncs (benchmarks on tmpfs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if fsync:
            fsync_dir(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class SpoolLayout:
    """Paths of one model's spool, and listing of what is in it."""

    def __init__(self, root: Path | str, model: str) -> None:
        self.root = Path(root)
        self.model = check_name("model", model)
        self.model_dir = self.root / model

    def generation_dir(self, generation: int) -> Path:
        return self.model_dir / f"gen-{generation:020d}"

    def rank_dir(self, generation: int, rank: int) -> Path:
        return self.generation_dir(generation) / f"rank-{rank:05d}"

    def segment_path(self, generation: int, rank: int, seq: int) -> Path:
        return self.rank_dir(generation, rank) / f"seg-{seq:012d}.dseg"

    def dense_path(self, generation: int, rank: int, seq: int) -> Path:
        """The dense state taken with the rank's segment ``seq`` (rank 0 writes them)."""
        return self.rank_dir(generation, rank) / f"dense-{seq:012d}.dseg"

    def dense_files(self, generation: int, rank: int) -> list[tuple[int, Path]]:
        """(seq, path) of the complete dense state files of a rank, by seq."""
        return self._numbered(generation, rank, DENSE_RE)

    def _numbered(
        self, generation: int, rank: int, pattern: re.Pattern[str]
    ) -> list[tuple[int, Path]]:
        """(number, path) of the rank's files whose whole name matches ``pattern``, sorted."""
        d = self.rank_dir(generation, rank)
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise SpoolError(f"cannot list {d}: {e}") from e
        return sorted((int(m.group(1)), d / n) for n in names if (m := pattern.fullmatch(n)))

    def rebase_request_path(self, generation: int, rank: int) -> Path:
        """Written by the sidecar when a segment of the rank was quarantined or is missing:
        the publisher of that rank answers with a fresh base at its next publish."""
        return self.rank_dir(generation, rank) / "rebase.request"

    def manifest_path(self, generation: int) -> Path:
        return self.generation_dir(generation) / MANIFEST_NAME

    @property
    def quarantine_dir(self) -> Path:
        return self.model_dir / "quarantine"

    @property
    def sidecar_dir(self) -> Path:
        return self.model_dir / "sidecar"

    @property
    def redis_dir(self) -> Path:
        return self.model_dir / "redis"

    def ensure_writable(self) -> None:
        """Create the model dir and prove it is writable, or raise SpoolError."""
        try:
            self.model_dir.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=self.model_dir)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise SpoolError(f"spool directory {self.model_dir} is not writable: {e}") from e

    def rank_lock_path(self, rank: int) -> Path:
        """The lock a sidecar holds on ``rank`` of this spool while it serves it."""
        return self.sidecar_dir / f"rank-{rank:05d}.lock"

    def lock_rank(self, rank: int) -> int:
        """Hold the lock of ``rank`` of this spool (an exclusive ``flock``, gone with the
        process, kill -9 included): the descriptor to close to let it go. SpoolError if
        another process holds it: two sidecars indexing one rank's files would merge and
        delete them under each other (one of them then saw no segment at all)."""
        path = self.rank_lock_path(rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise SpoolError(f"cannot open the rank lock {path}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            try:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SpoolError(
                    f"another sidecar serves rank {rank} of {self.model_dir} (it holds {path}"
                    f"{', ' + holder if holder else ''}): one sidecar per rank and spool"
                ) from None
            raise SpoolError(f"cannot lock {path}: {e}") from e
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        return fd

    def generations(self) -> list[int]:
        """Generations present, oldest first."""
        try:
            names = os.listdir(self.model_dir)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise SpoolError(f"cannot list {self.model_dir}: {e}") from e
        return sorted(int(m.group(1)) for n in names if (m := GENERATION_RE.fullmatch(n)))

    def latest_generation(self) -> int | None:
        """The newest generation that has a manifest, or None."""
        for g in reversed(self.generations()):
            if self.manifest_path(g).exists():
                return g
        return None

    def segments(self, generation: int, rank: int) -> list[tuple[int, Path]]:
        """(seq, path) of the complete segment files of a rank, by seq."""
        return self._numbered(generation, rank, SEGMENT_RE)

    def write_manifest(self, manifest: GenerationManifest, *, fsync: bool = True) -> None:
        try:
            write_atomic(
                self.manifest_path(manifest.generation), manifest.to_json().encode(), fsync=fsync
            )
        except OSError as e:
            raise SpoolError(f"cannot write generation manifest: {e}") from e

    def read_manifest(self, generation: int) -> GenerationManifest:
        p = self.manifest_path(generation)
        try:
            return GenerationManifest.from_json(read_small_file(p).decode())
        except FileNotFoundError:
            raise SpoolError(f"no manifest for generation {generation} at {p}") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SpoolError(f"bad manifest {p}: {e}") from e


#: most bytes of a small spool file (a manifest, a relay's release state)
SMALL_FILE_MAX_BYTES = 16 * 1024 * 1024


class NotRegularFile(ValueError):
    """A spool file that is a symbolic link, a FIFO, a device or a directory."""


def open_regular(path: Path) -> tuple[int, os.stat_result]:
    """(descriptor, stat) of the regular file ``path``, opened as every spool file is: no
    symbolic link followed, no wait on a FIFO (``O_NONBLOCK``); NotRegularFile if it is
    anything else (nothing left open). Other OSErrors propagate (FileNotFoundError: gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symbolic link
            raise NotRegularFile(f"not a regular file ({e.strerror})") from e
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):  # (a FIFO opens at once without O_NONBLOCK's wait)
        os.close(fd)
        raise NotRegularFile(f"not a regular file (mode {st.st_mode:o})")
    return fd, st


def read_small_file(path: Path, max_bytes: int = SMALL_FILE_MAX_BYTES) -> bytes:
    """The bytes of the small regular file ``path`` of a spool, read as the spool's segments
    are opened (:func:`open_regular`; NotRegularFile, a ValueError, if it is none), and at
    most ``max_bytes`` (ValueError past it: a file linked to ``/dev/zero`` or grown without
    bound is not read whole). FileNotFoundError if it is missing; other OSErrors propagate."""
    fd, st = open_regular(path)
    try:
        if st.st_size > max_bytes:
            raise ValueError(f"{st.st_size} bytes, more than {max_bytes}")
        chunks, left = [], max_bytes + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            raise ValueError(f"more than {max_bytes} bytes")
        return data
    finally:
        os.close(fd)
