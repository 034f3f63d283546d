"""Resync windows streamed into an applier's staged tables as their chunks arrive
(:class:`deltad.consume.appliers.ResyncStage`), against real sidecars and real trainers.

* streamed bootstraps are bit-equal to assembled ones (``pull()`` then ``apply``) for every
  wire dtype, world sizes 1 and 2, row-, column- and table-wise shards, TensorDictApplier and
  QuantApplier (fp32 and packed rows);
* a stream that breaks mid-bootstrap (sidecar stopped, deadline) installs nothing: the held
  tables are untouched, the staged ones dropped, and the next pull bootstraps;
* the rows reach the stage while the stream is still open (a sidecar stopped from inside the
  first staged chunk breaks the pull): the window is not assembled first.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from deltad.reference.consumers.serving import serving_state
from deltad.reference.trainer.model import ClickModel
from deltad.reference.trainer.train import TrainConfig, run_training
from spoolkit import FakeTrainer

from deltad.config import ConsumerConfig, PullOptions, ServerConfig
from deltad.consume.appliers import ResyncStage, TensorDictApplier, _TensorStage
from deltad.consume.client import DeltaConsumer, PullResult, _applier_of
from deltad.consume.quant import QuantApplier, packed_wire_dtype, quantize_model
from deltad.consume.window import RankDelta, ShardUpdate
from deltad.errors import ConsumerError
from deltad.serve.edge.app import SidecarServer
from deltad.types import Cursor, Form, ServeDtype, Shard, WireDtype

pytestmark = pytest.mark.timeout(300)

TABLES = {"t0": 120, "t1": 90}
SEQ_ROWS = 80
DIM = 16


@contextlib.contextmanager
def sidecars(
    spool: Path, redis_url: str, world: int, chunk_bytes: int = 4096
) -> Iterator[list[SidecarServer]]:
    servers: list[SidecarServer] = []
    try:
        for rank in range(world):
            cfg = ServerConfig(
                spool_dir=spool, model="m", rank=rank, listen="127.0.0.1:0",
                redis_url=redis_url, poll_interval_s=0.02, grace_period_s=0.5,
                chunk_bytes=chunk_bytes,
            )  # fmt: skip
            servers.append(SidecarServer(cfg).start())
        yield servers
    finally:
        for s in servers:
            s.stop(0.5)


def consumer(name: str, servers: list[SidecarServer], **kw: Any) -> DeltaConsumer:
    kw.setdefault("rpc_deadline_s", 20.0)
    cfg = ConsumerConfig(
        consumer=name, model="m", sidecars=tuple(s.endpoint for s in servers),
        max_retries=1, backoff_initial_s=0.05, heartbeat_interval_s=0.5, **kw,
    )  # fmt: skip
    return DeltaConsumer(cfg).connect()


def assembled(c: DeltaConsumer, applier: Any) -> PullResult:
    r = c.pull()  # no applier: windows assembled, as before
    assert r.deltas and not r.missing
    assert all(d.stage is None for d in r.deltas)
    applier.apply(r.deltas)
    c.commit(r)
    return r


def streamed(c: DeltaConsumer, applier: Any) -> PullResult:
    r = c.sync(applier.apply)
    assert r.deltas and not r.missing
    assert all(d.resync and d.stage is not None for d in r.deltas)
    assert all(d.stage.installed for d in r.deltas if d.stage is not None)
    return r


def staged_rows(r: PullResult) -> int:
    """Rows a streamed pull's windows still carry (the stage took the rest), but for
    managed-collision tables, which a QuantApplier's stage leaves to the window (their raw ids
    come with the assembled window)."""
    return sum(s.ids.numel() for d in r.deltas for s in d.shards if s.raw_ids is None)


# ------------------------------------------------------- bit-equality with real trainers


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "sharding"),
    [(1, {}), (2, {"t0": "cw", "t1": "rw", "seq": "tw"})],
    ids=["ws1", "ws2-cw-rw-tw"],
)
def test_streamed_bootstrap_equals_assembled(
    tmp_path: Path, redis_url: str, world_size: int, sharding: dict[str, str]
) -> None:
    """A real (1- or 2-rank gloo) trainer's tables, bootstrapped by fresh consumers streamed
    and assembled: bit-equal for fp32 / fp16 / bf16 / int8 wires into TensorDictApplier (fp32:
    the trainer's tables exactly), and for QuantApplier (int8 / int4 / fp16 models, fp32 and
    packed wires; column-wise shards of a packed pull stay assembled), dense state included."""
    spool = tmp_path / "spool"
    cfg = TrainConfig(
        spool_dir=spool, model="m", world_size=world_size, tables=TABLES, seq_rows=SEQ_ROWS,
        dim=DIM, sharding=sharding, steps=4, publish_every_steps=2, batch_size=32,
        final_tables=tmp_path / "final.pt", seed=3, progress=False, fsync=False,
    )  # fmt: skip
    run_training(cfg)
    truth = torch.load(tmp_path / "final.pt", weights_only=True)
    with sidecars(spool, redis_url, world_size) as servers:
        for wire in (WireDtype.FP32, WireDtype.FP16, WireDtype.BF16, WireDtype.INT8):
            pull = PullOptions(wire_dtype=wire)
            a, s = TensorDictApplier(), TensorDictApplier()
            with consumer(f"a-{wire.value}", servers, pull=pull) as ca:
                ra = assembled(ca, a)
            with consumer(f"s-{wire.value}", servers, pull=pull) as cs:
                rs = streamed(cs, s)
            assert ra.step == rs.step and rs.rows == ra.rows > 0
            assert staged_rows(rs) == 0  # every row went through the stage
            assert a.tables().keys() == s.tables().keys() == truth.keys()
            for n, t in a.tables().items():
                assert torch.equal(s.tables()[n], t), f"{wire.value}: {n}"
                if wire is WireDtype.FP32:
                    assert torch.equal(t, truth[n])
        for dtype, wire in [
            (ServeDtype.INT8, WireDtype.FP32),
            (ServeDtype.INT8, packed_wire_dtype(ServeDtype.INT8)),
            (ServeDtype.INT4, packed_wire_dtype(ServeDtype.INT4)),
            (ServeDtype.FP16, packed_wire_dtype(ServeDtype.FP16)),
        ]:
            models = []
            for how in ("a", "s"):
                torch.manual_seed(123)
                model = quantize_model(ClickModel(TABLES, SEQ_ROWS, dim=DIM).eval(), dtype)
                q = QuantApplier(model, chunk_rows=16)
                name = f"q{how}-{dtype.value}-{wire.value}"
                with consumer(name, servers, pull=PullOptions(wire_dtype=wire, dense=True)) as c:
                    r = assembled(c, q) if how == "a" else streamed(c, q)
                    assert r.rows > 0
                    if how == "s" and not any(v == "cw" for v in sharding.values()):
                        assert staged_rows(r) == 0
                models.append(serving_state(model))
            got, want = models[1], models[0]
            assert got.keys() == want.keys()
            for k in got:
                assert torch.equal(got[k], want[k]), f"{dtype.value} {wire.value}: {k}"


# ----------------------------------------------------------- broken streams install nothing


class _Hooked(TensorDictApplier):
    """A TensorDictApplier whose stage calls ``on_write(rank, update, stage)`` before
    each staged chunk (and records every chunk's rows)."""

    def __init__(self, on_write: Any = None) -> None:
        super().__init__()
        self.on_write = on_write
        self.chunks: list[tuple[int, int]] = []  # (rank, rows) per staged chunk
        self.stages: list[ResyncStage] = []

    def stage(self) -> ResyncStage:
        applier = self

        class Stage(_TensorStage):
            def write(self, rank: int, update: ShardUpdate) -> None:
                applier.chunks.append((rank, update.ids.numel()))
                if applier.on_write is not None:
                    applier.on_write(rank, update, self)
                super().write(rank, update)

        st = Stage(self)
        self.stages.append(st)
        return st


def _truth(trainer: FakeTrainer) -> dict[str, torch.Tensor]:
    return trainer.history[max(trainer.history)]


def _snapshot(applier: TensorDictApplier) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in applier.tables().items()}


@pytest.mark.parametrize(
    ("world", "align"),
    [
        # one rank is the two-rank case's subset: the full suite runs it, the fast lane not
        pytest.param(1, False, marks=pytest.mark.slow),
        (2, True),
        (2, False),
    ],
    ids=["ws1", "ws2-aligned", "ws2"],
)
def test_sidecar_stopped_mid_bootstrap_installs_nothing_then_a_retry_bootstraps(
    tmp_path: Path, redis_url: str, world: int, align: bool
) -> None:
    """The last rank's sidecar stops from inside its first staged chunk (so the rows reach
    the stage while the stream is open: an assembled window would have been complete before
    any row was applied, and this pull would have succeeded). Nothing is installed, not even
    the other rank's complete window (a row-wise shard shares its tables); the staged tables
    are dropped. Against held tables (a second bootstrap over the same applier) they stay
    as they were. Then, with the sidecar back, the next pull bootstraps."""
    # 12 MB per rank: far more than gRPC buffers ahead of a reader, so stopping the sidecar
    # breaks the stream rather than leaving a complete window in the client's buffers
    trainer = FakeTrainer(
        tmp_path / "spool", world_size=world, tables={"t0": (400_000, 16), "t1": (500, 8)}
    )
    trainer.start(0)
    trainer.step(10)
    truth = _truth(trainer)
    victim = world - 1
    for held in (False, True):
        applier = _Hooked()
        if held:  # tables held from an earlier consumer: a resync over same-shape tables
            with (
                sidecars(tmp_path / "spool", redis_url, world, 1 << 16) as servers,
                consumer("earlier", servers) as c,
            ):
                streamed(c, applier)
            for t in applier.tables().values():
                t.add_(1.0)  # held values that are not the trainer's: must survive the break
        before = _snapshot(applier)
        stopped: list[SidecarServer] = []
        with sidecars(tmp_path / "spool", redis_url, world, 1 << 16) as servers:

            def stop_victim(
                rank: int,
                update: ShardUpdate,
                stage: ResyncStage,
                stopped: list[SidecarServer] = stopped,
                servers: list[SidecarServer] = servers,
            ) -> None:
                if rank == victim and not stopped:
                    stopped.append(servers[victim])
                    servers[victim].stop(0)  # the server goes away mid-stream

            applier.on_write = stop_victim
            c = consumer(f"fresh-{held}", servers, rpc_deadline_s=5.0, align_steps=align)
            try:
                r = c.sync(applier.apply)
                assert stopped, "no chunk reached the stage"
                assert not r.deltas and victim in r.missing
                if not align:  # the other rank's complete window is dropped too
                    assert set(r.missing) == set(range(world))
                assert applier.stages[-1].discarded is not None
                after = applier.tables()
                assert after.keys() == before.keys()
                for n, t in before.items():
                    assert torch.equal(after[n], t), n
            finally:
                c.close()
        applier.on_write = None
        with (
            sidecars(tmp_path / "spool", redis_url, world, 1 << 16) as servers,
            consumer(f"fresh-{held}", servers) as c,
        ):
            assert streamed(c, applier).step == 10
        got = applier.tables()
        for n, t in truth.items():
            assert torch.equal(got[n], t), n


def test_a_stall_mid_bootstrap_is_resumed_where_it_broke(tmp_path: Path, redis_url: str) -> None:
    """A stream that stalls past its deadline after staging rows: a retry from the start
    would stage again over rows it cannot tell apart, so the retry asks the same resync
    window to go on after the chunks that arrived (GetDeltaRequest.resume); the same pull
    installs the whole table, every row staged once. (A window that cannot be continued:
    tests/test_stall.py.)"""
    trainer = FakeTrainer(tmp_path / "spool", world_size=1, tables={"t0": (2000, 16)})
    trainer.start(0)
    truth = _truth(trainer)
    stalls = [0]

    def stall(rank: int, update: ShardUpdate, stage: ResyncStage) -> None:
        if stalls[0] < 1:
            stalls[0] += 1
            time.sleep(1.5)  # past the 1 s deadline (counted from before this chunk)

    applier = _Hooked(stall)
    with (
        sidecars(tmp_path / "spool", redis_url, 1) as servers,
        consumer("slow", servers, rpc_deadline_s=1.0, align_steps=False) as c,
    ):
        r = c.sync(applier.apply)
        assert r.resync and not r.missing, r.missing
        assert applier.stages[-1].installed
    for n, t in truth.items():
        assert torch.equal(applier.tables()[n], t), n
    # rows came chunk by chunk, none of them the whole table, each row once
    rows = [n for _, n in applier.chunks]
    assert len(rows) >= 3 and max(rows) < 2000 and sum(rows) == 2000, rows


def test_a_failed_apply_discards_the_stage_and_keeps_the_tables(
    tmp_path: Path, redis_url: str
) -> None:
    """The applier refuses a staged window at apply time (the held table was replaced while
    the resync was staged): nothing is installed, the error reaches the caller, and nothing
    is committed, so the next pull bootstraps."""
    trainer = FakeTrainer(tmp_path / "spool", world_size=1, tables={"t0": (500, 8)})
    trainer.start(0)
    applier = TensorDictApplier({"t0": torch.full((500, 8), 7.0)})
    with (
        sidecars(tmp_path / "spool", redis_url, 1) as servers,
        consumer("c", servers, align_steps=False) as c,
    ):
        r = c.pull(applier=applier)
        stage = r.deltas[0].stage
        assert stage is not None
        replaced = torch.full((500, 8), 9.0)
        applier.tables()["t0"] = replaced
        with pytest.raises(ConsumerError, match="replaced while its resync was staged"):
            applier.apply(r.deltas)
        assert applier.tables()["t0"] is replaced and bool((replaced == 9.0).all())
        assert stage.discarded is not None
        with pytest.raises(ConsumerError, match="discarded"):
            applier.apply(r.deltas)  # a discarded stage is never installed later
        streamed(c, applier)
    assert torch.equal(applier.tables()["t0"], trainer.history[0]["t0"])
    assert applier.tables()["t0"] is replaced  # installed in place, as an assembled resync


def test_sync_streams_only_into_appliers_whose_apply_installs_stages() -> None:
    """``sync(applier.apply)`` streams for deltad's own ``apply`` (and for an applier passed
    itself); a plain callable, or a subclass that overrides ``apply`` (it may not install
    stages), gets assembled windows."""

    class Custom(TensorDictApplier):
        def apply(self, deltas: Any) -> int:
            return 0

    plain, hooked, custom = TensorDictApplier(), _Hooked(), Custom()
    assert _applier_of(plain.apply) is plain
    assert _applier_of(hooked.apply) is hooked  # overrides stage(), not apply
    assert _applier_of(custom) is custom
    assert _applier_of(custom.apply) is None
    assert _applier_of(lambda deltas: plain.apply(deltas)) is None


@pytest.mark.parametrize("held", [False, True], ids=["fresh", "held"])
def test_a_staged_resync_and_another_ranks_delta_equal_the_assembled_apply(held: bool) -> None:
    """One pull where rank 0 resyncs (streamed: rows 0..4 and 9 in two chunks, columns 0..4
    of rows 5..6 in a third) and rank 1 sends a plain delta into the same table (rows 7, 8):
    applying both gives the same table as applying the assembled windows, fresh or over a
    held table (whose rows no window carries keep their values, in place)."""
    gen = torch.Generator().manual_seed(0)
    full = Shard.columns_of("t", 10, 8, 0, 8)
    cols = Shard.columns_of("t", 10, 8, 0, 4)
    parts = [
        ShardUpdate(full, torch.arange(0, 3), torch.randn(3, 8, generator=gen)),
        ShardUpdate(full, torch.tensor([3, 4, 9]), torch.randn(3, 8, generator=gen)),
        ShardUpdate(cols, torch.tensor([5, 6]), torch.randn(2, 4, generator=gen)),
    ]
    other = ShardUpdate(full, torch.tensor([7, 8]), torch.randn(2, 8, generator=gen))

    def delta(rank: int, shards: list[ShardUpdate], resync: bool) -> RankDelta:
        return RankDelta(
            rank=rank, generation=1, resync=resync, from_seq=0, to_seq=1, to_step=10,
            form=Form.ROWS, wire_dtype=WireDtype.FP32, cursor=Cursor("c", rank, 1, 1, 10),
            shards=shards, rows=sum(s.ids.numel() for s in shards),
        )  # fmt: skip

    start = torch.randn(10, 8, generator=gen)
    a = TensorDictApplier({"t": start.clone()} if held else None)
    a.apply([delta(0, parts, True), delta(1, [other], False)])
    b = TensorDictApplier({"t": start.clone()} if held else None)
    kept = b.tables().get("t")
    stage = b.stage()
    assert stage.open(0, full, 0) and stage.open(0, cols, 0)
    for p in parts:
        stage.write(0, p)
    assert torch.equal(b.tables()["t"], start) if held else b.tables() == {}  # nothing yet
    d0 = delta(0, [], True)
    d0.stage, d0.rows = stage, 8
    assert b.apply([d0, delta(1, [other], False)]) == 10
    assert torch.equal(b.tables()["t"], a.tables()["t"])
    if held:
        assert b.tables()["t"] is kept
        assert torch.equal(b.tables()["t"][5:7, 4:], start[5:7, 4:])  # columns not sent
    assert stage.installed


def test_a_serving_model_bootstraps_over_a_link_that_keeps_dropping(
    tmp_path: Path, redis_url: str
) -> None:
    """An int8 serving model (QuantApplier, packed-int8 wire) bootstrapped through a link cut
    every 200 kB of a 1.2 MB window (64 kB messages): each retry goes on where the cut left
    the stream, and the model serves exactly what one bootstrapped directly serves."""
    from bench.netproxy import DroppingProxy

    tables = {"t0": (12_000, DIM), "t1": (9000, DIM), "seq": (8000, DIM)}
    trainer = FakeTrainer(tmp_path / "spool", world_size=1, tables=tables)
    trainer.start(0)
    trainer.step(10)
    pull = PullOptions(wire_dtype=packed_wire_dtype(ServeDtype.INT8), dense=False)
    states = []
    with sidecars(tmp_path / "spool", redis_url, 1) as servers:
        for how in ("direct", "link"):
            torch.manual_seed(123)
            model = ClickModel({"t0": 12_000, "t1": 9000}, 8000, dim=DIM).eval()
            q = QuantApplier(quantize_model(model, ServeDtype.INT8), chunk_rows=16)
            if how == "direct":
                with consumer("near", servers, pull=pull) as c:
                    streamed(c, q)
            else:
                with DroppingProxy(servers[0].endpoint, drop_after=200_000, drops=1000) as link:
                    cfg = ConsumerConfig(
                        consumer="far", model="m", sidecars=(link.endpoint,), pull=pull,
                        rpc_deadline_s=10.0, max_retries=60, backoff_initial_s=0.01,
                        backoff_max_s=0.05,
                    )  # fmt: skip
                    with DeltaConsumer(cfg).connect() as c:
                        streamed(c, q)
                    assert link.cut >= 4, link.cut
            states.append(serving_state(q.model))
    got, want = states
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]), k
