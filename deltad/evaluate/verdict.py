"""The verdict on one step: a pure function of the two models' scores and the thresholds.

Pass when, on every scored set (the golden set, the progressive-validation set), the
candidate's NE is at most the release's NE times ``1 + eps`` and the candidate's calibration
is within ``[1 - delta, 1 + delta]``, over at least ``min_examples`` examples in all; else
fail, with the reasons. A user's own metric (:class:`deltad.evaluate.metrics.Metric`) takes
part through its own ``passes``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from deltad.evaluate.metrics import Metric, Thresholds

PASS = "pass"
FAIL = "fail"


@dataclass(frozen=True)
class SetScores:
    """One labelled set scored by both models: ``{metric: value}`` each, and its size."""

    name: str
    examples: int
    candidate: dict[str, float]
    release: dict[str, float]


@dataclass(frozen=True)
class Verdict:
    """The evaluator's decision on ``step`` of ``generation`` against ``release_step``."""

    model: str
    generation: int
    step: int
    release_step: int
    verdict: str
    reasons: tuple[str, ...] = ()
    sets: tuple[SetScores, ...] = ()
    #: the step's publish time (the newest segment's, unix seconds; 0: unknown) and the time
    #: the verdict was reached
    published_unix: float = 0.0
    decided_unix: float = 0.0
    #: who decided it (the evaluator's consumer name): replicas adopt the first verdict
    by: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Verdict:
        d = json.loads(raw)
        d["reasons"] = tuple(d.get("reasons", ()))
        d["sets"] = tuple(SetScores(**s) for s in d.get("sets", ()))
        return cls(**d)

    def line(self) -> str:
        """One human line: ``step 40 (gen 7) vs release 38: pass (golden NE 0.91/0.92 ...)``."""
        parts = []
        for s in self.sets:
            ne_c, ne_r = s.candidate.get("ne"), s.release.get("ne")
            cal = s.candidate.get("calibration")
            if ne_c is not None and ne_r is not None and cal is not None:
                parts.append(
                    f"{s.name} NE {ne_c:.4f} vs {ne_r:.4f}, calibration {cal:.3f}, "
                    f"{s.examples} examples"
                )
        why = f"; {'; '.join(self.reasons)}" if self.reasons else ""
        return (
            f"step {self.step} (generation {self.generation}) vs release step "
            f"{self.release_step}: {self.verdict} ({'; '.join(parts) or 'no scores'}){why}"
        )


def decide(
    sets: list[SetScores], metrics: Sequence[Metric], th: Thresholds
) -> tuple[str, tuple[str, ...]]:
    """``(PASS or FAIL, reasons)`` for the scored ``sets`` (empty sets are left out): every
    metric's ``check`` on every set, and at least ``th.min_examples`` examples in all."""
    reasons: list[str] = []
    scored = [s for s in sets if s.examples > 0]
    total = sum(s.examples for s in scored)
    if total < th.min_examples:
        reasons.append(f"{total} examples scored, fewer than {th.min_examples}")
    for s in scored:
        for m in metrics:
            c, r = s.candidate.get(m.name), s.release.get(m.name)
            if c is None or r is None or math.isnan(c) or math.isnan(r):
                why = f"{m.name} not computed (candidate {c}, release {r})"
            else:
                why = m.check(c, r, th)
            if why:
                reasons.append(f"{s.name}: {why}")
    return (FAIL if reasons else PASS), tuple(reasons)
