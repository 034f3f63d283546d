"""`deltad consume`: the reference predictor (see :mod:`consumers.predictor`).

Imports nothing heavy at module import time; torch comes in with the predictor in ``run``.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from deltad import output
from deltad.config import MAX_COUNT, MAX_SECONDS, ConsumerConfig, PullOptions, Range
from deltad.signals import handle_signals
from deltad.types import Form

if TYPE_CHECKING:
    from deltad.types import WireDtype


#: The namespace attribute holding the form-specific flags the command line gave (by dest).
GIVEN = "_consume_given"


class _Given(argparse.Action):
    """Stores the value, as the default action does, and notes the flag as given: a flag of
    another form, or of the serving model without --serve-dtype, is refused only when typed
    (its default stays in --help)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        given = dict(getattr(namespace, GIVEN, None) or {})
        given[self.dest] = option_string or self.option_strings[0]
        setattr(namespace, GIVEN, given)


#: flags (dests) that apply only to --form topk
TOPK_ONLY = ("k", "fraction")
#: flags (dests) of the serving model: only with --serve-dtype
SERVING_ONLY = (
    "tables", "rows", "seq_rows", "dim", "consistency", "chunk_rows", "serve_batch_size",
    "serve_interval", "seed", "zch_slots", "zch_raw_ids", "zch_policy", "final_state",
)  # fmt: skip


def check_form_flags(args: argparse.Namespace) -> None:
    """ConfigError naming the first flag given that the chosen form ignores: --k / --fraction
    without --form topk, a serving-model flag without --serve-dtype (silently ignored, they
    would look honoured)."""
    from deltad.errors import ConfigError

    given: dict[str, str] = getattr(args, GIVEN, None) or {}
    for dest in TOPK_ONLY:
        if dest in given and args.form != "topk":
            raise ConfigError(
                f"{given[dest]} goes with --form topk (--form {args.form} ignores it)"
            )
    for dest in SERVING_ONLY:
        if dest in given and args.serve_dtype is None:
            raise ConfigError(
                f"{given[dest]} needs --serve-dtype: a setting of the serving model, "
                "ignored without one"
            )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the flags of `deltad consume`."""
    p.add_argument("--consumer", required=True, help="consumer name (its cursor in Redis)")
    p.add_argument("--model", default="model", help="model name")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--sidecar",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="sidecar endpoint; repeat once per rank, in rank order",
    )
    src.add_argument(
        "--redis-url",
        default=os.environ.get("DELTAD_REDIS_URL"),
        help="discover the sidecars in Redis (RedisKeys.ranks; redis://, rediss://, "
        "redis+sentinel://, redis+cluster://) [DELTAD_REDIS_URL]",
    )
    p.add_argument(
        "--form",
        choices=("ids", "rows", "topk"),
        default="rows",
        help="what a pull returns: changed ids, their rows, or the top-k rows that moved most",
    )
    p.add_argument(
        "--k", type=int, default=0, action=_Given, help="topk only: rows per table per pull"
    )
    p.add_argument(
        "--fraction",
        type=float,
        default=0.0,
        action=_Given,
        help="topk only: fraction of candidate rows (0, 1]",
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "fp16", "bf16", "int8", "packed-int8", "packed-int4", "packed-fp16"),
        help="wire dtype; None: fp32, or with --serve-dtype int8|int4|fp16 its packed form "
        "(rows in the serving tables' layout); packed-* only with the matching --serve-dtype",
    )
    p.add_argument("--max-rows", type=int, default=0, help="cap on rows per pull (0: none)")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between pulls")
    p.add_argument(
        "--long-poll",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="follow the trainer: between pulls wait up to this long for a rank to publish "
        "(a long poll the sidecars answer as soon as their head moves) and pull at once; "
        "0: pull every --interval",
    )
    p.add_argument("--duration", type=float, default=0.0, help="stop after N seconds (0: run)")
    p.add_argument("--pulls", type=int, default=0, help="stop after N pulls (0: run)")
    p.add_argument("--no-align", action="store_true", help="do not align ranks on one step")
    p.add_argument("--auto-commit", action="store_true", help="let the server commit")
    p.add_argument("--init-tables", type=Path, help="start from this {table: tensor} file")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the committed cursors instead of asking for the full tables; only "
        "with --init-tables holding the state of those cursors (e.g. this consumer's own "
        "--final-tables from a clean stop)",
    )
    p.add_argument(
        "--bootstrap-from",
        metavar="URL",
        default=os.environ.get("DELTAD_BOOTSTRAP_FROM"),
        help="cold start: read the newest archived base and segments from this object store "
        "(s3://BUCKET/PREFIX, credentials from the AWS environment, or file:///mount), then pull "
        "only the tail from the sidecars [DELTAD_BOOTSTRAP_FROM]",
    )
    p.add_argument(
        "--bootstrap-endpoint",
        metavar="URL",
        default=os.environ.get("DELTAD_BOOTSTRAP_ENDPOINT"),
        help="an S3-compatible server for an s3:// --bootstrap-from [DELTAD_BOOTSTRAP_ENDPOINT]",
    )
    p.add_argument("--final-tables", type=Path, help="torch.save the tables here at the end")
    p.add_argument("--json-log", metavar="PATH", help='JSON line per pull ("-": stdout)')
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve the predictor's Prometheus /metrics on this port (0: any free port): "
        "served step, freshness, pulls, refused windows",
    )
    p.add_argument(
        "--metrics-listen",
        default="127.0.0.1",
        metavar="HOST",
        help="host the predictor's /metrics binds to",
    )
    p.add_argument(
        "--rpc-deadline",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="deadline of each RPC, and of each wait for a GetDelta stream's next message (a "
        "stream silent that long is cancelled and retried)",
    )
    p.add_argument(
        "--stream-deadline",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="longest one GetDelta stream may run in all (a bootstrap of a big shard over a "
        "slow link; the sidecar's --stream-deadline bounds it too)",
    )
    p.add_argument(
        "--max-retries", type=int, default=5, help="retries of a failed RPC, with backoff"
    )
    p.add_argument(
        "--discovery-timeout", type=float, default=120.0, help="seconds to wait for all ranks"
    )
    p.add_argument(
        "--reuse-buffers-mb",
        type=int,
        default=8192,
        help="rebuild pulls into released buffers of earlier pulls, at most this many MB "
        "kept per rank (0: allocate afresh)",
    )
    serve = p.add_argument_group(
        "serving model",
        "hold a torchrec quantized reference model (the trainer's ClickModel architecture), "
        "bootstrapped from deltad alone, and answer forwards while syncing; the flags after "
        "--serve-dtype need it",
    )
    serve.add_argument(
        "--serve-dtype",
        choices=("int8", "int4", "fp16", "fp32"),
        help="quantize the serving model's tables to this dtype (torchrec 1.8 cannot do bf16)",
    )

    def serving(*names: str, **kw: Any) -> None:  # a flag that needs --serve-dtype
        serve.add_argument(*names, action=_Given, **kw)

    serving(
        "--tables",
        default="4",
        help="pooled tables: a count (t0..tN-1) or NAME[:ROWS],..., as given to the trainer",
    )
    serving("--rows", type=int, default=10_000, help="rows per pooled table")
    serving("--seq-rows", type=int, help="rows of the sequence table (None: --rows)")
    serving("--dim", type=int, default=16, help="embedding dim")
    serving(
        "--consistency",
        choices=("chunk", "window"),
        default="chunk",
        help="chunk: forwards wait at most one chunk's copy, rows of a window may mix; "
        "window: forwards see whole windows and wait for the whole copy",
    )
    serving("--chunk-rows", type=int, default=4096, help="rows per locked copy")
    serving("--serve-batch-size", type=int, default=64, help="fixed forward batch")
    serving("--serve-interval", type=float, default=0.002, help="seconds between forwards")
    serving("--seed", type=int, default=0, help="model code / batch seed")
    serving(
        "--zch-slots",
        type=int,
        help="slots of the managed-collision table 'zch', as given to the trainer (unset: "
        "the trainer's default; 0: none)",
    )
    serving("--zch-raw-ids", type=int, default=0, help="its raw-id space, as given to the trainer")
    serving("--zch-policy", choices=("lru", "lfu"), default="lru", help="its MCH eviction policy")
    serving(
        "--final-state",
        type=Path,
        help="torch.save the serving model's state_dict at exit (and its logits on the fixed "
        "batch to F's stem + '-forward'; its managed-collision probe to F's stem + '-zch')",
    )
    p.add_argument("--tls-ca", type=Path, help="CA bundle to verify TLS sidecars")
    p.add_argument(
        "--tls-cert",
        type=Path,
        help="client certificate (PEM) for sidecars that require mTLS (re-read when it changes)",
    )
    p.add_argument("--tls-key", type=Path, help="the private key (PEM) of --tls-cert")
    p.add_argument(
        "--token-file",
        type=Path,
        help="file holding the bearer token, re-read when it changes (instead of --token-env)",
    )
    p.add_argument(
        "--token-env",
        default="DELTAD_TOKEN",
        help="environment variable holding the bearer token",
    )


#: Every numeric flag's range (by argparse dest), checked by `deltad` before run().
RANGES: dict[str, Range] = {
    "k": Range(0, MAX_COUNT),
    "zch_slots": Range(0, 1 << 31, note="0 = no managed-collision table"),
    "zch_raw_ids": Range(0, 1 << 62, note="0 = 20 x the slots"),
    "fraction": Range(0, 1),
    "max_rows": Range(0, MAX_COUNT, note="0 = no cap"),
    "interval": Range(0, 3600),
    "long_poll": Range(0, 3600, note="0 = off"),
    "duration": Range(0, MAX_SECONDS, note="0 = no limit"),
    "pulls": Range(0, MAX_COUNT, note="0 = no limit"),
    "rpc_deadline": Range(0, 86400, lo_open=True),
    "stream_deadline": Range(0, 7 * 86400, lo_open=True),
    "max_retries": Range(0, 1000),
    "discovery_timeout": Range(0, 86400),
    "reuse_buffers_mb": Range(0, 1 << 30, note="0 = off"),
    "metrics_port": Range(0, 65535, note="0 = any free port"),
    "rows": Range(1, MAX_COUNT),
    "seq_rows": Range(1, MAX_COUNT),
    "dim": Range(1, 1 << 16),
    "chunk_rows": Range(1, MAX_COUNT),
    "serve_batch_size": Range(1, 1 << 20),
    "serve_interval": Range(0, 3600),
    "seed": Range(0, (1 << 63) - 1),
}


def build_consumer_config(args: argparse.Namespace) -> ConsumerConfig:
    """The ConsumerConfig of parsed ``deltad consume`` flags (ConfigError on bad values)."""
    return ConsumerConfig(
        consumer=args.consumer,
        model=args.model,
        sidecars=tuple(args.sidecar),
        redis_url=args.redis_url,
        pull=PullOptions(
            form=Form(args.form),
            k=args.k,
            fraction=args.fraction,
            wire_dtype=_wire_dtype(args.dtype, args.serve_dtype),
            max_rows=args.max_rows,
            auto_commit=args.auto_commit,
        ),
        align_steps=not args.no_align,
        rpc_deadline_s=args.rpc_deadline,
        stream_deadline_s=args.stream_deadline,
        max_retries=args.max_retries,
        discovery_timeout_s=args.discovery_timeout,
        token=None if args.token_file else (os.environ.get(args.token_env) or None),
        token_file=args.token_file,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        reuse_buffers_bytes=args.reuse_buffers_mb * (1 << 20),
        resume=args.resume,
        bootstrap_from=args.bootstrap_from or None,
        bootstrap_endpoint=args.bootstrap_endpoint or None,
    )


def run(args: argparse.Namespace) -> int:
    """Run the predictor until --duration / --pulls / SIGTERM; 0 on a clean stop."""
    check_form_flags(args)  # before torch loads, before anything connects
    from deltad.perf import tune_malloc, tune_threads

    tune_malloc()  # before torch loads (see deltad.perf)
    tune_threads()
    from deltad.errors import ConfigError

    from .predictor import SyncLoop, SyncLoopConfig

    if args.pulls < 0 or args.duration < 0 or args.interval < 0 or args.long_poll < 0:
        raise ConfigError(
            "--pulls, --duration, --interval and --long-poll must be >= 0 (0: no limit / off)"
        )
    if not args.sidecar and not args.redis_url:
        raise ConfigError("give --sidecar HOST:PORT (once per rank) or --redis-url")
    if args.sidecar and os.environ.get("DELTAD_REDIS_URL") == args.redis_url:
        args.redis_url = None  # explicit --sidecar wins over the environment's Redis
    if args.resume and args.init_tables is None:
        raise ConfigError("--resume needs --init-tables: the tables its committed cursors describe")
    if args.bootstrap_from and (
        args.init_tables or args.resume or args.serve_dtype or args.form == "ids"
    ):
        raise ConfigError(
            "--bootstrap-from starts float tables from the archive: not with --init-tables, "
            "--resume, --serve-dtype or --form ids"
        )
    serving = None
    if args.serve_dtype is not None or (args.dtype or "").startswith("packed"):
        from deltad.needs import need

        need("fbgemm_gpu", "torchrec", purpose="deltad consume --serve-dtype (quantized serving)")
    if args.serve_dtype is not None:
        from deltad.reference.trainer.cli import parse_tables

        from .serving import ServingConfig

        if args.init_tables is not None or args.resume:
            raise ConfigError("--serve-dtype bootstraps from deltad: no --init-tables / --resume")
        if args.form == "ids":  # (ids carry no values: the model would keep its init)
            raise ConfigError(
                "--form ids carries no values to serve: use --form rows or topk with --serve-dtype"
            )
        serving = ServingConfig(
            dtype=args.serve_dtype,
            tables=parse_tables(args.tables, args.rows),
            seq_rows=args.seq_rows or args.rows,
            dim=args.dim,
            consistency=args.consistency,
            chunk_rows=args.chunk_rows,
            seed=args.seed,
            batch_size=args.serve_batch_size,
            interval_s=args.serve_interval,
            final_state=args.final_state,
            zch_slots=args.zch_slots,
            zch_raw_ids=args.zch_raw_ids,
            zch_policy=args.zch_policy,
        )
    elif args.final_state is not None:
        raise ConfigError("--final-state needs --serve-dtype")
    if args.form == "ids" and (args.final_tables is not None or args.init_tables is not None):
        raise ConfigError(
            "--form ids applies no values: --final-tables / --init-tables need --form rows or topk"
        )
    consumer = build_consumer_config(args)
    for flag, dest in (
        ("--final-tables", args.final_tables),
        ("--final-state", args.final_state),
        ("--json-log", None if args.json_log == "-" else args.json_log),
    ):
        if dest is not None:
            _check_writable(flag, Path(dest))
    # --init-tables is read here (one line, exit 2 for a file that is not tables) before the
    # sidecars are waited for, and checked against the tables their Status describes
    predictor = SyncLoop(
        SyncLoopConfig(
            consumer=consumer,
            interval_s=args.interval,
            long_poll_s=args.long_poll,
            duration_s=args.duration,
            pulls=args.pulls,
            init_tables=args.init_tables,
            final_tables=args.final_tables,
            json_log=args.json_log,
            serving=serving,
            metrics_port=args.metrics_port,
            metrics_addr=args.metrics_listen,
        )
    )
    # A cold start needs no sidecar: the archived state is served at once, and the pull loop
    # joins each rank's log when its sidecar answers (the trainer may be down).
    if consumer.bootstrap_from is not None and _cold_start(predictor):
        predictor.check_tables([])
        return _run(predictor, serving)
    # Wait for the sidecars (every --sidecar answering, or every rank registered in Redis)
    # before the pull loop's signal handling: a signal here ends the wait at once and says so
    # (the loop's handlers only ask it to stop after the pull, which a wait never reached).
    with _waiting_for_sidecars() as waited:
        if consumer.sidecars:  # refused: a wrong model, fewer sidecars than ranks, none answering
            from deltad.clientauth import ClientAuth
            from deltad.commands.status import check_sidecars

            statuses = check_sidecars(
                consumer.sidecars,
                consumer.model,
                auth=ClientAuth.of(consumer),
                deadline_s=args.discovery_timeout,
                rpc_timeout_s=min(args.rpc_deadline, 5.0),
            )
        else:  # every rank registered in Redis (bounded by --discovery-timeout)
            statuses = predictor.sidecar_statuses()
        predictor.check_tables(statuses)
    if waited.signal is not None:
        what = f"while waiting for the sidecars ({waited.seconds:.0f}s)"
        if waited.signal == signal.SIGINT:
            output.line(f"deltad consume: interrupted {what}", level="WARNING")
            return 130
        # SIGTERM asks for a clean stop, and stopping before the first pull is one
        output.line(
            f"deltad consume: stopped by SIGTERM {what}: nothing pulled, committed or written",
            level="WARNING",
        )
        return 0

    return _run(predictor, serving)


def _run(predictor: Any, serving: Any) -> int:
    """The pull loop until its end; the summary lines; the exit code."""
    # Both finish the pull in flight, commit, write --final-tables, exit 0: tables saved by a
    # Ctrl-C are then the state of the committed cursors (what --resume relies on).
    with handle_signals(
        {sig: lambda _: predictor.stop() for sig in (signal.SIGTERM, signal.SIGINT)}
    ):
        s = predictor.run()
    output.line(
        f"consumer {s.consumer}: {s.pulls} pulls, {s.rows} rows, {s.bytes} bytes, "
        f"step {s.step}, freshness p50 {_fmt(s.freshness_p50_s)} p99 {_fmt(s.freshness_p99_s)}"
    )
    if serving is not None:
        output.line(
            f"consumer {s.consumer}: {s.forwards} forwards ({serving.dtype.value}), latency ms "
            f"idle p50 {_ms(s.forward_idle_p50_ms)} p99 {_ms(s.forward_idle_p99_ms)}, during "
            f"apply p50 {_ms(s.forward_apply_p50_ms)} p99 {_ms(s.forward_apply_p99_ms)} "
            f"({s.forward_apply_samples}), longest lock hold {_ms(s.max_hold_ms)}"
        )
    last = next((r for r in reversed(predictor.records) if r.missing), None)
    if s.step is None and last is not None:
        # every pull came back without a step to serve (refused by a sidecar, a rank
        # missing): the predictor has no model, which must not look like success
        reasons = "; ".join(f"rank {k}: {v}" for k, v in sorted(last.missing.items()))
        output.line(
            f"deltad consume: no pull was served ({s.pulls} pulls); the last: {reasons}",
            level="ERROR",
        )
        return 1
    return 0


def _cold_start(predictor: Any) -> bool:
    """Apply the archived state (deltad.consume.coldstart) and go on from its cursors (ranks
    whose sidecar did not answer are told the state by the loop's pulls); True if it was
    applied. A state the archive and the sidecars do not agree on, or none in the archive:
    False, and the loop bootstraps from the sidecars."""
    import dataclasses

    from deltad.consume.coldstart import ColdStartUnavailable, cold_start, resumed
    from deltad.serve.archive.store import ArchiveError

    consumer = predictor.config.consumer
    try:
        state = cold_start(consumer, predictor.applier)
    except (ColdStartUnavailable, ArchiveError) as e:
        output.line(f"deltad consume: no cold start ({e}): bootstrapping from the sidecars")
        consumer = dataclasses.replace(consumer, bootstrap_from=None, bootstrap_endpoint=None)
        predictor.config = dataclasses.replace(predictor.config, consumer=consumer)
        return False
    output.line(
        f"deltad consume: cold start from {consumer.bootstrap_from}: generation "
        f"{state.generation} step {state.step}, {state.nbytes} bytes in "
        f"{state.seconds * 1000:.0f} ms"
        + (
            f"; the sidecars of ranks {list(state.pending)} do not answer: serving it, "
            "following them once they do"
            if state.pending
            else ""
        )
    )
    consumer = resumed(consumer, state)
    predictor.config = dataclasses.replace(predictor.config, consumer=consumer)
    predictor.served_step = state.step  # (what the tables serve until a pull moves them)
    return True


class _Waited:
    """How a wait for the sidecars ended: ``signal`` (SIGINT / SIGTERM) if one ended it, and
    the seconds it had waited."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self.seconds = 0.0


class _Signalled(BaseException):
    """Raised in the main thread by a signal during the wait (a BaseException, like
    KeyboardInterrupt: no ``except Exception`` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signal.Signals(signum)


@contextmanager
def _waiting_for_sidecars() -> Iterator[_Waited]:
    """While the block waits for the sidecars, SIGINT and SIGTERM end it at once (an
    exception from their handler, as SIGINT's KeyboardInterrupt); the result says which
    one did and after how long. The previous handlers come back at the end. From the main
    thread only (CPython installs handlers there); elsewhere the signals are left alone."""
    waited = _Waited()
    t0 = time.monotonic()

    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Signalled(signum)  # takes no lock (see deltad.signals)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield waited
    except (_Signalled, KeyboardInterrupt) as e:
        waited.signal = e.signum if isinstance(e, _Signalled) else signal.SIGINT
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        waited.seconds = time.monotonic() - t0


def _wire_dtype(dtype: str | None, serve_dtype: str | None) -> WireDtype:
    """--dtype, or the default for --serve-dtype: the packed form of its rows (fp32 for
    fp32); ConfigError for packed rows that are not the served tables' layout."""
    from deltad.consume.quant import packed_wire_dtype
    from deltad.errors import ConfigError
    from deltad.types import WireDtype

    if dtype is None:
        return packed_wire_dtype(serve_dtype) if serve_dtype else WireDtype.FP32
    wire = WireDtype(dtype)
    if wire.packed and (serve_dtype is None or packed_wire_dtype(serve_dtype) is not wire):
        raise ConfigError(
            f"--dtype {wire.value} sends rows in the layout of {wire.value[7:]} tables: "
            f"use it with --serve-dtype {wire.value[7:]}"
        )
    return wire


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _check_writable(flag: str, path: Path) -> None:
    """ConfigError unless ``path`` can be written (checked before consuming, not after)."""
    from deltad.errors import ConfigError

    # (an existing file is replaced: its directory must be writable, as for a new one)
    target = path.parent
    if path.is_dir() or not target.is_dir() or not os.access(target, os.W_OK):
        raise ConfigError(f"{flag} {path}: not a writable file path")


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}s"
