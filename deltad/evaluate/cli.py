"""`deltad evaluate`: the canary evaluator (see deltad.evaluate.evaluator), or with
``--status`` its records: the evaluators alive and the newest verdicts.

::

    deltad evaluate --redis-url redis://r:6379 --model m --sidecar t0:50051 --sidecar t1:50051 \\
        --golden golden.jsonl --labelled-dir holdout/ --tables 4 --rows 10000 --dim 16 \\
        --eps 0.05 --delta 0.25 --min-examples 512 --min-release-interval 0 \\
        --token-file eval.token --metrics-port 9109
    deltad evaluate --redis-url redis://r:6379 --model m --status

Kept free of torch imports at module level so that ``deltad --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

from deltad.config import MAX_COUNT, MAX_SECONDS, Range
from deltad.errors import ConfigError

log = logging.getLogger(__name__)

RANGES: dict[str, Range] = {
    "eps": Range(0, 10),
    "delta": Range(0, 10),
    "min_examples": Range(1, MAX_COUNT),
    "min_release_interval": Range(0, MAX_SECONDS),
    "release_delay": Range(0, 3600),
    "progressive_examples": Range(0, 1 << 24),
    "metrics_port": Range(0, 65535, note="0 = off"),
    "rows": Range(1, MAX_COUNT),
    "seq_rows": Range(1, MAX_COUNT),
    "dim": Range(4, 1 << 16),
    "zch_slots": Range(0, 1 << 31, note="0 = no managed-collision table"),
    "zch_raw_ids": Range(0, 1 << 62),
    "duration": Range(0, MAX_SECONDS, note="0 = until stopped"),
    "poll_interval": Range(0, 3600, lo_open=True),
    "timeout": Range(0, 3600, lo_open=True),
    "last": Range(1, 200),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="model", help="model name")
    p.add_argument(
        "--redis-url",
        default=os.environ.get("DELTAD_REDIS_URL"),
        help="the model's Redis (verdict records, discovery without --sidecar) [DELTAD_REDIS_URL]",
    )
    p.add_argument(
        "--sidecar",
        action="append",
        default=[],
        help="a sidecar of the model, one per rank in rank order (repeat); unset: discovered "
        "in Redis. The Rollout controls go to the first that answers",
    )
    p.add_argument(
        "--consumer",
        default=None,
        help="the evaluator's consumer name (default eval-<model>); its own canary group, "
        "outside the predictors' ones; the release copy is <consumer>.release",
    )
    p.add_argument(
        "--golden", type=Path, help="the golden labelled set (JSON Lines, a file or dir)"
    )
    p.add_argument(
        "--labelled-dir", type=Path, help="holdout spool of the newest held-out examples"
    )
    p.add_argument(
        "--progressive-examples", type=int, default=2048,
        help="newest held-out examples scored per step",
    )  # fmt: skip
    p.add_argument("--eps", type=float, default=0.05, help="NE may be worse by this, relative")
    p.add_argument("--delta", type=float, default=0.25, help="calibration within 1 +- delta")
    p.add_argument("--min-examples", type=int, default=512, help="fewest examples per verdict")
    p.add_argument(
        "--min-release-interval", type=float, default=0.0, help="seconds between releases"
    )
    p.add_argument(
        "--release-delay",
        type=float,
        default=0.0,
        help="release a passed step only after it survived this many seconds of later "
        "verdicts (a failure meanwhile drops it)",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics (0: off)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds")
    p.add_argument("--poll-interval", type=float, default=1.0, help="longest wait for a step")
    p.add_argument(
        "--status", action="store_true", help="print the evaluators alive and the newest verdicts"
    )
    p.add_argument("--json", action="store_true", help="--status: one JSON object")
    p.add_argument("--last", type=int, default=20, help="--status: the newest N verdicts")
    model = p.add_argument_group("model", "the reference ClickModel's shape, as the trainer's")
    model.add_argument("--tables", default="4", help="a count (t0..tN-1) or NAME[:ROWS],...")
    model.add_argument("--rows", type=int, default=10_000, help="rows per pooled table")
    model.add_argument("--seq-rows", type=int, help="rows of the sequence table (None: --rows)")
    model.add_argument("--dim", type=int, default=16, help="embedding dim")
    model.add_argument("--zch-slots", type=int, help="managed-collision slots (unset: default)")
    model.add_argument("--zch-raw-ids", type=int, default=0, help="its raw-id space")
    model.add_argument(
        "--zch-policy", choices=("lru", "lfu"), default="lru", help="its MCH eviction policy"
    )
    p.add_argument(
        "--token-file",
        type=Path,
        default=os.environ.get("DELTAD_TOKEN_FILE"),
        help="the evaluator's bearer token (roles consume and admin, scoped to its names: "
        "'eval-* consume,admin') [DELTAD_TOKEN_FILE]",
    )
    p.add_argument("--tls-ca", type=Path, help="CA (PEM): use TLS")
    p.add_argument("--tls-cert", type=Path, help="client certificate (PEM) for mTLS")
    p.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per Rollout RPC")


def _redis(args: argparse.Namespace) -> Any:
    from deltad.store.client import connect

    if not args.redis_url:
        raise ConfigError("--redis-url (or DELTAD_REDIS_URL) is needed: verdicts live in Redis")
    return connect(args.redis_url)


def status(args: argparse.Namespace) -> int:
    from deltad.evaluate.record import VerdictStore

    store = VerdictStore(_redis(args), args.model)
    alive, recent = store.alive(), store.recent(args.last)
    if args.json:
        out = {
            "alive": alive,
            "verdicts": [json.loads(v.to_json()) for v in recent],
        }
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    for line in status_lines(alive, recent):
        print(line)
    return 0


def status_lines(alive: dict[str, Any], recent: list[Any]) -> list[str]:
    """What ``--status`` prints (and what ``deltad status`` could show)."""
    lines = []
    if alive:
        for name, info in sorted(alive.items()):
            lines.append(
                f"evaluator {name}: alive (candidate step {info.get('step')}, release copy at "
                f"step {info.get('release_step')})"
            )
    else:
        lines.append(
            "evaluator: none alive: the fleet stays at the last release (nothing is released "
            "unscored)"
        )
    if not recent:
        lines.append("verdicts: none yet")
    for v in recent:
        lines.append(f"verdict: {v.line()} [by {v.by}]")
    return lines


def run(args: argparse.Namespace) -> int:
    from deltad.config import check_endpoint

    for e in args.sidecar:
        check_endpoint("--sidecar", e)
    if args.status:
        return status(args)
    from deltad.needs import need

    need("fbgemm_gpu", "torchrec", purpose="deltad evaluate (the reference model)")

    from deltad.clientauth import ClientAuth
    from deltad.config import ConsumerConfig
    from deltad.evaluate.control import RolloutClient
    from deltad.evaluate.evaluator import CanaryEvaluator, EvalConfig
    from deltad.evaluate.labelled import read_examples
    from deltad.evaluate.promex import EvalMetrics
    from deltad.evaluate.record import VerdictStore
    from deltad.evaluate.scoring import ClickModelScorer, reference_model
    from deltad.evaluate.verdict import Thresholds
    from deltad.keys import RedisKeys
    from deltad.reference.trainer.cli import parse_tables
    from deltad.signals import handle_signals

    if args.golden is None and args.labelled_dir is None:
        raise ConfigError("give --golden PATH and/or --labelled-dir DIR: nothing to score")
    golden = read_examples(args.golden) if args.golden is not None else []
    d = args.labelled_dir
    if d is not None and not d.is_dir() and not d.absolute().parent.is_dir():
        # (the trainer creates it: its parent must exist, so a typo makes nothing)
        raise ConfigError(f"--labelled-dir {d}: no such directory, nor its parent")
    tables = parse_tables(args.tables, args.rows)
    client = _redis(args)
    targets = list(args.sidecar)
    if not targets:
        ranks = client.hgetall(RedisKeys(args.model).ranks())
        targets = [
            json.loads(v)["endpoint"] for _, v in sorted(ranks.items(), key=lambda kv: int(kv[0]))
        ]
        if not targets:
            raise ConfigError(f"no sidecar of model {args.model} is registered in Redis")
    consumer = args.consumer or f"eval-{args.model}"
    ccfg = ConsumerConfig(
        consumer=consumer, model=args.model, sidecars=tuple(args.sidecar),
        redis_url=args.redis_url, token_file=args.token_file, tls_ca=args.tls_ca,
        tls_cert=args.tls_cert, tls_key=args.tls_key, rpc_deadline_s=args.timeout,
    )  # fmt: skip
    auth = ClientAuth(
        token=None if args.token_file else (os.environ.get("DELTAD_TOKEN") or None),
        token_file=args.token_file, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )  # fmt: skip
    cfg = EvalConfig(
        consumer=ccfg,
        thresholds=Thresholds(args.eps, args.delta, args.min_examples),
        progressive_examples=args.progressive_examples,
        labelled_dir=args.labelled_dir,
        min_release_interval_s=args.min_release_interval,
        release_delay_s=args.release_delay,
        poll_s=args.poll_interval,
        duration_s=args.duration,
    )
    metrics = EvalMetrics(args.model)

    def make() -> Any:
        return reference_model(
            tables, args.seq_rows or args.rows, dim=args.dim, zch_slots=args.zch_slots,
            zch_raw_ids=args.zch_raw_ids, zch_policy=args.zch_policy,
        )  # fmt: skip

    ev = CanaryEvaluator(
        cfg,
        make_model=make,
        scorer=ClickModelScorer(list(tables), zch=args.zch_slots != 0),
        golden=golden,
        control=RolloutClient(targets, auth, args.timeout),
        store=VerdictStore(client, args.model),
        on_verdict=metrics.observe,
    )
    if args.metrics_port:
        port = metrics.serve_http(args.metrics_port, "0.0.0.0")
        log.warning("evaluator: metrics on port %d", port)
    stop = {sig: (lambda _s: ev.stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    with handle_signals(stop):
        ev.start()
        print(f"evaluating {args.model} as {consumer}: {len(golden)} golden examples", flush=True)
        try:
            ev.run()
        finally:
            ev.close()
            metrics.close()
    passed = sum(v.passed for v in ev.verdicts)
    print(f"verdicts: {passed} pass, {len(ev.verdicts) - passed} fail", flush=True)
    return 0
