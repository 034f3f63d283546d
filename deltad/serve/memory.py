"""What the sidecar's memory is, read at scrape time: the process's resident set, what it
held before indexing anything (the runtime: interpreter, torch, gRPC, the heap at start),
and the free heap malloc keeps beyond that (the sidecar tunes malloc to keep freed memory
for reuse: :mod:`deltad.perf`). With the log, the caches and the spill
(:meth:`deltad.serve.metrics.SidecarMetrics.track_sidecar`) they add up to the RSS.
"""

from __future__ import annotations

import ctypes
import os

#: What a sidecar or relay process needs beyond its log and its cache budgets: the runtime
#: (interpreter, torch, gRPC, the heap at start; ``deltad_runtime_bytes``, measured 270-290
#: MB on these machines), with room. README "Sizing" adds it to a memory limit.
RUNTIME_BYTES = 384 << 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _mallinfo2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    fn.argtypes = []
    return fn  # type: ignore[no-any-return]


_MALLINFO2 = _mallinfo2()


def status_bytes() -> dict[str, int]:
    """This process's VmRSS, RssAnon, RssFile and RssShmem in bytes (empty where /proc cannot
    tell)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def rss_bytes() -> int:
    """This process's resident set (VmRSS), in bytes; 0 where /proc cannot tell."""
    return status_bytes().get("VmRSS", 0)


def heap_free_bytes() -> int:
    """Bytes malloc holds free in its heap (glibc's ``mallinfo2().fordblks``; 0 elsewhere)."""
    if _MALLINFO2 is None:
        return 0
    return int(_MALLINFO2().fordblks)


class MemoryBaseline:
    """The sidecar's runtime memory: its anonymous memory once it has indexed the log and
    before it serves (interpreter, torch, gRPC, their heaps; the log's private copies are
    shared memory, not anonymous) and the mapped libraries' resident pages, read live
    (libraries load more as they are first used)."""

    def __init__(self) -> None:
        self.anon = status_bytes().get("RssAnon", 0)
        self.heap_free = heap_free_bytes()

    def runtime(self) -> int:
        """Runtime bytes: the anonymous baseline plus the resident library pages now."""
        return self.anon + status_bytes().get("RssFile", 0)

    def heap_free_growth(self) -> int:
        """Free heap bytes kept beyond those at start (freed temporaries malloc keeps)."""
        return max(0, heap_free_bytes() - self.heap_free)

    def heap_trimmed(self) -> None:
        """The free heap was just handed back to the kernel (``malloc_trim``): malloc still
        counts those bytes free, but their pages are no longer resident, so growth counts
        from here."""
        self.heap_free = heap_free_bytes()
