"""Reusable destination buffers for the tensors a consumer rebuilds every pull.

A predictor pulls a window, applies it and drops it, then pulls again. Allocating the rebuilt
tensors afresh each time makes every pull depend on the allocator still holding the pages
of the last one: when it gives them back to the kernel, the next pull page-faults its whole
size again (a 1 GB window is 262 k faults, 0.3-1.6 s of system time measured here).
:class:`BufferPool` keeps the buffers of earlier pulls and hands one out again **only once
nothing outside the pool refers to its memory** (no tensor, view, numpy array or DLPack
capsule of it is alive), so a result the caller still holds is never overwritten. One way to
hold the memory escapes it: a Python ``UntypedStorage`` object kept alone (``t.untyped_storage()``
with every tensor over it dropped) does not count; keep a tensor or view instead, or copy, or
turn the pool off (``ConsumerConfig.reuse_buffers_bytes = 0``).

A pool is thread-safe; ``DeltaConsumer`` keeps one per rank, and the trainer's
``SegmentPublisher`` one for its touched-row copies (pinned for device weights, with headroom
so a copy that grew a little still fits; a buffer whose segment is queued or being written is
referenced by that job, so it is never handed out again before the file is written).
"""

from __future__ import annotations

import mmap
import threading
from typing import Any

import torch

#: Buffers are rounded up to this many bytes, so windows of slightly different sizes reuse
#: each other's buffers.
GRANULE = 1 << 20
#: Tensors smaller than this come from the allocator as usual: small blocks are recycled from
#: its free lists anyway, and pooling them would pin a granule per small tensor.
MIN_POOLED_BYTES = 1 << 20


#: torch's count of references to a storage (private API; without it nothing is reused)
_USE_COUNT: Any = getattr(torch._C, "_storage_Use_Count", None)


def storage_refs(t: torch.Tensor) -> int | None:
    """How many references the storage under ``t`` has (None: this torch cannot tell)."""
    if _USE_COUNT is None:
        return None
    return int(_USE_COUNT(t.untyped_storage()._cdata))


class _Buffer:
    __slots__ = ("base", "idle_refs", "pinned", "used")

    def __init__(self, nbytes: int, device: torch.device, pinned: bool) -> None:
        self.base = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pinned)
        self.pinned = pinned
        # references while only the pool holds it (measured, not assumed: torch versions
        # differ in whether the Python storage object is cached)
        self.idle_refs = storage_refs(self.base)
        self.used = True

    @property
    def nbytes(self) -> int:
        return int(self.base.numel())

    def free(self) -> bool:
        return self.idle_refs is not None and storage_refs(self.base) == self.idle_refs


class BufferPool:
    """Hands out tensors backed by buffers of earlier pulls that nobody references any more.

    :meth:`take` returns an uninitialised tensor; :meth:`end_round` (call it once a pull is
    decoded) drops the free buffers that round did not use, so the pool holds about one
    window plus whatever results the caller still keeps. ``max_bytes`` bounds what it keeps;
    tensors under ``min_bytes`` (default :data:`MIN_POOLED_BYTES`) are plain allocations.
    A new buffer is ``headroom`` (a fraction) larger than asked, rounded up to ``granule``
    bytes (default :data:`GRANULE`).
    """

    def __init__(
        self,
        *,
        max_bytes: int = 8 << 30,
        min_bytes: int | None = None,
        device: torch.device | str = "cpu",
        granule: int = GRANULE,
        headroom: float = 0.0,
    ) -> None:
        if min_bytes is None:
            min_bytes = MIN_POOLED_BYTES
        if max_bytes < 0 or min_bytes < 0:
            raise ValueError(f"max_bytes and min_bytes must be >= 0, got {max_bytes}, {min_bytes}")
        if granule < 1 or headroom < 0:
            raise ValueError(f"granule must be >= 1 and headroom >= 0, got {granule}, {headroom}")
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self.device = torch.device(device)
        self.granule = granule
        self.headroom = headroom
        self._buffers: list[_Buffer] = []
        self._lock = threading.Lock()
        #: buffers handed out again / allocated, over the pool's life (for tests and metrics)
        self.reused = 0
        self.allocated = 0

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (in use or free)."""
        return sum(b.nbytes for b in self._buffers)

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, *, pin_memory: bool = False
    ) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype``, on a reused buffer if one is free
        (``pin_memory``: page-locked host memory, for asynchronous copies from a device)."""
        n = 1
        for s in shape:
            n *= s
        nbytes = n * dtype.itemsize
        if nbytes == 0 or nbytes < self.min_bytes:
            return torch.empty(shape, dtype=dtype, device=self.device, pin_memory=pin_memory)
        with self._lock:
            return self._take(nbytes, dtype, shape, pin_memory)

    def _take(
        self, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...], pinned: bool
    ) -> torch.Tensor:
        best: _Buffer | None = None
        for b in self._buffers:
            if (
                not b.used
                and b.pinned == pinned
                and b.nbytes >= nbytes
                and (best is None or b.nbytes < best.nbytes)
                and b.free()
            ):
                best = b
        if best is None:
            want = nbytes + int(nbytes * self.headroom)
            size = -(-want // self.granule) * self.granule
            if sum(b.nbytes for b in self._buffers) + size > self.max_bytes:
                return torch.empty(shape, dtype=dtype, device=self.device, pin_memory=pinned)
            best = _Buffer(size, self.device, pinned)
            self._buffers.append(best)
            self.allocated += 1
        else:
            self.reused += 1
        best.used = True
        return best.base[:nbytes].view(dtype).view(shape)

    def end_round(self) -> None:
        """Forget the free buffers this round did not use; mark every buffer unused."""
        with self._lock:
            keep = []
            for b in self._buffers:
                if b.used or not b.free():
                    keep.append(b)
                b.used = False
            self._buffers = keep

    def clear(self) -> None:
        """Forget every buffer (tensors handed out stay valid: they keep their memory)."""
        with self._lock:
            self._buffers = []


def mapped_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in a mapping of its own, given back to the kernel as soon
    as the tensor (and every view of it) is freed.

    For large temporaries of long-lived processes: the sidecar tunes malloc to keep freed
    heap memory (no mmap, a high trim threshold: :mod:`deltad.perf`), so a heap temporary the
    size of a merged base would stay in its RSS for good once freed."""
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # (private: counted as RssAnon; the tensor holds the buffer, the mapping goes with it)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mm, dtype=torch.uint8).view(dtype).view(shape)
