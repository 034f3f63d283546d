"""Prometheus metrics of one sidecar (own registry, so several servers can share a process).

Names follow Prometheus conventions: the unit is the suffix (``_bytes``, ``_seconds``), and
counters are exposed with ``_total`` (prometheus_client appends it); no ``*_created`` series
is exported (:class:`NoCreatedRegistry`). Every RPC is counted and
timed by :class:`RpcMetricsInterceptor` (``deltad_rpc_requests_total{method,code}``,
``deltad_rpc_duration_seconds{method}``; a stream's duration runs until its last message).
The process itself (``process_resident_memory_bytes``, ``process_cpu_seconds_total``,
``process_open_fds``, ...) comes from prometheus_client's process collector.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from deltad import __version__, wire
from deltad.metrics_endpoint import MetricsEndpoint
from deltad.serve import memory


class NoCreatedRegistry(CollectorRegistry):
    """A registry that exports no ``*_created`` series: the creation time prometheus_client
    adds to every counter and histogram is the process's start for all of them (already
    ``process_start_time_seconds``), one more series each for nothing."""

    def collect(self) -> Iterator[Any]:
        for m in super().collect():
            if m.type in ("counter", "histogram", "summary"):
                created = f"{m.name}_created"
                if any(s.name == created for s in m.samples):
                    m = copy.copy(m)
                    m.samples = [s for s in m.samples if s.name != created]
            yield m


class SidecarMetrics(MetricsEndpoint):
    """The sidecar's counters and gauges; ``serve_http(port)`` exposes them."""

    def __init__(self, model: str, rank: int) -> None:
        #: the runtime's memory (deltad.serve.memory), taken in track_sidecar
        self.memory = memory.MemoryBaseline()
        super().__init__(NoCreatedRegistry())
        labels = {"model": model, "rank": str(rank)}
        r = self.registry
        ProcessCollector(registry=r)  # RSS, CPU seconds, open fds, start time (Linux /proc)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=r).labels(**labels)

        Gauge(
            "deltad_build_info",
            "deltad version of this sidecar (value 1)",
            [*labels, "version"],
            registry=r,
        ).labels(**labels, version=__version__).set(1)
        self.bytes_served = counter("deltad_served_bytes", "Payload bytes sent by GetDelta")
        self.rows_served = counter("deltad_served_rows", "Rows sent by GetDelta")
        # where a GetDelta's CPU goes (thread CPU time; building: in whichever thread builds)
        self.build_cpu_seconds = counter(
            "deltad_window_build_cpu_seconds",
            "CPU seconds spent building GetDelta windows' messages (merge, cast, pack, encode)",
        )
        self.stream_cpu_seconds = counter(
            "deltad_getdelta_stream_cpu_seconds",
            "CPU seconds of the gRPC handler threads in GetDelta's chunk loops (sending; "
            "building as well where it runs there)",
        )
        self.pulls = counter("deltad_pulls", "GetDelta streams completed")
        self.cache_hits = counter("deltad_window_cache_hits", "Windows served from the cache")
        self.resumed_streams = counter(
            "deltad_getdelta_resumed",
            "Resync streams that continued a broken one where it broke (GetDeltaRequest.resume)",
        )
        self.resumed_messages = counter(
            "deltad_getdelta_resumed_messages",
            "Messages not sent again because their stream continued a broken one",
        )
        self.generation_diffs = counter(
            "deltad_generation_diffs",
            "Consumers moved to a new generation by a generation diff (the rows that differ)",
        )
        self.generation_resyncs = counter(
            "deltad_generation_resyncs",
            "Consumers moved to a new generation by a full resync (no diff possible)",
        )
        # rollout: rollback (issue 21)
        self.rollbacks = counter(
            "deltad_rollbacks",
            "Rollback windows served (a consumer taken back to a rollback order's step)",
        )
        # idle trim (issue 22 item 4): what an idle sidecar gave back (Upkeep.trim_idle)
        self.idle_heap_trims = counter(
            "deltad_idle_heap_trims", "Idle spells in which the free heap was handed back"
        )
        self.idle_page_outs = counter(
            "deltad_idle_page_outs", "Idle spells in which the libraries' code pages were paged out"
        )
        self.rpc_requests = Counter(
            "deltad_rpc_requests",
            "RPCs handled, by method and gRPC status code",
            [*labels, "method", "code"],
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "deltad_rpc_duration_seconds",
            "RPC handling time, by method (streams: until the last message)",
            [*labels, "method"],
            registry=r,
            buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0, 60.0),
        )
        self.quarantined = counter(
            "deltad_quarantined_segments", "Segments that failed their checksum"
        )
        self.spool_rewritten = counter(
            "deltad_spool_files_rewritten",
            "Served segment and dense state files the spool lost under the sidecar, written "
            "back from their verified copies",
        )
        self.merge_seconds = Histogram(
            "deltad_window_merge_seconds",
            "Time to merge and encode one window",
            list(labels),
            registry=r,
            buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0),
        ).labels(**labels)
        self.active_streams = Gauge(
            "deltad_active_streams", "GetDelta streams in flight", list(labels), registry=r
        ).labels(**labels)
        self.head_seq = Gauge(
            "deltad_head_seq", "Newest served segment", list(labels), registry=r
        ).labels(**labels)
        self.redis_up = Gauge(
            "deltad_redis_up",
            "1 while the offset store (Redis) answers the sidecar's probe, else 0",
            list(labels),
            registry=r,
        ).labels(**labels)
        self.redis_restarts = counter(
            "deltad_redis_restarts", "Embedded Redis servers this sidecar restarted"
        )
        self.lag_segments = Gauge(
            "deltad_consumer_lag_segments",
            "Head seq minus the consumer's committed seq",
            [*labels, "consumer"],
            registry=r,
        )
        self.lag_seconds = Gauge(
            "deltad_consumer_lag_seconds",
            "Age of the oldest segment the consumer has not committed",
            [*labels, "consumer"],
            registry=r,
        )
        self.consumers = Gauge(
            "deltad_consumers",
            "Known consumers: live (lease held) or expired (not forgotten yet)",
            [*labels, "state"],
            registry=r,
        )
        self.lag_segments_max = Gauge(
            "deltad_consumer_lag_segments_max",
            "The largest deltad_consumer_lag_segments of a live consumer",
            list(labels),
            registry=r,
        ).labels(**labels)
        self.lag_max_seconds = Gauge(
            "deltad_consumer_lag_max_seconds",
            "The largest deltad_consumer_lag_seconds of a live consumer",
            list(labels),
            registry=r,
        ).labels(**labels)
        self.registry_conflicts = counter(
            "deltad_registry_conflicts",
            "Times another sidecar registered this model and rank in this Redis since this one"
            " did (two deployments under one --model, or two sidecars on one rank)",
        )
        # rollout-control (issue 21): the validation gate and the release state
        self.gate_failures = counter(
            "deltad_gate_failures",
            "Segments and dense states the validation gate failed (never served)",
        )
        self.gate_held = Gauge(
            "deltad_gate_held",
            "1 while a step the validation gate failed (on any rank) holds the model, else 0",
            list(labels),
            registry=r,
        ).labels(**labels)
        self.rollout_held = Gauge(
            "deltad_rollout_held",
            "1 while the model's release state is held (hold, gate or rollback), else 0",
            list(labels),
            registry=r,
        ).labels(**labels)
        self.release_step = Gauge(
            "deltad_release_step",
            "The model's release step (-1: the head is released)",
            list(labels),
            registry=r,
        ).labels(**labels)
        self._labels = labels
        self._lagging: set[str] = set()

    def track(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A gauge read at scrape time (``read()``; an exception reads as NaN)."""

        def value() -> float:
            try:
                return float(read())
            except Exception:
                return float("nan")

        Gauge(name, doc, list(self._labels), registry=self.registry).labels(
            **self._labels
        ).set_function(value)

    def track_counter(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A counter (only ever rising) read at scrape time from ``read()``."""
        self.registry.register(_ReadCounter(name, doc, self._labels, read))

    def track_sidecar(self, servicer: Any, seglog: Any) -> None:
        """The memory and long polls of one sidecar, read at scrape time: the log it serves
        (private copies), the previous generation it holds for diffs, the window cache (cached
        and live windows), the pre-merged runs, the pack-once store, the spilled base (disk and
        resident pages), the spool's resident pages, windows streamed unkept, Status calls
        held. Runtime + log + previous generation + window cache + runs + packed + spill
        resident + spool resident + free heap is the RSS (tests/test_sidecar_mem_gauges.py)."""
        snap = lambda: seglog.snapshot()  # noqa: E731
        prev = lambda: seglog.previous()  # noqa: E731
        windows = servicer.windows
        self.track(
            "deltad_head_age_seconds",
            "Seconds since the trainer read the rows of the newest segment (its head; -1: none):"
            " it grows while the trainer, or this rank's publisher, publishes nothing",
            lambda: -1.0 if (x := snap()) is None else max(0.0, time.time() - x.head.created_unix),
        )
        self.track(
            "deltad_log_bytes", "Bytes of the served log (private copies of its segments)",
            lambda: 0 if (x := snap()) is None else x.nbytes,
        )  # fmt: skip
        self.track(
            "deltad_previous_generation_bytes",
            "Bytes of the previous generation's log held for generation diffs (0: none held)",
            lambda: 0 if (x := prev()) is None else x.nbytes,
        )
        self.track(
            "deltad_window_cache_bytes", "Bytes of cached and live windows (the budget holds both)",
            lambda: windows.cache.nbytes,
        )  # fmt: skip
        self.track_counter(
            "deltad_windows_unkept", "Windows streamed without being kept (over the budget)",
            lambda: windows.cache.unkept,
        )  # fmt: skip
        owed = servicer.owed
        self.track(
            "deltad_owed_bytes", "Disk bytes of owed rows (top-k consumers' files)",
            lambda: owed.nbytes,
        )  # fmt: skip
        self.track("deltad_owed_files", "Owed-row files of this rank", lambda: owed.files)
        self.track_counter(
            "deltad_owed_refused",
            "Pulls refused because their owed rows would exceed the owed-row budget",
            lambda: owed.refused,
        )
        self.track(
            "deltad_run_cache_bytes", "Bytes of pre-merged runs", lambda: windows.runs.nbytes
        )
        spill = windows.spill
        self.track(
            "deltad_spill_bytes",
            "Disk bytes of the spilled merged base (a file: its resident pages are"
            " deltad_spill_resident_bytes)",
            lambda: spill.nbytes,
        )
        # the pack-once store (deltad.serve.windows.packed), whichever object holds it
        packed = getattr(windows, "packed", None) or getattr(
            getattr(windows, "source", None), "packed", None
        )
        self.track(
            "deltad_packed_cache_bytes",
            "Bytes of rows kept packed for the packed wire dtypes (packed once per row version;"
            " at most --packed-cache-bytes, idle too)",
            lambda: 0 if packed is None else packed.nbytes,
        )
        if packed is not None:
            self.track_counter(
                "deltad_packed_cache_refused",
                "Parts packed per chunk instead of kept packed (no room beside the rows pulls"
                " are using, or asked for less often than the rows kept)",
                lambda: packed.refused,
            )
        # fbgemm's quantizers (~8 MB of code and heap: only the library that holds them) are
        # part of the runtime: loaded now, before the baseline is taken, not in the first pull
        # (the warm-up thread then has nothing left to do)
        wire.preload_quantizer()
        spill_dir = getattr(spill, "directory", None)
        mapped = memory.MappedFiles(seglog.layout.root, spill_dir)
        base = self.memory = memory.MemoryBaseline(mapped)  # (the log indexed, nothing served)
        self.track(
            "deltad_rss_bytes", "Resident set of the sidecar process (VmRSS)", memory.rss_bytes
        )
        self.track(
            "deltad_runtime_bytes",
            "Runtime memory: anonymous memory once the log was indexed, before serving "
            "(interpreter, libraries' heaps) plus resident library pages",
            base.runtime,
        )
        self.track(
            "deltad_spill_resident_bytes",
            "Resident pages of the spilled merged base's file mapped by the sidecar (page cache"
            " charged to its memory while resident)",
            lambda: mapped.get("spill"),
        )
        self.track(
            "deltad_spool_resident_bytes",
            "Resident pages of spool files mapped by the sidecar (segments and dense states"
            " read in place)",
            lambda: mapped.get("spool"),
        )
        self.track(
            "deltad_heap_free_bytes",
            "Free heap bytes malloc keeps for reuse beyond those at start (freed temporaries)",
            base.heap_free_growth,
        )
        self.track(
            "deltad_status_waiters", "Long-polling Status calls held", lambda: servicer.status.waiters
        )  # fmt: skip

    def set_lag(self, consumer: str, segments: int, seconds: float) -> None:
        self.lag_segments.labels(**self._labels, consumer=consumer).set(segments)
        self.lag_seconds.labels(**self._labels, consumer=consumer).set(seconds)
        self._lagging.add(consumer)

    def set_consumers(self, live: int, expired: int, lag_segments: int, lag_seconds: float) -> None:
        """The consumer counts and the largest lag of a live one (what an alert on a fleet
        reads without a series per consumer)."""
        self.consumers.labels(**self._labels, state="live").set(live)
        self.consumers.labels(**self._labels, state="expired").set(expired)
        self.lag_segments_max.set(lag_segments)
        self.lag_max_seconds.set(lag_seconds)

    def keep_lag_of(self, consumers: set[str]) -> None:
        """Drop the lag series of consumers not in ``consumers`` (forgotten ones, expired
        leases, consumers of other ranks only), so that no alert fires on a consumer that is
        gone and the series stay as many as the live consumers."""
        for gone in self._lagging - consumers:
            for gauge in (self.lag_segments, self.lag_seconds):
                try:
                    gauge.remove(*self._labels.values(), gone)
                except KeyError:
                    pass
        self._lagging &= consumers

    def observe_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        """Count one finished RPC and its duration."""
        self.rpc_requests.labels(**self._labels, method=method, code=code.name).inc()
        self.rpc_seconds.labels(**self._labels, method=method).observe(seconds)


def _code_of(context: grpc.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        return code
    if error is None:
        return grpc.StatusCode.OK
    # the client went away (its stream closed under the handler): not a server fault
    if isinstance(error, GeneratorExit) or not context.is_active():
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class RpcMetricsInterceptor(grpc.ServerInterceptor):
    """Counts and times every RPC of the server it is installed in (see the module doc)."""

    def __init__(self, metrics: SidecarMetrics) -> None:
        self._metrics = metrics

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = str(handler_call_details.method).rsplit("/", 1)[-1]
        observe = self._metrics.observe_rpc
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                start = time.perf_counter()
                error: BaseException | None = None
                try:
                    return inner_uu(request, context)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    observe(method, _code_of(context, error), time.perf_counter() - start)

            return handler._replace(unary_unary=unary_unary)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                start = time.perf_counter()
                error: BaseException | None = None
                try:
                    yield from inner_us(request, context)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    observe(method, _code_of(context, error), time.perf_counter() - start)

            return handler._replace(unary_stream=unary_stream)
        return handler


class _ReadCounter(Collector):
    """A counter whose value is read at scrape time (a count kept elsewhere)."""

    def __init__(
        self, name: str, doc: str, labels: dict[str, str], read: Callable[[], float]
    ) -> None:
        self._name, self._doc, self._labels, self._read = name, doc, labels, read

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), float(self._read()))
        yield family
