"""What the archive holds and where: object keys, the rank's manifest, and the bytes of a
verified log entry.

::

    <model>/gen-<generation:020d>/generation.json                       the generation manifest
    <model>/gen-<generation:020d>/rank-<rank:05d>/
        seg-<first_seq:012d>-<seq:012d>-<xxh3:016x>.dseg                a segment (a base: 0-..)
        dense-<seq:012d>-<xxh3:016x>.dseg                               rank 0's dense states
    <model>/rank-<rank:05d>/manifest.json                               the rank's archive manifest

Segment and dense objects are written once and never changed; their key names the XXH3-64 of
their bytes (content-addressed), so a key can only ever hold one content. The rank's manifest
is the one object that moves (by compare-and-swap): it lists the objects that make the rank's
log as its sidecar last served it (a base and contiguous deltas, and the dense states), every
one of them uploaded before the manifest names it. Objects the manifest no longer names (merged
away, an older generation) stay until retention deletes them.

The bytes of an entry are written from the sidecar's verified in-memory copy
(:mod:`deltad.serve.index.files`), not read again from the spool: what is archived is what was
served.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from deltad.serve.archive.store import ArchiveError
from deltad.serve.index.persist import encode_dense_state, write_dense_entry, write_entry

__all__ = [
    "MANIFEST_FORMAT",
    "ArchiveManifest",
    "ArchivedObject",
    "dense_key",
    "encode_dense_state",
    "file_digest",
    "generation_key",
    "manifest_key",
    "segment_key",
    "write_dense_entry",
    "write_entry",
]

MANIFEST_FORMAT = 1
#: most bytes of a rank's manifest read back (a log of ~100k entries)
MANIFEST_MAX_BYTES = 64 << 20


def generation_key(model: str, generation: int) -> str:
    return f"{model}/gen-{generation:020d}/generation.json"


def _rank_prefix(model: str, generation: int, rank: int) -> str:
    return f"{model}/gen-{generation:020d}/rank-{rank:05d}"


def segment_key(model: str, generation: int, rank: int, first: int, seq: int, digest: int) -> str:
    return f"{_rank_prefix(model, generation, rank)}/seg-{first:012d}-{seq:012d}-{digest:016x}.dseg"


def dense_key(model: str, generation: int, rank: int, seq: int, digest: int) -> str:
    return f"{_rank_prefix(model, generation, rank)}/dense-{seq:012d}-{digest:016x}.dseg"


def manifest_key(model: str, rank: int) -> str:
    return f"{model}/rank-{rank:05d}/manifest.json"


@dataclass(frozen=True)
class ArchivedObject:
    """One segment or dense state in the archive: its place in the log, key, size, digest."""

    key: str
    seq: int
    step: int
    size: int
    xxh3: int
    #: a segment's first seq (0: a base); None for a dense state
    first_seq: int | None = None
    #: when the trainer published ``seq`` (a segment's ``created_unix``)
    created_unix: float = 0.0


@dataclass(frozen=True)
class ArchiveManifest:
    """A rank's log as archived: the generation, its manifest's key, the entries (a base then
    contiguous deltas) and the dense states, oldest first."""

    model: str
    rank: int
    generation: int
    world_size: int
    generation_key: str
    entries: tuple[ArchivedObject, ...]
    dense: tuple[ArchivedObject, ...] = ()
    updated_unix: float = 0.0
    format: int = MANIFEST_FORMAT
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def head(self) -> ArchivedObject:
        return self.entries[-1]

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ArchiveManifest:
        """The manifest in ``raw``; ArchiveError if it is not one (checked: types, a base
        first, contiguous seqs, keys under the rank's generation)."""
        if len(raw) > MANIFEST_MAX_BYTES:
            raise ArchiveError(f"archive manifest of {len(raw)} bytes: too big")
        try:
            d = json.loads(raw)
            if d.get("format") != MANIFEST_FORMAT:
                raise ArchiveError(f"archive manifest format {d.get('format')!r} is not 1")
            d["entries"] = tuple(ArchivedObject(**e) for e in d["entries"])
            d["dense"] = tuple(ArchivedObject(**e) for e in d["dense"])
            m = cls(**d)
        except ArchiveError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ArchiveError(f"bad archive manifest: {e}") from None
        m.check()
        return m

    def check(self) -> None:
        """ArchiveError unless the entries form a log and every key is where it belongs."""
        for name in ("rank", "generation", "world_size"):
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise ArchiveError(f"archive manifest: {name} {v!r:.40} is not a count")
        if not self.entries:
            raise ArchiveError("archive manifest lists no entry")
        prefix = _rank_prefix(self.model, self.generation, self.rank) + "/"
        prev = -1
        for e in (*self.entries, *self.dense):
            for name in ("seq", "step", "size", "xxh3"):
                if type(getattr(e, name)) is not int:
                    raise ArchiveError(f"archive manifest: {name} of {e.key!r:.80} is not an int")
            if (
                not isinstance(e.key, str)
                or not e.key.startswith(prefix)
                or "/" in e.key[len(prefix) :]
            ):
                raise ArchiveError(f"archive manifest: key {e.key!r:.80} is not under {prefix}")
        for i, e in enumerate(self.entries):
            first = e.first_seq
            if type(first) is not int or (i == 0) != (first == 0) or (i and first != prev + 1):
                raise ArchiveError(
                    f"archive manifest: entry {i} ({first}..{e.seq}) does not continue the log"
                )
            if e.seq < first:
                raise ArchiveError(f"archive manifest: entry {i} ends before it starts")
            prev = e.seq
        if self.generation_key != generation_key(self.model, self.generation):
            raise ArchiveError("archive manifest: generation manifest key is not its own")

    def upto_step(self, step: int) -> tuple[ArchivedObject, ...]:
        """The entries whose state is the newest at or before ``step`` (at least the base)."""
        out = [self.entries[0]]
        for e in self.entries[1:]:
            if e.step > step:
                break
            out.append(e)
        return tuple(out)

    def dense_at(self, seq: int) -> ArchivedObject | None:
        """The newest dense state taken at or before segment ``seq``."""
        best = None
        for d in self.dense:
            if d.seq > seq:
                break
            best = d
        return best


def file_digest(path: Path) -> tuple[int, int]:
    """(size, XXH3-64) of the file ``path``."""
    h = xxhash.xxh3_64()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.intdigest()


def scratch_file(directory: Path, suffix: str) -> Path:
    """A fresh name for a scratch file in ``directory`` (created if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".archive-", suffix=suffix, dir=directory)
    os.close(fd)
    return Path(name)
