"""Dense state: rank 0 publishes the model's dense parameters and buffers with its segments;
the sidecar serves the newest one at or before a window's head; consumers get rows and dense
weights of one step.

The trainer side runs a real 2-rank gloo DMP (the toy model of shardkit plus an MLP with a
BatchNorm, wrapped in DDP by DMP, trained by a dense Adagrad next to the fused optimizer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from deltad.reference.trainer.train import _optimizer, shard_model
from serverkit import Client, Replica, SpoolWriter, server_config, wait_for
from shardkit import Toy, batch, spawn
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from deltad.config import ConsumerConfig, PublisherConfig, PullOptions
from deltad.consume import decode
from deltad.consume.align import dense_target
from deltad.consume.client import DeltaConsumer, RankStatus
from deltad.publish.publisher import SegmentPublisher
from deltad.segment.format import decode_dense, encode_dense, read_dense, read_segment, write_dense
from deltad.segment.spool import SpoolLayout
from deltad.serve.edge.app import SidecarServer
from deltad.serve.windows import encode
from deltad.v1 import delta_pb2 as pb

STEPS = 7
DENSE_NAMES = {
    "mlp.0.weight",
    "mlp.0.bias",
    "mlp.1.weight",
    "mlp.1.bias",
    "mlp.1.running_mean",
    "mlp.1.running_var",
    "mlp.1.num_batches_tracked",
    "mlp.2.weight",
    "mlp.2.bias",
}


class DenseToy(Toy):
    """The toy EBC + EC with a dense MLP (parameters and BatchNorm buffers) on top."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    def forward(self, b: Any) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        loss, _ = super().forward(b)
        x = torch.stack([b.seq.lengths()[:8].float(), *[b.seq.lengths()[:8].float() * 0.5] * 3], 1)
        loss = loss * 0.01 + self.mlp(x).pow(2).sum()
        return loss, loss.detach()


def _full_tables(dmp: Any, rank: int) -> dict[str, torch.Tensor]:
    """Every sharded table gathered whole on rank 0 (a collective: call on every rank)."""
    out = {}
    for key, value in dmp.state_dict().items():
        if not isinstance(value, ShardedTensor):  # a dense parameter or buffer
            continue
        full = torch.empty(value.size()) if rank == 0 else None
        value.gather(dst=0, out=full)
        if full is not None:
            out[key.split(".")[-2]] = full
    return out


def dense_dmp(world_size: int) -> Any:
    torch.manual_seed(0)
    from shardkit import EBC_TABLES, EC_TABLES

    plan = {t: st for t, (st, _) in {**EBC_TABLES, **EC_TABLES}.items()}
    return shard_model(DenseToy(), plan, world_size=world_size, learning_rate=0.1)


def _train_worker(rank: int, world_size: int, spool: str, every: int) -> None:
    dmp = dense_dmp(world_size)
    opt = _optimizer(dmp, 0.05)
    cfg = PublisherConfig(Path(spool), model="toy", every_steps=1, dense_every_steps=every)
    pub = SegmentPublisher(dmp, cfg)
    gen = pub.start(0)
    truth: dict[int, dict[str, torch.Tensor]] = {
        0: {n: t.detach().clone() for n, t in pub.dense_tensors().items()}
    }
    for step in range(1, STEPS + 1):
        if step == 2:  # a buffer replaced on its module: the new one is the dense state
            bn = next(m for m in dmp.modules() if isinstance(m, nn.BatchNorm1d))
            bn.running_mean = bn.running_mean.clone() + 1.0
            assert pub.dense_tensors()["mlp.1.running_mean"] is bn.running_mean
        loss, _ = dmp(batch(rank, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        truth[step] = {n: t.detach().clone() for n, t in pub.dense_tensors().items()}
        pub.maybe_publish(step)
    pub.close(STEPS)
    assert set(truth[0]) == DENSE_NAMES, sorted(truth[0])
    # replicated: every rank's dense parameters are the same at every step (DDP); buffers
    # (BatchNorm statistics) are each rank's own until DDP broadcasts rank 0's next forward
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, truth)
    for other in gathered[1:]:
        for step, state in truth.items():
            assert all(torch.equal(state[n], other[step][n]) for n in state if "running" not in n)
    assert not torch.equal(truth[0]["mlp.0.weight"], truth[STEPS]["mlp.0.weight"])
    assert int(truth[STEPS]["mlp.1.num_batches_tracked"]) == STEPS
    tables = _full_tables(dmp, rank)
    dist.barrier()
    if rank != 0:
        return
    torch.save({"dense": truth[STEPS], "tables": tables}, Path(spool) / "final.pt")
    layout = SpoolLayout(Path(spool), "toy")
    assert layout.dense_files(gen, 1) == []  # rank 0 publishes replicated state once
    files = layout.dense_files(gen, 0)
    seg_step = {seq: read_segment(p).header.step for seq, p in layout.segments(gen, 0)}
    # the base, the due ones, and the final segment (close(STEPS): a second one at STEPS)
    want_steps = [0, *(s for s in range(1, STEPS + 1) if every == 0 or s % every == 0), STEPS]
    assert [seg_step[seq] for seq, _ in files] == want_steps
    for seq, path in files:
        d = read_dense(path)
        assert d.header.seq == seq and d.header.step == seg_step[seq] and d.header.rank == 0
        state = truth[d.header.step]
        assert set(d.tensors) == DENSE_NAMES
        for name, t in state.items():
            assert d.tensors[name].dtype == t.dtype and torch.equal(d.tensors[name], t), name
    stats = pub.stats
    assert stats.dense_bytes == sum(read_dense(p).nbytes for _, p in files)
    assert [s.step for s in stats.segments if s.dense_bytes] == want_steps


@pytest.mark.slow
@pytest.mark.parametrize("every", [0, 3])
def test_dense_state_at_each_step_equals_the_trainers(
    tmp_path: Path, redis_url: str, every: int
) -> None:
    """2-rank gloo DMP: the dense state rank 0 published with the segment of step S equals
    the trainer's dense parameters and buffers after step S, bit for bit (every segment, or
    every 3 steps plus the base and the final segment). Then a consumer bootstraps through
    two real sidecars and receives rows and dense weights of the same (final) step."""
    spool = tmp_path / "spool"
    spawn(_train_worker, 2, tmp_path, str(spool), every)
    final = torch.load(spool / "final.pt", weights_only=True)
    servers = [
        SidecarServer(server_config(spool, redis_url, model="toy", rank=r)).start()
        for r in range(2)
    ]
    try:
        cfg = ConsumerConfig(
            consumer="pred", model="toy", sidecars=tuple(s.endpoint for s in servers)
        )
        with DeltaConsumer(cfg) as c:
            wait_for(lambda: [s.head_step for s in c.status()] == [STEPS, STEPS], 30.0)
            rep = Replica()
            r = c.pull()
            assert r.step == r.served_step == STEPS and r.dense_step == STEPS, r.missing
            assert r.resync and r.deltas[0].dense and not r.deltas[1].dense
            for d in r.deltas:
                rep.apply(d)
            c.commit(r)
            assert set(r.dense) == DENSE_NAMES
            for name, t in final["dense"].items():
                assert torch.equal(r.dense[name], t), name
            assert r.dense_bytes == sum(t.nbytes for t in final["dense"].values())
            assert r.bytes > r.dense_bytes > 0
            for name, t in final["tables"].items():
                assert torch.equal(rep.tables[name], t), name
            again = c.pull()  # nothing new: no rows, no dense state
            assert again.step == STEPS and again.rows == 0 and again.dense_step is None
    finally:
        for s in servers:
            s.stop(0)


def _write_dense(spool: SpoolWriter, tensors: dict[str, torch.Tensor]) -> None:
    """A dense state for the SpoolWriter's last segment (seq, step), as rank 0 writes it."""
    data = encode_dense(
        model=spool.layout.model,
        generation=spool.generation,
        rank=0,
        seq=spool.seq,
        step=spool.step,
        tensors=tensors,
    )
    write_dense(spool.layout.dense_path(spool.generation, 0, spool.seq), data, fsync=False)


def _state(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {
        "w": torch.randn(100_000, generator=g),  # 400 kB: several DenseChunks
        "bn.num_batches_tracked": torch.tensor(i),
        "mask": torch.rand(3, 5, generator=g) > 0.5,
        "half": torch.randn(4, 4, generator=g).to(torch.bfloat16),
    }


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(
        got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in want.items()
    )


def test_sidecar_serves_the_newest_dense_state_at_or_before_the_head(
    tmp_path: Path, redis_url: str
) -> None:
    root = tmp_path / "spool"
    spool = SpoolWriter(root)
    _write_dense(spool, _state(0))
    spool.delta()
    at10 = {t: v.clone() for t, v in spool.truth.items()}
    _write_dense(spool, _state(10))
    spool.delta()  # step 20: rows, no dense state yet
    srv = SidecarServer(server_config(root, redis_url, merge_min_segments=2)).start()
    raw = Client(f"127.0.0.1:{srv.port}")
    try:
        cfg = ConsumerConfig(consumer="p", model="m", sidecars=(srv.endpoint,))
        with DeltaConsumer(cfg) as c:
            wait_for(lambda: c.status()[0].dense_steps == (0, 10))
            assert c.status()[0].head_step == 20
            # aligned on the newest step that has a dense state: 10, not the head's 20
            r = c.pull()
            assert (r.step, r.dense_step) == (10, 10) and _same(r.dense, _state(10))
            rep = Replica()
            rep.apply(r.deltas[0])
            assert all(torch.equal(rep.tables[t], at10[t]) for t in at10)
            c.commit(r)
            r = c.pull()
            assert (r.step, r.rows, r.dense_step, r.dense_bytes) == (10, 0, None, 0)
            _write_dense(spool, _state(20))
            wait_for(lambda: c.status()[0].dense_steps == (0, 10, 20))
            r = c.pull()
            assert (r.step, r.dense_step) == (20, 20) and _same(r.dense, _state(20))
            rep.apply(r.deltas[0])
            assert all(torch.equal(rep.tables[t], spool.truth[t]) for t in spool.truth)
            c.commit(r)
        # a consumer that does not ask for dense states moves to the head's step alone
        cfg = ConsumerConfig(
            consumer="rows", model="m", sidecars=(srv.endpoint,), pull=PullOptions(dense=False)
        )
        spool.delta()  # step 30, no dense state
        wait_for(lambda: (s := srv.log.snapshot()) is not None and s.head.step == 30)
        with DeltaConsumer(cfg) as c:
            r = c.pull()
            assert (r.step, r.dense_step, r.dense) == (30, None, {})
            c.commit(r)
        # bootstrap (from_base): the raw and the protobuf decoders agree; small chunks
        a = raw.pull("boot", from_base=True, with_dense=True, max_step=20)
        b = raw.pull("boot", from_base=True, with_dense=True, max_step=20, raw=False)
        for d in (a, b):
            assert d.resync and d.dense_step == 20 and _same(d.dense, _state(20))
        raw.commit(b)  # the last pull issued
        # retention: the base moves to seq 2 (the oldest cursor); dense states before the
        # newest at or before it (seq 2, step 20) are deleted, that one is kept
        assert srv.retention.run_once()
        snap = srv.log.snapshot()
        assert snap is not None and snap.base.seq == 2
        assert [seq for seq, _ in spool.layout.dense_files(spool.generation, 0)] == [2]
        assert [d.step for d in snap.dense] == [20]
        d = raw.pull("late", with_dense=True)
        assert d.resync and d.to_step == 30 and d.dense_step == 20 and _same(d.dense, _state(20))
    finally:
        raw.close()
        srv.stop(0)


def test_dense_chunks_decode_and_a_broken_stream_is_refused() -> None:
    state = decode_dense(
        encode_dense(model="m", generation=1, rank=0, seq=4, step=40, tensors=_state(4))
    )
    header = pb.DeltaHeader(to_seq=4, to_step=40)
    header.dense.seq, header.dense.step = 4, 40
    for t in state.header.tensors:
        header.dense.tensors.add(name=t.name, dtype=t.dtype, shape=t.shape, nbytes=t.nbytes)
    head = encode.encode_header(header)
    chunks = list(encode.encode_dense_chunks(state, 64 * 1024))
    assert len(chunks) > len(state.tensors)  # the 400 kB tensor is split
    tail = encode.encode_trailer(pb.DeltaTrailer())
    d = decode.decode_stream([head, *chunks, tail])
    assert d.dense_step == 40 and _same(d.dense, _state(4))
    assert d.dense_bytes == d.bytes == state.nbytes
    with pytest.raises(decode.StreamDecodeError, match="bytes received"):
        decode.decode_stream([head, *chunks[:-1], tail])
    with pytest.raises(decode.StreamDecodeError, match="expected byte"):
        decode.decode_stream([head, chunks[1], chunks[0], *chunks[2:], tail])
    bad = pb.DeltaHeader()
    bad.CopyFrom(header)
    bad.dense.tensors[0].dtype = "complex64"
    with pytest.raises(decode.StreamDecodeError, match="unknown dense dtype"):
        decode.decode_stream([encode.encode_header(bad)])
    bad.dense.tensors[0].dtype = "float32"
    bad.dense.tensors[0].nbytes += 4
    with pytest.raises(decode.StreamDecodeError, match="bytes for float32"):
        decode.decode_stream([encode.encode_header(bad)])


def test_a_corrupt_dense_state_is_quarantined_not_served(tmp_path: Path, redis_url: str) -> None:
    root = tmp_path / "spool"
    spool = SpoolWriter(root)
    _write_dense(spool, _state(0))
    path = spool.layout.dense_path(spool.generation, 0, 0)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    srv = SidecarServer(server_config(root, redis_url)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        wait_for(lambda: srv.log.snapshot() is not None and srv.log.quarantined == 1)
        snap = srv.log.snapshot()
        assert snap is not None and snap.dense == () and not path.exists()
        d = c.pull("p", with_dense=True)
        assert d.resync and d.dense_step is None and d.dense == {}
    finally:
        c.close()
        srv.stop(0)


def test_dense_alignment_picks_a_step_every_rank_can_end_at() -> None:
    def st(rank: int, steps: tuple[int, ...], dense: tuple[int, ...] = ()) -> RankStatus:
        head = steps[-1] if steps else 5
        return RankStatus(rank, 2, 1, len(steps) - 1, head, 0.0, 0.0, dense, steps)

    # dense with every segment: the target itself
    assert dense_target([st(0, (0, 1, 2, 3), (0, 1, 2, 3)), st(1, (0, 1, 2, 3))], 3) == 3
    # dense every 2 steps: the newest dense step at or below the target
    assert dense_target([st(0, (0, 1, 2, 3), (0, 2)), st(1, (0, 1, 2, 3))], 3) == 2
    # rank 1 merged 1..3 into one entry ending at 3: step 2 is no end there; 0 is
    assert dense_target([st(0, (0, 1, 2, 3), (0, 2)), st(1, (0, 3))], 3) == 0
    # nothing common: rows move on to the target (the pull's dense_step tells the rest)
    assert dense_target([st(0, (1, 2, 3), (2,)), st(1, (3,))], 3) == 3
    # no dense states published: the target
    assert dense_target([st(0, (0, 5)), st(1, (0, 5))], 5) == 5
    # an older sidecar reports no steps: trusted
    assert dense_target([st(0, (), (0, 4)), st(1, ())], 5) == 4
