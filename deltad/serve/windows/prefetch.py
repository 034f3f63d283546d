"""A bounded prefetching producer for GetDelta's response stream.

gRPC Python's server pulls a streaming handler's response iterator in the handler thread and
asks for the next message only after the previous one was handed to the transport, so
building a message and sending the previous one never overlap. :class:`Prefetch` moves the
building to one producer thread that runs ahead of the sender into a bounded queue:

* at most ``max_items`` messages and ``max_bytes`` bytes wait in the queue (one message is
  always let in, however big), plus the one the producer holds while it waits for room;
* order is kept; the source's error is raised in the reader's thread (the same exception
  object, so an abort made by the producer ends the RPC with the status it set);
* :meth:`close` (the reader stopped: end of stream, cancel, deadline) stops the producer at
  its next message, closes the source in the producer's own thread and joins it for at most
  ``join_s`` seconds; ``stop`` may also be called from any thread (e.g. a gRPC
  ``context.add_callback``), and a stopped reader gets :class:`PrefetchStopped`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator
from typing import Final

log = logging.getLogger(__name__)

#: How long a reader or the producer waits on the queue before it looks again (stop flags).
_POLL_S: Final = 0.5


class PrefetchStopped(Exception):
    """The prefetching producer was stopped (cancel) before the stream ended."""


class Prefetch:
    """Iterate ``source`` in a producer thread, up to ``max_items`` / ``max_bytes`` ahead."""

    def __init__(
        self,
        source: Iterator[bytes],
        *,
        max_items: int,
        max_bytes: int,
        join_s: float = 10.0,
        name: str = "deltad-prefetch",
    ) -> None:
        if max_items < 1 or max_bytes < 1:
            raise ValueError("max_items and max_bytes must be >= 1")
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.join_s = join_s
        self._source = source
        self._cond = threading.Condition()
        self._queue: deque[bytes] = deque()
        self._queued_bytes = 0
        #: the most bytes ever queued at once (tests: the memory bound holds)
        self.peak_bytes = 0
        #: messages the reader had to wait for (the producer was behind: building is the
        #: bottleneck) and messages the producer had to wait to queue (the queue was full:
        #: sending is); logged with the pull at ``-v``
        self.reader_waits = 0
        self.producer_waits = 0
        self._done = False  # the producer has put its last message (or failed)
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._produce, name=name, daemon=True)
        self._thread.start()

    # --- the producer ----------------------------------------------------------------------

    def _produce(self) -> None:
        error: BaseException | None = None
        try:
            for item in self._source:
                with self._cond:
                    waited = False
                    while (
                        not self._stopped
                        and self._queue
                        and (
                            len(self._queue) >= self.max_items
                            or self._queued_bytes + len(item) > self.max_bytes
                        )
                    ):
                        waited = True
                        self._cond.wait(_POLL_S)
                    self.producer_waits += waited
                    if self._stopped:
                        break
                    self._queue.append(item)
                    self._queued_bytes += len(item)
                    self.peak_bytes = max(self.peak_bytes, self._queued_bytes)
                    self._cond.notify_all()
        except BaseException as e:  # handed to the reader, raised there
            error = e
        finally:
            close = getattr(self._source, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    log.warning("prefetch: closing the source failed", exc_info=True)
            with self._cond:
                self._error = error
                self._done = True
                self._cond.notify_all()

    # --- the reader ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        with self._cond:
            self.reader_waits += not self._queue and not self._done and not self._stopped
            while not self._queue and not self._done and not self._stopped:
                self._cond.wait(_POLL_S)
            if self._queue:
                item = self._queue.popleft()
                self._queued_bytes -= len(item)
                self._cond.notify_all()
                return item
            if self._stopped:
                raise PrefetchStopped("the stream was stopped")
            if self._error is not None:
                raise self._error
            raise StopIteration

    def stop(self) -> None:
        """Stop the producer at its next message (any thread; idempotent; does not wait)."""
        with self._cond:
            self._stopped = True
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()

    def close(self) -> bool:
        """Stop and join the producer for at most ``join_s``; True if it has ended."""
        self.stop()
        self._thread.join(self.join_s)
        if self._thread.is_alive():
            log.warning("prefetch: the producer did not end within %.1f s", self.join_s)
            return False
        return True

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
