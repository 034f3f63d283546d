"""The consumer library: read every rank's window from its sidecar, apply, commit.

::

    with DeltaConsumer(ConsumerConfig("ranker-1", sidecars=("h0:50051", "h1:50051"))) as c:
        result = c.pull()             # every rank's window, in parallel, step-aligned
        applier.apply(result.deltas)  # your tables now serve result.step
        c.commit(result)              # only now do the cursors move (at-least-once)

or ``c.sync(applier.apply)`` for all three. Sidecars come from a static list (index = rank) or from
Redis (``RedisKeys.ranks``). Every RPC has a deadline and bounded retries with exponential
backoff; gRPC errors become :class:`deltad.errors.ConsumerError` at this boundary. Credentials
(``token``/``token_file``, ``tls_ca``, and ``tls_cert``/``tls_key`` for sidecars that require
mTLS) are re-read when their files change, before the next call or reconnect (see
deltad.consume.sidecars, which holds the connections; this module builds pulls and commits).

Multi-rank alignment (``align_steps``; the step is chosen in :mod:`deltad.consume.align`): each
pull first asks every sidecar's Status for its head step and requests ``max_step = min`` over
ranks (with ``PullOptions.dense``, when the trainer publishes dense states: the newest step at
or below it that has one, so the rows and the dense weights applied are of that one step); it
applies only if every rank answered with the same generation and step, so a predictor never
serves a mix of two model versions. Otherwise the whole pull is dropped uncommitted
(``PullResult.missing`` says why) and the rows come again next time. A commit that fails
(sidecar down) stays pending and is retried before that rank's next pull; commits only move
forward, so none is lost or duplicated.

Bootstrap memory: ``c.sync(applier.apply)`` (or ``c.pull(applier=applier)`` then
``applier.apply(result.deltas)``) streams every resync window's rows into the applier's staged
tables as the chunks arrive (:class:`deltad.consume.appliers.ResyncStage`), instead of
assembling the whole window first: a bootstrap costs the tables once, not twice. One stage
serves all ranks of a pull; it is discarded (the held tables untouched, the ranks' rows come
again next pull) whenever the pull's windows are not all handed to the caller: a rank that
failed after it staged rows, a dropped aligned pull, the applier refusing a table.

``auto_commit`` (at-most-once, for simple readers): without alignment the server commits as
each stream completes; with alignment the client commits right after every rank answered,
so a pull it drops (ranks disagree) is never committed.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc

from deltad import wire
from deltad.config import ConsumerConfig
from deltad.consume import align, decode, longpoll
from deltad.consume.appliers import Applier, ResyncStage
from deltad.consume.pullstage import keep_stage
from deltad.consume.result import PullResult
from deltad.consume.sidecars import RankLink, RankStatus, Sidecars
from deltad.consume.window import Cursor, RankDelta
from deltad.errors import (
    ConfigError,
    ConsumerError,
    HeldStateRefused,
    OverloadedError,
    SidecarUnavailableError,
    WindowRefused,
)
from deltad.v1 import delta_pb2 as pb

__all__ = ["DeltaConsumer", "PullResult", "RankStatus"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The backoff after a refused window: from max(backoff_initial_s, this) ...
REFUSED_BACKOFF_MIN_S = 0.5
#: ... doubling up to this (a window refused again and again: e.g. a trainer whose identities
#: disagree across ranks, until it writes fresh bases).
REFUSED_BACKOFF_MAX_S = 30.0


class DeltaConsumer:
    """A named consumer reading every rank of one model (see the module docstring).

    The library leaves the process's allocator alone; a predictor that rebuilds large windows
    should call :func:`deltad.perf.tune_malloc` at startup, as ``deltad consume`` does.
    """

    def __init__(self, config: ConsumerConfig) -> None:
        self.config = config
        if not config.sidecars and not config.redis_url:
            raise ConsumerError("set sidecars (one per rank) or redis_url for discovery")
        self._sidecars = Sidecars(config)
        self._connected = False
        #: windows refused in a row (reset by a commit) and when the next pull may start
        self.refusals = 0
        self.refusals_total = 0
        self._retry_at = 0.0
        #: rank -> (generation, seq, step) this consumer's tables hold and its pulls name,
        #: until a commit from it is acknowledged (:meth:`hold`, ``config.holding``)
        self._held: dict[int, tuple[int, int, int]] = {
            rank: (gen, seq, step) for rank, gen, seq, step in config.holding
        }

    # ---- lifecycle -------------------------------------------------------------------------

    def connect(self) -> DeltaConsumer:
        """Resolve the sidecars, check them, register the consumer on every rank, start
        heartbeats.

        Every sidecar's Status must name ``config.model``, the rank it is listed as, and as
        many ranks as are listed (else ConfigError: fewer sidecars would serve partial
        tables). A sidecar that does not answer only delays its rank (the heartbeat thread
        checks and registers it later; pulls report it in ``missing``, and the first of its
        answers that fails the check raises ConfigError from the pull); any other failure
        raises ConsumerError.

        After :meth:`close`, ``connect()`` starts afresh, as a new DeltaConsumer of the same
        config would (each rank's first pull then sends its full tables, unless ``resume``).
        """
        if self._connected:
            return self
        if self._sidecars.closed.is_set():  # closed before: new connections, fresh state
            self._sidecars = Sidecars(self.config)
        try:
            self._connect()
        except BaseException:
            self.close()
            raise
        return self

    def _connect(self) -> None:
        self._sidecars.open_all()
        self._connected = True
        # Every sidecar's model, rank and world size before the consumer registers anywhere
        # (Sidecars.check raises ConfigError): one of another model would serve, and record
        # this consumer, as if it were of this one.
        answered = []
        for r, st in zip(self._ranks, self._parallel(self._sidecars.status), strict=True):
            if isinstance(st, SidecarUnavailableError):
                log.warning("rank %d: not answering yet: %s", r.rank, st)
            elif isinstance(st, Exception):
                raise st
            else:
                answered.append(r)
        registered = self._parallel(self._sidecars.register, answered)
        for r, resp in zip(answered, registered, strict=True):
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
        self._sidecars.start_heartbeats()

    def close(self) -> None:
        """Stop heartbeats and close the channels (pending commits are not flushed). A
        second close() does nothing; :meth:`connect` after it starts afresh."""
        self._sidecars.close()
        self._connected = False

    @property
    def _ranks(self) -> list[RankLink]:
        return self._sidecars.ranks

    def _parallel(
        self, fn: Callable[[RankLink], T], ranks: Sequence[RankLink] | None = None
    ) -> list[T | Exception]:
        return self._sidecars.parallel(fn, ranks)

    def _require_connected(self) -> None:
        if not self._connected:
            raise ConsumerError("DeltaConsumer is not connected (use connect() or `with`)")

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
        for res in self._parallel(self._sidecars.status):
            if isinstance(res, Exception):
                raise res
            out.append(res)
        return out

    def pull(self, *, applier: Applier | None = None) -> PullResult:
        """Read every rank's window (aligned on one trainer step when ``align_steps``).

        With ``applier``, resync windows are streamed into its stage (:meth:`Applier.stage`)
        as they arrive: apply the result with that applier (``applier.apply(result.deltas)``).
        A streamed window the applier refuses comes back as a result with no deltas and
        ``refused`` set (see :meth:`refuse`). After a refusal this first waits out its
        backoff (``retry_in_s``), unless that time has passed.
        """
        wait = self._retry_at - time.monotonic()
        if wait > 0:  # the backoff after a refused window (see refuse())
            self._sidecars.closed.wait(wait)
        started = time.monotonic()
        stage = applier.stage() if applier is not None else None
        try:
            result = self._pull(stage)
        except BaseException:
            if stage is not None:
                stage.discard("the pull failed")
            raise
        if stage is not None:
            try:
                dropped = keep_stage(result, stage, self._ranks)
            except WindowRefused as e:  # the applier refused a streamed resync's rows
                self.refuse(result, e)
                result.deltas, result.step = [], None
                return result
            if dropped is not None:
                log.warning("pull %s: %s", self.config.consumer, dropped)
        log.info(
            "pull %s step %s: %s: %d rows, %d bytes, %.0f ms%s",
            self.config.consumer, result.step,
            ", ".join(
                f"rank {d.rank} seq {d.from_seq}..{d.to_seq}{' resync' if d.resync else ''}"
                for d in result.deltas
            ) or "nothing",
            result.rows, result.bytes, (time.monotonic() - started) * 1000,
            f" (missing ranks {sorted(result.missing)})" if result.missing else "",
        )  # fmt: skip
        for rank, why in result.dense_missing.items():
            log.warning("pull %s rank %d: dense state missing: %s", self.config.consumer, rank, why)
        for rank, why in result.upstream_lost.items():
            log.warning("pull %s rank %d: %s", self.config.consumer, rank, why)
        return result

    def _pull(self, stage: ResyncStage | None = None) -> PullResult:
        self._require_connected()
        result = PullResult(pulled_unix=time.time())
        flushed = self._parallel(self._sidecars.flush_pending)
        for r, res in zip(self._ranks, flushed, strict=True):
            if isinstance(res, Exception):
                _miss(result, r.rank, res, "pending commit: ")
            elif res is not None:  # a held state's window committed: its cursor is the state
                self._held.pop(r.rank, None)
        if self.config.align_steps:
            return self._handed(self._pull_aligned(result, stage))
        # A rank whose commit is still pending is not pulled: a new pull would supersede it.
        ready = self._checked([r for r in self._ranks if r.rank not in result.missing], result)
        deltas = _raise_overloaded(
            self._parallel(lambda r: self._get_delta(r, self.config.pull.max_step, stage), ready)
        )
        for r, got in zip(ready, deltas, strict=True):
            if isinstance(got, RankDelta):
                result.deltas.append(got)
            else:
                _miss(result, r.rank, got)
        # a window of a generation its sidecar was not checked at (the trainer restarted,
        # perhaps with another world size): checked before the caller gets it
        moved = [
            self._ranks[d.rank]
            for d in result.deltas
            if d.generation != self._ranks[d.rank].checked_generation
        ]
        for r, st in zip(moved, self._parallel(self._sidecars.status, moved), strict=True):
            if isinstance(st, Exception):  # (ConfigError is raised, not returned)
                log.debug("rank %d: not checked at its new generation yet: %s", r.rank, st)
        if result.deltas:
            result.step = min(d.to_step for d in result.deltas)
            result.head_step = max(d.to_step for d in result.deltas)
        return self._handed(result)

    def _checked(self, ranks: list[RankLink], result: PullResult) -> list[RankLink]:
        """``ranks`` but those not checked yet (Sidecars.check: not answering since connect,
        or nothing published then) whose Status fails now (in ``result.missing``); a check
        that fails raises ConfigError. (Aligned pulls check every rank's Status anyway.)"""
        todo = [r for r in ranks if r.checked_generation is None]
        for r, st in zip(todo, self._parallel(self._sidecars.status, todo), strict=True):
            if isinstance(st, Exception):
                _miss(result, r.rank, st)
        return [r for r in ranks if r.rank not in result.missing]

    def _handed(self, result: PullResult) -> PullResult:
        """``result`` goes to the caller. A rank whose full tables it carries no longer needs
        them once they are applied, which :meth:`commit` says; an auto-committed window
        counts as delivered now (a pull dropped before this point still needs them)."""
        for d in result.deltas:
            if d.resync and d.committed:
                self._ranks[d.rank].needs_base = False
        return result

    def refuse(self, result: PullResult, error: BaseException) -> float:
        """The applier refused ``result``'s windows (``error``; nothing was applied): never
        commit them, ask each of their ranks for its full tables at the next pull (a rebase:
        what the predictor holds is replaced whole, not patched on top of what it could not
        take), and back off: the next pull waits the returned seconds (exponential from
        ``backoff_initial_s`` to :data:`REFUSED_BACKOFF_MAX_S`, with jitter) unless the
        caller waited them already. The serving tables keep serving what they held."""
        self.refusals += 1
        self.refusals_total += 1
        for d in result.deltas:
            self._ranks[d.rank].needs_base = True
            if d.stage is not None:
                d.stage.discard("the applier refused the window")
        base = max(self.config.backoff_initial_s, REFUSED_BACKOFF_MIN_S)
        delay = min(base * 2 ** (self.refusals - 1), REFUSED_BACKOFF_MAX_S)
        delay *= 0.5 + random.random() / 2
        self._retry_at = time.monotonic() + delay
        result.refused = str(error) or type(error).__name__
        result.retry_in_s = delay
        log.warning(
            "pull %s step %s refused by the applier, nothing applied (%d in a row): %s; "
            "asking rank(s) %s for their full tables in %.1f s",
            self.config.consumer, result.step, self.refusals, result.refused,
            sorted(d.rank for d in result.deltas), delay,
        )  # fmt: skip
        return delay

    def commit(self, result: PullResult) -> list[int]:
        """Commit every rank's cursor of an applied pull; return the ranks acknowledged.

        A rank whose sidecar does not answer keeps its cursor pending; it is committed
        before that rank's next pull.
        """
        if not isinstance(result, PullResult):
            raise TypeError(f"commit() takes the PullResult of pull(), not {type(result).__name__}")
        self._require_connected()
        if result.refused is not None:
            raise ConsumerError(f"a refused pull is never committed ({result.refused})")
        if result.deltas:
            self.refusals = 0
        # (a held state's window moves nothing, but its cursor is why it was pulled: hold())
        todo = {
            d.rank: d.cursor
            for d in result.deltas
            if not d.committed and (_worth(d) or d.rank in self._held)
        }
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
        for r, res in zip(ranks, self._parallel(self._sidecars.flush_pending, ranks), strict=True):
            if isinstance(res, Exception):
                log.warning("rank %d: commit pending (%s)", r.rank, res)
            else:
                done.append(r.rank)
                self._held.pop(r.rank, None)  # its cursor is the state now
        return done

    def sync(self, apply: Callable[[Sequence[RankDelta]], object] | Applier) -> PullResult:
        """pull, ``apply(deltas)`` (e.g. ``applier.apply``), commit; return the pull.

        A window the applier refuses (:class:`~deltad.errors.WindowRefused`: nothing of it
        applied) is not committed and does not raise: the result says so (``refused``), its
        ranks send their full tables next time, after a backoff (:meth:`refuse`).

        ``applier.apply`` of deltad's appliers (or an applier itself) streams resync windows
        into the applier's stage (see :meth:`pull`); any other callable, or the ``apply`` of a
        subclass that overrides it, gets assembled windows.
        """
        if not isinstance(apply, Applier) and not callable(apply):
            raise TypeError(
                "sync() takes an applier or a callable of the deltas (applier.apply), not "
                f"{type(apply).__name__}"
            )
        applier = _applier_of(apply)
        fn = apply.apply if isinstance(apply, Applier) else apply
        result = self.pull(applier=applier)
        try:
            if result.deltas:
                try:
                    fn(result.deltas)
                except WindowRefused as e:  # nothing applied: rebase, back off, go on
                    self.refuse(result, e)
                    return result
                self.commit(result)
        finally:  # an apply that failed leaves its stage: drop the staged tables now
            for d in result.deltas:
                if d.stage is not None:
                    d.stage.discard("apply did not install it")
        return result

    def wait_for_new(self, timeout_s: float, *, stop: threading.Event | None = None) -> bool:
        """Block until a rank publishes past what this consumer has seen of it (its last
        window or Status), or ``timeout_s``; True if something is new (pull now).

        A long poll: one held Status per rank, answered by the sidecar (or relay) as soon as
        its head moves, so a follower pulls within milliseconds of a publish without polling.
        False also comes at once from a sidecar that does not hold the call (busy, or older):
        then wait your poll interval before pulling. Never raises for an unreachable sidecar
        (the next pull reports it). ``stop``, once set, ends the wait early (False).
        ``timeout_s`` <= 0 returns True at once; a sidecar holds the call at most 30 s
        (``STATUS_MAX_WAIT_S``), so a longer one (or ``inf``) returns after that.
        """
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or math.isnan(timeout_s)
        ):
            raise ConfigError(
                f"wait_for_new: timeout_s must be a number of seconds, not {timeout_s!r}"
            )
        self._require_connected()
        return longpoll.wait_for_new(self._sidecars, timeout_s, stop)

    # ---- pulls -----------------------------------------------------------------------------

    def _pull_aligned(self, result: PullResult, stage: ResyncStage | None = None) -> PullResult:
        # Streaming into ``stage`` does not change what this keeps: windows are staged as they
        # arrive, but whenever this returns without handing every rank's window to the caller
        # (a rank missing, ranks at other generations or steps), the staged rows of the ranks
        # that did answer belong to no kept window, and pull() discards the stage
        # (keep_stage: a stage is kept only if every rank that touched it is in
        # result.deltas). The target step is chosen from Status before any GetDelta, so
        # every rank's window ends at one step or the pull is dropped whole.
        statuses: dict[int, RankStatus] = {}
        for r, st in zip(self._ranks, self._parallel(self._sidecars.status), strict=True):
            if isinstance(st, RankStatus):
                statuses[r.rank] = st
            else:
                _miss(result, r.rank, st)
        if result.missing:
            return result
        heads = list(statuses.values())
        result.missing = align.unaligned(heads)
        if result.missing:
            return result
        aligned = align.align(heads, self.config.pull.max_step, self.config.pull.dense)
        result.head_step, result.cap_step = aligned.head_step, aligned.cap_step
        result.release_step = aligned.release_step
        target = aligned.target
        deltas: list[RankDelta] = []
        got_all = _raise_overloaded(self._parallel(lambda r: self._get_delta(r, target, stage)))
        for r, got in zip(self._ranks, got_all, strict=True):
            if isinstance(got, RankDelta):
                deltas.append(got)
            else:
                _miss(result, r.rank, got)
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
        result.source_unix = align.source_unix(heads, result.step)
        return result

    def hold(self, generation: int, heads: dict[int, tuple[int, int]]) -> None:
        """Pulls name the state each rank's tables hold (``heads``: rank -> (seq, step) of
        ``generation``; GetDeltaRequest.holding): a cold start's, read from the archive. A
        sidecar serves the window from it, with no rows when nothing is newer; one without
        the field serves the request as if it were not named (deltad.consume.coldstart checks
        the windows either way)."""
        self._held = {rank: (generation, seq, step) for rank, (seq, step) in heads.items()}

    def _request(self, r: RankLink, max_step: int | None) -> pb.GetDeltaRequest:
        req = wire.request_from_options(self.config.consumer, self.config.pull)
        req.from_base = r.needs_base
        if r.rank in self._held:
            gen, seq, step = self._held[r.rank]
            req.holding.generation, req.holding.seq, req.holding.step = gen, seq, step
        if self.config.align_steps:
            req.auto_commit = False  # committed by _pull_aligned once every rank agreed
        if max_step is not None:
            req.max_step = max_step
        return req

    def _get_delta(
        self, r: RankLink, max_step: int | None, stage: ResyncStage | None = None
    ) -> RankDelta:
        req = self._request(r, max_step)
        started = time.monotonic()
        broke: list[str] = []  # how the last attempt ended
        stream = decode.ResumableStream(lambda: decode.WindowAssembler(pool=r.buffers, stage=stage))

        def attempt(ch: grpc.Channel, timeout: float, md: Sequence[tuple[str, str]]) -> RankDelta:
            ask, asm = stream.next(req)
            if ask is not req:
                log.info(
                    "pull %s rank %d: resuming the stream of seq %d..%d after %d messages%s",
                    self.config.consumer, r.rank, ask.resume.from_seq, ask.resume.to_seq,
                    asm.messages, f" ({broke[-1]})" if broke else "",
                )  # fmt: skip
            try:
                # ``timeout`` (rpc_deadline_s) bounds each wait for a message, not the
                # stream: a bootstrap of a big shard may take longer (stream_deadline_s)
                return decode.pull(
                    ch, ask, timeout=max(timeout, self.config.stream_deadline_s),
                    metadata=md, stall_s=timeout, assembler=asm,
                )  # fmt: skip
            except grpc.RpcError as e:
                broke.append(f"{e.code().name}: {e.details()}")
                raise

        def call(ch: grpc.Channel, timeout: float, md: Sequence[tuple[str, str]]) -> RankDelta:
            why = f" ({broke[-1]})" if broke else ""
            # rows of a broken window in the stage: a retry from the start would stage them
            # again, possibly of a newer window, and the two cannot be told apart. The same
            # window is asked to go on where it broke instead (what arrived stays, staged or
            # assembled); a sidecar that does not serve it so spoils this pull's stage if
            # rows were staged (pull() discards it; the next pull starts over), else this
            # attempt starts over, and so do the next ones.
            staged = stage is not None and stage.touched(r.rank)
            prev = stream.last
            if staged and prev is not None and prev.messages and not stream.resumes:
                raise ConsumerError(f"rank {r.rank}: a resync stream broke after staging rows{why}")
            try:
                return attempt(ch, timeout, md)
            except decode.NotResumed as e:
                stream.declined = True
                if staged:
                    raise ConsumerError(
                        f"rank {r.rank}: a resync stream broke after staging rows{why}; {e}"
                    ) from None
                log.info("pull %s rank %d: %s; starting over", self.config.consumer, r.rank, e)
                return attempt(ch, timeout, md)

        try:
            delta = self._sidecars.retry(r, "GetDelta", call, stream.progressed)
        except HeldStateRefused as e:
            # the tables hold a state this sidecar does not serve from: its full tables next
            self._held.pop(r.rank, None)
            r.needs_base = True
            log.warning("pull %s: %s: the rank's full tables next", self.config.consumer, e)
            raise
        r.seen = max(r.seen, (delta.generation, delta.to_seq))
        if delta.committed:
            r.committed = delta.cursor
            self._held.pop(r.rank, None)
        log.debug(
            "pull %s rank %d seq %d..%d step %d%s: %d rows, %d bytes, %.0f ms",
            self.config.consumer, r.rank, delta.from_seq, delta.to_seq, delta.to_step,
            " (resync)" if delta.resync else "", delta.rows, delta.bytes,
            (time.monotonic() - started) * 1000,
        )  # fmt: skip
        return delta


def _miss(result: PullResult, rank: int, why: object, prefix: str = "") -> None:
    """``rank`` was not read this time, for ``why`` (an exception or a reason); one whose
    sidecar did not answer is in ``result.unanswered`` too."""
    result.missing[rank] = f"{prefix}{why}"
    if isinstance(why, SidecarUnavailableError):
        result.unanswered.add(rank)


def _applier_of(apply: object) -> Applier | None:
    """The applier whose stage ``sync(apply)`` streams into: ``apply`` itself, or the applier
    of a bound ``applier.apply`` whose ``apply`` is this library's (a subclass that overrides
    ``apply`` may not install stages: it gets assembled windows, unless it passes itself);
    None for any other callable (assembled windows)."""
    if isinstance(apply, Applier):
        return apply
    owner = getattr(apply, "__self__", None)
    if not isinstance(owner, Applier) or getattr(apply, "__name__", "") != "apply":
        return None
    module = getattr(getattr(type(owner), "apply", None), "__module__", "") or ""
    return owner if module.startswith("deltad.consume.") else None


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
