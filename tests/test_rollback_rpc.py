"""A rollback ordered the way an operator orders it, `deltad rollout rollback --to-step S` (the
admin Rollout RPC, the model's release state in Redis), and the data path following it: 2 ranks
behind relays go back bit-exact, woken by the order; a step the log cannot restore is refused
with the reason before anything is recorded. Real sidecars and relays on port 0, real Redis."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from serverkit import server_config
from spoolkit import FakeTrainer, wait_for
from test_gendiff import assert_exact_diff
from test_relay import at_step, equal, predictor
from test_rollback import SHAPES, Release, relay_of, sidecars, trained

from deltad.consume.appliers import TensorDictApplier
from deltad.serve.edge.app import SidecarServer
from deltad.serve.relay.server import RelayServer
from deltad.serve.state.release import RolloutStore

pytestmark = pytest.mark.timeout(180)


@contextlib.contextmanager
def merging_rank(
    tmp_path: Path, redis_url: str, steps: range = range(5, 45, 5)
) -> Iterator[SidecarServer]:
    """One rank's trainer that published ``steps`` (10 rows each, seq 1 on) and its sidecar,
    which merges whatever no one holds (no restore window, two segments make a merge),
    started and at the head."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1, tables=SHAPES)
    ft.start(0)
    for step in steps:
        ft.step(step, touch=10)
    with sidecars(tmp_path / "spool", redis_url, 1, Release(redis_url), restore_window_steps=0,
                  merge_min_segments=2) as servers:  # fmt: skip
        srv = servers[0]
        wait_for(lambda: at_step([srv.endpoint], steps[-1]), 30, "the head")
        yield srv


def merge_all(srv: SidecarServer) -> None:
    """Run retention rounds until one merges nothing (bounded)."""
    for _ in range(50):
        if not srv.retain():
            break


def test_a_rollback_ordered_with_deltad_rollout_moves_two_ranks_back_bit_exact_through_relays(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`deltad rollout rollback --to-step 20` sent to rank 0's sidecar: the order lands in
    Redis; both sidecars and both relays (which follow their upstream's Status) apply it; the
    predictor's long poll on the relays wakes for it; one pull takes both ranks from step 40
    back to exactly the trainer's tables at 20 with only the rows that differ, in place; it
    stays there while the trainer moves on, until `deltad rollout release`."""
    from deltad.commands.main import main

    ft = FakeTrainer(tmp_path / "spool", world_size=2, tables=SHAPES)
    ft.start(0)
    watch = Release(redis_url)  # (only to wait until every server applies a change)
    relays: list[RelayServer] = []
    with sidecars(tmp_path / "spool", redis_url, 2, watch) as servers:
        try:
            for r, s in enumerate(servers):
                relays.append(relay_of(s.endpoint, tmp_path / f"relay-{r}", r, redis_url, watch))
            reps = [x.endpoint for x in relays]
            for step in (10, 20, 30, 40):  # the relays mirror each step as it comes
                ft.step(step, touch=25)
                wait_for(lambda s=step: at_step(reps, s), 30, f"relays at step {step}")  # type: ignore[misc]
            with predictor("pred-1", reps) as c:
                applier = TensorDictApplier()
                assert c.sync(applier.apply).step == 40
                held = {n: t.clone() for n, t in applier.tables().items()}

                code = main(
                    ["rollout", "rollback", "--to-step", "20", "--target", servers[0].endpoint]
                )
                out = capsys.readouterr()
                assert code == 0, out.err
                assert "rollback of * to step 20 ordered" in out.out
                state = RolloutStore(servers[0].store.client, servers[0].config.model).get()
                assert state.rollback is not None and state.rollback.to_step == 20
                assert state.release_step == 20 and state.held

                assert c.wait_for_new(20.0)  # the order woke the long poll
                wait_for(
                    lambda: all(s.rollout.state().version >= state.version for s in watch.servers),
                    30,
                    "every sidecar and relay applying the order",
                )
                r = c.sync(applier.apply)
                assert r.step == 20 and r.rollback_to == 20 and r.rolled_back
                assert not r.resync and not r.generation_diff
                assert_exact_diff(held, ft.history[20], r.deltas)
                assert equal(applier, ft.history[20])
                assert [cur.step for cur in c.cursors if cur is not None] == [20, 20]
                ft.step(50, touch=25)
                wait_for(lambda: at_step(reps, 50), 30, "relays at step 50")
                assert c.sync(applier.apply).step == 20  # capped at the order's step

                assert main(["rollout", "release", "--target", servers[1].endpoint]) == 0
                capsys.readouterr()
                released = RolloutStore(servers[0].store.client, "m").get()
                wait_for(
                    lambda: all(
                        s.rollout.state().version >= released.version for s in watch.servers
                    ),
                    30,
                    "every server applying the release",
                )
                r = c.sync(applier.apply)
                assert r.step == 50 and not r.rolled_back and equal(applier, ft.history[50])
        finally:
            for x in relays:
                x.stop(0)


def test_a_rollback_to_a_step_the_log_cannot_restore_is_refused_with_the_reason(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A restore window of 25 steps, retention run: `deltad rollout status` shows the
    restorable steps; a rollback to step 5 (merged into the base) exits 2 with one line
    giving INVALID_ARGUMENT and the reason, and records nothing; step 10 is accepted."""
    from deltad.commands.main import main

    ft = FakeTrainer(tmp_path / "spool", world_size=1, tables=SHAPES)
    ft.start(0)
    for step in range(5, 45, 5):
        ft.step(step, touch=10)
    srv = SidecarServer(
        server_config(tmp_path / "spool", redis_url, merge_min_segments=2,
                      restore_window_steps=25)
    ).start()  # fmt: skip
    try:
        wait_for(lambda: at_step([srv.endpoint], 40), 30, "the head")
        for _ in range(50):
            if not srv.retention.run_once():
                break
        assert main(["rollout", "status", "--target", srv.endpoint]) == 0
        assert "restorable: steps 10..40" in capsys.readouterr().out
        code = main(["rollout", "rollback", "--to-step", "5", "--target", srv.endpoint])
        # the sidecar runs in this process: its own log lines (e.g. a slow Redis read on a
        # loaded machine) share stderr; the command's own output is one line
        err = "\n".join(
            ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("deltad rollout")
        )
        assert code == 2 and len(err.strip().splitlines()) == 1
        assert "INVALID_ARGUMENT" in err and "older than the log's base" in err
        store = RolloutStore(srv.store.client, "m")
        assert store.get().rollback is None
        assert main(["rollout", "rollback", "--to-step", "10", "--target", srv.endpoint]) == 0
        order = store.get().rollback
        assert order is not None and order.to_step == 10
    finally:
        srv.stop(0)


def test_a_rollback_to_an_unpublished_step_records_the_published_one_and_says_how_many_match(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review 4 (stop 34) #5 and #7: steps are published every 10; a rollback to step 25 is
    recorded as step 20 (the state at 25 is the state at 20) and the answer says so, rather
    than "to step 25" while predictors land on 20; a pin at 35 is recorded at 30 likewise. Every
    answer naming a group says how many known consumers it matches, and a glob that matches
    none says so (a typo); a glob that can match no consumer name at all is refused."""
    from deltad.commands.main import main

    ft = trained(tmp_path)
    watch = Release(redis_url)
    with sidecars(tmp_path / "spool", redis_url, 2, watch) as servers:
        eps = [s.endpoint for s in servers]
        wait_for(lambda: at_step(eps, 40), 30, "the head")
        with predictor("pred-main-1", eps) as c, predictor("pred-main-2", eps) as d:
            applier, other = TensorDictApplier(), TensorDictApplier()
            assert c.sync(applier.apply).step == 40 and d.sync(other.apply).step == 40
            target = ["--target", eps[0]]
            capsys.readouterr()
            assert main(["rollout", "rollback", "--to-step", "25", "--group", "pred-main-*",
                         *target]) == 0  # fmt: skip
            out = capsys.readouterr().out
            assert "rollback of pred-main-* to step 20 ordered" in out, out
            assert "step 25 was not published: its state is that of step 20" in out
            assert "pred-main-* matches 2 of the 2 consumers of this sidecar" in out
            state = RolloutStore(servers[0].store.client, "m").get()
            assert state.rollback is not None and state.rollback.to_step == 20
            wait_for(
                lambda: all(s.rollout.state().version >= state.version for s in servers),
                30,
                "both sidecars at the order",
            )
            r = c.sync(applier.apply)
            assert (r.step, r.rollback_to) == (20, 20) and equal(applier, ft.history[20])
            assert main(["rollout", "pin", "--group", "prod-mian-*", "--step", "35",
                         *target]) == 0  # fmt: skip
            out = capsys.readouterr().out
            assert "pinned prod-mian-* at step 30 (step 35 was not published" in out
            pins = RolloutStore(servers[0].store.client, "m").get().pins
            assert [(p.group, p.step) for p in pins if p.group == "prod-mian-*"] == [
                ("prod-mian-*", 30)
            ]
            assert "prod-mian-* matches none of the 2 consumers of this sidecar" in out
            assert "(a typo?)" in out
            code = main(["rollout", "canary", "--group", "pred-\u00e9*", *target])
            err = capsys.readouterr().err
            assert code == 2 and "can match no consumer" in err, err


def test_answers_say_what_a_release_leaves_pinned_and_when_an_order_moves_a_group_forward(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review 7 (stop 34) #4 and #7: `release` to the head answered "released to the head"
    while every pinned group stayed where it was; a group's "rollback" to a step past its
    pin moved it forward without a word. Both answers now say so."""
    from deltad.commands.main import main

    trained(tmp_path)
    watch = Release(redis_url)
    with sidecars(tmp_path / "spool", redis_url, 2, watch) as servers:
        target = ["--target", servers[0].endpoint]
        wait_for(lambda: at_step([s.endpoint for s in servers], 40), 30, "the head")
        assert main(["rollout", "pin", "--group", "g-*", "--step", "20", *target]) == 0
        capsys.readouterr()
        assert main(["rollout", "release", *target]) == 0
        out = capsys.readouterr().out
        assert (
            "released to the head; still pinned (unpin --group G to release them): g-* at step 20"
            in out
        )
        # (issue 37: a rollback that moves its group FORWARD is refused without --force)
        rollback = ["rollout", "rollback", "--group", "g-*", "--to-step", "30", *target]
        assert main(rollback) == 2
        err = capsys.readouterr().err
        assert "g-* is pinned at step 20: a rollback to step 30 would move it FORWARD" in err
        assert "rollback --force" in err and len(err.strip().splitlines()) == 1
        assert main([*rollback, "--force"]) == 0
        out = capsys.readouterr().out
        assert (
            "(forced: g-* is pinned at step 20: a rollback to step 30 would move it FORWARD)" in out
        )
        assert main(["rollout", "rollback", "--group", "h-*", "--to-step", "30", *target]) == 0
        assert "FORWARD" not in capsys.readouterr().out


def test_a_pin_or_release_inside_a_merged_segment_is_refused(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review 8 (stop 34) #8: a pin at a step inside a merged segment was recorded as asked,
    and new consumers were served the entry before it, silently. It is refused, naming the
    segment."""
    from deltad.commands.main import main

    with merging_rank(tmp_path, redis_url) as srv:
        assert (
            main(["rollout", "pin", "--group", "old-*", "--step", "10", "--target", srv.endpoint])
            == 0
        )
        wait_for(lambda: bool(srv.rollout.state().pins), 10, "the pin applied")
        for _ in range(50):
            if not srv.retention.run_once():
                break
        snap = srv.log.snapshot()
        assert snap is not None and [e.step for e in snap.entries] == [10, 40]
        capsys.readouterr()
        for argv in (["pin", "--group", "new-*", "--step", "25"], ["release", "--to-step", "25"]):
            assert main(["rollout", *argv, "--target", srv.endpoint]) == 2
            err = capsys.readouterr().err
            assert "step 25 is not a state this log holds" in err and "inside merged" in err, err


def test_a_control_to_a_step_another_rank_merged_away_is_refused(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review 10: with no restore window each rank merges on its own; a rollback sent to rank 0
    to a step rank 1 had merged away was ordered (exit 0), and every predictor then failed
    every pull on rank 1 (UNAVAILABLE) until a release. Each rank keeps its restore points in
    its registry entry (again after every merge), and a rollback, pin or release to a step
    another rank no longer holds is refused with that rank's reason, recording nothing."""
    from deltad.commands.main import main

    ft = trained(tmp_path)  # 2 ranks, steps 10..40
    watch = Release(redis_url)
    with sidecars(tmp_path / "spool", redis_url, 2, watch, restore_window_steps=0,
                  merge_min_segments=2) as servers:  # fmt: skip
        wait_for(lambda: at_step([s.endpoint for s in servers], 40), 30, "the head")
        for _ in range(50):  # rank 1 alone merges: no consumer, no window
            if not servers[1].retain():
                break
        snap = servers[1].log.snapshot()
        assert snap is not None and [e.step for e in snap.entries] == [40]
        assert servers[0].log.snapshot().base.step == 0  # type: ignore[union-attr]
        target = ["--target", servers[0].endpoint]
        capsys.readouterr()
        for argv in (
            ["rollback", "--to-step", "20"],
            ["pin", "--group", "p-*", "--step", "20"],
            ["release", "--to-step", "20"],
        ):
            before = RolloutStore(servers[0].store.client, "m").get()
            assert main(["rollout", *argv, *target]) == 2, argv
            err = capsys.readouterr().err
            assert "FAILED_PRECONDITION" in err and "rank 1 cannot restore it" in err, err
            assert "older than its log's base (step 40)" in err, err
            assert RolloutStore(servers[0].store.client, "m").get() == before
        # a step every rank holds is taken
        assert main(["rollout", "rollback", "--to-step", "40", *target]) == 0
        order = RolloutStore(servers[0].store.client, "m").get().rollback
        assert order is not None and order.to_step == 40
    del ft


def test_a_control_while_redis_is_down_is_unavailable_not_a_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review 12: with Redis down, the check of the other ranks' restore points answered
    FAILED_PRECONDITION, "keep the same restore window on every rank": an outage is
    UNAVAILABLE, which clients retry."""
    from deltad.commands.main import main
    from deltad.store import EmbeddedRedis

    ft = trained(tmp_path)
    redis = EmbeddedRedis(tmp_path / "redis")
    url = redis.start()
    watch = Release(url)
    try:
        with sidecars(tmp_path / "spool", url, 2, watch) as servers:
            wait_for(lambda: at_step([s.endpoint for s in servers], 40), 30, "the head")
            redis.stop()
            capsys.readouterr()
            code = main(["rollout", "rollback", "--to-step", "20", "--target",
                         servers[0].endpoint, "--timeout", "30"])  # fmt: skip
            err = capsys.readouterr().err
            assert code != 0 and "UNAVAILABLE" in err and "restore window" not in err, err
    finally:
        redis.stop()
    del ft


def test_a_merge_tells_the_other_ranks_what_it_swallows_before_it_runs(
    tmp_path: Path, redis_url: str
) -> None:
    """Review 12: rank 1's registry entry was rewritten only after a merge, so an order given
    to rank 0 while rank 1 merged was checked against steps rank 1 was about to lose. The
    entry now says the merge's outcome before the merge runs."""
    ft = trained(tmp_path)  # 2 ranks, steps 10..40
    watch = Release(redis_url)
    with sidecars(tmp_path / "spool", redis_url, 2, watch, restore_window_steps=0,
                  merge_min_segments=2) as servers:  # fmt: skip
        wait_for(lambda: at_step([s.endpoint for s in servers], 40), 30, "the head")
        assert servers[0]._peers_check(20) == ""
        seen: list[str] = []
        told = servers[1]._before_merge

        def during(merging: tuple[int, int]) -> None:
            told(merging)
            snap = servers[1].log.snapshot()
            assert snap is not None and snap.base.step == 0  # not merged yet
            seen.append(servers[0]._peers_check(20))  # an order given now, on rank 0

        servers[1].retention.before_merge = during
        assert servers[1].retain()
        assert seen and "rank 1 cannot restore it" in seen[0], seen
    del ft


def test_a_pull_nothing_can_be_served_to_is_said_in_the_sidecars_log(
    tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Review 10/12: predictors failed every pull on a cap older than a rank's base, and that
    rank's log said nothing. Every such refusal is logged (rate-limited) with its code."""
    import grpc
    from serverkit import Client

    from deltad.serve import rollout as ro

    with merging_rank(tmp_path, redis_url) as srv:
        merge_all(srv)
        assert srv.log.snapshot().base.step == 40  # type: ignore[union-attr]
        # a pin older than the base, as a state written by hand or a race would hold it
        store = RolloutStore(srv.store.client, "m")
        state = store.update(lambda s: ro.pin(s, group="old-*", step=10, head_step=None))
        wait_for(lambda: srv.rollout.state().version >= state.version, 10, "the pin applied")
        caplog.set_level("WARNING")
        c = Client(srv.endpoint)
        try:
            with pytest.raises(grpc.RpcError) as e:
                c.pull("old-1")
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            c.close()
        said = [
            m for m in caplog.messages if "GetDelta of old-1 refused (FAILED_PRECONDITION)" in m
        ]
        assert said and "older than the oldest state this log holds" in said[0], caplog.messages


def test_a_merge_planned_on_a_stale_release_state_does_not_swallow_a_newer_order(
    tmp_path: Path, redis_url: str
) -> None:
    """Review 13 N3: a rank reads the release state up to 0.25 s late, so it could merge away
    a step an order recorded just before named. The state is read afresh once the merge is
    told to the registry, and a merge that would swallow a state it serves waits."""
    from deltad.serve import rollout as ro
    from deltad.serve.rollout import ReleaseState

    with merging_rank(tmp_path, redis_url, range(10, 50, 10)) as srv:
        srv.retention.release = lambda: ReleaseState()  # the view, not yet updated
        RolloutStore(srv.store.client, "m").update(
            lambda s: ro.pin(s, group="p-*", step=20, head_step=None)
        )
        merge_all(srv)
        snap = srv.log.snapshot()
        assert snap is not None and 20 in [e.step for e in snap.entries], snap.entries
