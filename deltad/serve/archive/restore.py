"""Restore: a sidecar started with ``--archive`` on an empty spool (a new node) fills its rank's
log from the store before it serves.

The rank's archived manifest names a generation, its base and contiguous deltas and the dense
states. Each is fetched (parallel ranged reads, size and checksum checked:
:mod:`deltad.serve.archive.fetch`), verified through the spool's own validation path
(:func:`deltad.segment.validate.load_verified`), and linked into the spool under its seq's
name, never over a file that is there (a trainer that publishes meanwhile keeps its files).
The seqs, steps and generation are those the previous sidecar served, so consumers' cursors
stay valid: a consumer whose cursor is inside the restored log gets the rows after it, not a
resync. An object that fails verification ends the restore there: the verified prefix is kept
(a log whose gap the publisher fills with a fresh base), nothing after it is used.

The spool is "empty" for the rank when the archived generation has no segment of the rank at or
before the archive's head and no newer generation is in the spool (the trainer restarted:
its new log is the one to serve).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from deltad.errors import DeltadError, SegmentCorruptError
from deltad.segment.spool import SpoolLayout, fsync_dir
from deltad.segment.validate import load_verified, load_verified_dense
from deltad.serve.archive.fetch import fetch_objects, read_generation, read_manifest
from deltad.serve.archive.layout import ArchivedObject
from deltad.serve.archive.store import ArchiveError, ObjectStore

__all__ = ["RestoreResult", "clear_staging", "place_verified", "restore_rank", "verify_fetched"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreResult:
    """What a restore did: the generation, the seqs restored, and why it stopped early."""

    generation: int
    base_seq: int
    head_seq: int
    segments: int
    dense: int
    nbytes: int
    #: why the restore stopped before the archive's head ("" if it did not)
    stopped: str = ""


def _needs_restore(layout: SpoolLayout, rank: int, generation: int, head_seq: int) -> str:
    """Why the spool need not be restored ("" if it must)."""
    newest = layout.latest_generation()
    if newest is not None and newest > generation:
        return f"the spool holds a newer generation ({newest}) than the archive ({generation})"
    if any(seq <= head_seq for seq, _ in layout.segments(generation, rank)):
        return "the spool holds the rank's log"
    return ""


def restore_rank(store: ObjectStore, layout: SpoolLayout, rank: int) -> RestoreResult | None:
    """Restore ``rank``'s log into ``layout`` from ``store`` if the spool has none of it;
    None if nothing was restored (nothing archived, or the spool has the log). Raises
    ArchiveError if the store cannot be read (the caller decides whether to serve without)."""
    model = layout.model
    m = read_manifest(store, model, rank)
    if m is None:
        log.info("archive %s: nothing archived for %s rank %d", store.url, model, rank)
        return None
    why = _needs_restore(layout, rank, m.generation, m.head.seq)
    if why:
        log.info("archive %s: no restore for rank %d: %s", store.url, rank, why)
        return None
    gm = read_generation(store, m)
    if not layout.manifest_path(m.generation).exists():
        layout.write_manifest(gm)
    rank_dir = layout.rank_dir(m.generation, rank)
    rank_dir.mkdir(parents=True, exist_ok=True)
    staging = rank_dir / ".restore"
    staging.mkdir(exist_ok=True)
    try:
        wanted = [(o, staging / f"{i:06d}.dseg") for i, o in enumerate(m.entries)]
        dense = [(o, staging / f"d{i:06d}.dseg") for i, o in enumerate(m.dense)]
        stopped = ""
        ok: list[tuple[ArchivedObject, Path]] = []
        try:
            fetch_objects(store, [*wanted, *dense])
        except ArchiveError as e:
            stopped = str(e)
        for obj, path in wanted:
            why = verify_fetched(layout, gm, m.generation, rank, obj, path, dense=False)
            if why:
                stopped = stopped or why
                break
            ok.append((obj, path))
        if not ok:
            raise ArchiveError(
                f"archive {store.url}: rank {rank}'s base cannot be restored: {stopped}"
            )
        head = ok[-1][0].seq
        good_dense = [
            (o, p) for o, p in dense
            if o.seq <= head and not verify_fetched(layout, gm, m.generation, rank, o, p, dense=True)
        ]  # fmt: skip
        nbytes = 0
        for obj, path in good_dense:
            nbytes += place_verified(path, layout.dense_path(m.generation, rank, obj.seq))
        for obj, path in ok:
            nbytes += place_verified(path, layout.segment_path(m.generation, rank, obj.seq))
        fsync_dir(rank_dir)
    finally:
        clear_staging(staging)
    if stopped:
        log.error(
            "archive %s: rank %d restored only up to seq %d: %s", store.url, rank, head, stopped
        )
    result = RestoreResult(
        m.generation, ok[0][0].seq, head, len(ok), len(good_dense), nbytes, stopped
    )
    log.warning(
        "archive %s: restored rank %d generation %d seq %d..%d (%d segments, %d dense states, "
        "%d bytes)", store.url, rank, m.generation, result.base_seq, head, len(ok),
        len(good_dense), nbytes,
    )  # fmt: skip
    return result


def verify_fetched(
    layout: SpoolLayout,
    gm: object,
    generation: int,
    rank: int,
    obj: ArchivedObject,
    path: Path,
    *,
    dense: bool,
) -> str:
    """Why the fetched ``path`` may not be used ("" if it may): missing, or it fails the
    spool's validation (header, checksum, structure; a segment's seqs as the manifest says)."""
    from deltad.segment.spool import GenerationManifest

    assert isinstance(gm, GenerationManifest)
    if not path.exists():
        return f"{obj.key} was not fetched"
    try:
        if dense:
            load_verified_dense(
                path, layout.model_dir, gm, generation=generation, rank=rank, seq=obj.seq
            )
            return ""
        seg = load_verified(
            path, layout.model_dir, gm, generation=generation, rank=rank, seq=obj.seq
        )
    except (SegmentCorruptError, DeltadError) as e:
        return f"{obj.key}: {e}"
    h = seg.header
    if (h.first_seq, h.step) != (obj.first_seq, obj.step):
        return (
            f"{obj.key}: holds seq {h.first_seq}..{h.seq} step {h.step}, not what the manifest says"
        )
    return ""


def clear_staging(staging: Path) -> None:
    """Delete a fetch's staging directory and what is left in it (placed files are links)."""
    for p in staging.iterdir() if staging.exists() else ():
        p.unlink(missing_ok=True)
    try:
        staging.rmdir()
    except OSError:
        pass


def place_verified(src: Path, dest: Path) -> int:
    """Link the verified ``src`` to ``dest`` unless a file is there; its size (0: kept the
    file that was there)."""
    size = src.stat().st_size
    try:
        os.link(src, dest)
    except FileExistsError:
        return 0
    return size
