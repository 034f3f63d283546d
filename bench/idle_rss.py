"""The idle sidecar's memory against its log at 5 x 1M x 64 (issue #22 item 4).

Run: ``python -m bench.idle_rss [--rows 1000000] [--tables 5] [--seconds 75]``; prints one
JSON line. A spool of a base (every row) and 4 deltas of 10 % skewed rows (1762 MiB of segment
files at the default size); a fresh ``deltad serve`` with default flags and no consumer:
retention merges the log into one base at once (no consumer pins it). VmRSS, RssAnon, RssFile
and RssShmem (the log: the sidecar keeps its verified copies in shared memory) are sampled
every second; at the end the Prometheus gauges are scraped and summed. ``RSS / log`` is the
last sample's VmRSS over the log's bytes (``deltad_log_bytes``), taken after the idle heap
trim (``knobs.IDLE_HEAP_TRIM_S`` after the merge).

The spool is written by a child process: this one never imports torch, so the sidecar is
measured as it runs in its own container. (Library pages another process maps too stay
resident: ``madvise(MADV_PAGEOUT)``, the idle trim's page-out, skips shared pages.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Children, Context, metric_sums, proc_status
from bench.deltad_procs import MODEL, start_sidecar

MIB = 1 << 20


def _gauges(port: int) -> dict[str, float]:
    return {k: v for k, v in metric_sums(port).items() if "_bytes" in k}


def measure(work: Path, *, rows: int, tables: int, dim: int, seconds: float) -> dict[str, Any]:
    """Write the spool, start the sidecar, sample its memory for ``seconds``."""
    spool = work / "spool"
    write = (
        "import json, sys; from pathlib import Path; from bench.datagen import write_spool; "
        "print(json.dumps(write_spool(Path(sys.argv[1]), model=sys.argv[2], tables=int(sys.argv[3]), "
        "rows_per_table=int(sys.argv[4]), dim=int(sys.argv[5]), deltas=4, delta_fraction=0.1)))"
    )
    args = [str(spool), MODEL, str(tables), str(rows), str(dim)]
    done = subprocess.run(
        [sys.executable, "-c", write, *args],
        check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    sizes = json.loads(done.stdout.strip().splitlines()[-1])
    with Children() as kids:
        side = start_sidecar(kids, spool, Context(), metrics=True)
        port = side.metrics_port
        assert port is not None
        samples: list[dict[str, float]] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            samples.append({k: v / MIB for k, v in proc_status(side.proc.pid).items()})
            time.sleep(1.0)
        gauges = _gauges(port)
        assert "torch" not in sys.modules, "the measuring process maps libtorch too"
        last = samples[-1]
        log_mib = gauges.get("deltad_log_bytes", 0.0) / MIB
        parts = ("deltad_runtime_bytes", "deltad_log_bytes", "deltad_heap_free_bytes")
        caches = [k for k in gauges if k.endswith("cache_bytes") or k == "deltad_spill_bytes"]
        accounted = sum(gauges.get(k, 0.0) for k in (*parts, *caches))
        return {
            "spool_bytes": sizes,
            "peak_rss_mib": max(s["VmRSS"] for s in samples),
            "last": last,
            "log_mib": log_mib,
            "rss_over_log": last["VmRSS"] / log_mib if log_mib else None,
            "runtime_mib": gauges.get("deltad_runtime_bytes", 0.0) / MIB,
            "gauges_sum_mb": accounted / 1e6,
            "rss_gauge_mb": gauges.get("deltad_rss_bytes", 0.0) / 1e6,
            "samples_vmrss": [round(s["VmRSS"]) for s in samples],
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    ap.add_argument("--tables", type=int, default=5)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=75.0, help="how long to sample")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="deltad-idle-rss-", dir=a.work_dir) as d:
        out = measure(Path(d), rows=a.rows, tables=a.tables, dim=a.dim, seconds=a.seconds)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
