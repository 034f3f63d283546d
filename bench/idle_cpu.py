"""An idle sidecar's CPU against the length of its log.

A log of thousands of segments is what a restore window keeps (``--restore-window-seconds
3600`` at a segment every second: 3600) or what consumers at spread cursors pin. Before stop
30 every poll (20 a second) listed the rank's directory and checked every pair of segments
for a merge's leftovers: an idle sidecar on 2001 segments took 82 % of a core, and held the
GIL its GetDelta streams need. Now an idle poll stats the directory
(:meth:`deltad.serve.index.files.RankFiles.unchanged`).

Two spools of small tables (2 x 1000 rows x 8): ``short`` (a base and 16 deltas) and
``long`` (a base and ``--segments`` deltas); a ``deltad serve`` on each with a restore window
of a day (retention keeps every segment), idle (no consumer, no trainer) for ``--seconds``
after it settled; its CPU in % of a core. ``short`` is measured twice (the noise line).

``python -m bench.idle_cpu [--segments 2000] [--seconds 20] [--record]``: prints one JSON line;
``--record`` writes bench/results/idle-cpu.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Children, Context, CpuMonitor, record_standalone, settle
from bench.deltad_procs import MODEL, start_sidecar

KEEP_EVERYTHING = ["--restore-window-seconds", "86400"]


def _spool(root: Path, deltas: int) -> int:
    from bench.datagen import write_spool

    write_spool(
        root, model=MODEL, tables=2, rows_per_table=1000, dim=8, deltas=deltas, delta_fraction=0.01
    )
    return deltas + 1


def idle_percent(spool: Path, seconds: float) -> float:
    """% of a core a sidecar on ``spool`` takes idle over ``seconds`` (after it settled)."""
    with Children() as kids:
        side = start_sidecar(kids, spool, Context(), extra=KEEP_EVERYTHING)
        cpu = CpuMonitor(side.proc.pid)
        settle(cpu, busy=0.9, limit_s=60.0)  # (indexing done; it may stay busy: then as is)
        time.sleep(2.0)
        cpu.reset()
        time.sleep(seconds)
        used = cpu.seconds()
        side.stop()
    return 100.0 * used / seconds


def run(segments: int, seconds: float, work: Path) -> dict[str, Any]:
    short, long_ = work / "short", work / "long"
    n_short, n_long = _spool(short, 16), _spool(long_, segments)
    a = idle_percent(short, seconds)
    b = idle_percent(long_, seconds)
    a2 = idle_percent(short, seconds)
    return {
        "segments": {"short": n_short, "long": n_long},
        "idle_percent_of_a_core": {"short": a, "long": b, "short_again": a2},
        "long_over_short": b / a if a else None,
        "noise": a2 / a if a else None,
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.idle_cpu", description=__doc__)
    p.add_argument("--segments", type=int, default=2000, help="deltas of the long log")
    p.add_argument("--seconds", type=float, default=20.0, help="idle span measured")
    p.add_argument("--record", action="store_true", help="write bench/results/idle-cpu.json")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="deltad-idlecpu-") as tmp:
        result = run(a.segments, a.seconds, Path(tmp))
    text = record_standalone("idle_cpu", result, argv, a.record)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
