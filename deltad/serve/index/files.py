"""Reading one rank's spool files: verified entries, quarantine, requests for a fresh base.

:meth:`RankFiles.scan` lists the rank's directory and loads each new file once through
:func:`deltad.segment.validate.load_verified` (a private copy whose checksum and structure are
verified: what is served and merged later is that copy). Bad files, and files named almost
like a segment, are moved to the quarantine directory, counted and logged, never served. It drops
files made redundant by a merged file (``first_seq..seq`` covers them: a merge that crashed
before deleting its inputs).

A quarantined segment makes it ask the publisher beside it for a fresh base of its rank (the
file ``rebase.request`` in the rank's directory, see SpoolLayout; the segment log asks too when
a gap stays open, :mod:`deltad.serve.index.log`); the publisher writes one at its next publish
(first_seq 0, covering every earlier seq).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deltad.errors import SegmentCorruptError, SpoolError
from deltad.segment.format import DenseState, Segment, ShardRows
from deltad.segment.spool import SEGMENT_RE, GenerationManifest, SpoolLayout, write_atomic
from deltad.segment.validate import load_verified, load_verified_dense
from deltad.types import SegmentKind, ShardKey

log = logging.getLogger(__name__)

#: A fresh base is asked for again this long after the last request if the gap stays.
REQUEST_EVERY_S = 10.0


@dataclass(frozen=True)
class LogEntry:
    """One verified segment file (possibly a merge of ``first_seq..seq``)."""

    first_seq: int
    seq: int
    step: int
    kind: SegmentKind
    path: Path
    nbytes: int
    created_unix: float
    segment: Segment = field(repr=False, compare=False)
    shards: dict[ShardKey, ShardRows] = field(repr=False, compare=False)

    @classmethod
    def load(cls, path: Path, seg: Segment) -> LogEntry:
        """The entry of ``seg``, loaded (and verified) from ``path``."""
        h = seg.header
        return cls(
            first_seq=h.first_seq,
            seq=h.seq,
            step=h.step,
            kind=h.kind,
            path=path,
            nbytes=sum(c.ids.nbytes + c.values.nbytes for c in seg.shards),
            created_unix=h.created_unix,
            segment=seg,
            shards={c.key: c for c in seg.shards},
        )

    @property
    def first_created_unix(self) -> float:
        """When the trainer published ``first_seq`` (``created_unix``: when it published
        ``seq``); the two differ for a merge."""
        return self.segment.header.first_created


@dataclass(frozen=True)
class DenseEntry:
    """One verified dense state file (rank 0): dense parameters and buffers at segment seq."""

    seq: int
    step: int
    path: Path
    nbytes: int
    state: DenseState = field(repr=False, compare=False)

    @classmethod
    def load(cls, path: Path, state: DenseState) -> DenseEntry:
        nbytes = sum(t.nbytes for t in state.tensors.values())
        return cls(state.header.seq, state.header.step, path, nbytes, state)


class RankFiles:
    """Reads one rank's segment and dense state files of the spool into verified entries;
    quarantines the bad ones and asks the publisher for fresh bases. Not thread-safe: the
    segment log calls it under its lock."""

    def __init__(
        self,
        layout: SpoolLayout,
        rank: int,
        *,
        on_quarantine: Callable[[Path, str], None] | None = None,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.on_quarantine = on_quarantine
        #: Segments of this rank in the quarantine directory (kept there across restarts).
        self.quarantined = self._count_quarantined()
        self._unreadable: dict[Path, str] = {}  # path -> the error last logged for it
        self._manifests: dict[int, GenerationManifest] = {}
        self._requested: dict[int, float] = {}  # generation -> monotonic time of the request
        #: Fresh bases asked of the publisher (rebase.request files written).
        self.rebase_requests = 0

    def manifest(self, generation: int) -> GenerationManifest:
        """The manifest of ``generation`` (read once); SpoolError if unreadable."""
        m = self._manifests.get(generation)
        if m is None:
            m = self._manifests[generation] = self.layout.read_manifest(generation)
        return m

    def load_entry(self, generation: int, seq: int, path: Path) -> LogEntry:
        """Load and verify one file of this rank (SegmentCorruptError / SpoolError)."""
        seg = load_verified(
            path,
            self.layout.model_dir,
            self.manifest(generation),
            generation=generation,
            rank=self.rank,
            seq=seq,
        )
        return LogEntry.load(path, seg)

    def _listing(self, generation: int) -> tuple[list[tuple[int, Path]], list[Path]]:
        """(seq, path) of the segment files, by seq, and the strays: names that start like a
        segment but are not exactly one (other digits, a trailing newline, ...)."""
        d = self.layout.rank_dir(generation, self.rank)
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return [], []
        except OSError as e:
            raise SpoolError(f"cannot list {d}: {e}") from e
        present, strays = [], []
        for n in names:
            m = SEGMENT_RE.fullmatch(n)
            if m is not None:
                present.append((int(m.group(1)), d / n))
            elif n.startswith("seg-"):
                strays.append(d / n)
        present.sort()
        return present, strays

    def drop_generation(self, generation: int) -> None:
        """Delete ``generation``'s files of this rank and its directory (never through a
        symbolic link)."""
        d = self.layout.rank_dir(generation, self.rank)
        if d.is_symlink() or d.parent.is_symlink():
            log.warning("not deleting through %s: a symbolic link", d)
            return
        for _, path in self.layout.segments(generation, self.rank):
            path.unlink(missing_ok=True)
        for _, path in self.layout.dense_files(generation, self.rank):
            path.unlink(missing_ok=True)
        self.layout.rebase_request_path(generation, self.rank).unlink(missing_ok=True)
        try:
            self.layout.rank_dir(generation, self.rank).rmdir()
        except OSError:
            pass

    def scan(self, generation: int, known: dict[Path, LogEntry]) -> None:
        """Update ``known`` to the segment files of ``generation`` on disk: drop the gone,
        load the new (quarantining bad ones), delete those a merged file covers."""
        present, strays = self._listing(generation)
        for p in strays:
            self._quarantine(generation, p, "not an exact segment file name", request=False)
        names = {p for _, p in present}
        for p in [p for p in known if p not in names]:
            del known[p]
        for seq, path in present:
            if path in known:
                continue
            try:
                entry = self.load_entry(generation, seq, path)
            except FileNotFoundError:
                continue
            except SegmentCorruptError as e:
                self._quarantine(generation, path, str(e))
                continue
            except SpoolError as e:
                if not path.exists():
                    continue
                if self._unreadable.get(path) != str(e):  # once, not at every poll
                    log.warning("cannot index %s (holding the log back until it can): %s", path, e)
                    self._unreadable[path] = str(e)
                continue
            self._unreadable.pop(path, None)
            known[path] = entry
        # a file whose range another file covers is the leftover of a merge: delete it
        for old in list(known.values()):
            if any(
                o is not old and o.first_seq <= old.first_seq and old.seq <= o.seq
                for o in known.values()
            ):
                log.info("deleting %s: covered by a merged segment", old.path)
                old.path.unlink(missing_ok=True)
                del known[old.path]

    def scan_dense(self, generation: int, dense: dict[Path, DenseEntry]) -> None:
        """Update ``dense`` to the dense state files of ``generation`` on disk (bad ones are
        quarantined like segments)."""
        present = self.layout.dense_files(generation, self.rank)
        names = {p for _, p in present}
        for p in [p for p in dense if p not in names]:
            del dense[p]
        for seq, path in present:
            if path in dense:
                continue
            try:
                state = load_verified_dense(
                    path,
                    self.layout.model_dir,
                    self.manifest(generation),
                    generation=generation,
                    rank=self.rank,
                    seq=seq,
                )
                entry = DenseEntry.load(path, state)
            except FileNotFoundError:
                continue
            except SegmentCorruptError as e:
                self._quarantine(generation, path, str(e))
                continue
            except SpoolError as e:
                log.warning("cannot index dense state %s: %s", path, e)
                continue
            dense[path] = entry

    def _count_quarantined(self) -> int:
        try:
            return sum(
                f"-rank-{self.rank:05d}-" in p.name for p in self.layout.quarantine_dir.iterdir()
            )
        except OSError:
            return 0

    def _quarantine(
        self, generation: int, path: Path, reason: str, *, request: bool = True
    ) -> None:
        qdir = self.layout.quarantine_dir
        name = path.name.encode("ascii", "backslashreplace").decode()[:80].replace("\n", "_")
        dest = qdir / f"gen-{generation}-rank-{self.rank:05d}-{name}.{time.time_ns()}"
        try:
            qdir.mkdir(parents=True, exist_ok=True)
            os.replace(path, dest)
        except OSError as e:
            log.error("cannot quarantine %s (%s): %s", path, reason, e)
            return
        log.error("quarantined segment %s -> %s: %s", path, dest, reason)
        if request:
            self.request_base(generation, f"quarantined {path.name}: {reason}")
        # counted last: whoever sees a count (this, the metric) sees the request too
        if self.on_quarantine is not None:
            self.on_quarantine(dest, reason)
        self.quarantined += 1

    def request_base(self, generation: int, reason: str, *, force: bool = False) -> bool:
        """Ask the publisher of this rank for a fresh base of ``generation`` (at most every
        ``REQUEST_EVERY_S`` unless ``force``); True if a request was written."""
        last = self._requested.get(generation)
        now = time.monotonic()
        if not force and last is not None and now - last < REQUEST_EVERY_S:
            return False
        path = self.layout.rebase_request_path(generation, self.rank)
        try:
            write_atomic(path, json.dumps({"reason": reason[:500], "unix": time.time()}).encode())
        except OSError as e:
            log.error("cannot ask for a fresh base of rank %d (%s): %s", self.rank, reason, e)
            return False
        self._requested[generation] = now
        self.rebase_requests += 1
        log.warning("rank %d: asked the publisher for a fresh base: %s", self.rank, reason)
        return True
