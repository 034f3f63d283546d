"""Process-wide memory settings for moving large buffers fast (sidecar and consumers).

:func:`tune_malloc` applies, at runtime, what ``MALLOC_MMAP_MAX_=0
MALLOC_TRIM_THRESHOLD_=2G MALLOC_ARENA_MAX=1`` would at startup, through glibc's ``mallopt``:

* ``M_MMAP_MAX = 0``: large allocations come from the heap instead of a fresh ``mmap`` each.
  A fresh mapping is zero-filled page by page on first touch, so every new multi-MB buffer
  (a merged window, an encoded 2 MB chunk, a received message, a tensor being rebuilt) pays
  page faults: ``ndarray.tobytes()`` of 64 MB runs at ~2.2 GB/s vs 12-14 GB/s with the
  setting (measured on this project's hardware).
* ``M_ARENA_MAX = 1``: every thread allocates from the main heap, to which the two settings
  here apply. Other threads otherwise get arenas of their own, built from 64 MB mmapped heaps
  that are handed back to the kernel as they empty: a window decoded in a worker thread (as
  ``DeltaConsumer`` does, one thread per rank) page-faulted its whole size again every pull.
  Measured (1 GB fp32 window, loopback, steady state): decoding in a pool thread 1.0 GB/s
  with 260 k page faults per pull, 2.1 GB/s and none with the setting.
* ``M_TRIM_THRESHOLD = 2 GiB - 1`` (``mallopt`` takes an ``int``; the environment form takes
  ``4G``): freed heap memory is kept for the next window instead of being returned to the
  kernel and faulted in again.

Measured (2-core shared VM, loopback, 256 MB fp32 window, every process tuned): the bare
Python gRPC stream 1.3-1.4 -> 2.05-2.3 GB/s, GetDelta 0.65 -> 1.46 GB/s (97 % of bare gRPC in
that run). The price: freed memory stays in the process (RSS holds its high-water mark).

It does **not** turn on torch's transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``): with the
common kernel setting ``transparent_hugepage/defrag = madvise`` every huge-page fault may
compact memory synchronously. Measured (1 GB fp32 window, client process): the first pull
took 3.3-4.5 s with it (2.8 s of system time) against 1.2-1.3 s without; later pulls reuse
the heap and gain nothing from it. Set it yourself where ``defrag`` is ``defer`` or ``never``.

glibc only; elsewhere (musl, macOS) it does nothing. It never raises and is idempotent.
``DELTAD_MALLOC_TUNE=0`` in the environment leaves the allocator alone.
"""

from __future__ import annotations

import ctypes
import os
import threading

#: glibc <malloc.h> parameter numbers
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
#: the largest trim threshold ``mallopt`` accepts (an ``int``)
TRIM_THRESHOLD = (1 << 31) - 1

_lock = threading.Lock()
_applied: bool | None = None


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version  # glibc only (musl has a mallopt stub)
        version.restype = ctypes.c_char_p
        version()
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def tune_malloc() -> bool:
    """Apply the allocator settings above once per process; True if ``mallopt`` took them."""
    global _applied
    with _lock:
        if _applied is not None:
            return _applied
        _applied = False
        try:
            if os.environ.get("DELTAD_MALLOC_TUNE", "1").strip().lower() in ("0", "false", "no"):
                return False
            libc = _glibc()
            if libc is None:
                return False
            ok_mmap = libc.mallopt(M_MMAP_MAX, 0) == 1
            ok_trim = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
            ok_arena = libc.mallopt(M_ARENA_MAX, 1) == 1
            _applied = ok_mmap and ok_trim and ok_arena
        except Exception:  # a tuning knob must never break startup
            _applied = False
        return _applied


def trim_heap() -> bool:
    """Hand malloc's free heap back to the kernel now (glibc ``malloc_trim(0)``; the tuning
    above otherwise keeps it for good); True if memory was released. Never raises."""
    try:
        libc = _glibc()
        if libc is None:
            return False
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        return bool(libc.malloc_trim(0))
    except Exception:
        return False


def tune_threads() -> None:
    """One torch intra-op thread, for processes that move data rather than compute on it.

    The sidecar and ``deltad consume`` run many small tensor ops (a quantized or decoded
    2 MB chunk at a time) from several threads. With torch's default of one OpenMP thread
    per core, each op forks a parallel region whose workers then spin, on the same two cores
    the gRPC threads need. Measured (256 MB window, loopback, 2 cores): an int8 pull's server
    CPU 0.35 -> 0.13 s and time 0.27 -> 0.16 s; fp16 0.49 -> 0.14 s. Where deltad wants
    parallelism (a window merge) it uses its own threads. An ``OMP_NUM_THREADS`` already set
    is left alone; call before torch is imported (``torch.set_num_threads`` after).
    """
    import sys

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch = sys.modules.get("torch")
    if torch is not None and os.environ["OMP_NUM_THREADS"] == "1":
        torch.set_num_threads(1)


def usable_cores() -> int:
    """CPUs this process may use: its affinity mask, bounded by its cgroup's (v2) CPU quota,
    as a container's CPU limit sets it; at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        n = min(n, -int(-quota // 1))  # (a quota of 1.5 cores lets two threads run)
    return max(1, n)


def cgroup_cpu_quota(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> float | None:
    """Cores' worth of CPU time the process's cgroup grants (v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``: quota / period); None where it sets none or
    it cannot be read (``proc_cgroup``, ``root``: where to read them)."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for hierarchy, controllers, rel in (x for x in lines if len(x) == 3):
        try:
            if hierarchy == "0" and not controllers:  # v2
                with open(os.path.join(root, rel.lstrip("/"), "cpu.max")) as f:
                    fields = f.read().split()
            elif "cpu" in controllers.split(","):  # v1
                d = os.path.join(root, controllers, rel.lstrip("/"))
                if not os.path.isdir(d):  # mounted as "cpu" with "cpu,cpuacct" a link to it
                    d = os.path.join(root, "cpu", rel.lstrip("/"))
                with open(os.path.join(d, "cpu.cfs_quota_us")) as f:
                    quota = f.read().strip()
                with open(os.path.join(d, "cpu.cfs_period_us")) as f:
                    fields = [quota, f.read().strip()]
            else:
                continue
        except OSError:
            continue
        if len(fields) < 2 or fields[0] in ("max", "-1"):
            continue
        try:
            return max(0.0, int(fields[0]) / max(1, int(fields[1])))
        except ValueError:
            continue
    return None


#: GetDelta's prefetching producer pays where a core is free for it: gRPC's handler, poller
#: and event-engine threads (and, on a shared box, the consumer) keep two busy. Measured on 2
#: cores (1 GB fp32 window, consumer on the same cores, 12 interleaved rounds, twice): with the
#: producer 0.80 / 0.84x bare gRPC at 0.68 / 0.60 CPU-s per GB, without it 0.89 / 0.89x at
#: 0.57 / 0.53 (int8: 0.33 vs 0.34x); with cores to spare, building (~0.2 CPU-s per GB) and
#: sending (~0.35) overlap.
PREFETCH_MIN_CORES = 4
PREFETCH_MESSAGES = 3


def default_prefetch_messages(cores: int | None = None) -> int:
    """The sidecar's default ``prefetch_messages``: :data:`PREFETCH_MESSAGES` with at least
    :data:`PREFETCH_MIN_CORES` usable cores (``cores``, else :func:`usable_cores`), else 0."""
    n = usable_cores() if cores is None else cores
    return PREFETCH_MESSAGES if n >= PREFETCH_MIN_CORES else 0


#: ``madvise`` advice: reclaim these pages now (Linux >= 5.4)
MADV_PAGEOUT = 21


def _library_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's loaded shared libraries that are never written
    (code and read-only data: ``r-xp`` / ``r--p`` mappings of a ``*.so*`` file)."""
    out: list[tuple[int, int]] = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[1] not in ("r-xp", "r--p"):
                continue
            name = fields[5].rstrip("\n").rsplit("/", 1)[-1]
            if not (name.endswith(".so") or ".so." in name):
                continue
            lo, _, hi = fields[0].partition("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def page_out_libraries() -> int:
    """Give back the resident pages of the loaded libraries' code and read-only data
    (``madvise(MADV_PAGEOUT)``): clean file pages, most touched once by start-up (libtorch's
    static registrations fault in ~80 MB of them), which the kernel would drop under memory
    pressure anyway. A page used again is read back from the page cache or the disk. Pages
    another process maps too are left (the kernel skips them). Returns the number of ranges
    advised; 0 where the kernel or libc cannot (Linux < 5.4, not glibc). Never raises."""
    try:
        libc = _glibc()
        if libc is None:
            return 0
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        done = 0
        for lo, hi in _library_ranges():
            if madvise(lo, hi - lo, MADV_PAGEOUT) == 0:
                done += 1
        return done
    except Exception:
        return 0
