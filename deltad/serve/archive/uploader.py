"""The sidecar's uploader: every verified segment, base and dense state of the served log, and
the rank's manifest, copied to the object store on a thread of its own.

What is left to upload is always the difference between the served log (the segment log's
current immutable snapshot) and what the store already holds: nothing is queued but that, so
the work in flight is bounded by the log itself, and a store that is down for minutes loses
nothing. Each round (:meth:`ArchiveUploader.run_once`) uploads the generation manifest, then
every entry and dense state of the snapshot not uploaded yet (create-once, content-addressed),
and only then moves the rank's manifest to name them (compare-and-swap: it never moves back to
an older log, whoever wrote it). A failed round is retried with exponential backoff
(``BACKOFF_S`` .. ``BACKOFF_MAX_S``); indexing and serving never wait on it (they only hand it
snapshots, which it reads without a lock).

Entries merged away by retention while the store was down are uploaded as the merged entry
(the state at its seq is the same); the restore points inside it are then not archived.

Retention in the store (:meth:`ArchiveUploader.sweep`, every ``gc_interval_s``): the archive
mirrors the served log, whose own retention already keeps what restore points, generation
diffs and live consumers need, so an object of this rank that the rank's manifest in the store
does not name is needed by nobody once every reader of an older manifest is done. Such an
object is deleted after ``gc_grace_s`` seconds of being seen unnamed (a cold start or a restore
reading an older manifest meanwhile still finds it); uploads not yet named by a manifest are
never deleted. Rank 0 deletes an older generation's ``generation.json`` once no rank's object
of that generation is left.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deltad.errors import DeltadError
from deltad.serve.archive.layout import (
    ArchivedObject,
    ArchiveManifest,
    dense_key,
    file_digest,
    generation_key,
    manifest_key,
    scratch_file,
    segment_key,
    write_dense_entry,
    write_entry,
)
from deltad.serve.archive.store import ArchiveError, ObjectStore
from deltad.serve.index.files import LogEntry
from deltad.serve.index.log import LogSnapshot, SegmentLog

log = logging.getLogger(__name__)

#: first wait after a failed round, doubled after each further failure up to BACKOFF_MAX_S
BACKOFF_S = 0.5
BACKOFF_MAX_S = 30.0
#: most compare-and-swap attempts of the manifest in one round
CAS_TRIES = 5


@dataclass(frozen=True)
class ArchiveLag:
    """How far the archive is behind the served log."""

    segments: int
    seconds: float


class ArchiveUploader:
    """Copies one rank's served log to ``store`` (see the module docstring)."""

    def __init__(
        self,
        store: ObjectStore,
        seglog: SegmentLog,
        model: str,
        *,
        scratch_dir: Path,
        interval_s: float = 0.2,
        gc_grace_s: float = 600.0,
        gc_interval_s: float | None = None,
        release: Callable[[], str | None] | None = None,
        base_deltas: float = 1.0,
        base_every_s: float = 3600.0,
    ) -> None:
        self.store = store
        #: The release state the server applies, as JSON (None: not known, or no release
        #: state): recorded in every manifest (``extra["release"]``), and the manifest moves
        #: when it changes, so that a predictor starting from the store with no sidecar to
        #: ask (deltad.consume.coldstart) is held where the fleet is.
        self.release = release
        #: when a fresh base is uploaded (see :meth:`plan`)
        self.base_deltas = base_deltas
        self.base_every_s = base_every_s
        self.log = seglog
        self.model = model
        self.rank = seglog.rank
        self.scratch_dir = Path(scratch_dir)
        self.interval_s = interval_s
        self.gc_grace_s = gc_grace_s
        #: between sweeps (None: a tenth of the grace, within 1 .. 60 s)
        self.gc_interval_s = (
            min(60.0, max(1.0, gc_grace_s / 10)) if gc_interval_s is None else gc_interval_s
        )
        #: key -> when a sweep first saw it named by no manifest (reset by a restart: the
        #: grace starts again, on the safe side)
        self._unnamed_since: dict[str, float] = {}
        self._next_sweep = 0.0
        self.deleted = 0  # objects retention deleted from the store
        #: (generation, first_seq, seq) of a segment / (generation, -1, seq) of a dense state
        #: -> the object holding it
        self._uploaded: dict[tuple[int, int, int], ArchivedObject] = {}
        self._generations: set[int] = set()
        #: the manifest this uploader last wrote or read, and its tag (None: none yet)
        self.archived: ArchiveManifest | None = None
        self._tag: str | None = None
        self._tag_known = False
        self.uploads = 0  # objects created
        self.uploaded_bytes = 0
        self.failures = 0  # failed rounds
        self.last_error = ""
        #: after a failed round: look whether the objects counted as uploaded are there (a
        #: store killed right after it answered may not have kept the last ones)
        self._recheck = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the thread ------------------------------------------------------------------------

    def start(self) -> ArchiveUploader:
        shutil.rmtree(self.scratch_dir, ignore_errors=True)  # a killed uploader's scratch
        self._thread = threading.Thread(target=self._loop, name="deltad-archive", daemon=True)
        self._thread.start()
        return self

    def wake(self) -> None:
        """Look at the log now (a new snapshot), not at the next interval."""
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.store.close()

    def _loop(self) -> None:
        backoff = BACKOFF_S
        while not self._stop.is_set():  # bounded by stop()
            try:
                self.run_once()
                if self.gc_grace_s > 0 and time.monotonic() >= self._next_sweep:
                    self._next_sweep = time.monotonic() + self.gc_interval_s
                    self.sweep()
                backoff = BACKOFF_S
                wait = self.interval_s
            except (DeltadError, OSError) as e:
                self.failures += 1
                self._recheck = True
                if str(e) != self.last_error:
                    log.warning("archive %s: %s (retrying)", self.store.url, e)
                self.last_error = str(e)
                wait, backoff = backoff, min(backoff * 2, BACKOFF_MAX_S)
            except Exception as e:  # a bug: logged, retried, never kills the sidecar
                self.failures += 1
                self._recheck = True
                self.last_error = f"{type(e).__name__}: {e}"
                log.exception("archive upload round failed")
                wait, backoff = backoff, min(backoff * 2, BACKOFF_MAX_S)
            self._wake.wait(wait)
            self._wake.clear()

    # --- one round -------------------------------------------------------------------------

    def run_once(self) -> bool:
        """Upload what the served log has and the archive lacks, then move the manifest;
        True if the manifest moved. Raises ArchiveError (the store) or OSError (scratch)."""
        snap = self.log.snapshot()
        if snap is None:
            return False
        if not self._tag_known:
            self._read_manifest()
        if self._recheck:
            self._check_uploaded()
        release = self.release() if self.release is not None else None
        planned = self.plan(snap)
        if (
            self.archived is not None
            and self.archived.entries == tuple(planned)  # (all archived already)
            and [d.seq for d in self.archived.dense] == [d.seq for d in snap.dense]
            and self.archived.extra.get("release") == release
        ):
            return False
        self._upload_generation(snap)
        entries = tuple(
            e if isinstance(e, ArchivedObject) else self._upload_entry(snap.generation, e)
            for e in planned
        )
        dense = tuple(self._upload_dense(snap.generation, d) for d in snap.dense)
        self.last_error = ""
        return self._move_manifest(
            ArchiveManifest(
                model=self.model,
                rank=self.rank,
                generation=snap.generation,
                world_size=snap.manifest.world_size,
                generation_key=generation_key(self.model, snap.generation),
                entries=entries,
                dense=dense,
                updated_unix=time.time(),
                extra={} if release is None else {"release": release},
            )
        )

    def plan(self, snap: LogSnapshot, now: float | None = None) -> list[ArchivedObject | LogEntry]:
        """The entries the archive's manifest is to name: its own base and the deltas after it
        (archived already), then the served entries past its head (to upload).

        The served log's retention moves its base forward every few segments; uploading each
        such base would copy the whole rank every few seconds. The archive keeps its base
        instead, and takes the served log as it is (its base first) only when a fresh base is
        due: the archived deltas reach ``base_deltas`` of the base's bytes, or the base's
        state is ``base_every_s`` old, and the served base is past the archived one. A
        served entry merged across the archive's head (merged before it was uploaded: the
        store was down) replaces what it covers."""
        served: list[ArchivedObject | LogEntry] = list(snap.entries)
        m = self.archived
        if m is None or m.generation != snap.generation:
            return served
        base = m.entries[0]
        if served[0].seq > base.seq:
            now = time.time() if now is None else now
            deltas = sum(o.size for o in m.entries[1:])
            if (
                deltas >= self.base_deltas * base.size
                or now - base.created_unix >= self.base_every_s
            ):
                return served  # a fresh base is due
        out: list[ArchivedObject | LogEntry] = list(m.entries)
        head = out[-1].seq
        for e in snap.entries:
            if e.seq <= head:
                continue
            if e.first_seq != head + 1:  # merged across the archive's head
                out = [o for o in out if o.seq < e.first_seq]
                if e.first_seq > 0 and (not out or out[-1].seq != e.first_seq - 1):
                    return served
            out.append(e)
            head = e.seq
        return out

    def retention_pin(self, generation: int, bound_s: float) -> int | None:
        """The newest seq of ``generation`` the archive holds (-1: none yet). The served
        log's retention merges nothing past it, so every delta is uploaded as published
        before it is merged (:meth:`plan` then keeps the archive's own base). None (no pin)
        while the archive lags more than ``bound_s`` seconds: a store that is down does not
        hold the log in memory for long."""
        if self.lag().seconds > bound_s:
            return None
        m = self.archived
        return m.head.seq if m is not None and m.generation == generation else -1

    def _read_manifest(self) -> None:
        """The rank's manifest as the store has it (a restarted or restored sidecar): its
        objects count as uploaded."""
        got = self.store.read_versioned(manifest_key(self.model, self.rank))
        self._tag, self._tag_known = (None if got is None else got.tag), True
        if got is None:
            return
        try:
            m = ArchiveManifest.from_json(got.data)
        except ArchiveError as e:
            log.error(
                "archive %s: the rank's manifest is unreadable (%s): replacing it",
                self.store.url,
                e,
            )
            return
        self.archived = m
        self._note(m)

    def _check_uploaded(self) -> None:
        """Forget the uploads the store does not hold (whole) any more: they go again, and a
        manifest naming them is written again after them."""
        gone = [k for k, o in self._uploaded.items() if self.store.size(o.key) != o.size]
        for k in gone:
            del self._uploaded[k]
        if gone:
            log.warning(
                "archive %s: %d objects were lost by the store: uploading them again",
                self.store.url,
                len(gone),
            )
            self.archived = None  # the manifest is written again once they are back
        self._generations.clear()  # (put again: a no-op where it is there)
        self._recheck = False

    def _note(self, m: ArchiveManifest) -> None:
        self._generations.add(m.generation)
        for e in m.entries:
            assert e.first_seq is not None
            self._uploaded.setdefault((m.generation, e.first_seq, e.seq), e)
        for d in m.dense:
            self._uploaded.setdefault((m.generation, -1, d.seq), d)

    def _put(self, key: str, path: Path, size: int) -> None:
        if self.store.put_if_absent(key, path):
            self.uploads += 1
            self.uploaded_bytes += size

    def _upload_generation(self, snap: LogSnapshot) -> None:
        if snap.generation in self._generations:
            return
        path = scratch_file(self.scratch_dir, ".json")
        try:
            path.write_bytes(snap.manifest.to_json().encode())
            self._put(generation_key(self.model, snap.generation), path, path.stat().st_size)
        finally:
            path.unlink(missing_ok=True)
        self._generations.add(snap.generation)

    def _upload_entry(self, generation: int, entry: object) -> ArchivedObject:
        assert isinstance(entry, LogEntry)
        have = self._uploaded.get((generation, entry.first_seq, entry.seq))
        if have is not None:
            return have
        path = scratch_file(self.scratch_dir, ".dseg")
        try:
            write_entry(entry, path)
            size, digest = file_digest(path)
            key = segment_key(self.model, generation, self.rank, entry.first_seq, entry.seq, digest)
            self._put(key, path, size)
        finally:
            path.unlink(missing_ok=True)
        obj = ArchivedObject(
            key, entry.seq, entry.step, size, digest, entry.first_seq, entry.created_unix
        )
        self._uploaded[(generation, entry.first_seq, entry.seq)] = obj
        return obj

    def _upload_dense(self, generation: int, entry: object) -> ArchivedObject:
        from deltad.serve.index.files import DenseEntry

        assert isinstance(entry, DenseEntry)
        have = self._uploaded.get((generation, -1, entry.seq))
        if have is not None:
            return have
        path = scratch_file(self.scratch_dir, ".dseg")
        try:
            write_dense_entry(entry, path)
            size, digest = file_digest(path)
            key = dense_key(self.model, generation, self.rank, entry.seq, digest)
            self._put(key, path, size)
        finally:
            path.unlink(missing_ok=True)
        obj = ArchivedObject(key, entry.seq, entry.step, size, digest, None)
        self._uploaded[(generation, -1, entry.seq)] = obj
        return obj

    def _move_manifest(self, new: ArchiveManifest) -> bool:
        """Compare-and-swap the rank's manifest to ``new`` unless the store's is of a newer
        log (a newer generation, or a later head): True if it moved."""
        key = manifest_key(self.model, self.rank)
        data = new.to_json()
        for _ in range(CAS_TRIES):
            tag = self.store.compare_and_swap(key, data, self._tag)
            if tag is not None:
                self._tag, self.archived = tag, new
                self._forget_unlisted(new)
                return True
            # someone else moved it: look at theirs
            got = self.store.read_versioned(key)
            self._tag = None if got is None else got.tag
            if got is None:
                continue
            try:
                theirs = ArchiveManifest.from_json(got.data)
            except ArchiveError:
                continue  # unreadable: replaced
            if (theirs.generation, theirs.head.seq) > (new.generation, new.head.seq):
                log.warning(
                    "archive %s: rank %d's manifest is at generation %d seq %d, ahead of this "
                    "sidecar's log (generation %d seq %d): not moved back",
                    self.store.url, self.rank, theirs.generation, theirs.head.seq,
                    new.generation, new.head.seq,
                )  # fmt: skip
                self.archived = theirs
                return False
        raise ArchiveError(f"{self.store.url}: the manifest of rank {self.rank} keeps moving")

    def _forget_unlisted(self, m: ArchiveManifest) -> None:
        """Keep the memory of uploads bounded by the log: only what ``m`` lists."""
        keep = {(m.generation, e.first_seq or 0, e.seq) for e in m.entries}
        keep |= {(m.generation, -1, d.seq) for d in m.dense}
        for k in [k for k in self._uploaded if k not in keep]:
            del self._uploaded[k]
        self._generations &= {m.generation}

    # --- retention in the store --------------------------------------------------------

    def sweep(self, now: float | None = None) -> int:
        """Delete this rank's objects that no manifest has named for ``gc_grace_s`` (see the
        module docstring); the number deleted. Raises ArchiveError (the store): nothing is
        deleted unless the rank's manifest in the store was read whole."""
        if self.gc_grace_s <= 0:
            return 0
        now = time.time() if now is None else now
        got = self.store.read_versioned(manifest_key(self.model, self.rank))
        if got is None:
            return 0  # nothing archived for this rank yet: nothing is unnamed
        current = ArchiveManifest.from_json(got.data)
        named = {o.key for o in (*current.entries, *current.dense)}
        named |= {o.key for o in self._uploaded.values()}  # uploaded, not named yet
        if self.archived is not None:
            named |= {o.key for o in (*self.archived.entries, *self.archived.dense)}
        generations: set[str] = set()  # "gen-N" holding an object of some rank
        unnamed: list[str] = []
        infos: list[str] = []
        mine = f"/rank-{self.rank:05d}/"
        head = f"{self.model}/gen-"
        for key in self.store.list(f"{self.model}/"):  # bounded by the store's listing
            if not key.startswith(head):
                continue
            gen = key[len(self.model) + 1 :].split("/", 1)[0]
            if "/rank-" in key:
                generations.add(gen)
                if mine in key and key not in named:
                    unnamed.append(key)
            elif key.endswith("/generation.json"):
                infos.append(key)
        current_gen = f"gen-{current.generation:020d}"
        if self.rank == 0:  # an older generation's manifest, once no rank's object is left
            unnamed += [
                k
                for k in infos
                if k.split("/")[-2] != current_gen and k.split("/")[-2] not in generations
            ]
        seen: dict[str, float] = {}
        deleted = 0
        for key in unnamed:
            since = self._unnamed_since.get(key, now)
            if now - since >= self.gc_grace_s:
                self.store.delete(key)
                deleted += 1
            else:
                seen[key] = since
        self._unnamed_since = seen
        self.deleted += deleted
        if deleted:
            log.info("archive %s: retention deleted %d objects", self.store.url, deleted)
        return deleted

    # --- lag -------------------------------------------------------------------------------

    def lag(self, now: float | None = None) -> ArchiveLag:
        """Segments of the served log not in the archive's manifest yet, and the age of the
        oldest of them (0, 0: the archive has the log)."""
        snap = self.log.snapshot()
        if snap is None:
            return ArchiveLag(0, 0.0)
        now = time.time() if now is None else now
        m = self.archived
        done = m.head.seq if m is not None and m.generation == snap.generation else -1
        behind = [e for e in snap.entries if e.seq > done]
        if not behind:
            return ArchiveLag(0, 0.0)
        oldest = min(e.first_created_unix for e in behind)
        return ArchiveLag(snap.head.seq - done, max(0.0, now - oldest))
