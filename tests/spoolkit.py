"""Test helpers for the consumer side: hand-built spools and real sidecars.

:class:`FakeTrainer` writes what a row-wise sharded trainer would publish (manifest, a base per
rank, then delta segments of random rows) and keeps the truth: the full tables at every step.
:class:`ZchWriter` writes managed-collision tables (segment format version 3) with their
slot -> raw id maps. :func:`running_serve` runs a real sidecar (a `deltad serve` subprocess);
:func:`cli_sidecar` starts the one `deltad serve` would, in this process.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from deltad.segment.format import ShardRows, write_segment
from deltad.segment.spool import GenerationManifest, SpoolLayout, TableInfo
from deltad.types import EMPTY_RAW_ID, SegmentKind, Shard

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


class ZchWriter:
    """One rank publishing managed-collision tables (segment format version 3) beside ordinary
    ones, as a trainer with MCH modules would, keeping the truth: every table's rows and every
    managed-collision table's slot -> raw id map (``raw``; ``EMPTY_RAW_ID`` = empty slot).

    ``mc`` / ``tables``: name -> (num_rows, dim); rank ``r`` of ``world_size`` owns the rows
    ``[r * n // ws, (r + 1) * n // ws)``. At the start the first half of the slots hold raw
    ids (``slot * 1000 + 7``), the rest are empty. :meth:`delta` admits raw ids into slots
    (evicting what they held), empties slots and moves rows, then publishes.
    """

    def __init__(
        self,
        root: Path,
        *,
        model: str = "m",
        mc: dict[str, tuple[int, int]] | None = None,
        tables: dict[str, tuple[int, int]] | None = None,
        generation: int = 1,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        self.layout = SpoolLayout(root, model)
        self.model = model
        self.mc = mc if mc is not None else {"zch": (64, 8)}
        self.plain = tables if tables is not None else {"t0": (40, 4)}
        self.specs = {**self.mc, **self.plain}
        self.rank, self.world_size = rank, world_size
        self.gen = torch.Generator().manual_seed(seed)
        self.next_raw = 10_000_000
        self.gone: list[int] = []  # raw ids evicted and not held: may come back
        self.start_generation(generation)

    def rows(self, table: str) -> tuple[int, int]:
        n = self.specs[table][0]
        return self.rank * n // self.world_size, (self.rank + 1) * n // self.world_size

    def start_generation(
        self,
        generation: int,
        start_step: int = 0,
        truth: dict[str, torch.Tensor] | None = None,
        raw: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """A new generation: fresh tables and maps (or ``truth`` / ``raw``), manifest, base."""
        self.generation = generation
        self.truth = (
            {t: v.clone() for t, v in truth.items()}
            if truth is not None
            else {t: torch.randn(n, d, generator=self.gen) for t, (n, d) in self.specs.items()}
        )
        if raw is not None:
            self.raw = {t: r.clone() for t, r in raw.items()}
        else:
            self.raw = {}
            for t, (n, _) in self.mc.items():
                r = torch.full((n,), EMPTY_RAW_ID, dtype=torch.int64)
                r[: n // 2] = torch.arange(n // 2, dtype=torch.int64) * 1000 + 7
                self.raw[t] = r
        self.seq, self.step = -1, start_step
        self.layout.write_manifest(
            GenerationManifest(
                model=self.model,
                generation=generation,
                world_size=self.world_size,
                start_step=start_step,
                created_unix=time.time(),
                tables=tuple(
                    TableInfo(
                        t, n, d, "float32", "ec", "ec", "row_wise", managed_collision=t in self.mc
                    )
                    for t, (n, d) in self.specs.items()
                ),
            )
        )
        ids = {t: torch.arange(*self.rows(t)) for t in self.specs}
        self._write(ids, {t: torch.empty(0, dtype=torch.int64) for t in self.mc}, SegmentKind.BASE)

    def delta(
        self,
        *,
        admit: dict[str, dict[int, int]] | None = None,
        empty: dict[str, list[int]] | None = None,
        touch: dict[str, list[int]] | None = None,
        n: int = 0,
    ) -> int:
        """Change rows and identities, publish them at the next step; returns the seq.

        ``admit``: table -> {slot: raw id} (the raw id enters the slot, whose row is reset;
        what the slot held is evicted; a raw id held by another slot moves); ``empty``: table
        -> slots emptied (row zeroed); ``touch``: table -> slots whose rows move. ``n``: as
        many random admissions (fresh raw ids, or evicted ones coming back), emptied slots and
        moved rows per managed-collision table (ordinary tables: ``n`` moved rows)."""
        admit = {t: dict(v) for t, v in (admit or {}).items()}
        empty = {t: list(v) for t, v in (empty or {}).items()}
        touch = {t: list(v) for t, v in (touch or {}).items()}
        for t in self.specs:
            lo, hi = self.rows(t)
            if not n:
                continue
            slots = (torch.randperm(hi - lo, generator=self.gen)[: 3 * n] + lo).tolist()
            touch.setdefault(t, []).extend(slots[:n])
            if t in self.mc:
                for s in slots[n : 2 * n]:
                    if self.gone and torch.rand(1, generator=self.gen).item() < 0.3:
                        raw = self.gone.pop(0)
                    else:
                        raw, self.next_raw = self.next_raw, self.next_raw + 1
                    admit.setdefault(t, {})[s] = raw
                empty.setdefault(t, []).extend(slots[2 * n : 2 * n + max(1, n // 3)])
        ids: dict[str, torch.Tensor] = {}
        evicted: dict[str, torch.Tensor] = {}
        for t, (_, d) in self.specs.items():
            changed: set[int] = set(touch.get(t, []))
            left: set[int] = set()
            if t in self.mc:
                raw = self.raw[t]
                for s in empty.get(t, []):
                    if s in admit.get(t, {}):
                        continue
                    if int(raw[s]) != EMPTY_RAW_ID:
                        left.add(int(raw[s]))
                    raw[s] = EMPTY_RAW_ID
                    self.truth[t][s] = 0.0
                    changed.add(s)
                for s, r in admit.get(t, {}).items():
                    held = (raw == r).nonzero().flatten().tolist()
                    for other in held:  # the raw id moves: its old slot empties
                        if other != s:
                            raw[other] = EMPTY_RAW_ID
                            changed.add(other)
                    if int(raw[s]) not in (EMPTY_RAW_ID, r):
                        left.add(int(raw[s]))
                    raw[s] = r
                    self.truth[t][s] = torch.randn(d, generator=self.gen)
                    changed.add(s)
                still = set(raw.tolist())
                gone = sorted(x for x in left if x not in still)
                self.gone.extend(x for x in gone if x not in self.gone)
                self.gone = [x for x in self.gone if x not in still]
                evicted[t] = torch.tensor(gone, dtype=torch.int64)
            for s in touch.get(t, []):
                self.truth[t][s] += torch.randn(d, generator=self.gen)
            ids[t] = torch.tensor(sorted(changed), dtype=torch.int64)
        self.step += 10
        return self._write(ids, evicted, SegmentKind.DELTA)

    def _write(
        self, ids: dict[str, torch.Tensor], evicted: dict[str, torch.Tensor], kind: SegmentKind
    ) -> int:
        self.seq += 1
        chunks = []
        for t, i in ids.items():
            lo, hi = self.rows(t)
            n, d = self.specs[t]
            i = i.to(torch.int64).sort().values
            i = i[(i >= lo) & (i < hi)]
            raw = self.raw[t][i].clone() if t in self.mc else None
            ev = evicted.get(t) if t in self.mc else None
            chunks.append(
                ShardRows(Shard(t, n, d, lo, hi, 0, d), i, self.truth[t][i].clone(), raw, ev)
            )
        write_segment(
            self.layout.segment_path(self.generation, self.rank, self.seq),
            model=self.model,
            generation=self.generation,
            rank=self.rank,
            world_size=self.world_size,
            seq=self.seq,
            step=self.step,
            kind=kind,
            shards=chunks,
            fsync=False,
        )
        return self.seq


def wait_for(cond: object, timeout_s: float = 30.0, what: str = "condition") -> None:
    """Poll ``cond()`` (bounded) until true; AssertionError on timeout."""
    assert callable(cond)
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
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
            "deltad.commands.main",
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


def cli_sidecar(*argv: str) -> Any:
    """The sidecar ``deltad serve <argv>`` runs (config from the CLI's own parser and
    environment), started in this process: a restart that does not pay a new interpreter's
    torch import. Only a test of the process itself (signals, kill -9, env) needs the real
    subprocess. Returns the started :class:`~deltad.serve.edge.app.SidecarServer`."""
    from deltad.commands.main import build_parser
    from deltad.serve import cli as serve_cli
    from deltad.serve.edge.app import SidecarServer

    args = build_parser().parse_args(["serve", *argv])
    return SidecarServer(serve_cli.build_config(args)).start()


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
