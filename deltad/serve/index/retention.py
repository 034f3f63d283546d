"""Retention: keep one rank's log bounded by merging segments no live consumer stands between.

Each round (bounded: one merge of at most ``deltad.knobs.MERGE_MAX_BYTES_PER_ROUND`` input bytes, plus the
base it extends) does the first applicable of:

1. **Base forward**: merge the base with the deltas up to the minimum *live* pin (a committed
   cursor or a pending pull of a consumer whose lease is alive; with no live consumer, up to
   the head), once there are ``merge_min_segments`` of them or they reach 1/8 of the base.
2. **Gaps**: between two neighbouring pins (and after the last one) merge a run of at least
   ``merge_min_segments`` entries into one.

Merging is lossless (union of ids, latest value wins): the merged file is written atomically
under the last input's name with ``first_seq..seq``, then the inputs are deleted; a crash in
between leaves files that :class:`~deltad.serve.index.log.SegmentLog` deletes as covered.

While a live consumer has still to follow a rollback order, the order's restore point is
pinned like a cursor (no merge crosses it), even once it left the restore window. So are the
steps the release state serves (deltad.serve.rollout.served_steps): the release step (a hold, a release
to a step, the validation gate's last good step) and every pin's step, so that a consumer
that is new or comes back without tables is still served that state, and a release or a
rollback to it stays possible, whoever is connected. While some consumer is held at a state
of another generation (a fleet held across a trainer restart: deltad.serve.rollout.unreleased),
nothing of the log's generation is merged: a release may name any of its steps. The log then
grows with the new generation until the operator or the evaluator releases it.

Neither kind of merge covers an entry of the restore window (``restore_steps`` /
``restore_seconds``, :func:`deltad.serve.index.restore.merge_limit`): every step in it stays
restorable for a rollback.

An expired-lease consumer pins nothing: if it comes back behind the merged base it gets a
resync from that base (a full-table window); if its cursor falls inside a merged delta, the
whole merged entry is served (a superset of rows, still exact for ids and rows; top-k held
values are then approximate for the rows merged before its cursor).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from deltad.errors import OffsetStoreError, SegmentCorruptError, SpoolError
from deltad.segment.format import write_segment
from deltad.serve.index.log import LogEntry, LogSnapshot, SegmentLog
from deltad.serve.index.merge import merge_plan
from deltad.serve.index.restore import merge_limit
from deltad.serve.rollout import ReleaseState, order_for, served_steps, unreleased
from deltad.serve.state.offsets import OffsetStore
from deltad.serve.windows.decide import LogView
from deltad.serve.windows.gendiff import drop_unpinned
from deltad.types import SegmentKind

log = logging.getLogger(__name__)


class Retention:
    """Merges one rank's log; call :meth:`run_once` from a background loop."""

    def __init__(
        self,
        seglog: SegmentLog,
        store: OffsetStore,
        *,
        min_segments: int = 4,
        max_bytes: int = 1 << 30,
        restore_steps: int = 0,
        restore_seconds: float = 0.0,
        release: Callable[[], ReleaseState] | None = None,
    ) -> None:
        self.seglog = seglog
        self.store = store
        self.min_segments = min_segments
        self.max_bytes = max_bytes
        self.restore_steps = restore_steps
        self.restore_seconds = restore_seconds
        #: the model's release state (its rollback order's restore point is kept while a
        #: consumer has still to follow it)
        self.release = release
        #: The (first_seq, seq) of a merge that failed unexpectedly: not retried, so one bad
        #: entry cannot make every round fail (other merges still run).
        self._failed: set[tuple[int, int]] = set()
        #: merges that failed (a full disk, an unwritable spool, a merge bug)
        self.failures = 0
        #: told (first_seq, seq) of each merge before it runs (the sidecar's registry entry:
        #: the other ranks' rollout controls read this rank's restore points there)
        self.before_merge: Callable[[tuple[int, int]], None] | None = None
        #: the release state read afresh (not the cached view) once the merge was told: an
        #: order recorded since the plan that needs a state the merge would swallow stops it
        #: (one recorded after this read saw the merge told, and was refused)
        self.fresh_release: Callable[[], ReleaseState] | None = None
        #: the archive's pin for a generation (deltad.serve.archive.uploader.retention_pin):
        #: no merge crosses a seq it has not uploaded, so it keeps its own base and the deltas
        #: as published; None: no pin (no archive, or one too far behind to wait for)
        self.archive_pin: Callable[[int], int | None] | None = None

    def _bounded(self, run: Sequence[LogEntry], first: LogEntry | None = None) -> list[LogEntry]:
        out = [first] if first is not None else []
        total = 0
        for e in run:
            if len(out) >= 2 and total + e.nbytes > self.max_bytes:
                break
            out.append(e)
            total += e.nbytes
        return out

    def plan(self) -> list[LogEntry] | None:
        """The entries the next merge covers (oldest first), or None."""
        snap = self.seglog.snapshot()
        if snap is None or len(snap.entries) < 2:
            return None
        try:
            pins = self.store.pins(self.seglog.rank, snap.generation)
        except OffsetStoreError as e:
            log.warning("retention skipped: %s", e)
            return None
        if self.release is not None:  # (one read of the state, one view of the log)
            state, view = self.release(), LogView.of(snap)
            if unreleased(state, snap.generation):
                # consumers are held at another generation: a release may name any step of
                # this one, so every step stays (issue 39; relays mirror each, the same)
                return None
            held = self._rollback_pins(snap, view, state) | self._release_pins(view, state)
            pins = sorted({*pins, *held})
        if self.archive_pin is not None:
            held_for_archive = self.archive_pin(snap.generation)
            if held_for_archive is not None:
                pins = sorted({*pins, held_for_archive})
        base, deltas = snap.base, snap.entries[1:]
        floor = pins[0] if pins else snap.head.seq
        limit = merge_limit(snap, steps=self.restore_steps, seconds=self.restore_seconds)
        if limit is not None:
            floor = min(floor, limit)
        forward = [e for e in deltas if e.seq <= floor]
        # Rewriting the base costs its size: do it once the deltas it absorbs are many or
        # at least 1/8 of it (write amplification <= 8x), not for every new segment.
        if forward and (
            len(forward) >= self.min_segments or 8 * sum(e.nbytes for e in forward) >= base.nbytes
        ):
            return self._bounded(forward, first=base)
        bounds = [p for p in pins if p > base.seq]
        lo = base.seq
        for hi in [*bounds, snap.head.seq]:
            end = hi if limit is None else min(hi, limit)
            run = [e for e in deltas if lo < e.first_seq and e.seq <= end]
            if len(run) >= self.min_segments:
                return self._bounded(run)
            lo = hi
        return None

    def _swallows_a_served_state(self, covered: Sequence[LogEntry]) -> bool:
        """Whether the release state, read afresh, serves a state the merge of ``covered``
        would lose (an entry's but the last one's: a step, pin or rollback order recorded
        since the plan read the cached state); then the merge waits for the next round."""
        if self.fresh_release is None:
            return False
        try:
            state = self.fresh_release()
        except OffsetStoreError as e:
            log.warning("retention skipped: %s", e)
            return True
        snap = self.seglog.snapshot()
        if snap is None or unreleased(state, snap.generation):
            return True
        view = LogView.of(snap)  # (the pins the plan takes from it, from the fresh state)
        held = self._release_pins(view, state) | self._rollback_pins(snap, view, state)
        lost = {e.seq for e in covered[:-1]}
        if held & lost:
            log.info(
                "retention: merge of seq %d..%d left for later: the release state serves seq %s",
                covered[0].first_seq, covered[-1].seq, sorted(held & lost),
            )  # fmt: skip
            return True
        return False

    def _release_pins(self, view: LogView, state: ReleaseState) -> set[int]:
        """The seqs of the states the release state serves (deltad.serve.rollout.served_steps)
        that this log holds."""
        out: set[int] = set()
        for step in served_steps(state, view.generation):
            target = view.restore_point(step)
            if not isinstance(target, str):
                out.add(target[0])
        return out

    def _rollback_pins(self, snap: LogSnapshot, view: LogView, state: ReleaseState) -> set[int]:
        """The seqs of the rollback orders' restore points that a live consumer has still to
        follow on this rank (the newest order naming it, past its step, not recorded as
        followed); empty if the log cannot restore them."""
        if not state.rollbacks:
            return set()
        targets: dict[int, int] = {}
        for rb in state.rollbacks:
            t = view.restore_point(rb.to_step)
            if not isinstance(t, str):
                targets[rb.epoch] = t[0]
        if not targets:
            return set()
        try:
            cursors = self.store.live_cursors(self.seglog.rank)
        except OffsetStoreError as e:  # keep them then: a merge can wait, a lost step cannot
            log.warning("retention: cannot read the cursors behind a rollback: %s", e)
            return set(targets.values())
        out: set[int] = set()
        for consumer, cur in cursors.items():
            order = order_for(state, consumer)
            if (
                order is not None
                and order.epoch in targets
                and cur.generation == snap.generation
                and cur.step > order.to_step
                and cur.rollback_epoch < order.epoch
            ):
                out.add(targets[order.epoch])
        return out

    def run_once(self) -> bool:
        """Do at most one merge; True if the log changed. Dense states older than the newest
        one at or before the base are deleted (the newest dense state is always kept)."""
        self.seglog.prune_dense()
        drop_unpinned(self.seglog, self.store)  # the previous generation, once nobody is at it
        covered = self.plan()
        if not covered or len(covered) < 2:
            return False
        first, last = covered[0], covered[-1]
        if (first.first_seq, last.seq) in self._failed:
            return False
        head = first.segment.header
        if self.before_merge is not None:
            self.before_merge((first.first_seq, last.seq))
        if self._swallows_a_served_state(covered):
            return False
        try:
            shards, values_of = merge_plan(covered)
        except Exception as e:  # verified inputs make this a bug, not a bad file: keep going
            self._failed.add((first.first_seq, last.seq))
            log.exception("retention merge of seq %d..%d failed: %s", first.first_seq, last.seq, e)
            self.failures += 1
            return False
        try:
            write_segment(
                last.path,
                model=head.model,
                generation=head.generation,
                rank=head.rank,
                world_size=head.world_size,
                seq=last.seq,
                first_seq=first.first_seq,
                step=last.step,
                kind=SegmentKind.BASE if first.first_seq == 0 else SegmentKind.DELTA,
                shards=shards,
                values_of=values_of,  # one shard's merged values in memory at a time
                # ages are of the trainer's steps, not of this file: a merge is no news
                created_unix=last.created_unix,
                first_created_unix=min(e.first_created_unix for e in covered),
            )
            entry = self.seglog.load_entry(head.generation, last.seq, last.path)
        except SegmentCorruptError as e:  # the merged file failed its check: not again
            self._failed.add((first.first_seq, last.seq))
            log.error("retention merge of seq %d..%d failed: %s", first.first_seq, last.seq, e)
            self.failures += 1
            return False
        except SpoolError as e:  # e.g. the disk is full: retried next round
            log.error("retention merge of seq %d..%d failed: %s", first.first_seq, last.seq, e)
            self.failures += 1
            return False
        except (ValueError, RuntimeError) as e:  # a merge bug (inputs are verified): not again
            self._failed.add((first.first_seq, last.seq))
            log.exception("retention merge of seq %d..%d failed: %s", first.first_seq, last.seq, e)
            self.failures += 1
            return False
        if not self.seglog.replace(covered, entry):
            return False
        log.info("merged seq %d..%d into %s", first.first_seq, last.seq, last.path.name)
        self.seglog.prune_dense()  # the base moved: older dense states can go
        return True
