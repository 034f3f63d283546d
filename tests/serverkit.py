"""Helpers for the sidecar tests: a spool writer standing in for the trainer, a real Redis, a
real sidecar on port 0, and a consumer-side table rebuild. No mocks."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import torch
from spoolkit import wait_for  # noqa: F401  (the one wait_for; re-exported for tests)

from deltad import wire
from deltad.config import ServerConfig
from deltad.consume import decode
from deltad.consume.window import RankDelta
from deltad.segment.format import ShardRows, write_segment
from deltad.segment.spool import GenerationManifest, SpoolLayout, TableInfo
from deltad.serve.edge.app import SidecarServer
from deltad.store import EmbeddedRedis
from deltad.types import Form, SegmentKind, Shard, WireDtype
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc

MODEL = "m"


class SpoolWriter:
    """Writes a rank's segments like the trainer would, keeping the true tables in memory.

    ``tables``: name -> (num_rows, dim); rank ``r`` of ``world_size`` owns the row range
    ``[r * n // ws, (r + 1) * n // ws)``; ``col_split`` splits every table's columns into that
    many column-wise slices (all on this rank).
    """

    def __init__(
        self,
        root: Path,
        *,
        tables: dict[str, tuple[int, int]] | None = None,
        generation: int = 1,
        rank: int = 0,
        world_size: int = 1,
        col_split: int = 1,
        seed: int = 0,
        fsync: bool = False,
    ) -> None:
        self.layout = SpoolLayout(root, MODEL)
        self.specs = tables or {"t0": (1000, 8), "t1": (500, 4)}
        self.rank, self.world_size, self.col_split, self.fsync = rank, world_size, col_split, fsync
        self.gen = torch.Generator().manual_seed(seed)
        self.generation = generation
        self.start_generation(generation)

    def rows(self, table: str) -> tuple[int, int]:
        n = self.specs[table][0]
        return self.rank * n // self.world_size, (self.rank + 1) * n // self.world_size

    def cols(self, table: str) -> list[tuple[int, int]]:
        dim = self.specs[table][1]
        step = dim // self.col_split
        return [
            (i * step, dim if i == self.col_split - 1 else (i + 1) * step)
            for i in range(self.col_split)
        ]

    def start_generation(
        self, generation: int, start_step: int = 0, truth: dict[str, torch.Tensor] | None = None
    ) -> None:
        """A new generation: fresh tables (or ``truth``), manifest, base segment (seq 0)."""
        self.generation = generation
        self.truth = (
            truth
            if truth is not None
            else {t: torch.randn(n, d, generator=self.gen) for t, (n, d) in self.specs.items()}
        )
        self.seq, self.step = -1, start_step
        self.layout.write_manifest(
            GenerationManifest(
                MODEL,
                generation,
                self.world_size,
                start_step,
                time.time(),
                tuple(
                    TableInfo(t, n, d, "float32", "ec", "ec", "row_wise")
                    for t, (n, d) in self.specs.items()
                ),
            ),
            fsync=self.fsync,
        )
        self._write({t: torch.arange(*self.rows(t)) for t in self.specs}, SegmentKind.BASE)

    def delta(self, touched: dict[str, Any] | None = None, n: int = 50) -> int:
        """Update rows (given ids, or ``n`` random ones per table) and publish; returns seq."""
        ids: dict[str, torch.Tensor] = {}
        for t in self.specs:
            lo, hi = self.rows(t)
            if touched is not None:
                ids[t] = torch.as_tensor(touched.get(t, []), dtype=torch.int64).unique()
            else:
                ids[t] = (torch.randperm(hi - lo, generator=self.gen)[:n] + lo).sort().values
            self.truth[t][ids[t]] += torch.randn(
                ids[t].numel(), self.specs[t][1], generator=self.gen
            )
        self.step += 10
        return self._write(ids, SegmentKind.DELTA)

    def _write(self, ids: dict[str, torch.Tensor], kind: SegmentKind) -> int:
        self.seq += 1
        chunks = []
        for t, i in ids.items():
            lo, hi = self.rows(t)
            n, d = self.specs[t]
            for c0, c1 in self.cols(t):
                chunks.append(
                    ShardRows(
                        Shard(t, n, d, lo, hi, c0, c1), i, self.truth[t][i, c0:c1].contiguous()
                    )
                )
        write_segment(
            self.layout.segment_path(self.generation, self.rank, self.seq),
            model=MODEL,
            generation=self.generation,
            rank=self.rank,
            world_size=self.world_size,
            seq=self.seq,
            step=self.step,
            kind=kind,
            shards=chunks,
            fsync=self.fsync,
        )
        return self.seq

    def shard(self, table: str) -> torch.Tensor:
        lo, hi = self.rows(table)
        return self.truth[table][lo:hi]


class Replica:
    """What a consumer holds: full tables rebuilt by applying RankDeltas."""

    def __init__(self) -> None:
        self.tables: dict[str, torch.Tensor] = {}

    def apply(self, d: RankDelta) -> None:
        # a resync window holds every row of the rank's shards: overwriting them is a replace
        for s in d.shards:
            t = self.tables.setdefault(s.shard.table, torch.zeros(s.shard.num_rows, s.shard.dim))
            if s.values is not None and s.ids.numel():
                t[s.ids, s.shard.col_start : s.shard.col_end] = s.values


class Client:
    """A consumer's view of one sidecar: stub, raw pull, commit."""

    def __init__(self, target: str, token: str | None = None) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = delta_pb2_grpc.DeltaServiceStub(self.channel)
        self.md = [("authorization", f"Bearer {token}")] if token else None

    def pull(
        self,
        consumer: str,
        form: Form = Form.ROWS,
        *,
        dtype: WireDtype = WireDtype.FP32,
        raw: bool = True,
        **kw: Any,
    ) -> RankDelta:
        req = pb.GetDeltaRequest(
            consumer=consumer, form=wire.form_to_pb(form), dtype=wire.dtype_to_pb(dtype), **kw
        )
        if raw:
            return decode.pull(self.channel, req, timeout=30, metadata=self.md)
        return decode.decode_stream(self.stub.GetDelta(req, timeout=30, metadata=self.md))

    def commit(self, d: RankDelta) -> pb.CommitResponse:
        return self.stub.Commit(
            pb.CommitRequest(consumer=d.cursor.consumer, cursor=wire.cursor_to_pb(d.cursor)),
            timeout=10,
            metadata=self.md,
        )

    def close(self) -> None:
        self.channel.close()


def resumed(srv: SidecarServer) -> tuple[float, float]:
    """(streams resumed, messages not sent again) by ``srv``."""
    labels = {"model": srv.config.model, "rank": str(srv.config.rank)}
    get = srv.metrics.registry.get_sample_value
    return (
        get("deltad_getdelta_resumed_total", labels) or 0.0,
        get("deltad_getdelta_resumed_messages_total", labels) or 0.0,
    )


def server_config(root: Path, redis_url: str | None, **kw: Any) -> ServerConfig:
    opts: dict[str, Any] = {
        "spool_dir": root,
        "model": MODEL,
        "listen": "127.0.0.1:0",
        "redis_url": redis_url,
        "poll_interval_s": 0.02,
        "retention_interval_s": 3600.0,
        "grace_period_s": 1.0,
    }
    opts.update(kw)
    return ServerConfig(**opts)


class ReusedRedis:
    """One real embedded redis-server handed from test to test, as empty as a new one.

    Starting and stopping a redis-server for each of a few hundred tests cost the fast lane
    more than many of their bodies. After a test, every key of every db is deleted, and the
    server is replaced by a new one when the test left it in any other state: stopped or
    killed, or with a client still connected (a server or consumer left running could write
    into the next test's store)."""

    def __init__(self) -> None:
        self.server: EmbeddedRedis | None = None
        self.started = 0
        self.reused = 0

    def acquire(self, new_dir: Callable[[], Path]) -> EmbeddedRedis:
        """The server for the next test: the previous one if clean, else a new one in
        ``new_dir()``."""
        if self.server is not None:
            self.reused += 1
            return self.server
        self.server = EmbeddedRedis(new_dir())
        self.server.start()
        self.started += 1
        return self.server

    def release(self) -> None:
        """After a test: empty the server, or drop it if it is not as a new one would be."""
        server = self.server
        if server is None:
            return
        try:
            clean = self._empty(server)
        except (redis.RedisError, OSError):
            clean = False
        if not clean:
            self.close()

    @staticmethod
    def _empty(server: EmbeddedRedis) -> bool:
        if server.proc is None or server.proc.poll() is not None:
            return False
        admin = redis.Redis.from_url(server.url, socket_timeout=5, socket_connect_timeout=5)
        try:
            if len(admin.client_list()) > 1:
                return False
            for db in admin.info("keyspace"):  # "db0", "db3": the dbs holding keys (relays)
                url = server.url.replace("?db=0&", f"?db={int(db[2:])}&")
                c = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
                try:
                    for keys in _batches(c.scan_iter(count=1000), 1000):
                        c.unlink(*keys)
                finally:
                    c.close()
            return not admin.info("keyspace")
        finally:
            admin.close()

    def close(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop(kill=True)


def _batches(it: Iterator[bytes], n: int) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


#: The server every test of this session gets from :func:`redis_server`.
REUSED_REDIS = ReusedRedis()


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """The one Redis fixture (conftest re-exports it): a real redis-server with no keys and no
    other client, reused across tests while they leave it so (:class:`ReusedRedis`)."""
    r = REUSED_REDIS.acquire(lambda: tmp_path_factory.mktemp("redis-data"))
    try:
        yield r
    finally:
        REUSED_REDIS.release()


@pytest.fixture
def spool(tmp_path: Path) -> SpoolWriter:
    return SpoolWriter(tmp_path / "spool")


@pytest.fixture
def sidecar(
    tmp_path: Path, spool: SpoolWriter, redis_server: EmbeddedRedis
) -> Iterator[SidecarServer]:
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    yield srv
    srv.stop(0)


@pytest.fixture
def client(sidecar: SidecarServer) -> Iterator[Client]:
    c = Client(f"127.0.0.1:{sidecar.port}")
    yield c
    c.close()
