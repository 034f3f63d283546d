"""``python -m bench.plots``: draw bench/README.md's figures from the recorded results.

Reads ``bench/results/*.json`` (committed: written by ``deltad bench --record``, or
transcribed once from the README's tables of earlier sessions, which each file's
``source`` says) and writes ``bench/figures/*.png`` (committed, embedded in the README).
``--tables`` prints the markdown tables the README quotes from the same files.

Each figure is drawn only if its results file is there; a figure whose data is missing is
skipped with a line on stderr, never drawn empty.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.common import FIGURES_DIR, RESULTS_DIR, pyplot, save_figure

#: the figures' names (``<name>.png``), in the README's order; ``encode-once`` is drawn
#: once the sidecar_mem benchmark is recorded (``deltad bench --only sidecar_mem --record``)
FIGURES = ("fanout", "fanout-memory", "encode-once", "serving", "throughput", "freshness")

#: configuration name -> colour, the same in every fan-out panel
_COLORS = {"direct": "tab:blue", "1 level": "tab:orange", "2 levels": "tab:green"}
_LEVEL_NAME = {0: "direct", 1: "1 level", 2: "2 levels"}


def load(results_dir: Path, name: str) -> dict[str, Any] | None:
    """The ``result`` of ``results_dir/<name>.json``, or None if it is not recorded."""
    path = results_dir / f"{name}.json"
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    res = doc.get("result", doc)
    return res if isinstance(res, dict) else None


def fleet_result(results_dir: Path) -> dict[str, Any] | None:
    """The recorded fleet run: ``fanout-fleet.json``, else the ``fleet`` key of a recorded
    whole fan-out run (``fanout.json``)."""
    res = load(results_dir, "fanout-fleet")
    if res is None:
        whole = load(results_dir, "fanout")
        res = whole.get("fleet") if whole else None
    return res if res and res.get("points") else None


def _save(fig: Any, out_dir: Path, name: str, grid: Sequence[Any] = (), axis: str = "both") -> Path:
    """Grid lines on the ``grid`` axes (``axis``: "both", "x" or "y"), then the figure at the
    README's 90 dpi."""
    for ax in grid:
        ax.grid(alpha=0.3, axis=axis)
    return save_figure(fig, out_dir, name, dpi=90)[0]


def plot_fanout(results_dir: Path, out_dir: Path) -> Path | None:
    """Pull time, CPU per delivered GB (serving tier and trainer sidecar) and aggregate GB/s
    against consumers: direct, through 1 and 2 relay levels; the fleet run (64/256
    consumers) and the earlier tree run (1-4 consumers) on one log axis."""
    fleet = fleet_result(results_dir)
    tree = load(results_dir, "fanout-tree")
    if fleet is None and tree is None:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (ax_t, ax_s), (ax_c, ax_g) = axes
    wmb = lambda b: f"{b / (1 << 20):.2g} MB"  # noqa: E731
    ticks: set[int] = set()
    for src, marker, label in (
        (tree, "s", f"{wmb(tree['window_bytes'])} window, 1 consumer process each" if tree else ""),
        (fleet, "o", f"{wmb(fleet['window_bytes'])} window, fleet" if fleet else ""),
    ):
        if src is None:
            continue
        for lv, name in _LEVEL_NAME.items():
            ps = sorted(
                (p for p in src["points"] if p["level"] == lv), key=lambda p: p["consumers"]
            )
            if not ps:
                continue
            xs = [p["consumers"] for p in ps]
            ticks.update(xs)
            c = _COLORS[name]
            lab = f"{name} ({label})"
            if src is fleet:
                ax_t.plot(xs, [p["p50_s"] for p in ps], marker + "-", color=c, label=f"{name} p50")
                ax_t.plot(xs, [p["p99_s"] for p in ps], marker + "--", color=c, label=f"{name} p99")
                serving = [p["serving_cpu_s_per_gb"] for p in ps]
                sidecar = [p["cpu_s_per_gb"]["sidecar"] for p in ps]
            else:
                serving = [p["serving_cpu_s_per_gb"] for p in ps]
                sidecar = [p["sidecar_cpu_s_per_gb"] for p in ps]
            ax_s.plot(xs, serving, marker + "-", color=c, label=lab)
            ax_c.plot(xs, sidecar, marker + "-", color=c, label=lab)
            ax_g.plot(xs, [_med(p["aggregate_gbps"]) for p in ps], marker + "-", color=c, label=lab)
    if fleet:
        ax_t.set_title(f"pull time, {wmb(fleet['window_bytes'])} window (fleet run)")
    ax_t.set_ylabel("seconds")
    ax_s.set_title("serving node CPU per delivered GB")
    ax_s.set_ylabel("CPU s / GB")
    ax_c.set_title("trainer's sidecar CPU per delivered GB")
    ax_c.set_ylabel("CPU s / GB")
    ax_g.set_title("aggregate throughput")
    ax_g.set_ylabel("GB/s")
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
        ax.set_xlabel("consumers")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax, size in ((ax_t, 7), (ax_s, 6)):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=size)
    fig.suptitle("fan-out: directly and through relay levels (squares: 1-4 consumers, tree run)")
    return _save(fig, out_dir, "fanout")


def plot_fanout_memory(results_dir: Path, out_dir: Path) -> Path | None:
    """Peak RSS per process of each tier, and consumer-side RSS per hosted consumer."""
    fleet = fleet_result(results_dir)
    if fleet is None:
        return None
    plt = pyplot()
    fig, (ax_r, ax_p) = plt.subplots(1, 2, figsize=(11, 3.8))
    pts = fleet["points"]
    labels = [f"{p['config']}\n{p['consumers']}" for p in pts]
    xs = list(range(len(pts)))
    tiers = ("sidecar", "relay1", "relay2")
    width = 0.8 / (len(tiers) + 1)
    for k, t in enumerate(tiers):
        ax_r.bar(
            [x + k * width for x in xs],
            [p["peak_rss_bytes"][t] / 1e6 for p in pts],
            width,
            label=t,
        )
    ax_r.bar(
        [x + len(tiers) * width for x in xs],
        [p["consumer_worker_peak_rss_bytes"] / 1e6 for p in pts],
        width,
        label="consumer worker",
    )
    ax_r.set_xticks([x + 0.4 - width / 2 for x in xs], labels, fontsize=7)
    ax_r.set_ylabel("peak RSS per process (MB)")
    ax_r.set_title("peak RSS per process, by tier")
    ax_r.legend(fontsize=7, loc="lower left")
    ax_p.bar(xs, [(p["consumer_rss_bytes_each"] or 0) / 1e6 for p in pts], 0.6)
    ax_p.set_xticks(xs, labels, fontsize=7)
    ax_p.set_ylabel("MB per consumer")
    ax_p.set_title("consumer worker: RSS over its baseline / consumers hosted")
    return _save(fig, out_dir, "fanout-memory", (ax_r, ax_p), "y")


def plot_serving(results_dir: Path, out_dir: Path) -> Path | None:
    """Forward p99 idle vs under apply, and apply throughput over bare fbgemm, per run."""
    res = load(results_dir, "serving")
    if res is None:
        return None
    plt = pyplot()
    runs = res["runs"]
    fig, (ax_f, ax_a) = plt.subplots(1, 2, figsize=(12, 4))
    xs = list(range(len(runs)))
    phases = ("idle", "chunk", "window", "chunk-packed")
    width = 0.8 / len(phases)
    for k, ph in enumerate(phases):
        vals = [r["fwd_p99_ms"].get(ph) for r in runs]
        ax_f.bar([x + k * width for x, v in zip(xs, vals, strict=True) if v is not None],
                 [v for v in vals if v is not None], width, label=f"p99 {ph}")  # fmt: skip
    ax_f.plot(
        [x + 0.4 - width / 2 for x in xs], [r["fwd_p50_ms"]["idle"] for r in runs], "k_",
        markersize=12, label="p50 idle",
    )  # fmt: skip
    labels = [f"{r['run']}\nload {r['load']}" for r in runs]
    ax_f.set_xticks([x + 0.4 - width / 2 for x in xs], labels, fontsize=6, rotation=30)
    ax_f.set_ylabel("forward latency (ms)")
    ax_f.set_title("forward p99: idle vs under apply (goal: <= 1.2x idle)")
    ax_f.legend(fontsize=7)
    for key, lab, off in (
        ("apply_float_rows_per_s", "from float rows", -0.2),
        ("apply_packed_rows_per_s", "from packed rows", 0.2),
    ):
        ax_a.bar(
            [x + off for x in xs],
            [r[key]["deltad"] / r[key]["bare_fbgemm"] for r in runs],
            0.4,
            label=lab,
        )
    goal = res.get("targets", {}).get("apply_over_bare", 0.8)
    ax_a.axhline(goal, color="k", ls="--", lw=1, label=f"goal {goal}x")
    ax_a.axhline(1.0, color="grey", ls=":", lw=1)
    ax_a.set_xticks(xs, labels, fontsize=6, rotation=30)
    ax_a.set_ylabel("deltad rows/s / bare fbgemm in-place update")
    ax_a.set_title("apply throughput into int8 tables vs bare fbgemm")
    ax_a.legend(fontsize=7)
    return _save(fig, out_dir, "serving", (ax_f, ax_a), "y")


def plot_throughput(results_dir: Path, out_dir: Path) -> Path | None:
    """GetDelta GB/s per window size and wire dtype, vs bare gRPC and raw loopback TCP."""
    res = load(results_dir, "throughput")
    if res is None:
        return None
    plt = pyplot()
    pts = res["points"]
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = list(range(len(pts)))
    ax.bar([x - 0.27 for x in xs], [p["wire_gbps"] for p in pts], 0.27, label="GetDelta, wire")
    ax.bar([x for x in xs], [p["fp32_rows_gbps"] for p in pts], 0.27, label="GetDelta, fp32 rows")
    ax.bar([x + 0.27 for x in xs], [p["bare_grpc_gbps"] for p in pts], 0.27,
           label="bare gRPC (best recipe)")  # fmt: skip
    if res.get("raw_tcp_gbps"):
        ax.axhline(res["raw_tcp_gbps"], color="grey", ls=":", label="raw loopback TCP")
    if res.get("target_gbps"):
        ax.axhline(res["target_gbps"], color="k", ls="--", lw=1, label="target 2 GB/s")
    ax.set_xticks(xs, [f"{p['window']}\n{p['dtype']}" for p in pts])
    ax.set_ylabel("GB/s")
    ax.set_title("GetDelta throughput per window and wire dtype (one consumer)")
    ax.legend(fontsize=7, loc="upper right")
    return _save(fig, out_dir, "throughput", (ax,), "y")


def plot_freshness(results_dir: Path, out_dir: Path) -> Path | None:
    """Step -> served lag vs publish interval, and freshness per relay level."""
    res = load(results_dir, "freshness")
    if res is None:
        return None
    plt = pyplot()
    fig, (ax_p, ax_l) = plt.subplots(1, 2, figsize=(11, 3.8))
    pub = res.get("publish", [])
    xs = [p["interval_s"] for p in pub]
    for key, mark, c, lab in (
        ("lag", "o", "tab:blue", "step -> served"),
        ("pipeline", "s", "tab:green", "pipeline only"),
    ):
        ax_p.plot(xs, [p[f"{key}_p50_s"] for p in pub], mark + "-", color=c, label=f"{lab} p50")
        ax_p.plot(xs, [p[f"{key}_p99_s"] for p in pub], mark + "--", color=c, label=f"{lab} p99")
    ax_p.set_xscale("log")
    ax_p.set_xticks(xs, [f"{x:g}" for x in xs])
    ax_p.minorticks_off()
    ax_p.set_xlabel("publish interval (s)")
    ax_p.set_ylabel("seconds")
    ax_p.set_title("freshness: trainer step -> predictor serving it")
    ax_p.legend(fontsize=7)
    lv = res.get("relay_levels", [])
    ax_l.bar([x["level"] - 0.2 for x in lv], [x["p50_s"] for x in lv], 0.4, label="p50")
    ax_l.bar([x["level"] + 0.2 for x in lv], [x["p99_s"] for x in lv], 0.4, label="p99")
    ax_l.set_xticks([x["level"] for x in lv], ["sidecar", "relay", "relay of relay"][: len(lv)])
    ax_l.set_ylabel("seconds")
    ax_l.set_title("new segment -> head at each level")
    ax_l.legend(fontsize=7)
    return _save(fig, out_dir, "freshness", (ax_p, ax_l))


def plot_encode_once(results_dir: Path, out_dir: Path) -> Path | None:
    """Sidecar CPU of N consumers at one cursor against the bare gRPC floor streaming the
    same bytes to N clients (the sidecar_mem benchmark's ``encode_once``)."""
    res = load(results_dir, "sidecar_mem")
    eo = (res or {}).get("encode_once") or {}
    if not eo.get("sidecar") or not eo.get("floor"):
        return None
    import statistics

    def curve(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
        ns = sorted({r["consumers"] for r in rows})
        return ns, [statistics.median(r[key] for r in rows if r["consumers"] == n) for n in ns]

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ns, ys = curve(eo["sidecar"], "cpu_s")
    ax.plot(ns, ys, "o-", label="deltad sidecar (window encoded once)")
    fs, fy = curve(eo["floor"], "server_cpu_s")
    ax.plot(fs, fy, "s--", label="bare gRPC, prebuilt messages (floor)")
    if len(ns) > 1 and len(fs) > 1 and fy[-1] != fy[0]:
        per = (ys[-1] - ys[0]) / (ns[-1] - ns[0])
        floor = (fy[-1] - fy[0]) / (fs[-1] - fs[0])
        ax.set_title(f"CPU per extra consumer: {per / floor:.2f}x the floor (goal 1.1x)")
    ax.set_xlabel("consumers at one cursor")
    ax.set_ylabel("server CPU seconds per round")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out_dir, "encode-once")


PLOTTERS: dict[str, Callable[[Path, Path], Path | None]] = {
    "fanout": plot_fanout,
    "fanout-memory": plot_fanout_memory,
    "encode-once": plot_encode_once,
    "serving": plot_serving,
    "throughput": plot_throughput,
    "freshness": plot_freshness,
}


def draw(results_dir: Path = RESULTS_DIR, out_dir: Path = FIGURES_DIR) -> list[Path]:
    """Every figure whose results are recorded; returns the PNGs written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fn in PLOTTERS.items():
        path = fn(results_dir, out_dir)
        if path is None:
            print(f"bench.plots: {name}: no recorded results, skipped", file=sys.stderr)
        else:
            paths.append(path)
    return paths


def readme_figures(readme: Path) -> list[str]:
    """The ``figures/<name>.png`` paths an ``![...](...)`` of ``readme`` shows."""
    return re.findall(r"!\[[^\]]*\]\((figures/[^)\s]+\.png)\)", readme.read_text())


def _med(x: Any) -> Any:
    return x.get("median") if isinstance(x, dict) else x


def _f(x: Any, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def fleet_table(results_dir: Path = RESULTS_DIR) -> list[str]:
    """The README's fleet table (markdown lines) from the recorded fleet run."""
    fleet = fleet_result(results_dir)
    if fleet is None:
        return []
    lines = [
        "| configuration | consumers | pull p50 / p99 s | aggregate GB/s | sidecar CPU s/GB "
        "| relay L1 CPU s/GB | relay L2 CPU s/GB | consumer CPU s/GB | peak RSS MB "
        "sidecar / L1 / L2 / worker | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in fleet["points"]:
        c = p["cpu_s_per_gb"]
        r = p["peak_rss_bytes"]
        rss = " / ".join(
            f"{v / 1e6:.0f}"
            for v in (r["sidecar"], r["relay1"], r["relay2"], p["consumer_worker_peak_rss_bytes"])
        )
        lines.append(
            f"| {p['config']} | {p['consumers']} | {_f(p['p50_s'])} / {_f(p['p99_s'])} "
            f"| {_f(p['aggregate_gbps'])} | {_f(c['sidecar'])} | {_f(c['relay1'])} "
            f"| {_f(c['relay2'])} | {_f(p['consumer_cpu_s_per_gb'])} | {rss} | {p['failed']} |"
        )
    return lines


def model_table(results_dir: Path = RESULTS_DIR) -> list[str]:
    """The README's scale-model table (markdown lines): :func:`bench.fanout_scale.scale_model` of
    the recorded fleet run (per-pull and per-GB costs) and the recorded relay tree (mirror,
    idle and per-hop freshness)."""
    from bench.fanout_scale import scale_model

    fleet = fleet_result(results_dir)
    tree = load(results_dir, "fanout-tree")
    if fleet is None or tree is None:
        return []
    model = scale_model(tree, fleet=fleet)
    lines = [
        "| delta rate per rank | consumers per node (limit) | relay levels | relays per rank, "
        "level 1 / 2 | relays in all | serving cores in all | relay idle cores in all "
        "| freshness p99 at predictors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in model["rows"]:
        widths = " / ".join(str(x["relays_per_rank"]) for x in r["relays"]) or "0 (sidecar)"
        lines.append(
            f"| {r['delta_mb_per_s_per_rank']:g} MB/s | {r['fanout_per_node']} "
            f"({r['limited_by']}) | {r['relay_levels']} | {widths} | {r.get('relays_total')} "
            f"| {_f(r.get('serving_cores_total'), 0)} | {_f(r.get('relay_idle_cores_total'), 0)} "
            f"| {_f(r.get('freshness_p99_s_at_predictor_tier'))} s |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench.plots``."""
    parser = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="recorded results dir")
    parser.add_argument("--out", type=Path, default=FIGURES_DIR, help="where the PNGs go")
    parser.add_argument("--tables", action="store_true", help="print the README's tables")
    args = parser.parse_args(argv)
    if args.tables:
        print("\n".join([*fleet_table(args.results), "", *model_table(args.results)]))
        return 0
    for path in draw(args.results, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
