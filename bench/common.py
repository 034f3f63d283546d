"""Shared plumbing of the benchmarks: statistics, the run context, child processes, memory.

Every benchmark is a function ``run(ctx) -> dict`` registered in :mod:`bench.run`. It raises
:class:`NotAvailable` when a deltad component it needs is missing, and reports samples through
:func:`summarize` (median, min, max, spread) so ratios can be formed in the same run.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from bench.wire_baselines import ClientWorker
    from deltad.config import ConsumerConfig

#: The repository root (``bench/``'s parent): children get it on PYTHONPATH.
REPO_ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = Path(__file__).resolve().parent / "out"
#: recorded results (committed): what bench/README.md quotes and bench.plots draws
RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: figures drawn from RESULTS_DIR by ``python -m bench.plots`` (committed, in the README)
FIGURES_DIR = Path(__file__).resolve().parent / "figures"

GB = 1e9
MB = 1 << 20

#: The synthetic spool the sidecar benchmarks pull from (:func:`bench.datagen.write_spool`):
#: ``TABLES`` tables of dim ``DIM``, a base and ``DELTAS`` deltas.
#: The model name of every bench spool and sidecar.
MODEL = "bench"
TABLES = 4
DIM = 64
DELTAS = 16


def rows_per_table(window_bytes: int) -> int:
    """Rows per table for a fresh consumer's fp32 window of ``window_bytes`` over that
    spool's tables (an 8-byte id and ``DIM`` floats a row)."""
    return window_bytes // (8 + DIM * 4) // TABLES


class NotAvailable(Exception):
    """A benchmark cannot run here: a deltad component it needs is missing or incomplete.

    ``partial`` keeps what was measured anyway (the baselines), so it is still reported.
    """

    def __init__(self, why: str, partial: dict[str, Any] | None = None) -> None:
        super().__init__(why)
        self.partial = partial or {}


def summarize(samples: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and spread ((max - min) / median, in %) of repeated measurements."""
    xs = [float(x) for x in samples if x is not None and math.isfinite(float(x))]
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None, "spread_pct": None}
    med = statistics.median(xs)
    spread = (max(xs) - min(xs)) / med * 100.0 if med else 0.0
    return {
        "n": len(xs),
        "median": med,
        "min": min(xs),
        "max": max(xs),
        "spread_pct": spread,
        "samples": xs,
    }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation, None for no values."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def med(d: dict[str, Any] | None) -> float | None:
    """The median of a :func:`summarize` dict (None-safe)."""
    return None if d is None else d.get("median")


def medf(d: dict[str, Any] | None) -> float:
    """The median of a :func:`summarize` dict, NaN when there is none (for arithmetic)."""
    m = med(d)
    return math.nan if m is None else float(m)


@dataclass
class Context:
    """What every benchmark gets: the size preset, repeats, where to write, progress output."""

    quick: bool = False
    tiny: bool = False  # smaller than --quick: the smoke test
    repeats: int = 3
    out_dir: Path = OUT_DIR
    work_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()))
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)
    #: Advance an outer progress bar description (set by the runner).
    status: Callable[[str], None] = lambda msg: None
    #: Results shared between benchmarks of one run (the tiny preset shares a live run).
    cache: dict[str, Any] = field(default_factory=dict)
    #: Called by the runner after the last benchmark (removes shared scratch dirs).
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def pick(self, full: Any, quick: Any, tiny: Any | None = None) -> Any:
        """The value for the current size preset."""
        if self.tiny:
            return quick if tiny is None else tiny
        return quick if self.quick else full

    @contextlib.contextmanager
    def tmpdir(self, prefix: str) -> Iterator[Path]:
        """A scratch directory under the work dir, removed afterwards."""
        with tempfile.TemporaryDirectory(prefix=f"deltad-bench-{prefix}-", dir=self.work_dir) as d:
            yield Path(d)


def machine_info() -> dict[str, Any]:
    """Conditions of the run: load, cores, memory, versions (stored with the results)."""
    import torch

    try:
        import grpc

        grpc_version = grpc.__version__
    except ImportError:  # pragma: no cover
        grpc_version = None
    vm = psutil.virtual_memory()
    return {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc_version,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": os.getloadavg(),
        "mem_total_gb": vm.total / GB,
        "mem_available_gb": vm.available / GB,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_commit": _git_commit(),
    }


def record_standalone(
    module: str, result: dict[str, Any], argv: list[str] | None, record: bool
) -> str:
    """A standalone benchmark's end (``python -m bench.<module>``): stamp ``result`` with the
    machine and the date, write ``bench/results/<module with dashes>.json`` (``{source,
    result}``) if ``record``; return its JSON line (to print)."""
    result["machine"] = machine_info()
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if record:
        args = " ".join(sys.argv[1:] if argv is None else argv)
        out = {"source": f"python -m bench.{module} {args} ({result['date']})", "result": result}
        name = module.replace("_", "-") + ".json"
        (Path(__file__).parent / "results" / name).write_text(json.dumps(out, indent=1))
    return json.dumps(result)


def _git_commit() -> str | None:
    """The repository's HEAD (plus "-dirty" with uncommitted changes), or None."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if head and dirty else head or None


def self_peak_rss() -> int:
    """Peak resident set size of this process, bytes.

    VmHWM of this address space; ``ru_maxrss`` would be wrong in spawned children, because
    Linux carries it across exec (a child would report the harness's peak).
    """
    hwm = proc_peak_rss(os.getpid())
    if hwm:
        return hwm
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def proc_peak_rss(pid: int) -> int | None:
    """Peak RSS (VmHWM) of a live process, bytes; None if it is gone."""
    return proc_status_bytes("VmHWM:", pid)


def proc_status_bytes(key: str, pid: int | str = "self") -> int | None:
    """A kB line of ``/proc/<pid>/status`` (``"VmRSS:"``, ``"VmHWM:"``, ...), in bytes; None
    if the process is gone or has no such line."""
    name = key.rstrip(":")
    return proc_status(pid, (name,)).get(name)


#: the memory lines of ``/proc/<pid>/status`` that :func:`proc_status` reads
STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def proc_status(pid: int | str = "self", keys: tuple[str, ...] = STATUS_KEYS) -> dict[str, int]:
    """Those kB lines of ``/proc/<pid>/status``, in bytes, by name; empty if the process is
    gone."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in keys:
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


class PeakRssMonitor:
    """Samples the peak RSS (VmHWM, including children) of named processes until stopped.

    VmHWM is the kernel's own high-water mark, so sampling every ``interval_s`` only risks
    missing the last moments of a process; :meth:`stop` takes a final reading.
    """

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.pids: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, name: str, pid: int) -> None:
        self.pids[name] = pid

    def _sample(self) -> None:
        for name, pid in list(self.pids.items()):
            total = 0
            try:
                procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                v = proc_peak_rss(p.pid)
                total += v or 0
            if total:
                self.peak[name] = max(self.peak.get(name, 0), total)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> PeakRssMonitor:
        self._thread = threading.Thread(target=self._loop, name="rss-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, int]:
        self._sample()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return dict(self.peak)


class CpuMonitor:
    """CPU seconds (user + system, including children) consumed by one process over a span."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self._t0 = self._cpu()

    def _cpu(self) -> float:
        try:
            t = self.proc.cpu_times()
            return float(t.user + t.system)
        except psutil.Error:
            return 0.0

    def reset(self) -> None:
        self._t0 = self._cpu()

    def seconds(self) -> float:
        return self._cpu() - self._t0


def settle(
    cpu: CpuMonitor, busy: float = 0.05, window_s: float = 0.25, limit_s: float = 20.0
) -> float:
    """Wait until the process uses under ``busy`` cores over ``window_s``; seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        cpu.reset()
        time.sleep(window_s)
        if cpu.seconds() < busy * window_s:
            break
    return time.monotonic() - t0


def metric(name: str, value: Any, unit: str, **more: Any) -> dict[str, Any]:
    """One row of a benchmark's headline: its metric's ``name``, ``value`` and ``unit``, then
    ``more`` (``baseline``, ``ratio``, ``target``, ``met``, where it has them)."""
    return {"metric": name, "value": value, "unit": unit, **more}


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(
    fig: Any, out_dir: Path, name: str, *, tight: bool = True, dpi: int = 110
) -> list[Path]:
    """Write ``fig`` as ``out_dir/name.png``, close it, return ``[path]``."""
    import matplotlib.pyplot as plt

    if tight:
        fig.tight_layout()
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return [path]


def save_panels(
    fig: Any, axes: Sequence[Any], ylabels: Sequence[str], title: str, out_dir: Path, name: str
) -> list[Path]:
    """Label a row of panels against consumers (their y labels, a legend each), title the
    figure and save it (:func:`save_figure`)."""
    for ax, ylabel in zip(axes, ylabels, strict=True):
        ax.set_ylabel(ylabel)
    for ax in axes:
        ax.set_xlabel("consumers")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, out_dir, name)


#: the sidecar's gauges that are parts of its RSS, each counted once (the spill and the spool:
#: their resident pages; the free heap malloc keeps)
RSS_PARTS = (
    "deltad_runtime_bytes",
    "deltad_log_bytes",
    "deltad_previous_generation_bytes",
    "deltad_window_cache_bytes",
    "deltad_run_cache_bytes",
    "deltad_packed_cache_bytes",
    "deltad_spill_resident_bytes",
    "deltad_spool_resident_bytes",
    "deltad_heap_free_bytes",
)


def metric_sums(port: int, prefix: str = "deltad_", timeout_s: float = 10.0) -> dict[str, float]:
    """A Prometheus ``/metrics`` page on 127.0.0.1:``port``: each sample named ``prefix...``
    summed over its labels (``name -> value``; counters keep their ``_total``)."""
    import urllib.request

    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for child processes: the repo root importable, quiet logging."""
    env = dict(os.environ)
    pp = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + pp if pp else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra:
        env.update(extra)
    return env


def deltad_command() -> list[str]:
    """How to run the ``deltad`` CLI as a child process (the console script's module)."""
    return [sys.executable, "-m", "deltad.commands.main"]


class Children:
    """Owns the child processes a benchmark starts; stops every one of them on exit.

    Stopping is SIGTERM, a bounded wait, then SIGKILL of that child (its own process group
    when it was started with ``start_new_session``); nothing is ever killed by name.
    """

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen[bytes]] = []
        self.procs: list[mp.process.BaseProcess] = []

    def popen(
        self, args: list[str], *, log_path: Path | None = None, **kw: Any
    ) -> subprocess.Popen[bytes]:
        out: Any = subprocess.DEVNULL
        if log_path is not None:
            out = open(log_path, "ab")  # noqa: SIM115 (closed with the child)
        kw.setdefault("env", child_env())
        kw.setdefault("cwd", str(REPO_ROOT))
        p = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **kw,
        )
        if log_path is not None:
            out.close()
        self.popens.append(p)
        return p

    def process(self, target: Callable[..., Any], *args: Any) -> mp.process.BaseProcess:
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=target, args=args, daemon=True)
        p.start()
        self.procs.append(p)
        return p

    @staticmethod
    def stop_popen(p: subprocess.Popen[bytes], timeout: float = 15.0) -> int | None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        return p.returncode

    def stop_all(self) -> None:
        for p in reversed(self.popens):
            self.stop_popen(p)
        for q in reversed(self.procs):
            q.join(timeout=10)
            if q.is_alive():
                q.terminate()
                q.join(timeout=5)
            if q.is_alive():
                q.kill()
                q.join(timeout=5)
        self.popens.clear()
        self.procs.clear()

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def warm_workers(kids: Children, n: int) -> list[ClientWorker]:
    """``n`` client worker processes with the consumer library imported (``client_warm``)."""
    from bench.wire_baselines import ClientWorker

    workers = [ClientWorker(kids) for _ in range(n)]
    for w in workers:
        w.send("call", module="bench.throughput", func="client_warm", kwargs={})
    for w in workers:
        w.recv("client_warm", 300.0)
    return workers


@contextlib.contextmanager
def spool_and_workers(
    ctx: Context, name: str, workers: int, *, rows: int, deltas: int = DELTAS
) -> Iterator[tuple[Path, Children, list[ClientWorker]]]:
    """A scratch spool (``rows`` rows per table, ``deltas`` deltas of 1 % of the rows), the
    children of the run and ``workers`` warm client workers; the workers are closed, the
    children stopped and the spool removed afterwards."""
    from bench.datagen import write_spool

    with ctx.tmpdir(name) as spool, Children() as kids:
        ctx.status(f"{name}: spool")
        write_spool(
            spool, model=MODEL, tables=TABLES, rows_per_table=rows, dim=DIM, deltas=deltas,
            delta_fraction=0.01,
        )  # fmt: skip
        ctx.status(f"{name}: consumer workers")
        started: list[ClientWorker] = []
        try:
            started += warm_workers(kids, workers)
            yield spool, kids, started
        finally:
            for w in started:
                w.close()


def consumer_config(consumer: str, model: str, endpoint: str, **more: Any) -> ConsumerConfig:
    """A consumer of one sidecar as the benchmarks run it: ranks not aligned (one rank), a
    600 s deadline per call; ``more``: the other :class:`~deltad.config.ConsumerConfig` fields."""
    from deltad.config import ConsumerConfig

    return ConsumerConfig(
        consumer=consumer, model=model, sidecars=(endpoint,), align_steps=False,
        rpc_deadline_s=600.0, **more,
    )  # fmt: skip


def wait_until(pred: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``pred`` until true or the timeout passes; return its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return pred()


def finite_positive(x: Any) -> bool:
    """True for a finite number > 0 (used by the smoke test and sanity checks)."""
    return isinstance(x, int | float) and math.isfinite(x) and x > 0
