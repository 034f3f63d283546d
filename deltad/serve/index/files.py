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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from deltad.errors import SegmentCorruptError, SpoolError
from deltad.segment.format import DenseState, Segment, ShardRows
from deltad.segment.spool import (
    DENSE_RE,
    SEGMENT_RE,
    GenerationManifest,
    SpoolLayout,
    write_atomic,
)
from deltad.segment.validate import load_verified, load_verified_dense
from deltad.types import SegmentKind, ShardKey

log = logging.getLogger(__name__)

#: A fresh base is asked for again this long after the last request if the gap stays.
REQUEST_EVERY_S = 10.0
#: An unchanged rank directory is listed again at least this often anyway (a filesystem whose
#: directory times are coarse or cached: NFS, some FUSE mounts; a clock stepped back).
FULL_SCAN_EVERY_S = 2.0
#: A directory modified less than this long before it was listed is listed again at the next
#: poll: a file added within the same tick of the directory's clock leaves its time unchanged.
RACY_S = 0.05

_E = TypeVar("_E", "LogEntry", "DenseEntry")


def covered(entries: Iterable[LogEntry]) -> list[LogEntry]:
    """The entries whose range ``first_seq..seq`` another entry's range covers (of entries with
    the same range, all but the first): leftovers of a merge. One sort, not a pass per pair
    (a log of thousands of segments, e.g. under a restore window, is scanned at every poll)."""
    out: list[LogEntry] = []
    reach = -1  # the highest seq of the entries starting at or before this one
    for e in sorted(entries, key=lambda e: (e.first_seq, -e.seq)):
        if e.seq <= reach:
            out.append(e)
        else:
            reach = e.seq
    return out


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
        #: the directory as the last :meth:`scan_all` found it (see :meth:`unchanged`): its
        #: stamp (None: scan again) and when (monotonic); whether a file is to be tried again
        self._stamp: tuple[int, int, int, int] | None = None
        self._stamped_at = 0.0
        self._retry = False

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

    def _listing(
        self, generation: int
    ) -> tuple[list[tuple[int, str]], list[tuple[int, str]], list[str]]:
        """One listing of the rank's directory: (seq, name) of the segment files and of the
        dense state files, by seq, and the strays: names that start like a segment but are not
        exactly one (other digits, a trailing newline, ...)."""
        d = self.layout.rank_dir(generation, self.rank)
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return [], [], []
        except OSError as e:
            raise SpoolError(f"cannot list {d}: {e}") from e
        segments, dense, strays = [], [], []
        for n in names:
            if (m := SEGMENT_RE.fullmatch(n)) is not None:
                segments.append((int(m.group(1)), n))
            elif (m := DENSE_RE.fullmatch(n)) is not None:
                dense.append((int(m.group(1)), n))
            elif n.startswith("seg-"):
                strays.append(n)
        segments.sort()
        dense.sort()
        return segments, dense, strays

    def _dir_stamp(self, generation: int) -> tuple[int, int, int, int] | None:
        """(generation, device, inode, modification time in ns) of the rank's directory; None
        if it cannot be read."""
        try:
            st = os.stat(self.layout.rank_dir(generation, self.rank))
        except OSError:
            return None
        return generation, st.st_dev, st.st_ino, st.st_mtime_ns

    def unchanged(self, generation: int) -> bool:
        """Whether a scan of ``generation`` would find nothing new: the rank's directory has
        its modification time of the last :meth:`scan_all` (whose listing came at least
        :data:`RACY_S` after that time and left no file to retry), which was less than
        :data:`FULL_SCAN_EVERY_S` ago. A directory's modification time changes with every
        file created, renamed in or out, or removed in it; a file is never changed in place."""
        if self._stamp is None or self._stamp[0] != generation:
            return False
        if time.monotonic() - self._stamped_at >= FULL_SCAN_EVERY_S:
            return False
        return self._dir_stamp(generation) == self._stamp

    def rescan(self) -> None:
        """List the rank's directory again at the next poll, whatever its time says."""
        self._stamp = None

    def scan_all(
        self, generation: int, known: dict[Path, LogEntry], dense: dict[Path, DenseEntry]
    ) -> bool:
        """:meth:`scan` and :meth:`scan_dense` from one listing; True if ``known`` or
        ``dense`` changed. Notes the directory's modification time for :meth:`unchanged`."""
        stamp = self._dir_stamp(generation)  # (before listing: a later change is seen)
        listed_unix = time.time()
        self._retry = False
        segments, dense_files, strays = self._listing(generation)
        changed = self.scan(generation, known, (segments, strays))
        changed = self.scan_dense(generation, dense, dense_files) or changed
        # (a time in whole seconds: a filesystem that keeps no finer ones, racy for longer)
        racy = RACY_S if stamp is None or stamp[3] % 1_000_000_000 else FULL_SCAN_EVERY_S
        settled = stamp is not None and listed_unix - stamp[3] / 1e9 >= racy
        self._stamp = stamp if settled and not self._retry else None
        self._stamped_at = time.monotonic()
        return changed

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

    def scan(
        self,
        generation: int,
        known: dict[Path, LogEntry],
        listing: tuple[list[tuple[int, str]], list[str]] | None = None,
    ) -> bool:
        """Update ``known`` to the segment files of ``generation`` on disk (``listing``: its
        segments and strays, if listed already): drop the gone, load the new (quarantining bad
        ones), delete those a merged file covers. True if ``known`` changed."""
        if listing is None:
            segments, _, strays = self._listing(generation)
        else:
            segments, strays = listing
        d = self.layout.rank_dir(generation, self.rank)
        for n in strays:
            self._quarantine(generation, d / n, "not an exact segment file name", request=False)
        added, gone = self._sync(
            generation,
            known,
            segments,
            lambda seq, path: self.load_entry(generation, seq, path),
            "cannot index %s (holding the log back until it can): %s",
        )
        if added:  # a file whose range another file covers is the leftover of a merge
            for old in covered(known.values()):
                log.info("deleting %s: covered by a merged segment", old.path)
                old.path.unlink(missing_ok=True)
                del known[old.path]
        return added or gone

    def scan_dense(
        self,
        generation: int,
        dense: dict[Path, DenseEntry],
        files: list[tuple[int, str]] | None = None,
    ) -> bool:
        """Update ``dense`` to the dense state files of ``generation`` on disk (``files``:
        their (seq, name), if listed already; bad ones are quarantined like segments). True if
        ``dense`` changed."""
        if files is None:
            files = self._listing(generation)[1]

        def load(seq: int, path: Path) -> DenseEntry:
            state = load_verified_dense(
                path,
                self.layout.model_dir,
                self.manifest(generation),
                generation=generation,
                rank=self.rank,
                seq=seq,
            )
            return DenseEntry.load(path, state)

        added, gone = self._sync(generation, dense, files, load, "cannot index dense state %s: %s")
        return added or gone

    def _sync(
        self,
        generation: int,
        held: dict[Path, _E],
        files: list[tuple[int, str]],
        load: Callable[[int, Path], _E],
        unreadable: str,
    ) -> tuple[bool, bool]:
        """Bring ``held`` to ``files`` ((seq, name) in the rank's directory): drop the gone,
        ``load`` the new. A corrupt file is quarantined; an unreadable one is tried again at
        the next scan and logged (``unreadable``, with path and error) once, not at every
        poll. Returns (any added, any gone)."""
        d = self.layout.rank_dir(generation, self.rank)
        names = {n for _, n in files}
        gone = [p for p in held if p.name not in names]
        for p in gone:
            del held[p]
        have = {p.name for p in held}
        added = False
        for seq, n in files:
            if n in have:
                continue
            path = d / n
            try:
                entry = load(seq, path)
            except FileNotFoundError:
                continue
            except SegmentCorruptError as e:
                self._quarantine(generation, path, str(e))
                continue
            except SpoolError as e:
                if not path.exists():
                    continue
                self._retry = True
                if self._unreadable.get(path) != str(e):
                    log.warning(unreadable, path, e)
                    self._unreadable[path] = str(e)
                continue
            self._unreadable.pop(path, None)
            held[path] = entry
            added = True
        return added, bool(gone)

    def quarantine_entry(self, generation: int, path: Path, reason: str) -> None:
        """Quarantine an indexed segment found inconsistent with the log before it (see
        :mod:`deltad.serve.index.identities`): moved, counted, a fresh base asked for."""
        self._quarantine(generation, path, reason)

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
            self._retry = True  # (still there: tried again at the next poll)
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
