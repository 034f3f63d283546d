"""DeltaConsumer's checks of what it is given: the sidecars' model, rank and world size (static
``sidecars=``), close() and connect() again, and the arguments of commit, sync and wait_for_new.

Real sidecars (in-process SidecarServer on port 0 over SpoolWriter spools) and real Redis."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from serverkit import SpoolWriter, server_config

from deltad.config import ConsumerConfig
from deltad.consume.appliers import TensorDictApplier
from deltad.consume.client import DeltaConsumer
from deltad.errors import ConfigError, ConsumerError
from deltad.serve.edge.app import SidecarServer
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc

pytestmark = pytest.mark.timeout(120)


def _config(name: str, endpoints: list[str], **kw: object) -> ConsumerConfig:
    opts: dict[str, object] = {
        "model": "m",
        "rpc_deadline_s": 5.0,
        "max_retries": 1,
        "backoff_initial_s": 0.05,
        "heartbeat_interval_s": 0.2,
    }
    opts.update(kw)
    return ConsumerConfig(consumer=name, sidecars=tuple(endpoints), **opts)  # type: ignore[arg-type]


@contextlib.contextmanager
def _servers(root: Path, redis_url: str, ranks: list[int], **kw: object) -> Iterator[list[str]]:
    started = []
    try:
        for rank in ranks:
            started.append(SidecarServer(server_config(root, redis_url, rank=rank, **kw)).start())
        yield [s.endpoint for s in started]
    finally:
        for s in started:
            s.stop(0.5)


def _two_ranks(root: Path) -> list[SpoolWriter]:
    writers = [SpoolWriter(root, rank=r, world_size=2, seed=r) for r in range(2)]
    for w in writers:
        w.delta()
    return writers


def _truth(writers: list[SpoolWriter]) -> dict[str, torch.Tensor]:
    """The full tables: each rank's own row range of its writer's truth."""
    out = {}
    for t in writers[0].specs:
        full = torch.zeros_like(writers[0].truth[t])
        for w in writers:
            lo, hi = w.rows(t)
            full[lo:hi] = w.truth[t][lo:hi]
        out[t] = full
    return out


def _consumers(endpoint: str) -> list[str]:
    channel = grpc.insecure_channel(endpoint)
    try:
        got = delta_pb2_grpc.DeltaServiceStub(channel).ListConsumers(
            pb.ListConsumersRequest(), timeout=5
        )
        return [c.consumer for c in got.consumers]
    finally:
        channel.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _settled(c: DeltaConsumer, applier: TensorDictApplier, step: int) -> None:
    """sync until the pull is caught up at ``step`` (the sidecars index the spool first)."""
    deadline = time.monotonic() + 30
    while True:
        r = c.sync(applier)
        if r.caught_up and r.step == step:
            return
        assert time.monotonic() < deadline, (r.step, r.missing)
        time.sleep(0.05)


# ---- world size and model (static sidecars=) -------------------------------------------------


def test_every_rank_listed_serves_whole_tables(tmp_path: Path, redis_url: str) -> None:
    writers = _two_ranks(tmp_path / "spool")
    with (
        _servers(tmp_path / "spool", redis_url, [0, 1]) as eps,
        DeltaConsumer(_config("both", eps)) as c,
    ):
        applier = TensorDictApplier()
        _settled(c, applier, 10)
        got = applier.tables()
        for t, want in _truth(writers).items():
            assert torch.equal(got[t], want), t


def test_one_sidecar_of_a_two_rank_model_is_refused_at_connect(
    tmp_path: Path, redis_url: str
) -> None:
    _two_ranks(tmp_path / "spool")
    with _servers(tmp_path / "spool", redis_url, [0, 1]) as eps:
        c = DeltaConsumer(_config("half", eps[:1]))
        with pytest.raises(ConfigError, match=r"model 'm' has 2 ranks; give one sidecar per rank"):
            c.connect()
        assert _consumers(eps[0]) == []  # refused before it registered there
        with pytest.raises(ConsumerError, match="not connected"):
            c.pull()


def test_a_sidecar_of_another_model_is_refused_at_connect(tmp_path: Path, redis_url: str) -> None:
    SpoolWriter(tmp_path / "spool").delta()
    with _servers(tmp_path / "spool", redis_url, [0]) as eps:
        c = DeltaConsumer(_config("typo", eps, model="mm"))
        with pytest.raises(ConfigError, match=rf"{eps[0]} serves model 'm', not 'mm'"):
            c.connect()
        assert _consumers(eps[0]) == []
        with DeltaConsumer(_config("right", eps)) as ok:  # the same sidecar, the right model
            _settled(ok, TensorDictApplier(), 10)


@pytest.mark.parametrize("align", [True, False])
@pytest.mark.parametrize("wrong", ["world", "model"])
def test_a_sidecar_down_at_connect_is_checked_when_it_answers(
    tmp_path: Path, redis_url: str, align: bool, wrong: str
) -> None:
    """connect() lets a silent sidecar be; once it answers, a wrong one fails the pull (never
    a caught-up pull of partial tables, never a commit there)."""
    if wrong == "world":
        _two_ranks(tmp_path / "spool")
        model, match = "m", r"model 'm' has 2 ranks"
    else:
        SpoolWriter(tmp_path / "spool").delta()
        model, match = "mm", r"serves model 'm', not 'mm'"
    endpoint = f"127.0.0.1:{_free_port()}"
    c = DeltaConsumer(_config("late", [endpoint], model=model, align_steps=align)).connect()
    try:
        r = c.pull()
        assert 0 in r.missing and not r.caught_up and not r.deltas
        with _servers(tmp_path / "spool", redis_url, [0], listen=endpoint):
            with pytest.raises(ConfigError, match=match):
                for _ in range(100):  # until the sidecar indexed its spool (world size known)
                    r = c.pull()
                    assert not r.deltas and not r.caught_up
                    time.sleep(0.05)
            time.sleep(0.5)  # heartbeats: a not-found lease checks before it registers
            assert _consumers(endpoint) == []
    finally:
        c.close()


def test_a_new_generation_of_another_world_size_is_refused(tmp_path: Path, redis_url: str) -> None:
    """Unaligned pulls check a window of a generation its sidecar was not checked at."""
    w = SpoolWriter(tmp_path / "spool")
    w.delta()
    with (
        _servers(tmp_path / "spool", redis_url, [0]) as eps,
        DeltaConsumer(_config("gen", eps, align_steps=False)) as c,
    ):
        _settled(c, TensorDictApplier(), 10)
        w.world_size = 2  # the trainer restarts with two ranks; rank 0 is listed alone
        w.start_generation(2, start_step=100)
        w.delta()
        with pytest.raises(ConfigError, match=r"model 'm' has 2 ranks"):
            for _ in range(200):
                r = c.pull()
                assert all(d.generation == 1 for d in r.deltas)
                time.sleep(0.05)


# ---- close() and connect() again ----------------------------------------------------------


def test_close_twice_and_close_inside_with(tmp_path: Path, redis_url: str) -> None:
    SpoolWriter(tmp_path / "spool").delta()
    with _servers(tmp_path / "spool", redis_url, [0]) as eps:
        c = DeltaConsumer(_config("twice", eps)).connect()
        c.close()
        c.close()  # a no-op (it called a Heartbeat on closed channels)
        with DeltaConsumer(_config("inside", eps)) as c2:
            _settled(c2, TensorDictApplier(), 10)
            c2.close()
        # __exit__ closed it again: nothing raised
        DeltaConsumer(_config("never", eps)).close()  # never connected: fine too


def test_connect_after_close_starts_afresh(tmp_path: Path, redis_url: str) -> None:
    w = SpoolWriter(tmp_path / "spool")
    w.delta()
    with _servers(tmp_path / "spool", redis_url, [0]) as eps:
        c = DeltaConsumer(_config("again", eps))
        c.close()  # closed before it ever connected
        with c:
            applier = TensorDictApplier()
            _settled(c, applier, 10)
        with pytest.raises(ConsumerError, match="not connected"):
            c.pull()
        w.delta()
        with c:  # connect() after close(): new channels, each rank's full tables first
            fresh = TensorDictApplier()
            assert c.sync(fresh).resync  # (at step 10 or 20: the sidecar may lag the spool)
            _settled(c, fresh, 20)
            cursor = c.cursors[0]
            assert cursor is not None and cursor.step == 20
            got = fresh.tables()
            for t, want in w.truth.items():
                assert torch.equal(got[t], want), t
            assert c.wait_for_new(0.2) is False  # heartbeats and long polls work again
        assert _consumers(eps[0]) == ["again"]


def test_connect_after_close_resyncs(tmp_path: Path, redis_url: str) -> None:
    """The first pull after connect() again sends the full tables (as a new consumer's)."""
    SpoolWriter(tmp_path / "spool").delta()
    with _servers(tmp_path / "spool", redis_url, [0]) as eps:
        c = DeltaConsumer(_config("resync", eps))
        with c:
            _settled(c, TensorDictApplier(), 10)
            assert not c.sync(TensorDictApplier()).resync
        with c:
            r = c.sync(TensorDictApplier())
            assert r.resync and r.step == 10 and not r.missing


# ---- arguments --------------------------------------------------------------------------


def test_commit_sync_and_wait_for_new_check_their_arguments(tmp_path: Path, redis_url: str) -> None:
    SpoolWriter(tmp_path / "spool").delta()
    with _servers(tmp_path / "spool", redis_url, [0]) as eps:
        c = DeltaConsumer(_config("args", eps))
        # checked before anything else: an unconnected consumer says so only for good arguments
        with pytest.raises(TypeError, match=r"commit\(\) takes the PullResult of pull\(\)"):
            c.commit(None)  # type: ignore[arg-type]
        for bad in (None, 123):
            with pytest.raises(TypeError, match=r"sync\(\) takes an applier or a callable"):
                c.sync(bad)  # type: ignore[arg-type]
        for t in (float("nan"), "1", None, True):
            with pytest.raises(ConfigError, match="timeout_s must be a number of seconds"):
                c.wait_for_new(t)  # type: ignore[arg-type]
        with c:
            applier = TensorDictApplier()
            _settled(c, applier, 10)
            with pytest.raises(TypeError, match="not NoneType"):
                c.commit(None)  # type: ignore[arg-type]
            with pytest.raises(ConfigError, match="not nan"):
                c.wait_for_new(float("nan"))
            # inf: held until the sidecar's cap, or here until stop is set
            stop = threading.Event()
            threading.Timer(0.3, stop.set).start()
            started = time.monotonic()
            assert c.wait_for_new(float("inf"), stop=stop) is False
            assert time.monotonic() - started < 5
