"""What the sidecar's memory is, read at scrape time: the process's resident set, what it
held before indexing anything (the runtime: interpreter, torch, gRPC, the heap at start, and
the libraries' resident pages), the free heap malloc keeps beyond that (the sidecar tunes
malloc to keep freed memory for reuse: :mod:`deltad.perf`), and the resident pages of the
files it maps that are not libraries: the spilled base and the spool's files, each its own
gauge (:class:`MappedFiles`, from ``/proc/self/smaps``). With the log, the caches and the
pack-once store (:meth:`deltad.serve.metrics.SidecarMetrics.track_sidecar`) they add up to
the RSS (``tests/test_sidecar_mem_gauges.py``).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

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


#: the log's private copies of its segments (deltad.segment.validate): counted as the log
MEMFD_LOG = "/memfd:deltad-segment"


class MappedFiles:
    """Resident bytes of this process's file mappings, by what they are: ``spill`` (under
    ``spill_dir``: the spilled merged base), ``spool`` (other files under ``spool_dir``: a
    segment or dense state read in place), ``log`` (the log's memfd copies) and ``files``
    (everything else file-backed: the libraries). Read from ``/proc/self/smaps`` (a page-table
    walk, tens of ms in a torch process), at most once per ``max_age_s`` for all of them."""

    def __init__(self, spool_dir: Path | None, spill_dir: Path | None, max_age_s: float = 1.0):
        self.spool = None if spool_dir is None else str(Path(spool_dir).resolve()) + "/"
        self.spill = None if spill_dir is None else str(Path(spill_dir).resolve()) + "/"
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._at = -1e18
        self._last: dict[str, int] = {}

    def read(self) -> dict[str, int]:
        """{spill, spool, log, files}: resident bytes of each (empty where /proc cannot tell)."""
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self.max_age_s:
                self._last = self._parse()
                self._at = time.monotonic()
            return self._last

    def get(self, what: str) -> int:
        return self.read().get(what, 0)

    def _parse(self) -> dict[str, int]:
        out = {"spill": 0, "spool": 0, "log": 0, "files": 0}
        try:
            with open(f"/proc/{os.getpid()}/smaps", "rb") as f:
                data = f.read()
        except OSError:
            return {}
        what: str | None = None
        for line in data.split(b"\n"):
            if line.startswith(b"Rss:"):
                if what is not None:
                    out[what] += int(line.split()[1]) * 1024
                continue
            head = line.split(None, 5)
            if len(head) < 5 or b"-" not in head[0] or head[0].endswith(b":"):
                continue  # a field line of the mapping above
            # a mapping: range perms offset dev inode [path]; inode 0: anonymous
            path = head[5].decode(errors="replace") if len(head) == 6 else ""
            if head[4] == b"0" and not path.startswith("/"):
                what = None  # anonymous ([heap], [stack], ...): the RssAnon side
            elif path.startswith(MEMFD_LOG):
                what = "log"
            elif self.spill is not None and path.startswith(self.spill):
                what = "spill"
            elif self.spool is not None and path.startswith(self.spool):
                what = "spool"
            elif path.startswith("/memfd:") or path.startswith("/dev/"):
                what = None  # other shared memory (counted where it is made)
            else:
                what = "files"
        return out


class MemoryBaseline:
    """The sidecar's runtime memory: its anonymous memory once it has indexed the log and
    before it serves (interpreter, torch, gRPC, their heaps; the log's private copies are
    shared memory, not anonymous) and the mapped libraries' resident pages, read live
    (libraries load more as they are first used). With ``mapped``, the library pages are
    those of :class:`MappedFiles` (the spill's and the spool's resident pages are not the
    runtime: they have gauges of their own); without, every resident file page."""

    def __init__(self, mapped: MappedFiles | None = None) -> None:
        self.anon = status_bytes().get("RssAnon", 0)
        self.heap_free = heap_free_bytes()
        self.mapped = mapped

    def runtime(self) -> int:
        """Runtime bytes: the anonymous baseline plus the resident library pages now."""
        if self.mapped is not None:
            files = self.mapped.read()
            if files:
                return self.anon + files["files"]
        return self.anon + status_bytes().get("RssFile", 0)

    def heap_free_growth(self) -> int:
        """Free heap bytes kept beyond those at start (freed temporaries malloc keeps)."""
        return max(0, heap_free_bytes() - self.heap_free)

    def heap_trimmed(self) -> None:
        """The free heap was just handed back to the kernel (``malloc_trim``): malloc still
        counts those bytes free, but their pages are no longer resident, so growth counts
        from here."""
        self.heap_free = heap_free_bytes()
