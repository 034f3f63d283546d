"""The object store seam: create-once objects, ranged reads, listing, deletion and one
compare-and-swap of a small object (the archive's manifest), behind one abstract class.

Backends: :class:`~deltad.serve.archive.filestore.FileStore` (``file:///shared/mount``) and
:class:`~deltad.serve.archive.s3store.S3Store` (``s3://bucket/prefix``); :func:`open_store`
picks one from a URL. Every method raises :class:`ArchiveError` (or its subclass
:class:`ArchiveUnavailable`, for a store that does not answer: the caller retries) and never
anything else on purpose.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from deltad.errors import ConfigError, DeltadError

__all__ = [
    "ArchiveError",
    "ArchiveUnavailable",
    "ObjectStore",
    "Versioned",
    "check_key",
]

#: Longest key the archive writes (S3 allows 1024 bytes).
MAX_KEY = 900


class ArchiveError(DeltadError):
    """The object store refused an operation, or an object read back is not what was
    written (a corrupted or truncated object is refused, like a spool file)."""


class ArchiveUnavailable(ArchiveError):
    """The object store did not answer (down, unreachable, timing out): retry later."""


@dataclass(frozen=True)
class Versioned:
    """A small object's bytes and the tag a compare-and-swap must name to replace them."""

    data: bytes
    tag: str


def check_key(key: str) -> str:
    """``key`` if it is a relative key the archive writes (no empty, ``.`` or ``..`` part, no
    leading slash, printable ASCII); ConfigError otherwise."""
    parts = key.split("/")
    if (
        not key
        or len(key) > MAX_KEY
        or not key.isascii()
        or not key.isprintable()
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise ConfigError(f"bad object key {key[:80]!r}")
    return key


class ObjectStore(abc.ABC):
    """Objects under one root (a bucket and prefix, or a directory); keys are relative."""

    #: the URL it was opened from (for logs and Status; no credentials are ever in it)
    url: str

    @abc.abstractmethod
    def put_if_absent(self, key: str, src: Path) -> bool:
        """Create ``key`` with the bytes of the file ``src`` unless it exists; True if this
        call created it. Never replaces an existing object."""

    @abc.abstractmethod
    def get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        """``length`` bytes of ``key`` from ``start`` (None: to the end); FileNotFoundError
        if there is no such object."""

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """The size of ``key`` in bytes; None if there is no such object."""

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[str]:
        """The keys under ``prefix`` (a folder: ends with ``/``), in no promised order."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key`` (no error if it is gone)."""

    @abc.abstractmethod
    def read_versioned(self, key: str) -> Versioned | None:
        """The small object ``key`` with its tag; None if there is none."""

    @abc.abstractmethod
    def compare_and_swap(self, key: str, data: bytes, expected: str | None) -> str | None:
        """Write ``data`` as ``key`` only if its tag is still ``expected`` (None: only if
        there is no such object); the new tag, or None if someone else moved it first."""

    def close(self) -> None:  # noqa: B027  (a store with nothing to let go of)
        """Let go of connections (the store may not be used after)."""
