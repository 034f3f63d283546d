"""Reading the archive back: a rank's manifest, and objects fetched with parallel ranged reads
into files that are verified before anything uses them.

An object is read in parts of ``PART_BYTES`` by a pool of threads into a hidden temp file,
checked against the manifest (its size and its XXH3-64), and only then given its name. The
caller then loads it through the same validation path as any spool file
(:func:`deltad.segment.validate.load_verified`: header, checksum, structure), so a corrupted or
truncated object is refused like a corrupt segment.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from deltad.segment.spool import GenerationManifest
from deltad.serve.archive.layout import ArchivedObject, ArchiveManifest, manifest_key
from deltad.serve.archive.store import ArchiveError, ObjectStore

__all__ = ["PART_BYTES", "fetch_objects", "read_generation", "read_manifest"]

#: bytes of one ranged read
PART_BYTES = 8 << 20
#: ranged reads in flight at once
PARALLEL_READS = 8
#: objects fetched at once (each by parts from the shared pool of reads)
OBJECTS_AT_ONCE = 4


def read_manifest(store: ObjectStore, model: str, rank: int) -> ArchiveManifest | None:
    """The archive manifest of ``rank`` (None: nothing archived for it); ArchiveError if it is
    not a valid one or names another model or rank."""
    got = store.read_versioned(manifest_key(model, rank))
    if got is None:
        return None
    m = ArchiveManifest.from_json(got.data)
    if m.model != model or m.rank != rank:
        raise ArchiveError(
            f"{store.url}: manifest of rank {rank} names model {m.model!r} rank {m.rank}"
        )
    return m


def read_generation(store: ObjectStore, m: ArchiveManifest) -> GenerationManifest:
    """The generation manifest ``m`` names, checked against it."""
    try:
        raw = store.get(m.generation_key)
    except FileNotFoundError:
        raise ArchiveError(f"{store.url}: {m.generation_key} is missing") from None
    try:
        gm = GenerationManifest.from_json(raw.decode())
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ArchiveError(f"{store.url}: {m.generation_key} is not a manifest: {e}") from None
    if (gm.model, gm.generation, gm.world_size) != (m.model, m.generation, m.world_size):
        raise ArchiveError(f"{store.url}: {m.generation_key} disagrees with the rank's manifest")
    return gm


def _fetch_one(
    store: ObjectStore, obj: ArchivedObject, dest: Path, pool: ThreadPoolExecutor
) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-fetch-", dir=dest.parent)
    try:
        os.ftruncate(fd, obj.size)
        starts = list(range(0, obj.size, PART_BYTES)) or [0]

        def part(start: int) -> int:
            n = min(PART_BYTES, obj.size - start)
            try:
                data = store.get(obj.key, start, n)
            except FileNotFoundError:
                raise ArchiveError(f"{store.url}: {obj.key} is missing") from None
            if len(data) != n:
                raise ArchiveError(
                    f"{store.url}: {obj.key} is truncated (bytes {start}..: got {len(data)} of {n})"
                )
            os.pwrite(fd, data, start)
            return n

        for _ in pool.map(part, starts):
            pass
        if store.get(obj.key, obj.size, 1):  # longer than the manifest says
            raise ArchiveError(f"{store.url}: {obj.key} is longer than its {obj.size} bytes")
        h = xxhash.xxh3_64()
        with open(fd, "rb", closefd=False) as f:
            f.seek(0)
            while chunk := f.read(1 << 20):
                h.update(chunk)
        if h.intdigest() != obj.xxh3:
            raise ArchiveError(f"{store.url}: {obj.key} fails its checksum (corrupted)")
        os.fsync(fd)
        os.replace(tmp, dest)
        tmp = ""
    finally:
        os.close(fd)
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def fetch_objects(
    store: ObjectStore,
    objects: Sequence[tuple[ArchivedObject, Path]],
    *,
    parallel: int = PARALLEL_READS,
) -> None:
    """Fetch each (object, destination) with parallel ranged reads, verified (size and
    checksum) before it is renamed to its destination; ArchiveError for the first that fails
    (nothing is left under its name)."""
    with (
        ThreadPoolExecutor(max(1, parallel), thread_name_prefix="deltad-fetch") as parts,
        ThreadPoolExecutor(OBJECTS_AT_ONCE, thread_name_prefix="deltad-fetch-obj") as objs,
    ):
        for _ in objs.map(lambda x: _fetch_one(store, x[0], x[1], parts), objects):
            pass
