"""The validation gate's cost (issue 21): checking a delta segment before it is served, as a
ratio to what the sidecar already pays to index that segment (``load_verified``: read,
checksum, private copy), measured in the same process, interleaved repeat by repeat.

::

    python -m bench.gate [--rows 262144] [--dim 64] [--tables 4] [--repeats 7] [--json]

Variants: ``nonfinite`` (always on: one vectorized ``torch.isfinite`` per shard),
``norm_jump`` (``--gate-max-norm-jump``: a row norm per changed row against the held norms),
``fraction`` (``--gate-max-changed-fraction``). The segment is a delta of ``rows`` changed
rows per table (fp32) over tables of 4x that many rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deltad.config import GateConfig
from deltad.segment.format import ShardRows, write_segment
from deltad.segment.spool import GenerationManifest, SpoolLayout, TableInfo
from deltad.segment.validate import load_verified
from deltad.serve.index.gate import SegmentGate
from deltad.serve.index.log import LogEntry
from deltad.types import SegmentKind, Shard


def _write(layout: SpoolLayout, seq: int, step: int, shards: list[ShardRows]) -> Path:
    path = layout.segment_path(1, 0, seq)
    kind = SegmentKind.BASE if seq == 0 else SegmentKind.DELTA
    write_segment(
        path, model="b", generation=1, rank=0, world_size=1, seq=seq, step=step, kind=kind,
        shards=shards, fsync=False,
    )  # fmt: skip
    return path


def run(rows: int, dim: int, tables: int, repeats: int) -> dict[str, Any]:
    table_rows = rows * 4
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        layout = SpoolLayout(Path(d), "b")
        names = [f"t{i}" for i in range(tables)]
        manifest = GenerationManifest(
            "b", 1, 1, 0, time.time(),
            tuple(TableInfo(n, table_rows, dim, "float32", "ebc", "ebc", "row_wise") for n in names),
        )  # fmt: skip
        layout.write_manifest(manifest)
        shard = {n: Shard(n, table_rows, dim, 0, table_rows, 0, dim) for n in names}
        base = [
            ShardRows(shard[n], torch.arange(table_rows), torch.randn(table_rows, dim, generator=g))
            for n in names
        ]
        base_path = _write(layout, 0, 0, base)
        ids = torch.randperm(table_rows, generator=g)[:rows].sort().values
        delta = [ShardRows(shard[n], ids, torch.randn(rows, dim, generator=g)) for n in names]
        delta_path = _write(layout, 1, 1, delta)

        def load(path: Path, seq: int) -> LogEntry:
            seg = load_verified(path, layout.model_dir, manifest, generation=1, rank=0, seq=seq)
            return LogEntry.load(path, seg)

        base_entry = load(base_path, 0)
        configs = {
            "nonfinite": GateConfig(),
            "norm_jump": GateConfig(max_norm_jump=(("*", 1e9),)),
            "fraction": GateConfig(max_changed_fraction=(("*", 1.0),)),
        }
        samples: dict[str, list[float]] = {"index": [], **{k: [] for k in configs}}
        for _ in range(repeats):
            t0 = time.perf_counter()
            entry = load(delta_path, 1)
            samples["index"].append(time.perf_counter() - t0)
            for name, cfg in configs.items():
                gate = SegmentGate(cfg)
                gate.check(1, [base_entry], [])  # the base: held norms start from it
                t0 = time.perf_counter()
                failed = gate.check(1, [base_entry, entry], [])
                samples[name].append(time.perf_counter() - t0)
                assert not failed
        seg_bytes = delta_path.stat().st_size
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "rows_per_table": rows,
        "dim": dim,
        "tables": tables,
        "segment_bytes": seg_bytes,
        "repeats": repeats,
        "median_s": med,
        "samples_s": samples,
        "ratio_to_index": {k: med[k] / med["index"] for k in configs},
        "gate_gb_per_s": {k: seg_bytes / med[k] / 1e9 for k in configs},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=262144)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    out = run(a.rows, a.dim, a.tables, a.repeats)
    if a.json:
        print(json.dumps(out, indent=2))
        return
    mb = out["segment_bytes"] / 1e6
    print(
        f"delta segment {mb:.1f} MB ({a.tables} tables x {a.rows} rows x dim {a.dim}, fp32), "
        f"{torch.get_num_threads()} torch threads"
    )
    print(f"  index (load_verified): {out['median_s']['index'] * 1000:.1f} ms")
    for k, r in out["ratio_to_index"].items():
        print(
            f"  gate {k:<10} {out['median_s'][k] * 1000:7.1f} ms  = {r:.3f} x index  "
            f"({out['gate_gb_per_s'][k]:.1f} GB/s)"
        )


if __name__ == "__main__":
    main()
