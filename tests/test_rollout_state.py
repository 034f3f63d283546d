"""The release state's controls as pure changes (deltad.serve.rollout), its store in a real Redis
(deltad.serve.state.release) and the validation gate (deltad.serve.index.gate) on its own."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from serverkit import SpoolWriter
from spoolkit import FakeTrainer

from deltad.config import GateConfig
from deltad.errors import ConfigError, RolloutError, RolloutRefused
from deltad.segment.format import encode_dense, write_dense
from deltad.serve import rollout as ro
from deltad.serve.index.gate import SegmentGate, nonfinite
from deltad.serve.index.log import SegmentLog
from deltad.serve.rollout import Pin, ReleaseState, Rollback, cap_for, order_for
from deltad.serve.state.release import FollowedRollout, RolloutStore, RolloutView
from deltad.store import connect

pytestmark = pytest.mark.timeout(60)


def test_hold_caps_everyone_at_the_head_it_found_and_canaries_follow_the_head() -> None:
    s = ro.hold(ReleaseState(), head_step=40)
    assert (s.release_step, s.held) == (40, True)
    s = ro.canary(s, "pred-canary-*")
    assert cap_for(s, "pred-1").max_step == 40
    assert cap_for(s, "pred-canary-3").max_step is None
    assert ro.hold(s, head_step=99).release_step == 40  # a second hold keeps the step


def test_release_to_a_step_and_to_the_head() -> None:
    s = ro.hold(ReleaseState(), head_step=40)
    s = ro.release(s, 45, head_step=50, generation=1)
    assert (s.release_step, s.held) == (45, False)
    assert cap_for(s, "p").max_step == 45
    s = ro.release(s, None, head_step=50, generation=1)
    assert cap_for(s, "p").max_step is None


def test_release_past_the_head_or_below_zero_is_an_invalid_argument() -> None:
    with pytest.raises(RolloutError, match="past the head step 50"):
        ro.release(ReleaseState(), 51, head_step=50, generation=1)
    with pytest.raises(RolloutError, match=">= 0"):
        ro.pin(ReleaseState(), "p-*", -1, head_step=50)


def test_pin_keeps_a_glob_and_wins_over_a_canary_and_unpin_drops_it() -> None:
    s = ro.canary(ReleaseState(), "p-*")
    s = ro.pin(s, "p-1*", 30, head_step=50)
    s = ro.pin(s, "p-1*", 32, head_step=50)  # replaces the group's pin
    assert s.pins == (Pin("p-1*", 32),)
    assert cap_for(s, "p-12").max_step == 32
    assert cap_for(s, "p-2").max_step is None
    s = ro.unpin(s, "p-1*")
    assert cap_for(s, "p-12").max_step is None
    with pytest.raises(RolloutError, match="no pin of group"):
        ro.unpin(s, "p-1*")


@pytest.mark.parametrize("group", ["", "a b", "x" * 300, "tab\there"])
def test_a_bad_group_glob_is_refused(group: str) -> None:
    with pytest.raises(RolloutError, match="group must be"):
        ro.pin(ReleaseState(), group, 1, head_step=None)


def test_rollback_of_everyone_orders_and_caps_at_the_step_and_stops_canaries() -> None:
    s = ro.canary(ReleaseState(), "c-*")
    s = ro.rollback(s, 20, head_step=50)
    assert s.rollback == Rollback(20, "*", 1)
    assert (s.release_step, s.held, s.canary) == (20, True, ())
    cap = cap_for(s, "c-1")
    assert cap.max_step == 20 and cap.rollback == Rollback(20, "*", 1)
    s = ro.rollback(s, 20, head_step=50)
    assert s.rollback is not None and s.rollback.epoch == 2  # a new order


def test_rollback_of_a_group_pins_the_group_only() -> None:
    s = ro.rollback(ReleaseState(), 20, "g-*", head_step=50)
    assert s.pins == (Pin("g-*", 20),)
    assert cap_for(s, "g-1") == ro.Cap(20, Rollback(20, "g-*", 1))
    assert cap_for(s, "h-1") == ro.Cap(None, None)


def test_a_gate_failure_holds_at_the_good_step_and_release_past_it_needs_force() -> None:
    s = ro.gate_failed(ReleaseState(), generation=1, bad_step=30, good_step=28, reason="nan")
    assert (s.release_step, s.held, s.gate_good_step, s.gate_bad_step) == (28, True, 28, 30)
    s = ro.canary(s, "c-*")
    assert cap_for(s, "c-1").max_step == 28  # a canary never passes the gate
    with pytest.raises(RolloutRefused, match="step 30 failed the validation gate"):
        ro.release(s, None, head_step=40, generation=1)
    with pytest.raises(RolloutRefused):
        ro.release(s, 30, head_step=40, generation=1)
    below = ro.release(s, 29, head_step=40, generation=1)  # below the bad step: fine
    assert below.release_step == 29 and below.gate_bad_step == 30
    # reported again (another rank, a restart): no new hold
    assert ro.gate_failed(below, generation=1, bad_step=30, good_step=28, reason="x") == below
    forced = ro.release(s, None, head_step=40, generation=1, force=True)
    assert (forced.release_step, forced.held, forced.gate_accepted_step) == (None, False, 40)
    assert ro.gate_failed(forced, generation=1, bad_step=30, good_step=28, reason="x") == forced
    again = ro.gate_failed(forced, generation=1, bad_step=45, good_step=44, reason="inf")
    assert (again.release_step, again.held, again.gate_bad_step) == (44, True, 45)


def test_a_gate_failure_of_an_older_generation_does_not_refuse_a_release() -> None:
    s = ro.gate_failed(ReleaseState(), generation=1, bad_step=30, good_step=28, reason="nan")
    s = ro.release(s, None, head_step=10, generation=2)
    assert (s.release_step, s.held, s.gate_reason) == (None, False, "")
    assert not [line for line in ro.describe(s, generation=2) if line.startswith("gate:")]
    # its failed step stays recorded: a rank still serving generation 1 (its new base late)
    # keeps it out, whichever rank the release was sent to (review 12)
    assert (s.gate_bad_step, s.gate_generation) == (30, 1) and ro.gate_open(s, 1) == 30


def test_a_hold_the_gate_set_in_an_earlier_generation_says_so() -> None:
    """Review 10: after a NaN incident and a trainer restart, status still said "step 480
    failed ...; holding at step 470" as if of this one. Issue 39: the hold names a state
    (generation 1, step 495), so the new generation is served to nobody held (cap NOTHING)
    until a release names it, and status says so."""
    s = ro.gate_failed(ReleaseState(), generation=1, bad_step=480, good_step=470, reason="nan")
    s = ro.release(s, None, head_step=490, generation=1, force=True)
    s = ro.gate_failed(s, generation=1, bad_step=500, good_step=495, reason="nan again")
    assert (s.release_step, s.release_generation) == (495, 1)
    lines = ro.describe(s, generation=2)
    assert lines[0] == "release: step 495 of generation 1, held (version 0)", lines
    assert any("failed in an earlier generation (1; 2 is served now)" in x for x in lines), lines
    assert any(
        "generation 2, served now, is not released" in x and "keep generation 1 step 495" in x
        for x in lines
    ), lines
    assert any("up to step 490 of generation 1" in x for x in lines), lines
    assert cap_for(s, "p", 1).max_step == 495
    assert cap_for(s, "p", 2).max_step == ro.NOTHING  # nothing of generation 2 (issue 39)
    assert "is held at generation 1 step 495" in cap_for(s, "p", 2).reasons[0]
    assert ro.gate_open(s, 2) is None
    released = ro.release(s, None, head_step=600, generation=2)  # no force needed
    assert released.release_step is None and not released.held
    assert cap_for(released, "p", 2).max_step is None
    assert not [x for x in ro.describe(released, generation=2) if x.startswith("gate:")]
    # of the generation served, as before
    assert any("holding the fleet at step 495" in x for x in ro.describe(s, generation=1))


def test_the_state_round_trips_through_json() -> None:
    s = ReleaseState(
        release_step=3, held=True, gate_reason="r", gate_good_step=2, pins=(Pin("a*", 1),),
        canary=("c*",), rollbacks=(Rollback(2, "b*", 3), Rollback(1, "a*", 4)),
        last_rollback_epoch=6, version=7, gate_bad_step=3, gate_generation=2,
        gate_accepted_step=None,
    )  # fmt: skip
    assert ReleaseState.from_json(s.to_json()) == s
    assert any("pin: a* at step 1" in line for line in ro.describe(s))
    assert [line for line in ro.describe(s) if line.startswith("rollback:")] == [
        "rollback: b* to step 2 (order 3)",
        "rollback: a* to step 1 (order 4)",
    ]


def test_a_state_written_with_one_rollback_order_reads_as_that_order() -> None:
    old = '{"release_step":5,"held":true,"rollback":[5,"*",2],"version":3}'
    s = ReleaseState.from_json(old)
    assert s.rollbacks == (Rollback(5, "*", 2),) and s.rollback == Rollback(5, "*", 2)
    # and a reader of the one order finds the newest in what is written now
    two = ro.rollback(ro.rollback(ReleaseState(), 9, "a-*", head_step=20), 8, "b-*", head_step=20)
    assert json.loads(two.to_json())["rollback"] == [8, "b-*", 2]


def test_an_order_for_another_group_does_not_cancel_an_order_not_yet_followed() -> None:
    # review 4 (stop 34) #1: a predictor away during "main to 150" and "canary to 120"
    # came back to a state with only the canary order and was never rolled back
    s = ro.rollback(ReleaseState(), 150, "pred-main-*", head_step=200)
    s = ro.rollback(s, 120, "pred-canary-*", head_step=200)
    assert cap_for(s, "pred-main-1") == ro.Cap(150, Rollback(150, "pred-main-*", 1))
    assert cap_for(s, "pred-canary-1") == ro.Cap(120, Rollback(120, "pred-canary-*", 2))
    assert cap_for(s, "other").rollback is None
    # a newer order naming a consumer replaces the older one for it (the newest wins) ...
    s = ro.rollback(s, 100, "pred-*", head_step=200)
    assert order_for(s, "pred-main-1") == Rollback(100, "pred-*", 3)
    assert len(s.rollbacks) == 3  # the older ones still name consumers "pred-*" does not
    # ... a new order of the same group replaces its older one, one of "*" every order
    s = ro.rollback(s, 90, "pred-main-*", head_step=200)
    assert [r.group for r in s.rollbacks] == ["pred-canary-*", "pred-*", "pred-main-*"]
    s = ro.rollback(s, 80, head_step=200)
    assert s.rollbacks == (Rollback(80, "*", 5),)


def test_orders_end_with_a_release_to_the_head_or_the_unpin_of_their_group() -> None:
    s = ro.rollback(ReleaseState(), 150, "g-*", head_step=200)
    s = ro.rollback(s, 140, head_step=200)
    assert s.pins == ()  # a pin past a rollback of everyone would take g-* forward again
    s = ro.rollback(s, 130, "h-*", head_step=200)
    s = ro.release(s, 145, head_step=200, generation=1)  # to a step: orders stay
    assert [r.group for r in s.rollbacks] == ["*", "h-*"]
    s = ro.release(s, None, head_step=200, generation=1)  # to the head: "*" orders end
    assert [r.group for r in s.rollbacks] == ["h-*"]
    s = ro.unpin(s, "h-*")
    assert s.rollbacks == () and s.pins == ()


def test_an_order_after_its_predecessors_ended_gets_a_new_epoch() -> None:
    """Review 6 (stop 34) #2: cursors record the highest epoch they followed; an epoch given
    again after a release to the head (or an unpin) ended the orders looked followed already,
    and predictors stayed past the new order's step."""
    s = ro.rollback(ReleaseState(), 20, head_step=50)
    assert s.rollback == Rollback(20, "*", 1)
    s = ro.release(s, None, head_step=50, generation=1)
    assert s.rollbacks == () and s.last_rollback_epoch == 1
    s = ro.rollback(s, 30, head_step=50)
    assert s.rollback == Rollback(30, "*", 2)
    s = ro.rollback(s, 10, "g-*", head_step=50)
    s = ro.unpin(s, "g-*")
    assert ro.rollback(s, 10, "g-*", head_step=50).rollback == Rollback(10, "g-*", 4)
    # and through the stored form, from a state written before the counter
    old = ReleaseState.from_json(
        '{"release_step":null,"held":false,"rollback":[5,"*",7],"version":9}'
    )
    assert ro.rollback(
        ro.release(old, None, head_step=9, generation=1), 5, head_step=9
    ).rollback == (Rollback(5, "*", 8))


def test_a_group_recorded_before_the_glob_check_can_still_be_removed() -> None:
    """Review 6 (stop 34) #3: a pin or canary of a glob no name can match (recorded before
    the check) must not be stuck in the state, keeping its step in every log."""
    s = ReleaseState(pins=(Pin("team/a*", 5),), canary=("x:y",))
    assert ro.unpin(s, "team/a*").pins == ()
    assert ro.canary(s, "x:y", on=False).canary == ()
    with pytest.raises(RolloutError, match="can match no consumer"):
        ro.pin(s, "team/b*", 5, head_step=None)


def test_the_redacted_state_keeps_the_order_for_every_consumer_for_old_readers() -> None:
    """Review 6 (stop 34) #4: with orders [* to 20, can-* to 30], a reader that knows only
    "rollback" (a relay before "rollbacks") saw none in the redacted state."""
    s = ro.rollback(ReleaseState(), 20, head_step=50)
    s = ro.rollback(s, 30, "can-*", head_step=50, force=True)  # (forward: forced)
    d = json.loads(ro.redacted_json(s.to_json()))
    assert d["rollback"] == [20, "*", 1] and d["rollbacks"] == [[20, "*", 1]]
    assert ReleaseState.from_json(ro.redacted_json(s.to_json())).rollbacks == (
        Rollback(20, "*", 1),
    )
    # written before "rollbacks": as it was
    old = '{"release_step":null,"held":false,"rollback":[4,"g-*",2],"version":3}'
    assert json.loads(ro.redacted_json(old))["rollback"] is None


def test_rollback_orders_of_distinct_groups_are_bounded() -> None:
    s = ReleaseState()
    for i in range(ro.MAX_ROLLBACKS):
        s = ro.rollback(s, 10, f"g{i}-*", head_step=20)
    with pytest.raises(RolloutRefused, match="rollback orders of other groups are in force"):
        ro.rollback(s, 10, "one-more-*", head_step=20)
    assert ro.rollback(s, 10, "g0-*", head_step=20).rollbacks[-1].group == "g0-*"  # a renewal
    assert len(ro.rollback(s, 10, head_step=20).rollbacks) == 1


@pytest.mark.parametrize(
    ("group", "message"),
    [
        ("pred-\u00e9*", "can match no consumer"),
        ("pred/*", "can match no consumer"),
        ("pred-[", "opens a '\\[' it never closes"),
        ("pred-[ab", "opens a '\\[' it never closes"),
        ("pred-!x", "'!' outside"),
        ("pred-]", "']' outside"),
        ("a[]b", "opens a '\\[' it never closes"),  # (fnmatch: "]" first is a member)
        ("pred-[!]", "opens a '\\[' it never closes"),
        ("pred-[]]", "is not a set of name characters"),
        ("pred-[9-0]*", "is not a set of name characters"),  # (a reversed range: empty)
        ("pred-[!A-Za-z0-9_.-]*", "is not a set of name characters"),  # (every name char)
        ("pred-[*]", "is not a set of name characters"),
    ],
)
def test_a_glob_that_can_match_no_consumer_name_is_refused(group: str, message: str) -> None:
    with pytest.raises(RolloutError, match=message):
        ro.rollback(ReleaseState(), 1, group, head_step=5)


@pytest.mark.parametrize(
    "group",
    ["*", "pred-*", "p?ed-[0-9]*", "pred-[!c]*", "a.b_c-d", "x[]a]*", "x[!]a]*", "p[a-]*", "p[-9]"],
)
def test_globs_that_can_match_names_are_taken(group: str) -> None:
    assert ro.pin(ReleaseState(), group, 1, head_step=5).pins[0].group == group


def test_the_store_is_atomic_under_concurrent_writers(redis_url: str) -> None:
    store = RolloutStore(connect(redis_url), "m")
    assert store.get() == ReleaseState()

    def add(i: int) -> None:
        for j in range(10):
            store.update(lambda s, g=f"g{i}-{j}": ro.canary(s, g))

    threads = [threading.Thread(target=add, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = store.get()
    assert len(s.canary) == 40 and s.version == 40
    # an unchanged state is not written
    assert store.update(lambda s: s).version == 40
    # a refused change writes nothing
    with pytest.raises(RolloutError):
        store.update(lambda s: ro.unpin(s, "nope"))
    assert store.get().version == 40
    # a second store (another process, a restart) reads the same state
    assert RolloutStore(connect(redis_url), "m").get() == s
    assert RolloutStore(connect(redis_url), "other").get() == ReleaseState()


def test_the_view_rereads_after_its_ttl(redis_url: str) -> None:
    store = RolloutStore(connect(redis_url), "m")
    view = RolloutView(store, ttl_s=0.0)
    assert view.state().held is False
    store.update(lambda s: ro.hold(s, head_step=5))
    assert view.state().release_step == 5


def test_a_relay_follows_the_upstream_state_and_ignores_a_malformed_one() -> None:
    f = FollowedRollout()
    f.follow(ro.hold(ReleaseState(), head_step=3).to_json())
    assert f.state().release_step == 3
    f.follow("{not json")
    assert f.state().release_step == 3
    f.follow("")
    assert f.state() == ReleaseState()


def test_gate_limits_parse_from_flags() -> None:
    limits = GateConfig.parse(["t0=2.5", "0.1"], "gate-max-norm-jump")
    assert limits == (("t0", 2.5), ("*", 0.1))
    assert GateConfig.limit(limits, "t0") == 2.5 and GateConfig.limit(limits, "t9") == 0.1
    with pytest.raises(ConfigError, match=r"\[TABLE=\]NUMBER"):
        GateConfig.parse(["t0=x"], "gate-max-norm-jump")
    with pytest.raises(ConfigError, match="fraction in"):
        GateConfig(max_changed_fraction=(("*", 2.0),))


def test_nonfinite_counts_nan_and_inf_only_in_float_tensors() -> None:
    t = torch.zeros(4, 3)
    assert nonfinite(t) == 0
    t[1, 2], t[3, 0] = float("nan"), float("-inf")
    assert nonfinite(t) == 2
    assert nonfinite(t.half()) == 2
    assert nonfinite(torch.arange(4)) == 0


def _log(tmp_path: Path, gate: SegmentGate) -> tuple[FakeTrainer, SegmentLog]:
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    return ft, SegmentLog(ft.layout, 0, gate=gate)


def test_the_gate_fails_a_nan_segment_and_caps_below_it(tmp_path: Path) -> None:
    seen = []
    gate = SegmentGate(on_fail=seen.append)
    ft, log = _log(tmp_path, gate)
    ft.step(1)
    ft.step(2, poison=float("nan"))
    ft.step(3)
    log.refresh()
    assert [f.step for f in seen] == [2]
    assert seen[0].good_step == 1 and "t0: 1 non-finite values" in seen[0].reason
    assert gate.cap(1, None) == 1
    assert gate.cap(1, 2) is None  # released past by an operator
    log.refresh()
    assert len(seen) == 1  # checked once
    assert gate.checks == 4


def test_the_gate_norm_and_fraction_limits(tmp_path: Path) -> None:
    cfg = GateConfig(max_norm_jump=(("t0", 100.0),), max_changed_fraction=(("t1", 0.5),))
    seen = []
    gate = SegmentGate(cfg, on_fail=seen.append)
    ft, log = _log(tmp_path, gate)
    ft.step(1)
    ft.step(2, poison=1e6)  # finite, but a huge jump in row norm
    log.refresh()
    assert [f.step for f in seen] == [2] and "row norm jumped" in seen[0].reason
    ft.step(3, touch=30)  # 30 of t1's 40 rows
    log.refresh()
    assert [f.step for f in seen] == [2, 3] and "of its rows changed" in seen[1].reason


def test_a_gate_limit_naming_no_table_is_warned_about_once_per_generation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A typo in ``--gate-max-norm-jump TABLE=...`` would turn that limit off unseen: the log
    says so once the generation's tables are known (a sidecar may start before its trainer)."""
    cfg = GateConfig(
        max_norm_jump=(("nosuchtable", 3.0), ("t0", 100.0), ("*", 1e9)),
        max_changed_fraction=(("t1", 0.5), ("t9", 0.5)),
    )
    gate = SegmentGate(cfg)
    ft, log = _log(tmp_path, gate)
    with caplog.at_level("WARNING", logger="deltad.serve.index.gate"):
        ft.step(1)
        log.refresh()
        ft.step(2)
        log.refresh()
    lines = [r.getMessage() for r in caplog.records if "checks nothing" in r.getMessage()]
    assert len(lines) == 2, lines  # once each, not per refresh; "t0", "t1" and "*" are fine
    assert "--gate-max-norm-jump nosuchtable=" in lines[0] and "t0, t1" in lines[0]
    assert "--gate-max-changed-fraction t9=" in lines[1]


def test_the_gate_fails_a_dense_state_with_nan_and_holds_before_its_step(tmp_path: Path) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    seen = []
    gate = SegmentGate(on_fail=seen.append)
    log = SegmentLog(spool.layout, 0, gate=gate)
    spool.delta()  # step 10

    def dense(w: torch.Tensor) -> None:
        data = encode_dense(
            model=spool.layout.model, generation=1, rank=0, seq=spool.seq, step=spool.step,
            tensors={"w": w, "n": torch.tensor(3)},
        )  # fmt: skip
        write_dense(spool.layout.dense_path(1, 0, spool.seq), data, fsync=False)

    dense(torch.ones(4))
    spool.delta()  # step 20
    dense(torch.tensor([1.0, float("nan"), 2.0, float("inf")]))
    log.refresh()
    assert [(f.step, f.good_step) for f in seen] == [(20, 10)]
    assert "dense state: 2 non-finite values in w" in seen[0].reason
    assert gate.cap(1, None) == 19


def test_an_asked_resync_of_a_cursor_past_the_cap_goes_to_the_cursor_not_the_head() -> None:
    from deltad.serve.state.offsets import StoredCursor
    from deltad.serve.windows.caps import within_cap
    from deltad.serve.windows.decide import LogView, WindowAsk, decide_window

    log = LogView(1, ((0, 0), (1, 10), (2, 20), (3, 30), (4, 40)))
    cursor = StoredCursor(generation=1, seq=2, step=20, pull_id="x")
    d = decide_window(WindowAsk("p", from_base=True, max_step=10), cursor, log)
    assert (d.to_seq, d.to_step) == (4, 40)  # the head: decide_window knows no cap
    capped = within_cap(d, cursor, log, 10)
    assert capped.resync and (capped.to_seq, capped.to_step) == (2, 20)
    assert within_cap(d, cursor, log, None) == d
    ordinary = decide_window(WindowAsk("p", max_step=10), cursor, log)
    assert within_cap(ordinary, cursor, log, 10) == ordinary  # empty, at the cursor


def test_a_window_past_the_cap_is_told_apart_from_a_cursor_already_past_it() -> None:
    from deltad.serve.state.offsets import StoredCursor
    from deltad.serve.windows.caps import past_cap
    from deltad.serve.windows.decide import LogView, WindowAsk, decide_window

    log = LogView(1, ((3, 30), (4, 40)))  # the base merged forward to step 30
    fresh = decide_window(WindowAsk("p", max_step=10), None, log)
    assert (fresh.to_seq, fresh.to_step) == (3, 30) and past_cap(fresh, None, log, 10)
    cursor = StoredCursor(generation=1, seq=4, step=40, pull_id="x")
    held = decide_window(WindowAsk("p", max_step=10), cursor, log)
    assert not past_cap(held, cursor, log, 10)  # an empty window at its cursor
    assert not past_cap(fresh, None, log, None) and not past_cap(fresh, None, log, 30)
    # a consumer at the cap whose state the log lost (its relay re-based past it: review 9,
    # stop 34, #2) was served the base past the cap; it is refused now
    below = StoredCursor(generation=1, seq=2, step=20, pull_id="x")
    lost = decide_window(WindowAsk("p", max_step=25), below, log)
    assert lost.resync and lost.to_step == 30 and past_cap(lost, below, log, 25)


def test_a_relay_told_a_redacted_state_says_so_once_and_follows_the_release_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A relay whose upstream credential has no relay role gets the state without its pins
    and canary groups (deltad.serve.edge.gate): it follows what it gets and says why its
    consumers see no pins."""
    full = ReleaseState(release_step=7, held=True, pins=(Pin("eu-*", 5),), canary=("c-*",))
    follow = FollowedRollout()
    with caplog.at_level("WARNING", logger="deltad.serve.state.release"):
        for _ in range(3):
            follow.follow(ro.redacted_json(full.to_json()))
    said = [r.getMessage() for r in caplog.records if "hides" in r.getMessage()]
    assert len(said) == 1 and "no relay role" in said[0]
    got = follow.state()
    assert (got.release_step, got.held, got.pins, got.canary) == (7, True, (), ())
    caplog.clear()
    with caplog.at_level("WARNING", logger="deltad.serve.state.release"):
        FollowedRollout().follow(full.to_json())
    assert not [r for r in caplog.records if "hides" in r.getMessage()]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ('{"release_step":"200","held":true}', "release_step"),
        ('{"release_step":-3}', "release_step"),
        ('{"held":"yes"}', "held"),
        ('{"pins":[["pred-*",-5]]}', "pins\\[0\\] step"),
        ('{"pins":[[5,"pred-*"]]}', "pins\\[0\\] group"),
        ('{"rollbacks":[[20,"*"]]}', "rollbacks must be a list of"),
        ('{"rollbacks":[[1.5,"*",1]]}', "rollbacks\\[0\\] step"),
        ('{"canary":"c-*"}', "canary must be a list"),
        ('{"version":true}', "version"),
        ("[1,2]", "not a JSON object"),
    ],
)
def test_a_state_no_control_could_have_written_is_refused_naming_the_field(
    raw: str, field: str, tmp_path: Path
) -> None:
    """Review 7 (stop 34) #3: a hand-edited relay state file with a string step was taken,
    then broke every Status and retention round; a negative pin was taken as it was. Such a
    state is refused (ValueError naming the field); a relay reading it from its spool treats
    it as never heard (it serves nothing until its upstream answers)."""
    with pytest.raises(ValueError, match=field):
        ReleaseState.from_json(raw)
    kept = tmp_path / "release-state-rank0.json"
    kept.write_text(raw)
    assert not FollowedRollout(kept).known
    f = FollowedRollout(None)
    f.follow(raw)  # (from an upstream: ignored, logged)
    assert not f.known


def test_a_malformed_state_in_redis_is_an_offset_store_error_naming_the_key(
    redis_url: str,
) -> None:
    import redis as redis_py

    from deltad.errors import OffsetStoreError

    client = redis_py.Redis.from_url(redis_url)
    store = RolloutStore(client, "m")
    client.set(store.key, '{"release_step":"x"}')
    with pytest.raises(OffsetStoreError, match=r"release state in Redis .* is malformed"):
        store.get()
    view = RolloutView(store, ttl_s=0.0)
    # nothing read yet: not known (review 8, stop 34, #10: it counted as everything released)
    assert not view.known and "is malformed" in view.unknown_reason
    # ... and its Status says so: relays keep their state (review 9: they took "released")
    shown = json.loads(view.state_json())
    assert shown["unknown"] and "unreadable in Redis" in shown["why"]
    follow = FollowedRollout(None)
    follow.follow(ReleaseState(release_step=9, held=True, version=4).to_json())
    follow.follow(view.state_json())
    assert follow.known and follow.state().release_step == 9
    client.set(store.key, ReleaseState(release_step=3, held=True, version=1).to_json())
    assert view.known and view.state().release_step == 3
    client.set(store.key, '{"release_step":"x"}')
    assert view.known and view.state().release_step == 3  # the last state read stays


def test_a_sidecar_that_cannot_read_the_release_state_serves_nothing(
    tmp_path: Path, redis_url: str
) -> None:
    import grpc
    import redis as redis_py
    from serverkit import server_config
    from spoolkit import wait_for

    from deltad.serve.edge.app import SidecarServer
    from deltad.v1 import delta_pb2 as pb
    from deltad.v1 import delta_pb2_grpc as pb_grpc

    SpoolWriter(tmp_path / "spool").delta()
    client = redis_py.Redis.from_url(redis_url)
    client.set(RolloutStore(client, "m").key, '{"pins":[["p-*",-5]]}')
    srv = SidecarServer(server_config(tmp_path / "spool", redis_url)).start()
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            stub = pb_grpc.DeltaServiceStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.GetDelta(pb.GetDeltaRequest(consumer="c", form=pb.FORM_ROWS), timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            why = e.value.details() or ""
            assert "nothing is served until the release state is read" in why
            assert "pins[0] step must be an integer in 0.." in why
            client.delete(RolloutStore(client, "m").key)  # an operator removes it
            req = pb.GetDeltaRequest(consumer="c", form=pb.FORM_ROWS)

            def served() -> bool:
                try:
                    return bool(list(stub.GetDelta(req, timeout=10)))
                except grpc.RpcError:
                    return False

            wait_for(served, 10, "served once the state is gone")
    finally:
        srv.stop(0)


def test_a_gate_failure_of_the_base_is_a_state_the_parser_takes() -> None:
    """Review 8 (stop 34) #1: a base that fails the gate holds at step -1 (nothing good);
    the strict parser refused that state, and every control and reader failed after it."""
    s = ro.gate_failed(ReleaseState(), generation=1, bad_step=0, good_step=-1, reason="nan")
    assert (s.release_step, s.gate_good_step) == (-1, -1)
    assert ReleaseState.from_json(s.to_json()) == s


def test_a_group_rollback_wins_over_an_older_pin_of_a_narrower_group() -> None:
    """Review 8 (stop 34) #5: pred-main-* pinned at 50, then pred-* rolled back to 30: the
    older, narrower pin matched first and took pred-main consumers forward to 50 again."""
    s = ro.pin(ReleaseState(), "pred-main-*", 50, head_step=60)
    s = ro.rollback(s, 30, "pred-*", head_step=60)
    assert cap_for(s, "pred-main-1") == ro.Cap(30, Rollback(30, "pred-*", 1))
    assert cap_for(s, "pred-other-1").max_step == 30
    assert cap_for(ro.unpin(s, "pred-*"), "pred-main-1").max_step == 50  # its own pin again
