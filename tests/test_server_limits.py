"""Tokens, TLS/mTLS, health, reflection, metrics, stream limits and the shared window cache."""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from serverkit import MODEL, Client, SpoolWriter, redis_server, server_config, wait_for

from deltad import wire
from deltad.consume import decode
from deltad.serve.edge.app import SidecarServer
from deltad.store import EmbeddedRedis
from deltad.types import Form, WireDtype
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc

__all__ = ["redis_server"]


def _serve(tmp_path: Path, url: str, **kw: object) -> SidecarServer:
    return SidecarServer(server_config(tmp_path / "spool", url, **kw)).start()


def test_tokens_health_reflection_metrics(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    SpoolWriter(tmp_path / "spool")
    srv = _serve(tmp_path, redis_server.url, tokens=("s3cret", "other"), metrics_port=0)
    target = f"127.0.0.1:{srv.port}"
    try:
        for token in (None, "wrong"):
            c = Client(target, token)
            with pytest.raises(grpc.RpcError) as e:
                c.pull("t")
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                c.stub.Status(pb.StatusRequest(), metadata=c.md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            c.close()
        c = Client(target, "other")
        assert c.pull("t").rows == 1500
        health = health_pb2_grpc.HealthStub(c.channel)  # open without a token
        for service in ("", "deltad.v1.DeltaService"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(c.channel)
        answers = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
            metadata=c.md,
            timeout=5,
        )
        names = {s.name for a in answers for s in a.list_services_response.service}
        assert "deltad.v1.DeltaService" in names
        assert srv.metrics_port
        body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics").read()
        text = body.decode()
        for metric in (
            "deltad_served_bytes_total",
            "deltad_served_rows_total",
            "deltad_window_merge_seconds_count",
            "deltad_quarantined_segments_total",
        ):
            assert metric in text
        c.stub.ListConsumers(pb.ListConsumersRequest(), metadata=c.md)
        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics").read()
        assert b'deltad_consumer_lag_segments{consumer="t"' in text
        assert b'deltad_build_info{model="m",rank="0",version="' in text
        # every RPC is counted by method and code, refused ones included
        assert b'deltad_rpc_requests_total{code="OK",method="ListConsumers"' in text
        assert b'deltad_rpc_duration_seconds_count{method="GetDelta"' in text
        # memory near the data, read at scrape time: the log it serves and the window cache
        # holding the window just pulled (both > 0), nothing held for diffs, no long poll
        values = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.decode().splitlines()
            if line.startswith("deltad_") and "{" in line
        }
        assert values["deltad_log_bytes"] == srv.log.snapshot().nbytes > 0  # type: ignore[union-attr]
        assert 0 < values["deltad_window_cache_bytes"] <= srv.config.window_cache_bytes
        assert values["deltad_previous_generation_bytes"] == 0
        assert values["deltad_status_waiters"] == 0
        for gauge in ("deltad_run_cache_bytes", "deltad_spill_bytes", "deltad_owed_bytes"):
            assert values[gauge] >= 0
        # counters that only rise are counters; the process is measured too
        assert b"# TYPE deltad_windows_unkept_total counter" in text
        assert b"# TYPE deltad_owed_refused_total counter" in text
        assert b"# TYPE deltad_retention_failures_total counter" in text
        for process in (b"process_resident_memory_bytes", b"process_cpu_seconds_total",
                        b"process_open_fds"):  # fmt: skip
            assert process + b" " in text
        c.close()
    finally:
        srv.stop(0)


def test_metrics_split_a_pulls_cpu_into_building_and_streaming(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """``deltad_window_build_cpu_seconds`` counts the CPU that built a window's messages, once
    per window built (a cache hit builds nothing); ``deltad_getdelta_stream_cpu_seconds`` the
    gRPC handler's chunk loop of every stream."""
    SpoolWriter(tmp_path / "spool", tables={"big": (200_000, 32)})
    srv = _serve(tmp_path, redis_server.url, metrics_port=0)
    c = Client(f"127.0.0.1:{srv.port}")
    build, stream = "deltad_window_build_cpu_seconds", "deltad_getdelta_stream_cpu_seconds"

    def split() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics").read()
        return {
            line.split("_total{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.decode().splitlines()
            if line.startswith((build + "_total{", stream + "_total{"))
        }

    try:
        assert split() == {build: 0.0, stream: 0.0}
        assert c.pull("a").rows == 200_000  # built (a 25.6 MB window), kept in the cache
        first = split()
        assert first[build] > 0 and first[stream] > 0
        assert c.pull("a").rows == 200_000  # not committed: the same window, a cache hit
        hit = split()
        assert hit[build] == first[build]
        assert hit[stream] > first[stream]
        assert c.pull("b", dtype=WireDtype.FP16).rows == 200_000  # another window: built
        assert split()[build] > hit[build]
    finally:
        c.close()
        srv.stop(0)


def test_tls_and_mutual_tls(tmp_path: Path, redis_server: EmbeddedRedis, pki: Path) -> None:
    d = pki / "a"
    SpoolWriter(tmp_path / "spool")
    srv = _serve(
        tmp_path,
        redis_server.url,
        tls_cert=d / "server.pem",
        tls_key=d / "server.key",
        tls_client_ca=d / "ca.pem",
        listen="localhost:0",
    )
    ca = (d / "ca.pem").read_bytes()
    target = f"localhost:{srv.port}"
    req = pb.GetDeltaRequest(consumer="tls", form=pb.FORM_IDS)
    try:
        anon = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=ca))
        with pytest.raises(grpc.RpcError) as e:
            decode.pull(anon, req, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # handshake refused: no client cert
        anon.close()
        creds = grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=(d / "client.key").read_bytes(),
            certificate_chain=(d / "client.pem").read_bytes(),
        )
        ch = grpc.secure_channel(target, creds)
        assert decode.pull(ch, req, timeout=10).rows == 1500
        ch.close()
    finally:
        srv.stop(0)


def test_concurrency_limit_and_stream_deadline(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    SpoolWriter(tmp_path / "spool", tables={"big": (200_000, 32)})
    srv = _serve(  # nobody waits in line (test_overload.py): refused at once
        tmp_path, redis_server.url, max_concurrent_streams=1, max_queued_streams=0,
        stream_deadline_s=1.0,
    )  # fmt: skip
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        req = pb.GetDeltaRequest(consumer="a", chunk_bytes=64 * 1024)
        first = decode.raw_get_delta(c.channel)(req, timeout=30)
        next(first)  # the stream holds its slot: 26 MB wait behind flow control
        with pytest.raises(grpc.RpcError) as e:
            c.pull("b")
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        time.sleep(1.2)  # a slow reader runs into the server's stream deadline
        with pytest.raises(grpc.RpcError) as e:
            for _ in first:
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "stream_deadline_s" in (e.value.details() or "")
        assert c.pull("b", Form.IDS).rows == 200_000  # the slot was released
    finally:
        c.close()
        srv.stop(0)


def test_consumers_at_one_cursor_share_one_merge(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    spool = SpoolWriter(tmp_path / "spool", tables={"t": (50_000, 16)})
    srv = _serve(tmp_path, redis_server.url)
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        names = [f"c{i}" for i in range(8)]
        for n in names:
            c.commit(c.pull(n))
        for _ in range(10):
            spool.delta(n=5000)
        while srv.log.snapshot().head.seq != 10:  # type: ignore[union-attr]
            time.sleep(0.02)
        with ThreadPoolExecutor(8) as pool:  # at once: the first builds, the others wait
            deltas = list(pool.map(c.pull, names))
        assert len({d.rows for d in deltas}) == 1 and deltas[0].rows > 5000
        assert srv.servicer.cache.hits == 7 + 7  # base windows, then the delta windows
        merges = srv.metrics.registry.get_sample_value(
            "deltad_window_merge_seconds_count", {"model": "m", "rank": "0"}
        )
        assert merges == 2
    finally:
        c.close()
        srv.stop(0)


def test_stub_and_raw_paths_use_the_same_service(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    SpoolWriter(tmp_path / "spool")
    srv = _serve(tmp_path, redis_server.url)
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    try:
        stub = delta_pb2_grpc.DeltaServiceStub(ch)
        msgs = list(stub.GetDelta(pb.GetDeltaRequest(consumer="p"), timeout=10))
        assert msgs[0].WhichOneof("msg") == "header" and msgs[-1].WhichOneof("msg") == "trailer"
        assert sum(m.chunk.count for m in msgs[1:-1]) == 1500
    finally:
        ch.close()
        srv.stop(0)


def test_sidecar_loads_the_int8_kernel_at_start(
    tmp_path: Path, redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first INT8 pull does not wait for fbgemm's import: the sidecar loads it at start."""
    monkeypatch.setattr(wire, "_FBGEMM_Q8", None)
    srv = _serve(tmp_path, redis_server.url)
    try:
        wait_for(lambda: wire._FBGEMM_Q8 is not None, what="the int8 kernel preloaded")
        assert wire._FBGEMM_Q8 is not False, "fbgemm-gpu-cpu is installed: its kernel must load"
    finally:
        srv.stop(0)


def test_a_client_that_stops_reading_loses_its_slot_at_the_deadline(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """A stream blocked in a send (its client stopped reading, and never cancels) is cancelled
    at stream_deadline_s: its slot goes to the next consumer instead of being held for good."""
    SpoolWriter(tmp_path / "spool", tables={"big": (200_000, 64)})
    srv = _serve(tmp_path, redis_server.url, max_concurrent_streams=1, stream_deadline_s=1.0)
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        req = pb.GetDeltaRequest(consumer="stuck", chunk_bytes=64 * 1024)
        stuck = decode.raw_get_delta(c.channel)(req)  # no client deadline, and never read again
        next(stuck)
        assert srv.servicer._streams == 1
        wait_for(lambda: srv.servicer._streams == 0, timeout_s=10.0, what="the stuck stream freed")
        assert c.pull("b", Form.IDS).rows == 200_000
        stuck.cancel()
    finally:
        c.close()
        srv.stop(0)


def test_a_stream_that_sends_nothing_loses_its_slot_at_the_stall_bound_not_the_deadline(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """stream_stall_s frees a stuck stream's slot long before its deadline (an hour, the
    default); a slow reader that keeps reading for longer than the stall bound finishes."""
    SpoolWriter(tmp_path / "spool", tables={"big": (200_000, 64)})
    srv = _serve(tmp_path, redis_server.url, max_concurrent_streams=1, stream_stall_s=1.0)
    assert srv.config.stream_deadline_s == 3600.0
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        req = pb.GetDeltaRequest(consumer="stuck", chunk_bytes=64 * 1024)
        stuck = decode.raw_get_delta(c.channel)(req)  # never read again, never cancelled
        next(stuck)
        t0 = time.monotonic()
        wait_for(lambda: srv.servicer._streams == 0, timeout_s=10.0, what="the stuck stream freed")
        assert time.monotonic() - t0 < 5.0
        assert c.pull("b", Form.IDS).rows == 200_000
        stuck.cancel()
        slow = decode.raw_get_delta(c.channel)(
            pb.GetDeltaRequest(consumer="slow", chunk_bytes=64 * 1024), timeout=60
        )
        t0 = time.monotonic()
        msgs, last = 0, b""
        for msg in slow:  # ~800 messages; a pause of half the stall bound every 200
            msgs, last = msgs + 1, msg
            if msgs % 200 == 0:
                time.sleep(0.5)
        assert msgs > 800 and time.monotonic() - t0 > 1.0
        assert pb.GetDeltaResponse.FromString(last).WhichOneof("msg") == "trailer"
    finally:
        c.close()
        srv.stop(0)


def test_large_server_chunks_still_fit_the_consumers_receive_limit(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """A sidecar configured for 128 MB chunks (and 256 MB messages) sends none larger than a
    consumer accepts: pulls work instead of failing RESOURCE_EXHAUSTED."""
    from deltad.config import ConsumerConfig
    from deltad.consume.client import DeltaConsumer

    spool = SpoolWriter(tmp_path / "spool", tables={"big": (300_000, 64)})  # 77 MB of rows
    srv = _serve(tmp_path, redis_server.url, max_message_bytes=256 << 20, chunk_bytes=128 << 20)
    try:
        cfg = ConsumerConfig("wide", model=MODEL, sidecars=(f"127.0.0.1:{srv.port}",))
        with DeltaConsumer(cfg) as c:
            r = c.pull()
        assert not r.missing and r.rows == 300_000
        got = r.deltas[0].shards[0]
        assert torch.equal(got.values, spool.truth["big"][got.ids])  # type: ignore[index]
    finally:
        srv.stop(0)


def test_health_watch_and_reflection_streams_cannot_take_every_worker(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """Review 11: 200 open health Watch streams (no credential needed) held every RPC worker,
    and Status, GetDelta and the health checks all timed out. Such streams now have
    knobs.SIDE_STREAMS slots of their own, past which they are refused at once."""
    from deltad import knobs

    SpoolWriter(tmp_path / "spool")
    with knobs.override(SIDE_STREAMS=3):
        srv = _serve(
            tmp_path, redis_server.url, tokens=("s3cret",), metrics_port=0,
            max_concurrent_streams=2, max_queued_streams=0,
        )  # fmt: skip
    target = f"127.0.0.1:{srv.port}"
    anon = grpc.insecure_channel(target)
    c = Client(target, "s3cret")
    watches: list[grpc.Future] = []
    try:
        health = health_pb2_grpc.HealthStub(anon)
        for _ in range(3):  # no token: health is open
            w = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
            assert next(w).status == health_pb2.HealthCheckResponse.SERVING
            watches.append(w)
        # the fourth, with or without a credential, and a reflection stream: refused at once
        for md in (None, c.md):
            with pytest.raises(grpc.RpcError) as e:
                next(health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10,
                                  metadata=md))  # fmt: skip
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "SIDE_STREAMS" in (e.value.details() or "")
        refl = reflection_pb2_grpc.ServerReflectionStub(c.channel)
        with pytest.raises(grpc.RpcError) as e:
            list(refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                metadata=c.md, timeout=10,
            ))  # fmt: skip
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # everything else is served meanwhile, within its deadline
        t0 = time.monotonic()
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
        c.stub.Status(pb.StatusRequest(), metadata=c.md, timeout=5)
        assert c.pull("t").rows == 1500
        assert time.monotonic() - t0 < 5
        # a watch that ends gives its slot back
        watches.pop().cancel()
        wait_for(lambda: srv.gate.side_streams.active == 2, timeout_s=10)
        w = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        assert next(w).status == health_pb2.HealthCheckResponse.SERVING
        watches.append(w)
        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics").read()
        assert b"deltad_side_streams_refused_total 3.0" in text.replace(
            b'{model="m",rank="0"}', b""
        )
    finally:
        for w in watches:
            w.cancel()
        anon.close()
        c.close()
        srv.stop(0)


def test_the_head_age_gauge_grows_while_nothing_is_published(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """Review 10: with the trainer killed, every lag gauge stayed 0 and health SERVING; no
    metric said the source had stopped. ``deltad_head_age_seconds`` is the head's age."""
    spool = SpoolWriter(tmp_path / "spool")
    srv = _serve(tmp_path, redis_server.url, metrics_port=0)

    def age() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics").read()
        line = next(
            x for x in text.decode().splitlines() if x.startswith("deltad_head_age_seconds{")
        )
        return float(line.rsplit(" ", 1)[1])

    try:
        first = age()
        assert first >= 0
        time.sleep(1.0)
        later = age()
        assert later >= first + 0.9  # nothing published: it grows with the clock
        spool.delta()
        wait_for(lambda: srv.log.snapshot().head.seq == 1)  # type: ignore[union-attr]
        assert age() < later  # a new head is young
    finally:
        srv.stop(0)
