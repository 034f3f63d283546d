"""Restore points: the window of recent steps whose state one rank's log keeps, so that a
rollback (deltad.serve.windows.rollback) can take a consumer back to any of them exactly.

The state at a step ``S`` is that of the newest entry at or before ``S``; it is in the log as
long as that entry ends a segment and the entry after it was not merged with others (a
retention merge of ``first..seq`` keeps only the state at ``seq``). So retention
(deltad.serve.index.retention) never merges an entry inside the restore window, nor the entry
just before it: a merge may only cover entries up to :func:`merge_limit`. The window is the
entries within ``steps`` of the head's step, or published within ``seconds`` (either; 0 turns
a bound off). Cost: the log keeps those segments as published instead of merging them
(bench/restore.py measures it).
"""

from __future__ import annotations

import time
from typing import Any

from deltad.serve.index.log import LogSnapshot
from deltad.serve.windows.decide import LogView


def merge_limit(
    snap: LogSnapshot, *, steps: int, seconds: float, now: float | None = None
) -> int | None:
    """The newest seq a retention merge may cover (None: no restore window, no limit; -1:
    nothing may merge). Entries after it are the restore window and the entry whose state
    its oldest step may need."""
    if steps <= 0 and seconds <= 0:
        return None
    now = time.time() if now is None else now
    head = snap.head.step
    limit: int | None = None
    prev = -1
    for e in snap.entries:
        inside = (steps > 0 and e.step >= head - steps) or (
            seconds > 0 and e.created_unix >= now - seconds
        )
        if inside:
            return prev
        prev = e.seq if e is not snap.base else -1  # the base itself never merges forward
        limit = prev
    return limit


def restorable(snap: LogSnapshot, step: int) -> str:
    """Why this rank's log cannot restore trainer step ``step`` ("" if it can): the hook the
    rollout controls ask before recording a rollback order."""
    got = LogView.of(snap).restore_point(step)
    return got if isinstance(got, str) else ""


def restorable_steps(snap: LogSnapshot) -> tuple[int, int]:
    """(oldest, newest) step this rank's log can restore exactly: the base's step (or the
    oldest step after the newest merged entry) up to the head's."""
    oldest = snap.base.step
    for e in snap.entries[1:]:
        if e.first_seq != e.seq:
            oldest = e.step  # steps before a merged entry's end are lost
    return oldest, snap.head.step


#: most merged entries a rank tells the others of (with more, the newest of them are told and
#: the steps before them are taken as lost)
MAX_MERGED_TOLD = 256


def restore_points(snap: LogSnapshot, merging: tuple[int, int] | None = None) -> dict[str, Any]:
    """What the other ranks' rollout controls need to know of this rank's restore points (in
    its registry entry): its generation, its base's step, and the (step before, step) of every
    merged entry after the base, whose steps in between are lost. ``merging``: the
    (first_seq, seq) of a merge about to run, told as if done (told before it runs, so no
    order accepted meanwhile names a step it swallows)."""
    entries = [(e.first_seq, e.seq, e.step) for e in snap.entries]
    if merging is not None:
        inside = [x for x in entries if merging[0] <= x[0] and x[1] <= merging[1]]
        if inside:
            at = entries.index(inside[0])
            merged_entry = (merging[0], inside[-1][1], inside[-1][2])
            entries[at : at + len(inside)] = [merged_entry]
    merged: list[list[int]] = []
    base = prev = entries[0][2]
    for first_seq, seq, step in entries[1:]:
        if first_seq != seq:
            merged.append([prev, step])
        prev = step
    if len(merged) > MAX_MERGED_TOLD:
        base, merged = merged[-MAX_MERGED_TOLD - 1][1], merged[-MAX_MERGED_TOLD:]
    return {"generation": snap.generation, "base_step": base, "merged": merged}


def unrestorable(points: Any, generation: int, step: int) -> str:
    """Why a rank whose :func:`restore_points` are ``points`` cannot restore ``step`` of
    ``generation`` ("" if it can, or if ``points`` are of another generation or not what
    deltad writes: nothing is known then)."""
    if not isinstance(points, dict) or points.get("generation") != generation:
        return ""
    base, merged = points.get("base_step"), points.get("merged")
    if not isinstance(base, int) or not isinstance(merged, list):
        return ""
    if step < base:
        return f"step {step} is older than its log's base (step {base})"
    for m in merged:
        ok = isinstance(m, list) and len(m) == 2 and all(isinstance(x, int) for x in m)
        if ok and m[0] < step < m[1]:
            return f"step {step} falls inside a merged segment of its log (steps {m[0]}..{m[1]})"
    return ""
