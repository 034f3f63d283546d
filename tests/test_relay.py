"""Relay sidecars (deltad.serve.relay.server): trees of real sidecars and relays on port 0, each with
its own real Redis; predictors are real DeltaConsumers. The trainer is tests/spoolkit's
FakeTrainer (the reference trainer's chain and kill -9 are in test_relay_slow.py)."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

import grpc
import pytest
import torch
from spoolkit import FakeTrainer, wait_for

from deltad.commands import status as status_cli
from deltad.config import ConfigError, ConsumerConfig, PullOptions, RelayConfig, ServerConfig
from deltad.consume.appliers import TensorDictApplier
from deltad.consume.client import DeltaConsumer
from deltad.segment.format import read_segment
from deltad.segment.spool import SpoolLayout
from deltad.serve.edge.app import SidecarServer
from deltad.serve.relay.server import RelayServer
from deltad.types import Form, SegmentKind, Shard
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)


def server_config(spool: Path, rank: int, redis_url: str | None) -> ServerConfig:
    return ServerConfig(
        spool_dir=spool, model="m", rank=rank, listen="127.0.0.1:0", redis_url=redis_url,
        poll_interval_s=0.02, grace_period_s=0.5, retention_interval_s=3600.0,
    )  # fmt: skip


def db(redis_url: str, n: int) -> str:
    """Database ``n`` of the test's Redis: a relay's own keyspace, never the upstream's.

    (Not an embedded Redis per relay: forking redis-server from this process while its gRPC
    threads run now and then aborts the child.)"""
    u = urlsplit(redis_url)
    if u.scheme == "unix":  # the embedded server's URL: the db is a query parameter
        query = [(k, v) for k, v in parse_qsl(u.query) if k != "db"] + [("db", str(n))]
        return f"unix://{u.path}?{urlencode(query)}"
    return redis_url.rsplit("/", 1)[0] + f"/{n}"


def start_relay(
    upstream: str, spool: Path, rank: int, redis_url: str, consumer: str = "relay"
) -> RelayServer:
    """A relay with its own Redis keyspace (``redis_url``, see :func:`db`)."""
    cfg = server_config(spool, rank, redis_url)
    return RelayServer(
        cfg,
        RelayConfig(upstream=upstream, consumer=consumer, poll_interval_s=0.02, fsync=False,
                    backoff_initial_s=0.05, backoff_max_s=0.5),
    ).start()  # fmt: skip


@contextlib.contextmanager
def tree(tmp_path: Path, redis_url: str, world: int, levels: int) -> Iterator[list[list[str]]]:
    """Sidecars for every rank, then ``levels`` relays in a chain per rank; yields the
    endpoints per level (level 0: the sidecars)."""
    servers: list[SidecarServer | RelayServer] = []
    try:
        level = []
        for r in range(world):
            s = SidecarServer(server_config(tmp_path / "spool", r, redis_url)).start()
            servers.append(s)
            level.append(s.endpoint)
        out = [level]
        for lv in range(1, levels + 1):
            level = []
            for r in range(world):
                n = (lv - 1) * world + r + 1
                s = start_relay(out[-1][r], tmp_path / f"relay-{lv}-{r}", r, db(redis_url, n))
                servers.append(s)
                level.append(s.endpoint)
            out.append(level)
        yield out
    finally:
        for s in reversed(servers):
            s.stop(0.2)


def status(endpoint: str) -> pb.StatusResponse:
    with grpc.insecure_channel(endpoint) as ch:
        return pb_grpc.DeltaServiceStub(ch).Status(pb.StatusRequest(), timeout=10)


def at_step(endpoints: list[str], step: int, generation: int | None = None) -> bool:
    sts = [status(e) for e in endpoints]
    return all(
        s.head_step == step and (generation is None or s.generation == generation) for s in sts
    )


def predictor(name: str, endpoints: list[str], **pull: object) -> DeltaConsumer:
    return DeltaConsumer(
        ConsumerConfig(
            consumer=name, model="m", sidecars=tuple(endpoints), rpc_deadline_s=10.0,
            max_retries=3, backoff_initial_s=0.05, heartbeat_interval_s=0.5,
            pull=PullOptions(**pull),  # type: ignore[arg-type]
        )
    )  # fmt: skip


def equal(applier: TensorDictApplier, truth: dict[str, torch.Tensor]) -> bool:
    got = applier.tables()
    return set(got) == set(truth) and all(torch.equal(got[n], t) for n, t in truth.items())


def test_chain_of_two_relays_is_bit_equal_and_keeps_seqs_and_steps(
    tmp_path: Path, redis_url: str
) -> None:
    """trainer -> sidecar -> relay -> relay -> predictor, two ranks, rows form."""
    ft = FakeTrainer(tmp_path / "spool", world_size=2)
    ft.start(0)
    ft.step(10)
    with tree(tmp_path, redis_url, 2, 2) as levels, predictor("p", levels[2]) as c:
        wait_for(lambda: at_step(levels[2], 10), 30, "relays at step 10")
        applier = TensorDictApplier()
        r = c.sync(applier.apply)
        assert r.resync and r.step == 10 and equal(applier, ft.history[10])
        for step in (20, 30, 40):
            ft.step(step, touch=7)
            wait_for(lambda s=step: at_step(levels[2], s), 30, f"relays at step {step}")  # type: ignore[misc]
            r = c.sync(applier.apply)
            assert not r.resync and r.step == step
            # only the changed rows travel, through every level
            assert r.rows == sum(len(ids) for ids in ft.touched[step].values())
            assert equal(applier, ft.history[step])
        # Status tells a relay from a sidecar, and nothing else differs
        top, mid, side = status(levels[2][1]), status(levels[1][1]), status(levels[0][1])
        assert side.upstream == "" and mid.upstream == levels[0][1]
        assert top.upstream == levels[1][1]
        for s in (top, mid):
            assert (s.generation, s.head_seq, s.head_step, s.world_size, s.rank) == (
                side.generation, side.head_seq, side.head_step, side.world_size, side.rank,
            )  # fmt: skip
            assert [(t.table, t.num_rows, t.dim, t.dtype) for t in s.tables] == [
                (t.table, t.num_rows, t.dim, t.dtype) for t in side.tables
            ]
            assert [list(t.local_slices) for t in s.tables] == [
                list(t.local_slices) for t in side.tables
            ]
            assert abs(s.head_age_seconds - side.head_age_seconds) < 5  # the rows' age
    # the relay's spool: a base, then one segment per upstream pull, with upstream seqs/steps
    segs = [read_segment(p) for _, p in SpoolLayout(tmp_path / "relay-2-0", "m").segments(1, 0)]
    assert segs[0].header.kind is SegmentKind.BASE and segs[0].header.first_seq == 0
    assert [s.header.step for s in segs] == [10, 20, 30, 40]
    assert [(s.header.first_seq, s.header.seq) for s in segs[1:]] == [(2, 2), (3, 3), (4, 4)]


def test_generation_change_propagates_through_relays(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=1, generation=1)
    ft.start(0)
    ft.step(10)
    with tree(tmp_path, redis_url, 1, 2) as levels, predictor("g", levels[2]) as c:
        wait_for(lambda: at_step(levels[2], 10), 30, "relays at step 10")
        applier = TensorDictApplier()
        c.sync(applier.apply)
        assert equal(applier, ft.history[10])
        restarted = FakeTrainer(
            tmp_path / "spool", world_size=1, generation=2, seed=5,
            tables={"t0": (30, 8), "t1": (40, 4)},
        )  # fmt: skip
        restarted.start(100)
        restarted.step(110)
        wait_for(lambda: at_step(levels[2], 110, 2), 30, "relays at generation 2")
        r = c.sync(applier.apply)
        assert r.resync and r.step == 110 and {d.generation for d in r.deltas} == {2}
        assert equal(applier, restarted.history[110])
    layout = SpoolLayout(tmp_path / "relay-2-0", "m")
    assert layout.read_manifest(2).tables[0].num_rows == 30
    assert layout.segments(1, 0) == []  # the old generation's segments are gone


def test_topk_through_a_relay_converges_bit_equal(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=1, tables={"t0": (200, 8), "t1": (120, 4)})
    ft.start(0)
    with (
        tree(tmp_path, redis_url, 1, 1) as levels,
        predictor("k", levels[1], form=Form.TOPK, k=5) as c,
    ):
        wait_for(lambda: at_step(levels[1], 0), 30, "relay at step 0")
        applier = TensorDictApplier()
        c.sync(applier.apply)
        for step in (10, 20, 30):
            ft.step(step, touch=40)
        wait_for(lambda: at_step(levels[1], 30), 30, "relay at step 30")
        r = c.sync(applier.apply)
        assert r.rows == 10 and sum(s.owed for d in r.deltas for s in d.shards) > 0
        assert not equal(applier, ft.history[30])  # rows still owed
        for _ in range(60):  # training paused: the owed rows come, k per pull
            r = c.sync(applier.apply)
            if r.rows == 0:
                break
        assert equal(applier, ft.history[30])


def test_restart_with_the_spool_ahead_of_the_upstream_cursor(
    tmp_path: Path, redis_url: str
) -> None:
    """What a kill -9 between writing a segment and committing it upstream leaves: a local
    head past the relay's upstream cursor. The relay writes only what it lacks, and its
    predictors miss nothing. (The killed process itself: test_relay_slow.py.)"""
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    ft.step(10)
    with tree(tmp_path, redis_url, 1, 0) as levels:
        up = levels[0][0]
        # "b" committed upstream at step 10 (seq 1) and no further
        with predictor("b", [up]) as lag:
            lag.sync(lambda deltas: None)
        a = start_relay(up, tmp_path / "relay-a", 0, db(redis_url, 10), consumer="a")
        ft.step(20)
        ft.step(30)
        wait_for(lambda: at_step([a.endpoint], 30), 30, "relay a at step 30")
        a.stop(0.2)
        # relay b starts from a's spool (head seq 3) with its upstream cursor at seq 1
        shutil.copytree(tmp_path / "relay-a", tmp_path / "relay-b")
        b = start_relay(up, tmp_path / "relay-b", 0, db(redis_url, 11), consumer="b")
        try:
            with predictor("p", [b.endpoint]) as c:
                applier = TensorDictApplier()
                wait_for(lambda: b.mirror is not None and b.mirror.pulls >= 1, 30, "a pull")
                c.sync(applier.apply)
                assert equal(applier, ft.history[30])
                assert b.mirror is not None and b.mirror.written == 0  # it had (1, 3] already
                ft.step(40, touch=3)
                wait_for(lambda: at_step([b.endpoint], 40), 30, "relay b at step 40")
                r = c.sync(applier.apply)
                assert not r.resync and equal(applier, ft.history[40])
        finally:
            b.stop(0.2)
    segs = [read_segment(p) for _, p in SpoolLayout(tmp_path / "relay-b", "m").segments(1, 0)]
    assert [(s.header.first_seq, s.header.seq, s.header.step) for s in segs][-1] == (4, 4, 40)


def test_a_lost_relay_spool_asks_for_the_full_tables(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    ft.step(10)
    with tree(tmp_path, redis_url, 1, 0) as levels:
        up = levels[0][0]
        a = start_relay(up, tmp_path / "relay-a", 0, db(redis_url, 10), consumer="a")
        wait_for(lambda: at_step([a.endpoint], 10), 30, "relay at step 10")
        a.stop(0.2)
        shutil.rmtree(tmp_path / "relay-a")  # its upstream cursor stays at seq 1
        ft.step(20)
        a = start_relay(up, tmp_path / "relay-a", 0, db(redis_url, 11), consumer="a")
        try:
            wait_for(lambda: at_step([a.endpoint], 20), 30, "relay at step 20")
            with predictor("p", [a.endpoint]) as c:
                applier = TensorDictApplier()
                c.sync(applier.apply)
                assert equal(applier, ft.history[20])
        finally:
            a.stop(0.2)


def test_an_upstream_of_another_rank_stops_the_relay(tmp_path: Path, redis_url: str) -> None:
    ft = FakeTrainer(tmp_path / "spool", world_size=2)
    ft.start(0)
    with tree(tmp_path, redis_url, 2, 0) as levels:
        # rank 1's sidecar as rank 0's upstream
        r = start_relay(levels[0][1], tmp_path / "relay", 0, db(redis_url, 10))
        try:
            assert r.wait(30)
            assert r.error is not None and "rank 1" in str(r.error)
            # checked before it registered: it left no consumer at the upstream
            _, listed = status_cli.fetch(levels[0][1])
            assert [c.consumer for c in listed.consumers] == []
        finally:
            r.stop(0.2)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        RelayConfig(upstream="nowhere")


def test_serve_with_a_bad_upstream_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from deltad.commands.main import main

    assert main(["serve", "--spool", str(tmp_path), "--upstream", "no-port"]) == 2
    err = capsys.readouterr().err
    assert "upstream (--upstream) must be HOST:PORT" in err and err.count("\n") == 1
    assert main(["serve", "--spool", str(tmp_path), "--upstream", "h:1",
                 "--upstream-consumer", "bad name"]) == 2  # fmt: skip
    assert "invalid upstream consumer name" in capsys.readouterr().err


def test_fp16_tables_stay_fp16_and_bit_equal_through_a_relay(
    tmp_path: Path, redis_url: str
) -> None:
    """fp32 on the upstream wire carries fp16 values exactly; the relay stores them as fp16."""
    import time

    from deltad.commands.status import render
    from deltad.segment.format import ShardRows, write_segment
    from deltad.segment.spool import GenerationManifest, TableInfo

    layout = SpoolLayout(tmp_path / "spool", "m")
    truth = torch.randn(300, 8).half()
    layout.write_manifest(
        GenerationManifest(
            "m", 1, 1, 0, time.time(), (TableInfo("h", 300, 8, "float16", "x", "ec", "rw"),)
        ),
        fsync=False,
    )
    ids = torch.arange(300)
    write_segment(
        layout.segment_path(1, 0, 0), model="m", generation=1, rank=0, world_size=1, seq=0,
        step=0, kind=SegmentKind.BASE, shards=[ShardRows(Shard("h", 300, 8, 0, 300, 0, 8), ids, truth)],
        fsync=False,
    )  # fmt: skip
    with tree(tmp_path, redis_url, 1, 1) as levels:
        wait_for(lambda: at_step(levels[1], 0), 30, "relay at step 0")
        st = status(levels[1][0])
        assert [t.dtype for t in st.tables] == ["float16"]
        with grpc.insecure_channel(levels[1][0]) as ch:
            consumers = pb_grpc.DeltaServiceStub(ch).ListConsumers(
                pb.ListConsumersRequest(), timeout=10
            )
        assert f"relay of {levels[0][0]}" in render(st, consumers)
    (seg,) = [read_segment(p) for _, p in SpoolLayout(tmp_path / "relay-1-0", "m").segments(1, 0)]
    (c,) = seg.shards
    assert c.values.dtype == torch.float16 and torch.equal(c.values, truth)
    assert (c.shard.row_start, c.shard.row_end) == (0, 300)


def test_a_relay_of_a_sidecar_with_tokens_sends_its_token(tmp_path: Path, redis_url: str) -> None:
    """The upstream requires a bearer token: a relay with the wrong one mirrors nothing (and
    keeps retrying), one with the right token mirrors; both stop promptly."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    ft.step(10)
    cfg = server_config(tmp_path / "spool", 0, redis_url)
    cfg.tokens = ("s3cret",)
    side = SidecarServer(cfg).start()
    relays = []
    try:
        for name, token in (("wrong", "nope"), ("right", "s3cret")):
            rcfg = server_config(tmp_path / f"relay-{name}", 0, db(redis_url, len(relays) + 1))
            relays.append(
                RelayServer(
                    rcfg,
                    RelayConfig(
                        upstream=side.endpoint,
                        consumer=name,
                        token=token,
                        poll_interval_s=0.02,
                        fsync=False,
                        backoff_max_s=0.2,
                    ),
                ).start()
            )
        wrong, right = relays
        wait_for(lambda: at_step([right.endpoint], 10), 30, "the relay with the token")
        assert status(wrong.endpoint).head_seq == -1 and wrong.error is None
        assert right.mirror is not None and right.mirror.written == 1
    finally:
        t0 = time.monotonic()
        for r in relays:
            r.stop(0.2)
        assert time.monotonic() - t0 < 20
        side.stop(0.2)


def test_a_predictor_moves_between_relays_of_one_tier_without_a_resync(
    tmp_path: Path, redis_url: str
) -> None:
    """Two relays of one rank sharing one Redis database (docker/k8s/relay.yaml): cursors mean
    the same on both, so a predictor that reconnects to the other replica continues from its
    cursor and gets only the changed rows."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    ft.step(10)
    with tree(tmp_path, redis_url, 1, 0) as levels:
        up = levels[0][0]
        tier = db(redis_url, 5)
        a = start_relay(up, tmp_path / "relay-a", 0, tier, consumer="a")
        b = start_relay(up, tmp_path / "relay-b", 0, tier, consumer="b")
        try:
            wait_for(lambda: at_step([a.endpoint, b.endpoint], 10), 30, "both relays")
            applier = TensorDictApplier()
            with predictor("p", [a.endpoint]) as c:
                assert c.sync(applier.apply).resync
            ft.step(20, touch=4)
            wait_for(lambda: at_step([a.endpoint, b.endpoint], 20), 30, "both at step 20")
            moved = DeltaConsumer(
                ConsumerConfig(
                    consumer="p", model="m", sidecars=(b.endpoint,), resume=True,
                    rpc_deadline_s=10.0, max_retries=2, backoff_initial_s=0.05,
                )
            )  # fmt: skip
            with moved:
                r = moved.sync(applier.apply)
            assert not r.resync and r.step == 20
            assert r.rows == sum(len(ids) for ids in ft.touched[20].values())
            assert equal(applier, ft.history[20])
            # registering one rank from both replicas is this tier's design, not a conflict
            # of two deployments (review 12)
            for relay in (a, b, a, b):
                relay.server.upkeep.register_endpoint()
            for relay in (a, b):
                assert relay.server.metrics.registry_conflicts._value.get() == 0  # type: ignore[attr-defined]
        finally:
            a.stop(0.2)
            b.stop(0.2)


def test_a_relayed_segment_keeps_its_publish_time_across_a_long_poll(
    tmp_path: Path, redis_url: str
) -> None:
    """Review 10: a relay dated each segment from when it *asked* its upstream's Status, which
    a long poll holds until the head moves: every relayed segment (and so predictors'
    freshness, lag seconds and head ages behind relays) was one publish interval too old."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1)
    ft.start(0)
    side = SidecarServer(server_config(tmp_path / "spool", 0, redis_url)).start()
    relay = start_relay(f"127.0.0.1:{side.port}", tmp_path / "relay", 0, db(redis_url, 1))
    up, down = f"127.0.0.1:{side.port}", f"127.0.0.1:{relay.port}"
    try:
        wait_for(lambda: at_step([down], 0), 30, "relay at the base")
        for step in (10, 20, 30):
            time.sleep(1.5)  # the relay waits in a long poll meanwhile
            ft.step(step)
            wait_for(lambda s=step: at_step([down], s), 30, f"relay at step {step}")  # type: ignore[misc]
        mine = {
            read_segment(p).header.seq: read_segment(p).header.created_unix
            for _, p in SpoolLayout(tmp_path / "relay", "m").segments(1, 0)
        }
        theirs = {
            read_segment(p).header.seq: read_segment(p).header.created_unix
            for _, p in SpoolLayout(tmp_path / "spool", "m").segments(1, 0)
        }
        for seq in (1, 2, 3):
            assert abs(mine[seq] - theirs[seq]) < 0.5, (seq, mine[seq] - theirs[seq])
        assert abs(status(down).head_age_seconds - status(up).head_age_seconds) < 0.5
    finally:
        relay.stop(0)
        side.stop(0)
