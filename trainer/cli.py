"""`deltad train`: run the reference online trainer and publish segments to a spool.

Kept free of torch imports at module level so that ``deltad --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from deltad import output
from deltad.config import MAX_COUNT, MAX_SECONDS, Range
from deltad.errors import ConfigError

from .zch import POLICIES, ZCH_RAW_PER_SLOT, ZCH_SLOTS

_SHARDINGS = ("tw", "rw", "cw", "twrw")  # also the cycle of --sharding mixed
_LOOPS = ("plain", "pipeline-base", "pipeline-sparse-dist")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spool", type=Path, help="spool directory (required unless --no-publish)")
    parser.add_argument("--model", default="model", help="model name (default: %(default)s)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default: %(default)s)")
    parser.add_argument(
        "--tables",
        default="4",
        help="pooled tables: a count (t0..tN-1) or NAME[:ROWS],... (default: %(default)s)",
    )
    parser.add_argument("--rows", type=int, default=10_000, help="rows per table")
    parser.add_argument("--seq-rows", type=int, help="rows of the sequence table (default --rows)")
    parser.add_argument("--dim", type=int, default=16, help="embedding dim (default: %(default)s)")
    parser.add_argument(
        "--zch-slots",
        type=int,
        default=ZCH_SLOTS,
        help="slots of the managed-collision (ZCH) table 'zch', row-wise sharded; 0: no such table",
    )
    parser.add_argument(
        "--zch-raw-ids",
        type=int,
        default=0,
        help=f"raw-id space of the zch table; 0: {ZCH_RAW_PER_SLOT} x its slots",
    )
    parser.add_argument(
        "--zch-policy", choices=POLICIES, default="lru", help="its MCH eviction policy"
    )
    parser.add_argument(
        "--sharding",
        default="mixed",
        help="tw|rw|cw|twrw for every table, 'mixed' (cycle tw,rw,cw,twrw; seq rw) or "
        "TABLE=TYPE,... (unlisted: tw) (default: %(default)s)",
    )
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--steps", type=int, help="train this many steps (default 100)")
    limit.add_argument("--duration", type=float, help="train this many seconds")
    parser.add_argument(
        "--step-interval",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="at most one step every this many seconds, as an online trainer fed by a stream: "
        "a step that ends early waits the rest (not counted in its step time) (default: 0, "
        "as fast as it can)",
    )
    parser.add_argument("--batch-size", type=int, default=128, help="samples per rank per step")
    parser.add_argument(
        "--publish-every-steps", type=int, help="publish every N steps (default 10 if no seconds)"
    )
    parser.add_argument(
        "--publish-every-seconds",
        type=float,
        default=0.0,
        help="publish when this many seconds passed since the last segment (0: off)",
    )
    parser.add_argument("--no-publish", action="store_true", help="no tracker (baseline)")
    parser.add_argument(
        "--no-fsync",
        action="store_true",
        help="do not fsync segments (free on a tmpfs spool anyway; see docs/design-notes.md)",
    )
    parser.add_argument(
        "--generation",
        type=int,
        help="generation id, larger than every one in the spool (refused otherwise; "
        "default: time-based, past the newest)",
    )
    parser.add_argument(
        "--loop", choices=_LOOPS, default="plain", help="train loop: plain or a torchrec pipeline"
    )
    parser.add_argument(
        "--input",
        choices=("kjt", "tensordict"),
        default="kjt",
        help="batch input type: KeyedJaggedTensor or TensorDict",
    )
    parser.add_argument("--final-tables", type=Path, help="torch.save {table: tensor} here")
    parser.add_argument(
        "--final-model",
        type=Path,
        help="torch.save the final model's state_dict here (unsharded names: every table "
        "gathered, and the dense parameters and buffers)",
    )
    parser.add_argument(
        "--dump-steps",
        default="",
        help="save the model at these steps, e.g. 30,60 (needs --dump-dir): "
        "model-step-S.pt (state_dict) and tables-step-S.pt",
    )
    parser.add_argument("--dump-dir", type=Path, help="directory of --dump-steps files")
    parser.add_argument(
        "--inject-nan-step",
        type=int,
        default=0,
        help="a bad update at this step: NaN gradients (rows and dense weights go NaN); 0 = none",
    )
    parser.add_argument(
        "--holdout-dir",
        type=Path,
        help="write held-out labelled examples (never trained on) of every step here, for "
        "`deltad evaluate --labelled-dir` (docs/evaluate.md; plain loop, KJT input)",
    )
    parser.add_argument(
        "--holdout-examples", type=int, default=16, help="held-out examples per rank per step"
    )
    parser.add_argument(
        "--holdout-keep", type=int, default=64, help="holdout files kept per rank (oldest deleted)"
    )
    parser.add_argument(
        "--golden-out", type=Path, help="write a fixed golden labelled set here at start"
    )
    parser.add_argument(
        "--golden-examples", type=int, default=2048, help="examples of --golden-out"
    )
    parser.add_argument(
        "--corrupt-labels-from-step",
        type=int,
        default=0,
        help="a silent bad update: flip (or shuffle) the training labels from this step; 0 = off",
    )
    parser.add_argument(
        "--corrupt-feature-from-step",
        type=int,
        default=0,
        help="a silent bad update: the first pooled table gets the second's ids from this "
        "step; 0 = off",
    )
    parser.add_argument(
        "--corrupt-steps", type=int, default=0, help="steps each corruption lasts (0: to the end)"
    )
    parser.add_argument(
        "--corrupt-labels-mode", choices=("flip", "shuffle"), default="flip",
        help="how labels are corrupted",
    )  # fmt: skip
    parser.add_argument(
        "--corrupt-fraction",
        type=float,
        default=1.0,
        help="fraction of each batch's labels corrupted",
    )
    parser.add_argument("--seed", type=int, default=0, help="data and model seed")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--result-json", type=Path, help="write the run's stats here")


#: Every numeric flag's range (by argparse dest), checked by `deltad` before run().
RANGES: dict[str, Range] = {
    "world_size": Range(1, 1 << 12),
    "zch_slots": Range(0, 1 << 31, note="0 = no managed-collision table"),
    "zch_raw_ids": Range(0, 1 << 62, note="0 = 20 x the slots"),
    "rows": Range(1, MAX_COUNT),
    "seq_rows": Range(1, MAX_COUNT),
    "dim": Range(1, 1 << 16),
    "steps": Range(1, MAX_COUNT),
    "duration": Range(0, MAX_SECONDS, lo_open=True),
    "batch_size": Range(1, 1 << 24),
    "step_interval": Range(0, 3600),
    "publish_every_steps": Range(0, MAX_COUNT),
    "publish_every_seconds": Range(0, MAX_SECONDS),
    "generation": Range(1, float(1 << 63) - 1),
    "seed": Range(0, (1 << 63) - 1),
    "lr": Range(0, 1e6, lo_open=True),
    "inject_nan_step": Range(0, MAX_COUNT, note="0 = none"),
    "holdout_examples": Range(1, 1 << 20),
    "holdout_keep": Range(1, 1 << 20),
    "golden_examples": Range(1, 1 << 24),
    "corrupt_labels_from_step": Range(0, MAX_COUNT, note="0 = off"),
    "corrupt_feature_from_step": Range(0, MAX_COUNT, note="0 = off"),
    "corrupt_steps": Range(0, MAX_COUNT, note="0 = to the end"),
    "corrupt_fraction": Range(0, 1, lo_open=True),
}


def parse_tables(spec: str, rows: int) -> dict[str, int]:
    """``"3"`` -> t0,t1,t2 with ``rows`` rows; ``"a,b:500"`` -> {a: rows, b: 500}."""
    spec = spec.strip()
    if spec.isdigit():
        return {f"t{i}": rows for i in range(int(spec))}
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, n = item.partition(":")
        try:
            out[name] = int(n) if n else rows
        except ValueError:
            raise ConfigError(f"--tables: bad row count in {item!r}") from None
        if not name:
            raise ConfigError(f"--tables: empty table name in {spec!r}")
    return out


def parse_steps(spec: str) -> tuple[int, ...]:
    """``"30,60"`` -> (30, 60) (``--dump-steps``)."""
    try:
        return tuple(int(s) for s in spec.split(",") if s.strip())
    except ValueError:
        raise ConfigError(f"--dump-steps: expected steps like 30,60, got {spec!r}") from None


def parse_sharding(spec: str, tables: list[str]) -> dict[str, str]:
    """Resolve ``--sharding`` into {table: short type}, the sequence table ``seq`` included."""
    spec = spec.strip()
    if spec == "mixed":
        out = {t: _SHARDINGS[i % len(_SHARDINGS)] for i, t in enumerate(tables)}
        out["seq"] = "rw"
        return out
    if spec in _SHARDINGS:
        out = dict.fromkeys(tables, spec)
        out["seq"] = "rw" if spec == "twrw" else spec
        return out
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, eq, st = item.partition("=")
        if not eq:
            raise ConfigError(
                f"--sharding: expected one of {', '.join((*_SHARDINGS, 'mixed'))} or "
                f"TABLE=TYPE,..., got {item!r}"
            )
        out[name] = st
    return out


def run(args: argparse.Namespace) -> int:
    from deltad.needs import need
    from deltad.types import TrainLoop

    need("fbgemm_gpu", "torchrec", purpose="deltad train (the reference trainer)")

    from .train import TrainConfig, run_training

    if args.duration is not None and args.duration <= 0:
        raise ConfigError("--duration must be > 0 seconds")
    if args.result_json is not None and not args.result_json.parent.is_dir():
        raise ConfigError(f"--result-json {args.result_json}: no such directory")
    tables = parse_tables(args.tables, args.rows)
    cfg = TrainConfig(
        spool_dir=args.spool,
        model=args.model,
        world_size=args.world_size,
        tables=tables,
        seq_rows=args.seq_rows or args.rows,
        dim=args.dim,
        zch_slots=args.zch_slots,
        zch_raw_ids=args.zch_raw_ids,
        zch_policy=args.zch_policy,
        sharding=parse_sharding(args.sharding, list(tables)),
        steps=args.steps if args.steps is not None else (0 if args.duration else 100),
        duration_s=args.duration or 0.0,
        step_interval_s=args.step_interval,
        batch_size=args.batch_size,
        publish_every_steps=(
            args.publish_every_steps
            if args.publish_every_steps is not None
            else (0 if args.publish_every_seconds else 10)
        ),
        publish_every_seconds=args.publish_every_seconds,
        publish=not args.no_publish,
        generation=args.generation,
        loop=TrainLoop(args.loop),
        input_format=args.input,
        final_tables=args.final_tables,
        final_model=args.final_model,
        seed=args.seed,
        learning_rate=args.lr,
        fsync=not args.no_fsync,
        progress=not args.no_progress,
        dump_steps=parse_steps(args.dump_steps),
        dump_dir=args.dump_dir,
        inject_nan_step=args.inject_nan_step,
        holdout_dir=args.holdout_dir,
        holdout_examples=args.holdout_examples,
        holdout_keep=args.holdout_keep,
        golden_out=args.golden_out,
        golden_examples=args.golden_examples,
        corrupt_labels_from_step=args.corrupt_labels_from_step,
        corrupt_feature_from_step=args.corrupt_feature_from_step,
        corrupt_steps=args.corrupt_steps,
        corrupt_labels_mode=args.corrupt_labels_mode,
        corrupt_fraction=args.corrupt_fraction,
    )
    result = run_training(cfg)
    text = json.dumps(asdict(result), indent=None if output.json_lines() else 2)
    print(text)  # the result (stdout), one JSON object: one line with --log-json
    if args.result_json:
        try:
            args.result_json.write_text(text)
        except OSError as e:
            raise ConfigError(f"--result-json {args.result_json}: {e}") from e
    return 0
