"""gRPC fuzz: garbage request bytes and hostile field values against a real `deltad serve`:
INVALID_ARGUMENT (or another deliberate status, never UNKNOWN / INTERNAL), bounded memory,
at most a rate-limited log line, and the sidecar keeps serving."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from serverkit import Client, SpoolWriter, redis_server
from spoolkit import child_env, read_serving_line, stop_process

from deltad.store import EmbeddedRedis
from deltad.v1 import delta_pb2 as pb

__all__ = ["redis_server"]

METHODS = ["GetDelta", "Commit", "Register", "Heartbeat", "ListConsumers", "Status"]
BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _call(ch: grpc.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    path = f"/deltad.v1.DeltaService/{method}"
    try:
        if method == "GetDelta":
            for _ in ch.unary_stream(path)(payload, timeout=10):
                pass
        else:
            ch.unary_unary(path)(payload, timeout=10)
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _garbage(rng: random.Random) -> bytes:
    kind = rng.randrange(4)
    n = rng.choice([1, 3, 17, 200, 5000])
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(n))
    if kind == 1:  # a length-delimited field running past the end
        return b"\x0a" + bytes([0xFF, 0xFF, 0x7F]) + b"x" * rng.randrange(10)
    if kind == 2:  # invalid UTF-8 in the consumer string
        return b"\x0a\x04\xff\xfe\xfd\xfc"
    return b"\x08" + b"\xff" * 11  # a varint longer than 10 bytes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_garbage_and_hostile_fields_are_refused_with_bounded_memory(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    SpoolWriter(tmp_path / "spool")
    err_file = open(tmp_path / "serve.err", "w")  # noqa: SIM115 (closed in finally)
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltad.commands.main", "serve", "--spool", str(tmp_path / "spool"),
         "--model", "m", "--listen", "127.0.0.1:0", "--redis-url", redis_server.url,
         "--max-consumers", "50", "--grace-period", "0"],
        stdout=subprocess.PIPE, stderr=err_file, text=True,
        env=child_env(),
    )  # fmt: skip
    try:
        target = read_serving_line(proc, 60)
        ch = grpc.insecure_channel(target)
        rng = random.Random(7)
        codes: dict[grpc.StatusCode, int] = {}

        def round_(n: int) -> None:
            for i in range(n):
                code = _call(ch, METHODS[i % len(METHODS)], _garbage(rng))
                codes[code] = codes.get(code, 0) + 1
                assert code not in BAD, code

        round_(600)  # warm-up: thread pools, allocator arenas
        before = _rss_kb(proc.pid)
        round_(3000)
        grown_mb = (_rss_kb(proc.pid) - before) / 1024
        print(f"RSS after 3000 garbage requests: {grown_mb:+.1f} MB; codes {codes}")
        assert grown_mb < 8, grown_mb
        assert codes.get(grpc.StatusCode.INVALID_ARGUMENT, 0) >= 2000

        # well-formed messages with hostile values
        hostile: list[tuple[str, bytes]] = []
        for name in ["", "x" * 5000, "ünï", "a/b", "a\nb", "-a", "a" * 129]:
            hostile.append(("GetDelta", pb.GetDeltaRequest(consumer=name).SerializeToString()))
            hostile.append(("Register", pb.RegisterRequest(consumer=name).SerializeToString()))
            hostile.append(("Heartbeat", pb.HeartbeatRequest(consumer=name).SerializeToString()))
        for req in [
            pb.GetDeltaRequest(consumer="f", form=99),
            pb.GetDeltaRequest(consumer="f", dtype=77),
            pb.GetDeltaRequest(consumer="f", form=pb.FORM_TOPK, fraction=math.nan),
            pb.GetDeltaRequest(consumer="f", form=pb.FORM_TOPK, fraction=math.inf),
            pb.GetDeltaRequest(consumer="f", form=pb.FORM_TOPK, k=2**64 - 1),
            pb.GetDeltaRequest(consumer="f", max_rows=2**64 - 1),
            pb.GetDeltaRequest(consumer="f", tables=[f"t{i}" for i in range(5000)]),
            pb.GetDeltaRequest(consumer="f", chunk_bytes=2**32 - 1),
            pb.GetDeltaRequest(consumer="f", max_step=-(2**63)),
        ]:
            hostile.append(("GetDelta", req.SerializeToString()))
        for ttl in [-1.0, math.nan, math.inf, 1e300]:
            req2 = pb.RegisterRequest(consumer="f", lease_ttl_seconds=ttl)
            hostile.append(("Register", req2.SerializeToString()))
        for cursor in [
            pb.Cursor(consumer="f", rank=7, seq=1),
            pb.Cursor(consumer="g", seq=1),
            pb.Cursor(consumer="f", generation=2**64 - 1, seq=2**63 - 1, pull_id="p" * 100000),
        ]:
            req3 = pb.CommitRequest(consumer="f", cursor=cursor)
            hostile.append(("Commit", req3.SerializeToString()))
        for i in range(80):  # more names than --max-consumers
            hostile.append(("Register", pb.RegisterRequest(consumer=f"n{i}").SerializeToString()))
        seen: dict[grpc.StatusCode, int] = {}
        for method, payload in hostile:
            code = _call(ch, method, payload)
            seen[code] = seen.get(code, 0) + 1
            assert code not in BAD, (method, payload[:80], code)
        assert seen.get(grpc.StatusCode.RESOURCE_EXHAUSTED, 0) >= 30
        ch.close()
        c = Client(target)  # still serving, and the limit held
        assert c.pull("n1").rows == 1500
        c.close()
    finally:
        stop_process(proc)
        err_file.close()
    err = (tmp_path / "serve.err").read_text()
    assert "Traceback" not in err and "Exception deserializing" not in err, err[-2000:]
    malformed = [ln for ln in err.splitlines() if "malformed" in ln]
    assert 1 <= len(malformed) <= 5, malformed  # rate-limited: one per 10 s
