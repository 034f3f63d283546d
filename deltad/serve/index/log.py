"""The segment log of one rank: the served index over its spool directory, as snapshots.

:meth:`SegmentLog.refresh` reads the rank's new files into verified entries
(:class:`~deltad.serve.index.files.RankFiles`: bad files are quarantined, never served) and
switches to a newer generation once that generation's base for this rank is present. Served
entries form a contiguous run from the base: a file after a gap (a segment still being written,
or one that was quarantined) is held back until the gap is filled or a new generation arrives,
so a window never silently misses a segment.

A quarantined segment, or a gap that stays open for ``GAP_GRACE_S`` (a segment missing),
makes the log ask the publisher beside it for a fresh base of its rank; the publisher writes
one at its next publish (first_seq 0, covering every earlier seq), the log serves from it and
drops what it covers. Predictors stall for at most: ``GAP_GRACE_S`` (a missing segment only) + the
trainer's publish interval + one base write + one poll.

Readers take an immutable :class:`LogSnapshot`; retention swaps entries with :meth:`replace`.

The served log is held in memory (verified private copies); the spool's files are how it
outlives a restart. A served file the spool loses under a running sidecar (a deleted or
remounted spool) is written back from its copy at the next poll, with the generation's manifest:
the log never moves back, and the trainer's next segments continue it.

At a switch the previous generation's snapshot stays in memory (its files leave the spool as
before) for ``keep_previous_s`` seconds if its rows take at most ``keep_previous_bytes``:
:meth:`SegmentLog.previous` hands it to generation diffs (deltad.serve.windows.gendiff). A restarted
sidecar holds no previous generation (its consumers at one resync, and are told why).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from deltad.segment.spool import GenerationManifest, SpoolLayout
from deltad.serve.index.files import REQUEST_EVERY_S, DenseEntry, LogEntry, RankFiles
from deltad.serve.index.gate import SegmentGate
from deltad.serve.index.identities import IdentityLedger

__all__ = [
    "GAP_GRACE_S",
    "REQUEST_EVERY_S",
    "DenseEntry",
    "LogEntry",
    "LogSnapshot",
    "SegmentLog",
]

log = logging.getLogger(__name__)

#: A gap with later segments behind it for this long is a missing segment (a segment being
#: written fills its gap in well under this).
GAP_GRACE_S = 2.0


@dataclass(frozen=True)
class LogSnapshot:
    """The served log at one instant: a base entry followed by contiguous deltas, and the
    dense states (rank 0 of a trainer that publishes them), oldest first."""

    generation: int
    manifest: GenerationManifest
    entries: tuple[LogEntry, ...]
    dense: tuple[DenseEntry, ...] = ()

    def dense_at(self, seq: int) -> DenseEntry | None:
        """The newest dense state taken at or before segment ``seq`` (None: none)."""
        best = None
        for d in self.dense:
            if d.seq > seq:
                break
            best = d
        return best

    @property
    def base(self) -> LogEntry:
        return self.entries[0]

    @property
    def head(self) -> LogEntry:
        return self.entries[-1]

    def last_at_or_before_step(self, max_step: int | None) -> LogEntry:
        """The newest entry with step <= max_step (at least the base)."""
        if max_step is None:
            return self.head
        best = self.base
        for e in self.entries[1:]:
            if e.step > max_step:
                break
            best = e
        return best

    def after(self, seq: int, to_seq: int) -> list[LogEntry]:
        """Entries holding segments in (seq, to_seq]; an entry straddling ``seq`` is included
        whole (a superset of latest values is still exact for ids and rows)."""
        return [e for e in self.entries if e.seq > seq and e.seq <= to_seq]

    def upto(self, seq: int) -> list[LogEntry]:
        """Entries with seq <= ``seq``, oldest first (the state at ``seq``)."""
        return [e for e in self.entries if e.seq <= seq]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


class SegmentLog:
    """Index of one rank's segments in the spool; thread-safe."""

    def __init__(
        self,
        layout: SpoolLayout,
        rank: int,
        *,
        on_quarantine: Callable[[Path, str], None] | None = None,
        on_rewrite: Callable[[int], None] | None = None,
        keep_previous_s: float = 0.0,
        keep_previous_bytes: int = 0,
        gate: SegmentGate | None = None,
    ) -> None:
        self.layout = layout
        #: Checks every entry and dense state before it is published (None: no gate).
        self.gate = gate
        self.rank = rank
        #: The rank's files on disk, read into verified entries (quarantine, rebase requests).
        self.files = RankFiles(layout, rank, on_quarantine=on_quarantine)
        #: Managed-collision identities along the served run (a segment inconsistent with
        #: the log before it is quarantined before it is served).
        self.identities = IdentityLedger()
        #: Called with the number of served files written back after the spool lost them.
        self.on_rewrite = on_rewrite
        #: Served files written back after the spool lost them (see :meth:`refresh`).
        self.rewritten = 0
        self._lock = threading.Lock()
        self._snapshot: LogSnapshot | None = None
        #: Notified whenever a new snapshot is published (long-polling Status waits on it).
        self._changed = threading.Condition()
        self._known: dict[Path, LogEntry] = {}
        self._dense: dict[Path, DenseEntry] = {}
        self._generation: int | None = None
        self._gap_since: float | None = None
        self.keep_previous_s = keep_previous_s
        self.keep_previous_bytes = keep_previous_bytes
        #: The previous generation's log after a switch (see :meth:`previous`) and the
        #: monotonic time it is dropped at; why it is not held ("" while it is).
        self._previous: LogSnapshot | None = None
        self._previous_until = 0.0
        self.previous_missing = "no generation switch since this sidecar started"

    @property
    def quarantined(self) -> int:
        """Segments of this rank in the quarantine directory (kept there across restarts)."""
        return self.files.quarantined

    @property
    def rebase_requests(self) -> int:
        """Fresh bases asked of the publisher (rebase.request files written)."""
        return self.files.rebase_requests

    def manifest(self, generation: int) -> GenerationManifest:
        """The manifest of ``generation`` (read once); SpoolError if unreadable."""
        return self.files.manifest(generation)

    def load_entry(self, generation: int, seq: int, path: Path) -> LogEntry:
        """Load and verify one file of this rank (SegmentCorruptError / SpoolError)."""
        return self.files.load_entry(generation, seq, path)

    def request_base(self, generation: int, reason: str, *, force: bool = False) -> bool:
        """Ask the publisher of this rank for a fresh base of ``generation`` (at most every
        ``REQUEST_EVERY_S`` unless ``force``); True if a request was written."""
        return self.files.request_base(generation, reason, force=force)

    def snapshot(self) -> LogSnapshot | None:
        """The current served log (None before any base segment of this rank exists).

        Lock-free: a snapshot is immutable and replaced by one assignment, so readers never
        wait for an indexing round (a large base's verified copy takes a while)."""
        return self._snapshot

    def previous(self) -> LogSnapshot | None:
        """The previous generation's log, while it is held (None: not held; the reason is
        :attr:`previous_missing`)."""
        prev = self._previous
        if prev is not None and time.monotonic() >= self._previous_until:
            self.drop_previous(
                f"generation {prev.generation}'s log was dropped after "
                f"{self.keep_previous_s:g} s (generation_keep_s)"
            )
            return None
        return prev

    def drop_previous(self, reason: str) -> None:
        """Stop holding the previous generation's log (``reason``: what consumers are told)."""
        if self._previous is not None:
            log.info("rank %d: %s", self.rank, reason)
        self._previous, self.previous_missing = None, reason

    def refresh(self) -> bool:
        """Index new files, maybe switch generation; True if the served log changed."""
        with self._lock:
            before = self._snapshot
            newest = self.layout.latest_generation()
            if newest is not None and (self._generation is None or newest > self._generation):
                self._try_switch(newest)
            gen = self._generation
            # an idle poll costs a stat of the rank's directory, whatever the log's length;
            # a gap being waited out is looked at every poll (its grace, a fresh base)
            if gen is not None and (self._gap_since is not None or not self.files.unchanged(gen)):
                self.files.scan_all(gen, self._known, self._dense)
                self._rewrite_lost(gen)
                self._publish(gen)
            self.previous()  # drops a held previous generation once its time is up
            return self._snapshot is not before

    def _try_switch(self, generation: int) -> None:
        known: dict[Path, LogEntry] = {}
        self.files.scan(generation, known)
        if not any(e.first_seq == 0 for e in known.values()):
            return  # this rank's base of the new generation is not there yet
        old = self._generation
        if old is not None:
            self._hold_previous(self._snapshot)
        self._generation, self._known, self._dense = generation, known, {}
        if old is not None:
            log.info("rank %d: generation %d -> %d", self.rank, old, generation)
            self.files.drop_generation(old)

    def _rewrite_lost(self, generation: int) -> None:
        """Write back the served files the spool lost under this sidecar (a deleted or
        remounted spool, an operator's ``rm -r``), from their verified private copies, and
        keep serving them: the log never moves back, and a restart finds them again. A file
        is lost when the served snapshot holds it, the scan did not find it, and no file it
        found covers its seqs (retention's merges and a fresh base cover what they replace;
        the sidecar deletes its own files under this lock, after the snapshot moved)."""
        snap = self._snapshot
        if snap is None or snap.generation != generation:
            return
        lost = [e for e in snap.entries if e.path not in self._known]
        lost_dense = [d for d in snap.dense if d.path not in self._dense]
        if not lost and not lost_dense:
            return
        spans = [(k.first_seq, k.seq) for k in self._known.values()]
        lost = [e for e in lost if not any(a <= e.first_seq and e.seq <= b for a, b in spans)]
        if not lost and not lost_dense:
            return
        from deltad.serve.index.persist import write_dense_entry, write_entry

        try:
            if not self.layout.manifest_path(generation).exists():
                self.layout.write_manifest(snap.manifest)
            for e in lost:
                write_entry(e, e.path, fsync=True)
                self._known[e.path] = e
            for d in lost_dense:
                write_dense_entry(d, d.path, fsync=True)
                self._dense[d.path] = d
        except OSError as e:  # served from memory all the same; tried again next poll
            log.error("rank %d: cannot write back the spool's lost files: %s", self.rank, e)
            for x in lost:
                self._known.setdefault(x.path, x)
            for y in lost_dense:
                self._dense.setdefault(y.path, y)
            self.files.rescan()
            return
        self.rewritten += len(lost) + len(lost_dense)
        log.warning(
            "rank %d: the spool lost %d served segments (seq %d..%d) and %d dense states under "
            "this sidecar: written back from their verified copies",
            self.rank, len(lost), lost[0].first_seq if lost else -1,
            lost[-1].seq if lost else -1, len(lost_dense),
        )  # fmt: skip
        if self.on_rewrite is not None:
            self.on_rewrite(len(lost) + len(lost_dense))
        self.files.rescan()

    def _hold_previous(self, snap: LogSnapshot | None) -> None:
        """Keep ``snap`` (the log being switched away from) for generation diffs, within the
        time and byte bounds."""
        if snap is None:
            self.drop_previous("the previous generation had no base on this rank")
        elif self.keep_previous_s <= 0:
            self.drop_previous("previous generations are not kept (generation_keep_s = 0)")
        elif snap.nbytes > self.keep_previous_bytes:
            self.drop_previous(
                f"generation {snap.generation}'s log ({snap.nbytes} bytes) is over "
                f"generation_keep_bytes = {self.keep_previous_bytes}"
            )
        else:
            self._previous, self.previous_missing = snap, ""
            self._previous_until = time.monotonic() + self.keep_previous_s
            log.info(
                "rank %d: holding generation %d's log (%d bytes, seq %d..%d) for %g s",
                self.rank, snap.generation, snap.nbytes, snap.base.seq, snap.head.seq,
                self.keep_previous_s,
            )  # fmt: skip

    def prune_dense(self) -> int:
        """Delete the dense states no window can need any more: those older than the newest
        one at or before the base (every window ends at or after the base; a window serves
        the newest dense state at or before its head). The newest one is always kept."""
        with self._lock:
            snap = self._snapshot
            if snap is None:
                return 0
            keep = snap.dense_at(snap.base.seq)
            old = [d for d in self._dense.values() if keep is not None and d.seq < keep.seq]
            for d in old:
                d.path.unlink(missing_ok=True)
                del self._dense[d.path]
            if old:
                self._publish(snap.generation)
            return len(old)

    def _publish(self, generation: int) -> None:
        entries = sorted(self._known.values(), key=lambda e: e.seq)
        bases = [e for e in entries if e.first_seq == 0]
        if not bases:
            self._set_snapshot(None)
            return
        run = [bases[-1]]
        gap = False
        for e in entries:
            if e.seq <= run[-1].seq:
                continue
            if e.first_seq != run[-1].seq + 1:
                log.debug("rank %d: holding back seq %d after a gap", self.rank, e.seq)
                gap = True
                break
            run.append(e)
        bad = self.identities.check(generation, run)
        if bad is not None:  # quarantined (a fresh base asked for); what follows waits
            i, why = bad
            self.files.quarantine_entry(generation, run[i].path, why)
            self._known.pop(run[i].path, None)
            gap = gap or len(run) > i + 1 or any(e.seq > run[-1].seq for e in entries)
            del run[i:]
        dense = tuple(sorted(self._dense.values(), key=lambda d: d.seq))
        now = time.monotonic()
        if not gap:
            self._gap_since = None
        elif self._gap_since is None:
            self._gap_since = now
        elif now - self._gap_since > GAP_GRACE_S:
            self.request_base(generation, f"segment {run[-1].seq + 1} is missing")
        cur = self._snapshot
        if (
            cur is not None
            and cur.generation == generation
            and cur.entries == tuple(run)
            and cur.dense == dense
        ):
            return
        manifest = (
            cur.manifest
            if cur is not None and cur.generation == generation
            else self.manifest(generation)
        )
        if self.gate is not None:  # before anyone can read them
            self.gate.check(generation, run, dense, [t.name for t in manifest.tables])
        self._set_snapshot(LogSnapshot(generation, manifest, tuple(run), dense))

    def _set_snapshot(self, snap: LogSnapshot | None) -> None:
        changed = snap is not self._snapshot
        self._snapshot = snap
        if changed:
            with self._changed:
                self._changed.notify_all()

    def wait_past(
        self, generation: int, seq: int, timeout: float, stop: threading.Event | None = None
    ) -> LogSnapshot | None:
        """The snapshot once its head is past ``(generation, seq)``, ``timeout`` seconds have
        passed or ``stop`` is set (then :meth:`wake`: whichever first; the snapshot either
        way). A long-polling reader's wait: woken by each published snapshot, so it sees a new
        head without polling."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._changed:
            while True:  # bounded by the deadline
                snap = self._snapshot
                if snap is not None and (snap.generation, snap.head.seq) > (generation, seq):
                    return snap
                if stop is not None and stop.is_set():
                    return snap
                left = deadline - time.monotonic()
                if left <= 0:
                    return snap
                self._changed.wait(left)

    def wake(self) -> None:
        """Wake every :meth:`wait_past` (those given a set ``stop`` return)."""
        with self._changed:
            self._changed.notify_all()

    def replace(self, covered: Sequence[LogEntry], merged: LogEntry) -> bool:
        """Swap ``covered`` (already replaced on disk by ``merged``) for ``merged``; delete
        the covered files. False if the log moved on meanwhile (nothing is changed then,
        except that a merge of a generation dropped meanwhile is deleted with it)."""
        with self._lock:
            snap = self._snapshot
            if merged.segment.header.generation != self._generation:
                # the merge wrote into a generation dropped while it ran (re-creating its
                # directory): nothing will ever read or delete it but this
                self.files.drop_generation(merged.segment.header.generation)
                return False
            if snap is None or any(self._known.get(e.path) is not e for e in covered):
                return False
            for e in covered:
                del self._known[e.path]
            for e in covered:
                if e.path != merged.path:
                    e.path.unlink(missing_ok=True)
            self._known[merged.path] = merged
            self._publish(snap.generation)
            return True
