"""Generation change: what a trainer restart costs a predictor, generation diff vs full resync.

One rank, ``T`` tables of ``rows x dim`` fp32 in a spool; a sidecar (in-process, port 0, an
embedded Redis) serves it. Two predictors follow it (raw GetDelta pulls, rows form, fp32,
decoded and applied into their tables, then committed): both sit at the head of generation
``g``. The trainer "restarts": generation ``g + 1`` is the same tables with ``x`` % of each
table's rows changed. Then one predictor pulls with ``no_generation_diff`` (a full resync: the
new base) and the other pulls normally (a generation diff: the rows that differ from what it
holds); a third, at the same old cursor, pulls the same diff after it (served from the diff
cache: what every further predictor of a herd costs). Measured per predictor: wall time from the
pull's start to its tables applied, and payload bytes. The order of the two alternates over
repeats (one new generation per repeat), so both see the same background load.

The sidecar computes a diff by merging the old state at the cursor and the new head and
comparing them bit-exactly (deltad.serve.windows.gendiff): a cost the full resync does not have, paid
once per cursor.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.common import Context, med, metric, ratio, summarize

DIM = 64


def _write_generation(
    root: Path, generation: int, tables: dict[str, torch.Tensor], step: int
) -> None:
    from deltad.segment.format import ShardRows, write_segment
    from deltad.segment.spool import GenerationManifest, SpoolLayout, TableInfo
    from deltad.types import SegmentKind, Shard

    layout = SpoolLayout(root, "m")
    layout.write_manifest(
        GenerationManifest(
            "m", generation, 1, step, time.time(),
            tuple(TableInfo(n, t.shape[0], t.shape[1], "float32", "ec", "ec", "row_wise")
                  for n, t in tables.items()),
        ),
        fsync=False,
    )  # fmt: skip
    chunks = [
        ShardRows(Shard(n, t.shape[0], t.shape[1], 0, t.shape[0], 0, t.shape[1]),
                  torch.arange(t.shape[0]), t)
        for n, t in tables.items()
    ]  # fmt: skip
    write_segment(
        layout.segment_path(generation, 0, 0), model="m", generation=generation, rank=0,
        world_size=1, seq=0, step=step, kind=SegmentKind.BASE, shards=chunks, fsync=False,
    )  # fmt: skip


class _Predictor:
    """A predictor's tables and its raw pull + apply + commit."""

    def __init__(self, name: str, channel: grpc.Channel) -> None:
        from deltad.consume.appliers import TensorDictApplier
        from deltad.v1 import delta_pb2_grpc

        self.name = name
        self.channel = channel
        self.stub = delta_pb2_grpc.DeltaServiceStub(channel)
        self.applier = TensorDictApplier()

    def sync(self, **kw: Any) -> tuple[float, int, bool, int | None]:
        """(seconds to tables applied, payload bytes, resync, diff_from_generation)."""
        from deltad import wire
        from deltad.consume import decode
        from deltad.v1 import delta_pb2 as pb

        t0 = time.perf_counter()
        req = pb.GetDeltaRequest(consumer=self.name, form=pb.FORM_ROWS, **kw)
        d = decode.pull(self.channel, req, timeout=600)
        self.applier.apply([d])
        seconds = time.perf_counter() - t0
        self.stub.Commit(
            pb.CommitRequest(consumer=self.name, cursor=wire.cursor_to_pb(d.cursor)), timeout=60
        )
        return seconds, d.bytes, d.resync, d.generation_diff


def run(ctx: Context) -> dict[str, Any]:
    """Sweep the fraction of rows a restart changes."""
    from deltad.config import ServerConfig
    from deltad.serve.edge.app import SidecarServer
    from deltad.store import EmbeddedRedis

    n_tables = ctx.pick(4, 2, 2)
    rows = ctx.pick(250_000, 100_000, 5_000)
    dim = ctx.pick(DIM, DIM, 16)
    fractions = ctx.pick([0.001, 0.01, 0.1, 0.5], [0.01, 0.1], [0.01, 0.1])
    repeats = max(1, ctx.repeats)
    points: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(1)
    for frac in fractions:
        with ctx.tmpdir("gendiff") as d:
            ctx.status(f"gendiff {frac:.1%}")
            tables = {f"t{i}": torch.randn(rows, dim, generator=gen) for i in range(n_tables)}
            _write_generation(d / "spool", 1, tables, 0)
            redis = EmbeddedRedis(d / "redis")
            redis.start()
            srv = SidecarServer(
                ServerConfig(spool_dir=d / "spool", model="m", listen="127.0.0.1:0",
                             redis_url=redis.url, poll_interval_s=0.02, grace_period_s=0.2,
                             retention_interval_s=3600.0, window_cache_bytes=4 << 30)
            ).start()  # fmt: skip
            ch = grpc.insecure_channel(
                f"127.0.0.1:{srv.port}",
                options=[("grpc.max_receive_message_length", 256 << 20)],
            )
            try:
                full, diff, herd = (_Predictor(n, ch) for n in ("full", "diff", "herd"))
                for who in (full, diff, herd):
                    who.sync()
                samples: dict[str, list[float]] = {"full_s": [], "diff_s": [], "herd_s": []}
                sizes: dict[str, int] = {}
                for r in range(repeats):
                    g = r + 2
                    for t in tables.values():
                        ids = torch.randperm(rows, generator=gen)[: max(1, int(frac * rows))]
                        t[ids] += 1.0
                    _write_generation(d / "spool", g, tables, 100 * g)
                    deadline = time.monotonic() + 120
                    while time.monotonic() < deadline:
                        snap = srv.log.snapshot()
                        if snap is not None and snap.generation == g:
                            break
                        time.sleep(0.02)
                    order = [("full", full), ("diff", diff)]
                    for name, who in order if r % 2 == 0 else order[::-1]:
                        s, nbytes, resync, diff_from = who.sync(no_generation_diff=name == "full")
                        assert resync == (name == "full") and (diff_from is None) == resync
                        samples[f"{name}_s"].append(s)
                        sizes[f"{name}_bytes"] = nbytes
                    s, nbytes, resync, _ = herd.sync()
                    assert not resync
                    samples["herd_s"].append(s)
                    for n, t in tables.items():  # the diff predictor is bit-equal
                        assert torch.equal(diff.applier.tables()[n], t), n
            finally:
                ch.close()
                srv.stop(0)
                redis.stop()
        p: dict[str, Any] = {
            "changed_fraction": frac,
            "tables": n_tables,
            "rows": rows,
            "dim": dim,
            "table_bytes": n_tables * rows * dim * 4,
            **sizes,
            **{k: summarize(v) for k, v in samples.items()},
        }
        p["bytes_ratio"] = ratio(sizes["diff_bytes"], sizes["full_bytes"])
        p["time_ratio"] = ratio(med(p["diff_s"]), med(p["full_s"]))
        p["herd_time_ratio"] = ratio(med(p["herd_s"]), med(p["full_s"]))
        ctx.log(
            f"gendiff {frac:.1%} changed: full {sizes['full_bytes'] / 1e6:.1f} MB "
            f"{med(p['full_s']):.3f} s, diff {sizes['diff_bytes'] / 1e6:.1f} MB "
            f"{med(p['diff_s']):.3f} s (x{p['time_ratio']:.2f}), herd diff "
            f"{med(p['herd_s']):.3f} s"
        )
        points.append(p)
    headline = []
    for p in points:
        what = f"restart changing {p['changed_fraction']:.1%} of rows"
        none = {"target": None, "met": None}
        headline += [
            metric(f"{what}: diff time", med(p["diff_s"]), "s", baseline=med(p["full_s"]),
                   ratio=p["time_ratio"], **none),
            metric(f"{what}: diff bytes", float(p["diff_bytes"]), "B",
                   baseline=float(p["full_bytes"]), ratio=p["bytes_ratio"], **none),
        ]  # fmt: skip
    return {"points": points, "headline": headline}
