"""Quality metrics of a model's predictions on labelled examples, and how each judges a
candidate against the release.

:class:`NE` (normalized entropy) and :class:`Calibration` are computed with TorchRec's own
functions (``torchrec.metrics.ne``: ``get_ne_states`` then ``compute_ne``, eta 1e-12;
``torchrec.metrics.calibration``: sum of weighted predictions over sum of weighted labels),
so the numbers are the ones a TorchRec ``RecMetricModule`` would report on the same
examples. A user's own metric is any object of the :class:`Metric` protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from deltad.errors import ConfigError

#: TorchRec's eta (NEMetricComputation.eta)
ETA = 1e-12


@dataclass(frozen=True)
class Thresholds:
    """``eps``: the NE the candidate may lose, relative; ``delta``: how far its calibration may
    be from 1; ``min_examples``: the fewest examples a verdict rests on."""

    eps: float = 0.05
    delta: float = 0.25
    min_examples: int = 512

    def __post_init__(self) -> None:
        if not 0 <= self.eps < 10 or not 0 <= self.delta < 10 or self.min_examples < 1:
            raise ConfigError("eps and delta must be in [0, 10), min_examples >= 1")


@runtime_checkable
class Metric(Protocol):
    """A quality metric: its ``name``, its value on one set of predictions (probabilities,
    labels 0/1, weights: 1-D tensors of one length), and ``check``: why the candidate's value
    fails against the release's ("" if it passes)."""

    name: str

    def compute(
        self, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
    ) -> float: ...

    def check(self, candidate: float, release: float, th: Thresholds) -> str: ...


class NE:
    """Normalized entropy (lower is better): passes when the candidate's is at most the
    release's times ``1 + eps``."""

    name = "ne"

    def compute(
        self, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
    ) -> float:
        from torchrec.metrics.ne import compute_ne, get_ne_states

        s = get_ne_states(labels.double(), predictions.double(), weights.double(), ETA)
        ne = compute_ne(
            s["cross_entropy_sum"], s["weighted_num_samples"], s["pos_labels"],
            s["neg_labels"], ETA,
        )  # fmt: skip
        return float(ne)

    def check(self, candidate: float, release: float, th: Thresholds) -> str:
        if candidate <= release * (1 + th.eps):
            return ""
        return f"NE {candidate:.4f} > release's {release:.4f} x (1 + {th.eps:g})"


class Calibration:
    """Calibration, sum of predictions over sum of labels (1 is perfect): passes when the
    candidate's is within ``[1 - delta, 1 + delta]``."""

    name = "calibration"

    def compute(
        self, predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
    ) -> float:
        from torchrec.metrics.calibration import compute_calibration, get_calibration_states

        s = get_calibration_states(labels.double(), predictions.double(), weights.double())
        return float(compute_calibration(s["calibration_num"], s["calibration_denom"]))

    def check(self, candidate: float, release: float, th: Thresholds) -> str:
        if 1 - th.delta <= candidate <= 1 + th.delta:
            return ""
        return f"calibration {candidate:.3f} outside [{1 - th.delta:g}, {1 + th.delta:g}]"


def default_metrics() -> list[Metric]:
    """NE and calibration."""
    return [NE(), Calibration()]
