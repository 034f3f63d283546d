"""DeltaConsumer against real sidecars (in-process SidecarServer on port 0, real Redis).

Spools are written by hand (tests/spoolkit.FakeTrainer keeps the truth at every step).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch
from spoolkit import FakeTrainer, child_env, wait_for

from deltad.config import ConsumerConfig, PullOptions, ServerConfig
from deltad.consume.appliers import TensorDictApplier
from deltad.consume.client import DeltaConsumer, PullResult
from deltad.errors import ConfigError
from deltad.keys import RedisKeys
from deltad.serve.edge.app import SidecarServer

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def sidecars(
    spool: Path, redis_url: str, world: int, model: str = "m"
) -> Iterator[list[SidecarServer]]:
    servers = []
    try:
        for rank in range(world):
            cfg = ServerConfig(
                spool_dir=spool,
                model=model,
                rank=rank,
                listen="127.0.0.1:0",
                redis_url=redis_url,
                poll_interval_s=0.02,
                grace_period_s=0.5,
            )
            servers.append(SidecarServer(cfg).start())
        yield servers
    finally:
        for s in servers:
            s.stop(0.5)


def consumer(name: str, servers: list[SidecarServer], **kw: object) -> DeltaConsumer:
    cfg = ConsumerConfig(
        consumer=name,
        model="m",
        sidecars=tuple(s.endpoint for s in servers),
        rpc_deadline_s=10.0,
        max_retries=2,
        backoff_initial_s=0.05,
        heartbeat_interval_s=0.5,
        **kw,  # type: ignore[arg-type]
    )
    return DeltaConsumer(cfg)


def wait_head(c: DeltaConsumer, steps: list[int], generation: int | None = None) -> None:
    def ready() -> bool:
        st = c.status()
        return [s.head_step for s in st] == steps and (
            generation is None or all(s.generation == generation for s in st)
        )

    wait_for(ready, 30.0, f"sidecars at steps {steps}")


def assert_tables(applier: TensorDictApplier, truth: dict[str, torch.Tensor]) -> None:
    got = applier.tables()
    assert set(got) == set(truth)
    for n, t in truth.items():
        assert torch.equal(got[n], t), n


def apply_commit_check(
    c: DeltaConsumer, applier: TensorDictApplier, r: PullResult, truth: dict[str, torch.Tensor]
) -> None:
    """Apply a two-rank pull, see both ranks acknowledge its commit, check the tables."""
    applier.apply(r.deltas)
    assert sorted(c.commit(r)) == [0, 1]
    assert_tables(applier, truth)


def test_rows_from_every_rank_then_only_changes(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path, world_size=2)
    ft.start(0)
    ft.step(10)
    with sidecars(tmp_path, redis_url, 2) as servers, consumer("p1", servers) as c:
        wait_head(c, [10, 10])
        applier = TensorDictApplier()
        first = c.sync(applier.apply)
        assert first.resync and first.step == 10 and not first.missing
        assert_tables(applier, ft.history[10])
        assert [cur.seq for cur in c.cursors if cur is not None] == [1, 1]
        again = c.sync(applier.apply)
        assert again.rows == 0 and again.step == 10
        ft.step(20, touch=3)
        wait_head(c, [20, 20])
        second = c.sync(applier.apply)
        assert not second.resync and second.step == 20
        touched = sum(len(ids) for ids in ft.touched[20].values())
        assert second.rows == touched  # only the changed rows travel
        assert_tables(applier, ft.history[20])


def test_step_alignment_never_mixes_versions(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path, world_size=2)
    ft.start(0)
    ft.step(10)
    ft.step(20, ranks=[0])  # rank 0 is ahead: it published step 20, rank 1 not yet
    with sidecars(tmp_path, redis_url, 2) as servers, consumer("aligned", servers) as c:
        wait_head(c, [20, 10])
        applier = TensorDictApplier()
        r = c.sync(applier.apply)
        assert r.step == 10 and r.head_step == 20
        assert {d.to_step for d in r.deltas} == {10}
        assert_tables(applier, ft.history[10])  # step 10 everywhere, nothing of step 20
        ft.step(20, ranks=[1])
        wait_head(c, [20, 20])
        r = c.sync(applier.apply)
        assert r.step == 20
        assert_tables(applier, ft.history[20])


def test_readers_only_ever_see_one_trainer_step(tmp_path: Path, redis_url: str) -> None:
    """While ranks publish out of step, a reader under reading() always sees exactly the
    tables of one trainer step (never rank 0 at step N with rank 1 at N-1)."""
    ft = FakeTrainer(tmp_path, world_size=2)
    ft.start(0)
    with sidecars(tmp_path, redis_url, 2) as servers, consumer("reader", servers) as c:
        applier = TensorDictApplier()
        wait_head(c, [0, 0])
        c.sync(applier.apply)
        seen: set[int] = set()
        mixed: list[int] = []
        stop = threading.Event()

        def reader() -> None:
            while not stop.is_set():
                with applier.reading():
                    snap = {n: t.clone() for n, t in applier.tables().items()}
                steps = [
                    s
                    for s, h in list(ft.history.items())
                    if all(torch.equal(snap[n], h[n]) for n in h)
                ]
                if steps:
                    seen.update(steps)
                else:
                    mixed.append(1)

        th = threading.Thread(target=reader)
        th.start()
        try:
            for step in range(1, 7):
                ft.step(step, ranks=[0])  # rank 0 publishes first
                wait_head(c, [step, step - 1])
                assert c.sync(applier.apply).step == step - 1
                ft.step(step, ranks=[1])
                wait_head(c, [step, step])
                assert c.sync(applier.apply).step == step
            deadline = time.monotonic() + 30  # let the reader look at the final tables
            while 6 not in seen and th.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            stop.set()
            th.join(timeout=30)
        assert not mixed and max(seen) == 6
        assert_tables(applier, ft.history[6])


def test_generation_change_resyncs(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path, world_size=2, generation=1)
    ft.start(0)
    ft.step(10)
    with sidecars(tmp_path, redis_url, 2):
        cfg = ConsumerConfig(
            consumer="gen", model="m", redis_url=redis_url, max_retries=2, backoff_initial_s=0.05
        )
        with DeltaConsumer(cfg) as c:  # discovery through Redis
            assert c.world_size == 2
            applier = TensorDictApplier()
            wait_head(c, [10, 10])
            assert c.sync(applier.apply).step == 10
            restarted = FakeTrainer(
                tmp_path, world_size=2, generation=2, seed=7, tables={"t0": (30, 8), "t1": (40, 4)}
            )
            restarted.start(100)
            restarted.step(110)
            wait_head(c, [110, 110], generation=2)
            r = c.sync(applier.apply)
            assert r.resync and r.step == 110
            assert {d.generation for d in r.deltas} == {2}
            assert_tables(applier, restarted.history[110])  # t0 changed shape too


VICTIM = textwrap.dedent(
    """
    import json, os, signal, sys
    from deltad.consume.client import DeltaConsumer
    from deltad.config import ConsumerConfig
    cfg = ConsumerConfig(consumer="victim", model="m", sidecars=tuple(sys.argv[1:]))
    c = DeltaConsumer(cfg).connect()
    r = c.pull()
    print(json.dumps({"rows": r.rows, "step": r.step,
                      "ids": sorted(int(i) for d in r.deltas for s in d.shards for i in s.ids)}))
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # dies after receiving, before committing
    """
)


def test_killed_before_commit_gets_the_rows_again(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path, world_size=2)
    ft.start(0)
    ft.step(10)
    with sidecars(tmp_path, redis_url, 2) as servers:
        with consumer("probe", servers) as probe:
            wait_head(probe, [10, 10])
        endpoints = [s.endpoint for s in servers]
        proc = subprocess.run(
            [sys.executable, "-c", VICTIM, *endpoints],
            capture_output=True,
            text=True,
            timeout=90,
            env=child_env(),
        )
        assert proc.returncode == -9, proc.stderr
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
        assert seen["rows"] > 0 and seen["step"] == 10
        with consumer("victim", servers) as c:
            applier = TensorDictApplier()
            r = c.pull()
            ids = sorted(int(i) for d in r.deltas for s in d.shards for i in s.ids)
            assert r.rows == seen["rows"] and ids == seen["ids"]  # redelivered, whole
            applier.apply(r.deltas)
            c.commit(r)
            assert_tables(applier, ft.history[10])
            assert c.pull().rows == 0  # committed once: not delivered a third time


def test_down_sidecar_delays_its_rank_and_keeps_the_commit(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path, world_size=2)
    ft.start(0)
    ft.step(10)
    cfg = ConsumerConfig(
        consumer="steady",
        model="m",
        redis_url=redis_url,
        rpc_deadline_s=3.0,
        max_retries=2,
        backoff_initial_s=0.05,
        pull=PullOptions(),
    )
    keys = RedisKeys("m")
    store = redis.Redis.from_url(redis_url)
    with sidecars(tmp_path, redis_url, 2) as servers, DeltaConsumer(cfg) as c:
        wait_head(c, [10, 10])
        applier = TensorDictApplier()
        r = c.pull()
        applier.apply(r.deltas)
        servers[1].stop(0)  # rank 1's sidecar dies between apply and commit
        assert c.commit(r) == [0]  # rank 1's commit stays pending
        assert store.hget(keys.cursor("steady", 1), "seq") is None
        down = c.pull()
        assert not down.deltas and 1 in down.missing  # aligned: nothing half-applied
        ft.step(20)
        servers[1] = SidecarServer(servers[1].config).start()  # back, on a new port
        wait_head(c, [20, 20])
        r2 = c.pull()
        # the pending commit went first: rank 1's window starts after seq 1, not at the base
        assert store.hget(keys.cursor("steady", 1), "seq") == b"1"
        assert r2.step == 20 and not r2.resync
        assert r2.rows == sum(len(ids) for ids in ft.touched[20].values())
        apply_commit_check(c, applier, r2, ft.history[20])
    store.close()


def test_commit_for_a_consumer_redis_lost_resyncs_instead_of_wedging(
    tmp_path: Path, redis_url: str
) -> None:
    """Redis lost the consumer's keys (flushed, failed over, forgotten) between its pull and
    its commit: the commit is refused for good (NOT_FOUND), the consumer drops it and its
    next pull resyncs from the base, instead of keeping it pending and pulling nothing."""
    ft = FakeTrainer(tmp_path, world_size=2)
    ft.start(0)
    ft.step(10)
    store = redis.Redis.from_url(redis_url)
    with sidecars(tmp_path, redis_url, 2) as servers, consumer("amnesiac", servers) as c:
        wait_head(c, [10, 10])
        applier = TensorDictApplier()
        r = c.pull()
        applier.apply(r.deltas)
        store.delete(*store.keys("*"))  # (FLUSHDB is disabled on the embedded server)
        c.commit(r)  # refused on both ranks (NOT_FOUND): dropped, not kept pending
        ft.step(20)
        wait_head(c, [20, 20])
        again = c.pull()
        assert not again.missing and again.resync and again.step == 20
        apply_commit_check(c, applier, again, ft.history[20])
    store.close()


def test_a_restarted_consumer_gets_the_full_tables_unless_it_resumes(
    tmp_path: Path, redis_url: str
) -> None:
    """A predictor process that restarts under its name has lost its in-memory tables: its
    first pull is the full tables (from_base), not the rows changed since its last commit.
    One that restored its tables (resume=True) continues from its committed cursors."""
    ft = FakeTrainer(tmp_path, world_size=2)
    ft.start(0)
    ft.step(10)
    with sidecars(tmp_path, redis_url, 2) as servers:
        with consumer("phoenix", servers) as c:
            wait_head(c, [10, 10])
            first = TensorDictApplier()
            c.sync(first.apply)
            assert_tables(first, ft.history[10])
        ft.step(20)
        with consumer("phoenix", servers) as c:  # restarted, tables lost
            wait_head(c, [20, 20])
            assert c.pull().resync  # full tables, but never applied (say the apply failed)
            fresh = TensorDictApplier()
            r = c.sync(fresh.apply)
            assert r.resync and r.step == 20
            assert_tables(fresh, ft.history[20])
            ft.step(30)
            wait_head(c, [30, 30])
            r = c.sync(fresh.apply)  # later pulls of the same process: only changes
            assert not r.resync and r.rows == sum(len(i) for i in ft.touched[30].values())
            assert_tables(fresh, ft.history[30])
        ft.step(40)
        with consumer("phoenix", servers, resume=True) as c:  # tables restored from disk
            wait_head(c, [40, 40])
            restored = TensorDictApplier({n: t.clone() for n, t in fresh.tables().items()})
            r = c.sync(restored.apply)
            assert not r.resync and r.rows == sum(len(i) for i in ft.touched[40].values())
            assert_tables(restored, ft.history[40])


def test_sidecars_listed_out_of_rank_order_are_refused(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path, world_size=2)
    ft.start(0)
    with sidecars(tmp_path, redis_url, 2) as servers:
        swapped = ConsumerConfig(
            consumer="mixed", model="m", sidecars=(servers[1].endpoint, servers[0].endpoint)
        )
        with pytest.raises(ConfigError, match="serves rank 1, but it is listed as rank 0"):
            DeltaConsumer(swapped).connect()


def test_rebuild_buffers_are_reused_only_once_released(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pulls rebuild into the buffers of earlier pulls (no fresh pages each time), but never
    into the tensors of a result the caller still holds."""
    monkeypatch.setattr("deltad.buffers.MIN_POOLED_BYTES", 0)  # these tables are small
    ft = FakeTrainer(tmp_path, world_size=2)
    ft.start(0)
    ft.step(10)
    with sidecars(tmp_path, redis_url, 2) as servers, consumer("pooled", servers) as c:
        wait_head(c, [10, 10])
        held = c.pull()  # not committed: every pull is the whole window again
        snapshot = [
            (s.ids.clone(), None if s.values is None else s.values.clone())
            for d in held.deltas
            for s in d.shards
        ]
        second = c.pull()
        pools = [r.buffers for r in c._ranks]
        assert all(p is not None and p.reused == 0 for p in pools)
        for (ids, vals), s in zip(
            snapshot, (s for d in held.deltas for s in d.shards), strict=True
        ):
            assert torch.equal(s.ids, ids) and (vals is None or torch.equal(s.values, vals))
        del held, snapshot
        third = c.pull()  # the first result's buffers are free now
        assert all(p is not None and p.reused > 0 for p in pools)
        for r in (second, third):
            applier = TensorDictApplier()
            applier.apply(r.deltas)
            assert_tables(applier, ft.history[10])
