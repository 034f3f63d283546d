"""The reference predictor: pull every rank's window on an interval, apply it, commit.

It keeps its tables as a dict of tensors (:class:`~deltad.consume.appliers.TensorDictApplier`),
optionally starting from a ``{table: tensor}`` file, and logs per pull what it served:

* ``step`` / ``head_step`` / ``step_lag``: the trainer step its tables serve vs the newest
  step any rank has published;
* ``freshness_s``: seconds from the creation of the newest segment of ``step`` (the last
  rank to publish it) to the moment its rows were applied, sampled when a new step is served;
* ``rows`` / ``bytes``: what the pull carried; ``owed``: top-k rows still owed;
* ``cap_step`` / ``caught_up``: the model's release cap on it (deltad rollout) and whether it
  serves the newest step it may.

With ``serving`` set it holds a torchrec quantized ClickModel instead
(:mod:`consumers.serving`), bootstrapped from deltad alone, answers forwards on a fixed batch
in a thread while it syncs, and reports their latency during apply and idle.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from deltad.config import ConsumerConfig
from deltad.consume.appliers import Applier, TensorDictApplier
from deltad.consume.client import DeltaConsumer, PullResult
from deltad.consume.quant import QuantApplier
from deltad.errors import ConfigError, ConsumerError, WindowRefused
from deltad.types import Form
from deltad.v1 import delta_pb2 as pb

from .metrics import PredictorMetrics
from .serving import ForwardLoop, ServingConfig, build_serving_model, save_state, zch_probe

log = logging.getLogger(__name__)

#: raw ids reported evicted kept per managed-collision table (for the exit probe)
MAX_EVICTED = 65536


@dataclass
class SyncLoopConfig:
    """What `deltad consume` runs (a :class:`SyncLoop`)."""

    consumer: ConsumerConfig
    interval_s: float = 0.5
    #: > 0: follow the trainer: between pulls wait up to this long for a rank to publish
    #: (DeltaConsumer.wait_for_new, a long poll) and pull at once when one does; sidecars that
    #: do not hold the call leave it polling every ``interval_s``. 0: pull every interval.
    long_poll_s: float = 0.0
    #: Stop after this many seconds / pulls (0 = no limit; SIGTERM / stop() also stop it).
    duration_s: float = 0.0
    pulls: int = 0
    init_tables: Path | None = None
    final_tables: Path | None = None
    #: JSON lines, one per pull and a summary ("-" = stdout).
    json_log: str | None = None
    #: Serve a quantized reference model (and write its state at exit) instead of a dict.
    serving: ServingConfig | None = None
    #: Prometheus /metrics of the predictor on this port (0: any free port; None: none), bound
    #: to ``metrics_addr`` (:mod:`consumers.metrics`).
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"


@dataclass
class PullLogLine:
    """One line of the predictor's log."""

    event: str
    consumer: str
    t: float
    pull: int
    step: int | None
    head_step: int | None
    step_lag: int | None
    freshness_s: float | None
    rows: int
    bytes: int
    owed: int
    resync: bool
    #: a new generation that came as the rows that differ, not as a full resync
    generation_diff: bool = False
    missing: dict[int, str] = field(default_factory=dict)
    pull_s: float = 0.0
    apply_s: float = 0.0
    #: bytes of dense state received (counted in ``bytes`` too) and the step it is of
    dense_bytes: int = 0
    dense_step: int | None = None
    #: an operator's rollback this pull followed (the step it was ordered to); None: none
    rollback_to: int | None = None
    #: the model's release cap on this predictor (None: the head) and whether it serves the
    #: newest step it may (a held predictor is caught up to the release, not behind)
    cap_step: int | None = None
    caught_up: bool = False
    #: ranks whose sidecar says the pull lacks the dense state it should bring, and why
    #: (the rows are of ``step``, the dense weights older: not caught up)
    dense_missing: dict[int, str] = field(default_factory=dict)
    #: ranks served by a relay that lost its upstream, and why (not caught up)
    upstream_lost: dict[int, str] = field(default_factory=dict)
    #: why the applier refused this pull's windows (None: applied). Nothing of them was
    #: applied or committed: the model serves ``step`` as before; the ranks send their full
    #: tables at the next pull, ``retry_in_s`` later
    refused: str | None = None
    retry_in_s: float = 0.0


@dataclass
class SyncSummary:
    """Totals of a sync loop's run (the last line of its log)."""

    event: str
    consumer: str
    pulls: int
    rows: int
    bytes: int
    step: int | None
    freshness_p50_s: float | None
    freshness_p99_s: float | None
    freshness_samples: int
    #: serving model only: forward latency (ms) while an apply ran / while idle
    forwards: int = 0
    forward_idle_p50_ms: float | None = None
    forward_idle_p99_ms: float | None = None
    forward_apply_p50_ms: float | None = None
    forward_apply_p99_ms: float | None = None
    forward_apply_samples: int = 0
    #: serving model only: the longest write-lock hold of an apply (ms)
    max_hold_ms: float | None = None
    #: bytes of dense state received (counted in ``bytes`` too)
    dense_bytes: int = 0
    #: pulls whose windows the applier refused (nothing of them applied)
    refused: int = 0


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return float(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1])


class SyncLoop:
    """The reference predictor's sync loop: holds the tables (or a serving model) and runs
    the pull / apply / commit loop; forwards, if any, run in :class:`ForwardLoop`."""

    def __init__(self, config: SyncLoopConfig) -> None:
        self.config = config
        self.applier: Applier
        self.model: torch.nn.Module | None = None
        self.forwards: ForwardLoop | None = None
        self.max_hold_s = 0.0
        if config.serving is not None:
            if config.init_tables is not None:
                raise ConfigError("a serving model bootstraps from deltad: no --init-tables")
            self.model, quant = build_serving_model(config.serving)
            self.applier = quant
            self.forwards = ForwardLoop(self.model, quant, config.serving)
        else:
            tables: dict[str, torch.Tensor] = {}
            if config.init_tables is not None:
                tables = load_tables(config.init_tables)
            self.applier = TensorDictApplier(tables)
        #: the init tables were checked against the sidecars' tables (check_tables)
        self.tables_checked = config.init_tables is None
        self.stop_event = threading.Event()
        self.records: list[PullLogLine] = []
        self.freshness: list[float] = []
        self.served_step: int | None = None
        #: managed-collision tables: raw ids the windows reported evicted (bounded)
        self.evicted: dict[str, set[int]] = {}
        self._out: IO[str] | None = None
        #: the predictor's /metrics (started by run() when ``metrics_port`` is set)
        self.metrics: PredictorMetrics | None = None

    def stop(self) -> None:
        """Ask the loop to finish after the current pull."""
        self.stop_event.set()

    def check_tables(self, statuses: Sequence[pb.StatusResponse | None]) -> None:
        """ConfigError unless the init tables are tables of the model these Status answers
        (one per rank; None: not answering) describe (:func:`check_init_tables`). ``run``
        asks the sidecars itself when this was not called."""
        c = self.config
        if c.init_tables is not None:
            check_init_tables(
                self.applier.tables(),
                statuses,
                model=c.consumer.model,
                resume=c.consumer.resume,
                source=f"--init-tables {c.init_tables}",
            )
        self.tables_checked = True

    def sidecar_statuses(self) -> list[pb.StatusResponse | None]:
        """Every rank's Status, asked once each (None: no answer); the ranks of a Redis
        discovery are waited for as DeltaConsumer waits for them (up to the consumer's
        discovery timeout)."""
        import grpc

        from deltad.clientauth import ClientAuth
        from deltad.consume.discovery import Discovery
        from deltad.errors import DeltadError
        from deltad.v1 import delta_pb2_grpc

        cc = self.config.consumer
        try:
            auth = ClientAuth.of(cc)
        except DeltadError as e:
            raise ConsumerError(str(e)) from e
        endpoints = list(cc.sidecars)
        if not endpoints:
            discovery = Discovery(cc, auth, ())
            try:
                endpoints = discovery.all()
            finally:
                discovery.close()
        out: list[pb.StatusResponse | None] = []
        for target in endpoints:
            channel = auth.channel(target)
            try:
                out.append(
                    delta_pb2_grpc.DeltaServiceStub(channel).Status(
                        pb.StatusRequest(),
                        timeout=min(cc.rpc_deadline_s, 5.0),
                        metadata=auth.metadata(),
                    )
                )
            except grpc.RpcError:
                out.append(None)
            finally:
                channel.close()
        return out

    def run(self) -> SyncSummary:
        """Pull until duration / pulls / stop(); write the final tables; return totals."""
        c = self.config
        if not self.tables_checked:  # before registering: nothing done with wrong tables
            self.check_tables(self.sidecar_statuses())
        deadline = time.monotonic() + c.duration_s if c.duration_s > 0 else None
        self._open_log()
        if c.metrics_port is not None and self.metrics is None:
            self.metrics = PredictorMetrics(c.consumer.model, c.consumer.consumer)
            port = self.metrics.serve_http(c.metrics_port, c.metrics_addr)
            log.info("metrics on http://%s:%d/metrics", c.metrics_addr, port)
        if self.forwards is not None:
            self.forwards.start()
        try:
            with DeltaConsumer(c.consumer) as consumer:
                n = 0
                while not self.stop_event.is_set():
                    if c.pulls and n >= c.pulls:
                        break
                    if deadline is not None and time.monotonic() >= deadline:
                        break
                    started = time.monotonic()
                    n += 1
                    rec = self.pull_once(consumer, n)
                    self._emit(rec)
                    if rec.refused is not None:  # back off, then the full tables again
                        self.stop_event.wait(rec.retry_in_s)
                        continue
                    if (
                        c.long_poll_s > 0
                        and not rec.owed
                        and not rec.missing
                        and not rec.dense_missing  # poll again: the relay may get it
                    ):
                        wait = c.long_poll_s
                        if deadline is not None:
                            wait = min(wait, max(0.0, deadline - time.monotonic()))
                        started = time.monotonic()  # the interval counts from the answer
                        if consumer.wait_for_new(wait, stop=self.stop_event):
                            continue
                    pause = c.interval_s - (time.monotonic() - started)
                    if pause > 0:
                        self.stop_event.wait(pause)
            if self.forwards is not None:
                self.forwards.stop()
                if self.forwards.error is not None:
                    raise ConsumerError(f"serving forward failed: {self.forwards.error!r}")
            summary = self.summary()
            self._emit(summary)
            if self.served_step is None and (
                c.final_tables or (c.serving and c.serving.final_state)
            ):
                # (no pull was served: files of tables nobody sent would pass for served ones)
                log.warning("no pull was served: --final-tables / --final-state not written")
                return summary
            if c.final_tables is not None:
                save_tables(self.applier.tables(), c.final_tables)
            if c.serving is not None and c.serving.final_state is not None:
                assert self.model is not None and self.forwards is not None
                assert isinstance(self.applier, QuantApplier)
                probe = zch_probe(self.model, self.applier, self.evicted)
                save_state(self.model, c.serving.final_state, self.forwards.output(), probe)
            return summary
        finally:
            if self.forwards is not None:
                self.forwards.stop()
            if self._out is not None and self._out is not sys.stdout:
                self._out.close()
            if self.metrics is not None:
                self.metrics.close()

    def pull_once(self, consumer: DeltaConsumer, n: int) -> PullLogLine:
        """One pull, apply (not for the ids form), commit; the record of what happened."""
        t0 = time.monotonic()
        ids_only = consumer.config.pull.form is Form.IDS
        result = consumer.pull(applier=None if ids_only else self.applier)  # resyncs: streamed
        t1 = time.monotonic()
        if result.deltas and consumer.config.pull.form is not Form.IDS:
            if self.forwards is not None:
                self.forwards.applying.set()
            try:
                self.applier.apply(result.deltas)
            except WindowRefused as e:  # nothing applied: the model serves what it held
                consumer.refuse(result, e)
            finally:
                if self.forwards is not None:
                    self.forwards.applying.clear()
            if result.refused is None:
                if isinstance(self.applier, QuantApplier):
                    self.max_hold_s = max(self.max_hold_s, self.applier.stats.max_hold_s)
                self._note_evicted(result)
        if result.refused is not None:
            return self._record(result, n, time.time(), t1 - t0, time.monotonic() - t1)
        applied_unix = time.time()
        t2 = time.monotonic()
        if result.deltas:
            consumer.commit(result)
        return self._record(result, n, applied_unix, t1 - t0, t2 - t1)

    def _note_evicted(self, r: PullResult) -> None:
        """Keep (up to :data:`MAX_EVICTED` per table) the raw ids the windows evicted."""
        for d in r.deltas:
            for s in d.shards:
                ev = s.evicted_raw_ids
                if ev is None or not ev.numel():
                    continue
                seen = self.evicted.setdefault(s.shard.table, set())
                if len(seen) < MAX_EVICTED:
                    seen.update(ev[: MAX_EVICTED - len(seen)].tolist())

    def _record(
        self, r: PullResult, n: int, applied_unix: float, pull_s: float, apply_s: float
    ) -> PullLogLine:
        fresh = None
        if r.deltas and r.step is not None and r.refused is None:
            # a new generation (resync or diff) may start below the step served before
            new_step = (
                r.resync
                or r.generation_diff
                or self.served_step is None
                or r.step > self.served_step
            )
            if new_step and r.source_unix is not None:
                fresh = max(0.0, applied_unix - r.source_unix)
                self.freshness.append(fresh)
            self.served_step = r.step
        rec = PullLogLine(
            event="pull",
            consumer=self.config.consumer.consumer,
            t=applied_unix,
            pull=n,
            step=self.served_step,
            head_step=r.head_step,
            step_lag=(r.head_step - self.served_step)
            if r.head_step is not None and self.served_step is not None
            else None,
            freshness_s=fresh,
            rows=r.rows,
            bytes=r.bytes,
            owed=sum(s.owed for d in r.deltas for s in d.shards),
            resync=r.resync,
            generation_diff=r.generation_diff,
            missing=r.missing,
            pull_s=pull_s,
            apply_s=apply_s,
            dense_bytes=r.dense_bytes,
            cap_step=r.cap_step,
            caught_up=r.caught_up,
            dense_step=r.dense_step,
            rollback_to=r.rollback_to,
            dense_missing=r.dense_missing,
            upstream_lost=r.upstream_lost,
            refused=r.refused,
            retry_in_s=r.retry_in_s,
        )
        if r.refused is not None:  # what it says of rows and bytes is what was refused
            rec.rows = rec.bytes = rec.owed = rec.dense_bytes = 0
            rec.resync = rec.generation_diff = False
            rec.dense_step = rec.rollback_to = None
        self.records.append(rec)
        return rec

    def summary(self) -> SyncSummary:
        f = self.forwards
        idle = [x * 1e3 for x in f.idle_s] if f is not None else []
        busy = [x * 1e3 for x in f.apply_s] if f is not None else []
        return SyncSummary(
            event="summary",
            consumer=self.config.consumer.consumer,
            pulls=len(self.records),
            rows=sum(r.rows for r in self.records),
            bytes=sum(r.bytes for r in self.records),
            step=self.served_step,
            freshness_p50_s=percentile(self.freshness, 50),
            freshness_p99_s=percentile(self.freshness, 99),
            freshness_samples=len(self.freshness),
            forwards=f.forwards if f is not None else 0,
            forward_idle_p50_ms=percentile(idle, 50),
            forward_idle_p99_ms=percentile(idle, 99),
            forward_apply_p50_ms=percentile(busy, 50),
            forward_apply_p99_ms=percentile(busy, 99),
            forward_apply_samples=len(busy),
            max_hold_ms=self.max_hold_s * 1e3 if f is not None else None,
            dense_bytes=sum(r.dense_bytes for r in self.records),
            refused=sum(r.refused is not None for r in self.records),
        )

    def _open_log(self) -> None:
        dest = self.config.json_log
        if dest == "-":
            self._out = sys.stdout
        elif dest:
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
            self._out = open(dest, "a", buffering=1)  # noqa: SIM115 - closed in run()

    def _emit(self, rec: PullLogLine | SyncSummary) -> None:
        if self.metrics is not None and isinstance(rec, PullLogLine):
            self.metrics.observe(rec)
        d: dict[str, Any] = asdict(rec)
        if self._out is not None:
            self._out.write(json.dumps(d, separators=(",", ":")) + "\n")
            self._out.flush()
        if isinstance(rec, PullLogLine) and (rec.rows or rec.missing or rec.dense_missing):
            log.debug(  # -v: the library's line per pull says it (deltad.consume.client)
                "pull %d: step %s (head %s) rows %d bytes %d fresh %s missing %s%s",
                rec.pull, rec.step, rec.head_step, rec.rows, rec.bytes,
                None if rec.freshness_s is None else f"{rec.freshness_s:.3f}s",
                sorted(rec.missing),
                f" dense missing {rec.dense_missing}" if rec.dense_missing else "",
            )  # fmt: skip


def load_tables(path: Path) -> dict[str, torch.Tensor]:
    """``{table: 2-D tensor}`` from a torch.save file (the trainer's --init-tables output).
    ConsumerError (one line) for a file that is not one: missing, truncated, or arbitrary
    bytes, on which torch.load raises nearly anything (UnpicklingError, EOFError, ...)."""
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": one line only
            warnings.simplefilter("ignore")
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # what torch.load raises for arbitrary bytes is open-ended
        raise ConsumerError(f"cannot load tables from {path}: {_load_error(e)}") from e
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) and v.dim() == 2 for k, v in raw.items()
    ):
        raise ConsumerError(f"{path}: expected a dict of table name -> 2-D tensor")
    return {k: v.clone() for k, v in raw.items()}


def _load_error(e: Exception) -> str:
    """One line of what torch.load raised (its weights-only errors run to a paragraph that
    advises weights_only=False, which a predictor never does)."""
    if isinstance(e, OSError):
        return str(e)
    text = str(e)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1]
    line = next((x.strip() for x in text.splitlines() if x.strip()), "")
    if isinstance(e, EOFError):
        line = line or "empty or truncated file"
    line = line[:200]
    return f"not a torch.save file of tensors ({type(e).__name__}: {line})"


def check_init_tables(
    tables: dict[str, torch.Tensor],
    statuses: Sequence[pb.StatusResponse | None],
    *,
    model: str,
    resume: bool,
    source: object = "--init-tables",
) -> None:
    """ConfigError (naming the table and what differs) unless ``tables`` are tables of the
    model the sidecars describe in their Status (each rank's manifest: every table's name,
    rows (slots, for a managed-collision table) and dim): no table the model lacks, each of
    the model's shape and of a floating-point dtype (rows are written into it), and with
    ``resume`` every table of the model (deltas alone never fill one the file lacks).
    Nothing to check when no sidecar has a manifest yet (nothing published)."""
    described: dict[str, pb.TableStatus] = {}
    for st in statuses:
        if st is not None:
            for info in st.tables:
                described.setdefault(info.table, info)
    if not described:
        log.warning("%s: no sidecar describes model %r's tables yet: not checked", source, model)
        return
    for name, t in tables.items():
        ts = described.get(name)
        if ts is None:
            raise ConfigError(
                f"{source}: table {name!r} is not a table of model {model!r} "
                f"(its tables: {', '.join(sorted(described))})"
            )
        want = (int(ts.num_rows), int(ts.dim))
        if tuple(t.shape) != want:
            what = "slots" if ts.managed_collision else "rows"
            raise ConfigError(
                f"{source}: table {name!r} is {t.shape[0]}x{t.shape[1]}, model {model!r} has "
                f"{want[0]}x{want[1]} ({what} x dim)"
            )
        if not t.dtype.is_floating_point:
            raise ConfigError(
                f"{source}: table {name!r} has dtype {t.dtype}, not a floating-point dtype "
                f"(model {model!r}: {ts.dtype})"
            )
    missing = sorted(set(described) - set(tables))
    if resume and missing:
        raise ConfigError(
            f"{source}: table {missing[0]!r} of model {model!r} is missing "
            f"({len(missing)} missing): --resume needs every table the committed cursors describe"
        )


def save_tables(tables: dict[str, torch.Tensor], path: Path) -> None:
    """torch.save ``{table: tensor}`` atomically (temp file, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    torch.save({k: v.detach().clone() for k, v in tables.items()}, tmp)
    tmp.replace(path)
