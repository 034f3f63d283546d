"""Rollback windows: a consumer past an operator's rollback step goes back to exactly its state.

When the release state (deltad.serve.rollout) carries a rollback order ``Rollback(S, group,
epoch)`` that a consumer has not followed yet and its cursor ``C`` (of the log's generation) is
past step ``S``, the window decision (:func:`deltad.serve.windows.decide.decide_window`) names
the restore point ``R``: the newest entry at or before ``S``, whose state is exactly the state
at ``S`` (retention keeps those: deltad.serve.index.restore). The window then holds every row
whose value at ``R`` differs bit-exactly from its value at ``C``: the rows changed in ``(S, C]``
with their values at ``S`` (from the restore-point segments or the base), plus the rows still
owed to the consumer from a top-k pull (it holds stale values for those), and the dense state
at ``R`` when asked for. It is the generation diff's comparison of two states
(:func:`deltad.serve.windows.statediff.state_diff_window`) within one generation, and like a
generation diff it is complete in every form and wire dtype (k, fraction, max_rows do not
apply: a rollback is never partial). The header says ``resync = false``, ``from_seq = C``,
``to_seq = R`` and ``rollback_to_step = S``; the consumer applies it in place and commits the
trailer's cursor, which moves back to ``R`` (the offset store accepts that for this pull only)
and records the order's epoch, so the order is followed once.

Cost on the sidecar: one merge of the state at ``C`` and one of the state at ``R`` per shard
(transiently two copies of this rank's tables), once per (cursor, window shape): windows
without owed rows are cached, so a fleet at one cursor costs one diff.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace

from deltad.segment.format import ShardRows
from deltad.serve.index.log import LogSnapshot
from deltad.serve.windows.cache import WindowCache
from deltad.serve.windows.decide import WindowDecision
from deltad.serve.windows.encoded import EncodedWindow
from deltad.serve.windows.spec import WindowSpec
from deltad.serve.windows.statediff import state_diff_window
from deltad.types import ShardKey

#: Rollback windows (no owed rows) kept for the consumers at one cursor.
CACHE_ENTRIES = 4


def build_rollback_window(
    snap: LogSnapshot,
    spec: WindowSpec,
    to_step: int,
    owed: dict[ShardKey, ShardRows],
    rollback_to: int,
    epoch: int,
) -> EncodedWindow:
    """The rollback window ``spec`` (``from_seq``: the cursor, ``to_seq``: the restore point)
    over ``snap`` for a consumer owed ``owed``."""
    held = [e.shards for e in snap.upto(spec.from_seq)]
    return state_diff_window(
        held, snap, spec, to_step, owed, rollback_to_step=rollback_to, rollback_epoch=epoch
    )


class RollbackWindows:
    """The rollback windows of one rank's sidecar (called by deltad.serve.windows.source);
    cached windows count against the window cache's byte budget."""

    def __init__(self, budget: WindowCache) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[int, int, WindowSpec], EncodedWindow] = OrderedDict()
        self.built = 0

    def window(
        self,
        snap: LogSnapshot,
        shape: WindowSpec,
        decision: WindowDecision,
        owed: dict[ShardKey, ShardRows],
    ) -> tuple[EncodedWindow, bool]:
        """(the window of a rollback ``decision`` that is not a resync, whether it was cached)."""
        assert decision.rollback_to is not None and not decision.resync
        spec = replace(shape, resync=False, from_seq=decision.from_seq, to_seq=decision.to_seq)
        args = (decision.to_step, decision.rollback_to, decision.rollback_epoch)
        if owed:
            self.built += 1
            return build_rollback_window(snap, spec, args[0], owed, args[1], args[2]), False
        key = (snap.generation, decision.rollback_epoch, spec)
        with self._lock:  # a fleet at one cursor waits for the first one's window
            win = self._cache.get(key)
            if win is not None:
                self._cache.move_to_end(key)
                return win, True
            win = build_rollback_window(snap, spec, args[0], {}, args[1], args[2])
            self.built += 1
            if self.budget.hold(win.nbytes):
                self._cache[key] = win
                while len(self._cache) > CACHE_ENTRIES:
                    self.budget.release(self._cache.popitem(last=False)[1].nbytes)
            return win, False

    def clear(self) -> None:
        """Forget the cached windows, giving their bytes back."""
        with self._lock:
            while self._cache:
                self.budget.release(self._cache.popitem()[1].nbytes)
