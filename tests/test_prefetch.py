"""GetDelta's prefetching producer (deltad.serve.windows.prefetch): order kept, bounded by
count and bytes, errors raised in the reader (and over gRPC with the status of today), a stop
or a cancel ends the producer thread and closes its source."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from serverkit import Client, SpoolWriter, redis_server, server_config, wait_for

from deltad import perf
from deltad.errors import SpoolError
from deltad.serve.edge.app import SidecarServer
from deltad.serve.windows import encode
from deltad.serve.windows.prefetch import Prefetch, PrefetchStopped
from deltad.store import EmbeddedRedis
from deltad.v1 import delta_pb2 as pb

__all__ = ["redis_server"]


class Source:
    """A generator of numbered messages that records how far it got and whether it closed."""

    def __init__(self, n: int, size: int = 100, fail_at: int | None = None) -> None:
        self.n, self.size, self.fail_at = n, size, fail_at
        self.made = 0
        self.closed = threading.Event()
        self.release = threading.Event()  # set: produce freely; clear: block before item 1
        self.release.set()

    def __iter__(self) -> Iterator[bytes]:
        try:
            for i in range(self.n):
                if i == 1:
                    assert self.release.wait(30)
                if i == self.fail_at:
                    raise SpoolError(f"segment vanished at {i}")
                self.made += 1
                yield i.to_bytes(4, "little") * (self.size // 4)
        finally:
            self.closed.set()


def _index(m: bytes) -> int:
    return int.from_bytes(m[:4], "little")


def test_messages_come_out_in_order_and_complete() -> None:
    src = Source(200)
    with Prefetch(iter(src), max_items=2, max_bytes=1000) as p:
        got = [_index(m) for m in p]
    assert got == list(range(200))
    assert not p.alive and src.closed.is_set()


def test_the_producer_runs_ahead_by_at_most_the_bounds() -> None:
    src = Source(100, size=400)
    p = Prefetch(iter(src), max_items=3, max_bytes=1000)  # bytes bind first: 2 messages
    try:
        # with nobody reading, the producer fills the queue and waits holding one more
        wait_for(lambda: src.made == 3, timeout_s=10.0, what="the producer to fill the queue")
        assert next(p) is not None  # room for one more
        wait_for(lambda: src.made == 4, timeout_s=10.0, what="the producer to refill")
        assert sum(1 for _ in p) == 99
        assert p.peak_bytes <= 1000
        assert p.producer_waits >= 1  # it waited for room at least while nobody read
    finally:
        p.close()
    src = Source(100, size=100)
    with Prefetch(iter(src), max_items=3, max_bytes=10_000) as p:  # count binds: 3 messages
        wait_for(lambda: src.made == 4, timeout_s=10.0, what="the producer to fill the queue")
        assert src.made == 4 and p.peak_bytes == 300
        assert sum(1 for _ in p) == 100


def test_one_message_bigger_than_the_byte_bound_still_passes() -> None:
    src = Source(5, size=4000)
    with Prefetch(iter(src), max_items=4, max_bytes=1000) as p:
        assert [_index(m) for m in p] == [0, 1, 2, 3, 4]
    assert p.peak_bytes == 4000


def test_an_error_mid_stream_is_raised_in_the_reader_after_the_messages_before_it() -> None:
    src = Source(10, fail_at=6)
    got = []
    p = Prefetch(iter(src), max_items=2, max_bytes=10_000)
    with p, pytest.raises(SpoolError, match="vanished at 6"):
        for m in p:
            got.append(_index(m))
    assert got == [0, 1, 2, 3, 4, 5]
    assert not p.alive and src.closed.is_set()


def test_a_stop_from_another_thread_ends_the_producer_and_closes_the_source() -> None:
    src = Source(1000)
    src.release.clear()  # the producer blocks making message 1
    p = Prefetch(iter(src), max_items=2, max_bytes=10_000)
    assert _index(next(p)) == 0
    threading.Thread(target=p.stop).start()  # e.g. gRPC's cancel callback
    src.release.set()
    with pytest.raises(PrefetchStopped):
        while True:
            next(p)
    assert p.close()
    assert not p.alive and src.closed.is_set() and src.made < 1000


def test_a_reader_closing_early_ends_the_producer_and_closes_the_source() -> None:
    src = Source(1000)
    p = Prefetch(iter(src), max_items=2, max_bytes=10_000)
    assert [_index(next(p)) for _ in range(3)] == [0, 1, 2]
    assert p.close()
    assert src.closed.is_set() and src.made < 1000


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        Prefetch(iter([b"x"]), max_items=0, max_bytes=10)


# --- through gRPC ---------------------------------------------------------------------------


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "deltad-prefetch"]


def _serve(tmp_path: Path, redis_url: str, **kw: object) -> SidecarServer:
    return SidecarServer(server_config(tmp_path / "spool", redis_url, **kw)).start()


def test_a_window_is_the_same_messages_with_and_without_prefetch(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    spool = SpoolWriter(tmp_path / "spool", tables={"a": (20_000, 16), "b": (3000, 8)})
    for _ in range(3):
        spool.delta(n=2000)
    streams = {}
    for prefetch in (0, 3):
        srv = _serve(tmp_path, redis_server.url, prefetch_messages=prefetch, prefetch_bytes=200_000)
        c = Client(f"127.0.0.1:{srv.port}")
        try:
            req = pb.GetDeltaRequest(consumer=f"c{prefetch}", chunk_bytes=64 * 1024)
            msgs = list(c.stub.GetDelta(req, timeout=30))
            assert msgs[-1].HasField("trailer")
            streams[prefetch] = [m.SerializeToString() for m in msgs[:-1]]
            d = c.pull(f"d{prefetch}", chunk_bytes=64 * 1024)
            assert d.rows == 23_000
            got = next(s for s in d.shards if s.shard.table == "a")
            assert got.values is not None
            assert (got.values == spool.shard("a")[got.ids]).all()
        finally:
            c.close()
            srv.stop(0)
    assert len(streams[3]) > 10
    assert streams[3] == streams[0]
    assert not _prefetch_threads()


@pytest.mark.parametrize("prefetch", [0, 3])
def test_an_error_mid_stream_reaches_the_client_with_the_same_status(
    tmp_path: Path, redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch, prefetch: int
) -> None:
    SpoolWriter(tmp_path / "spool", tables={"a": (50_000, 16)})
    real, calls = encode.RowFraming.new, [0]

    def failing(*a: object, **kw: object) -> tuple[bytes, int, int]:
        calls[0] += 1
        if calls[0] == 4:  # (fp32 rows from the base: each message is framed here)
            raise SpoolError("segment vanished mid-stream")
        return real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(encode.RowFraming, "new", failing)
    srv = _serve(tmp_path, redis_server.url, prefetch_messages=prefetch, window_cache_entries=0)
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        req = pb.GetDeltaRequest(consumer="c", chunk_bytes=64 * 1024)
        got = []
        with pytest.raises(grpc.RpcError) as e:
            for m in c.stub.GetDelta(req, timeout=30):
                got.append(m)
        assert e.value.code() == grpc.StatusCode.UNKNOWN
        assert "segment vanished mid-stream" in (e.value.details() or "")
        assert len(got) == 4  # the header and the 3 chunks made before the error
    finally:
        c.close()
        srv.stop(0)
    assert not _prefetch_threads()


def test_a_cancelled_stream_leaves_no_producer_thread(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    SpoolWriter(tmp_path / "spool", tables={"big": (200_000, 64)})
    srv = _serve(tmp_path, redis_server.url, prefetch_messages=2, window_cache_entries=0)
    c = Client(f"127.0.0.1:{srv.port}")
    try:
        req = pb.GetDeltaRequest(consumer="quitter", chunk_bytes=64 * 1024)
        stream = c.stub.GetDelta(req, timeout=30)
        next(stream), next(stream)
        assert _prefetch_threads()
        stream.cancel()
        wait_for(lambda: not _prefetch_threads(), timeout_s=15.0, what="the producer to end")
        wait_for(lambda: srv.servicer._streams == 0, timeout_s=15.0, what="the slot freed")
        assert c.pull("next", chunk_bytes=64 * 1024).rows == 200_000  # the sidecar serves on
    finally:
        c.close()
        srv.stop(0)


def test_no_producer_thread_for_a_cached_window_or_a_packed_dtype(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """Prefetch builds ahead only where building is work: an uncached fp32 window gets a
    producer thread; the same window once cached (every chunk built) and a packed-int8 window
    (copies of rows packed once) are streamed from the handler thread, with the same bytes."""
    spool = SpoolWriter(tmp_path / "spool", tables={"big": (100_000, 64)})
    srv = _serve(tmp_path, redis_server.url, prefetch_messages=2)
    c = Client(f"127.0.0.1:{srv.port}")

    def first_messages(consumer: str, dtype: int) -> tuple[bool, list[bytes]]:
        req = pb.GetDeltaRequest(consumer=consumer, chunk_bytes=64 * 1024, dtype=dtype)
        stream = c.stub.GetDelta(req, timeout=30)
        msgs = [next(stream).SerializeToString() for _ in range(3)]
        producing = bool(_prefetch_threads())
        msgs += [m.SerializeToString() for m in stream]
        wait_for(lambda: not _prefetch_threads(), timeout_s=15.0, what="the producer to end")
        return producing, msgs

    try:
        fp32 = pb.WIRE_DTYPE_FP32
        assert first_messages("fresh", fp32)[0]  # merged and encoded as it is sent
        cached, again = first_messages("cached", fp32)
        # (the trailer holds the consumer's name and pull id)
        assert not cached and again[:-1] == first_messages("fresh-2", fp32)[1][:-1]
        packed, msgs = first_messages("packed", pb.WIRE_DTYPE_PACKED_INT8)
        assert not packed and msgs[-1] and len(msgs) > 3
        d = c.pull("check", chunk_bytes=64 * 1024)
        assert (
            d.rows == 100_000 and (d.shards[0].values == spool.shard("big")[d.shards[0].ids]).all()
        )
    finally:
        c.close()
        srv.stop(0)


def test_the_default_depth_follows_the_cores_the_sidecar_may_use(tmp_path: Path) -> None:
    """The producer thread is on by default only with cores to spare for it (on 2 it costs
    more than it overlaps: deltad.perf.PREFETCH_MIN_CORES); an explicit depth always wins."""
    assert [perf.default_prefetch_messages(n) for n in (1, 2, 3, 4, 64)] == [0, 0, 0, 3, 3]
    cores = perf.usable_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    cfg = server_config(tmp_path / "spool", None)
    assert cfg.prefetch_messages == perf.default_prefetch_messages(cores)
    assert server_config(tmp_path / "spool", None, prefetch_messages=5).prefetch_messages == 5
    # a process allowed one CPU (taskset, a cpuset) counts one, and builds in gRPC's thread
    first = min(os.sched_getaffinity(0))
    code = (
        f"import os; os.sched_setaffinity(0, {{{first}}}); from deltad import perf; "
        "from deltad.config import ServerConfig; "
        "print(perf.usable_cores(), ServerConfig(spool_dir='x', model='m').prefetch_messages)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "0"]


@pytest.mark.parametrize(
    ("cgroup", "files", "cores"),
    [
        ("0::/kubepods/pod1\n", {"kubepods/pod1/cpu.max": "150000 100000\n"}, 1.5),
        ("0::/kubepods/pod1\n", {"kubepods/pod1/cpu.max": "max 100000\n"}, None),
        (
            "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n",
            {
                "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "400000\n",
                "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
            },
            4.0,
        ),
        (
            "3:cpu,cpuacct:/docker/abc\n",  # mounted as "cpu" only
            {"cpu/docker/abc/cpu.cfs_quota_us": "-1\n", "cpu/docker/abc/cpu.cfs_period_us": "1"},
            None,
        ),
        ("0::/gone\n", {}, None),
    ],
)
def test_a_containers_cpu_limit_is_read_from_its_cgroup(
    tmp_path: Path, cgroup: str, files: dict[str, str], cores: float | None
) -> None:
    (tmp_path / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        (tmp_path / "fs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / rel).write_text(text)
    got = perf.cgroup_cpu_quota(str(tmp_path / "cgroup"), str(tmp_path / "fs"))
    assert got == cores
