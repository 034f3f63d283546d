"""A window a predictor cannot apply never stops it: nothing of it is applied or committed, the
model serves what it held, the result and log say so, and the consumer backs off and asks the
ranks for their full tables again until a window it can apply comes (issue 37).

The end-to-end case is the one no sidecar can refuse: each rank's segments are consistent, but
two ranks give one raw id to two slots of the same managed-collision table.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from spoolkit import FakeTrainer, wait_for
from test_relay import at_step, predictor, tree

from deltad.consume.appliers import TensorDictApplier
from deltad.consume.window import RankDelta, ShardUpdate
from deltad.errors import ConsumerError, WindowRefused
from deltad.segment.format import read_segment, write_segment
from deltad.segment.spool import SpoolLayout
from deltad.types import EMPTY_RAW_ID, Cursor, Form, SegmentKind, Shard, WireDtype

pytestmark = pytest.mark.timeout(180)


class RefusingApplier(TensorDictApplier):
    """A dict applier whose ``apply`` refuses the first ``times`` windows it is handed."""

    def __init__(self, times: int, tables: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__(tables)
        self.times = times
        self.handed: list[list[RankDelta]] = []

    def apply(self, deltas: Sequence[RankDelta]) -> int:
        self.handed.append(list(deltas))
        if len(self.handed) <= self.times:
            raise WindowRefused(f"refusal {len(self.handed)} of {self.times}")
        return super().apply(deltas)


@pytest.mark.parametrize("relays", [0, 1], ids=["sidecars", "through-relays"])
def test_a_refused_window_is_never_committed_and_the_next_pulls_rebase_after_a_backoff(
    tmp_path: Path, redis_url: str, relays: int
) -> None:
    """Directly from the sidecars, and through a relay per rank (its full tables are the relay's
    mirrored log, rebased the same way)."""
    ft = FakeTrainer(tmp_path / "spool", world_size=2)
    ft.start(0)
    ft.step(10)
    with tree(tmp_path, redis_url, 2, relays) as levels, predictor("p", levels[-1]) as c:
        wait_for(lambda: at_step(levels[-1], 10), 30, "servers at step 10")
        ok = TensorDictApplier()
        assert c.sync(ok.apply).step == 10  # bootstrapped
        cursors = list(c.cursors)
        ft.step(20)
        wait_for(lambda: at_step(levels[-1], 20), 30, "servers at step 20")
        applier = RefusingApplier(2, {n: t.clone() for n, t in ok.tables().items()})
        held = {n: t.clone() for n, t in applier.tables().items()}
        r = c.sync(applier)
        assert r.refused == "refusal 1 of 2" and not r.caught_up and r.retry_in_s > 0
        assert all(torch.equal(applier.tables()[n], t) for n, t in held.items())
        assert c.cursors == cursors  # not committed
        with pytest.raises(ConsumerError, match="never committed"):
            c.commit(r)
        started = time.monotonic()
        r2 = c.sync(applier)  # waits out the backoff, asks every rank for its full tables
        assert time.monotonic() - started >= r.retry_in_s * 0.9
        assert r2.refused == "refusal 2 of 2" and r2.retry_in_s > 0
        assert all(d.resync for d in applier.handed[1])
        r3 = c.sync(applier)
        assert r3.refused is None and r3.resync and r3.step == 20 and r3.caught_up
        assert all(torch.equal(applier.tables()[n], ft.history[20][n]) for n in ft.history[20])
        assert c.refusals == 0 and c.refusals_total == 2
        assert [cur.step for cur in c.cursors if cur is not None] == [20, 20]


def test_every_applier_refuses_an_inconsistent_window_whole(tmp_path: Path) -> None:
    """Float, dict and quantized appliers: WindowRefused, and nothing of the window written
    (the identity checks come after rows of other tables were planned)."""
    from torchrec import EmbeddingCollection, EmbeddingConfig

    from deltad.consume.appliers import TorchRecApplier
    from deltad.consume.quant import QuantApplier, quantize_model
    from deltad.types import ServeDtype

    sh = Shard("t", 16, 4, 0, 16, 0, 4)
    good = ShardUpdate(sh, torch.tensor([1, 2]), torch.ones(2, 4))
    short = ShardUpdate(sh, torch.tensor([3]), torch.ones(2, 4))  # two rows for one id
    window = RankDelta(
        rank=0, generation=1, resync=False, from_seq=0, to_seq=1, to_step=1, form=Form.ROWS,
        wire_dtype=WireDtype.FP32, shards=[good, short], cursor=Cursor("p", 0, 1, 1, 1),
    )  # fmt: skip
    d = TensorDictApplier({"t": torch.zeros(16, 4)})
    with pytest.raises(WindowRefused):
        d.apply([window])
    assert not d.tables()["t"].any()
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=16, feature_names=["f"])],
        device=torch.device("cpu"),
    )
    before = ec.embeddings["t"].weight.detach().clone()
    with pytest.raises(WindowRefused):
        TorchRecApplier(ec).apply([window])
    assert torch.equal(ec.embeddings["t"].weight, before)
    q = quantize_model(torch.nn.Sequential(ec).eval(), ServeDtype.INT8)
    qa = QuantApplier(q)
    held = {k: v.clone() for k, v in q.state_dict().items() if isinstance(v, torch.Tensor)}
    with pytest.raises(WindowRefused):
        qa.apply([window])
    assert all(torch.equal(q.state_dict()[k], v) for k, v in held.items())


# ---- end to end: a trainer, two sidecars, a live int8 serving predictor ---------------------


def _rows_of(layout: SpoolLayout, rank: int, table: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's current rows and slot -> raw id map of ``table`` (base + segments)."""
    rows: torch.Tensor | None = None
    raw: torch.Tensor | None = None
    start = 0
    for _, path in layout.segments(1, rank):
        for c in read_segment(path).shards:
            if c.shard.table != table:
                continue
            start = c.shard.row_start
            n = c.shard.row_end - start
            if rows is None:
                rows = torch.zeros(n, c.shard.dim)
                raw = torch.full((n,), EMPTY_RAW_ID, dtype=torch.int64)
            assert raw is not None and c.raw_ids is not None
            rows[c.ids - start] = c.values.float()
            raw[c.ids - start] = c.raw_ids
    assert rows is not None and raw is not None
    return rows, raw


def _publish(layout: SpoolLayout, rank: int, world: int, step: int, shards: list[Any]) -> None:
    seq = max(s for s, _ in layout.segments(1, rank)) + 1
    write_segment(
        layout.segment_path(1, rank, seq), model="m", generation=1, rank=rank, world_size=world,
        seq=seq, step=step, kind=SegmentKind.DELTA, shards=shards, fsync=False,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_live_serving_predictor_keeps_serving_through_a_window_it_cannot_apply_and_recovers(
    tmp_path: Path, redis_url: str
) -> None:
    from shardkit import spawn
    from test_zch_predictor import E2EModel, _train_worker, e2e_check, e2e_reference
    from test_zch_trainer import STEPS

    from deltad.consume.quant import QuantApplier, quantize_model
    from deltad.consume.window import ShardUpdate  # noqa: F401  (the wire's shard type)
    from deltad.segment.format import ShardRows
    from deltad.types import ServeDtype

    world = 2
    spool = tmp_path / "spool"
    spawn(_train_worker, world, tmp_path, str(spool), "ebc", "lru", 1, str(tmp_path))
    layout = SpoolLayout(spool, "m")
    served = quantize_model(E2EModel("ebc", "lru").eval(), ServeDtype.INT8)
    applier = QuantApplier(served, chunk_rows=5)
    ref, slot_map = e2e_reference(tmp_path, "ebc", "lru", 1, world, ServeDtype.INT8)
    probe = {"fz": torch.tensor([1, 2, 3])}
    forwards: list[float] = []
    stop = threading.Event()

    def serve() -> None:  # a forward every few ms, as a predictor answers requests
        from test_zch_predictor import probe_forward

        while not stop.is_set():
            with applier.serving():
                probe_forward(served, "z", probe["fz"])
            forwards.append(time.monotonic())
            time.sleep(0.002)

    with tree(tmp_path, redis_url, world, 0) as levels, predictor("p", levels[0]) as c:
        wait_for(lambda: at_step(levels[0], STEPS), 60, f"sidecars at step {STEPS}")
        r = c.sync(applier)
        while not r.caught_up:
            r = c.sync(applier)
        e2e_check(served, applier, ref, slot_map, set(range(2000)) - set(slot_map.tolist()))
        held = {k: v.clone() for k, v in served.state_dict().items() if isinstance(v, torch.Tensor)}
        server = threading.Thread(target=serve, daemon=True)
        server.start()
        # rank 1 gives a slot of its own the raw id a slot of rank 0 holds: each rank's log is
        # consistent (its sidecar serves it), the whole table is not
        rows1, raw1 = _rows_of(layout, 1, "z")
        _, raw0 = _rows_of(layout, 0, "z")
        stolen = int(raw0[raw0 != EMPTY_RAW_ID][0])
        n0 = raw0.numel()
        victim = 0  # rank 1's first slot (global n0)
        shard = next(
            c.shard for _, p in layout.segments(1, 1) for c in read_segment(p).shards
            if c.shard.table == "z"
        )  # fmt: skip
        old = int(raw1[victim])
        ev = [] if old == EMPTY_RAW_ID else [old]

        def z(raw: int, evicted: list[int]) -> ShardRows:
            return ShardRows(
                shard, torch.tensor([n0 + victim]), rows1[victim : victim + 1].clone(),
                torch.tensor([raw]), torch.tensor(evicted, dtype=torch.int64),
            )  # fmt: skip

        _publish(layout, 1, world, STEPS + 1, [z(stolen, ev)])
        _publish(layout, 0, world, STEPS + 1, [])
        wait_for(lambda: at_step(levels[0], STEPS + 1), 30, "sidecars at the hostile step")
        r = c.sync(applier)
        assert r.refused is not None and "two slots" in r.refused, r.refused
        count = len(forwards)
        time.sleep(0.3)
        assert len(forwards) > count, "forwards stopped"
        now = {k: v for k, v in served.state_dict().items() if isinstance(v, torch.Tensor)}
        assert all(torch.equal(now[k], v) for k, v in held.items()), "a refused window wrote"
        # refused again (from the bases: the same identities) until the trainer's next
        # segment gives the slot its raw id back
        r = c.sync(applier)
        assert r.refused is not None and c.refusals == 2
        _publish(layout, 1, world, STEPS + 2, [z(old, [])])  # (rank 0 still holds it)
        _publish(layout, 0, world, STEPS + 2, [])
        wait_for(lambda: at_step(levels[0], STEPS + 2), 30, "sidecars at the repaired step")
        for _ in range(20):
            r = c.sync(applier)
            if r.refused is None and r.caught_up:
                break
        assert r.refused is None and r.step == STEPS + 2 and r.resync
        stop.set()
        server.join(10)
        e2e_check(served, applier, ref, slot_map, set(range(2000)) - set(slot_map.tolist()))


def test_the_predictor_loop_logs_a_refusal_counts_it_and_goes_on(
    tmp_path: Path, redis_url: str
) -> None:
    """``deltad consume``'s loop: a refused pull is a log line with ``refused`` (nothing
    served from it), counted in the summary; the loop backs off, goes on, and serves the
    next window it can apply."""
    from consumers.predictor import SyncLoop, SyncLoopConfig
    from deltad.config import ConsumerConfig

    ft = FakeTrainer(tmp_path / "spool", world_size=2)
    ft.start(0)
    ft.step(10)
    log = tmp_path / "p.jsonl"
    with tree(tmp_path, redis_url, 2, 0) as levels:
        wait_for(lambda: at_step(levels[0], 10), 30, "sidecars at step 10")
        cc = ConsumerConfig(
            consumer="p", model="m", sidecars=tuple(levels[0]), backoff_initial_s=0.05
        )
        loop = SyncLoop(
            SyncLoopConfig(consumer=cc, interval_s=0.05, pulls=4, json_log=str(log), metrics_port=0)
        )
        loop.applier = RefusingApplier(times=2)
        summary = loop.run()
        assert loop.metrics is not None
        from prometheus_client import generate_latest

        scraped = generate_latest(loop.metrics.registry).decode()
        assert 'deltad_predictor_refused_windows_total{consumer="p",model="m"} 2.0' in scraped
        assert 'deltad_predictor_served_step{consumer="p",model="m"} 10.0' in scraped
        assert 'deltad_predictor_refusals_in_a_row{consumer="p",model="m"} 0.0' in scraped
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    pulls = [x for x in lines if x["event"] == "pull"]
    assert [bool(x["refused"]) for x in pulls][:3] == [True, True, False], pulls
    assert pulls[0]["step"] is None and pulls[0]["rows"] == 0 and pulls[0]["retry_in_s"] > 0
    assert pulls[2]["step"] == 10 and pulls[2]["resync"]
    assert summary.refused == 2 and lines[-1]["refused"] == 2
    got = loop.applier.tables()
    assert all(torch.equal(got[n], ft.history[10][n]) for n in ft.history[10])
