"""Benchmark: the C++ predictor (``deltad-predictor-cpp``) against baselines of the same run.

One spool holds a base of the reference model's tables (``t0``, ``t1``, ``seq``; ROWS rows of
dim 16 each, no managed-collision table), served by one sidecar. Measured:

* **C++ apply vs bare ``emb_inplace_update``**: the C++ applier's time to write the base's
  packed-int8 rows (its ``apply_s``: checks, row copies, fbgemm's op chunk by chunk under the
  serving lock), with forwards running back to back (every 2 ms) and with no forward in
  flight, against one call of ``torch.ops.fbgemm.emb_inplace_update`` on the same rows in
  the same artifact, in Python (goal >= 0.9x); and, with no forwards, against the op on the
  same rows where they lie in the predictor itself (``--bare-baseline``: one call per slice,
  before the apply or after it, alternating);
* **forward p99 under apply vs idle** of the C++ predictor following 20 deltas (a tenth of
  every table each, fp32 wire: it packs them) with forwards back to back (goal <= 1.2x), its
  pull / apply thread at ``--apply-nice 10`` (the default) and at 0, alternating, ``--repeat``
  predictors of each;
* **C++ bootstrap vs the Python client**: pull + apply of the same base by the C++ predictor and
  by ``deltad consume --serve-dtype int8`` (same sidecar, packed-int8 wire): their ``pull_s +
  apply_s`` (ratio Python / C++);
* **C++ pull vs a bare C++ gRPC stream of the same bytes** (``deltad-pull-bench``, alternating
  in one process): a fresh ``deltad::Consumer``'s ``pull()`` of the base (Status, the stream,
  the decode; no apply) against one GetDelta stream read and dropped (goal >= 0.9x).

Run: ``python -m bench.cpp_apply [--rows N] [--repeat K]`` (needs ``scripts/build_cpp.sh`` and a
Redis: an embedded one is started). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / "build" / "cpp" / "deltad-predictor-cpp"
DIM = 16


NAMES = {"t0": ("ebc", "ebc"), "t1": ("ebc", "ebc"), "seq": ("ec", "ec")}


def write_delta(spool: Path, rows: int, seq: int, touch: int, seed: int) -> None:
    """A delta segment (seq, step = 10 * seq) moving ``touch`` random rows of every table."""
    from deltad.segment.format import ShardRows, write_segment
    from deltad.segment.spool import SpoolLayout
    from deltad.types import SegmentKind, Shard

    gen = torch.Generator().manual_seed(seed)
    chunks = []
    for n in NAMES:
        ids = torch.randperm(rows, generator=gen)[:touch].sort().values
        vals = torch.randn(touch, DIM, generator=gen)
        chunks.append(ShardRows(Shard(n, rows, DIM, 0, rows, 0, DIM), ids, vals))
    write_segment(
        SpoolLayout(spool, "m").segment_path(1, 0, seq), model="m", generation=1, rank=0,
        world_size=1, seq=seq, step=10 * seq, kind=SegmentKind.DELTA, shards=chunks, fsync=False,
    )  # fmt: skip


def forward_latency(
    endpoint: str, art: Path, spool: Path, rows: int, first_seq: int, nice: int
) -> dict[str, Any]:
    """The C++ predictor's forward p99 idle and during applies: it follows 20 deltas (seqs
    ``first_seq``.., a tenth of every table each, one every 0.25 s, the demo's rate x2) with
    forwards back to back, its pull / apply thread at ``--apply-nice nice``; its summary line
    splits the latencies."""
    import signal

    proc = subprocess.Popen(
        [str(BIN), "--sidecars", endpoint, "--model", "m", "--consumer",
         f"bench-latency-{first_seq}", "--artifact", str(art), "--wire-dtype", "fp32",
         "--serve-interval", "0", "--long-poll", "1", "--apply-nice", str(nice)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        time.sleep(3.0)  # bootstrap, then idle forwards
        for seq in range(first_seq, first_seq + 20):
            write_delta(spool, rows, seq, rows // 10, seed=seq)
            time.sleep(0.25)
        time.sleep(2.0)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    summary = [json.loads(x) for x in out.splitlines() if '"summary"' in x][-1]
    # idle: forwards while the predictor neither pulls nor applies (its summary's "quiet")
    idle, busy = summary["forward_p99_quiet_ms"], summary["forward_p99_apply_ms"]
    return {
        "forward_p99_idle_ms": idle,
        "forward_p99_apply_ms": busy,
        "forwards_during_apply": summary["forwards_during_apply"],
        "forwards_idle": summary["forwards_quiet"],
        "p99_apply_vs_idle": busy / idle if idle and busy else None,
    }


def write_base(spool: Path, rows: int) -> dict[str, torch.Tensor]:
    """One rank's base of t0, t1, seq (rows x DIM, random): the tables."""
    from deltad.segment.format import ShardRows, write_segment
    from deltad.segment.spool import GenerationManifest, SpoolLayout, TableInfo
    from deltad.types import SegmentKind, Shard

    layout = SpoolLayout(spool, "m")
    names = NAMES
    layout.write_manifest(
        GenerationManifest(
            model="m", generation=1, world_size=1, start_step=0, created_unix=time.time(),
            tables=tuple(
                TableInfo(n, rows, DIM, "float32", k, m, "table_wise") for n, (k, m) in names.items()
            ),
        )
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    tables = {n: torch.randn(rows, DIM, generator=gen) for n in names}
    chunks = [
        ShardRows(Shard(n, rows, DIM, 0, rows, 0, DIM), torch.arange(rows), t)
        for n, t in tables.items()
    ]
    write_segment(
        layout.segment_path(1, 0, 0), model="m", generation=1, rank=0, world_size=1, seq=0,
        step=0, kind=SegmentKind.BASE, shards=chunks, fsync=False,
    )  # fmt: skip
    return tables


def first_pull(lines: list[str]) -> dict[str, Any]:
    for line in lines:
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if d.get("event") == "pull" and d.get("rows", 0) > 0:
            return d
    raise RuntimeError("no pull with rows in the log:\n" + "\n".join(lines[-5:]))


def bare_update(artifact: Path, tables: dict[str, torch.Tensor]) -> float:
    """Seconds of one emb_inplace_update per TBE writing every row (packed as torchrec does)."""
    import fbgemm_gpu

    if not hasattr(torch.ops.fbgemm, "emb_inplace_update"):  # fbgemm 1.8: not loaded on import
        lib = Path(fbgemm_gpu.__file__).parent / "fbgemm_gpu_embedding_inplace_ops.so"
        torch.ops.load_library(str(lib))

    from deltad.consume.export import manifest_path
    from deltad.consume.quant import pack_rows
    from deltad.types import ServeDtype

    m = torch.jit.load(str(artifact))
    man = json.loads(manifest_path(artifact).read_text())
    per_tbe: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for t in man["tables"]:
        rows = pack_rows(tables[t["name"]], ServeDtype.INT8, t["row_bytes"])
        per_tbe.setdefault(t["tbe"], []).append((t["index"], rows))
    total = 0.0
    for b, parts in per_tbe.items():
        names = man["tbes"][b]
        ts = [getattr(m, names[k]) for k in ("weights_host", "weights_uvm", "weights_placements",
                                             "weights_offsets", "weights_tys", "D_offsets")]  # fmt: skip
        weights = torch.cat([r.reshape(-1) for _, r in parts])
        tidx = torch.cat([torch.full((r.shape[0],), i, dtype=torch.int32) for i, r in parts])
        ridx = torch.cat([torch.arange(r.shape[0]) for _, r in parts])
        widths = torch.cat([torch.full((r.shape[0],), r.shape[1]) for _, r in parts])
        offsets = torch.cumsum(widths, 0) - widths
        t0 = time.perf_counter()
        torch.ops.fbgemm.emb_inplace_update(
            ts[0], ts[1], ts[2], ts[3], ts[4], ts[5], weights, tidx, ridx, offsets,
            names["row_alignment"],
        )  # fmt: skip
        total += time.perf_counter() - t0
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    if not BIN.exists():
        print(json.dumps({"skipped": f"{BIN} not built (scripts/build_cpp.sh)"}))
        return 0
    from deltad.reference.consumers.serving import ServingConfig

    from deltad.config import ServerConfig
    from deltad.consume.export import export_reference
    from deltad.serve.edge.app import SidecarServer
    from deltad.store.embedded import EmbeddedRedis

    out: dict[str, Any] = {"rows_per_table": args.rows, "tables": 3, "dim": DIM}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        tables = write_base(tmp / "spool", args.rows)
        cfg = ServingConfig(
            dtype="int8", tables={"t0": args.rows, "t1": args.rows}, seq_rows=args.rows,
            dim=DIM, zch_slots=0,
        )  # fmt: skip
        art = tmp / "model.pt"
        export_reference(cfg, art)
        redis = EmbeddedRedis(tmp / "redis")
        redis.start()
        srv = SidecarServer(
            ServerConfig(
                spool_dir=tmp / "spool",
                model="m",
                rank=0,
                listen="127.0.0.1:0",
                redis_url=redis.url,
                poll_interval_s=0.05,
            )
        ).start()
        cpp: list[dict[str, Any]] = []
        idle: list[dict[str, Any]] = []
        py: list[dict[str, Any]] = []
        bare: list[float] = []
        try:
            for i in range(args.repeat):
                for into, serve in ((cpp, "0.002"), (idle, "60")):
                    # with no forwards, the same rows' bare op in the same process too: before
                    # the apply (its rows cold) and after it (warm), alternating
                    bare_in = ["--bare-baseline", "before" if i % 2 else "after"]
                    lines = subprocess.run(
                        [str(BIN), "--sidecars", srv.endpoint, "--model", "m", "--consumer",
                         f"bench-cpp-{i}-{serve}", "--artifact", str(art), "--pulls", "1",
                         "--wire-dtype", "packed-int8", "--serve-interval", serve,
                         *(bare_in if into is idle else [])],
                        capture_output=True, text=True, timeout=600, check=True,
                    ).stdout.splitlines()  # fmt: skip
                    into.append(first_pull(lines))
                res = subprocess.run(
                    [sys.executable, "-m", "deltad", "consume", "--sidecar", srv.endpoint,
                     "--model", "m", "--consumer", f"bench-py-{i}", "--pulls", "1",
                     "--serve-dtype", "int8", "--dtype", "packed-int8", "--tables",
                     f"t0:{args.rows},t1:{args.rows}", "--seq-rows", str(args.rows),
                     "--dim", str(DIM), "--zch-slots", "0", "--json-log", "-"],
                    capture_output=True, text=True, timeout=600, check=False,
                )  # fmt: skip
                if res.returncode:
                    raise RuntimeError(f"deltad consume: {res.stderr.strip()[-500:]}")
                py.append(first_pull(res.stdout.splitlines()))
                bare.append(bare_update(art, tables))
            pulls = subprocess.run(
                [str(BIN.parent / "deltad-pull-bench"), srv.endpoint, "m",
                 str(max(5, 2 * args.repeat))],
                capture_output=True, text=True, timeout=600, check=True,
            )  # fmt: skip
            pb = json.loads(pulls.stdout)
            out.update(
                cpp_pull_only_s=pb["client_pull_s"], bare_stream_s=pb["bare_stream_s"],
                pull_vs_bare_stream=pb["client_vs_bare"], pull_bench_repeat=pb["repeat"],
            )  # fmt: skip
            # forward p99 under apply vs idle, the apply thread niced (the default) and not,
            # alternating; a median over the repeats of each
            lat: dict[int, list[dict[str, Any]]] = {10: [], 0: []}
            for i in range(args.repeat):
                for nice, into_lat in lat.items():
                    first = 1 + 20 * (2 * i + (nice == 0))
                    into_lat.append(
                        forward_latency(srv.endpoint, art, tmp / "spool", args.rows, first, nice)
                    )
            for nice, runs in lat.items():
                tag = "" if nice else "_not_niced"
                ratios = [r["p99_apply_vs_idle"] for r in runs if r["p99_apply_vs_idle"]]
                out[f"p99_apply_vs_idle{tag}"] = statistics.median(ratios) if ratios else None
                out[f"p99_apply_vs_idle{tag}_all"] = ratios
                out[f"forward_p99_idle_ms{tag}"] = statistics.median(
                    r["forward_p99_idle_ms"] for r in runs
                )
                out[f"forward_p99_apply_ms{tag}"] = statistics.median(
                    r["forward_p99_apply_ms"] for r in runs
                )
        finally:
            srv.stop(0.5)
            redis.stop()
    cpp_apply = statistics.median(x["apply_s"] for x in cpp)
    idle_apply = statistics.median(x["apply_s"] for x in idle)
    cpp_total = statistics.median(x["pull_s"] + x["apply_s"] for x in cpp)
    py_total = statistics.median(x["pull_s"] + x["apply_s"] for x in py)
    bare_s = statistics.median(bare)
    out.update(
        cpp_apply_s=cpp_apply, bare_update_s=bare_s, apply_vs_bare=bare_s / cpp_apply,
        cpp_apply_no_forwards_s=idle_apply, apply_no_forwards_vs_bare=bare_s / idle_apply,
        bare_in_process_s=statistics.median(x["bare_write_s"] for x in idle),
        apply_no_forwards_vs_bare_in_process=statistics.median(
            x["bare_write_s"] / x["apply_s"] for x in idle
        ),
        cpp_pull_apply_s=cpp_total, python_pull_apply_s=py_total,
        cpp_vs_python=py_total / cpp_total,
        cpp_pull_s=statistics.median(x["pull_s"] for x in cpp),
        cpp_pull_no_forwards_s=statistics.median(x["pull_s"] for x in idle),
        cpp_pack_s=statistics.median(x["pack_s"] for x in cpp),
        cpp_write_s=statistics.median(x["write_s"] for x in cpp),
        cpp_chunks=cpp[0]["chunks"],
        python_pull_s=statistics.median(x["pull_s"] for x in py),
    )  # fmt: skip
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
