"""`deltad demo`: the whole loop on this machine, with a report and checks.

It starts an embedded Redis, the reference trainer (``deltad train``: gloo ranks, a small
DLRM, Zipf traffic, mixed sharding types), one ``deltad serve`` per rank and three predictors
(``deltad consume``: rows/fp32, top-k/int8, and serving-int8: a torchrec int8-quantized
ClickModel answering forwards while it syncs, pulling rows packed in its tables' layout
(packed-int8) and the trainer's dense state), all as subprocesses with logs in the work
directory. When training ends, the predictors catch up with the final head, stop, and write
their tables; the demo then checks

* the rows/fp32 predictor's tables are bit-equal to the trainer's final tables;
* the top-k/int8 predictor, once no rows are owed, is within the int8 row-wise rounding
  bound of the trainer's final tables: ``|served - trained| <= (row max - row min + 1e-8) / 510``
  per row (plus float32 rounding of code * scale + bias);
* the serving-int8 predictor's weights (every table byte and the dense parameters and
  buffers) and its forward output on a fixed batch are bit-equal to the trainer's final
  model (``deltad train --final-model``: its tables and dense state) quantized by torchrec
  (``quantize_embeddings``);
* ``serving-zch``: that predictor's managed-collision table (the reference model's ``zch``,
  served by torchrec's ``QuantManagedCollisionEmbeddingBagCollection``): its rows, its
  remapper's lookup buffers and the embeddings it serves for raw ids it holds, raw ids evicted
  during the run and raw ids never seen (its exit probe) are bit-equal to the same model's.

Exit 0 only if all hold; otherwise one line on stderr and exit 1. Every child is stopped on
exit or Ctrl-C (SIGTERM, a bounded wait, then SIGKILL).

:class:`~deltad.demo.loop.Demo` runs the loop (:mod:`deltad.demo.loop`), the bad-update scenario
:mod:`deltad.demo.rollout`; the work directory and the children are
:mod:`deltad.demo.procs`, the predictors' logs and the traffic table :mod:`deltad.demo.report`,
the checks :mod:`deltad.demo.checks`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deltad import output
from deltad.config import MAX_COUNT, MAX_SECONDS, Range
from deltad.demo.checks import SERVING, TABLES, ZCH
from deltad.demo.loop import MODEL, Demo
from deltad.demo.procs import DemoFailed, terminate_as_interrupt
from deltad.demo.report import PredictorLog
from deltad.errors import ConfigError

__all__ = ["MODEL", "SERVING", "TABLES", "ZCH", "Demo", "DemoFailed", "PredictorLog", "run"]


#: Every numeric flag's range (by argparse dest), checked by `deltad` before run().
RANGES: dict[str, Range] = {
    "duration": Range(0, MAX_SECONDS, lo_open=True),
    "rows": Range(1, MAX_COUNT),
    "dim": Range(1, 1 << 16),
    "world_size": Range(1, 64),
    "publish_every": Range(0, 3600, lo_open=True),
    "pull_interval": Range(0, 3600, lo_open=True),
    "topk_fraction": Range(0, 1, lo_open=True),
    "settle_timeout": Range(0, MAX_SECONDS, lo_open=True),
}


#: The defaults of the flags that ``--scenario bad-update`` (a fixed shape) refuses when given:
#: their argparse default is None (not given), filled in from here by :func:`check_args`.
DEFAULTS: dict[str, int | float] = {
    "duration": 60.0,
    "world_size": 2,
    "publish_every": 0.5,
    "topk_fraction": 0.5,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the flags of `deltad demo`."""

    def default(dest: str) -> str:
        return f" (default: {DEFAULTS[dest]:g}; not with --scenario bad-update)"

    p.add_argument("--duration", type=float, help="seconds of training" + default("duration"))
    p.add_argument("--rows", type=int, default=20_000, help="rows per table")
    p.add_argument("--dim", type=int, default=16, help="embedding dim")
    p.add_argument("--world-size", type=int, help="trainer ranks" + default("world_size"))
    p.add_argument(
        "--publish-every", type=float, help="seconds between segments" + default("publish_every")
    )
    p.add_argument("--pull-interval", type=float, default=0.1, help="predictor pull interval")
    p.add_argument(
        "--topk-fraction", type=float, help="top-k predictor fraction" + default("topk_fraction")
    )
    p.add_argument("--settle-timeout", type=float, default=60.0, help="catch-up limit (s)")
    p.add_argument(
        "--workdir",
        type=Path,
        help="spool, logs, tables: a new or an empty directory (default: a temp dir)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--archive",
        nargs="?",
        const="",
        metavar="URL",
        help="the sidecars copy their logs to an object store, and after training a predictor "
        "bootstraps from it alone (check cold-start): alone, a store in the work directory; "
        "or s3://BUCKET/PREFIX (with --archive-endpoint) or file:///shared/mount; only with "
        "the default scenario",
    )
    p.add_argument(
        "--archive-endpoint", metavar="URL", help="an S3-compatible server for an s3:// --archive"
    )
    p.add_argument(
        "--scenario",
        choices=("default", "bad-update", "silent-bad-update"),
        default="default",
        help="bad-update: a NaN step, the validation gate, a canary and a rollback "
        "(deltad.demo.rollout), at a fixed shape (2 ranks, 40 steps, a segment every 2 steps, "
        "no top-k predictor): it takes --rows, --dim, --pull-interval, --settle-timeout, "
        "--workdir and --keep, and refuses --duration, --world-size, --publish-every and "
        "--topk-fraction; silent-bad-update: flipped labels, the canary evaluator holds and "
        "rolls back (deltad.demo.quality; the same flags); default: the whole loop, with its "
        "report and checks",
    )


def check_args(args: argparse.Namespace) -> None:
    """ConfigError (one line, exit 2, before anything starts) for a flag the scenario cannot
    honour; then the defaults of the flags left out (:data:`DEFAULTS`)."""
    scenario = getattr(args, "scenario", "default")
    if scenario != "default" and getattr(args, "archive", None) is not None:
        raise ConfigError(f"--archive goes with the default scenario, not --scenario {scenario}")
    if getattr(args, "archive_endpoint", None) and getattr(args, "archive", None) is None:
        raise ConfigError("--archive-endpoint needs --archive")
    if scenario == "bad-update":
        from deltad.demo.rollout import check_flags

        check_flags(args)
    if getattr(args, "scenario", "default") == "silent-bad-update":
        from deltad.demo.quality import check_flags as check_quality_flags

        check_quality_flags(args)
    for dest, value in DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 only if its checks hold."""
    check_args(args)
    kind: type[Demo] = Demo
    if getattr(args, "scenario", "default") == "bad-update":
        from deltad.demo.rollout import BadUpdateDemo

        kind = BadUpdateDemo
    if getattr(args, "scenario", "default") == "silent-bad-update":
        from deltad.demo.quality import SilentBadUpdateDemo

        kind = SilentBadUpdateDemo
    demo = kind(args)
    try:
        with terminate_as_interrupt():
            return demo.run()
    except DemoFailed as e:
        output.line(f"deltad demo: {e}; {demo.discard(keep_logs=True)}", level="ERROR")
        return 1
    except KeyboardInterrupt:
        output.line(f"deltad demo: interrupted; {demo.discard()}", level="WARNING")
        return 130
