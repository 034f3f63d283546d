"""Configuration dataclasses for every deltad component, in one place.

Each component takes its config object; the CLI builds them from flags and env vars.
Validation happens in ``__post_init__`` and raises :class:`deltad.errors.ConfigError`.
"""

from __future__ import annotations

import enum
import os
import re
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TypeVar

from deltad import perf
from deltad.errors import ConfigError
from deltad.types import Form, TrainLoop, WireDtype

_E = TypeVar("_E", bound=enum.Enum)

#: Model and consumer names: what may appear in Redis keys, file names and metric labels.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


def check_name(kind: str, value: str) -> str:
    """Return ``value`` if it is a valid model/consumer name, else raise ConfigError."""
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise ConfigError(
            f"invalid {kind} name {clip(value)}: 1-128 chars of [A-Za-z0-9_.-], starting "
            "alphanumeric"
        )
    return value


REDIS_SCHEMES = ("redis", "rediss", "unix")
#: The largest --packed-cache-bytes accepted (1 TiB: a typo in a byte count, not a budget).
MAX_PACKED_CACHE_BYTES = 1 << 40
#: A Sentinel-managed master: ``redis+sentinel://[[user]:password@]host:port[,host:port...]
#: /<service>[/<db>][?sentinel_password=...&ssl_ca_certs=...]`` (the hosts are the
#: sentinels; the password is the data nodes', ``sentinel_password`` the sentinels'). A commit
#: is acknowledged once ``min_replicas`` replicas (default 1, 0: none) have it (Redis WAIT),
#: so a failover to a replica loses no committed cursor.
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
#: A Redis Cluster: ``redis+cluster://[[user]:password@]host:port[,host:port...][/0]
#: [?ssl_ca_certs=...]`` (the hosts are startup nodes; a cluster has database 0 only).
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


@dataclass(frozen=True)
class RedisNodesUrl:
    """A parsed Sentinel or Cluster URL (see :data:`SENTINEL_SCHEMES`, :data:`CLUSTER_SCHEMES`)."""

    kind: str  # "sentinel" or "cluster"
    tls: bool
    nodes: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    service: str
    db: int
    options: dict[str, str]


def parse_nodes_url(url: str) -> RedisNodesUrl:
    """Parse a ``redis+sentinel://`` or ``redis+cluster://`` URL; ConfigError naming what is
    wrong (never the password)."""
    from urllib.parse import parse_qsl, unquote

    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SENTINEL_SCHEMES + CLUSTER_SCHEMES:
        raise ConfigError(f"not a Sentinel or Cluster Redis URL: scheme {scheme!r:.20}")
    kind = "sentinel" if scheme in SENTINEL_SCHEMES else "cluster"
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    auth, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = auth.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    nodes = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        host = host.strip("[]")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"invalid {kind} Redis URL: each node is host:port, not {item!r:.40}")
        nodes.append((host, int(port)))
    parts = [p for p in path.split("/") if p]
    service = ""
    if kind == "sentinel":
        if not parts:
            raise ConfigError(
                "invalid sentinel Redis URL: name the master after the hosts "
                "(redis+sentinel://h1:26379,h2:26379/mymaster/0)"
            )
        service, parts = parts[0], parts[1:]
    if len(parts) > 1 or (parts and not (parts[0].isascii() and parts[0].isdigit())):
        raise ConfigError(f"invalid {kind} Redis URL: db must be a number, not {path[:20]!r}")
    db = int(parts[0]) if parts else 0
    replicas = options_min_replicas(query)
    if replicas is not None and kind != "sentinel":
        raise ConfigError("invalid cluster Redis URL: min_replicas is a Sentinel option")
    if kind == "cluster" and db != 0:
        raise ConfigError("invalid cluster Redis URL: a Redis Cluster has database 0 only")
    options = dict(parse_qsl(query))
    known = {"sentinel_password", "sentinel_username", "ssl_ca_certs", "min_replicas"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"invalid {kind} Redis URL: unknown options {unknown}"[:200])
    return RedisNodesUrl(
        kind, scheme.startswith("rediss"), tuple(nodes), username, password, service, db, options
    )


def options_min_replicas(query: str) -> int | None:
    """The ``min_replicas`` option of a URL's query, if given (ConfigError unless 0..16)."""
    from urllib.parse import parse_qs

    raw = parse_qs(query).get("min_replicas")
    if not raw:
        return None
    if not raw[-1].isascii() or not raw[-1].isdigit() or int(raw[-1]) > 16:
        raise ConfigError(f"invalid Redis URL: min_replicas must be 0..16, not {raw[-1][:10]!r}")
    return int(raw[-1])


def check_redis_url(url: str) -> str:
    """Return ``url`` if it is a usable Redis URL (redis://, rediss://, unix://, with an
    integer db if any; or a Sentinel or Cluster URL, see :func:`parse_nodes_url`), else raise
    ConfigError naming what is wrong (never the password)."""
    from urllib.parse import parse_qs, urlsplit

    if url.partition("://")[0] in SENTINEL_SCHEMES + CLUSTER_SCHEMES:
        parse_nodes_url(url)
        return url

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ConfigError(f"invalid Redis URL: {e}") from None
    if parts.scheme not in REDIS_SCHEMES:
        raise ConfigError(
            f"invalid Redis URL scheme {parts.scheme!r:.20}: use redis://, rediss://, unix://, "
            "redis+sentinel:// or redis+cluster://"
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ConfigError("invalid Redis URL: no host (redis://host:port/db)")
    if parts.scheme == "unix" and not parts.path:
        raise ConfigError("invalid Redis URL: no socket path (unix:///path/to/redis.sock)")
    dbs = parse_qs(parts.query).get("db", [])
    if parts.scheme != "unix" and parts.path.strip("/"):
        dbs.append(parts.path.strip("/"))
    for db in dbs:
        if not db.isascii() or not db.isdigit():
            raise ConfigError(f"invalid Redis URL: db must be a number, not {db[:20]!r}")
    del port
    return url


#: HOST:PORT, with gRPC's target prefixes (``dns:///``, ``ipv4:``, ``ipv6:``) and IPv6
#: literals in brackets
_ENDPOINT = re.compile(
    r"(?:(?:dns:(?://[^/]*/)?)|ipv4:|ipv6:)?(\[[0-9A-Fa-f:.%a-z]+\]|[^\s:/\[\]]+):(\d{1,5})"
)


def check_endpoint(what: str, value: str, *, listen: bool = False) -> str:
    """``value`` if it is HOST:PORT with a port in 1..65535 (0..65535 for an address to
    listen on: 0 takes any free port), else ConfigError naming ``what``: gRPC would take
    port 99999 as 34463 (modulo 65536), a typo that reaches another server. gRPC's target
    prefixes (``dns:///``, ``ipv4:``, ``ipv6:``) and ``[IPv6]:PORT`` are accepted; a Unix
    socket (``unix:PATH``, not for ``listen``) as it is."""
    if isinstance(value, str) and value.startswith("unix:") and len(value) > 5 and not listen:
        return value
    m = _ENDPOINT.fullmatch(value) if isinstance(value, str) else None
    low = 0 if listen else 1
    if m is None or not low <= int(m.group(2)) <= 65535:
        raise ConfigError(
            f"{what} must be HOST:PORT with a port in {low}..65535, not {clip(value)}"
        )
    return value


def clip(value: object, limit: int = 64) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for error messages that echo input
    (a status message must stay far below gRPC's metadata limit, whatever a client sent)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: finite, ``lo`` <= v (< v if ``lo_open``) <= ``hi``."""

    lo: float
    hi: float
    lo_open: bool = False
    #: what the low end means, for the message (e.g. "0 = off")
    note: str = ""
    #: only an ``int`` (not a bool, not a float such as 2.5) is accepted
    integer: bool = False

    def text(self) -> str:
        left = "(" if self.lo_open else "["
        note = f"; {self.note}" if self.note else ""
        if self.integer:
            return f"an integer in {left}{int(self.lo)}, {int(self.hi)}]{note}"
        return f"a finite number in {left}{self.lo:g}, {self.hi:g}]{note}"


#: Common upper bounds: a byte budget (1 PiB), seconds (a year), counts.
MAX_BYTES = float(1 << 50)
MAX_SECONDS = 365 * 24 * 3600.0
MAX_COUNT = float(1 << 31)


def check_number(name: str, value: object, rng: Range) -> None:
    """The one range check of every numeric flag, env var and config field: ConfigError
    naming ``name`` unless ``value`` is a finite number within ``rng`` (nan, inf, negative
    and huge values are refused here, not found later as a crash or a hot loop)."""
    import math

    if value is None:
        return
    kinds = int if rng.integer else int | float
    ok = isinstance(value, kinds) and not isinstance(value, bool)
    if ok and isinstance(value, float):
        ok = math.isfinite(value)
    if ok:  # an int is compared as it is (float() of a huge one would overflow)
        v: float = value  # type: ignore[assignment]
        ok = (v > rng.lo if rng.lo_open else v >= rng.lo) and v <= rng.hi
    if not ok:
        raise ConfigError(f"{name} must be {rng.text()}, not {clip(value, 32)}")


def check_numbers(
    obj: object, ranges: dict[str, Range], names: dict[str, str] | None = None
) -> None:
    """:func:`check_number` over the attributes of ``obj`` named in ``ranges`` (a config
    dataclass, or parsed flags); ``names`` maps an attribute to the name to report."""
    for attr, rng in ranges.items():
        check_number((names or {}).get(attr, attr), getattr(obj, attr), rng)


def check_bool(name: str, value: object) -> None:
    """ConfigError naming ``name`` unless ``value`` is a bool (a string such as "no" is
    truthy: taken as True it would silently switch something on)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, not {clip(value, 32)}")


def check_names(name: str, value: object) -> tuple[str, ...]:
    """``value`` (a tuple or list of strings) as a tuple; ConfigError naming ``name`` for a
    single string (which would become a tuple of its characters) or a non-string item."""
    if isinstance(value, str | bytes):
        raise ConfigError(
            f"{name} must be a tuple or list of strings, not the single string {clip(value, 32)}"
            f": write ({clip(value, 32)},)"
        )
    if not isinstance(value, Iterable):
        raise ConfigError(f"{name} must be a tuple or list of strings, not {clip(value, 32)}")
    items = tuple(value)
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"{name} must hold strings only, not {clip(item, 32)}")
    return items


def check_choice(name: str, value: object, kind: type[_E]) -> _E:
    """``value`` as a member of the enum ``kind`` (a member, or its value such as "topk");
    ConfigError naming ``name`` and the choices otherwise."""
    try:
        return kind(value)
    except (ValueError, TypeError):
        choices = [m.value for m in kind]  # type: ignore[attr-defined]
        raise ConfigError(f"{name} {clip(value, 32)} is not one of {choices}") from None


@dataclass
class TrackerConfig:
    """How the trainer-side tracker records touched rows."""

    #: Module FQNs (or parts of them) not to track.
    fqns_to_skip: tuple[str, ...] = ()
    #: The train loop; decides how many lookups run ahead of the optimizer (see TrainLoop).
    train_loop: TrainLoop = TrainLoop.PLAIN
    # Tunables (fold thread, its queue): deltad.knobs.

    def __post_init__(self) -> None:
        self.fqns_to_skip = check_names("fqns_to_skip", self.fqns_to_skip)
        self.train_loop = check_choice("train_loop", self.train_loop, TrainLoop)


@dataclass
class PublisherConfig:
    """When and where the trainer publishes segments."""

    spool_dir: Path
    model: str = "model"
    #: The train loop (plain or a torchrec pipeline); decides how many lookups run ahead of
    #: the optimizer, whose rows the publisher keeps owed (see TrainLoop).
    train_loop: TrainLoop = TrainLoop.PLAIN
    #: Sharded module FQNs (or parts of them) not to track.
    fqns_to_skip: tuple[str, ...] = ()
    #: Publish every N steps (0 = off). At least one of every_steps / every_seconds is set.
    every_steps: int = 0
    #: Publish when this many seconds have passed since the last segment (0 = off).
    every_seconds: float = 0.0
    #: Generation id, larger than every generation already in the spool (a smaller or equal
    #: one is refused at start); None = max(time_ns, newest + 1), chosen by rank 0.
    generation: int | None = None
    #: Segments copied but not yet written before the training loop blocks (backpressure).
    max_pending_writes: int = 2
    #: fsync segment files and their directory (off only for benchmarks on tmpfs).
    fsync: bool = True
    # Tunables (writer thread niceness, copy-buffer reuse): deltad.knobs.
    #: CPU weights: read the drained ids and copy the rows on a background thread while the
    #: next forward runs; the next backward waits for it before any row is updated (see
    #: deltad.publish.publisher). Off: the loop copies at the boundary. Device weights always copy
    #: in the loop (asynchronously on the device). Turn it off if something writes tracked
    #: weights outside the backward pass between publishes, or call wait_copied() first.
    copy_in_background: bool = True
    #: Rank 0 also publishes the model's dense parameters and buffers (everything that is
    #: not a sharded embedding table; replicated, so once) with a segment, taken at the same
    #: drain point, so a predictor serves rows and dense weights of one step.
    publish_dense: bool = True
    #: Dense with a segment once this many steps / seconds passed since the last dense state
    #: (both 0, the default: with every segment). The base and the final segment always
    #: carry one. Consumers that want dense align on steps that have one.
    dense_every_steps: int = 0
    dense_every_seconds: float = 0.0
    #: After a failed write (spool full, I/O error) or a sidecar's request for a fresh base
    #: (a segment it quarantined or misses), the next publish writes a fresh base of the rank
    #: instead of a delta; while that fails, retry at most this often (seconds). Training
    #: never stops for it.
    rebase_retry_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.spool_dir, str | os.PathLike) or not str(self.spool_dir):
            raise ConfigError(f"spool_dir must be a path, not {clip(self.spool_dir, 32)}")
        self.spool_dir = Path(self.spool_dir)
        if not self.spool_dir.exists() and not self.spool_dir.parent.exists():
            # a typo makes nothing (as `deltad serve --spool`): only the last level is created
            raise ConfigError(
                f"spool_dir (--spool) {self.spool_dir}: neither it nor its parent directory exists (the "
                "publisher creates the spool directory itself at most)"
            )
        self.train_loop = check_choice("train_loop", self.train_loop, TrainLoop)
        self.fqns_to_skip = check_names("fqns_to_skip", self.fqns_to_skip)
        check_name("model", self.model)
        check_numbers(self, PUBLISHER_RANGES)
        if self.every_steps == 0 and self.every_seconds == 0:
            raise ConfigError("set every_steps or every_seconds (or both)")
        if self.generation is not None and (
            not isinstance(self.generation, int) or isinstance(self.generation, bool)
        ):
            raise ConfigError(f"generation must be an int or None, not {clip(self.generation, 32)}")
        for flag in ("fsync", "copy_in_background", "publish_dense"):
            check_bool(flag, getattr(self, flag))


#: PublisherConfig's numeric fields and their ranges.
PUBLISHER_RANGES: dict[str, Range] = {
    "every_steps": Range(0, MAX_COUNT, note="0 = off", integer=True),
    "every_seconds": Range(0, MAX_SECONDS, note="0 = off"),
    "max_pending_writes": Range(1, 1024, integer=True),
    "dense_every_steps": Range(0, MAX_COUNT, note="0 = with every segment", integer=True),
    "dense_every_seconds": Range(0, MAX_SECONDS, note="0 = with every segment"),
    "rebase_retry_s": Range(0, 86400),
}


def check_client_auth(
    prefix: str,
    token: str | None,
    token_file: Path | str | None,
    tls_ca: Path | str | None,
    tls_cert: Path | str | None,
    tls_key: Path | str | None,
) -> tuple[Path | None, Path | None, Path | None, Path | None]:
    """A client's credential settings as Paths (ca, cert, key, token file); ConfigError if
    the certificate comes without its key (or the reverse) or both token forms are set."""

    def name(field: str) -> str:
        return f"--{field.replace('_', '-')}" if prefix == "--" else prefix + field

    if (tls_cert is None) != (tls_key is None):
        raise ConfigError(f"{name('tls_cert')} and {name('tls_key')} go together")
    if token and token_file is not None:
        raise ConfigError(f"give {name('token')} or {name('token_file')}, not both")

    def path(p: Path | str | None) -> Path | None:
        return None if p is None else Path(p)

    return path(tls_ca), path(tls_cert), path(tls_key), path(token_file)


@dataclass(frozen=True)
class GateConfig:
    """The validation gate's optional per-table limits (deltad.serve.index.gate); non-finite
    values are refused always. Each limit is ``((table or "*", value), ...)``: the table's own
    entry wins over "*"; no entry: no limit."""

    #: the largest jump | ||new row|| - ||old row|| | of any row of a segment
    max_norm_jump: tuple[tuple[str, float], ...] = ()
    #: the largest fraction of a table's rows (on this rank) one segment may change
    max_changed_fraction: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        for what, limits in (
            ("max_norm_jump", self.max_norm_jump),
            ("max_changed_fraction", self.max_changed_fraction),
        ):
            for table, value in limits:
                if not table or not (value > 0):
                    raise ConfigError(
                        f"gate {what}: {table}={value}: a table (or *) and a value > 0"
                    )
                if what == "max_changed_fraction" and value > 1:
                    raise ConfigError(f"gate {what}: {table}={value}: a fraction in (0, 1]")

    @staticmethod
    def limit(limits: tuple[tuple[str, float], ...], table: str) -> float | None:
        """The limit of ``table`` in ``limits`` (its own entry, else "*", else None)."""
        own = [v for t, v in limits if t == table]
        if own:
            return own[-1]
        star = [v for t, v in limits if t == "*"]
        return star[-1] if star else None

    @staticmethod
    def parse(items: list[str] | tuple[str, ...], what: str) -> tuple[tuple[str, float], ...]:
        """``TABLE=VALUE`` or ``VALUE`` (every table) flags as limits; ConfigError if bad."""
        out = []
        for item in items:
            table, _, value = item.rpartition("=")
            try:
                v = float(value)
            except ValueError:
                raise ConfigError(f"--{what} {item!r}: expected [TABLE=]NUMBER") from None
            out.append((table or "*", v))
        return tuple(out)


@dataclass
class ServerConfig:
    """`deltad serve`: one sidecar per trainer rank."""

    spool_dir: Path
    model: str = "model"
    rank: int = 0
    listen: str = "127.0.0.1:50051"
    #: redis:// or rediss:// URL; None starts an embedded Redis with its data in the spool.
    redis_url: str | None = None
    #: Endpoint other processes should use to reach this sidecar (registered in Redis).
    advertise: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    #: Bearer tokens with full access (every consumer, consume and admin), for library use;
    #: sent as metadata ``authorization: Bearer <t>``. Scoped credentials: ``tokens_file``.
    tokens: tuple[str, ...] = ()
    #: Scoped credentials, ``TOKEN CONSUMERS ROLES`` per line (deltad.serve.edge.auth); reloaded
    #: on SIGHUP by `deltad serve`. Neither this nor ``tokens``: no authorization.
    tokens_file: Path | None = None
    #: Most consumer names the offset store knows (new ones beyond: RESOURCE_EXHAUSTED);
    #: 0 = no limit.
    max_consumers: int = 10000
    max_concurrent_streams: int = 64
    #: GetDelta calls that wait in line (first come first served) for one of those slots,
    #: each for up to ``stream_queue_wait_s``; past that: RESOURCE_EXHAUSTED with a retry hint.
    max_queued_streams: int = 64
    stream_queue_wait_s: float = 10.0
    max_message_bytes: int = 16 * 1024 * 1024
    chunk_bytes: int = 2 * 1024 * 1024
    #: Longest a single GetDelta stream may run before the server aborts it (a bootstrap of a
    #: big shard over a slow link runs long; a stuck one is ended by ``stream_stall_s``).
    stream_deadline_s: float = 3600.0
    #: A GetDelta stream that handed gRPC no message for this long (its client stopped
    #: reading: the stream waits for flow control) is cancelled and its slot freed.
    stream_stall_s: float = 60.0
    lease_ttl_s: float = 30.0
    poll_interval_s: float = 0.05
    grace_period_s: float = 10.0
    metrics_port: int | None = None
    #: host the /metrics endpoint binds to; None: the --listen host
    metrics_listen: str | None = None
    #: Merged windows kept for reuse by consumers at the same cursor.
    window_cache_entries: int = 8
    #: Byte budget of those cached (encoded) windows; bigger windows are not cached.
    window_cache_bytes: int = 1 << 30
    #: Byte budget of pre-merged runs of deltas (deltad.serve.index.runs: a window at any cursor is
    #: a merge of a few of them); 0: windows are merged from their segments.
    run_cache_bytes: int = 512 << 20
    #: Byte budget of the log's rows kept packed for the packed wire dtypes
    #: (deltad.serve.windows.packed: packed once per row version, not per pull); 0: every
    #: pull packs its rows.
    packed_cache_bytes: int = 512 << 20
    #: GetDelta's prefetching producer (deltad.serve.windows.prefetch): a thread builds up to
    #: this many chunk messages ahead of the one gRPC is sending (windows being merged, not
    #: cached ones nor packed dtypes: there building is only copies); 0: built in the handler
    #: thread as gRPC asks for each (no overlap of building and sending). Default: 3 where the
    #: process has at least 4 usable cores, else 0 (deltad.perf.default_prefetch_messages).
    prefetch_messages: int = field(default_factory=perf.default_prefetch_messages)
    #: ... and at most this many bytes of them (one message is always let in).
    prefetch_bytes: int = 64 << 20
    #: Generation diffs (deltad.serve.windows.gendiff): after a switch to a new generation the previous
    #: generation's log stays in memory this many seconds (its files leave the spool at the
    #: switch), so consumers still at it get only the rows that differ; 0: never kept (every
    #: consumer resyncs on a new generation).
    generation_keep_s: float = 600.0
    #: ... and only if its rows take at most this many bytes (a bigger one is not kept).
    generation_keep_bytes: int = 4 << 30
    #: Disk bytes of the merged base spilled to an unnamed file (deltad.serve.index.spill) from
    #: which bootstraps larger than the window cache stream (with runs); 0: each such
    #: bootstrap merges the base and the deltas again.
    spill_max_bytes: int = 8 << 30
    #: Retention: merge runs of at least this many segments between live cursors.
    merge_min_segments: int = 4
    #: Restore points (deltad.serve.index.restore): retention never merges away the state of a
    #: segment whose step is within this many steps of the head, or ...
    restore_window_steps: int = 0
    #: ... that was published within this many seconds; any step in the window can be
    #: rolled back to (``deltad rollout rollback``). 0 and 0: no restore window (retention
    #: merges as before; a rollback then reaches only the steps still in the log).
    restore_window_s: float = 0.0
    # Retention's bound on one round's merge input: deltad.knobs.MERGE_MAX_BYTES_PER_ROUND.
    retention_interval_s: float = 1.0
    #: Forget a consumer this long after its lease expired and it was last heard of: its
    #: cursors, pending pulls and owed rows go (0 = keep forever). Back, it is a new consumer.
    forget_after_s: float = 7 * 24 * 3600.0
    #: Seconds between forget sweeps (Redis and owed files), bounded work each.
    forget_interval_s: float = 60.0
    #: The validation gate's limits (deltad.serve.index.gate; non-finite values: always).
    gate: GateConfig = field(default_factory=GateConfig)
    #: Disk bytes of owed rows (top-k / row-capped consumers' files in the spool) over every
    #: consumer of this rank, and per consumer; a pull past either is refused
    #: (RESOURCE_EXHAUSTED), nothing written. 0: no bound.
    owed_max_bytes: int = 4 << 30
    owed_max_consumer_bytes: int = 1 << 30
    #: Object store the sidecar copies its verified log to, and restores an empty spool from
    #: (deltad.serve.archive): ``s3://bucket/prefix`` or ``file:///shared/mount``; None: none.
    #: S3 credentials come from the standard AWS environment or credentials file, never here.
    archive_url: str | None = None
    #: An S3-compatible server's URL (http(s)://host:port) for an ``s3://`` archive.
    archive_endpoint: str | None = None
    #: The archive's health service (deltad.v1.Archive) answers NOT_SERVING while the oldest
    #: segment it lacks is older than this many seconds (serving goes on regardless).
    archive_lag_bound_s: float = 300.0
    #: Retention in the store: this rank's objects that no manifest has named for this many
    #: seconds are deleted (merged away, an older generation); a cold start or restore that read
    #: an older manifest less long ago still finds every object it names. 0: never delete.
    archive_gc_grace_s: float = 600.0
    #: The archive's own base: the served log's base moves forward every few segments (its
    #: retention), but the archive keeps its base and the deltas after it, and uploads a fresh
    #: base only once those deltas reach this fraction of the base's bytes ...
    archive_base_deltas: float = 1.0
    #: ... or the archived base's state is this many seconds old (a cold start reads the
    #: base and every delta after it: these two bound what it reads beyond the base).
    archive_base_every_s: float = 3600.0

    def __post_init__(self) -> None:
        self.spool_dir = Path(self.spool_dir)
        check_name("model", self.model)
        check_endpoint("listen address (--listen, DELTAD_LISTEN)", self.listen, listen=True)
        check_numbers(self, SERVER_RANGES, SERVER_FLAG_NAMES)
        if self.chunk_bytes > self.max_message_bytes // 2:
            raise ConfigError("chunk_bytes must be at most half of max_message_bytes")
        if self.rank < 0:
            raise ConfigError("rank must be >= 0")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        if self.max_concurrent_streams < 1 or self.max_message_bytes < 1024 * 1024:
            raise ConfigError("max_concurrent_streams >= 1 and max_message_bytes >= 1 MiB")
        if self.run_cache_bytes < 0:
            raise ConfigError("run_cache_bytes must be >= 0 (0 = no runs)")
        if self.generation_keep_s < 0 or self.generation_keep_bytes < 0:
            raise ConfigError("generation_keep_s and generation_keep_bytes must be >= 0 (0 = off)")
        if self.restore_window_steps < 0 or self.restore_window_s < 0:
            raise ConfigError("restore_window_steps and restore_window_s must be >= 0 (0 = off)")
        if self.spill_max_bytes < 0:
            raise ConfigError("spill_max_bytes must be >= 0 (0 = no spill)")
        if self.archive_endpoint is not None and self.archive_url is None:
            raise ConfigError("--archive-endpoint needs --archive")
        if self.max_queued_streams < 0 or self.stream_queue_wait_s < 0:
            raise ConfigError("max_queued_streams and stream_queue_wait_s must be >= 0")
        if self.stream_deadline_s <= 0 or self.lease_ttl_s <= 0 or self.grace_period_s < 0:
            raise ConfigError("stream deadline and lease TTL must be > 0, grace period >= 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics port {self.metrics_port} is not in 0..65535")
        if self.poll_interval_s <= 0 or self.retention_interval_s <= 0:
            raise ConfigError("poll and retention intervals must be > 0 (seconds)")
        if self.merge_min_segments < 2:
            raise ConfigError("merge_min_segments must be >= 2")
        if self.forget_after_s < 0 or self.forget_interval_s <= 0:
            raise ConfigError("forget_after must be >= 0 (0 = never) and its interval > 0")
        if self.max_consumers < 0:
            raise ConfigError("max_consumers must be >= 0 (0 = no limit)")
        if self.redis_url is not None:
            check_redis_url(self.redis_url)
        self.tokens = check_names("tokens", self.tokens)
        if self.tokens_file is not None:
            self.tokens_file = Path(self.tokens_file)


#: ServerConfig's numeric fields and their ranges (flags: ``deltad serve --help``).
SERVER_RANGES: dict[str, Range] = {
    "rank": Range(0, 1 << 16),
    "max_consumers": Range(0, 1e8, note="0 = no limit"),
    "max_concurrent_streams": Range(1, 1 << 16),
    "max_queued_streams": Range(0, 1 << 20),
    "stream_queue_wait_s": Range(0, 3600),
    # gRPC keeps message sizes in a signed 32-bit int
    "max_message_bytes": Range(1 << 20, (1 << 31) - 1),
    "chunk_bytes": Range(1024, 1 << 30),
    "stream_deadline_s": Range(0, 7 * 24 * 3600, lo_open=True),
    "stream_stall_s": Range(0, 7 * 24 * 3600, lo_open=True),
    "lease_ttl_s": Range(0, 86400, lo_open=True),
    "poll_interval_s": Range(0.001, 60),
    "grace_period_s": Range(0, 3600),
    "metrics_port": Range(0, 65535),
    "window_cache_entries": Range(0, 1 << 20),
    "window_cache_bytes": Range(0, MAX_BYTES),
    "run_cache_bytes": Range(0, MAX_BYTES, note="0 = off"),
    "packed_cache_bytes": Range(0, MAX_PACKED_CACHE_BYTES, note="0 = pack per pull"),
    "prefetch_messages": Range(0, 64, note="0 = off"),
    "prefetch_bytes": Range(1, 1 << 30),
    "generation_keep_s": Range(0, MAX_SECONDS, note="0 = off"),
    "generation_keep_bytes": Range(0, MAX_BYTES),
    "spill_max_bytes": Range(0, MAX_BYTES, note="0 = off"),
    "merge_min_segments": Range(2, 1 << 20),
    "retention_interval_s": Range(0.001, MAX_SECONDS),
    "forget_after_s": Range(0, 100 * MAX_SECONDS, note="0 = never"),
    "forget_interval_s": Range(0.001, 86400),
    "restore_window_steps": Range(0, MAX_COUNT, note="0 = off"),
    "restore_window_s": Range(0, MAX_SECONDS, note="0 = off"),
    "owed_max_bytes": Range(0, MAX_BYTES, note="0 = no bound"),
    "owed_max_consumer_bytes": Range(0, MAX_BYTES, note="0 = no bound"),
    "archive_lag_bound_s": Range(0, MAX_SECONDS, lo_open=True),
    "archive_gc_grace_s": Range(0, MAX_SECONDS, note="0 = never delete"),
    "archive_base_deltas": Range(0, 1000, note="0 = a fresh base whenever the served one moves"),
    "archive_base_every_s": Range(0, MAX_SECONDS, lo_open=True),
}


def _integers(ranges: dict[str, Range], cls: type) -> dict[str, Range]:
    """``ranges`` with ``integer`` set for the fields ``cls`` annotates ``int``: a library
    caller's 2.5 or True for a count is refused as the CLI's ``type=int`` refuses it."""
    hints = typing.get_type_hints(cls)
    ints = {f.name for f in fields(cls) if hints[f.name] in (int, int | None)}
    return {k: replace(r, integer=True) if k in ints else r for k, r in ranges.items()}


SERVER_RANGES = _integers(SERVER_RANGES, ServerConfig)
#: The `deltad serve` flag (argparse dest) of each ServerConfig field: the field without
#: its ``_s``, but for these.
SERVER_FLAG_DESTS: dict[str, str] = {
    f: {"restore_window_s": "restore_window_seconds"}.get(f, f.removesuffix("_s"))
    for f in SERVER_RANGES
}
#: ... as flag and environment variable, for messages.
SERVER_FLAG_NAMES: dict[str, str] = {
    f: "--{} (DELTAD_{})".format(d.replace("_", "-"), d.upper())
    for f, d in SERVER_FLAG_DESTS.items()
}


@dataclass(frozen=True)
class ArchiveFollowConfig:
    """`deltad serve --upstream-archive`: a relay that follows the rank's log in the archive
    (deltad.serve.archive.follow) instead of an upstream sidecar."""

    #: The archive: ``s3://bucket/prefix`` or ``file:///shared/mount``.
    url: str
    #: An S3-compatible server's URL for an ``s3://`` ``url``.
    endpoint: str | None = None
    #: Seconds between reads of the rank's archived manifest.
    poll_interval_s: float = 0.2
    #: fsync placed files (off only on tmpfs).
    fsync: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("s3://", "file://")):
            raise ConfigError(
                f"--upstream-archive {self.url!r:.80}: give s3://BUCKET/PREFIX or file:///PATH"
            )
        if not 0 < self.poll_interval_s <= 3600:
            raise ConfigError("the archive's poll interval must be in (0, 3600] seconds")


@dataclass
class RelayConfig:
    """`deltad serve --upstream`: a relay mirrors one rank's log from an upstream sidecar (or
    relay) into its own spool and serves it like a sidecar (see deltad.serve.relay.mirror)."""

    #: host:port of the upstream sidecar or relay (same model and rank).
    upstream: str
    #: The relay's consumer name at the upstream (its cursor there); stable across restarts.
    consumer: str = "relay"
    #: Bearer token for the upstream (or a file holding it, re-read when it changes), a CA
    #: to verify its TLS certificate (None: plaintext), and the relay's client certificate
    #: and key for an upstream that requires mTLS (re-read when they change).
    token: str | None = None
    tls_ca: Path | None = None
    token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: Seconds between upstream Status polls when nothing is new and the upstream does not
    #: hold a long poll (older servers, or one with all its waiter places taken).
    poll_interval_s: float = 0.05
    #: Longest wait of one long-polling Status call (the upstream answers as soon as its head
    #: moves); 0 polls every ``poll_interval_s`` instead. Capped at a third of the lease.
    long_poll_s: float = 10.0
    #: Deadline of one upstream RPC; a mirror pull's stream is bounded instead by each wait
    #: for its next message (``deltad.serve.relay.upstream.STALL_S`` or this, the shorter) and
    #: as a whole by ``stream_deadline_s``.
    rpc_deadline_s: float = 300.0
    #: Longest one mirror pull's stream may run in all (a whole base over a slow link;
    #: `deltad serve --stream-deadline`, which bounds the streams the relay serves too).
    stream_deadline_s: float = 3600.0
    #: The relay's lease at the upstream; renewed every third of it.
    lease_ttl_s: float = 30.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    #: fsync mirrored segments before committing upstream (off only on tmpfs).
    fsync: bool = True

    def __post_init__(self) -> None:
        check_endpoint("upstream (--upstream)", self.upstream)
        check_name("upstream consumer", self.consumer)
        check_numbers(
            self,
            RELAY_RANGES,
            {"long_poll_s": "long_poll_s (--upstream-long-poll, DELTAD_UPSTREAM_LONG_POLL)"},
        )
        if self.poll_interval_s <= 0 or self.rpc_deadline_s <= 0 or self.lease_ttl_s <= 0:
            raise ConfigError("relay poll interval, RPC deadline and lease TTL must be > 0")
        if not 0 <= self.long_poll_s <= 3600:
            raise ConfigError(f"relay long_poll_s must be in [0, 3600], not {self.long_poll_s}")
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ConfigError("relay backoff_initial_s must be > 0 and <= backoff_max_s")
        check_bool("fsync", self.fsync)
        self.tls_ca, self.tls_cert, self.tls_key, self.token_file = check_client_auth(
            "upstream ", self.token, self.token_file, self.tls_ca, self.tls_cert, self.tls_key
        )


RELAY_RANGES: dict[str, Range] = {
    "poll_interval_s": Range(0.001, 60),
    "long_poll_s": Range(0, 3600),
    "rpc_deadline_s": Range(0, 86400, lo_open=True),
    "stream_deadline_s": Range(0, 7 * 86400, lo_open=True),
    "lease_ttl_s": Range(0, 86400, lo_open=True),
    "backoff_initial_s": Range(0, 3600, lo_open=True),
    "backoff_max_s": Range(0, 3600, lo_open=True),
}


@dataclass
class PullOptions:
    """What a consumer asks of GetDelta."""

    form: Form = Form.ROWS
    #: top-k: the k rows per table (0 = use ``fraction``).
    k: int = 0
    #: top-k: fraction of the window's candidate rows per table, in (0, 1].
    fraction: float = 0.0
    tables: tuple[str, ...] = ()
    wire_dtype: WireDtype = WireDtype.FP32
    #: Cap on rows returned per pull (0 = none); the rest stays in the window.
    max_rows: int = 0
    #: Highest trainer step to include (None = up to the head). Used for multi-rank alignment.
    max_step: int | None = None
    auto_commit: bool = False
    #: Packed wire dtypes: pad each row to a multiple of this many bytes (0: 16, TorchRec's
    #: CPU inference tables; a power of two up to 4096).
    row_alignment: int = 0
    #: Also receive the trainer's dense state (``RankDelta.dense``) and, with aligned pulls,
    #: move only to steps that have one, so rows and dense weights are of one step.
    dense: bool = True

    def __post_init__(self) -> None:
        self.form = check_choice("form", self.form, Form)
        self.wire_dtype = check_choice("wire_dtype", self.wire_dtype, WireDtype)
        self.tables = check_names("tables", self.tables)
        check_numbers(self, PULL_RANGES)
        for flag in ("auto_commit", "dense"):
            check_bool(flag, getattr(self, flag))
        if self.k < 0 or self.max_rows < 0:
            raise ConfigError("k and max_rows must be >= 0")
        if not 0.0 <= self.fraction <= 1.0:  # (NaN fails too)
            raise ConfigError(f"fraction must be in (0, 1], not {self.fraction}")
        if self.form is not Form.TOPK and (self.k or self.fraction):
            # (the CLI refuses --k / --fraction without --form topk the same way)
            given = "k" if self.k else "fraction"
            raise ConfigError(
                f"{given} is for form=Form.TOPK only (form is {self.form.value}): set "
                f"form=Form.TOPK or leave {given} at 0"
            )
        if self.form is Form.TOPK and self.k == 0 and self.fraction == 0.0:
            raise ConfigError("top-k needs k > 0 or a fraction in (0, 1]")
        a = self.row_alignment
        if not 0 <= a <= 4096 or a & (a - 1):
            raise ConfigError(f"row_alignment must be 0 or a power of two <= 4096, not {a}")


PULL_RANGES: dict[str, Range] = {
    "k": Range(0, MAX_COUNT, integer=True),
    "fraction": Range(0, 1),
    "max_rows": Range(0, MAX_COUNT, note="0 = no cap", integer=True),
    "max_step": Range(0, float(1 << 62), integer=True),
    "row_alignment": Range(0, 4096, integer=True),
}


@dataclass
class ConsumerConfig:
    """The predictor-side consumer library."""

    consumer: str
    model: str = "model"
    #: Static list of sidecar endpoints, one per rank (index = rank). Empty = discover in Redis.
    sidecars: tuple[str, ...] = ()
    redis_url: str | None = None
    pull: PullOptions = field(default_factory=PullOptions)
    #: Apply only up to the highest trainer step every rank has published.
    align_steps: bool = True
    #: Deadline of each RPC; for a GetDelta stream, of each wait for its next message (a
    #: stream that stalls that long is cancelled and retried, however long it has run).
    rpc_deadline_s: float = 30.0
    #: Longest one GetDelta stream may run in all (a bootstrap of a big shard over a slow
    #: link); the sidecar's ``--stream-deadline`` (default an hour too) ends streams too.
    stream_deadline_s: float = 3600.0
    max_retries: int = 5
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    #: A sidecar at its stream limit (RESOURCE_EXHAUSTED) is retried, after the wait it
    #: suggests, for up to this many seconds per pull; then the pull raises OverloadedError.
    overload_wait_s: float = 300.0
    lease_ttl_s: float = 30.0
    heartbeat_interval_s: float = 5.0
    token: str | None = None
    tls_ca: Path | None = None
    #: A file holding the bearer token (instead of ``token``); re-read when it changes.
    token_file: Path | None = None
    #: Client certificate and key (PEM) for sidecars that require mTLS (``--tls-client-ca``);
    #: re-read, with ``tls_ca``, when they change (before a reconnect). TLS is on when
    #: ``tls_ca`` or ``tls_cert`` is set (without ``tls_ca``: the system's roots).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: Redis discovery: how long connect() waits for every rank's sidecar to register.
    discovery_timeout_s: float = 120.0
    #: Rebuild each pull into the buffers of earlier pulls that nothing references any more
    #: (:mod:`deltad.buffers`); at most this many bytes kept per rank, 0 = allocate afresh.
    reuse_buffers_bytes: int = 8 << 30
    #: Continue from the committed cursors: only for a consumer whose tables already hold
    #: the state those cursors describe (restored from disk). Off (default), each rank's
    #: first pull of this process asks for the full tables (a resync), whatever its cursor:
    #: a restarted predictor that kept its tables in memory must not get only the rows
    #: changed since its last commit.
    resume: bool = False
    #: Cold start (deltad.consume.coldstart): read the newest archived base and segments from
    #: this object store (``s3://bucket/prefix`` or ``file:///mount``), then pull only the
    #: tail from the sidecars; None: bootstrap from the sidecars.
    bootstrap_from: str | None = None
    #: An S3-compatible server's URL for an ``s3://`` ``bootstrap_from``.
    bootstrap_endpoint: str | None = None
    #: (rank, generation, seq, step) of each rank whose tables hold an archived state its
    #: sidecar has not acknowledged yet (a cold start while it did not answer,
    #: :func:`deltad.consume.coldstart.resumed`): that rank's pulls name the state
    #: (GetDeltaRequest.holding) until a commit from it is acknowledged; a sidecar that
    #: refuses it sends that rank's full tables instead.
    holding: tuple[tuple[int, int, int, int], ...] = ()

    def __post_init__(self) -> None:
        check_name("consumer", self.consumer)
        check_name("model", self.model)
        check_numbers(self, CONSUMER_RANGES)
        for flag in ("align_steps", "resume"):
            check_bool(flag, getattr(self, flag))
        for held in self.holding:
            if (
                not isinstance(held, tuple)
                or len(held) != 4
                or any(type(x) is not int or x < 0 for x in held)
            ):
                raise ConfigError(
                    f"holding: {held!r:.80} is not (rank, generation, seq, step) of counts"
                )
        if not isinstance(self.pull, PullOptions):
            raise ConfigError(f"pull must be a PullOptions, not {type(self.pull).__name__}")
        if self.reuse_buffers_bytes < 0:
            raise ConfigError("reuse_buffers_bytes must be >= 0")
        if self.max_retries < 0 or self.rpc_deadline_s <= 0:
            raise ConfigError("max_retries must be >= 0 and rpc_deadline_s > 0")
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ConfigError("backoff_initial_s must be > 0 and <= backoff_max_s")
        if self.overload_wait_s < 0:
            raise ConfigError("overload_wait_s must be >= 0")
        if self.lease_ttl_s <= 0 or self.heartbeat_interval_s <= 0:
            raise ConfigError("lease_ttl_s and heartbeat_interval_s must be > 0")
        self.sidecars = tuple(
            check_endpoint("sidecar endpoint (--sidecar)", e) for e in self.sidecars
        )
        if self.redis_url is not None:
            check_redis_url(self.redis_url)
        self.tls_ca, self.tls_cert, self.tls_key, self.token_file = check_client_auth(
            "", self.token, self.token_file, self.tls_ca, self.tls_cert, self.tls_key
        )


CONSUMER_RANGES: dict[str, Range] = {
    "rpc_deadline_s": Range(0, 86400, lo_open=True),
    "stream_deadline_s": Range(0, 7 * 86400, lo_open=True),
    "max_retries": Range(0, 1000),
    "backoff_initial_s": Range(0, 3600, lo_open=True),
    "backoff_max_s": Range(0, 3600, lo_open=True),
    "overload_wait_s": Range(0, 86400),
    "lease_ttl_s": Range(0, 86400, lo_open=True),
    "heartbeat_interval_s": Range(0, 3600, lo_open=True),
    "discovery_timeout_s": Range(0, 86400),
    "reuse_buffers_bytes": Range(0, MAX_BYTES, note="0 = off"),
}
