"""Relay sidecars: ``deltad serve --upstream HOST:PORT`` mirrors one rank's log from an upstream
sidecar (or another relay) into its own spool and serves it to its own predictors.

::

    relay = RelayServer(ServerConfig(spool_dir=..., model="m", rank=0, listen=...),
                        RelayConfig(upstream="sidecar-0:50051", consumer="relay-a")).start()

A relay is an ordinary sidecar (:class:`~deltad.serve.edge.app.SidecarServer`: its own spool, its
own Redis with its own consumers' cursors, retention, every GetDelta form, top-k with owed rows
per downstream consumer) whose spool is written by :class:`RelayMirror` instead of a trainer.
The mirror is a consumer of the upstream: rows form, fp32 on the wire (exact for fp32, fp16 and
bf16 tables), at-least-once, committed under ``RelayConfig.consumer``.

Numbering: **one local segment per upstream pull**, with the upstream's generation, seqs and
steps. A pull of the upstream window ``(from, to]`` at step ``s`` becomes one segment
``first_seq = local head + 1, seq = to, step = s`` (a merged segment in the log's sense: it
stands for upstream segments ``head+1..to``); a resync pull (the upstream's full tables at
``to``) becomes a base ``0..to``. So a cursor ``(generation, seq, step)`` means the same state
at every level of a tree; a relay's log is only coarser where it pulled several upstream
segments at once (after falling behind). A predictor aligning several ranks on one step gets
no step a rank's relay skipped: such a pull is dropped and retried until the relays' heads
meet, which they do once every relay keeps up (each then pulls one upstream segment at a
time). Creation times are the upstream's too, so ``head_age_seconds`` is the age of the rows.

Durability: a mirrored segment is written atomically (and fsynced, ``RelayConfig.fsync``)
before the upstream cursor is committed, so a relay killed at any point restarts with a local
head at or past its upstream cursor. The upstream then re-sends ``(cursor, to]``; the relay
writes ``(local head, to]`` from it (a superset of the rows since its head, latest values: exact
for ids and rows) or nothing if it already has ``to``, and commits. An upstream cursor past
the local head (the relay's spool was lost) makes it ask for the full tables (``from_base``).

Generations: a resync of a newer upstream generation writes that generation's manifest (tables
from the upstream's Status) and its base; the relay's log switches to it like a sidecar's does
when its trainer restarts. The mirror asks for no generation diff (it needs a base to write);
the relay's own consumers get generation diffs from the previous generation's log it holds
(deltad.serve.windows.gendiff), or resync.

Dense states: the mirror pulls ``with_dense``; a window carrying one (the upstream's newest at or
before its head, with its seq and step) is written as ``dense-<seq>`` *before* the window's
segment, exactly as the trainer's publisher does, so the relay's log (its retention, its
generation diffs, its ``dense_steps``) serves it like a sidecar serves the trainer's, at every
level of a tree. A window the relay serves ``with_dense`` whose dense state it knows it lacks
(the upstream listed a newer dense state at or before the window's step than the relay holds,
or the upstream said its own window lacked one) says so in ``DeltaHeader.dense_missing``:
:meth:`RelayMirror.dense_missing`, so a predictor never looks caught up on init weights.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.experimental
import torch

from deltad import wire
from deltad.clientauth import ClientAuth
from deltad.config import RelayConfig, ServerConfig
from deltad.consume import decode
from deltad.consume.window import RankDelta, ShardUpdate
from deltad.errors import DeltadError, UpstreamError
from deltad.segment.format import ShardRows, encode_dense, write_dense, write_segment
from deltad.segment.spool import GenerationManifest, SpoolLayout, TableInfo
from deltad.serve.edge.app import SidecarServer
from deltad.serve.index.log import LogSnapshot
from deltad.serve.state.release import FollowedRollout
from deltad.types import SegmentKind, Shard, ShardKey
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", wire.CONSUMER_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
]
#: Commit answers no retry changes: the upstream refuses this cursor for good.
_FINAL_COMMIT = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class _Local:
    """The head of the relay's own log: what it holds, and how to write more of it."""

    generation: int
    seq: int
    step: int
    world_size: int
    #: every (table, col_start, col_end) of the base, in order, with its shard's row range
    ranges: dict[ShardKey, tuple[int, int]]
    dtypes: dict[str, torch.dtype]


#: Answers that mean the upstream refuses this relay's credentials or scope (no retry helps
#: until someone fixes them): readiness turns NOT_SERVING.
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
#: Transport failures that are a TLS refusal (wrong CA, rejected client certificate), not
#: an upstream that is down.
_TLS_REFUSAL = ("ssl", "handshake", "certificate", "tls")


def refuses(e: grpc.RpcError) -> bool:
    """Whether ``e`` is the upstream refusing the relay (credentials, scope or TLS trust)."""
    if e.code() in _REFUSED:
        return True
    details = (e.details() or "").lower()
    return e.code() == grpc.StatusCode.UNAVAILABLE and any(w in details for w in _TLS_REFUSAL)


def _worth_commit(d: RankDelta) -> bool:
    return d.resync or d.rows > 0 or d.to_seq != d.from_seq


class RelayMirror:
    """Mirrors the upstream's log of one rank into ``server``'s spool (see the module doc).

    :meth:`start` runs :meth:`step` on a thread until :meth:`stop`; an upstream that is down
    is retried with bounded exponential backoff forever (the relay keeps serving what it has).
    An upstream of another model or rank is fatal: ``error`` is set and ``on_fatal`` called.
    """

    def __init__(
        self,
        config: RelayConfig,
        server: SidecarServer,
        on_fatal: Callable[[DeltadError], None] | None = None,
    ) -> None:
        self.config = config
        self.server = server
        self.layout: SpoolLayout = server.layout
        self.model = server.config.model
        self.rank = server.config.rank
        self.on_fatal = on_fatal
        self.error: DeltadError | None = None
        #: upstream pulls made and local segments written (for tests and logs)
        self.pulls = 0
        self.written = 0
        self._auth = ClientAuth(
            token=config.token,
            token_file=config.token_file,
            tls_ca=config.tls_ca,
            tls_cert=config.tls_cert,
            tls_key=config.tls_key,
        )
        self._channel = self._auth.channel(config.upstream, _CHANNEL_OPTIONS)
        self._stub = pb_grpc.DeltaServiceStub(self._channel)
        self._local = self._read_local()
        self._registered = False
        self._needs_base = self._local is None
        self._pending: pb.Cursor | None = None
        #: (generation, seq) committed upstream, as far as the relay knows
        self._committed: tuple[int, int] | None = None
        self._touched = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_problem = ""
        self._waited_s = 0.0
        self._rollout_version = 0
        #: the upstream's dense steps (its last Status) and generation, and why its last
        #: window lacked a dense state ("" if it did not): what dense_missing compares with
        self._up_dense: tuple[int, tuple[int, ...]] = (-1, ())
        self._up_dense_missing = ""
        #: dense state files written (for tests and logs)
        self.dense_written = 0

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return self._auth.metadata()

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> RelayMirror:
        self._thread = threading.Thread(target=self._run, name="deltad-relay", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop mirroring: an upstream call in flight is cancelled (closing the channel), so
        this returns at once; nothing half-written is committed."""
        self._stop.set()
        self._channel.close()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        c = self.config
        delay = c.backoff_initial_s
        while not self._stop.is_set():
            refused = False
            try:
                pulled = self.step()
                delay = c.backoff_initial_s
                self.server.set_problem("upstream", None)
                if self._last_problem:
                    log.info("upstream %s: mirroring again", c.upstream)
                    self._last_problem = ""
                if not pulled:  # a long poll that ran out waited already: at most top up
                    self._stop.wait(max(0.0, c.poll_interval_s - self._waited_s))
                continue
            except UpstreamError as e:
                self.error = e
                log.error("relay stops: %s", e)
                if self.on_fatal is not None:
                    self.on_fatal(e)
                return
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return  # cancelled by stop()
                problem = f"{e.code().name}: {e.details()}"
                refused = refuses(e)
                if refused:  # readiness says so (one line per change, by set_problem)
                    self.server.set_problem(
                        "upstream", f"upstream {c.upstream} refuses this relay: {problem[:300]}"
                    )
            except DeltadError as e:
                if self._stop.is_set():
                    return
                problem = str(e)
            except Exception as e:  # a bug must not end mirroring silently
                if self._stop.is_set():
                    return
                log.exception("relay step failed")
                problem = repr(e)
            if problem != self._last_problem and not refused:  # once per kind, not per retry
                log.warning("upstream %s: %s (retrying)", c.upstream, problem)
                self._last_problem = problem
            self._stop.wait(delay * (0.5 + random.random() / 2))
            delay = min(delay * 2, c.backoff_max_s)

    # ---- one round -------------------------------------------------------------------------

    def step(self) -> bool:
        """Register if needed, flush a pending commit, pull if the upstream moved; True if
        it pulled. gRPC errors propagate (the loop retries them). Credential files that
        changed are re-read first (a new channel if the TLS files did)."""
        if self._auth.tls_changed():
            log.info("upstream %s: new TLS credentials, reconnecting", self.config.upstream)
            self._channel.close()
            self._channel = self._auth.channel(self.config.upstream, _CHANNEL_OPTIONS)
            self._stub = pb_grpc.DeltaServiceStub(self._channel)
        if not self._registered:
            self._register()
        if self._pending is not None:
            self._commit()
        asked = time.time()
        st = self._status()
        self._follow(st)
        if st.model != self.model or st.rank != self.rank:
            raise UpstreamError(
                f"upstream {self.config.upstream} serves model {st.model!r} rank {st.rank}; "
                f"this relay serves model {self.model!r} rank {self.rank}"
            )
        self._up_dense = (st.generation, tuple(int(t) for t in st.dense_steps))
        loc = self._local
        head = (st.generation, st.head_seq)
        if st.head_seq < 0 or (
            loc is not None
            and st.generation == loc.generation
            and st.head_seq <= loc.seq
            and self._committed is not None
            and self._committed >= head
        ):
            self._keep_lease()
            return False
        if loc is not None and st.generation < loc.generation:
            raise UpstreamError(
                f"upstream {self.config.upstream} is at generation {st.generation}, older than "
                f"the relay's {loc.generation} (another trainer's log?)"
            )
        self._pull(st, asked)
        return True

    def _follow(self, st: pb.StatusResponse) -> None:
        """Take the upstream's release state (rollout-control, issue 21): the relay applies
        it to its own consumers (deltad.serve.state.release.FollowedRollout)."""
        follow = getattr(self.server, "rollout", None)
        if isinstance(follow, FollowedRollout):
            follow.follow(st.rollout_state)
            self._rollout_version = st.rollout_version

    def _status(self) -> pb.StatusResponse:
        """The upstream's Status; a long poll (answered when its head passes the relay's)
        when the relay holds a log and owes no commit. Sets ``_waited_s``: how long the
        upstream held the call (0 when it did not wait), so the loop polls again at once
        after a wait that ran out, and after ``poll_interval_s`` otherwise."""
        c = self.config
        loc, wait = self._local, min(c.long_poll_s, c.lease_ttl_s / 3)
        req = pb.StatusRequest()
        idle = (
            loc is not None
            and self._pending is None
            and not self._needs_base
            and self._committed is not None
            and self._committed >= (loc.generation, loc.seq)
        )
        if idle and loc is not None and wait > 0:
            req = pb.StatusRequest(
                after_generation=loc.generation, after_seq=loc.seq, wait_ms=int(wait * 1000),
                after_rollout_version=self._rollout_version,
            )  # fmt: skip
        start = time.monotonic()
        st = self._stub.Status(
            req, timeout=min(10.0, c.rpc_deadline_s) + req.wait_ms / 1000,
            metadata=self._metadata,
        )  # fmt: skip
        self._waited_s = time.monotonic() - start if st.waited else 0.0
        return st

    def _pull(self, st: pb.StatusResponse, asked: float) -> None:
        req = pb.GetDeltaRequest(
            consumer=self.config.consumer, form=pb.FORM_ROWS, dtype=pb.WIRE_DTYPE_FP32,
            from_base=self._needs_base, no_generation_diff=True, mirror=True, with_dense=True,
        )  # fmt: skip
        d = decode.pull(
            self._channel, req, timeout=self.config.rpc_deadline_s, metadata=self._metadata
        )
        self.pulls += 1
        self._touched = time.monotonic()
        if d.rank != self.rank:
            raise UpstreamError(f"upstream answered rank {d.rank} for rank {self.rank}")
        self._up_dense_missing = d.dense_missing
        same = d.generation == st.generation and d.to_seq == st.head_seq
        created = asked - st.head_age_seconds if same else time.time()
        loc = self._local
        if loc is None or d.generation > loc.generation:
            if not d.resync:
                log.warning("upstream sent a delta of an unseen generation: asking for its base")
                self._needs_base = True
                return
            if d.generation != st.generation:  # the tables to declare are of d's generation
                st = self._stub.Status(
                    pb.StatusRequest(), timeout=min(10.0, self.config.rpc_deadline_s),
                    metadata=self._metadata,
                )  # fmt: skip
                if d.generation != st.generation:
                    return  # the upstream moved again meanwhile; pull again (nothing committed)
            self._write_base(d, created, _manifest(st, d))
        elif d.generation < loc.generation:
            raise UpstreamError(
                f"upstream {self.config.upstream} sent generation {d.generation}, older than "
                f"the relay's {loc.generation}"
            )
        elif d.resync:
            if d.to_seq > loc.seq:
                self._write_base(d, created, None)
        elif d.from_seq > loc.seq:
            log.warning(
                "upstream cursor seq %d is past the relay's head %d (its spool was lost?): "
                "asking for the full tables",
                d.from_seq,
                loc.seq,
            )
            self._needs_base = True
            return
        elif d.to_seq > loc.seq:
            self._write_delta(d, created)
        self._needs_base = False
        if _worth_commit(d):
            self._pending = wire.cursor_to_pb(d.cursor)
            self._commit()

    # ---- the local spool -------------------------------------------------------------------

    def _read_local(self) -> _Local | None:
        self.server.log.refresh()
        snap = self.server.log.snapshot()
        if snap is None:
            return None
        ranges = {k: (c.shard.row_start, c.shard.row_end) for k, c in snap.base.shards.items()}
        return _Local(
            snap.generation,
            snap.head.seq,
            snap.head.step,
            snap.manifest.world_size,
            ranges,
            {t.name: _DTYPES.get(t.dtype, torch.float32) for t in snap.manifest.tables},
        )

    def _write_base(
        self, d: RankDelta, created: float, manifest: GenerationManifest | None
    ) -> None:
        loc = self._local
        if manifest is not None:
            self.layout.write_manifest(manifest, fsync=self.config.fsync)
            dtypes = {t.name: _DTYPES.get(t.dtype, torch.float32) for t in manifest.tables}
            world = manifest.world_size
        else:
            assert loc is not None
            dtypes, world = loc.dtypes, loc.world_size
        ranges: dict[ShardKey, tuple[int, int]] = {}
        rows = []
        for s in d.shards:
            ids, values, raw = _sorted(s)
            n = ids.numel()
            # a base holds every row of the shard: its row range is that of its ids
            r0, r1 = (int(ids[0]), int(ids[-1]) + 1) if n else (0, 0)
            ranges[s.shard.key] = (r0, r1)
            rows.append(_shard_rows(s, r0, r1, ids, values, dtypes, raw))
        self._write_dense(d)
        self._write(d, SegmentKind.BASE, 0, world, rows, created)
        self._local = _Local(d.generation, d.to_seq, d.to_step, world, ranges, dtypes)

    def _write_delta(self, d: RankDelta, created: float) -> None:
        loc = self._local
        assert loc is not None
        got = {s.shard.key: s for s in d.shards}
        unknown = set(got) - set(loc.ranges)
        if unknown:
            raise UpstreamError(f"upstream sent shards {sorted(unknown)} its base did not have")
        rows = []
        for key, (r0, r1) in loc.ranges.items():
            s = got.get(key)
            if s is None:
                continue
            ids, values, raw = _sorted(s)
            rows.append(_shard_rows(s, r0, r1, ids, values, loc.dtypes, raw))
        self._write_dense(d)
        self._write(d, SegmentKind.DELTA, loc.seq + 1, loc.world_size, rows, created)
        self._local = _Local(
            d.generation, d.to_seq, d.to_step, loc.world_size, loc.ranges, loc.dtypes
        )

    def _write_dense(self, d: RankDelta) -> None:
        """The window's dense state as ``dense-<seq>`` (before the segment that makes it
        visible: a log that sees segment ``to_seq`` finds it), unless the relay has it."""
        if d.dense_seq is None or d.dense_step is None:
            return
        path = self.layout.dense_path(d.generation, self.rank, d.dense_seq)
        if path.exists():
            return
        data = encode_dense(
            model=self.model, generation=d.generation, rank=self.rank, seq=d.dense_seq,
            step=d.dense_step, tensors=d.dense,
        )  # fmt: skip
        write_dense(path, data, fsync=self.config.fsync)
        self.dense_written += 1

    def dense_missing(self, snap: LogSnapshot, to_seq: int, to_step: int) -> str:
        """Why a window of the relay's log ending at ``to_seq`` (step ``to_step``) lacks the
        dense state it should carry; "" if it does not (or the relay cannot tell): the
        upstream said its window lacked one, or the upstream serves a dense state at or
        before ``to_step`` newer than any the relay holds at or before ``to_seq``."""
        up = self.config.upstream
        if self._up_dense_missing:
            return f"upstream {up}: {self._up_dense_missing}"[:512]
        generation, steps = self._up_dense
        if generation != snap.generation:
            return ""
        expected = max((t for t in steps if t <= to_step), default=None)
        if expected is None:
            return ""
        held = snap.dense_at(to_seq)
        if held is not None and held.step >= expected:
            return ""
        return (
            f"relay of {up} holds no dense state of step {expected} (newest held: "
            f"{'none' if held is None else held.step}); its upstream serves it"
        )

    def _write(
        self,
        d: RankDelta,
        kind: SegmentKind,
        first_seq: int,
        world: int,
        rows: list[ShardRows],
        created: float,
    ) -> None:
        write_segment(
            self.layout.segment_path(d.generation, self.rank, d.to_seq),
            model=self.model,
            generation=d.generation,
            rank=self.rank,
            world_size=world,
            seq=d.to_seq,
            first_seq=first_seq,
            step=d.to_step,
            kind=kind,
            shards=rows,
            fsync=self.config.fsync,
            created_unix=created,
        )
        self.written += 1
        self.server.log.refresh()  # serve it now, not at the next poll

    # ---- small upstream RPCs ---------------------------------------------------------------

    def _register(self) -> None:
        resp = self._stub.Register(
            pb.RegisterRequest(
                consumer=self.config.consumer, lease_ttl_seconds=self.config.lease_ttl_s
            ),
            timeout=min(10.0, self.config.rpc_deadline_s),
            metadata=self._metadata,
        )
        c, loc = resp.cursor, self._local
        self._committed = (c.generation, c.seq) if c.seq >= 0 else None
        if loc is None:
            self._needs_base = True
        elif c.seq >= 0 and (
            c.generation > loc.generation or (c.generation == loc.generation and c.seq > loc.seq)
        ):
            # committed upstream past what the spool holds: the spool was lost or replaced
            log.warning(
                "upstream cursor (generation %d seq %d) is past the relay's head (generation "
                "%d seq %d): the first pull asks for the full tables",
                c.generation,
                c.seq,
                loc.generation,
                loc.seq,
            )
            self._needs_base = True
        self._registered = True
        self._touched = time.monotonic()

    def _keep_lease(self) -> None:
        if time.monotonic() - self._touched < self.config.lease_ttl_s / 3:
            return
        try:
            self._stub.Heartbeat(
                pb.HeartbeatRequest(consumer=self.config.consumer),
                timeout=min(10.0, self.config.rpc_deadline_s),
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            self._register()  # the lease expired: take it again
        self._touched = time.monotonic()

    def _commit(self) -> None:
        cursor = self._pending
        assert cursor is not None
        try:
            self._stub.Commit(
                pb.CommitRequest(consumer=self.config.consumer, cursor=cursor),
                timeout=min(10.0, self.config.rpc_deadline_s),
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            if e.code() not in _FINAL_COMMIT:
                raise
            # refused for good (superseded, older generation, forgotten): the next pull
            # re-sends whatever is not committed, and the relay already holds it
            log.warning("upstream refused the commit of seq %d: %s", cursor.seq, e.details())
        self._committed = max(self._committed or (-1, -1), (cursor.generation, cursor.seq))
        self._pending = None


def _sorted(s: ShardUpdate) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The shard's ids ascending (segments require it) with their values (and raw ids, of a
    managed-collision shard)."""
    ids, raw = s.ids, s.raw_ids
    assert s.values is not None, "a rows-form pull carries values"
    values = s.values
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        order = torch.argsort(ids)
        ids, values = ids[order], values[order]
        raw = None if raw is None else raw[order]
    return ids, values, raw


def _shard_rows(
    s: ShardUpdate,
    r0: int,
    r1: int,
    ids: torch.Tensor,
    values: torch.Tensor,
    dtypes: dict[str, torch.dtype],
    raw: torch.Tensor | None = None,
) -> ShardRows:
    # fp32 on the wire carries fp16 / bf16 table values exactly: cast back to the table's dtype
    # (a managed-collision shard keeps its raw ids and the window's evicted: version 3)
    sh = s.shard
    dtype = dtypes.get(sh.table, torch.float32)
    evicted = s.evicted_raw_ids
    return ShardRows(
        Shard(sh.table, sh.num_rows, sh.dim, r0, r1, sh.col_start, sh.col_end),
        ids.contiguous(),
        values.to(dtype).contiguous(),
        None if raw is None else raw.contiguous(),
        None if raw is None or evicted is None else evicted.contiguous(),
    )


def _manifest(st: pb.StatusResponse, d: RankDelta) -> GenerationManifest:
    """The generation manifest a relay writes for ``d``'s generation, from the upstream's
    Status (the owning module's name does not travel: it is empty)."""
    return GenerationManifest(
        model=st.model,
        generation=d.generation,
        world_size=st.world_size,
        start_step=d.to_step,
        created_unix=time.time(),
        tables=tuple(
            TableInfo(
                t.table,
                t.num_rows,
                t.dim,
                t.dtype,
                "",
                t.kind,
                t.sharding_type,
                managed_collision=t.managed_collision,
            )
            for t in st.tables
        ),
    )


def clean_temp_files(layout: SpoolLayout, rank: int) -> int:
    """Delete segment temp files a killed relay left in its rank's directories; return how
    many (only the relay writes there, and it has not started yet)."""
    gone = 0
    for g in layout.generations():
        d: Path = layout.rank_dir(g, rank)
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            if n.startswith(".tmp-"):
                (d / n).unlink(missing_ok=True)
                gone += 1
    return gone


class RelayServer:
    """A sidecar whose spool a :class:`RelayMirror` fills from ``relay.upstream``.

    Same surface as :class:`~deltad.serve.edge.app.SidecarServer` (``start``, ``port``,
    ``endpoint``, ``stop``, ``wait``); Status says ``upstream``. ``wait`` also returns when
    the mirror stopped for good (``error``: an upstream of another model or rank).
    """

    def __init__(self, config: ServerConfig, relay: RelayConfig) -> None:
        self.config = config
        self.relay = relay
        self.server = SidecarServer(config, relay=True)
        self.mirror: RelayMirror | None = None
        self._failed = threading.Event()

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    @property
    def error(self) -> DeltadError | None:
        return self.mirror.error if self.mirror is not None else None

    def start(self) -> RelayServer:
        """Clean temp files, start the sidecar, then the mirror; raises DeltadError."""
        layout = SpoolLayout(self.config.spool_dir, self.config.model)
        n = clean_temp_files(layout, self.config.rank)
        if n:
            log.info("deleted %d temp file(s) of an interrupted write", n)
        self.server.start()
        try:
            self.server.servicer.upstream = self.relay.upstream
            self.mirror = RelayMirror(self.relay, self.server, lambda e: self._failed.set())
            self.server.servicer.windows.dense_check = self.mirror.dense_missing
            self.mirror.start()
        except BaseException:
            self.server.stop(0)
            raise
        return self

    def stop(self, grace: float | None = None) -> None:
        if self.mirror is not None:
            self.mirror.stop()
        self.server.stop(grace)

    def reload_credentials(self) -> bool:
        """Re-read the relay's own tokens file (SIGHUP), as a sidecar does."""
        return self.server.reload_credentials()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops or the mirror failed (True), or ``timeout`` (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._failed.is_set() or self.server.wait(0):
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._failed.wait(0.2 if left is None else min(0.2, left))
