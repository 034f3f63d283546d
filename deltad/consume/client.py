"""The consumer library: read every rank's window from its sidecar, apply, commit.

::

    with DeltaConsumer(ConsumerConfig("ranker-1", sidecars=("h0:50051", "h1:50051"))) as c:
        result = c.pull()             # every rank's window, in parallel, step-aligned
        applier.apply(result.deltas)  # your tables now serve result.step
        c.commit(result)              # only now do the cursors move (at-least-once)

or ``c.sync(applier.apply)`` for all three. Sidecars come from a static list (index = rank) or from
Redis (``RedisKeys.ranks``). Every RPC has a deadline and bounded retries with exponential
backoff; gRPC errors become :class:`deltad.errors.ConsumerError` at this boundary.

Multi-rank alignment (``align_steps``): each pull first asks every sidecar's Status for its
head step and requests ``max_step = min`` over ranks (with ``PullOptions.dense``, when the
trainer publishes dense states: the newest step at or below it that has one, so the rows and
the dense weights applied are of that one step); it applies only if every rank answered
with the same generation and step, so a predictor never serves a mix of two model versions.
Otherwise the whole pull is dropped uncommitted (``PullResult.missing`` says why) and the
rows come again next time. A commit that fails (sidecar down) stays pending and is retried
before that rank's next pull; commits only move forward, so none is lost or duplicated.

``auto_commit`` (at-most-once, for simple readers): without alignment the server commits as
each stream completes; with alignment the client commits right after every rank answered,
so a pull it drops (ranks disagree) is never committed.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import grpc.experimental
import torch

from deltad import wire
from deltad.buffers import BufferPool
from deltad.config import ConsumerConfig
from deltad.consume import decode
from deltad.consume.window import Cursor, RankDelta
from deltad.errors import (
    ConfigError,
    ConsumerError,
    DeltadError,
    OverloadedError,
    SidecarUnavailableError,
)
from deltad.keys import RedisKeys
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Codes worth another attempt: the sidecar is down, slow or restarting.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    }
)

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", wire.CONSUMER_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    # The thread reading a GetDelta stream drives it itself, instead of a channel thread
    # receiving every message and handing it over. Measured (1 GB fp32 window, decoded in a
    # pull thread, steady state): 1.4-1.5 -> 1.65-2.1 GB/s, client CPU 0.7 -> 0.5-0.6 s.
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
]


@dataclass(frozen=True)
class RankStatus:
    """What one sidecar's Status said, stamped with the local time it was asked."""

    rank: int
    world_size: int
    generation: int
    head_seq: int
    head_step: int
    head_age_s: float
    asked_unix: float
    #: Steps of the dense states this rank serves (rank 0 of a trainer publishing them).
    dense_steps: tuple[int, ...] = ()
    #: Steps a window of this rank can end at (its log's entries; empty: not reported).
    steps: tuple[int, ...] = ()

    @property
    def head_created_unix(self) -> float:
        """When the head segment was created, on this host's clock."""
        return self.asked_unix - self.head_age_s


@dataclass
class PullResult:
    """One pull: the windows to apply (one per rank) and what serving them means."""

    deltas: list[RankDelta] = field(default_factory=list)
    #: Trainer step the tables serve once ``deltas`` are applied (None: nothing pulled). With
    #: dense states asked for and published, the dense weights of that step come with it (in
    #: the window of the rank that publishes them), unless the predictor holds them already.
    step: int | None = None
    #: Newest step any rank has published.
    head_step: int | None = None
    #: When the last segment of ``step`` was created (host clock), if known.
    source_unix: float | None = None
    #: Ranks not read this time, with the reason (the rows come next time).
    missing: dict[int, str] = field(default_factory=dict)
    pulled_unix: float = 0.0

    @property
    def rows(self) -> int:
        return sum(d.rows for d in self.deltas)

    @property
    def bytes(self) -> int:
        return sum(d.bytes for d in self.deltas)

    @property
    def resync(self) -> bool:
        return any(d.resync for d in self.deltas)

    @property
    def served_step(self) -> int | None:
        """The step the predictor serves once it applied this pull (= ``step``)."""
        return self.step

    @property
    def dense(self) -> dict[str, torch.Tensor]:
        """The dense state this pull carries (empty: none new)."""
        return next((d.dense for d in self.deltas if d.dense_step is not None), {})

    @property
    def dense_step(self) -> int | None:
        """The step of the dense state this pull carries (None: none new)."""
        return next((d.dense_step for d in self.deltas if d.dense_step is not None), None)

    @property
    def dense_bytes(self) -> int:
        return sum(d.dense_bytes for d in self.deltas)


class _Rank:
    """Connection and bookkeeping of one rank's sidecar."""

    def __init__(self, rank: int, endpoint: str, buffers_bytes: int = 0) -> None:
        self.rank = rank
        self.endpoint = endpoint
        self.buffers = BufferPool(max_bytes=buffers_bytes) if buffers_bytes > 0 else None
        self.channel: grpc.Channel | None = None
        self.stub: pb_grpc.DeltaServiceStub | None = None
        self.pending: Cursor | None = None  # applied, commit not acknowledged yet
        self.committed: Cursor | None = None
        #: The caller's tables hold nothing of this rank yet: ask for the full tables.
        self.needs_base = True
        self.lock = threading.Lock()


class DeltaConsumer:
    """A named consumer reading every rank of one model (see the module docstring).

    The library leaves the process's allocator alone; a predictor that rebuilds large windows
    should call :func:`deltad.perf.tune_malloc` at startup, as ``deltad consume`` does.
    """

    def __init__(self, config: ConsumerConfig) -> None:
        self.config = config
        if not config.sidecars and not config.redis_url:
            raise ConsumerError("set sidecars (one per rank) or redis_url for discovery")
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {config.token}"),) if config.token else ()
        )
        self._credentials: grpc.ChannelCredentials | None = None
        if config.tls_ca is not None:
            try:
                ca = config.tls_ca.read_bytes()
            except OSError as e:
                raise ConsumerError(f"cannot read TLS CA {config.tls_ca}: {e}") from e
            self._credentials = grpc.ssl_channel_credentials(root_certificates=ca)
        self._redis: Any = None
        self._redis_lock = threading.Lock()
        self._ranks: list[_Rank] = []
        self._pool: ThreadPoolExecutor | None = None
        self._closed = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._connected = False

    # ---- lifecycle -------------------------------------------------------------------------

    def connect(self) -> DeltaConsumer:
        """Resolve the sidecars, register the consumer on every rank, start heartbeats.

        A sidecar that does not answer only delays its rank (the heartbeat thread registers
        it later; pulls report it in ``missing``); any other failure raises ConsumerError.
        """
        if self._connected:
            return self
        try:
            self._connect()
        except BaseException:
            self.close()
            raise
        return self

    def _connect(self) -> None:
        endpoints = list(self.config.sidecars) or self._discover_all()
        self._ranks = [
            _Rank(r, ep, self.config.reuse_buffers_bytes) for r, ep in enumerate(endpoints)
        ]
        for r in self._ranks:
            r.needs_base = not self.config.resume
        for r in self._ranks:
            self._open(r)
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, len(self._ranks)), thread_name_prefix="deltad-consumer"
        )
        self._connected = True
        for r, resp in zip(self._ranks, self._parallel(self._register), strict=True):
            if isinstance(resp, SidecarUnavailableError):
                log.warning("rank %d: not registered yet: %s", r.rank, resp)
            elif isinstance(resp, Exception):
                raise resp
            elif resp.cursor.rank != r.rank:
                raise ConfigError(
                    f"sidecar {r.endpoint} serves rank {resp.cursor.rank}, but it is listed as "
                    f"rank {r.rank}: list the sidecars in rank order (one per rank)"
                )
            else:
                r.committed = wire.cursor_from_pb(resp.cursor)
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, name="deltad-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def close(self) -> None:
        """Stop heartbeats and close the channels (pending commits are not flushed)."""
        self._closed.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=self.config.rpc_deadline_s)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for r in self._ranks:
            if r.channel is not None:
                r.channel.close()
        if self._redis is not None:
            self._redis.close()
        self._connected = False

    def __enter__(self) -> DeltaConsumer:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    @property
    def cursors(self) -> list[Cursor | None]:
        """The last acknowledged commit of every rank."""
        return [r.committed for r in self._ranks]

    # ---- the consumer API ------------------------------------------------------------------

    def status(self) -> list[RankStatus]:
        """Every rank's Status (raises SidecarUnavailableError if one is down)."""
        out = []
        for res in self._parallel(self._status):
            if isinstance(res, Exception):
                raise res
            out.append(res)
        return out

    def pull(self) -> PullResult:
        """Read every rank's window (aligned on one trainer step when ``align_steps``)."""
        self._require_connected()
        result = PullResult(pulled_unix=time.time())
        flushed = self._parallel(self._flush_pending)
        for r, res in zip(self._ranks, flushed, strict=True):
            if isinstance(res, Exception):
                result.missing[r.rank] = f"pending commit: {res}"
        if self.config.align_steps:
            return self._handed(self._pull_aligned(result))
        # A rank whose commit is still pending is not pulled: a new pull would supersede it.
        ready = [r for r in self._ranks if r.rank not in result.missing]
        deltas = _raise_overloaded(
            self._parallel(lambda r: self._get_delta(r, self.config.pull.max_step), ready)
        )
        for r, got in zip(ready, deltas, strict=True):
            if isinstance(got, RankDelta):
                result.deltas.append(got)
            else:
                result.missing[r.rank] = str(got)
        if result.deltas:
            result.step = min(d.to_step for d in result.deltas)
            result.head_step = max(d.to_step for d in result.deltas)
        return self._handed(result)

    def _handed(self, result: PullResult) -> PullResult:
        """``result`` goes to the caller. A rank whose full tables it carries no longer needs
        them once they are applied, which :meth:`commit` says; an auto-committed window
        counts as delivered now (a pull dropped before this point still needs them)."""
        for d in result.deltas:
            if d.resync and d.committed:
                self._ranks[d.rank].needs_base = False
        return result

    def commit(self, result: PullResult) -> list[int]:
        """Commit every rank's cursor of an applied pull; return the ranks acknowledged.

        A rank whose sidecar does not answer keeps its cursor pending; it is committed
        before that rank's next pull.
        """
        self._require_connected()
        todo = {d.rank: d.cursor for d in result.deltas if not d.committed and _worth(d)}
        for d in result.deltas:
            if d.resync:  # applied: the caller's tables now hold this rank's full tables
                self._ranks[d.rank].needs_base = False
            if d.committed:
                self._ranks[d.rank].committed = d.cursor
        for rank, cursor in todo.items():
            r = self._ranks[rank]
            with r.lock:
                r.pending = cursor
        done = []
        ranks = [self._ranks[rank] for rank in todo]
        for r, res in zip(ranks, self._parallel(self._flush_pending, ranks), strict=True):
            if isinstance(res, Exception):
                log.warning("rank %d: commit pending (%s)", r.rank, res)
            else:
                done.append(r.rank)
        return done

    def sync(self, apply: Callable[[Sequence[RankDelta]], object]) -> PullResult:
        """pull, ``apply(deltas)`` (e.g. ``applier.apply``), commit; return the pull."""
        result = self.pull()
        if result.deltas:
            apply(result.deltas)
            self.commit(result)
        return result

    # ---- pulls -----------------------------------------------------------------------------

    def _pull_aligned(self, result: PullResult) -> PullResult:
        statuses: dict[int, RankStatus] = {}
        for r, st in zip(self._ranks, self._parallel(self._status), strict=True):
            if isinstance(st, RankStatus):
                statuses[r.rank] = st
            else:
                result.missing[r.rank] = str(st)
        if result.missing:
            return result
        generations = {s.generation for s in statuses.values()}
        if len(generations) > 1 or any(s.head_seq < 0 for s in statuses.values()):
            result.missing = {
                s.rank: f"generation {s.generation} head seq {s.head_seq}: ranks not aligned yet"
                for s in statuses.values()
            }
            return result
        target = min(s.head_step for s in statuses.values())
        if self.config.pull.max_step is not None:
            target = min(target, self.config.pull.max_step)
        if self.config.pull.dense:
            target = _dense_target(list(statuses.values()), target)
        result.head_step = max(s.head_step for s in statuses.values())
        deltas: list[RankDelta] = []
        got_all = _raise_overloaded(self._parallel(lambda r: self._get_delta(r, target)))
        for r, got in zip(self._ranks, got_all, strict=True):
            if isinstance(got, RankDelta):
                deltas.append(got)
            else:
                result.missing[r.rank] = str(got)
        if result.missing:
            return result
        gens = {d.generation for d in deltas}
        steps = {d.to_step for d in deltas}
        if len(gens) > 1 or len(steps) > 1:
            log.warning("pull dropped: ranks answered generations %s steps %s", gens, steps)
            result.missing = {d.rank: "answered another step or generation" for d in deltas}
            return result
        result.deltas = deltas
        result.step = deltas[0].to_step
        if self.config.pull.auto_commit:
            self.commit(result)
            for d in deltas:
                d.committed = True
        at_step = [s.head_created_unix for s in statuses.values() if s.head_step == result.step]
        result.source_unix = max(at_step) if at_step else None
        return result

    def _request(self, r: _Rank, max_step: int | None) -> pb.GetDeltaRequest:
        req = wire.request_from_options(self.config.consumer, self.config.pull)
        req.from_base = r.needs_base
        if self.config.align_steps:
            req.auto_commit = False  # committed by _pull_aligned once every rank agreed
        if max_step is not None:
            req.max_step = max_step
        return req

    def _get_delta(self, r: _Rank, max_step: int | None) -> RankDelta:
        req = self._request(r, max_step)

        delta = self._retry(
            r,
            "GetDelta",
            lambda ch, timeout: decode.pull(
                ch, req, timeout=timeout, metadata=self._metadata, pool=r.buffers
            ),
        )
        if delta.committed:
            r.committed = delta.cursor
        return delta

    # ---- small RPCs ------------------------------------------------------------------------

    def _status(self, r: _Rank) -> RankStatus:
        def call(ch: grpc.Channel, timeout: float) -> RankStatus:
            s = pb_grpc.DeltaServiceStub(ch).Status(
                pb.StatusRequest(), timeout=timeout, metadata=self._metadata
            )
            return RankStatus(
                rank=int(s.rank),
                world_size=int(s.world_size),
                generation=int(s.generation),
                head_seq=int(s.head_seq),
                head_step=int(s.head_step),
                head_age_s=float(s.head_age_seconds),
                asked_unix=time.time(),
                dense_steps=tuple(int(x) for x in s.dense_steps),
                steps=tuple(int(x) for x in s.steps),
            )

        return self._retry(r, "Status", call)

    def _register(self, r: _Rank) -> pb.RegisterResponse:
        req = pb.RegisterRequest(
            consumer=self.config.consumer, lease_ttl_seconds=self.config.lease_ttl_s
        )
        return self._retry(
            r,
            "Register",
            lambda ch, timeout: pb_grpc.DeltaServiceStub(ch).Register(
                req, timeout=timeout, metadata=self._metadata
            ),
        )

    def _flush_pending(self, r: _Rank) -> Cursor | None:
        """Commit the rank's pending cursor, if any; keep it pending on failure."""
        with r.lock:
            cursor = r.pending
        if cursor is None:
            return None
        req = pb.CommitRequest(consumer=self.config.consumer, cursor=wire.cursor_to_pb(cursor))
        try:
            resp = self._retry(
                r,
                "Commit",
                lambda ch, timeout: pb_grpc.DeltaServiceStub(ch).Commit(
                    req, timeout=timeout, metadata=self._metadata
                ),
            )
            stored: Cursor | None = wire.cursor_from_pb(resp.committed)
        except _Rejected as e:
            # The server refuses this cursor for good (older generation, superseded pull, or
            # a consumer its Redis no longer knows: forgotten, or the keys were lost): the
            # next pull re-sends whatever is still owed, or resyncs from the base, so
            # dropping it loses nothing.
            log.warning("rank %d: commit of seq %d rejected: %s", r.rank, cursor.seq, e)
            stored = None if e.code == grpc.StatusCode.NOT_FOUND else r.committed
        with r.lock:
            if r.pending == cursor:
                r.pending = None
            r.committed = stored
        return stored

    def _heartbeat_loop(self) -> None:
        interval = max(0.05, self.config.heartbeat_interval_s)
        req = pb.HeartbeatRequest(consumer=self.config.consumer)
        while not self._closed.wait(interval):
            for r in self._ranks:
                if self._closed.is_set():
                    return
                stub = r.stub
                if stub is None:
                    continue
                try:
                    stub.Heartbeat(
                        req, timeout=min(interval, self.config.rpc_deadline_s),
                        metadata=self._metadata,
                    )  # fmt: skip
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.NOT_FOUND:  # lease expired: register again
                        try:
                            self._register(r)
                        except DeltadError as err:
                            log.warning("rank %d: re-register failed: %s", r.rank, err)
                    else:
                        log.debug("rank %d: heartbeat failed: %s", r.rank, e.code())

    # ---- plumbing --------------------------------------------------------------------------

    def _require_connected(self) -> None:
        if not self._connected:
            raise ConsumerError("DeltaConsumer is not connected (use connect() or `with`)")

    def _parallel(
        self, fn: Callable[[_Rank], T], ranks: Sequence[_Rank] | None = None
    ) -> list[T | Exception]:
        """``fn`` on every rank at once; ConsumerErrors come back as values, in rank order."""
        ranks = self._ranks if ranks is None else ranks
        assert self._pool is not None
        futures = [self._pool.submit(fn, r) for r in ranks]
        out: list[T | Exception] = []
        for f in futures:
            try:
                out.append(f.result())
            except ConsumerError as e:
                out.append(e)
        return out

    def _open(self, r: _Rank) -> None:
        if r.channel is not None:
            r.channel.close()
        if self._credentials is not None:
            r.channel = grpc.secure_channel(r.endpoint, self._credentials, _CHANNEL_OPTIONS)
        else:
            r.channel = grpc.insecure_channel(r.endpoint, _CHANNEL_OPTIONS)
        r.stub = pb_grpc.DeltaServiceStub(r.channel)

    def _retry(self, r: _Rank, what: str, call: Callable[[grpc.Channel, float], T]) -> T:
        """``call`` with a deadline, retried with exponential backoff and jitter.

        RESOURCE_EXHAUSTED (the sidecar's stream limit) does not count as an attempt: it is
        retried after the wait the sidecar suggests (``deltad.wire.RETRY_AFTER_KEY``, with
        jitter) for up to ``overload_wait_s``, then raises OverloadedError.
        """
        c = self.config
        delay = c.backoff_initial_s
        last: grpc.RpcError | None = None
        attempt = 0
        overloaded_until: float | None = None
        while attempt <= c.max_retries:
            if self._closed.is_set():
                break
            channel = r.channel
            assert channel is not None
            try:
                return call(channel, c.rpc_deadline_s)
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    now = time.monotonic()
                    if overloaded_until is None:
                        overloaded_until = now + c.overload_wait_s
                    left = overloaded_until - now
                    if left <= 0:
                        raise OverloadedError(
                            f"rank {r.rank} {what} at {r.endpoint}: still at its stream limit "
                            f"after {c.overload_wait_s:.0f}s (overload_wait_s): {e.details()}"
                        ) from None
                    hint = _retry_after(e)
                    if hint is None:
                        wait = delay * (0.5 + random.random() / 2)
                        delay = min(delay * 2, c.backoff_max_s)
                    else:  # spread the callers told the same time over half of it again
                        wait = hint * (1 + random.random() / 2)
                    self._closed.wait(min(wait, left))
                    continue
                if code not in RETRYABLE:
                    if code in _FINAL_COMMIT_CODES and what == "Commit":
                        raise _Rejected(code, e.details()) from None
                    raise ConsumerError(
                        f"rank {r.rank} {what} at {r.endpoint}: {code.name}: {e.details()}"
                    ) from None
                last = e
            except DeltadError as e:
                raise ConsumerError(f"rank {r.rank} {what}: {e}") from e
            if attempt < c.max_retries:
                self._closed.wait(delay * (0.5 + random.random() / 2))
                delay = min(delay * 2, c.backoff_max_s)
                if self.config.redis_url and not self.config.sidecars:
                    self._rediscover(r)
            attempt += 1
        detail = f"{last.code().name}: {last.details()}" if last is not None else "closed"
        raise SidecarUnavailableError(
            f"rank {r.rank} {what} at {r.endpoint}: no answer after "
            f"{c.max_retries + 1} attempts ({detail})"
        )

    # ---- discovery -------------------------------------------------------------------------

    def _registry(self) -> dict[int, str]:
        """rank -> endpoint, as the sidecars registered themselves in Redis."""
        from deltad.redisutil import connect

        assert self.config.redis_url is not None
        try:
            with self._redis_lock:
                if self._redis is None:
                    self._redis = connect(
                        self.config.redis_url, attempts=self.config.max_retries + 1
                    )
                client = self._redis
            raw = client.hgetall(RedisKeys(self.config.model).ranks())
        except Exception as e:  # redis errors and OffsetStoreError alike
            raise ConsumerError(f"sidecar discovery in redis failed: {e}") from e
        out: dict[int, str] = {}
        for k, v in raw.items():
            try:
                out[int(k)] = str(json.loads(v)["endpoint"])
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring bad ranks entry %r", k)
        return out

    def _discover_all(self) -> list[str]:
        """Every rank's endpoint; waits (bounded) until all ranks 0..world-1 registered."""
        deadline = time.monotonic() + self.config.discovery_timeout_s
        delay = self.config.backoff_initial_s
        found: dict[int, str] = {}
        while True:
            found = self._registry()
            world = self._world_size(found)
            if world and all(r in found for r in range(world)):
                return [found[r] for r in range(world)]
            if time.monotonic() >= deadline:
                raise SidecarUnavailableError(
                    f"model {self.config.model}: ranks {sorted(found)} registered in redis, "
                    f"not all of 0..{max(world, 1) - 1} after {self.config.discovery_timeout_s}s"
                )
            time.sleep(delay)
            delay = min(delay * 2, self.config.backoff_max_s)

    def _world_size(self, found: dict[int, str]) -> int:
        """World size as a registered sidecar's Status reports it (0 if none answers)."""
        for rank in sorted(found):
            probe = _Rank(rank, found[rank])
            self._open(probe)
            try:
                assert probe.stub is not None
                s = probe.stub.Status(
                    pb.StatusRequest(), timeout=min(2.0, self.config.rpc_deadline_s),
                    metadata=self._metadata,
                )  # fmt: skip
                return int(s.world_size)
            except grpc.RpcError:
                continue
            finally:
                if probe.channel is not None:
                    probe.channel.close()
        return 0

    def _rediscover(self, r: _Rank) -> None:
        """Reopen the rank's channel if its sidecar registered a new endpoint."""
        try:
            endpoint = self._registry().get(r.rank)
        except ConsumerError as e:
            log.debug("rediscovery failed: %s", e)
            return
        if endpoint and endpoint != r.endpoint:
            log.info("rank %d: sidecar moved %s -> %s", r.rank, r.endpoint, endpoint)
            r.endpoint = endpoint
            self._open(r)


#: Commit answers that no retry can change: the cursor is refused for good.
_FINAL_COMMIT_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)


class _Rejected(ConsumerError):
    """The server refused a commit for good (FAILED_PRECONDITION, NOT_FOUND)."""

    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


def _dense_target(statuses: list[RankStatus], target: int) -> int:
    """The step an aligned pull that wants dense weights goes to, at most ``target``: the
    newest step that has a dense state and that every rank's log can end a window at (a
    retention merge may have swallowed a step on some rank). With dense states published with
    every segment (the default) that is ``target`` itself: no freshness is lost. If no such
    step exists (none published, or all swallowed), ``target``: rows move on, and the pull's
    ``dense_step`` (older) says which dense state the predictor holds."""
    dense = sorted({t for s in statuses for t in s.dense_steps if t <= target}, reverse=True)
    ends = [set(s.steps) for s in statuses]
    for t in dense:
        if all(t in e for e in ends if e):  # a rank that reports no steps: an older sidecar
            return t
    return target


def _retry_after(e: grpc.RpcError) -> float | None:
    """The wait (seconds) a sidecar suggested in a refusal's trailing metadata, if any."""
    try:
        for key, value in e.trailing_metadata() or ():  # type: ignore[attr-defined]
            if key == wire.RETRY_AFTER_KEY:
                return min(60.0, max(0.0, int(value) / 1000))
    except (ValueError, TypeError, AttributeError):
        pass
    return None


def _raise_overloaded(results: list[T | Exception]) -> list[T | Exception]:
    """``results``, unless a rank gave up on an overloaded sidecar: then raise that (a
    pull that gives up is the caller's error, not a missing rank)."""
    for res in results:
        if isinstance(res, OverloadedError):
            raise res
    return results


def _worth(d: RankDelta) -> bool:
    """Whether the pull moved anything the server should record."""
    return d.resync or d.rows > 0 or d.to_seq != d.from_seq
