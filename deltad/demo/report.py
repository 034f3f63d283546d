"""What `deltad demo` reports: the predictors' JSON logs, read as they grow, and its traffic table."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class PredictorLog:
    """What a predictor's JSON log says so far (read incrementally)."""

    path: Path
    offset: int = 0
    pulls: int = 0
    rows: int = 0
    bytes: int = 0
    dense_bytes: int = 0
    step: int | None = None
    owed: int = 0
    last_rows: int = 0
    steps_served: int = 0
    freshness: list[float] = field(default_factory=list)
    summary: dict[str, Any] | None = None

    def refresh(self) -> None:
        """Read the lines written since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            rec = json.loads(line)
            if rec.get("event") == "summary":
                self.summary = rec
            if rec.get("event") != "pull":
                continue
            self.pulls += 1
            self.rows += rec["rows"]
            self.bytes += rec["bytes"]
            self.dense_bytes += rec.get("dense_bytes", 0)
            self.owed = rec["owed"]
            self.last_rows = rec["rows"]
            if rec["step"] is not None and rec["step"] != self.step:
                self.steps_served += 1
            self.step = rec["step"]
            if rec.get("freshness_s") is not None:
                self.freshness.append(float(rec["freshness_s"]))


@dataclass
class Report:
    """The demo's report text and the checks that failed."""

    text: str
    failures: list[str]


def traffic_lines(
    args: argparse.Namespace,
    result: dict[str, Any],
    truth: dict[str, Any],
    logs: dict[str, PredictorLog],
    elapsed: float,
    table_bytes: dict[str, int],
) -> list[str]:
    """The report's head: the run in one line, then per predictor its pulls, rows, bytes
    against full syncs (``table_bytes``: a whole-table copy in its dtype, fp32 if absent),
    and its freshness."""
    from deltad.reference.consumers.predictor import percentile

    a = args
    rows_total = sum(t.shape[0] for t in truth.values())
    fp32_table_bytes = sum(t.numel() * 4 for t in truth.values())
    segs = [int(r["segments"]) for r in result["ranks"]]
    out = [
        "",
        f"deltad demo: {a.world_size} ranks, {tables_line(truth, rows_total, a.dim)}, trained {result['steps']} steps in {a.duration:.0f}s, "
        f"{sum(segs)} segments ({', '.join(map(str, segs))} per rank), "
        f"publish every {a.publish_every}s; run time {elapsed:.0f}s",
        f"{'predictor':<12} {'pulls':>6} {'rows':>10} {'bytes':>12} {'dense':>10} "
        f"{'full syncs':>12} {'ratio':>7} {'fresh p50':>9} {'p99':>7}",
    ]
    for name, lg in logs.items():
        full = table_bytes.get(name, fp32_table_bytes) * lg.steps_served
        p50, p99 = percentile(lg.freshness, 50), percentile(lg.freshness, 99)
        out.append(
            f"{name:<12} {lg.pulls:>6} {lg.rows:>10} {mb(lg.bytes):>12} "
            f"{mb(lg.dense_bytes):>10} {mb(full):>12} "
            f"{(lg.bytes / full if full else 0):>7.1%} {sec(p50):>9} {sec(p99):>7}"
        )
    out.append(
        "  bytes: rows and dense state received (dense: of which the trainer's dense state); "
        "full syncs: a whole-table copy (same dtype) at every step the predictor served; "
        "freshness: segment created -> rows applied (aim: p50 <= 0.5s, p99 <= 2s)"
    )
    return out


def tables_line(truth: dict[str, Any], rows_total: int, dim: int) -> str:
    """``5 tables x 100000 rows x dim 16`` (rows per table), or each table's rows if they differ."""
    counts = {n: int(t.shape[0]) for n, t in truth.items()}
    if len(set(counts.values())) == 1:
        return f"{len(counts)} tables x {next(iter(counts.values()))} rows x dim {dim}"
    each = ", ".join(f"{n} {c}" for n, c in counts.items())
    return f"{len(counts)} tables ({each} rows; {rows_total} in all), dim {dim}"


def ms(v: float | None) -> str:
    """Milliseconds, or ``-``."""
    return "-" if v is None else f"{v:.2f}ms"


def sec(v: float | None) -> str:
    """Seconds, or ``-``."""
    return "-" if v is None else f"{v:.2f}s"


def mb(n: float) -> str:
    """Bytes in MB."""
    return f"{n / 1e6:.2f} MB"
