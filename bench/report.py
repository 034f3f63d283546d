"""Turn results.json into a short console summary and the markdown table of bench/README.md.

Each benchmark result carries ``headline``: a list of ``{"metric", "value", "unit",
"baseline", "ratio", "target", "met"}`` dicts (``met`` is None when no target applies).
``python -m bench.report [results.json]`` prints the markdown table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.common import OUT_DIR


def _fmt(x: Any, unit: str = "") -> str:
    if x is None:
        return "n/a"
    s = (f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}") if isinstance(x, float) else str(x)
    return f"{s} {unit}".strip()


def headline_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """(benchmark, metric, value, baseline/ratio, target, verdict) rows."""
    rows: list[tuple[str, str, str, str, str, str]] = []
    for name, res in results.get("benchmarks", {}).items():
        status = res.get("status", "?")
        if status != "ok":
            rows.append((name, "-", status, "", "", ""))
            continue
        for h in res.get("headline", []):
            base = h.get("baseline")
            rat = h.get("ratio")
            comp = ""
            if base is not None:
                comp = f"{_fmt(base, h.get('baseline_unit', h.get('unit', '')))}"
            if rat is not None:
                comp = f"{comp} (ratio {_fmt(rat)})" if comp else f"ratio {_fmt(rat)}"
            met = h.get("met")
            verdict = "" if met is None else ("met" if met else "MISSED")
            rows.append(
                (
                    name,
                    str(h.get("metric", "")),
                    _fmt(h.get("value"), h.get("unit", "")),
                    comp,
                    str(h.get("target", "")),
                    verdict,
                )
            )
    return rows


def summary_lines(results: dict[str, Any]) -> list[str]:
    """Plain-text lines for the console."""
    out = []
    for r in headline_rows(results):
        out.append(" | ".join(x for x in r if x))
    return out


def markdown_table(results: dict[str, Any]) -> str:
    """The results table for bench/README.md."""
    lines = [
        "| benchmark | metric | value | baseline (ratio) | target | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for r in headline_rows(results):
        lines.append("| " + " | ".join(x.replace("|", "/") for x in r) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the markdown table of a results file."""
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else OUT_DIR / "results.json"
    results = json.loads(path.read_text())
    print(markdown_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
