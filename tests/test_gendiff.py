"""Generation diffs (deltad.serve.windows.gendiff): after a trainer restart a predictor at the old
generation gets only the rows that differ, applied in place, and ends bit-equal to the new
generation; where no diff can be made it resyncs and the header says why. Real sidecars on port
0 (in-process and `deltad serve` subprocesses), real Redis, real DeltaConsumers; the reference
trainer (2 gloo ranks) in the slow test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from serverkit import Client, Replica, SpoolWriter, server_config
from spoolkit import (
    FakeTrainer,
    child_env,
    cli_sidecar,
    read_serving_line,
    stop_process,
    wait_for,
)
from test_relay import at_step, equal, predictor, status, tree

from deltad.consume.appliers import TensorDictApplier
from deltad.consume.window import RankDelta
from deltad.serve.edge.app import SidecarServer
from deltad.store import EmbeddedRedis
from deltad.types import Form, WireDtype

pytestmark = pytest.mark.timeout(180)

SHAPES = {"t0": (400, 8), "t1": (200, 4)}


def restart(
    ft: FakeTrainer, generation: int, frac: float, seed: int = 11, step: int = 100
) -> FakeTrainer:
    """The trainer restarted as ``generation`` from its current tables with ``frac`` of each
    table's rows changed; its base is published at ``step``."""
    new = FakeTrainer(
        ft.layout.root, world_size=ft.world_size, generation=generation, tables=ft.shapes,
        seed=seed,
    )  # fmt: skip
    new.tables = {n: t.clone() for n, t in ft.tables.items()}
    for t in new.tables.values():
        ids = torch.randperm(t.shape[0], generator=new.gen)[: int(frac * t.shape[0])]
        t[ids] += 1.0
    new.start(step)
    return new


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def assert_exact_diff(
    held: dict[str, torch.Tensor], truth: dict[str, torch.Tensor], deltas: Sequence[RankDelta]
) -> int:
    """The windows sent exactly the (row, column slice)s where ``held`` differs bit-wise from
    ``truth``: every differing element was sent, every row sent differs in its slice. Returns
    the rows sent."""
    sent = {n: torch.zeros(t.shape, dtype=torch.bool) for n, t in truth.items()}
    rows = 0
    for d in deltas:
        for s in d.shards:
            c0, c1 = s.shard.col_start, s.shard.col_end
            a, b = bits(held[s.shard.table][s.ids, c0:c1]), bits(truth[s.shard.table][s.ids, c0:c1])
            assert (a != b).any(dim=1).all(), f"{s.shard.table}: a row sent that did not change"
            sent[s.shard.table][s.ids, c0:c1] = True
            rows += s.ids.numel()
    for n, t in truth.items():
        differs = bits(held[n]) != bits(t)
        assert not (differs & ~sent[n]).any(), f"{n}: a changed row was not sent"
    return rows


def metric(srv: SidecarServer, name: str) -> float:
    v = srv.metrics.registry.get_sample_value(
        f"deltad_{name}_total", {"model": srv.config.model, "rank": str(srv.config.rank)}
    )
    return float(v or 0.0)


@contextmanager
def sidecars(spool: Path, redis_url: str, world: int, **kw: Any) -> Iterator[list[SidecarServer]]:
    servers = [
        SidecarServer(server_config(spool, redis_url, rank=r, grace_period_s=0.2, **kw)).start()
        for r in range(world)
    ]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop(0)


def test_a_restart_costs_a_predictor_only_the_rows_that_differ(
    tmp_path: Path, redis_url: str
) -> None:
    """World size 2: predictor at (gen 1, step 20) while gen 1 went on to step 30; the trainer
    restarts from step 30 with 5% of rows changed, then publishes step 110. The predictor's
    next pull is a diff against what it holds (step 20), not the old head."""
    ft = FakeTrainer(tmp_path / "spool", world_size=2, tables=SHAPES)
    ft.start(0)
    ft.step(10, touch=30)
    ft.step(20, touch=30)
    with (
        sidecars(tmp_path / "spool", redis_url, 2) as servers,
        predictor("p", [s.endpoint for s in servers]) as c,
    ):
        eps = [s.endpoint for s in servers]
        wait_for(lambda: at_step(eps, 20), 30, "sidecars at step 20")
        applier = TensorDictApplier()
        assert c.sync(applier.apply).step == 20
        ft.step(30, touch=30)  # the predictor never pulls it
        new = restart(ft, 2, 0.05)
        new.step(110, touch=10)
        wait_for(lambda: at_step(eps, 110, 2), 30, "sidecars at generation 2")
        held = {n: t.clone() for n, t in applier.tables().items()}
        built = [metric(s, "window_build_cpu_seconds") for s in servers]
        r = c.sync(applier.apply)
        assert r.step == 110 and not r.resync and r.generation_diff
        # the diff's build is CPU the sidecars account for (deltad_window_build_cpu_seconds)
        after = [metric(s, "window_build_cpu_seconds") for s in servers]
        assert all(a > b for a, b in zip(after, built, strict=True)), (built, after)
        assert all(d.generation_diff == 1 and d.generation == 2 for d in r.deltas)
        assert all(d.from_seq == -1 and d.resync_reason == "" for d in r.deltas)
        rows = assert_exact_diff(held, new.history[110], r.deltas)
        assert 0 < rows < sum(n for n, _ in SHAPES.values()) // 2
        assert equal(applier, new.history[110])
        # the cursor moved to generation 2: the next pull is an ordinary (empty) window
        again = c.sync(applier.apply)
        assert not again.resync and again.rows == 0 and not again.generation_diff
        assert all(metric(s, "generation_diffs") == 1 for s in servers)
        assert all(metric(s, "generation_resyncs") == 0 for s in servers)
        # a predictor without a cursor: a resync, and it says so
        with predictor("fresh", eps) as f:
            fresh = TensorDictApplier()
            r = f.sync(fresh.apply)
            assert r.resync and r.resync_reasons == {0: "no cursor", 1: "no cursor"}
            assert equal(fresh, new.history[110])


def _pull_base(c: Client, name: str, **kw: Any) -> RankDelta:
    d = c.pull(name, **kw)
    c.commit(d)
    return d


@pytest.mark.parametrize(
    ("form", "dtype"),
    [
        (Form.ROWS, WireDtype.FP16),
        (Form.ROWS, WireDtype.INT8),
        (Form.ROWS, WireDtype.PACKED_INT8),
        (Form.ROWS, WireDtype.PACKED_FP16),
        (Form.IDS, WireDtype.FP32),
    ],
)
def test_a_diff_in_every_form_and_dtype_matches_a_resync(
    tmp_path: Path, redis_server: EmbeddedRedis, form: Form, dtype: WireDtype
) -> None:
    """The diff's rows are those that differ, in the request's form and dtype, with the same
    bytes a full resync sends for them."""
    spool = SpoolWriter(tmp_path / "spool")
    cfg = server_config(tmp_path / "spool", redis_server.url)
    srv = SidecarServer(cfg).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        kw: dict[str, Any] = {"form": form, "dtype": dtype}
        spool.delta()
        wait_for(lambda: srv.log.snapshot().head.seq == 1, 10, "seq 1")  # type: ignore[union-attr]
        _pull_base(c, "p", **kw)
        held = {t: spool.shard(t).clone() for t in spool.specs}
        truth = {t: v.clone() for t, v in spool.truth.items()}
        for t in truth.values():
            t[torch.randperm(t.shape[0])[: t.shape[0] // 20]] *= 3
        spool.start_generation(2, truth=truth)
        wait_for(lambda: srv.log.snapshot().generation == 2, 10, "generation 2")  # type: ignore[union-attr]
        d = c.pull("p", **kw)
        full = c.pull("q", **kw)
        assert d.generation_diff == 1 and not d.resync and full.resync
        assert full.resync_reason == "no cursor"
        by_table = {s.shard.table: s for s in full.shards}
        for s in d.shards:
            want = (bits(held[s.shard.table]) != bits(spool.shard(s.shard.table))).any(dim=1)
            assert torch.equal(s.ids, want.nonzero().squeeze(1)), s.shard.table
            ref = by_table[s.shard.table]
            for got, base in ((s.values, ref.values), (s.packed, ref.packed)):
                assert (got is None) == (base is None)
                if got is not None and base is not None:
                    assert torch.equal(got, base[s.ids])  # the resync's rows are all of them
        assert d.rows > 0 and d.bytes < full.bytes / 4
    finally:
        c.close()
        srv.stop(0)


def test_top_k_owed_rows_come_with_the_diff(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    """A top-k predictor holds stale values for the rows still owed to it: the diff carries
    them too, and it ends bit-equal to the new generation."""
    spool = SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        replica = Replica()
        replica.apply(_pull_base(c, "p", form=Form.TOPK, k=3))
        spool.delta(n=40)
        wait_for(lambda: srv.log.snapshot().head.seq == 1, 10, "seq 1")  # type: ignore[union-attr]
        d = _pull_base(c, "p", form=Form.TOPK, k=3)
        replica.apply(d)
        assert sum(s.owed for s in d.shards) > 0
        truth = {t: v.clone() for t, v in spool.truth.items()}
        truth["t0"][:5] += 1.0  # 1% of t0; the owed rows keep their (newer) values
        spool.start_generation(2, truth=truth)
        wait_for(lambda: srv.log.snapshot().generation == 2, 10, "generation 2")  # type: ignore[union-attr]
        d = c.pull("p", form=Form.TOPK, k=3)
        assert d.generation_diff == 1 and all(s.owed == 0 for s in d.shards)
        replica.apply(d)
        c.commit(d)
        for t in spool.specs:
            assert torch.equal(replica.tables[t], spool.truth[t]), t
    finally:
        c.close()
        srv.stop(0)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"generation_keep_s": 0.3}, "was dropped after 0.3 s"),
        ({"generation_keep_bytes": 1000}, "is over generation_keep_bytes = 1000"),
        ({"generation_keep_s": 0.0}, "previous generations are not kept"),
        ({"shape": (1000, 16)}, "tables changed: t0"),
    ],
)
def test_no_diff_is_a_full_resync_that_says_why(
    tmp_path: Path, redis_server: EmbeddedRedis, kw: dict[str, Any], why: str
) -> None:
    shape = kw.pop("shape", None)
    spool = SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url, **kw)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        replica = Replica()
        replica.apply(_pull_base(c, "p"))
        if shape is not None:
            spool.specs["t0"] = shape
        spool.start_generation(2)
        wait_for(lambda: srv.log.snapshot().generation == 2, 10, "generation 2")  # type: ignore[union-attr]
        time.sleep(0.4)  # past a 0.3 s keep
        d = c.pull("p")
        assert d.resync and d.generation_diff is None and d.generation == 2
        assert d.resync_reason.startswith("new generation: ") and why in d.resync_reason
        assert metric(srv, "generation_resyncs") == 1 and metric(srv, "generation_diffs") == 0
        # the opt-out: a full resync even while the log is held
        assert c.pull("p", no_generation_diff=True).resync
    finally:
        c.close()
        srv.stop(0)


def test_the_opt_out_and_from_base_are_full_resyncs(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        _pull_base(c, "p")
        spool.start_generation(2)
        wait_for(lambda: srv.log.snapshot().generation == 2, 10, "generation 2")  # type: ignore[union-attr]
        d = c.pull("p", no_generation_diff=True)
        assert d.resync and "no generation diff asked" in d.resync_reason
        d = c.pull("p", from_base=True)
        assert d.resync and d.resync_reason == "asked"
        d = c.pull("p")  # still at generation 1 (nothing committed): the diff
        assert d.generation_diff == 1 and not d.resync
    finally:
        c.close()
        srv.stop(0)


def _serve_args(spool: Path, redis_url: str) -> list[str]:
    return ["--spool", str(spool), "--model", "m", "--rank", "0", "--listen", "127.0.0.1:0",
            "--redis-url", redis_url, "--poll-interval", "0.02", "--grace-period", "0.2"]  # fmt: skip


def _serve(spool: Path, redis_url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "serve", *_serve_args(spool, redis_url)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
        start_new_session=True,
    )  # fmt: skip


def test_kill_9_of_the_sidecar_after_the_switch_resyncs_with_the_reason(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """The previous generation's log is held in memory only (its files leave the spool at the
    switch): a sidecar killed after the switch restarts without it, and the predictor at the
    old generation resyncs, told why."""
    spool = SpoolWriter(tmp_path / "spool")
    proc = _serve(tmp_path / "spool", redis_server.url)
    restarted: SidecarServer | None = None
    try:
        endpoint = read_serving_line(proc, 60)
        c = Client(endpoint)
        replica = Replica()
        replica.apply(_pull_base(c, "p"))
        truth = {t: v.clone() for t, v in spool.truth.items()}
        truth["t1"][:10] += 1.0
        spool.start_generation(2, truth=truth)
        wait_for(lambda: status(endpoint).generation == 2, 20, "the switch")
        assert not spool.layout.segments(1, 0)  # the old generation's files are gone
        c.close()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        # the restart: the same `deltad serve` command line, in this process (a new process
        # would hold nothing more than a new server object does)
        restarted = cli_sidecar(*_serve_args(tmp_path / "spool", redis_server.url))
        c = Client(restarted.endpoint)
        d = c.pull("p")
        assert d.resync and d.generation == 2
        assert d.resync_reason == (
            "new generation: no generation switch since this sidecar started"
        )
        replica.apply(d)
        for t in spool.specs:
            assert torch.equal(replica.tables[t][slice(*spool.rows(t))], spool.shard(t))
        c.close()
    finally:
        stop_process(proc)
        if restarted is not None:
            restarted.stop(0)


def test_a_predictor_behind_a_relay_gets_the_diff_from_the_relay(
    tmp_path: Path, redis_url: str
) -> None:
    """The relay takes a full resync from its upstream on a generation change (it writes a
    base) and serves its own predictors diffs from the previous log it holds."""
    ft = FakeTrainer(tmp_path / "spool", world_size=1, tables=SHAPES)
    ft.start(0)
    ft.step(10, touch=20)
    with tree(tmp_path, redis_url, 1, 1) as levels, predictor("p", levels[1]) as c:
        wait_for(lambda: at_step(levels[1], 10), 30, "relay at step 10")
        applier = TensorDictApplier()
        assert c.sync(applier.apply).resync
        new = restart(ft, 2, 0.05)
        new.step(110, touch=10)
        wait_for(lambda: at_step(levels[1], 110, 2), 30, "relay at generation 2")
        held = {n: t.clone() for n, t in applier.tables().items()}
        r = c.sync(applier.apply)
        assert r.generation_diff and not r.resync and r.step == 110
        assert_exact_diff(held, new.history[110], r.deltas)
        assert equal(applier, new.history[110])


@pytest.mark.slow
def test_reference_trainer_restart_is_a_bit_equal_diff(tmp_path: Path, redis_url: str) -> None:
    """The reference trainer (2 gloo ranks, mixed sharding) trains generation 3 for 24 steps;
    a predictor follows it to the end. It restarts as generation 4 from scratch (same seed)
    and stops at step 12: the predictor's diff is exactly the rows that differ from what it
    holds, and it ends bit-equal to generation 4's final tables."""

    def train(generation: int, steps: int, final: Path) -> None:
        p = subprocess.run(
            [sys.executable, "-m", "deltad.commands.main", "train", "--spool", str(tmp_path / "spool"),
             "--model", "m", "--world-size", "2", "--tables", "3", "--rows", "400", "--dim",
             "8", "--steps", str(steps), "--publish-every-steps", "2", "--generation",
             str(generation), "--no-progress", "--final-tables", str(final), "--no-fsync"],
            env={**child_env(), "TMPDIR": str(tmp_path)}, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr[-2000:]
        assert "leaked semaphore" not in p.stderr  # the ranks release what they created

    train(3, 24, tmp_path / "final3.pt")
    truth3 = torch.load(tmp_path / "final3.pt", weights_only=True)
    with tree(tmp_path, redis_url, 2, 0) as levels, predictor("p", levels[0]) as c:
        applier = TensorDictApplier()
        deadline = time.monotonic() + 60
        while not equal(applier, truth3) and time.monotonic() < deadline:
            c.sync(applier.apply)
            time.sleep(0.05)
        assert equal(applier, truth3)
        train(4, 12, tmp_path / "final4.pt")
        truth4 = torch.load(tmp_path / "final4.pt", weights_only=True)
        wait_for(
            lambda: all(s.generation == 4 and s.head_step == 12 for s in map(status, levels[0])),
            60,
            "generation 4 at step 12",
        )
        held = {n: t.clone() for n, t in applier.tables().items()}
        r = c.sync(applier.apply)
        assert r.generation_diff and not r.resync and r.step == 12
        rows = assert_exact_diff(held, truth4, r.deltas)
        assert equal(applier, truth4)
        total = sum(t.shape[0] for t in truth4.values())
        print(f"reference trainer restart: diff {rows} rows of {total}")


def test_the_held_log_is_dropped_once_no_live_consumer_is_at_it(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """Retention drops the previous generation's log when the last live consumer standing on
    it moved on (here: by its diff), long before generation_keep_s."""
    spool = SpoolWriter(tmp_path / "spool")
    cfg = server_config(tmp_path / "spool", redis_server.url, retention_interval_s=0.05)
    srv = SidecarServer(cfg).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        _pull_base(c, "p")
        _pull_base(c, "q")
        spool.start_generation(2)
        wait_for(lambda: srv.log.snapshot().generation == 2, 10, "generation 2")  # type: ignore[union-attr]
        cache = srv.servicer.cache
        before = cache.nbytes
        d = c.pull("p")
        assert d.generation_diff == 1
        c.commit(d)
        assert cache.nbytes > before  # the cached diff counts in the window cache's budget
        time.sleep(0.5)  # rounds of retention: q still stands on generation 1
        assert srv.log.previous() is not None
        held = cache.nbytes
        assert held <= cache.max_bytes
        d = c.pull("q")  # the same old cursor: the cached diff
        assert d.generation_diff == 1
        c.commit(d)
        wait_for(lambda: srv.log.previous() is None, 10, "the held log dropped")
        assert "no live consumer was at it" in srv.log.previous_missing
        c.pull("p")  # the next GetDelta sees the held log gone: its diffs give their bytes back
        assert srv.servicer.windows.gendiff._cached_generation is None
        assert cache.nbytes < held
    finally:
        c.close()
        srv.stop(0)
