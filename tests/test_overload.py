"""Overload without failure: more consumers than --max-concurrent-streams on a real sidecar.

Slots are held deterministically by "stalled" GetDelta streams: a raw stream whose reader
takes the header and stops reading, so the sidecar blocks in a send under flow control (a
25 MB window is far larger than what gRPC buffers) until the test cancels it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from spoolkit import FakeTrainer, wait_for

from deltad import wire
from deltad.config import ConsumerConfig, ServerConfig
from deltad.consume import decode
from deltad.consume.appliers import TensorDictApplier
from deltad.consume.client import DeltaConsumer, PullResult
from deltad.errors import OverloadedError
from deltad.serve.edge.app import SidecarServer
from deltad.v1 import delta_pb2 as pb

pytestmark = pytest.mark.timeout(120)

TABLES = {"t0": (100_000, 64)}  # 25.6 MB of fp32 rows


def sidecar(tmp_path: Path, redis_url: str, **kw: object) -> SidecarServer:
    ft = FakeTrainer(tmp_path / "spool", world_size=1, tables=TABLES)
    ft.start(0)
    ft.step(10)
    cfg = ServerConfig(
        spool_dir=tmp_path / "spool", model="m", listen="127.0.0.1:0", redis_url=redis_url,
        poll_interval_s=0.02, grace_period_s=0.2, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    return SidecarServer(cfg).start()


class Stalled:
    """A GetDelta stream that read its header and stopped reading: it holds a slot."""

    def __init__(self, endpoint: str, name: str) -> None:
        self.channel = grpc.insecure_channel(endpoint)
        req = pb.GetDeltaRequest(consumer=name, form=pb.FORM_ROWS, from_base=True)
        self.call = decode.raw_get_delta(self.channel)(req, timeout=60)
        next(iter(self.call))  # the header: the server holds the slot and is sending

    def release(self) -> None:
        self.call.cancel()
        self.channel.close()


def stalled(srv: SidecarServer, n: int) -> Iterator[Stalled]:
    for i in range(n):
        yield Stalled(srv.endpoint, f"stall{i}")


def consumer(srv: SidecarServer, name: str, **kw: object) -> DeltaConsumer:
    return DeltaConsumer(
        ConsumerConfig(
            consumer=name, model="m", sidecars=(srv.endpoint,), rpc_deadline_s=30.0,
            max_retries=2, backoff_initial_s=0.05, backoff_max_s=0.5, **kw,  # type: ignore[arg-type]
        )
    )  # fmt: skip


def test_refused_call_carries_a_retry_hint(tmp_path: Path, redis_url: str) -> None:
    srv = sidecar(tmp_path, redis_url, max_concurrent_streams=1, max_queued_streams=0)
    held = list(stalled(srv, 1))
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            req = pb.GetDeltaRequest(consumer="late", form=pb.FORM_ROWS)
            with pytest.raises(grpc.RpcError) as info:
                decode.pull(ch, req, timeout=10)
        e = info.value
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        hints = dict(e.trailing_metadata())  # type: ignore[attr-defined]
        assert 50 <= int(hints[wire.RETRY_AFTER_KEY]) <= 30_000
        assert "retry in" in e.details()  # type: ignore[attr-defined]
        assert srv.servicer.refused == 1
    finally:
        for s in held:
            s.release()
        srv.stop(0)


def test_more_consumers_than_streams_are_all_served(tmp_path: Path, redis_url: str) -> None:
    """2 stream slots held, 2 places in line, 12 consumers pulling at once: the sidecar queues
    two and refuses the rest with a hint; once the slots free up every consumer gets its
    tables (nothing missing, no error)."""
    srv = sidecar(
        tmp_path, redis_url, max_concurrent_streams=2, max_queued_streams=2,
        stream_queue_wait_s=0.3,
    )  # fmt: skip
    held = list(stalled(srv, 2))
    results: dict[str, PullResult | BaseException] = {}
    appliers = {f"c{i}": TensorDictApplier() for i in range(12)}

    def pull(name: str) -> None:
        try:
            with consumer(srv, name) as c:
                results[name] = c.sync(appliers[name].apply)
        except BaseException as e:
            results[name] = e

    threads = [threading.Thread(target=pull, args=(n,)) for n in appliers]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: srv.servicer.refused >= 10, 30, "refusals while the slots are held")
        time.sleep(0.5)  # refused consumers are waiting out their hints now
        for s in held:
            s.release()
        for t in threads:
            t.join(60)
    finally:
        for s in held:
            s.release()
        srv.stop(0)
    assert all(isinstance(r, PullResult) for r in results.values()), results
    for name, r in results.items():
        assert isinstance(r, PullResult)
        assert not r.missing and r.step == 10 and r.rows == TABLES["t0"][0], name
        assert appliers[name].tables()["t0"].shape == TABLES["t0"]
    assert len(results) == 12


def test_a_pull_that_gives_up_on_an_overloaded_sidecar_raises(
    tmp_path: Path, redis_url: str
) -> None:
    srv = sidecar(tmp_path, redis_url, max_concurrent_streams=1, max_queued_streams=0)
    held = list(stalled(srv, 1))
    try:
        with consumer(srv, "impatient", overload_wait_s=0.5) as c:
            t0 = time.monotonic()
            with pytest.raises(OverloadedError, match="stream limit"):
                c.pull()
            assert 0.5 <= time.monotonic() - t0 < 10
            assert srv.servicer.refused >= 2  # it did retry, honouring the hints
    finally:
        for s in held:
            s.release()
        srv.stop(0)


def test_callers_in_line_are_served_first_come_first_served(tmp_path: Path, redis_url: str) -> None:
    """One slot, three callers in line: each gets the slot in its turn, none is refused."""
    srv = sidecar(
        tmp_path, redis_url, max_concurrent_streams=1, max_queued_streams=3,
        stream_queue_wait_s=30.0,
    )  # fmt: skip
    held = list(stalled(srv, 1))
    order: list[str] = []
    lock = threading.Lock()

    def pull(name: str) -> None:
        with grpc.insecure_channel(srv.endpoint) as ch:
            decode.pull(ch, pb.GetDeltaRequest(consumer=name, from_base=True), timeout=60)
        with lock:
            order.append(name)

    threads = []
    try:
        for name in ("a", "b", "c"):
            t = threading.Thread(target=pull, args=(name,))
            t.start()
            threads.append(t)
            wait_for(lambda n=len(threads): len(srv.servicer._queue) == n, 10, "in line")  # type: ignore[misc]
        held[0].release()
        for t in threads:
            t.join(60)
    finally:
        for s in held:
            s.release()
        srv.stop(0)
    assert order == ["a", "b", "c"] and srv.servicer.refused == 0
