"""`deltad export`: write the reference model's TorchScript artifact (and its manifest) for a
C++ predictor (``deltad-predictor-cpp``); see :mod:`deltad.consume.export`. No torch at import time."""

from __future__ import annotations

import argparse
from pathlib import Path

from deltad.config import Range
from deltad.errors import ConfigError

#: Every numeric flag's range (by argparse dest), checked by `deltad` before run().
RANGES: dict[str, Range] = {
    "rows": Range(1, 1 << 40),
    "seq_rows": Range(1, 1 << 40),
    "dim": Range(4, 1 << 16),
    "seed": Range(0, 1 << 62),
    "serve_batch_size": Range(1, 1 << 20),
    "zch_slots": Range(0, 1 << 31, note="0 = no managed-collision table"),
    "zch_raw_ids": Range(0, 1 << 62, note="0 = 20 x the slots"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out", type=Path, default=Path("model.pt"), help="the artifact (its manifest: OUT.json)"
    )
    p.add_argument(
        "--serve-dtype",
        choices=("int8", "int4", "fp16", "fp32"),
        default="int8",
        help="the tables' dtype, as torchrec quantizes them",
    )
    p.add_argument(
        "--tables",
        default="4",
        help="pooled tables: a count (t0..tN-1) or NAME[:ROWS],..., as given to the trainer",
    )
    p.add_argument("--rows", type=int, default=10_000, help="rows per pooled table")
    p.add_argument("--seq-rows", type=int, help="rows of the sequence table (None: --rows)")
    p.add_argument("--dim", type=int, default=16, help="embedding dim")
    p.add_argument("--seed", type=int, default=0, help="model code / batch seed")
    p.add_argument("--serve-batch-size", type=int, default=64, help="the example batch's size")
    p.add_argument("--zch-slots", type=int, help="slots of the managed-collision table (0: none)")
    p.add_argument("--zch-raw-ids", type=int, default=0, help="its raw-id space")
    p.add_argument(
        "--zch-policy", choices=("lru", "lfu"), default="lru", help="its MCH eviction policy"
    )
    p.add_argument(
        "--state",
        type=Path,
        help="float weights to export (a trainer's --final-model; default: the model code's)",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from deltad.consume.export import export_reference, manifest_path
    from deltad.reference.consumers.serving import ServingConfig
    from deltad.reference.trainer.cli import parse_tables

    cfg = ServingConfig(
        dtype=args.serve_dtype, tables=parse_tables(args.tables, args.rows),
        seq_rows=args.seq_rows or args.rows, dim=args.dim, seed=args.seed,
        batch_size=args.serve_batch_size, zch_slots=args.zch_slots,
        zch_raw_ids=args.zch_raw_ids, zch_policy=args.zch_policy,
    )  # fmt: skip
    state = None
    if args.state is not None:
        try:
            state = torch.load(args.state, map_location="cpu", weights_only=True)
        except Exception as e:  # (what torch.load raises for arbitrary bytes is open-ended)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConfigError(f"cannot load --state {args.state}: {first}") from e
        if not isinstance(state, dict):
            raise ConfigError(f"--state {args.state}: expected a state_dict (name -> tensor)")
    manifest = export_reference(cfg, args.out, state)
    print(
        f"exported {args.out} ({len(manifest['tables'])} tables, "
        f"{len(manifest['dense'])} dense tensors) and {manifest_path(args.out)}",
        flush=True,
    )
    return 0
