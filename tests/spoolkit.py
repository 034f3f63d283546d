"""Test helpers for the consumer side: hand-built spools and real sidecars.

:class:`FakeTrainer` writes what a row-wise sharded trainer would publish (manifest, a base per
rank, then delta segments of random rows) and keeps the truth: the full tables at every step.
:func:`running_sidecars` / :func:`running_serve` run real sidecars (in-process on port 0, or
`deltad serve` subprocesses).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from deltad.segment.format import ShardRows, write_segment
from deltad.segment.spool import GenerationManifest, SpoolLayout, TableInfo
from deltad.types import SegmentKind, Shard

ROOT = Path(__file__).resolve().parents[1]


class FakeTrainer:
    """Publishes row-wise shards of ``tables`` ({name: (rows, dim)}) into a spool."""

    def __init__(
        self,
        spool: Path,
        *,
        model: str = "m",
        world_size: int = 2,
        generation: int = 1,
        tables: dict[str, tuple[int, int]] | None = None,
        seed: int = 0,
    ) -> None:
        self.layout = SpoolLayout(spool, model)
        self.model = model
        self.world_size = world_size
        self.generation = generation
        self.shapes = tables or {"t0": (64, 8), "t1": (40, 4)}
        self.gen = torch.Generator().manual_seed(seed)
        self.tables = {
            n: torch.randn(r, d, generator=self.gen) for n, (r, d) in self.shapes.items()
        }
        self.history: dict[int, dict[str, torch.Tensor]] = {}
        self.touched: dict[int, dict[str, torch.Tensor]] = {}
        self.seq = dict.fromkeys(range(world_size), -1)

    def shard(self, rank: int, rows: int) -> tuple[int, int]:
        per = (rows + self.world_size - 1) // self.world_size
        return min(rows, rank * per), min(rows, (rank + 1) * per)

    def start(self, step: int = 0) -> None:
        """Manifest and every rank's base at ``step``."""
        self.layout.write_manifest(
            GenerationManifest(
                model=self.model,
                generation=self.generation,
                world_size=self.world_size,
                start_step=step,
                created_unix=time.time(),
                tables=tuple(
                    TableInfo(n, r, d, "float32", "ebc", "ebc", "row_wise")
                    for n, (r, d) in self.shapes.items()
                ),
            )
        )
        self.history[step] = {n: t.clone() for n, t in self.tables.items()}
        for rank in range(self.world_size):
            ids = {n: torch.arange(*self.shard(rank, r)) for n, (r, _) in self.shapes.items()}
            self._write(rank, step, ids, SegmentKind.BASE)

    def step(
        self,
        step: int,
        ranks: list[int] | None = None,
        touch: int = 5,
        poison: float | None = None,
    ) -> None:
        """Change ``touch`` random rows per table and publish them at ``step`` on ``ranks``.

        All ranks publish the same step in a real trainer; ``ranks`` lets a test hold one back
        (call again with the remaining ranks to catch up). ``poison`` (e.g. NaN): the first
        table's lowest changed row gets it in its first column (a bad update).
        """
        if step not in self.history:
            self.touched[step] = {}
            for n, t in self.tables.items():
                ids = torch.randperm(t.shape[0], generator=self.gen)[:touch]
                t[ids] = torch.randn(len(ids), t.shape[1], generator=self.gen)
                if poison is not None and not self.touched[step]:
                    t[ids.min(), 0] = poison
                self.touched[step][n] = ids
            self.history[step] = {n: t.clone() for n, t in self.tables.items()}
        for rank in ranks if ranks is not None else range(self.world_size):
            ids = {}
            for n, (r, _) in self.shapes.items():
                lo, hi = self.shard(rank, r)
                ch = self.touched[step][n]
                ids[n] = ch[(ch >= lo) & (ch < hi)]
            self._write(rank, step, ids, SegmentKind.DELTA, values=self.history[step])

    def _write(
        self,
        rank: int,
        step: int,
        ids: dict[str, torch.Tensor],
        kind: SegmentKind,
        values: dict[str, torch.Tensor] | None = None,
    ) -> None:
        vals = values or self.tables
        chunks = []
        for n, (r, d) in self.shapes.items():
            lo, hi = self.shard(rank, r)
            i = ids[n].sort().values.to(torch.int64)
            chunks.append(ShardRows(Shard(n, r, d, lo, hi, 0, d), i, vals[n][i].clone()))
        self.seq[rank] += 1
        write_segment(
            self.layout.segment_path(self.generation, rank, self.seq[rank]),
            model=self.model,
            generation=self.generation,
            rank=rank,
            world_size=self.world_size,
            seq=self.seq[rank],
            step=step,
            kind=kind,
            shards=chunks,
            fsync=False,
        )


def wait_for(cond: object, timeout_s: float = 30.0, what: str = "condition") -> None:
    """Poll ``cond()`` (bounded) until true; AssertionError on timeout."""
    assert callable(cond)
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


@contextlib.contextmanager
def running_serve(
    spool: Path, *, rank: int, redis_url: str, model: str = "m", timeout_s: float = 60.0
) -> Iterator[str]:
    """A `deltad serve` subprocess on a free port; yields its endpoint once it is serving."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deltad.cli",
            "serve",
            "--spool",
            str(spool),
            "--model",
            model,
            "--rank",
            str(rank),
            "--listen",
            "127.0.0.1:0",
            "--redis-url",
            redis_url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        start_new_session=True,
    )
    try:
        endpoint = read_serving_line(proc, timeout_s)
        yield endpoint
    finally:
        stop_process(proc)


def read_serving_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """Read ``proc``'s stdout until ``serving <model> rank <r> on <host:port>``."""
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
            break
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        parts = line.split()
        if len(parts) >= 6 and parts[0] == "serving" and parts[4] == "on":
            return parts[5]
    stop_process(proc)
    raise AssertionError("sidecar did not start:\n" + "".join(seen[-30:]))


def stop_process(proc: subprocess.Popen[str], timeout_s: float = 10.0) -> None:
    """SIGTERM, bounded wait, SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
    if proc.stdout is not None:
        proc.stdout.close()
