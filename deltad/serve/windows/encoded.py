"""A window streamed while it is produced, its chunks shared by concurrent readers."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator

from deltad.segment.format import ShardRows
from deltad.serve.index import spill
from deltad.serve.windows.encode import Skip
from deltad.serve.windows.packed import Pins, pinning
from deltad.types import ShardKey

log = logging.getLogger(__name__)


class EncodedWindow:
    """A window streamed while it is merged and encoded.

    The header, the row count and the owed rows are known when the window is returned (after
    the plan); the RowChunks are produced on demand, in the threads that read them with
    :meth:`iter_chunks`: a reader that needs a chunk nobody has produced yet produces it (one
    at a time), the others wait for it. No producer thread: a second thread merging while the
    gRPC thread sends contends for the GIL, and measured slower (0.4-0.5x bare gRPC vs
    0.77x at 1 GB, 2 cores). A ``kept`` window keeps its chunks (shared by concurrent readers
    and the cache; the last reader to stop early produces the rest); otherwise the one
    reader streams them without keeping any. ``payload_bytes`` and ``merge_seconds``
    are final once the last chunk is out. The packed rows its chunks are made from are pinned
    to it (:attr:`pins`) until then: the pack-once store never evicts them under it.
    """

    def __init__(
        self,
        header: bytes,
        to_seq: int,
        to_step: int,
        rows: int,
        owed: dict[ShardKey, ShardRows],
        merge_seconds: float,
        *,
        kept: bool = True,
    ) -> None:
        self.header = header
        self.to_seq = to_seq
        self.to_step = to_step
        self.rows = rows
        self.owed = owed
        self.merge_seconds = merge_seconds
        #: CPU time of the threads that built its chunks (merge, cast, pack, encode), set by
        #: its producer (:func:`~deltad.serve.windows.plan.build_window`); final when done
        self.build_cpu_seconds = 0.0
        self.payload_bytes = 0
        self.kept = kept
        #: an upper bound of :attr:`nbytes` known at once (what the cache reserves for it;
        #: set by :func:`~deltad.serve.windows.plan.build_window`). None: unknown, and the
        #: cache reserves nothing while it is live (the budget then holds only once it is
        #: done; windows built elsewhere should set it, see
        #: :func:`~deltad.serve.windows.header.window_bound`)
        self.bound: int | None = None
        self._cond = threading.Condition()
        self._chunks: list[bytes] = []
        self._produce: Iterator[tuple[bytes | None, float]] | None = None
        self._producing = False
        self._readers = 0
        self._done = False
        self._error: BaseException | None = None
        self._on_done: list[Callable[[EncodedWindow], None]] = []
        #: messages its producer leaves out unbuilt (see :meth:`skip_unbuilt`)
        self.skip = Skip()
        #: packed rows its producer took (:mod:`deltad.serve.windows.packed`), released once
        #: its last chunk is produced
        self.pins = Pins()

    @property
    def owed_rows(self) -> int:
        return sum(r.ids.numel() for r in self.owed.values())

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.payload_bytes

    @property
    def done(self) -> bool:
        return self._done

    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def chunks(self) -> list[bytes]:
        """Every chunk (produces the rest; kept windows only)."""
        assert self.kept
        return list(self.iter_chunks())

    def skip_unbuilt(self, n: int) -> int:
        """Have the producer leave out the first ``n`` messages without building them (a
        resumed stream); only a window that is not kept and not started (its one reader is
        the caller, nobody else sees its chunks). The messages left out: ``n`` or 0."""
        if self.kept or self._produce is None or self._producing or self._done:
            return 0
        self.skip.left = n
        return n

    def start(self, produce: Iterator[tuple[bytes | None, float]]) -> EncodedWindow:
        """Produce from ``produce``: (chunk or None, seconds spent), as readers need them."""
        self._produce = produce
        return self

    def finish_with(self, chunks: Iterable[bytes]) -> EncodedWindow:
        """A window whose chunks are all known now."""
        for c in chunks:
            self._chunks.append(c)
            self.payload_bytes += len(c)
        self._finish(None)
        return self

    def on_done(self, fn: Callable[[EncodedWindow], None]) -> None:
        """Call ``fn(self)`` once the last chunk is produced (now if it is)."""
        with self._cond:
            if not self._done:
                self._on_done.append(fn)
                return
        fn(self)

    def _finish(self, error: BaseException | None) -> None:
        with self._cond:
            self._error = error
            self._done = True
            self._producing = False
            self._produce = None
            callbacks, self._on_done = self._on_done, []
            self._cond.notify_all()
        self.pins.release()
        spill.after_chunk(0, done=True)  # (the spill's pages it read leave the RSS)
        for fn in callbacks:
            fn(self)

    def _next(self) -> bytes | None:
        """The next chunk from the producer (None: no more); the caller holds the turn."""
        assert self._produce is not None
        with pinning(self.pins):
            for c, seconds in self._produce:
                self.merge_seconds += seconds
                if c is not None:
                    self.payload_bytes += len(c)
                    spill.after_chunk(len(c))
                    return c
        return None

    def iter_chunks(self) -> Iterator[bytes]:
        """The chunks in order, producing them as needed; re-raises the producer's error.

        A kept window's last reader that stops early produces the rest before it goes (the
        cache then holds a complete window, and no half-built one keeps its segments).
        """
        if not self.kept:
            yield from self._stream()
            return
        with self._cond:
            self._readers += 1
        i = 0
        try:
            while True:
                c = self._chunk(i)
                if c is None:
                    return
                i += 1
                yield c
        finally:
            with self._cond:
                self._readers -= 1
                rest = self._readers == 0 and not self._done
            if rest:
                try:
                    while self._chunk(i) is not None:
                        i += 1
                except Exception:
                    log.warning("window: producing the rest failed", exc_info=True)

    def _chunk(self, i: int) -> bytes | None:
        """Chunk ``i`` of a kept window (None past the end), produced if nobody has yet."""
        with self._cond:
            while i >= len(self._chunks) and not self._done and self._producing:
                self._cond.wait()
            if i < len(self._chunks):
                return self._chunks[i]
            if self._done:
                if self._error is not None:
                    raise self._error
                return None
            self._producing = True  # this reader's turn to produce the next chunk
        try:
            c = self._next()
        except BaseException as e:
            self._finish(e)
            raise
        if c is None:
            self._finish(None)
            return None
        with self._cond:
            self._chunks.append(c)
            self._producing = False
            self._cond.notify_all()
        return c

    def _stream(self) -> Iterator[bytes]:
        """The one reader of a window not kept: produce and hand over, keeping nothing."""
        produce, self._produce = self._produce, None
        if produce is None:  # finished already (finish_with) or a second reader
            if not self._done:
                raise RuntimeError("a window that is not kept has one reader")
            yield from self._chunks
            return
        error: BaseException | None = None
        try:
            while True:
                with pinning(self.pins):  # (not across the yield: the reader's code)
                    got = next(produce, None)
                if got is None:
                    break
                c, seconds = got
                self.merge_seconds += seconds
                if c is not None:
                    self.payload_bytes += len(c)
                    spill.after_chunk(len(c))
                    yield c
        except GeneratorExit:
            raise
        except BaseException as e:
            error = e
            raise
        finally:
            close = getattr(produce, "close", None)
            if close is not None:
                close()
            self._finish(error)
