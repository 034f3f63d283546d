"""The rollback part of the window decision, alone (deltad.serve.windows.decide): which consumer
goes back, to which restore point, and when the log cannot restore the step."""

from __future__ import annotations

from dataclasses import replace

from deltad.serve.rollout import Rollback
from deltad.serve.state.offsets import StoredCursor
from deltad.serve.windows.decide import LogView, WindowAsk, decide_window

#: generation 3: base at seq 4 (step 40), deltas 5..8 at steps 50..80, 9 is seq 9 step 90
LOG = LogView(3, ((4, 40), (5, 50), (6, 60), (7, 70), (8, 80), (9, 90)), (0, 5, 6, 7, 8, 9))
#: the same log after a retention merge of seqs 6..8 into one entry
MERGED = LogView(3, ((4, 40), (5, 50), (8, 80), (9, 90)), (0, 5, 6, 9))

ORDER = Rollback(60, "*", 2)


def cur(seq: int, epoch: int = 0, generation: int = 3, owed: str = "") -> StoredCursor:
    return StoredCursor(generation, seq, seq * 10, owed_token=owed, rollback_epoch=epoch)


def test_a_cursor_past_the_step_goes_back_to_its_restore_point_in_place() -> None:
    d = decide_window(WindowAsk("c"), cur(8, owed="t"), LOG, rollback=ORDER)
    assert (d.resync, d.from_seq, d.to_seq, d.to_step) == (False, 8, 6, 60)
    assert d.rollback_to == 60 and d.rollback_epoch == 2 and d.owed_token == "t"
    assert d.reason == "rollback to step 60" and not d.refusal
    # max_step (the cap, or the client's alignment) does not move a rollback
    assert decide_window(WindowAsk("c", max_step=80), cur(8), LOG, rollback=ORDER).to_seq == 6


def test_a_step_between_two_segments_restores_the_newer_one_at_or_before_it() -> None:
    d = decide_window(WindowAsk("c"), cur(9), LOG, rollback=Rollback(65, "*", 1))
    assert (d.to_seq, d.to_step, d.rollback_to) == (6, 60, 65)


def test_an_order_is_followed_once() -> None:
    d = decide_window(WindowAsk("c"), cur(6, epoch=2), LOG, rollback=ORDER)
    assert d.rollback_to is None and (d.from_seq, d.to_seq) == (6, 9) and d.rollback_epoch == 2
    # a new order (a new epoch) at the same step is a new order
    d = decide_window(WindowAsk("c"), cur(8, epoch=2), LOG, rollback=replace(ORDER, epoch=3))
    assert d.rollback_to == 60 and d.rollback_epoch == 3


def test_a_consumer_at_or_before_the_step_is_not_moved_but_records_the_order() -> None:
    for stored in (cur(6), cur(5), None):
        d = decide_window(WindowAsk("c", max_step=60), stored, LOG, rollback=ORDER)
        assert d.rollback_to is None and d.rollback_epoch == 2 and d.to_step <= 60
    assert decide_window(WindowAsk("c"), cur(6), LOG).rollback_epoch == 0  # no order


def test_a_rollback_resyncs_to_the_step_when_the_cursor_state_is_not_in_the_log() -> None:
    # asked for the full tables (a restarted predictor)
    d = decide_window(WindowAsk("c", from_base=True), cur(8), LOG, rollback=ORDER)
    assert (d.resync, d.to_seq, d.to_step, d.rollback_to) == (True, 6, 60, 60)
    assert d.reason == "rollback to step 60: asked"
    # the cursor is inside a merged entry, or behind the base
    log = LogView(3, ((4, 40), (5, 50), (6, 60), (9, 90)), (0, 5, 6, 7))
    d = decide_window(WindowAsk("c"), cur(8), log, rollback=ORDER)
    assert d.resync and d.to_seq == 6 and d.rollback_to == 60 and "merged" in d.reason
    d = decide_window(WindowAsk("c"), StoredCursor(3, 2, 95), LOG, rollback=ORDER)
    assert d.resync and d.reason == "rollback to step 60: behind the base"


def test_a_step_the_log_cannot_restore_is_refused_with_the_reason() -> None:
    d = decide_window(WindowAsk("c"), cur(9), MERGED, rollback=Rollback(60, "*", 1))
    assert "inside merged segment seq 6..8" in d.refusal
    d = decide_window(WindowAsk("c"), cur(9), LOG, rollback=Rollback(30, "*", 1))
    assert "older than the log's base" in d.refusal
    # the end of a merged entry is still a restore point, and so is any step after it
    assert MERGED.restore_point(80) == (8, 80) and MERGED.restore_point(85) == (8, 80)
    assert MERGED.restore_point(50) == (5, 50)
    assert isinstance(MERGED.restore_point(55), str)


def test_a_cursor_of_an_older_generation_is_not_rolled_back_but_diffed() -> None:
    prev = LogView(2, ((0, 0), (3, 30), (9, 95)), (0, 1, 9))
    d = decide_window(WindowAsk("c"), cur(9, generation=2), LOG, prev, rollback=ORDER)
    assert d.rollback_to is None and d.diff_from == (2, 9) and d.rollback_epoch == 2
