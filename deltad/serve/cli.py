"""`deltad serve`: run one rank's sidecar until SIGTERM / SIGINT (graceful, with a grace period).

Every flag has an environment variable (``DELTAD_<FLAG>``, e.g. ``DELTAD_REDIS_URL``). When
ready it prints exactly one line to stdout, ``serving <model> rank <r> on <host:port>`` (with
``--log-json``: that text as the ``msg`` of one JSON object); errors go to stderr with exit
code 2. torch is imported only when the server starts.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from deltad import output, perf
from deltad.config import RELAY_RANGES, SERVER_FLAG_DESTS, SERVER_RANGES, Range
from deltad.errors import ConfigError
from deltad.signals import handle_signals

#: Every numeric flag's range (by argparse dest; the ServerConfig field's, checked again
#: there for values from the environment).
RANGES: dict[str, Range] = {
    **{SERVER_FLAG_DESTS[field]: rng for field, rng in SERVER_RANGES.items()},
    "upstream_long_poll": RELAY_RANGES["long_poll_s"],
}


def _env(name: str, default: Any = None) -> Any:
    return os.environ.get(f"DELTAD_{name}", default)


class EnvValue:
    """A flag's value taken from ``DELTAD_<NAME>``, converted (and checked) by
    :func:`value` so that a bad one is reported naming the variable, in one line."""

    def __init__(self, name: str, raw: str, kind: Any) -> None:
        self.name, self.raw, self.kind = name, raw, kind

    def __repr__(self) -> str:
        return f"{self.raw} (from ${self.name})"


def _typed_env(name: str, kind: Any, default: Any) -> Any:
    raw = os.environ.get(f"DELTAD_{name}")
    return default if raw is None else EnvValue(f"DELTAD_{name}", raw, kind)


def value(v: Any) -> Any:
    """A parsed flag's value; one from the environment converted here (ConfigError naming
    the variable if it does not convert)."""
    if not isinstance(v, EnvValue):
        return v
    try:
        return v.kind(v.raw)
    except (TypeError, ValueError):
        kind = getattr(v.kind, "__name__", str(v.kind))
        raise ConfigError(f"{v.name}={v.raw[:64]!r} is not a valid {kind}") from None


def _env_flag(
    p: argparse.ArgumentParser, flag: str, text: str, default: Any = None, **kw: Any
) -> None:
    """A text flag ``--flag`` whose default is ``$DELTAD_<FLAG>`` (else ``default``), the
    variable named at the end of its help."""
    env = flag.upper().replace("-", "_")
    p.add_argument(f"--{flag}", default=_env(env, default), help=f"{text} [DELTAD_{env}]", **kw)


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    _env_flag(
        p,
        "spool",
        "spool directory shared with the trainer (it, or at least its parent, must exist)",
    )
    _env_flag(p, "model", "model name", "model")
    a(
        "--rank",
        type=int,
        default=_typed_env("RANK", int, 0),
        help="trainer rank served [DELTAD_RANK]",
    )
    for flag, fallback, text in (
        ("listen", "127.0.0.1:50051", "host:port, port 0..65535 (0: any free one)"),
        ("advertise", None, "endpoint registered in Redis"),
        (
            "redis-url",
            None,
            "redis:// or rediss://[user:password@]host:port/db (a CA for rediss: append "
            "?ssl_ca_certs=/path/ca.pem), redis+sentinel://[:password@]h1:26379,h2:26379/MASTER"
            "[/db][?sentinel_password=..&min_replicas=1] or redis+cluster://[:password@]h1:7000,"
            "h2:7001; unset: embedded Redis in the spool",
        ),
        (
            "tls-cert",
            None,
            "server certificate (PEM); it, the key and the client CA are reloaded on SIGHUP "
            "or when they change",
        ),
        ("tls-key", None, "server private key (PEM)"),
        ("tls-client-ca", None, "require client certificates signed by this CA (mTLS)"),
        (
            "tokens-file",
            None,
            "scoped credentials, one 'TOKEN CONSUMERS ROLES' per line (TOKEN 'mtls:<CN>' "
            "binds a client certificate; reloaded on SIGHUP or when it changes)",
        ),
    ):
        _env_flag(p, flag, text, fallback)
    cores = perf.usable_cores()
    prefetch = perf.default_prefetch_messages(cores)
    for flag, kind, default, text in (
        ("max-concurrent-streams", int, 64, "GetDelta streams at once (more wait in line)"),
        ("max-queued-streams", int, 64, "GetDelta calls waiting in line for a stream slot"),
        (
            "stream-queue-wait",
            float,
            10.0,
            "seconds one may wait in line (then RESOURCE_EXHAUSTED with a retry hint)",
        ),
        (
            "max-consumers",
            int,
            10000,
            "consumer names the offset store may know (new ones beyond: RESOURCE_EXHAUSTED, "
            "nothing stored; 0 = no limit)",
        ),
        ("max-message-bytes", int, 16 << 20, "largest request / message in bytes"),
        ("chunk-bytes", int, 2 << 20, "default RowChunk size in bytes"),
        (
            "stream-deadline",
            float,
            3600.0,
            "seconds one GetDelta stream may run (then DEADLINE_EXCEEDED; a stream whose client "
            "stopped reading is cancelled 1 s later); a relay's mirror pull from its upstream "
            "too",
        ),
        (
            "stream-stall",
            float,
            60.0,
            "seconds a GetDelta stream may send nothing (its client stopped reading) before it "
            "is cancelled and its slot freed",
        ),
        ("lease-ttl", float, 30.0, "default consumer lease in seconds"),
        ("poll-interval", float, 0.05, "seconds between spool scans"),
        ("grace-period", float, 10.0, "seconds streams may finish after SIGTERM"),
        ("window-cache-entries", int, 8, "encoded windows kept for consumers at one cursor"),
        ("window-cache-bytes", int, 1 << 30, "byte budget of those windows"),
        (
            "run-cache-bytes",
            int,
            512 << 20,
            "byte budget of pre-merged runs of deltas (windows at any cursor; 0 = off)",
        ),
        (
            "packed-cache-bytes",
            int,
            512 << 20,
            "byte budget of rows kept packed (packed-int8/int4/fp16 wire dtypes), made once "
            "per row version instead of once per pull (0 = pack per pull; at most 1 TiB)",
        ),
        (
            "prefetch-messages",
            int,
            prefetch,
            "GetDelta chunk messages a producer thread builds ahead of the one being sent, "
            "for windows being merged in fp32/fp16/bf16/int8 (0..64; 0 = build each as gRPC "
            f"asks for it; default {perf.PREFETCH_MESSAGES} with at least "
            f"{perf.PREFETCH_MIN_CORES} usable cores, else 0; here {cores} usable, so "
            f"{prefetch})",
        ),
        ("prefetch-bytes", int, 64 << 20, "byte bound of those prefetched messages (1..1 GiB)"),
        (
            "generation-keep",
            float,
            600.0,
            "seconds the previous generation's log stays in memory for generation diffs (0 = off)",
        ),
        (
            "generation-keep-bytes",
            int,
            4 << 30,
            "byte budget of that log (a bigger one is not kept: consumers resync)",
        ),
        (
            "spill-max-bytes",
            int,
            8 << 30,
            "disk bytes of the merged base spilled to an unnamed file in the spool, for "
            "bootstraps bigger than the window cache (0 = off)",
        ),
        ("merge-min-segments", int, 4, "retention: merge runs of at least this many segments"),
        (
            "restore-window-steps",
            int,
            0,
            "rollback: keep the state of every segment within this many steps of the head "
            "(restore points retention never merges away; 0 = off)",
        ),
        (
            "restore-window-seconds",
            float,
            0.0,
            "rollback: ... and of every segment published within this many seconds (0 = off)",
        ),
        ("retention-interval", float, 1.0, "seconds between retention rounds"),
        (
            "owed-max-bytes",
            int,
            4 << 30,
            "disk bytes of owed rows (top-k consumers' files in the spool) over all consumers; "
            "a pull past it is refused with RESOURCE_EXHAUSTED (0 = no bound)",
        ),
        (
            "owed-max-consumer-bytes",
            int,
            1 << 30,
            "the same per consumer (0 = no bound)",
        ),
        (
            "archive-lag-bound",
            float,
            300.0,
            "the archive's health (deltad.v1.Archive) is NOT_SERVING while the oldest segment "
            "it lacks is older than this many seconds",
        ),
        (
            "archive-gc-grace",
            float,
            600.0,
            "retention in the archive: delete this rank's objects no manifest has named for "
            "this many seconds (merged away, older generations; 0 = never delete)",
        ),
        (
            "archive-base-deltas",
            float,
            1.0,
            "the archive keeps its own base and the deltas after it, and uploads a fresh base "
            "once those deltas reach this fraction of the base's bytes (0: whenever the served "
            "base moves)",
        ),
        (
            "archive-base-every",
            float,
            3600.0,
            "... or once the archived base is this many seconds old",
        ),
        (
            "forget-after",
            float,
            7 * 24 * 3600.0,
            "forget a consumer (cursors, owed rows) this many seconds after its lease "
            "expired and it went silent; it comes back as new (0 = never)",
        ),
    ):
        env = flag.upper().replace("-", "_")
        # a default from the environment is converted, and checked, by value()
        a(
            f"--{flag}",
            type=kind,
            default=_typed_env(env, kind, default),
            help=f"{text} [DELTAD_{env}]",
        )
    # rollout-control (issue 21): the validation gate's optional limits
    a(
        "--gate-max-norm-jump",
        action="append",
        default=[x for x in (_env("GATE_MAX_NORM_JUMP") or "").split(",") if x],
        metavar="[TABLE=]X",
        help="validation gate: fail a segment in which a row's norm jumps by more than X "
        "against its previous value (per table, or every table; repeatable; non-finite values "
        "always fail) [DELTAD_GATE_MAX_NORM_JUMP, comma-separated]",
    )
    a(
        "--gate-max-changed-fraction",
        action="append",
        default=[x for x in (_env("GATE_MAX_CHANGED_FRACTION") or "").split(",") if x],
        metavar="[TABLE=]F",
        help="validation gate: fail a segment that changes more than this fraction of a "
        "table's rows on this rank (repeatable) [DELTAD_GATE_MAX_CHANGED_FRACTION]",
    )
    # relay: the upstream it mirrors, and the relay's credentials there
    for flag, text in (
        (
            "upstream",
            "run as a relay: mirror this rank's log from the sidecar or relay at host:port "
            "(token: DELTAD_UPSTREAM_TOKEN)",
        ),
        (
            "upstream-consumer",
            "the relay's consumer name at the upstream (default relay-<hostname>)",
        ),
        ("upstream-tls-ca", "CA (PEM) of the upstream's TLS certificate"),
        (
            "upstream-tls-cert",
            "the relay's client certificate (PEM) for an upstream that requires mTLS; "
            "re-read when it changes",
        ),
        ("upstream-tls-key", "the key of --upstream-tls-cert"),
        (
            "upstream-token-file",
            "file holding the upstream's bearer token (instead of DELTAD_UPSTREAM_TOKEN); "
            "re-read when it changes",
        ),
    ):
        _env_flag(p, flag, text)
    a(
        "--upstream-long-poll",
        type=float,
        default=_typed_env("UPSTREAM_LONG_POLL", float, 10.0),
        metavar="SECONDS",
        help="longest wait of one long-polling Status call at the upstream, which answers as "
        "soon as its head moves (0: poll every 50 ms instead) [DELTAD_UPSTREAM_LONG_POLL]",
    )
    a(
        "--metrics-port",
        type=int,
        default=_typed_env("METRICS_PORT", int, None),
        help="serve Prometheus /metrics on this port [DELTAD_METRICS_PORT]",
    )
    _env_flag(
        p, "metrics-listen", "host /metrics binds to (default: the --listen host)", metavar="HOST"
    )
    _env_flag(
        p,
        "archive",
        "copy the verified log to this object store and restore an empty spool from it: "
        "s3://BUCKET/PREFIX (credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or "
        "AWS_SHARED_CREDENTIALS_FILE) or file:///shared/mount",
        metavar="URL",
    )
    _env_flag(
        p,
        "archive-endpoint",
        "an S3-compatible server for an s3:// --archive or --upstream-archive",
        metavar="URL",
    )
    _env_flag(
        p,
        "upstream-archive",
        "run as a relay that follows the rank's log in this object store instead of an "
        "upstream sidecar (another region, a replicated bucket): s3://BUCKET/PREFIX or "
        "file:///shared/mount; the release state archived with the log is applied",
        metavar="URL",
    )


def _no_plain_tokens() -> None:
    if _env("TOKENS"):
        raise ConfigError(
            "DELTAD_TOKENS (unscoped tokens) is no longer accepted: put each token in "
            "--tokens-file as 'TOKEN CONSUMERS ROLES'"
        )


def build_config(args: argparse.Namespace) -> Any:
    """ServerConfig from parsed flags (ConfigError on bad values)."""
    from deltad.config import GateConfig, ServerConfig

    if not args.spool:
        raise ConfigError("--spool (or DELTAD_SPOOL) is required")
    _no_plain_tokens()

    def path(v: str | None) -> Path | None:
        return Path(v) if v else None

    return ServerConfig(
        spool_dir=Path(args.spool),
        model=args.model,
        rank=value(args.rank),
        listen=args.listen,
        redis_url=args.redis_url or None,
        advertise=args.advertise,
        tls_cert=path(args.tls_cert),
        tls_key=path(args.tls_key),
        tls_client_ca=path(args.tls_client_ca),
        tokens_file=path(args.tokens_file),
        max_consumers=value(args.max_consumers),
        max_concurrent_streams=value(args.max_concurrent_streams),
        max_message_bytes=value(args.max_message_bytes),
        chunk_bytes=value(args.chunk_bytes),
        stream_deadline_s=value(args.stream_deadline),
        stream_stall_s=value(args.stream_stall),
        lease_ttl_s=value(args.lease_ttl),
        poll_interval_s=value(args.poll_interval),
        grace_period_s=value(args.grace_period),
        metrics_port=value(args.metrics_port),
        metrics_listen=args.metrics_listen or None,
        window_cache_entries=value(args.window_cache_entries),
        window_cache_bytes=value(args.window_cache_bytes),
        run_cache_bytes=value(args.run_cache_bytes),
        packed_cache_bytes=value(args.packed_cache_bytes),
        prefetch_messages=value(args.prefetch_messages),
        prefetch_bytes=value(args.prefetch_bytes),
        generation_keep_s=value(args.generation_keep),
        generation_keep_bytes=value(args.generation_keep_bytes),
        spill_max_bytes=value(args.spill_max_bytes),
        merge_min_segments=value(args.merge_min_segments),
        restore_window_steps=value(args.restore_window_steps),
        restore_window_s=value(args.restore_window_seconds),
        retention_interval_s=value(args.retention_interval),
        forget_after_s=value(args.forget_after),
        owed_max_bytes=value(args.owed_max_bytes),
        owed_max_consumer_bytes=value(args.owed_max_consumer_bytes),
        archive_url=args.archive or None,
        # (with --upstream-archive, the endpoint is that store's: ArchiveFollowConfig)
        archive_endpoint=None if args.upstream_archive else (args.archive_endpoint or None),
        archive_lag_bound_s=value(args.archive_lag_bound),
        archive_gc_grace_s=value(args.archive_gc_grace),
        archive_base_deltas=value(args.archive_base_deltas),
        archive_base_every_s=value(args.archive_base_every),
        max_queued_streams=value(args.max_queued_streams),
        stream_queue_wait_s=value(args.stream_queue_wait),
        gate=GateConfig(
            max_norm_jump=GateConfig.parse(args.gate_max_norm_jump, "gate-max-norm-jump"),
            max_changed_fraction=GateConfig.parse(
                args.gate_max_changed_fraction, "gate-max-changed-fraction"
            ),
        ),
    )


def build_follow_config(args: argparse.Namespace) -> Any:
    """ArchiveFollowConfig from parsed flags, or None without --upstream-archive (ConfigError
    on bad values or with --upstream / --archive)."""
    if not args.upstream_archive:
        return None
    from deltad.config import ArchiveFollowConfig

    if args.upstream:
        raise ConfigError("--upstream-archive and --upstream: a relay follows one of them")
    if args.archive:
        raise ConfigError(
            "--upstream-archive and --archive: a relay following the archive does not write it"
        )
    return ArchiveFollowConfig(args.upstream_archive, endpoint=args.archive_endpoint or None)


def build_relay_config(args: argparse.Namespace) -> Any:
    """RelayConfig from parsed flags, or None without --upstream (ConfigError on bad values)."""
    if not args.upstream:
        return None
    import re
    import socket

    from deltad.config import RelayConfig

    name = args.upstream_consumer or "relay-" + re.sub(
        r"[^A-Za-z0-9_.-]", "-", socket.gethostname()
    )
    return RelayConfig(
        upstream=args.upstream,
        consumer=name[:128],
        token=None if args.upstream_token_file else (_env("UPSTREAM_TOKEN") or None),
        token_file=Path(args.upstream_token_file) if args.upstream_token_file else None,
        tls_ca=Path(args.upstream_tls_ca) if args.upstream_tls_ca else None,
        tls_cert=Path(args.upstream_tls_cert) if args.upstream_tls_cert else None,
        tls_key=Path(args.upstream_tls_key) if args.upstream_tls_key else None,
        long_poll_s=value(args.upstream_long_poll),
        stream_deadline_s=value(args.stream_deadline),
    )


def run(args: argparse.Namespace) -> int:
    # Allocator settings, before torch loads: merged windows and encoded chunks are fresh
    # multi-MB buffers and page faults dominate otherwise.
    from deltad.perf import tune_malloc, tune_threads

    tune_malloc()
    tune_threads()
    from deltad.serve.edge.app import SidecarServer

    config = build_config(args)
    stop, reload = threading.Event(), threading.Event()
    relay = build_relay_config(args)
    follow = build_follow_config(args)

    # SIGHUP: the loop below re-reads the tokens and TLS files within 0.5 s
    actions = {
        signal.SIGTERM: lambda _: stop.set(),
        signal.SIGINT: lambda _: stop.set(),
        signal.SIGHUP: lambda _: reload.set(),
    }
    with handle_signals(actions):
        server: Any
        if relay is not None:
            from deltad.serve.relay.server import RelayServer

            server = RelayServer(config, relay)
        elif follow is not None:
            from deltad.serve.relay.archived import ArchiveRelayServer

            server = ArchiveRelayServer(config, follow)
        else:
            server = SidecarServer(config)
        server.start()
        try:
            output.line(
                f"serving {config.model} rank {config.rank} on {server.endpoint}", file=sys.stdout
            )
            while not stop.wait(0.5):
                if reload.is_set():
                    reload.clear()
                    server.reload_credentials()  # logs what it did, once
                if server.wait(0):
                    break
            output.line(f"deltad serve: stopping (grace {config.grace_period_s}s)")
        finally:  # (whatever ends the loop: the server and the Redis it embeds stop)
            server.stop(config.grace_period_s)
    if getattr(server, "error", None) is not None:
        return 2  # the relay logged why it stopped
    return 0
