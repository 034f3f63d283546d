"""Rollback (deltad.serve.windows.rollback): a predictor past an operator's rollback step goes back
to exactly the trainer's state at that step, with only the rows that differ, in place, in every
form and wire dtype, across 2 ranks and through a relay. Real sidecars on port 0, real Redis,
real DeltaConsumers; the trainer is tests/spoolkit's FakeTrainer, whose ``history`` is the
truth at every step. The release state is the model's, in Redis (RolloutStore), changed as the
rollout controls change it; the admin RPC itself is in test_rollback_rpc.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from serverkit import MODEL, server_config
from spoolkit import FakeTrainer, wait_for
from test_gendiff import assert_exact_diff
from test_relay import at_step, db, equal, predictor

from deltad.config import RelayConfig
from deltad.consume.appliers import TensorDictApplier
from deltad.serve import rollout as ro
from deltad.serve.edge.app import SidecarServer
from deltad.serve.index.restore import restorable, restorable_steps
from deltad.serve.relay.server import RelayServer
from deltad.serve.rollout import Pin, ReleaseState
from deltad.serve.state.offsets import CommitRejected, OffsetStore, PendingPull
from deltad.serve.state.release import RolloutStore
from deltad.types import Form, WireDtype

pytestmark = pytest.mark.timeout(180)

SHAPES = {"t0": (300, 8), "t1": (120, 4)}


class Release:
    """The model's release state in Redis, changed as the rollout controls change it; each
    change returns once every server :meth:`watch` was given applies it (a sidecar re-reads
    Redis within 0.25 s, a relay takes it from its upstream's Status)."""

    def __init__(self, redis_url: str, model: str = MODEL) -> None:
        self.store = RolloutStore(redis.Redis.from_url(redis_url), model)
        self.servers: list[SidecarServer] = []

    def watch(self, server: SidecarServer) -> None:
        self.servers.append(server)

    @property
    def state(self) -> ReleaseState:
        return self.store.get()

    def change(self, fn: Callable[[ReleaseState], ReleaseState]) -> ReleaseState:
        new = self.store.update(fn)
        wait_for(
            lambda: all(s.rollout.state().version >= new.version for s in self.servers),
            30,
            f"every server at release state version {new.version}",
        )
        return new

    def rollback(self, step: int, group: str = "*") -> None:
        """What ``deltad rollout rollback --to-step`` records: the order, and the cap at it."""
        self.change(lambda st: ro.rollback(st, step, group, head_step=None))

    def release(self) -> None:
        self.change(lambda st: replace(st, release_step=None, held=False))

    def unpin(self, group: str) -> None:
        self.change(lambda st: ro.unpin(st, group))


@contextmanager
def sidecars(
    spool: Path, redis_url: str, world: int, release: Release, **kw: Any
) -> Iterator[list[SidecarServer]]:
    kw.setdefault("restore_window_steps", 1000)
    servers = [
        SidecarServer(server_config(spool, redis_url, rank=r, grace_period_s=0.2, **kw)).start()
        for r in range(world)
    ]
    try:
        for s in servers:
            release.watch(s)
        yield servers
    finally:
        for s in servers:
            s.stop(0)


def trained(tmp_path: Path, steps: tuple[int, ...] = (10, 20, 30, 40)) -> FakeTrainer:
    ft = FakeTrainer(tmp_path / "spool", world_size=2, tables=SHAPES)
    ft.start(0)
    for s in steps:
        ft.step(s, touch=25)
    return ft


def test_a_rollback_takes_two_ranks_back_to_the_step_with_only_the_rows_that_differ(
    tmp_path: Path, redis_url: str
) -> None:
    """Predictor at step 40 of 2 ranks; rollback to 20: one pull, applied in place (no
    resync), sends exactly the rows that differ between step 40 and step 20 and ends
    bit-equal to the trainer's tables at 20; the order is followed once; a release then
    takes it forward again."""
    ft = trained(tmp_path)
    release = Release(redis_url)
    with (
        sidecars(tmp_path / "spool", redis_url, 2, release) as servers,
        predictor("p", [s.endpoint for s in servers]) as c,
    ):
        eps = [s.endpoint for s in servers]
        wait_for(lambda: at_step(eps, 40), 30, "sidecars at step 40")
        applier = TensorDictApplier()
        assert c.sync(applier.apply).step == 40
        held = {n: t.clone() for n, t in applier.tables().items()}
        release.rollback(20)
        r = c.sync(applier.apply)
        assert r.step == 20 and r.rollback_to == 20 and r.rolled_back
        assert not r.resync and not r.generation_diff
        assert all(d.from_seq == 4 and d.to_seq == 2 for d in r.deltas)
        rows = assert_exact_diff(held, ft.history[20], r.deltas)
        assert 0 < rows < sum(n for n, _ in SHAPES.values()) // 2
        assert equal(applier, ft.history[20])
        assert [cur.step for cur in c.cursors if cur is not None] == [20, 20]
        for s in servers:
            labels = {"model": s.config.model, "rank": str(s.config.rank)}
            got = s.metrics.registry.get_sample_value("deltad_rollbacks_total", labels)
            assert got == 1.0
        # followed once: the next pull is an empty window at 20 (held there)
        again = c.sync(applier.apply)
        assert again.step == 20 and again.rows == 0 and not again.rolled_back
        ft.step(50, touch=25)
        wait_for(lambda: at_step(eps, 50), 30, "sidecars at step 50")
        assert c.sync(applier.apply).step == 20  # still held at the rollback's step
        release.release()  # the order stays recorded; it is not followed again
        r = c.sync(applier.apply)
        assert r.step == 50 and not r.rolled_back and equal(applier, ft.history[50])
        # a predictor that joins after the order bootstraps at the head, never rolled back
        with predictor("late", eps) as late:
            fresh = TensorDictApplier()
            assert late.sync(fresh.apply).step == 50
            assert late.sync(fresh.apply).step == 50 and equal(fresh, ft.history[50])


@pytest.mark.parametrize(
    ("form", "dtype"),
    [
        (Form.ROWS, WireDtype.FP16),
        (Form.ROWS, WireDtype.INT8),
        (Form.TOPK, WireDtype.FP32),
        (Form.TOPK, WireDtype.INT8),
    ],
)
def test_a_rollback_is_complete_in_every_form_and_dtype(
    tmp_path: Path, redis_url: str, form: Form, dtype: WireDtype
) -> None:
    """A predictor that pulled in ``form``/``dtype`` (top-k leaves rows owed) rolls back to
    step 20 and then holds exactly what a predictor bootstrapped at step 20 in the same dtype
    holds (fp32 top-k: the trainer's tables at 20): nothing owed is forgotten."""
    ft = trained(tmp_path)
    release = Release(redis_url)
    pull: dict[str, Any] = {"form": form, "wire_dtype": dtype}
    if form is Form.TOPK:
        pull["k"] = 3
    with sidecars(tmp_path / "spool", redis_url, 2, release) as servers:
        eps = [s.endpoint for s in servers]
        wait_for(lambda: at_step(eps, 40), 30, "sidecars at step 40")
        with predictor("p", eps, **pull) as c:
            applier = TensorDictApplier()
            r = c.sync(applier.apply)  # the bootstrap (complete), then windows of top-k
            assert r.step == 40
            ft.step(50, touch=25)
            wait_for(lambda: at_step(eps, 50), 30, "sidecars at step 50")
            r = c.sync(applier.apply)
            assert r.step == 50
            if form is Form.TOPK:
                assert sum(s.owed for d in r.deltas for s in d.shards) > 0
            release.rollback(20)
            r = c.sync(applier.apply)
            assert r.step == 20 and r.rollback_to == 20 and not r.resync
            got = {n: t.clone() for n, t in applier.tables().items()}
        with predictor("ref", eps, form=Form.ROWS, wire_dtype=dtype, max_step=20) as ref:
            want = TensorDictApplier()
            assert ref.sync(want.apply).step == 20
        assert set(got) == set(want.tables())
        for n, t in want.tables().items():
            assert torch.equal(got[n], t), n
        if dtype is WireDtype.FP32:
            assert all(torch.equal(got[n], t) for n, t in ft.history[20].items())


def test_a_rollback_sends_only_the_ids_in_the_ids_form(tmp_path: Path, redis_url: str) -> None:
    """FORM_IDS: the rollback window names exactly the rows whose values differ between the
    predictor's step and the rollback's step (what a cache must invalidate)."""
    ft = trained(tmp_path)
    release = Release(redis_url)
    with sidecars(tmp_path / "spool", redis_url, 2, release) as servers:
        eps = [s.endpoint for s in servers]
        wait_for(lambda: at_step(eps, 40), 30, "sidecars at step 40")
        with predictor("p", eps, form=Form.IDS) as c:
            assert c.sync(lambda _: None).step == 40
            release.rollback(10)
            r = c.sync(lambda _: None)
        assert r.step == 10 and r.rollback_to == 10
        sent = {n: set() for n in SHAPES}  # type: dict[str, set[int]]
        for d in r.deltas:
            for s in d.shards:
                assert s.values is None
                sent[s.shard.table] |= set(s.ids.tolist())
        for n in SHAPES:
            differs = (ft.history[40][n] != ft.history[10][n]).any(dim=1)
            assert sent[n] == set(differs.nonzero().squeeze(1).tolist()), n


def test_a_group_rollback_moves_only_the_group_and_a_relay_passes_it_through(
    tmp_path: Path, redis_url: str
) -> None:
    """A rollback of ``canary-*`` to step 20: a canary predictor behind relays (2 ranks) goes
    back bit-exact to the trainer's step 20, from the relays' own restore points (a relay
    mirrors every step it pulled, so its log restores the steps since it started); a predictor
    of another name stays at the head; a release (the pin lifted) takes the canary forward."""
    ft = FakeTrainer(tmp_path / "spool", world_size=2, tables=SHAPES)
    ft.start(0)
    release = Release(redis_url)
    relays: list[RelayServer] = []
    with sidecars(tmp_path / "spool", redis_url, 2, release) as servers:
        try:
            for r, s in enumerate(servers):
                relays.append(relay_of(s.endpoint, tmp_path / f"relay-{r}", r, redis_url, release))
            reps = [x.endpoint for x in relays]
            for step in (10, 20, 30, 40):  # the relays pull each step as it comes
                ft.step(step, touch=25)
                wait_for(lambda s=step: at_step(reps, s), 30, f"relays at step {step}")  # type: ignore[misc]
            with predictor("canary-1", reps) as canary, predictor("main-1", reps) as main:
                a, b = TensorDictApplier(), TensorDictApplier()
                assert canary.sync(a.apply).step == 40 and main.sync(b.apply).step == 40
                release.rollback(20, "canary-*")
                held = {n: t.clone() for n, t in a.tables().items()}
                r = canary.sync(a.apply)
                assert r.step == 20 and r.rollback_to == 20 and not r.resync
                assert_exact_diff(held, ft.history[20], r.deltas)
                assert equal(a, ft.history[20])
                ft.step(50, touch=25)
                wait_for(lambda: at_step(reps, 50), 30, "relays at step 50")
                r = main.sync(b.apply)
                assert r.step == 50 and not r.rolled_back and equal(b, ft.history[50])
                assert canary.sync(a.apply).step == 20  # pinned at the rollback's step
                release.unpin("canary-*")
                assert canary.sync(a.apply).step == 50 and equal(a, ft.history[50])
        finally:
            for x in relays:
                x.stop(0)


def relay_of(
    upstream: str, spool: Path, rank: int, redis_url: str, release: Release, window: int = 1000
) -> RelayServer:
    """A relay (its own Redis keyspace) with a restore window of ``window`` steps (0: none),
    under ``release``."""
    cfg = server_config(
        spool, db(redis_url, rank + 1), rank=rank, grace_period_s=0.2, restore_window_steps=window
    )
    relay = RelayServer(
        cfg,
        RelayConfig(upstream=upstream, consumer="relay", poll_interval_s=0.02, fsync=False,
                    backoff_initial_s=0.05, backoff_max_s=0.5),
    ).start()  # fmt: skip
    release.watch(relay.server)
    return relay


def test_a_cursor_moves_back_only_by_committing_a_rollback_pull(redis_url: str) -> None:
    """The offset store refuses a commit behind the cursor unless it is of the rollback pull
    the sidecar issued; that commit records the order's epoch, which later commits keep."""
    s = OffsetStore.from_url(redis_url, "m")
    s.record_pull("c", 0, PendingPull("p1", 1, 8, 80))
    assert s.commit("c", 0, pull_id="p1", generation=1, seq=8, step=80).seq == 8
    s.record_pull("c", 0, PendingPull("p2", 1, 4, 40, rollback_epoch=3))
    with pytest.raises(CommitRejected) as e:  # an ordinary pull behind the cursor
        s.commit("c", 0, pull_id="p2", generation=1, seq=4, step=40)
    assert e.value.reason == "behind"
    s.record_pull("c", 0, PendingPull("p3", 1, 4, 40, rollback_epoch=3, rollback=True))
    back = s.commit("c", 0, pull_id="p3", generation=1, seq=4, step=40)
    assert (back.seq, back.step, back.rollback_epoch) == (4, 40, 3)
    s.record_pull("c", 0, PendingPull("p4", 1, 6, 60))  # a pull with no order in force
    fwd = s.commit("c", 0, pull_id="p4", generation=1, seq=6, step=60)
    assert (fwd.seq, fwd.rollback_epoch) == (6, 3)
    s.record_pull("c", 0, PendingPull("p5", 2, 0, 100, rollback_epoch=4))  # a new generation
    assert s.commit("c", 0, pull_id="p5", generation=2, seq=0, step=100).rollback_epoch == 4


def test_retention_keeps_every_step_of_the_restore_window_restorable(
    tmp_path: Path, redis_url: str
) -> None:
    """With a restore window of 25 steps and no consumer pinning anything, retention merges
    the old segments into the base but not those of the last 25 steps nor the one before
    them: every step from 15 to the head stays restorable; without the window all merge."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1, tables=SHAPES)
    ft.start(0)
    for step in range(5, 45, 5):
        ft.step(step, touch=10)
    for window, oldest in ((25, 10), (0, 40)):
        srv = SidecarServer(
            server_config(tmp_path / "spool", redis_url, merge_min_segments=2,
                          restore_window_steps=window)
        ).start()  # fmt: skip
        try:
            wait_for(lambda s=srv: s.log.snapshot().head.step == 40, 30, "the head")  # type: ignore[misc,union-attr]
            for _ in range(50):
                if not srv.retention.run_once():
                    break
            snap = srv.log.snapshot()
            assert snap is not None
            assert restorable_steps(snap) == (oldest, 40)
            for step in range(oldest, 45, 5):
                assert restorable(snap, step) == "", step
            if window:
                assert "older than the log's base" in restorable(snap, 5)
                assert [e.step for e in snap.entries] == [10, 15, 20, 25, 30, 35, 40]
        finally:
            srv.stop(0)


def test_a_trainer_restarted_after_a_rollback_moves_predictors_by_a_generation_diff(
    tmp_path: Path, redis_url: str
) -> None:
    """After a rollback to step 20 the trainer restarts from its checkpoint at 20 (a new
    generation; 5 % of its rows differ, then it publishes step 30). Under the same release
    state (the order still recorded, the cap released) the predictor moves to the new
    generation with a generation diff, not a resync, and is not rolled back again; a pin
    recorded before the restart still holds a group at the new generation's start."""
    ft = trained(tmp_path)
    release = Release(redis_url)
    with (
        sidecars(tmp_path / "spool", redis_url, 2, release) as servers,
        predictor("p", [s.endpoint for s in servers]) as c,
        predictor("pinned-1", [s.endpoint for s in servers]) as pinned,
    ):
        eps = [s.endpoint for s in servers]
        wait_for(lambda: at_step(eps, 40), 30, "sidecars at step 40")
        applier, other = TensorDictApplier(), TensorDictApplier()
        assert c.sync(applier.apply).step == 40 and pinned.sync(other.apply).step == 40
        release.rollback(20)
        assert c.sync(applier.apply).rollback_to == 20 and equal(applier, ft.history[20])
        assert pinned.sync(other.apply).step == 20
        # the trainer restarts from step 20: generation 2
        back = FakeTrainer(tmp_path / "spool", world_size=2, generation=2, tables=SHAPES, seed=5)
        back.tables = {n: t.clone() for n, t in ft.history[20].items()}
        for t in back.tables.values():
            t[torch.randperm(t.shape[0], generator=back.gen)[: t.shape[0] // 20]] += 1.0
        back.start(20)
        back.step(30, touch=10)
        wait_for(lambda: at_step(eps, 30, 2), 30, "sidecars at generation 2")
        release.change(
            lambda st: replace(st, release_step=None, held=False, pins=(Pin("pinned-*", 20),))
        )
        r = c.sync(applier.apply)
        assert r.step == 30 and r.generation_diff and not r.resync and not r.rolled_back
        assert equal(applier, back.history[30])
        assert c.sync(applier.apply).rows == 0  # the order is not replayed
        r = pinned.sync(other.apply)
        assert r.step == 20 and r.generation_diff and equal(other, back.history[20])


def test_retention_keeps_an_orders_step_until_every_consumer_followed_it(
    tmp_path: Path, redis_url: str
) -> None:
    """No restore window: a rollback order to step 20 still keeps step 20 restorable while a
    live predictor past it has not followed the order: retention merges, but never across
    the order's restore point, which stays the end of an entry."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1, tables=SHAPES)
    ft.start(0)
    for step in (10, 20, 30, 40):
        ft.step(step, touch=10)
    release = Release(redis_url)
    with (
        sidecars(tmp_path / "spool", redis_url, 1, release, restore_window_steps=0,
                 merge_min_segments=2) as servers,
        predictor("p", [servers[0].endpoint]) as c,
    ):  # fmt: skip
        srv = servers[0]
        wait_for(lambda: at_step([srv.endpoint], 40), 30, "the head")
        applier = TensorDictApplier()
        assert c.sync(applier.apply).step == 40
        release.rollback(20)

        def retain() -> Any:
            for _ in range(50):
                if not srv.retention.run_once():
                    break
            return srv.log.snapshot()

        snap = retain()  # merges still run, but none crosses step 20
        assert restorable(snap, 20) == "" and "inside merged" in restorable(snap, 30)
        assert [e.step for e in snap.entries] == [20, 40]
        assert c.sync(applier.apply).rollback_to == 20 and equal(applier, ft.history[20])


@pytest.mark.parametrize("how", ["hold", "gate", "pin"])
def test_retention_keeps_the_steps_the_release_state_serves_with_nobody_connected(
    tmp_path: Path, redis_url: str, how: str
) -> None:
    """Review 4 (stop 34) #4: with no restore window and no predictor connected, a hold at
    step 20 (an operator's, or the validation gate's at its last good step) or a pin at 20
    used to be merged into the base at the head within seconds: new predictors got nothing,
    a release or rollback to 20 was refused. Retention now keeps the state at 20 (merges
    still run on either side of it); a new predictor is served exactly step 20; once the
    release state lets go, everything merges."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1, tables=SHAPES)
    ft.start(0)
    for step in (10, 15, 20, 25, 30, 35, 40):
        ft.step(step, touch=10)
    release = Release(redis_url)
    with sidecars(
        tmp_path / "spool", redis_url, 1, release, restore_window_steps=0, merge_min_segments=2
    ) as servers:
        srv = servers[0]
        wait_for(lambda: at_step([srv.endpoint], 40), 30, "the head")
        if how == "hold":
            release.change(lambda st: replace(st, release_step=20, held=True))
        elif how == "gate":
            release.change(
                lambda st: ro.gate_failed(
                    st, generation=1, bad_step=25, good_step=20, reason="nan (test)"
                )
            )
        else:
            release.change(lambda st: ro.pin(st, "new-*", 20, head_step=40))

        def retain() -> Any:
            for _ in range(50):
                if not srv.retention.run_once():
                    break
            return srv.log.snapshot()

        snap = retain()
        assert restorable(snap, 20) == "", [(e.first_seq, e.seq, e.step) for e in snap.entries]
        assert [e.step for e in snap.entries] == [20, 40]  # merged on both sides of 20
        # and a rollback to it is taken, though no restore window is set (review 7 #6)
        from deltad.commands.main import main

        assert main(["rollout", "rollback", "--to-step", "20", "--target", srv.endpoint]) == 0
        wait_for(lambda: srv.rollout.state().rollback is not None, 10, "the sidecar has the order")
        with predictor("new-1", [srv.endpoint]) as c:
            applier = TensorDictApplier()
            assert c.sync(applier.apply).step == 20 and equal(applier, ft.history[20])
        assert srv.store.forget("new-1", 1)  # (its cursor at 20 would keep 20 too)
        release.change(lambda st: ReleaseState(version=st.version))
        assert [e.step for e in retain().entries] == [40]


def test_a_predictor_away_follows_its_groups_order_after_an_order_for_another_group(
    tmp_path: Path, redis_url: str
) -> None:
    """Review 4 (stop 34) #1: ``main-*`` to step 20 while main-1 is away, then ``canary-*``
    to 30 (or a typo's order). The second order used to replace the first: main-1, back,
    stayed at step 40 and reported caught up. Now it goes back to exactly step 20, and the
    canary to 30; neither is rolled back again."""
    ft = trained(tmp_path)
    release = Release(redis_url)
    with sidecars(tmp_path / "spool", redis_url, 2, release) as servers:
        eps = [s.endpoint for s in servers]
        wait_for(lambda: at_step(eps, 40), 30, "sidecars at step 40")
        main, canary = TensorDictApplier(), TensorDictApplier()
        with predictor("main-1", eps) as c:
            assert c.sync(main.apply).step == 40
        with predictor("canary-1", eps) as k:
            assert k.sync(canary.apply).step == 40
            release.rollback(20, "main-*")  # main-1 is away
            release.rollback(30, "canary-*")
            r = k.sync(canary.apply)
            assert r.rollback_to == 30 and equal(canary, ft.history[30])
            assert k.sync(canary.apply).rows == 0
        with predictor("main-1", eps) as c:  # back, with the tables it had
            r = c.sync(main.apply)  # (a new consumer object asks for a base: a resync)
            assert r.rollback_to == 20 and r.step == 20 and r.cap_step == 20
            assert equal(main, ft.history[20])
            assert c.sync(main.apply).rows == 0
