"""GetDelta's concurrency limit: ``max_concurrent_streams`` slots, a first-come-first-served
line of ``max_queued_streams`` callers waiting up to ``stream_queue_wait_s`` each, refusals
with a retry hint, and each stream's bounds: its deadline (``stream_deadline_s``) and the
longest it may go without handing gRPC a message (``stream_stall_s``)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import NoReturn

import grpc

from deltad import wire
from deltad.config import ServerConfig
from deltad.serve.edge.grpcutil import abort as _abort
from deltad.serve.metrics import SidecarMetrics

log = logging.getLogger(__name__)

#: A stream past its deadline ends with DEADLINE_EXCEEDED (and a message) at its next message;
#: one stuck in a send (its client stopped reading) is cancelled this long after the deadline,
#: so a client that reads on at the deadline gets the status rather than a bare CANCELLED.
CANCEL_GRACE_S = 1.0


class StreamSlot:
    """One unit of the GetDelta concurrency limit, with its stream's deadline; release is
    idempotent."""

    def __init__(
        self, owner: StreamSlots, context: grpc.ServicerContext, consumer: str, deadline: float
    ) -> None:
        self.owner = owner
        self.context = context
        self.consumer = consumer
        self.deadline = deadline
        self.started = time.monotonic()
        #: when the stream last handed gRPC a message (or started): set by its handler
        self.progress = self.started
        self.held = True

    def release(self) -> None:
        owner = self.owner
        with owner._slot_free:
            if self.held:
                self.held = False
                owner.active -= 1
                owner._slots.discard(self)
                owner.metrics.active_streams.set(owner.active)
                took = time.monotonic() - self.started
                owner._stream_seconds += 0.2 * (took - owner._stream_seconds)
                owner.last_release = time.monotonic()
                owner._slot_free.notify_all()  # the first waiter in line takes it


class StreamSlots:
    """The GetDelta stream slots of one sidecar (see the module docstring)."""

    def __init__(self, config: ServerConfig, metrics: SidecarMetrics) -> None:
        self.config = config
        self.metrics = metrics
        #: streams holding a slot
        self.active = 0
        self._streams_lock = threading.Lock()
        self._slots: set[StreamSlot] = set()
        # GetDelta calls waiting for a slot, first come first served (see acquire)
        self._slot_free = threading.Condition(self._streams_lock)
        self.queue: deque[object] = deque()
        self._stream_seconds = 0.2  # moving average of a stream's duration (retry hints)
        #: GetDelta calls refused for want of a slot (RESOURCE_EXHAUSTED with a retry hint)
        self.refused = 0
        #: when the last stream ended (monotonic; the sidecar's start before any)
        self.last_release = time.monotonic()

    def idle_s(self) -> float:
        """Seconds since the last GetDelta stream ended; 0 while one runs or waits."""
        if self.active or self.queue:
            return 0.0
        return time.monotonic() - self.last_release

    def acquire(self, context: grpc.ServicerContext, consumer: str) -> StreamSlot:
        """A stream slot: at once, or after waiting in line (``max_queued_streams`` callers,
        ``stream_queue_wait_s`` each, first come first served). Past that the call ends with
        RESOURCE_EXHAUSTED and a hint (:data:`deltad.wire.RETRY_AFTER_KEY`) of when a slot is likely
        free, which the consumer library honours."""
        cfg = self.config
        limit = cfg.max_concurrent_streams
        with self._slot_free:
            if (self.active >= limit or self.queue) and len(self.queue) < cfg.max_queued_streams:
                me = object()
                self.queue.append(me)
                until = time.monotonic() + cfg.stream_queue_wait_s
                try:
                    while self.queue[0] is not me or self.active >= limit:
                        left = until - time.monotonic()
                        if left <= 0 or not context.is_active():
                            break
                        self._slot_free.wait(min(left, 0.5))
                finally:
                    first = self.queue[0] is me
                    self.queue.remove(me)
                    self._slot_free.notify_all()  # the next in line may be first now
                if not first or self.active >= limit:
                    self.refuse(context)
            elif self.active >= limit:
                self.refuse(context)
            self.active += 1
            deadline = time.monotonic() + cfg.stream_deadline_s
            slot = StreamSlot(self, context, consumer, deadline)
            self._slots.add(slot)
            self.metrics.active_streams.set(self.active)
        context.add_callback(slot.release)
        return slot

    def refuse(self, context: grpc.ServicerContext) -> NoReturn:
        """RESOURCE_EXHAUSTED with a retry hint; call with ``_slot_free`` held."""
        cfg = self.config
        # streams ahead of a caller that comes back now, drained max_concurrent at a time
        ahead = len(self.queue) + 1
        hint = min(30.0, max(0.05, self._stream_seconds * ahead / cfg.max_concurrent_streams))
        self.refused += 1
        context.set_trailing_metadata(((wire.RETRY_AFTER_KEY, str(int(hint * 1000))),))
        _abort(
            context,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{self.active} GetDelta streams in flight and {len(self.queue)} waiting "
            f"(max_concurrent_streams={cfg.max_concurrent_streams}, max_queued_streams="
            f"{cfg.max_queued_streams}); retry in {hint:.2f}s",
        )

    def _overdue(self, s: StreamSlot, now: float) -> str:
        """Why stream ``s`` is to be cancelled at ``now`` ("" if it is not)."""
        cfg = self.config
        if s.deadline < now - CANCEL_GRACE_S:
            return f"past stream_deadline_s={cfg.stream_deadline_s:g}"
        if now - s.progress > cfg.stream_stall_s:
            return f"no message sent for {now - s.progress:.0f} s (stream_stall_s={cfg.stream_stall_s:g})"
        return ""

    def cancel_overdue(self) -> int:
        """Cancel GetDelta streams past ``stream_deadline_s`` + :data:`CANCEL_GRACE_S`, or that
        handed gRPC no message for ``stream_stall_s``; return how many.

        The stream checks its deadline between messages; one whose client stopped reading
        waits in a send for flow control and never gets there, holding its slot (and with
        ``max_concurrent_streams`` of them, every other consumer out). The sidecar calls this
        periodically (``SidecarServer``)."""
        now = time.monotonic()
        with self._streams_lock:
            overdue = [(s, why) for s in self._slots if s.held and (why := self._overdue(s, now))]
        for s, why in overdue:
            log.warning("GetDelta of %s cancelled: %s (client not reading?)", s.consumer, why)
            s.context.cancel()
            s.release()
        return len(overdue)
