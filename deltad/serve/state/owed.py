"""Owed rows of top-k (or row-capped) consumers, one file per consumer, rank and pull.

``<sidecar_dir>/owed/<consumer>/r<rank>-<token>.dseg`` is a segment file (same format and
checksum as the log) whose shards hold the owed ids and the values the consumer holds for
them. A pull writes its file under the pull id as token; Commit makes that token current in
the Redis cursor (``owed_token``), and files of other tokens are garbage.

Bounded: ``max_bytes`` over every consumer's files of this rank, ``max_consumer_bytes`` per
consumer (0: no bound). A pull whose owed rows would pass either is refused
(:class:`~deltad.errors.OwedBudgetError`) before anything is written: a credential that may
name many consumers cannot fill the trainer's disk. ``nbytes``, ``files`` and ``refused``
feed the metrics.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

from deltad.errors import OwedBudgetError, SegmentCorruptError, SpoolError
from deltad.segment.format import ShardRows, read_segment, write_segment
from deltad.types import SegmentKind, ShardKey

log = logging.getLogger(__name__)


class OwedStore:
    """Reads and writes owed-row files under ``root`` (SpoolLayout.sidecar_dir)."""

    def __init__(
        self,
        root: Path,
        model: str,
        rank: int,
        world_size: int = 1,
        *,
        max_bytes: int = 0,
        max_consumer_bytes: int = 0,
    ) -> None:
        self.root = Path(root) / "owed"
        self.model = model
        self.rank = rank
        self.world_size = world_size
        self.max_bytes = max_bytes
        self.max_consumer_bytes = max_consumer_bytes
        #: pulls refused for the budget
        self.refused = 0
        self._lock = threading.Lock()
        #: consumer -> {file: bytes} of this rank's files, and their total
        self._sizes: dict[str, dict[Path, int]] = {}
        self._total = 0
        self._scan()

    def path(self, consumer: str, token: str) -> Path:
        return self.root / consumer / f"r{self.rank}-{token}.dseg"

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's owed files."""
        return self._total

    @property
    def files(self) -> int:
        """This rank's owed files."""
        with self._lock:
            return sum(len(f) for f in self._sizes.values())

    def _scan(self) -> None:
        """Count the files already on disk (a restart keeps its owed rows and their cost)."""
        prefix = f"r{self.rank}-"
        try:
            dirs = [d for d in self.root.iterdir() if d.is_dir()]
        except FileNotFoundError:
            return
        for d in dirs:
            try:
                for p in d.iterdir():
                    if p.name.startswith(prefix):
                        self._add(d.name, p, p.stat().st_size)
            except OSError:
                continue

    def _add(self, consumer: str, p: Path, size: int) -> None:
        mine = self._sizes.setdefault(consumer, {})
        self._total += size - mine.get(p, 0)
        mine[p] = size

    def _gone(self, consumer: str, p: Path) -> None:
        with self._lock:
            mine = self._sizes.get(consumer)
            if mine is not None and p in mine:
                self._total -= mine.pop(p)
                if not mine:
                    del self._sizes[consumer]

    def _reserve(self, consumer: str, need: int) -> None:
        """OwedBudgetError unless ``need`` more bytes of ``consumer`` fit both budgets."""
        with self._lock:
            mine = sum(self._sizes.get(consumer, {}).values())
            over = ""
            if self.max_consumer_bytes and mine + need > self.max_consumer_bytes:
                over = f"its budget of {self.max_consumer_bytes} bytes"
            elif self.max_bytes and self._total + need > self.max_bytes:
                over = f"the sidecar's budget of {self.max_bytes} bytes for all consumers"
            if over:
                self.refused += 1
        if over:
            raise OwedBudgetError(
                f"the rows owed to {consumer!r} ({need} bytes) would exceed {over}: pull the "
                "rows form or a larger k, or forget idle consumers"
            )

    def save(
        self, consumer: str, token: str, generation: int, seq: int, rows: dict[ShardKey, ShardRows]
    ) -> None:
        """Write the owed rows of ``token``; OwedBudgetError (nothing written) if they do not
        fit the budgets."""
        need = 4096 + sum(
            r.ids.numel() * r.ids.element_size() + r.values.numel() * r.values.element_size()
            for r in rows.values()
        )
        self._reserve(consumer, need)
        p = self.path(consumer, token)
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
        try:
            size = p.stat().st_size
        except OSError:
            return
        with self._lock:
            self._add(consumer, p, size)

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
                self._gone(consumer, p)

    def drop(self, consumer: str) -> int:
        """Delete this rank's owed files of ``consumer`` (forgotten); returns how many."""
        d = self.root / consumer
        try:
            files = [p for p in d.iterdir() if p.name.startswith(f"r{self.rank}-")]
        except (FileNotFoundError, NotADirectoryError):
            return 0
        n = _delete(d, files)
        for p in files:
            if not p.exists():
                self._gone(consumer, p)
        return n

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
            for p in files:
                if not p.exists():
                    self._gone(d.name, p)
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
