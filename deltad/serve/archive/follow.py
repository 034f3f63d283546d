"""A relay that follows the archive instead of an upstream sidecar (``deltad serve
--upstream-archive URL``): another region reads the log from a replicated bucket, never from
the trainer's sidecar across the WAN.

:class:`ArchiveFollower` polls the rank's archived manifest (one small GET per round; its tag
says whether it moved). When it moved, it takes the release state archived with it (the
relay's :class:`~deltad.serve.state.release.FollowedRollout`, kept in its spool: a hold holds
here too, applied before any newer row is placed), then fetches the entries and dense states
after the relay's local head with parallel ranged reads, verifies each as a restore does
(size and XXH3, then the spool's own validation), and links them into the relay's spool in
order: dense states first, then segments, oldest first, so the relay's log never sees a gap.

The seqs, steps, generation and creation times are the trainer's, so a cursor means the same
state at the sidecar, in the archive and at this relay: a predictor can move between them
without a resync. An entry the archive merged across the local head (the relay fell behind
past the sidecar's retention) is placed like any other: its range covers the local files,
which the log drops as a merge's leftovers. A newer generation in the archive is placed with
its manifest and base; the relay's log switches to it as a sidecar's does.

A round that fails (the store unreachable, an object that fails verification) places nothing
after the failure; the next round starts over from the local head. After
:data:`LOST_AFTER_S` (10 s) of failures the relay says it lost its upstream (``upstream_lost`` in
every window and in Status): a predictor behind it is then not caught up.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from deltad.segment.spool import SpoolLayout, fsync_dir
from deltad.serve.archive.fetch import fetch_objects, read_generation
from deltad.serve.archive.layout import ArchivedObject, ArchiveManifest, manifest_key
from deltad.serve.archive.restore import clear_staging, place_verified, verify_fetched
from deltad.serve.archive.store import ArchiveError, ObjectStore
from deltad.serve.relay.upstream_health import LOST_AFTER_S  # (as a mirroring relay says it)
from deltad.serve.state.release import FollowedRollout

__all__ = ["ArchiveFollower"]

log = logging.getLogger(__name__)


class ArchiveFollower:
    """Keeps one rank of a relay's spool at the archive's head (see the module docstring)."""

    def __init__(
        self,
        store: ObjectStore,
        layout: SpoolLayout,
        rank: int,
        rollout: FollowedRollout,
        *,
        interval_s: float = 0.2,
        fsync: bool = True,
    ) -> None:
        self.store = store
        self.layout = layout
        self.model = layout.model
        self.rank = rank
        self.rollout = rollout
        self.interval_s = interval_s
        self.fsync = fsync
        self._tag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: the archive's newest manifest read: (generation, head seq, head step)
        self.archive_head: tuple[int, int, int] | None = None
        self.placed = 0  # segment files placed
        self.placed_dense = 0
        self.placed_bytes = 0
        self.rounds_failed = 0
        #: monotonic time of the last successful round (None: none yet) and since when
        #: rounds fail (None: the last one succeeded), with why
        self.last_ok: float | None = None
        self.failing_since: float | None = None
        self.problem = ""

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> ArchiveFollower:
        self._thread = threading.Thread(
            target=self._run, name=f"deltad-follow-archive-{self.rank}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.store.close()

    def _run(self) -> None:
        while not self._stop.is_set():  # bounded by stop()
            try:
                self.step()
                self.last_ok, self.failing_since, self.problem = time.monotonic(), None, ""
            except (ArchiveError, OSError) as e:
                self.rounds_failed += 1
                if self.failing_since is None:
                    self.failing_since = time.monotonic()
                    log.warning("archive %s: following failed (retrying): %s", self.store.url, e)
                self.problem = str(e)[:300]
                self._tag = None  # read it again whole next round
            except Exception:
                self.rounds_failed += 1
                if self.failing_since is None:
                    self.failing_since = time.monotonic()
                self.problem = "an internal error (see the log)"
                log.exception("archive %s: following failed", self.store.url)
                self._tag = None
            self._stop.wait(self.interval_s)

    # --- one round ---------------------------------------------------------------------------

    def step(self) -> int:
        """Take the archive's release state and place what it holds past the local head;
        the number of files placed. Raises ArchiveError (the store, an object that fails
        verification: nothing after it is placed)."""
        got = self.store.read_versioned(manifest_key(self.model, self.rank))
        if got is None:
            return 0  # nothing archived yet
        if got.tag == self._tag and self._tag is not None:
            return 0
        m = ArchiveManifest.from_json(got.data)
        release = m.extra.get("release") if isinstance(m.extra, dict) else None
        if isinstance(release, str):
            self.rollout.follow(release)
        elif not self.rollout.known:  # (archived by a sidecar that records none)
            self.rollout.follow("")
        self.archive_head = (m.generation, m.head.seq, m.head.step)
        newest = self.layout.latest_generation()
        if newest is not None and newest > m.generation:
            self._tag = got.tag  # the archive is behind this spool (a restart being archived)
            return 0
        local = self._local_head(m.generation)
        entries = [o for o in m.entries if o.seq > local]
        n = self._place(m, entries, local) if entries else 0
        self._tag = got.tag
        return n

    def _local_head(self, generation: int) -> int:
        """The newest seq of ``generation`` in this rank's spool (-1: none)."""
        segs = self.layout.segments(generation, self.rank)
        return segs[-1][0] if segs else -1

    def _place(self, m: ArchiveManifest, entries: list[ArchivedObject], local: int) -> int:
        gm = read_generation(self.store, m)
        if not self.layout.manifest_path(m.generation).exists():
            self.layout.write_manifest(gm, fsync=self.fsync)
        rank_dir = self.layout.rank_dir(m.generation, self.rank)
        rank_dir.mkdir(parents=True, exist_ok=True)
        # (the dense states of seqs past the local head: those at or before it were placed
        # with their segments, and the relay's log may have pruned them since)
        dense = [d for d in m.dense if local < d.seq <= entries[-1].seq]
        # staged beside the spool (same file system, for the links), not in the rank's
        # directory: the relay's log lists that one
        staging = self.layout.sidecar_dir / f"follow-rank-{self.rank:05d}"
        staging.mkdir(parents=True, exist_ok=True)
        try:
            wanted = [(o, staging / f"{i:06d}.dseg") for i, o in enumerate(entries)]
            wanted_dense = [(o, staging / f"d{i:06d}.dseg") for i, o in enumerate(dense)]
            fetch_objects(self.store, [*wanted, *wanted_dense])
            ok: list[tuple[ArchivedObject, Path]] = []
            for obj, path in wanted:
                why = verify_fetched(
                    self.layout, gm, m.generation, self.rank, obj, path, dense=False
                )
                if why:
                    if not ok:
                        raise ArchiveError(why)
                    log.error("archive %s: placing up to seq %d only: %s", self.store.url,
                              ok[-1][0].seq, why)  # fmt: skip
                    break
                ok.append((obj, path))
            head = ok[-1][0].seq
            placed = 0
            for obj, path in wanted_dense:
                if obj.seq > head:
                    continue
                if verify_fetched(self.layout, gm, m.generation, self.rank, obj, path, dense=True):
                    continue  # a dense state that fails is not placed; its rows still are
                size = place_verified(
                    path, self.layout.dense_path(m.generation, self.rank, obj.seq)
                )
                self.placed_bytes += size
                self.placed_dense += bool(size)
            for obj, path in ok:  # oldest first: the log never sees a gap
                size = place_verified(
                    path, self.layout.segment_path(m.generation, self.rank, obj.seq)
                )
                self.placed_bytes += size
                self.placed += bool(size)
                placed += bool(size)
            if self.fsync:
                fsync_dir(rank_dir)
        finally:
            clear_staging(staging)
        log.info(
            "archive %s: placed rank %d generation %d seq %d..%d (%d files)",
            self.store.url, self.rank, m.generation, local + 1, head, placed,
        )  # fmt: skip
        return placed

    # --- what the relay says -----------------------------------------------------------------

    def lost(self) -> str:
        """Why this relay cannot vouch that its head is the archive's ("" if it can)."""
        since = self.failing_since
        if since is None:
            return ""
        age = time.monotonic() - since
        if age < LOST_AFTER_S:
            return ""
        return f"relay lost its archive {self.store.url} {age:.0f}s ago: {self.problem}"[:512]

    def lag(self, local_seq: int | None) -> int:
        """Segments the relay's head is behind the archive's last read head (-1: not known)."""
        if self.archive_head is None or local_seq is None:
            return -1
        return max(0, self.archive_head[1] - local_seq)
