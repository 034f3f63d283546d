"""The consumer's connections to its sidecars, one per rank: channels and credentials, deadlines
and bounded retries, heartbeats (discovery in Redis: :mod:`deltad.consume.discovery`), and the
small RPCs (Status, Register, Commit). :class:`deltad.consume.client.DeltaConsumer` builds pulls
and commits on top of :class:`Sidecars`; gRPC errors become :class:`deltad.errors.ConsumerError`
here.

Credentials come from :class:`deltad.clientauth.ClientAuth`: the token file is re-read when
it changes (before each call), the TLS files before each retry and each reconnect (a rank
whose channel was opened with older files gets a new channel).
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc

from deltad import wire
from deltad.buffers import BufferPool
from deltad.channels import stream_channel_options
from deltad.clientauth import ClientAuth
from deltad.config import ConsumerConfig
from deltad.consume.discovery import Discovery
from deltad.consume.window import Cursor
from deltad.errors import (
    ConfigError,
    ConsumerError,
    DeltadError,
    HeldStateRefused,
    OverloadedError,
    SidecarUnavailableError,
)
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

#: Commit answers that no retry can change: the cursor is refused for good.
FINAL_COMMIT_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)


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
    #: The newest step the model's release state (and the server's validation gate) lets
    #: this consumer be served (None: the head; deltad.serve.rollout), and that state's version.
    cap_step: int | None = None
    rollout_version: int = 0
    #: Why the server does not know the release state ("" if it does): a relay that has not
    #: heard its upstream's, a sidecar that cannot read Redis's; it serves nothing meanwhile.
    state_unknown: str = ""

    @property
    def head_created_unix(self) -> float:
        """When the trainer published the head step, on this host's clock."""
        return self.asked_unix - self.head_age_s


class Rejected(ConsumerError):
    """The server refused a commit for good (FAILED_PRECONDITION, NOT_FOUND)."""

    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


class RankLink:
    """Connection and bookkeeping of one rank's sidecar."""

    def __init__(self, rank: int, endpoint: str, buffers_bytes: int = 0) -> None:
        self.rank = rank
        self.endpoint = endpoint
        self.buffers = BufferPool(max_bytes=buffers_bytes) if buffers_bytes > 0 else None
        self.channel: grpc.Channel | None = None
        self.stub: pb_grpc.DeltaServiceStub | None = None
        #: ClientAuth.generation of the credentials the channel was opened with
        self.auth_generation = -1
        self.pending: Cursor | None = None  # applied, commit not acknowledged yet
        self.committed: Cursor | None = None
        #: The caller's tables hold nothing of this rank yet: ask for the full tables.
        self.needs_base = True
        #: the release state's version the last Status answered (None: none, or an older
        #: server); a long poll also ends when it changes
        self.rollout_version: int | None = None
        #: The newest (generation, head seq) this consumer has seen of the rank (Status,
        #: windows): what a long poll waits to see passed (DeltaConsumer.wait_for_new).
        self.seen: tuple[int, int] = (0, -1)
        #: The generation whose Status showed this sidecar serves the consumer's model, this
        #: rank, and as many ranks as the consumer lists (None: not seen yet; see
        #: Sidecars.check).
        self.checked_generation: int | None = None
        self.lock = threading.Lock()


class Sidecars:
    """Every rank's sidecar of one consumer (see the module docstring)."""

    def __init__(self, config: ConsumerConfig) -> None:
        self.config = config
        try:
            self.auth = ClientAuth.of(config)
        except DeltadError as e:
            raise ConsumerError(str(e)) from e
        self.ranks: list[RankLink] = []
        #: Set by close() (for good: DeltaConsumer.connect opens a new Sidecars after it).
        self.closed = threading.Event()
        self._close_lock = threading.Lock()
        self.channel_options = stream_channel_options(
            backoff_initial_s=config.backoff_initial_s,
            backoff_max_s=config.backoff_max_s,
            deadline_s=config.rpc_deadline_s,
        )
        self.discovery = Discovery(config, self.auth, self.channel_options)
        self._pool: ThreadPoolExecutor | None = None
        self._heartbeat: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def open_all(self) -> None:
        """Resolve the endpoints (static list or Redis), open a channel to each."""
        endpoints = list(self.config.sidecars) or self.discovery.all()
        self.ranks = [
            RankLink(r, ep, self.config.reuse_buffers_bytes) for r, ep in enumerate(endpoints)
        ]
        for r in self.ranks:
            r.needs_base = not self.config.resume
            self.open(r)
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, len(self.ranks)), thread_name_prefix="deltad-consumer"
        )

    def start_heartbeats(self) -> None:
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, name="deltad-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def close(self) -> None:
        """Stop the heartbeats, end an uncommitted lease, close the channels; a second
        close() does nothing (the channels are closed already)."""
        with self._close_lock:
            if self.closed.is_set():
                return
            self.closed.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=self.config.rpc_deadline_s)
        if not any(r.committed is not None and r.committed.seq >= 0 for r in self.ranks):
            self._release()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for r in self.ranks:
            if r.channel is not None:
                r.channel.close()
        self.discovery.close()

    def _release(self) -> None:
        """End the lease of a consumer that committed nothing (it failed at once, or
        stopped before its first commit), so it is not listed as live and lagging; best
        effort, one short call per rank."""
        req = pb.HeartbeatRequest(consumer=self.config.consumer, release=True)
        for r in self.ranks:
            if r.stub is None:
                continue
            try:
                r.stub.Heartbeat(
                    req, timeout=min(2.0, self.config.rpc_deadline_s),
                    metadata=self.auth.metadata(),
                )  # fmt: skip
            except grpc.RpcError as e:
                log.debug("rank %d: lease release failed: %s", r.rank, e.code())

    def open(self, r: RankLink) -> None:
        """(Re)open the rank's channel with the current credentials."""
        # A channel replaced for new credentials is left to the garbage collector: another
        # thread (the heartbeat) may still be in a call on it.
        r.channel = self.auth.channel(r.endpoint, self.channel_options)
        r.auth_generation = self.auth.generation
        r.stub = pb_grpc.DeltaServiceStub(r.channel)

    def _fresh(self, r: RankLink) -> None:
        """Before a (re)connect: reopen the rank's channel if the TLS files changed."""
        self.auth.tls_changed()
        if r.auth_generation != self.auth.generation:
            log.info("rank %d: new TLS credentials, reconnecting", r.rank)
            self.open(r)

    # ---- calls -----------------------------------------------------------------------------

    def parallel(
        self, fn: Callable[[RankLink], T], ranks: Sequence[RankLink] | None = None
    ) -> list[T | Exception]:
        """``fn`` on every rank at once; ConsumerErrors come back as values, in rank order."""
        ranks = self.ranks if ranks is None else ranks
        assert self._pool is not None
        futures = [self._pool.submit(fn, r) for r in ranks]
        out: list[T | Exception] = []
        for f in futures:
            try:
                out.append(f.result())
            except ConsumerError as e:
                out.append(e)
        return out

    def retry(
        self,
        r: RankLink,
        what: str,
        call: Callable[[grpc.Channel, float, tuple[tuple[str, str], ...]], T],
        progressed: Callable[[], bool] | None = None,
    ) -> T:
        """``call(channel, timeout, metadata)`` with a deadline, retried with exponential
        backoff and jitter; credentials re-read before each attempt.

        RESOURCE_EXHAUSTED (the sidecar's stream limit) does not count as an attempt: it is
        retried after the wait the sidecar suggests (``deltad.wire.RETRY_AFTER_KEY``, with
        jitter) for up to ``overload_wait_s``, then raises OverloadedError.

        ``progressed()``, asked after a failed attempt: True if that attempt got somewhere
        the next one goes on from (a resumable stream received messages). Such an attempt
        does not count either, and the backoff starts again from ``backoff_initial_s``: a
        link that drops every few minutes must not use up the retries of a bootstrap that
        takes longer. (Bounded: each such attempt took at least one message of a finite
        window.)
        """
        c = self.config
        delay = c.backoff_initial_s
        last: grpc.RpcError | None = None
        attempt = 0
        overloaded_until: float | None = None
        while attempt <= c.max_retries:
            if self.closed.is_set():
                break
            self._fresh(r)
            channel = r.channel
            assert channel is not None
            try:
                return call(channel, c.rpc_deadline_s, self.auth.metadata())
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
                    hint = retry_after(e)
                    if hint is None:
                        wait = delay * (0.5 + random.random() / 2)
                        delay = min(delay * 2, c.backoff_max_s)
                    else:  # spread the callers told the same time over half of it again
                        wait = hint * (1 + random.random() / 2)
                    self.closed.wait(min(wait, left))
                    continue
                if code not in RETRYABLE:
                    if code in FINAL_COMMIT_CODES and what == "Commit":
                        raise Rejected(code, e.details()) from None
                    if (
                        code == grpc.StatusCode.FAILED_PRECONDITION
                        and what == "GetDelta"
                        and refusal(e) == wire.REFUSED_HELD_STATE
                    ):
                        raise HeldStateRefused(
                            f"rank {r.rank} GetDelta at {r.endpoint}: {e.details()}"
                        ) from None
                    raise ConsumerError(
                        f"rank {r.rank} {what} at {r.endpoint}: {code.name}: {e.details()}"
                    ) from None
                last = e
            except DeltadError as e:
                raise ConsumerError(f"rank {r.rank} {what}: {e}") from e
            free = progressed is not None and progressed()  # (counts as no attempt)
            if free:
                delay = c.backoff_initial_s
            if free or attempt < c.max_retries:
                self.closed.wait(delay * (0.5 + random.random() / 2))
                delay = min(delay * 2, c.backoff_max_s)
                if self.config.redis_url and not self.config.sidecars:
                    self._rediscover(r)
            attempt += not free
        detail = f"{last.code().name}: {last.details()}" if last is not None else "closed"
        raise SidecarUnavailableError(
            f"rank {r.rank} {what} at {r.endpoint}: no answer after "
            f"{c.max_retries + 1} attempts ({detail})"
        )

    # ---- small RPCs ------------------------------------------------------------------------

    def status(self, r: RankLink) -> RankStatus:
        """The rank's Status, after :meth:`check` (ConfigError: a sidecar of another model,
        rank or world size)."""
        req = pb.StatusRequest(consumer=self.config.consumer)
        s = self.retry(
            r,
            "Status",
            lambda ch, timeout, md: pb_grpc.DeltaServiceStub(ch).Status(
                req, timeout=timeout, metadata=md
            ),
        )
        asked = time.time()
        self.check(r, s)
        r.seen = max(r.seen, (int(s.generation), int(s.head_seq)))
        # a server without release state (older) sends no rollout_state: no cap
        cap = int(s.cap_step) if s.rollout_state and s.cap_step >= 0 else None
        r.rollout_version = int(s.rollout_version) if s.rollout_state else None
        return RankStatus(
            rank=int(s.rank),
            world_size=int(s.world_size),
            generation=int(s.generation),
            head_seq=int(s.head_seq),
            head_step=int(s.head_step),
            head_age_s=float(s.head_age_seconds),
            asked_unix=asked,
            dense_steps=tuple(int(x) for x in s.dense_steps),
            steps=tuple(int(x) for x in s.steps),
            cap_step=cap,
            rollout_version=int(s.rollout_version),
            state_unknown=_unknown(s.rollout_state),
        )

    def check(self, r: RankLink, s: pb.StatusResponse) -> None:
        """Raise ConfigError unless the sidecar's Status says it serves this consumer's model,
        the rank it is listed as, and a model of as many ranks as the consumer reads (fewer
        sidecars would serve partial tables: the unlisted ranks' rows never arrive); the world
        size of a sidecar with nothing published yet (0) is checked at a later Status."""
        c = self.config
        if s.model != c.model:
            raise ConfigError(f"{r.endpoint} serves model {s.model!r}, not {c.model!r}")
        if s.rank != r.rank:
            raise ConfigError(
                f"sidecar {r.endpoint} serves rank {s.rank}, but it is listed as rank "
                f"{r.rank}: list the sidecars in rank order (one per rank)"
            )
        if s.world_size and s.world_size != len(self.ranks):
            fix = (
                f"give one sidecar per rank (got {len(self.ranks)}): fewer would serve "
                "partial tables"
                if c.sidecars
                else f"{len(self.ranks)} were registered in redis at connect(): "
                "close() and connect() again"
            )
            raise ConfigError(f"model {c.model!r} has {s.world_size} ranks; {fix}")
        if s.world_size:
            r.checked_generation = int(s.generation)

    def wait_past(self, r: RankLink, wait_s: float) -> grpc.Future:
        """A long-polling Status of the rank (one attempt, not retried), answered when its
        head passes ``r.seen`` or after ``wait_s``; a grpc Future (``cancel()`` ends it)."""
        self._fresh(r)
        assert r.channel is not None
        req = pb.StatusRequest(
            after_generation=r.seen[0], after_seq=r.seen[1], wait_ms=int(wait_s * 1000)
        )
        if r.rollout_version is not None:  # a release (or hold) ends the wait too
            req.after_rollout_version = r.rollout_version
        return pb_grpc.DeltaServiceStub(r.channel).Status.future(
            req, timeout=wait_s + min(10.0, self.config.rpc_deadline_s),
            metadata=self.auth.metadata(),
        )  # fmt: skip

    def register(self, r: RankLink) -> pb.RegisterResponse:
        req = pb.RegisterRequest(
            consumer=self.config.consumer, lease_ttl_seconds=self.config.lease_ttl_s
        )
        return self.retry(
            r,
            "Register",
            lambda ch, timeout, md: pb_grpc.DeltaServiceStub(ch).Register(
                req, timeout=timeout, metadata=md
            ),
        )

    def flush_pending(self, r: RankLink) -> Cursor | None:
        """Commit the rank's pending cursor, if any; keep it pending on failure."""
        with r.lock:
            cursor = r.pending
        if cursor is None:
            return None
        req = pb.CommitRequest(consumer=self.config.consumer, cursor=wire.cursor_to_pb(cursor))
        started = time.monotonic()
        try:
            resp = self.retry(
                r,
                "Commit",
                lambda ch, timeout, md: pb_grpc.DeltaServiceStub(ch).Commit(
                    req, timeout=timeout, metadata=md
                ),
            )
            stored: Cursor | None = wire.cursor_from_pb(resp.committed)
            log.debug(
                "commit %s rank %d seq %d step %d in %.0f ms",
                self.config.consumer, r.rank, cursor.seq, cursor.step,
                (time.monotonic() - started) * 1000,
            )  # fmt: skip
        except Rejected as e:
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
        while not self.closed.wait(interval):
            for r in self.ranks:
                if self.closed.is_set():
                    return
                stub = r.stub
                if stub is None:
                    continue
                try:
                    stub.Heartbeat(
                        req, timeout=min(interval, self.config.rpc_deadline_s),
                        metadata=self.auth.metadata(),
                    )  # fmt: skip
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.NOT_FOUND:  # lease expired: register again
                        try:
                            if r.checked_generation is None:  # (not answering at connect)
                                self.status(r)  # its model, rank and world size first
                            self.register(r)
                        except DeltadError as err:
                            log.warning("rank %d: re-register failed: %s", r.rank, err)
                    else:
                        log.debug("rank %d: heartbeat failed: %s", r.rank, e.code())

    # ---- discovery -------------------------------------------------------------------------

    def _rediscover(self, r: RankLink) -> None:
        """Reopen the rank's channel if its sidecar registered a new endpoint."""
        try:
            endpoint = self.discovery.registry().get(r.rank)
        except ConsumerError as e:
            log.debug("rediscovery failed: %s", e)
            return
        if endpoint and endpoint != r.endpoint:
            log.info("rank %d: sidecar moved %s -> %s", r.rank, r.endpoint, endpoint)
            r.endpoint = endpoint
            if r.channel is not None:
                r.channel.close()
            self.open(r)


def _trailing(e: grpc.RpcError, key: str) -> str | None:
    """The value of ``key`` in a failed call's trailing metadata (None: absent)."""
    try:
        for k, value in e.trailing_metadata() or ():  # type: ignore[attr-defined]
            if k == key:
                return str(value)
    except (TypeError, AttributeError):
        pass
    return None


def refusal(e: grpc.RpcError) -> str:
    """The kind of refusal a sidecar named in the trailing metadata (``deltad.wire.REFUSAL_KEY``;
    "" if none)."""
    return _trailing(e, wire.REFUSAL_KEY) or ""


def retry_after(e: grpc.RpcError) -> float | None:
    """The wait (seconds) a sidecar suggested in a refusal's trailing metadata, if any."""
    value = _trailing(e, wire.RETRY_AFTER_KEY)
    try:
        return None if value is None else min(60.0, max(0.0, int(value) / 1000))
    except ValueError:
        return None


def _unknown(rollout_state: str) -> str:
    """Why a Status's release state is not known ("" if it is, or is not sent)."""
    if '"unknown":true' not in rollout_state:
        return ""
    try:
        return str(json.loads(rollout_state).get("why", "not known"))[:300]
    except ValueError:
        return "not known"
