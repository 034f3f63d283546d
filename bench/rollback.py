"""Rollback: time from an operator's rollback order to every predictor serving the step, and
what it sends against a full resync; and what the restore points cost the log.

A 2-rank spool (``--tables`` tables of ``--rows`` x ``--dim`` fp32, row-wise shards) with a
base at step 0 and ``--deltas`` deltas (steps 1..n), each changing ``--touch`` of every table's
rows; a sidecar per rank (in-process, port 0, one embedded Redis) with a restore window over
every step. ``--predictors`` predictors (DeltaConsumer, rows form, fp32, TensorDictApplier;
one thread each) follow the head, directly or through one relay per rank. Then a rollback to
the middle step is ordered through rank 0's admin Rollout RPC (what ``deltad rollout rollback
--to-step S`` sends; the sidecars see the release state in Redis within 0.25 s, relays through
their upstream's Status); each predictor pulls every ``--poll`` seconds and stops once it
serves S. Measured per predictor: seconds from the order's answer to its tables holding S (p50 / p99 over the fleet), the bytes of its rollback pull and
of its bootstrap (a full resync of the same tables). Checked: every predictor's tables equal
the tables at S. Restore points: the log's bytes (memory: the private copies the sidecar
holds; disk: the spool) once retention ran with no consumer pinning anything, with the
restore window and without (everything merged into the base).

    python -m bench.rollback [--predictors 32] [--rows 200000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

MODEL = "m"


class Spool:
    """A 2-rank trainer's spool written step by step; ``history``: the tables at every step."""

    def __init__(self, root: Path, tables: int, rows: int, dim: int, touch: float) -> None:
        from deltad.segment.spool import GenerationManifest, SpoolLayout, TableInfo
        from deltad.types import SegmentKind

        self.layout = SpoolLayout(root, MODEL)
        self.names = [f"t{i}" for i in range(tables)]
        self.rows, self.dim, self.touch = rows, dim, touch
        self.layout.write_manifest(
            GenerationManifest(
                model=MODEL, generation=1, world_size=2, start_step=0, created_unix=time.time(),
                tables=tuple(TableInfo(n, rows, dim, "float32", "ebc", "ebc", "row_wise")
                             for n in self.names),
            )
        )  # fmt: skip
        self.gen = torch.Generator().manual_seed(0)
        self.state = {n: torch.randn(rows, dim, generator=self.gen) for n in self.names}
        self.history = {0: {n: t.clone() for n, t in self.state.items()}}
        self._write(0, {n: torch.arange(rows) for n in self.names}, SegmentKind.BASE)

    def delta(self, step: int) -> None:
        from deltad.types import SegmentKind

        ids = {}
        for n in self.names:
            k = int(self.touch * self.rows)
            ids[n] = torch.randperm(self.rows, generator=self.gen)[:k].sort().values
            self.state[n][ids[n]] = torch.randn(k, self.dim, generator=self.gen)
        self._write(step, ids, SegmentKind.DELTA)
        self.history[step] = {n: t.clone() for n, t in self.state.items()}

    def _write(self, step: int, ids: dict[str, torch.Tensor], kind: Any) -> None:
        from deltad.segment.format import ShardRows, write_segment
        from deltad.types import Shard

        half = (self.rows + 1) // 2
        for rank in range(2):
            lo, hi = rank * half, min(self.rows, (rank + 1) * half)
            parts = []
            for n in self.names:
                i = ids[n][(ids[n] >= lo) & (ids[n] < hi)]
                shard = Shard(n, self.rows, self.dim, lo, hi, 0, self.dim)
                parts.append(ShardRows(shard, i, self.state[n][i].clone()))
            write_segment(
                self.layout.segment_path(1, rank, step), model=MODEL, generation=1, rank=rank,
                world_size=2, seq=step, step=step, kind=kind, shards=parts, fsync=False,
            )  # fmt: skip


def db(url: str, n: int) -> str:
    """Database ``n`` of the embedded Redis (a relay's own keyspace, or a clean one)."""
    from urllib.parse import parse_qsl, urlencode, urlsplit

    u = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(u.query) if k != "db"] + [("db", str(n))]
    return f"unix://{u.path}?{urlencode(query)}"


def run_fleet(
    endpoints: list[str], n: int, control: str, step: int, truth: dict[str, torch.Tensor],
    poll: float,
) -> dict[str, Any]:  # fmt: skip
    """Bootstrap ``n`` predictors on ``endpoints``, order the rollback through the admin
    Rollout RPC of the sidecar at ``control`` (what `deltad rollout rollback` sends), time
    each one from the order's answer to serving ``step``."""
    from deltad.clientauth import ClientAuth
    from deltad.commands.rollout import call
    from deltad.config import ConsumerConfig, PullOptions
    from deltad.consume.appliers import TensorDictApplier
    from deltad.consume.client import DeltaConsumer
    from deltad.v1 import delta_pb2 as pb

    consumers, appliers, boot_bytes = [], [], []
    for i in range(n):
        c = DeltaConsumer(
            ConsumerConfig(
                consumer=f"pred-{i}", model=MODEL, sidecars=tuple(endpoints),
                rpc_deadline_s=60.0, pull=PullOptions(),
            )
        ).connect()  # fmt: skip
        a = TensorDictApplier()
        boot_bytes.append(c.sync(a.apply).bytes)
        consumers.append(c)
        appliers.append(a)
    done: list[float] = [0.0] * n
    sent: list[int] = [0] * n
    errors: list[str] = []
    go = threading.Event()
    ordered = [0.0]

    def follow(i: int) -> None:
        go.wait()
        try:
            for _ in range(10_000):  # bounded
                r = consumers[i].sync(appliers[i].apply)
                sent[i] += r.bytes
                if r.step == step:
                    done[i] = time.monotonic() - ordered[0]
                    return
                time.sleep(poll)
            errors.append(f"pred-{i} never reached step {step}")
        except Exception as e:  # reported, not raised in a thread
            errors.append(f"pred-{i}: {e!r}")

    threads = [threading.Thread(target=follow, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    call(control, pb.RolloutRequest(action=pb.ROLLOUT_ROLLBACK, step=step), auth=ClientAuth())
    ordered[0] = time.monotonic()
    go.set()
    for t in threads:
        t.join(600)
    exact = all(torch.equal(a.tables()[k], v) for a in appliers for k, v in truth.items())
    for c in consumers:
        c.close()
    if errors:
        raise RuntimeError("; ".join(errors[:5]))
    q = statistics.quantiles(done, n=100) if len(done) > 1 else [done[0]] * 99
    return {
        "predictors": n,
        "p50_s": statistics.median(done),
        "p99_s": q[98],
        "max_s": max(done),
        "rollback_bytes": statistics.median(sent),
        "resync_bytes": statistics.median(boot_bytes),
        "bytes_ratio": statistics.median(sent) / statistics.median(boot_bytes),
        "bit_exact": exact,
    }


def log_cost(root: Path, redis_url: str, window: int) -> dict[str, Any]:
    """A fresh sidecar (rank 0) over the spool, retention run to the end: the log's bytes."""
    from deltad.config import ServerConfig
    from deltad.serve.edge.app import SidecarServer

    srv = SidecarServer(
        ServerConfig(
            spool_dir=root, model=MODEL, rank=0, listen="127.0.0.1:0", redis_url=redis_url,
            retention_interval_s=3600.0, merge_min_segments=2, restore_window_steps=window,
        )
    ).start()  # fmt: skip
    try:
        for _ in range(1000):
            if not srv.retention.run_once():
                break
        snap = srv.log.snapshot()
        assert snap is not None
        disk = sum(
            p.stat().st_size for p in (root / MODEL).rglob("seg-*") if "rank-00000" in str(p)
        )
        return {"entries": len(snap.entries), "memory_bytes": snap.nbytes, "disk_bytes": disk}
    finally:
        srv.stop(0)


def _wait_head(logs: list[Any], step: int) -> None:
    """Until every log's head is at ``step`` (bounded)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for lg in logs:
            lg.refresh()
        if all((sn := lg.snapshot()) is not None and sn.head.step == step for lg in logs):
            return
        time.sleep(0.01)
    raise RuntimeError(f"the logs never reached step {step}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rollback", description=__doc__.split("\n")[0])
    p.add_argument("--tables", type=int, default=2)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--deltas", type=int, default=20)
    p.add_argument("--touch", type=float, default=0.01, help="fraction of rows per delta")
    p.add_argument("--predictors", type=int, default=32)
    p.add_argument("--poll", type=float, default=0.05, help="seconds between a predictor's pulls")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--record", action="store_true", help="also record bench/results/rollback.json")
    args = p.parse_args(argv)

    from deltad.config import RelayConfig, ServerConfig
    from deltad.serve.edge.app import SidecarServer
    from deltad.serve.relay.server import RelayServer
    from deltad.store import EmbeddedRedis

    out: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "record")}
    }
    step = args.deltas // 2
    with tempfile.TemporaryDirectory(prefix="deltad-rollback-") as tmp:
        root = Path(tmp)
        redis = EmbeddedRedis(root / "redis")
        url = redis.start()
        try:
            for i, where in enumerate(("direct", "relay")):
                servers: list[Any] = []
                spool_dir = root / f"spool-{where}"
                spool = Spool(spool_dir, args.tables, args.rows, args.dim, args.touch)
                try:
                    for rank in range(2):
                        cfg = ServerConfig(
                            spool_dir=spool_dir, model=MODEL, rank=rank, listen="127.0.0.1:0",
                            redis_url=db(url, 3 * i), poll_interval_s=0.02, grace_period_s=0.2,
                            restore_window_steps=10_000, max_concurrent_streams=256,
                        )  # fmt: skip
                        servers.append(SidecarServer(cfg).start())
                    eps = [s.endpoint for s in servers]
                    control = eps[0]
                    logs = [s.log for s in servers]
                    if where == "relay":  # one relay per rank, running while the trainer runs
                        relays = []
                        for rank in range(2):
                            rcfg = ServerConfig(
                                spool_dir=root / f"relay-{rank}", model=MODEL, rank=rank,
                                listen="127.0.0.1:0", redis_url=db(url, 3 * i + 1 + rank),
                                poll_interval_s=0.02, grace_period_s=0.2,
                                restore_window_steps=10_000, max_concurrent_streams=256,
                            )  # fmt: skip
                            r = RelayServer(
                                rcfg, RelayConfig(upstream=eps[rank], consumer=f"relay-{rank}",
                                                  poll_interval_s=0.02, fsync=False),
                            )  # fmt: skip
                            relays.append(r.start())
                        servers.extend(relays)
                        eps = [r.endpoint for r in relays]
                        logs = [r.server.log for r in relays]
                    for t in range(1, args.deltas + 1):  # the trainer, one step at a time
                        spool.delta(t)
                        _wait_head(logs, t)
                    out[where] = run_fleet(
                        eps, args.predictors, control, step, spool.history[step], args.poll
                    )
                finally:
                    for s in reversed(servers):
                        s.stop(0)
            out["restore_points"] = {
                "window": log_cost(root / "spool-direct", db(url, 8), 10_000),
                "no_window": log_cost(root / "spool-direct", db(url, 9), 0),
            }
        finally:
            redis.stop()
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    if args.record:
        from bench.run import record

        record("rollback", out, {"preset": "python -m bench.rollback", **out["config"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
