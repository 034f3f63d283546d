"""Owed rows of top-k (or row-capped) consumers, one file per consumer, rank and pull.

``<sidecar_dir>/owed/<consumer>/r<rank>-<token>.dseg`` is a segment file (same format and
checksum as the log) whose shards hold the owed ids and the values the consumer holds for
them. A pull writes its file under the pull id as token; Commit makes that token current in
the Redis cursor (``owed_token``), and files of other tokens are garbage.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

from deltad.errors import SegmentCorruptError, SpoolError
from deltad.segment.format import ShardRows, read_segment, write_segment
from deltad.types import SegmentKind, ShardKey

log = logging.getLogger(__name__)


class OwedStore:
    """Reads and writes owed-row files under ``root`` (SpoolLayout.sidecar_dir)."""

    def __init__(self, root: Path, model: str, rank: int, world_size: int = 1) -> None:
        self.root = Path(root) / "owed"
        self.model = model
        self.rank = rank
        self.world_size = world_size

    def path(self, consumer: str, token: str) -> Path:
        return self.root / consumer / f"r{self.rank}-{token}.dseg"

    def save(
        self, consumer: str, token: str, generation: int, seq: int, rows: dict[ShardKey, ShardRows]
    ) -> None:
        write_segment(
            self.path(consumer, token),
            model=self.model,
            generation=generation,
            rank=self.rank,
            world_size=self.world_size,
            seq=seq,
            step=0,
            kind=SegmentKind.DELTA,
            shards=list(rows.values()),
        )

    def load(self, consumer: str, token: str, generation: int) -> dict[ShardKey, ShardRows]:
        """The owed rows of ``token``; SpoolError if the file is missing or corrupt (a consumer
        must never silently lose owed rows)."""
        p = self.path(consumer, token)
        try:
            seg = read_segment(p, verify=True)
        except SegmentCorruptError as e:
            raise SpoolError(f"owed rows of {consumer!r} are corrupt: {e}") from e
        if seg.header.generation != generation:
            return {}
        return {c.key: c.with_rows(c.ids, c.values) for c in seg.shards}

    def gc(self, consumer: str, keep: set[str]) -> None:
        """Delete this rank's owed files of ``consumer`` except the tokens in ``keep``.

        A pull writes its file just before Redis records its token, so a concurrent gc can
        take it for garbage; the consumer's next pull then finds its owed rows missing and
        resyncs from the base (see ``DeltaServicer.GetDelta``): nothing is lost."""
        d = self.root / consumer
        prefix = f"r{self.rank}-"
        try:
            names = [p for p in d.iterdir() if p.name.startswith(prefix)]
        except FileNotFoundError:
            return
        for p in names:
            token = p.name[len(prefix) :].removesuffix(".dseg")
            if token not in keep:
                p.unlink(missing_ok=True)

    def drop(self, consumer: str) -> int:
        """Delete this rank's owed files of ``consumer`` (forgotten); returns how many."""
        d = self.root / consumer
        try:
            files = [p for p in d.iterdir() if p.name.startswith(f"r{self.rank}-")]
        except (FileNotFoundError, NotADirectoryError):
            return 0
        return _delete(d, files)

    def sweep(self, has_state: Callable[[str], bool], *, min_age_s: float, limit: int = 100) -> int:
        """Delete this rank's owed files of consumers with no state left (``has_state`` is
        False: forgotten, or never committed), if older than ``min_age_s`` (a pull writes its
        file before Redis records it). At most ``limit`` consumers per call, chosen at random;
        returns the number of files deleted."""
        try:
            dirs = [p for p in self.root.iterdir() if p.is_dir()]
        except FileNotFoundError:
            return 0
        # a random ``limit`` of them: with more consumers than that, every one comes up in time
        dirs = random.sample(dirs, min(limit, len(dirs)))
        prefix = f"r{self.rank}-"
        cutoff = time.time() - min_age_s
        deleted = 0
        for d in dirs:
            try:
                files = [p for p in d.iterdir() if p.name.startswith(prefix)]
            except FileNotFoundError:
                continue
            if not files or has_state(d.name):
                continue
            deleted += _delete(d, files, older_than=cutoff)
        return deleted


def _delete(d: Path, files: list[Path], *, older_than: float | None = None) -> int:
    """Unlink ``files`` (those modified before ``older_than`` if given), then ``d`` if that
    left it empty (only once every rank's files are gone); returns how many were deleted."""
    deleted = 0
    for p in files:
        try:
            if older_than is None or p.stat().st_mtime < older_than:
                p.unlink()
                deleted += 1
        except FileNotFoundError:
            pass
    try:
        d.rmdir()
    except OSError:
        pass
    return deleted
