"""The archive against a real SeaweedFS: a sidecar uploads its verified log; a sidecar on an
empty spool restores it before it serves, and consumers go on from their cursors (no resync);
a predictor cold-starts from the store bit-equal to a sidecar bootstrap; kill -9 of the store
during uploads loses nothing."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from s3kit import Seaweed, archive_url, own_seaweed, s3_env, seaweed  # noqa: F401
from serverkit import MODEL, Client, Replica, SpoolWriter, server_config, wait_for

from deltad.config import ConsumerConfig, PullOptions
from deltad.consume.appliers import TensorDictApplier
from deltad.consume.client import DeltaConsumer
from deltad.consume.coldstart import cold_start, read_archived_state, resumed
from deltad.segment.format import encode_dense, write_dense
from deltad.serve.archive.fetch import read_manifest
from deltad.serve.archive.layout import ArchiveManifest
from deltad.serve.archive.opening import open_store
from deltad.serve.archive.sidecar import ARCHIVE_HEALTH
from deltad.serve.archive.store import ArchiveUnavailable
from deltad.serve.edge.app import SidecarServer
from deltad.store import EmbeddedRedis


def _sidecar(root: Path, redis_url: str, url: str, endpoint: str, **kw: Any) -> SidecarServer:
    cfg = server_config(root, redis_url, archive_url=url, archive_endpoint=endpoint, **kw)
    return SidecarServer(cfg).start()


def _archived_head(url: str, endpoint: str) -> tuple[int, int] | None:
    """The archived (generation, head seq); None while there is none or the store does not
    answer yet (a SeaweedFS just restarted answers InternalError for a moment)."""
    s = open_store(url, endpoint=endpoint)
    try:
        m = read_manifest(s, MODEL, 0)
    except ArchiveUnavailable:
        return None
    finally:
        s.close()
    return None if m is None else (m.generation, m.head.seq)


def _wait_archived(url: str, endpoint: str, spool: SpoolWriter, timeout_s: float = 30) -> None:
    wait_for(
        lambda: _archived_head(url, endpoint) == (spool.generation, spool.seq),
        timeout_s,
        f"the archive to reach seq {spool.seq}",
    )


def _lag(srv: SidecarServer) -> tuple[float, float]:
    labels = {"model": MODEL, "rank": "0"}
    get = srv.metrics.registry.get_sample_value
    return (
        get("deltad_archive_lag_segments", labels) or 0.0,
        get("deltad_archive_lag_seconds", labels) or 0.0,
    )


def _health(srv: SidecarServer, service: str) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def _status_archive_line(srv: SidecarServer) -> str:
    """The archive line of `deltad status` against ``srv``."""
    import contextlib
    import io

    from deltad.commands.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["status", "--target", f"127.0.0.1:{srv.port}"]) == 0
    return next(ln for ln in out.getvalue().splitlines() if ln.startswith("archive: "))


def _served(srv: SidecarServer, seq: int, timeout_s: float = 10) -> None:
    """Wait until ``srv``'s log serves ``seq`` as its head."""
    wait_for(
        lambda: (s := srv.log.snapshot()) is not None and s.head.seq == seq,
        timeout_s,
        f"the sidecar serving seq {seq}",
    )


def _bootstrap(name: str, endpoint: str, applier: Any, pull: PullOptions | None = None) -> None:
    """A predictor ``name`` bootstrapped by the sidecar at ``endpoint`` into ``applier``."""
    cfg = ConsumerConfig(
        name, model=MODEL, sidecars=(endpoint,), pull=pull or PullOptions(dense=False)
    )
    with DeltaConsumer(cfg) as c:
        c.sync(applier)


def _cold_config(
    name: str, endpoint: str, url: str, store_endpoint: str, pull: PullOptions
) -> ConsumerConfig:
    """A consumer that cold-starts from the archive ``url`` and then follows ``endpoint``."""
    return ConsumerConfig(
        name,
        model=MODEL,
        sidecars=(endpoint,),
        pull=pull,
        bootstrap_from=url,
        bootstrap_endpoint=store_endpoint,
    )


def _assert_archive_rebuilds(url: str, endpoint: str, spool: SpoolWriter) -> None:
    """What the store holds (read back and verified) rebuilds the trainer's tables exactly."""
    state = read_archived_state(url, MODEL, endpoint=endpoint)
    r = Replica()
    for d in state.deltas:
        r.apply(d)
    _assert_tables(r.tables, spool)


def _assert_tables(tables: dict[str, torch.Tensor], spool: SpoolWriter) -> None:
    for t in spool.specs:
        assert torch.equal(tables[t], spool.truth[t]), t


@pytest.mark.usefixtures("s3_env")
def test_the_sidecar_archives_every_verified_segment_and_its_manifest(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    seaweed: Seaweed,  # noqa: F811
) -> None:
    spool = SpoolWriter(tmp_path / "spool")
    url = archive_url()
    srv = _sidecar(tmp_path / "spool", redis_server.url, url, seaweed.endpoint)
    try:
        for _ in range(5):
            spool.delta()
        _wait_archived(url, seaweed.endpoint, spool)
        wait_for(lambda: _lag(srv) == (0.0, 0.0), 10, "the lag metric at 0")
        # `deltad status` says where the archive is and that it is caught up
        assert _status_archive_line(srv) == f"archive: {url}: caught up"
        # what the store holds rebuilds the trainer's tables exactly (verified on read)
        state = read_archived_state(url, MODEL, endpoint=seaweed.endpoint)
        assert state.heads == {0: (spool.seq, spool.step)}
        r = Replica()
        for d in state.deltas:
            r.apply(d)
        _assert_tables(r.tables, spool)
        # objects are written once: each of the log's objects was uploaded once
        uploads = srv.archive.uploader.uploads if srv.archive and srv.archive.uploader else 0
        assert uploads == 7  # generation manifest, base, 5 deltas
        # a trainer restart: the archive follows the new generation
        spool.start_generation(2, start_step=spool.step)
        spool.delta()
        _wait_archived(url, seaweed.endpoint, spool)
        state = read_archived_state(url, MODEL, endpoint=seaweed.endpoint)
        assert (state.generation, state.heads) == (2, {0: (1, spool.step)})
        r = Replica()
        for d in state.deltas:
            r.apply(d)
        _assert_tables(r.tables, spool)
    finally:
        srv.stop(0)


@pytest.mark.usefixtures("s3_env")
def test_a_sidecar_on_an_empty_spool_restores_the_log_and_consumers_keep_their_cursors(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    seaweed: Seaweed,  # noqa: F811
) -> None:
    root = tmp_path / "spool"
    spool = SpoolWriter(root)
    url = archive_url()
    srv = _sidecar(root, redis_server.url, url, seaweed.endpoint)
    replica = Replica()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        spool.delta()
        _served(srv, 1)
        d = c.pull("p1")
        assert d.resync
        replica.apply(d)
        c.commit(d)
        for _ in range(3):
            spool.delta()
        _wait_archived(url, seaweed.endpoint, spool)
    finally:
        c.close()
        srv.stop(0)
    # the node is lost: its spool is gone; the trainer goes on publishing into a new one,
    # before the new sidecar is up
    shutil.rmtree(root)
    root.mkdir()
    archived = spool.seq
    spool.delta()
    srv = _sidecar(root, redis_server.url, url, seaweed.endpoint)
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        assert srv.archive is not None and srv.archive.restored is not None
        assert srv.archive.restored.head_seq == archived
        snap = srv.log.snapshot()
        assert snap is not None and snap.head.seq == spool.seq  # restored + the trainer's
        d = c.pull("p1")
        assert not d.resync and d.from_seq == 1 and d.to_seq == spool.seq
        replica.apply(d)
        c.commit(d)
        _assert_tables(replica.tables, spool)
        spool.delta()  # the trainer's next segment continues the restored log
        _served(srv, spool.seq)
        d = c.pull("p1")
        assert not d.resync and d.from_seq == spool.seq - 1
        replica.apply(d)
        _assert_tables(replica.tables, spool)
        # the restored log is archived on: the new sidecar's uploads continue the manifest
        _wait_archived(url, seaweed.endpoint, spool)
    finally:
        c.close()
        srv.stop(0)


def _write_dense(spool: SpoolWriter, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "mlp.weight": torch.randn(4, 3, generator=g),
        "mlp.bias": torch.randn(4, generator=g).to(torch.bfloat16),
        "steps": torch.tensor([seed], dtype=torch.int64),
    }
    data = encode_dense(
        model=MODEL, generation=spool.generation, rank=0, seq=spool.seq + 1,
        step=spool.step + 10, tensors=tensors,
    )  # fmt: skip
    write_dense(spool.layout.dense_path(spool.generation, 0, spool.seq + 1), data)
    return tensors


@pytest.mark.usefixtures("s3_env")
def test_dense_states_are_archived_restored_and_cold_started_exactly(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    seaweed: Seaweed,  # noqa: F811
) -> None:
    root = tmp_path / "spool"
    spool = SpoolWriter(root)
    url = archive_url()
    srv = _sidecar(root, redis_server.url, url, seaweed.endpoint)
    try:
        _write_dense(spool, 1)
        spool.delta()
        dense = _write_dense(spool, 2)  # dense state and segment of one drain point
        spool.delta()
        _wait_archived(url, seaweed.endpoint, spool)
        wait_for(lambda: len(_manifest(url, seaweed.endpoint).dense) == 2, 10, "dense states")
        before = sorted(p.name for p in spool.layout.rank_dir(1, 0).iterdir())
    finally:
        srv.stop(0)
    state = read_archived_state(url, MODEL, endpoint=seaweed.endpoint)
    got = state.deltas[0]
    assert (got.dense_seq, got.dense_step) == (spool.seq, spool.step)
    assert got.dense.keys() == dense.keys()
    for k, v in dense.items():
        assert got.dense[k].dtype == v.dtype and torch.equal(got.dense[k], v), k
    shutil.rmtree(root)
    root.mkdir()
    srv = _sidecar(root, redis_server.url, url, seaweed.endpoint)
    try:
        assert srv.archive is not None and srv.archive.restored is not None
        assert srv.archive.restored.dense == 2
        after = sorted(p.name for p in spool.layout.rank_dir(1, 0).iterdir())
        assert after == before
        snap = srv.log.snapshot()
        assert snap is not None and [d.seq for d in snap.dense] == [1, 2]
        held = snap.dense[-1].state.tensors
        for k, v in dense.items():
            assert torch.equal(held[k], v), k
    finally:
        srv.stop(0)


def _manifest(url: str, endpoint: str | None) -> ArchiveManifest:
    s = open_store(url, endpoint=endpoint)
    try:
        m = read_manifest(s, MODEL, 0)
    finally:
        s.close()
    assert m is not None
    return m


def test_a_shared_file_system_archive_restores_an_empty_spool(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    root = tmp_path / "spool"
    spool = SpoolWriter(root)
    url = f"file://{tmp_path / 'mount'}"
    srv = SidecarServer(server_config(root, redis_server.url, archive_url=url)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    replica = Replica()
    try:
        spool.delta()
        _served(srv, 1)
        d = c.pull("p1")
        replica.apply(d)
        c.commit(d)
        spool.delta()
        wait_for(lambda: _manifest(url, None).head.seq == spool.seq, 10, "the archive")
    finally:
        c.close()
        srv.stop(0)
    shutil.rmtree(root)
    root.mkdir()
    srv = SidecarServer(server_config(root, redis_server.url, archive_url=url)).start()
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        d = c.pull("p1")
        assert not d.resync and d.from_seq == 1
        replica.apply(d)
        _assert_tables(replica.tables, spool)
        assert not list((tmp_path / "mount").rglob(".tmp-*"))  # nothing half written
    finally:
        c.close()
        srv.stop(0)


@pytest.mark.usefixtures("s3_env")
def test_a_corrupted_archived_segment_is_refused_and_only_the_verified_prefix_restored(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    seaweed: Seaweed,  # noqa: F811
) -> None:
    root = tmp_path / "spool"
    spool = SpoolWriter(root)
    url = archive_url()
    srv = _sidecar(root, redis_server.url, url, seaweed.endpoint)
    try:
        for _ in range(3):
            spool.delta()
        _wait_archived(url, seaweed.endpoint, spool)
    finally:
        srv.stop(0)
    store = open_store(url, endpoint=seaweed.endpoint)
    m = read_manifest(store, MODEL, 0)
    assert m is not None
    bad = m.entries[2]  # seq 2: flip a byte (a store that corrupted it), same size
    data = bytearray(store.get(bad.key))
    data[len(data) // 2] ^= 0xFF
    store.delete(bad.key)
    p = tmp_path / "bad"
    p.write_bytes(bytes(data))
    assert store.put_if_absent(bad.key, p)
    store.close()
    shutil.rmtree(root)
    root.mkdir()
    srv = _sidecar(root, redis_server.url, url, seaweed.endpoint)
    try:
        assert srv.archive is not None and srv.archive.restored is not None
        assert srv.archive.restored.head_seq == 1
        assert "checksum" in srv.archive.restored.stopped
        snap = srv.log.snapshot()
        assert snap is not None and snap.head.seq == 1  # nothing past the bad object
    finally:
        srv.stop(0)


@pytest.mark.usefixtures("s3_env")
def test_a_cold_start_from_the_store_is_bit_equal_and_pulls_only_the_tail(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    seaweed: Seaweed,  # noqa: F811
) -> None:
    root = tmp_path / "spool"
    spool = SpoolWriter(root, tables={"t0": (2000, 64), "t1": (700, 32)})
    url = archive_url()
    srv = _sidecar(root, redis_server.url, url, seaweed.endpoint)
    try:
        for _ in range(4):
            spool.delta()
        _wait_archived(url, seaweed.endpoint, spool)
        archived = spool.step
        truth_then = {t: v.clone() for t, v in spool.truth.items()}
        spool.delta()  # the tail: published after the archive was read
        _served(srv, spool.seq)
        endpoint = f"127.0.0.1:{srv.port}"
        # a predictor bootstrapped by the sidecar, the reference
        ref = TensorDictApplier()
        _bootstrap("ref", endpoint, ref)
        pull = PullOptions(dense=False, max_step=archived)
        cfg = _cold_config("cold", endpoint, url, seaweed.endpoint, pull)
        cold = TensorDictApplier()
        served_before = srv.metrics.bytes_served._value.get()
        state = cold_start(cfg, cold)
        assert state.step == archived
        for t in spool.specs:
            assert torch.equal(cold.tables()[t], truth_then[t])
        handshake_bytes = srv.metrics.bytes_served._value.get() - served_before
        table_bytes = sum(v.numel() * 4 for v in spool.truth.values())
        rows = sum(n for n, _ in spool.specs.values())
        # the sidecar sent no rows: the pull named the archived state it holds (an empty
        # window at it; a sidecar without GetDeltaRequest.holding would send 8 bytes a row)
        assert handshake_bytes < 1024 < rows * 8 < table_bytes / 20
        # a predictor killed after its cold start (tables gone, cursors committed) starts
        # again the same way
        again = TensorDictApplier()
        assert cold_start(cfg, again).heads == state.heads
        for t in spool.specs:
            assert torch.equal(again.tables()[t], truth_then[t])
        after = resumed(cfg)
        after.pull = PullOptions(dense=False)
        with DeltaConsumer(after) as c:
            got = c.sync(cold)
            assert [d.resync for d in got.deltas] == [False]
            assert got.deltas[0].from_seq == spool.seq - 1
        for t in spool.specs:
            assert torch.equal(cold.tables()[t], ref.tables()[t])  # bit-equal to a bootstrap
        _assert_tables(cold.tables(), spool)
    finally:
        srv.stop(0)


@pytest.mark.slow
@pytest.mark.usefixtures("s3_env")
def test_kill_9_of_the_store_during_uploads_loses_nothing(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    own_seaweed: Seaweed,  # noqa: F811
) -> None:
    root = tmp_path / "spool"
    spool = SpoolWriter(root, tables={"t0": (20000, 32), "t1": (5000, 16)})
    url = archive_url()
    srv = _sidecar(root, redis_server.url, url, own_seaweed.endpoint, archive_lag_bound_s=1.0)
    try:
        wait_for(lambda: _archived_head(url, own_seaweed.endpoint) is not None, 30, "a manifest")
        spool.delta(n=5000)
        spool.delta(n=5000)
        time.sleep(0.05)  # uploads under way
        own_seaweed.kill()
        for _ in range(4):  # the trainer and the sidecar go on without the store
            spool.delta(n=2000)
        _served(srv, spool.seq)
        wait_for(lambda: _lag(srv)[0] > 0 and _lag(srv)[1] > 1.0, 20, "the lag to show")
        wait_for(srv.check_archive, 10, "the archive health to say it is behind")
        assert _health(srv, ARCHIVE_HEALTH) == "NOT_SERVING"
        assert _health(srv, "") == "SERVING"  # serving never stopped
        own_seaweed.start()
        _wait_archived(url, own_seaweed.endpoint, spool, timeout_s=90)
        wait_for(lambda: not srv.check_archive(), 10, "the archive health to recover")
        assert _health(srv, ARCHIVE_HEALTH) == "SERVING"
        _assert_archive_rebuilds(url, own_seaweed.endpoint, spool)
    finally:
        srv.stop(0)


@pytest.mark.usefixtures("s3_env")
@pytest.mark.parametrize("dtype", ["int8", pytest.param("int4", marks=pytest.mark.slow)])
def test_a_quantized_predictor_cold_started_from_the_store_is_byte_equal_to_a_packed_bootstrap(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    seaweed: Seaweed,  # noqa: F811
    dtype: str,
) -> None:
    from deltad.reference.trainer.model import ClickModel

    from deltad.consume.quant import QuantApplier, packed_wire_dtype, quantize_model
    from deltad.types import ServeDtype

    serve = ServeDtype(dtype)
    root = tmp_path / "spool"
    spool = SpoolWriter(root, tables={"t0": (50, 16), "t1": (37, 16), "seq": (29, 16)})
    url = archive_url()
    srv = _sidecar(root, redis_server.url, url, seaweed.endpoint)

    def served() -> tuple[torch.nn.Module, QuantApplier]:
        torch.manual_seed(0)
        m = quantize_model(ClickModel({"t0": 50, "t1": 37}, 29, dim=16, zch_slots=0).eval(), serve)
        return m, QuantApplier(m)

    try:
        for _ in range(3):
            spool.delta(n=10)
        _wait_archived(url, seaweed.endpoint, spool)
        spool.delta(n=10)  # the tail
        _served(srv, spool.seq)
        endpoint = f"127.0.0.1:{srv.port}"
        packed = PullOptions(dense=False, wire_dtype=packed_wire_dtype(serve))
        ref_model, ref = served()
        _bootstrap("ref", endpoint, ref, packed)
        cold_model, cold = served()
        cfg = _cold_config("cold", endpoint, url, seaweed.endpoint, packed)
        cold_start(cfg, cold)
        with DeltaConsumer(resumed(cfg)) as c:
            got = c.sync(cold)
            assert [d.resync for d in got.deltas] == [False]
        a, b = cold_model.state_dict(), ref_model.state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(getattr(a[k], "elem", a[k]), getattr(b[k], "elem", b[k])), k
        untouched = served()[0].state_dict()  # (and the rows really arrived)
        assert any(
            not torch.equal(getattr(a[k], "elem", a[k]), getattr(v, "elem", v))
            for k, v in untouched.items()
        )
    finally:
        srv.stop(0)


@pytest.mark.usefixtures("s3_env")
def test_a_managed_collision_cold_start_holds_the_same_identities_as_a_bootstrap(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    seaweed: Seaweed,  # noqa: F811
) -> None:
    """A spool of a managed-collision table (segment format version 3: slots, raw ids,
    evictions) and a plain one: a predictor cold-started from the store holds the rows and the
    slot -> raw id map a sidecar bootstrap gives, and follows the tail from there."""
    from spoolkit import ZchWriter

    root = tmp_path / "spool"
    z = ZchWriter(root, model=MODEL, mc={"zch": (64, 8)}, tables={"t0": (40, 4)}, seed=3)
    url = archive_url()
    srv = _sidecar(root, redis_server.url, url, seaweed.endpoint)
    try:
        for _ in range(4):
            z.delta(n=6)
        wait_for(
            lambda: _archived_head(url, seaweed.endpoint) == (z.generation, z.seq),
            30,
            f"the archive to reach seq {z.seq}",
        )
        archived = z.step
        truth_then = {t: v.clone() for t, v in z.truth.items()}
        raw_then = z.raw["zch"].clone()
        z.delta(n=6)  # the tail
        _served(srv, z.seq)
        endpoint = f"127.0.0.1:{srv.port}"
        pull = PullOptions(dense=False, max_step=archived)
        cfg = _cold_config("cold-mc", endpoint, url, seaweed.endpoint, pull)
        cold = TensorDictApplier()
        assert cold_start(cfg, cold).step == archived
        for t in z.specs:
            assert torch.equal(cold.tables()[t], truth_then[t]), t
        assert torch.equal(cold.slot_maps()["zch"].slot_raw, raw_then)
        after = resumed(cfg)
        after.pull = PullOptions(dense=False)
        with DeltaConsumer(after) as c:
            got = c.sync(cold)
            assert [d.resync for d in got.deltas] == [False]
        ref = TensorDictApplier()
        _bootstrap("ref-mc", endpoint, ref)
        for t in z.specs:
            assert torch.equal(cold.tables()[t], ref.tables()[t]), t
            assert torch.equal(cold.tables()[t], z.truth[t]), t
        assert torch.equal(cold.slot_maps()["zch"].slot_raw, z.raw["zch"])
        assert torch.equal(ref.slot_maps()["zch"].slot_raw, z.raw["zch"])
    finally:
        srv.stop(0)


@pytest.mark.slow
@pytest.mark.usefixtures("s3_env")
def test_a_store_that_hangs_for_20_s_under_load_loses_nothing(
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    own_seaweed: Seaweed,  # noqa: F811
) -> None:
    """The store stops answering (SIGSTOP: connections accepted, nothing answered: the worst
    kind of unreachable) for 20 s while the trainer publishes every 0.25 s and the sidecar
    serves; then it answers again. Serving never waited on it, the uploader's calls timed out
    instead of hanging, and the archive catches up to the head: restorable, bit-equal.
    (A one-minute outage is the same with a longer wait; 20 s keeps the suite short.)"""
    import os
    import signal

    root = tmp_path / "spool"
    spool = SpoolWriter(root, tables={"t0": (4000, 16), "t1": (1000, 8)})
    url = archive_url()
    srv = _sidecar(root, redis_server.url, url, own_seaweed.endpoint, archive_lag_bound_s=1.0)
    assert own_seaweed.proc is not None
    try:
        _wait_archived(url, own_seaweed.endpoint, spool)
        os.kill(own_seaweed.proc.pid, signal.SIGSTOP)
        try:
            end = time.monotonic() + 20
            endpoint = f"127.0.0.1:{srv.port}"
            cfg = ConsumerConfig(
                "p", model=MODEL, sidecars=(endpoint,), pull=PullOptions(dense=False)
            )
            with DeltaConsumer(cfg) as c:
                held = TensorDictApplier()
                while time.monotonic() < end:  # bounded: the outage
                    spool.delta(n=300)
                    wait_for(
                        lambda: (s := srv.log.snapshot()) is not None and s.head.seq == spool.seq,
                        10,
                    )
                    assert c.sync(held).step == spool.step  # serving goes on, fresh
                    time.sleep(0.25)
                _assert_tables(held.tables(), spool)
            assert _lag(srv)[0] > 0 and srv.check_archive()  # behind, and said so
            line = _status_archive_line(srv)
            assert line.startswith(f"archive: {url}: ") and "segment(s) behind" in line, line
            assert _health(srv, "") == "SERVING"
        finally:
            os.kill(own_seaweed.proc.pid, signal.SIGCONT)
        _wait_archived(url, own_seaweed.endpoint, spool, timeout_s=120)
        wait_for(lambda: not srv.check_archive(), 20, "the archive health to recover")
        _assert_archive_rebuilds(url, own_seaweed.endpoint, spool)
    finally:
        srv.stop(0)
