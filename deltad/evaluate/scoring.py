"""Scoring a model on labelled examples: the :class:`Scorer` protocol (a user's own model
and features) and :class:`ClickModelScorer` (the reference ClickModel)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from deltad.evaluate.labelled import LabelledExample
from deltad.evaluate.metrics import Metric
from deltad.evaluate.verdict import SetScores


@runtime_checkable
class Scorer(Protocol):
    """Predicts click probabilities (a 1-D float tensor, one per example) of ``model``."""

    def predict(self, model: Any, examples: Sequence[LabelledExample]) -> torch.Tensor: ...


class ClickModelScorer:
    """The reference ClickModel's probabilities (sigmoid of its logits), in batches of
    ``batch_size``; batches of a fixed set (the golden set) are built once."""

    def __init__(self, tables: Sequence[str], *, zch: bool, batch_size: int = 1024) -> None:
        self.tables, self.zch, self.batch_size = list(tables), zch, batch_size
        self._cache: dict[int, tuple[Sequence[LabelledExample], list[Any]]] = {}

    def _batches(self, examples: Sequence[LabelledExample]) -> list[Any]:
        from deltad.reference.trainer.holdout import batch_of

        hit = self._cache.get(id(examples))
        if hit is not None and hit[0] is examples:
            return hit[1]
        out = [
            batch_of(examples[i : i + self.batch_size], self.tables, zch=self.zch)
            for i in range(0, len(examples), self.batch_size)
        ]
        if len(self._cache) > 4:
            self._cache.clear()
        self._cache[id(examples)] = (examples, out)
        return out

    def predict(self, model: Any, examples: Sequence[LabelledExample]) -> torch.Tensor:
        if not examples:
            return torch.zeros(0)
        with torch.no_grad():
            outs = [model(b)[1] for b in self._batches(examples)]
        return torch.sigmoid(torch.cat(outs).double())


def labels_and_weights(examples: Sequence[LabelledExample]) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor([ex.label for ex in examples], dtype=torch.float64),
        torch.tensor([ex.weight for ex in examples], dtype=torch.float64),
    )


def score(
    name: str,
    examples: Sequence[LabelledExample],
    candidate: torch.Tensor,
    release: torch.Tensor,
    metrics: Sequence[Metric],
) -> SetScores:
    """Every metric of both models' predictions on one set."""
    if not examples:
        return SetScores(name, 0, {}, {})
    labels, weights = labels_and_weights(examples)
    return SetScores(
        name,
        len(examples),
        {m.name: m.compute(candidate, labels, weights) for m in metrics},
        {m.name: m.compute(release, labels, weights) for m in metrics},
    )


def reference_model(
    tables: dict[str, int],
    seq_rows: int,
    *,
    dim: int,
    zch_slots: int | None = None,
    zch_raw_ids: int = 0,
    zch_policy: str = "lru",
) -> Any:
    """A float reference ClickModel (the trainer's architecture) in eval mode, its weights
    to be written by a :class:`~deltad.consume.appliers.TorchRecApplier`."""
    from deltad.reference.trainer.model import ClickModel

    kw: dict[str, Any] = {"zch_raw_ids": zch_raw_ids, "zch_policy": zch_policy}
    if zch_slots is not None:
        kw["zch_slots"] = zch_slots
    torch.manual_seed(0)
    return ClickModel(tables, seq_rows, dim=dim, **kw).eval()
