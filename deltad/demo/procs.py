"""Where `deltad demo` runs: its work directory and its children, each with a log, stopped by group."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from deltad.errors import ConfigError
from deltad.parent import PARENT_PID_ENV


class DemoFailed(Exception):
    """A child failed or a bounded wait ran out."""


@dataclass
class Child:
    """A subprocess of the demo, its log file and what it printed so far."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path


class WorkDir:
    """The demo's work directory (spool, logs, tables, the embedded Redis): ``--workdir``, or
    a temporary one that :meth:`discard` removes after an early end unless ``--keep``.

    A ``--workdir`` must be a new or an empty directory (one the demo can create): a previous
    run's spool and the Redis holding its predictors' cursors would mix both runs in the report
    and the checks. ConfigError (one line, exit 2) otherwise, before anything starts."""

    def __init__(self, workdir: Path | None, keep: bool) -> None:
        self.tmp = workdir is None
        self.keep = keep
        if workdir is not None:
            check_workdir(workdir)
        self.path = Path(workdir or tempfile.mkdtemp(prefix="deltad-demo-")).resolve()
        self.spool = self.path / "spool"
        self.logs = self.path / "logs"
        try:
            self.logs.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--workdir {workdir}: cannot create it: {e.strerror or e}") from None

    def discard(self, *, keep_logs: bool = False) -> str:
        """Remove the temporary work directory (spool, tables, the embedded Redis and its
        secret; with ``keep_logs`` all but ``logs/``) after an early end, unless ``--keep`` or
        ``--workdir``; says what it did."""
        if not self.tmp or self.keep:
            return f"work directory kept: {self.path}"
        if not keep_logs:
            shutil.rmtree(self.path, ignore_errors=True)
            return f"removed its work directory {self.path} (--keep keeps it)"
        for p in self.path.iterdir() if self.path.is_dir() else ():
            if p != self.logs:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        return (
            f"removed its work directory {self.path} but its logs ({self.logs}; --keep keeps all)"
        )

    def remove_if_temporary(self) -> None:
        """After a run whose checks held: remove a temporary directory unless ``--keep``."""
        if self.tmp and not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)


def check_workdir(workdir: Path) -> None:
    """ConfigError unless ``workdir`` is a new or an empty directory (see :class:`WorkDir`)."""
    what = f"--workdir {workdir}"
    try:
        if not workdir.exists():
            return  # created by WorkDir (an error there is one line too)
        if not workdir.is_dir():
            raise ConfigError(f"{what}: not a directory")
        if next(workdir.iterdir(), None) is not None:
            raise ConfigError(
                f"{what}: not empty (a previous demo's spool and offsets would mix into this "
                "run); pick an empty or a new directory"
            )
    except OSError as e:
        raise ConfigError(f"{what}: {e.strerror or e}") from None


class Children:
    """The demo's children (``deltad <subcommand>`` in their own process groups): spawn, check
    alive, stop (SIGTERM, a bounded wait, then SIGKILL)."""

    def __init__(self, work: Path, logs: Path) -> None:
        self.work = work
        self.logs = logs
        #: the children's environment (the caller may add to it before a spawn): this
        #: checkout's ``deltad`` first on PYTHONPATH, the allocator tuned for large tables
        self.env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (root, self.env.get("PYTHONPATH")) if p)
        self.env.setdefault("MALLOC_MMAP_MAX_", "0")
        self.env.setdefault("MALLOC_TRIM_THRESHOLD_", str(4 << 30))
        self.running: list[Child] = []

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        executable: bool = False,
        env: dict[str, str] | None = None,
    ) -> Child:
        """Start ``deltad ARGV`` in the work directory, its output in ``logs/<name>.log``;
        ``executable``: ARGV is a program of its own (the C++ predictor), its standard output
        (JSON lines) in ``logs/<name>.jsonl``, its standard error in ``logs/<name>.log``;
        ``env``: variables set (or, given "", emptied) for this child only."""
        log = self.logs / f"{name}.log"
        cmd = list(argv) if executable else [sys.executable, "-m", "deltad", *argv]
        with (
            open(log, "wb") as err,
            open(self.logs / f"{name}.jsonl" if executable else os.devnull, "wb") as lines,
        ):
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=lines if executable else err,
                stderr=err if executable else subprocess.STDOUT,
                env={**self.env, **(env or {}), PARENT_PID_ENV: str(os.getpid())},
                cwd=self.work,
                start_new_session=True,
            )
        child = Child(name, proc, log)
        self.running.append(child)
        return child

    def stop_all(self) -> None:
        """SIGTERM every child (its process group), wait bounded, SIGKILL the rest."""
        for c in reversed(self.running):
            signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + 15.0
        for c in reversed(self.running):
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(c.proc, signal.SIGKILL)
                c.proc.wait(timeout=10.0)
        self.running.clear()

    def stop(self, names: Sequence[str], timeout_s: float) -> None:
        """SIGTERM the children called ``names`` and wait (bounded) for each to exit 0."""
        deadline = time.monotonic() + timeout_s
        for c in self.running:
            if c.name in names:
                signal_group(c.proc, signal.SIGTERM)
        for c in self.running:
            if c.name in names:
                try:
                    rc = c.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise DemoFailed(f"{c.name} did not stop; see {c.log}") from None
                if rc != 0:
                    raise DemoFailed(f"{c.name} exited with {rc}; see {c.log}")

    def check_alive(self) -> None:
        """DemoFailed if any child but the trainer has exited."""
        for c in self.running:
            if c.name != "trainer" and c.proc.poll() is not None:
                raise DemoFailed(f"{c.name} exited with {c.proc.returncode}; see {c.log}")

    def wait_until(
        self, cond: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.1
    ) -> None:
        """Poll ``cond`` until it is true, for at most ``timeout_s``; every child must stay
        alive meanwhile (:class:`DemoFailed` otherwise, or when the time runs out)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # bounded
            if cond():
                return
            self.check_alive()
            time.sleep(poll_s)
        raise DemoFailed(f"timed out waiting for {what}")


def wait_serving(child: Child, timeout_s: float = 120.0) -> str:
    """Endpoint from the sidecar's ``serving <model> rank <r> on <host:port>`` line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in child.log.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) >= 6 and parts[0] == "serving" and parts[4] == "on":
                return parts[5]
        if child.proc.poll() is not None:
            break
        time.sleep(0.05)
    raise DemoFailed(f"{child.name} did not start serving; see {child.log}")


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to a running child's process group."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C, so the children are cleaned up either way."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def statuses(endpoints: Sequence[str], timeout_s: float = 5.0) -> list[Any] | None:
    """Every sidecar's StatusResponse, in order; None if one does not answer."""
    import grpc

    from deltad.v1 import delta_pb2 as pb
    from deltad.v1 import delta_pb2_grpc as pb_grpc

    out = []
    for ep in endpoints:
        with grpc.insecure_channel(ep) as ch:
            try:
                out.append(
                    pb_grpc.DeltaServiceStub(ch).Status(pb.StatusRequest(), timeout=timeout_s)
                )
            except grpc.RpcError:
                return None
    return out
