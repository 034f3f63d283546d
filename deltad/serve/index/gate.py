"""The validation gate: every segment and dense state is checked before it is served.

Non-finite values (NaN, inf) fail always; per-table limits (``GateConfig``) fail a segment
whose largest jump in row norm (against the row's previous value) or whose fraction of the
table's rows changed is over the limit. The log (deltad.serve.index.log) calls
:meth:`SegmentGate.check` with every snapshot it is about to publish, so no entry is served
before it was checked; the window server caps every window below the first failed step that
an operator has not accepted (:meth:`SegmentGate.cap`), and the failure holds the model
(``on_fail``: the sidecar writes it to the release state, deltad.serve.rollout.gate_failed).

Cost: one vectorized ``torch.aminmax`` per shard of a segment (and per dense tensor: NaN and
infinities show in it; ``bench/gate.py`` measures it against indexing); with a norm limit, one row-norm per changed row and a float32 norm per row of the
shard held in memory (4 bytes x the rank's rows of those tables).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deltad.config import GateConfig
from deltad.types import ShardKey

if TYPE_CHECKING:
    from deltad.serve.index.files import DenseEntry, LogEntry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateFailure:
    """A segment (or dense state) of ``generation`` at ``seq``/``step`` failed the gate;
    ``good_step`` is the newest step before it (-1: the base itself failed)."""

    generation: int
    seq: int
    step: int
    good_step: int
    reason: str


def nonfinite(values: torch.Tensor) -> int:
    """How many elements of ``values`` are NaN or infinite (0 for non-float tensors)."""
    if not values.is_floating_point() or values.numel() == 0:
        return 0
    # one pass, no temporary: NaN propagates to both, an infinity shows as min or max
    # (measured 10-15x faster than torch.isfinite(values).all() here); count only on failure
    lo, hi = torch.aminmax(values)
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return 0
    return int(values.numel() - int(torch.isfinite(values).sum()))


class SegmentGate:
    """The checks of one rank's log (see the module docstring); thread-safe."""

    def __init__(
        self, config: GateConfig | None = None, on_fail: Callable[[GateFailure], None] | None = None
    ) -> None:
        self.config = config or GateConfig()
        self.on_fail = on_fail
        self._lock = threading.Lock()
        self._generation: int | None = None
        #: the newest seq checked: an entry at or below it was checked (a merge of checked
        #: segments, the merged base retention writes, is not checked again)
        self._upto = -1
        self._dense_upto = -1
        self._failures: list[GateFailure] = []
        self._norms: dict[ShardKey, torch.Tensor] = {}
        self._norm_seq = -1  # the seq the held norms are of
        #: checks made, failures found and seconds spent checking (metrics, bench)
        self.checks = 0
        self.failed = 0
        self.seconds = 0.0

    # ---- checking ---------------------------------------------------------------------

    def check(
        self,
        generation: int,
        entries: Sequence[LogEntry],
        dense: Sequence[DenseEntry],
        tables: Sequence[str] = (),
    ) -> list[GateFailure]:
        """Check the entries and dense states not checked yet (the run the log is about to
        publish, base first); the new failures (``on_fail`` called for each). ``tables``: the
        generation's table names, against which the limits' names are checked once (a
        warning for each that names no table: a typo would turn its limit off unseen)."""
        new: list[GateFailure] = []
        with self._lock:
            started = time.perf_counter()
            if generation != self._generation:
                self._generation = generation
                self._upto, self._dense_upto, self._failures = -1, -1, []
                self._norms, self._norm_seq = {}, -1
                if tables:
                    self._warn_unknown_tables(generation, tables)
            prev_step = -1
            steps = {e.seq: e.step for e in entries}
            for e in entries:
                if e.seq > self._upto:
                    self._upto = e.seq
                    self.checks += 1
                    why = self._check_entry(e)
                    if why:
                        new.append(GateFailure(generation, e.seq, e.step, prev_step, why))
                prev_step = e.step
            for d in dense:
                if d.seq <= self._dense_upto:
                    continue
                self._dense_upto = d.seq
                self.checks += 1
                bad = {n: nonfinite(t) for n, t in d.state.tensors.items()}
                bad = {n: k for n, k in bad.items() if k}
                if bad:
                    name, k = next(iter(bad.items()))
                    older = [s for q, s in steps.items() if q < d.seq]
                    good = max(older) if older else -1
                    why = f"dense state: {k} non-finite values in {name}"
                    if len(bad) > 1:
                        why += f" (and {len(bad) - 1} more tensors)"
                    new.append(GateFailure(generation, d.seq, d.step, good, why))
            for f in new:
                self._failures.append(f)
                self.failed += 1
            self._failures.sort(key=lambda f: (f.step, f.seq))
            self.seconds += time.perf_counter() - started
        for f in new:
            log.error(
                "gate: generation %d seq %d step %d failed: %s (the newest step before it: %d;"
                " the release state holds the model at the step before its first failure)",
                f.generation, f.seq, f.step, f.reason, f.good_step,
            )  # fmt: skip
            if self.on_fail is not None:
                try:
                    self.on_fail(f)
                except Exception:
                    log.exception("gate: reporting the failure failed")
        return new

    def _warn_unknown_tables(self, generation: int, tables: Sequence[str]) -> None:
        known = set(tables)
        for flag, limits in (
            ("--gate-max-norm-jump", self.config.max_norm_jump),
            ("--gate-max-changed-fraction", self.config.max_changed_fraction),
        ):
            for name in sorted({t for t, _ in limits if t != "*" and t not in known}):
                log.warning(
                    "gate: %s %s=...: generation %d has no table %r (its tables: %s): that "
                    "limit checks nothing",
                    flag, name, generation, name, ", ".join(sorted(known)),
                )  # fmt: skip

    def _check_entry(self, e: LogEntry) -> str:
        """Why ``e`` fails ("" if it passes); updates the held row norms."""
        bad: dict[str, int] = {}  # per table (a table's shards on this rank summed)
        for c in e.shards.values():
            k = nonfinite(c.values)
            if k:
                bad[c.shard.table] = bad.get(c.shard.table, 0) + k
        reasons = [f"{table}: {k} non-finite values" for table, k in bad.items()]
        if e.first_seq == 0:  # a base (or a fresh base): the norms start over from it
            self._norms, self._norm_seq = {}, e.seq
            self._take_norms(e, check=False)
        elif e.first_seq == self._norm_seq + 1:
            reasons += self._take_norms(e, check=True)
            self._norm_seq = e.seq
        if e.first_seq == e.seq and e.first_seq > 0:  # one trainer segment (not a merge)
            reasons += self._check_fraction(e)
        return "; ".join(reasons[:4]) + (f" (+{len(reasons) - 4} more)" if len(reasons) > 4 else "")

    def _take_norms(self, e: LogEntry, *, check: bool) -> list[str]:
        """Check the row-norm jumps of ``e`` against the held norms (``check``) and hold its
        rows' norms; only for tables with a norm limit."""
        out: list[str] = []
        limits = self.config.max_norm_jump
        if not limits:
            return out
        for key, c in e.shards.items():
            limit = GateConfig.limit(limits, c.shard.table)
            if limit is None or c.values.numel() == 0:
                continue
            held = self._norms.get(key)
            if held is None:
                held = self._norms[key] = torch.zeros(c.shard.rows, dtype=torch.float32)
            local = c.ids - c.shard.row_start
            norms = torch.linalg.vector_norm(c.values, dim=1, dtype=torch.float32)
            if check:
                jump = norms.sub(held.index_select(0, local)).abs_()
                worst = float(jump.amax()) if jump.numel() else 0.0
                if math.isnan(worst) or worst > limit:
                    out.append(f"{c.shard.table}: row norm jumped by {worst:.4g} (limit {limit:g})")
            held.index_copy_(0, local, norms)
        return out

    def _check_fraction(self, e: LogEntry) -> list[str]:
        limits = self.config.max_changed_fraction
        if not limits:
            return []
        changed: dict[str, int] = {}
        rows: dict[str, int] = {}
        for c in e.shards.values():
            t = c.shard.table
            changed[t] = changed.get(t, 0) + c.ids.numel()
            rows[t] = rows.get(t, 0) + c.shard.rows
        out = []
        for t, n in changed.items():
            limit = GateConfig.limit(limits, t)
            if limit is not None and rows[t] and n / rows[t] > limit:
                out.append(f"{t}: {n / rows[t]:.3g} of its rows changed (limit {limit:g})")
        return out

    # ---- reading ----------------------------------------------------------------------

    def failures(self, generation: int) -> list[GateFailure]:
        """The failures of ``generation``, by step."""
        with self._lock:
            return [f for f in self._failures if f.generation == generation]

    def first_open(self, generation: int, accepted_step: int | None) -> GateFailure | None:
        """The first failure of ``generation`` past ``accepted_step`` (None: none)."""
        for f in self.failures(generation):
            if accepted_step is None or f.step > accepted_step:
                return f
        return None

    def cap(self, generation: int, accepted_step: int | None) -> int | None:
        """The newest step a window of ``generation`` may end at (None: no gate cap)."""
        f = self.first_open(generation, accepted_step)
        return None if f is None else f.step - 1
