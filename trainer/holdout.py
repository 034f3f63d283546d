"""Held-out labelled examples of the reference trainer, and silent bad updates.

* :func:`split_batch`: the first ``n`` samples of a batch (trained on) and the rest (held out,
  never trained on: the canary evaluator's progressive-validation examples).
* :func:`examples_of` / :func:`batch_of`: a batch's samples as
  :class:`deltad.evaluate.labelled.LabelledExample` (``dense``, ``ids`` by feature name:
  ``f_<table>``, ``seq``, ``f_zch``) and back, so the evaluator can score the reference model.
* :func:`golden_examples`: a fixed labelled set from its own stream (the same click
  function, never trained on).
* :func:`corrupt_labels` / :func:`corrupt_feature`: what ``--corrupt-labels-from-step`` and
  ``--corrupt-feature-from-step`` do to a training batch (the norm gate lets both through).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from deltad.errors import ConfigError
from deltad.evaluate.labelled import LabelledExample

from .data import SEQ_FEATURE, ZCH_TABLE, Batch, ClickStream, feature_name

#: the stream rank golden sets are drawn from (no training rank has it)
GOLDEN_RANK = 1 << 20


def _slice(kjt: KeyedJaggedTensor, lo: int, hi: int) -> KeyedJaggedTensor:
    keys = kjt.keys()
    d = kjt.to_dict()
    vals, lens = [], []
    for k in keys:
        off = d[k].offsets()
        vals.append(d[k].values()[int(off[lo]) : int(off[hi])])
        lens.append(d[k].lengths()[lo:hi])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(keys), values=torch.cat(vals), lengths=torch.cat(lens)
    )


def split_batch(batch: Batch, n: int) -> tuple[Batch, Batch]:
    """``(first n samples, the rest)`` of a KJT batch."""
    if not isinstance(batch.sparse, KeyedJaggedTensor):
        raise ConfigError("held-out examples need KJT input (--input kjt)")
    b = batch.labels.numel()
    if not 0 < n < b:
        raise ConfigError(f"cannot hold out {b - n} of a batch of {b}")

    def part(lo: int, hi: int) -> Batch:
        return Batch(
            batch.dense[lo:hi],
            _slice(batch.sparse, lo, hi),
            _slice(batch.seq, lo, hi),
            batch.labels[lo:hi],
            None if batch.zch is None else _slice(batch.zch, lo, hi),
        )

    return part(0, n), part(n, b)


def examples_of(batch: Batch, *, step: int = -1, rank: int = 0) -> list[LabelledExample]:
    """Every sample of ``batch`` as a LabelledExample."""
    kjts = [batch.sparse_kjt(), batch.seq] + ([batch.zch] if batch.zch is not None else [])
    per_key: dict[str, list[list[int]]] = {}
    for kjt in kjts:
        for k, jt in kjt.to_dict().items():
            off = jt.offsets().tolist()
            vals = jt.values().tolist()
            per_key[k] = [vals[off[i] : off[i + 1]] for i in range(len(off) - 1)]
    dense = batch.dense.tolist()
    labels = batch.labels.tolist()
    return [
        LabelledExample(
            label=float(labels[i]),
            dense=tuple(dense[i]),
            ids={k: tuple(v[i]) for k, v in per_key.items()},
            step=step,
            rank=rank,
        )
        for i in range(len(labels))
    ]


def _kjt(keys: Sequence[str], examples: Sequence[LabelledExample]) -> KeyedJaggedTensor:
    vals: list[int] = []
    lens: list[int] = []
    for k in keys:
        for ex in examples:
            ids = ex.ids.get(k, ())
            vals.extend(ids)
            lens.append(len(ids))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(keys),
        values=torch.tensor(vals, dtype=torch.int64),
        lengths=torch.tensor(lens, dtype=torch.int64),
    )


def batch_of(examples: Sequence[LabelledExample], tables: Sequence[str], *, zch: bool) -> Batch:
    """The KJT batch of ``examples`` for a ClickModel of pooled ``tables`` (``zch``: with the
    managed-collision table); a feature an example lacks is an empty bag."""
    if not examples:
        raise ConfigError("no examples to batch")
    return Batch(
        dense=torch.tensor([list(ex.dense) for ex in examples], dtype=torch.float32),
        sparse=_kjt([feature_name(t) for t in tables], examples),
        seq=_kjt([SEQ_FEATURE], examples),
        labels=torch.tensor([ex.label for ex in examples], dtype=torch.float32),
        zch=_kjt([feature_name(ZCH_TABLE)], examples) if zch else None,
    )


def golden_examples(
    tables: dict[str, int],
    seq_rows: int,
    n: int,
    *,
    seed: int = 0,
    zch_raw_ids: int = 0,
) -> list[LabelledExample]:
    """``n`` labelled examples from the reference click stream's own rank (never trained
    on), deterministic in the arguments: a golden set."""
    stream = ClickStream(
        tables, seq_rows, batch_size=n, seed=seed, rank=GOLDEN_RANK, zch_raw_ids=zch_raw_ids
    )
    return examples_of(stream.next_batch())


def corrupt_labels(
    batch: Batch, generator: torch.Generator, *, mode: str = "flip", fraction: float = 1.0
) -> Batch:
    """``batch`` with the labels of a ``fraction`` of its samples flipped (``flip``) or
    shuffled among them (``shuffle``)."""
    labels = batch.labels.clone()
    b = labels.numel()
    hit = torch.rand(b, generator=generator) < fraction
    if mode == "flip":
        labels[hit] = 1.0 - labels[hit]
    elif mode == "shuffle":
        idx = hit.nonzero().squeeze(1)
        labels[idx] = labels[idx[torch.randperm(idx.numel(), generator=generator)]]
    else:
        raise ConfigError(f"label corruption mode must be flip or shuffle, not {mode!r}")
    return Batch(batch.dense, batch.sparse, batch.seq, labels, batch.zch)


def corrupt_feature(batch: Batch, tables: dict[str, int]) -> Batch:
    """``batch`` with the first pooled table fed the second table's ids (modulo its rows): a
    feature pipeline that sends one feature another's ids."""
    names = list(tables)
    if len(names) < 2:
        raise ConfigError("feature corruption needs at least two pooled tables")
    kjt = batch.sparse_kjt()
    d = kjt.to_dict()
    src, dst = feature_name(names[1]), feature_name(names[0])
    keys = list(kjt.keys())
    vals, lens = [], []
    for k in keys:
        jt = d[src] if k == dst else d[k]
        v = jt.values() % tables[names[0]] if k == dst else jt.values()
        vals.append(v)
        lens.append(jt.lengths())
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(vals), lengths=torch.cat(lens)
    )
    return Batch(batch.dense, sparse, batch.seq, batch.labels, batch.zch)
