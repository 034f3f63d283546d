"""Labelled examples for the canary evaluator: the format, a bounded spool writer and readers.

One example is one JSON object on one line (JSON Lines, UTF-8)::

    {"label": 1.0, "weight": 1.0, "step": 12, "rank": 0,
     "dense": [0.3, -1.2, ...], "ids": {"f_t0": [17, 4], "f_t1": [9], "seq": [3, 3, 8]}}

``label`` is 0 or 1 (a click), ``weight`` its weight (default 1), ``step`` the trainer step
whose batch it was held out of (-1: not from a step, e.g. a golden set), ``dense`` the dense
features and ``ids`` every sparse feature's ids by feature name; what ``dense`` and ``ids``
mean is the scorer's business (:class:`deltad.evaluate.scoring.Scorer`), the evaluator only
reads labels and weights.

A **holdout spool** is a directory of such files, one per (generation, rank, step) written
atomically (a temporary name, then a rename) and named
``holdout-g<generation>-r<rank>-s<step, 12 digits>.jsonl``; :class:`HoldoutWriter` keeps the
newest ``keep`` files of its rank and deletes older ones, so the directory stays bounded.
:func:`newest_examples` reads the newest files' examples (the progressive-validation set). A
**golden set** is one such file (or a directory of them), fixed: :func:`read_examples`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltad.errors import ConfigError

#: holdout-g<generation>-r<rank>-s<step>.jsonl
_NAME = re.compile(r"^holdout-g(\d+)-r(\d+)-s(\d+)\.jsonl$")


@dataclass(frozen=True)
class LabelledExample:
    """One labelled example (see the module docstring for its JSON form)."""

    label: float
    dense: tuple[float, ...] = ()
    ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    weight: float = 1.0
    step: int = -1
    rank: int = 0

    def to_json(self) -> str:
        d = {
            "label": self.label,
            "weight": self.weight,
            "step": self.step,
            "rank": self.rank,
            "dense": list(self.dense),
            "ids": {k: list(v) for k, v in self.ids.items()},
        }
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> LabelledExample:
        """The example of one line; ValueError naming what is wrong."""
        d = json.loads(line)
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        label = d.get("label")
        if isinstance(label, bool) or not isinstance(label, int | float) or label not in (0, 1):
            raise ValueError(f"label must be 0 or 1, not {label!r:.32}")
        weight = d.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight >= 0:
            raise ValueError(f"weight must be a number >= 0, not {weight!r:.32}")
        dense = d.get("dense", [])
        if not isinstance(dense, list) or not all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in dense
        ):
            raise ValueError("dense must be a list of numbers")
        ids = d.get("ids", {})
        if not isinstance(ids, dict) or not all(
            isinstance(k, str)
            and isinstance(v, list)
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)
            for k, v in ids.items()
        ):
            raise ValueError("ids must map feature names to lists of ids >= 0")
        step, rank = d.get("step", -1), d.get("rank", 0)
        if not isinstance(step, int) or not isinstance(rank, int):
            raise ValueError("step and rank must be integers")
        return cls(
            label=float(label),
            dense=tuple(float(x) for x in dense),
            ids={k: tuple(v) for k, v in ids.items()},
            weight=float(weight),
            step=step,
            rank=rank,
        )


def write_examples(path: Path, examples: Iterable[LabelledExample]) -> int:
    """Write ``examples`` to ``path`` atomically (JSON Lines); the number written."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(ex.to_json())
            f.write("\n")
            n += 1
    os.replace(tmp, path)
    return n


def read_examples(path: Path) -> list[LabelledExample]:
    """Every example of a JSON Lines file, or of every ``*.jsonl`` file of a directory (in
    name order); ConfigError naming the file and line of a bad one, or a missing path."""
    path = Path(path)
    if path.is_dir():
        out: list[LabelledExample] = []
        for p in sorted(path.glob("*.jsonl")):
            out.extend(read_examples(p))
        return out
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"labelled examples {path}: {e.strerror or e}") from e
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(LabelledExample.from_json(line))
        except ValueError as e:
            raise ConfigError(f"labelled examples {path} line {i}: {e}") from e
    return out


def holdout_name(generation: int, rank: int, step: int) -> str:
    return f"holdout-g{generation}-r{rank}-s{step:012d}.jsonl"


def holdout_files(directory: Path) -> list[tuple[int, int, int, Path]]:
    """``(generation, step, rank, path)`` of every holdout file in ``directory``, oldest first."""
    out = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        m = _NAME.match(name)
        if m:
            g, r, s = (int(x) for x in m.groups())
            out.append((g, s, r, Path(directory) / name))
    out.sort()
    return out


class HoldoutWriter:
    """Writes one rank's held-out examples to a holdout spool, keeping its newest ``keep``
    files (older ones of this rank are deleted after each write)."""

    def __init__(self, directory: Path, *, rank: int = 0, generation: int = 0, keep: int = 64):
        if keep < 1:
            raise ConfigError("holdout keep must be >= 1 file")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank, self.generation, self.keep = rank, generation, keep

    def write(self, step: int, examples: Sequence[LabelledExample]) -> Path:
        """Write the examples held out of ``step``'s batch; the file written."""
        path = self.directory / holdout_name(self.generation, self.rank, step)
        write_examples(path, examples)
        mine = [f for f in holdout_files(self.directory) if f[2] == self.rank]
        for *_, old in mine[: max(0, len(mine) - self.keep)]:
            try:
                old.unlink()
            except FileNotFoundError:
                pass
        return path


def newest_examples(directory: Path, n: int, *, max_step: int | None = None) -> list[Any]:
    """The newest ``n`` examples (or fewer) of a holdout spool: whole files, newest
    generation and step first (``max_step``: only files of steps at or below it, of the
    newest generation). A file deleted or half read meanwhile is skipped."""
    files = holdout_files(directory)
    if not files:
        return []
    newest_gen = files[-1][0]
    out: list[LabelledExample] = []
    for g, s, _, p in reversed(files):
        if len(out) >= n:
            break
        if g != newest_gen or (max_step is not None and s > max_step):
            continue
        try:
            out.extend(read_examples(p))
        except ConfigError:
            continue
    return out[:n]


def iter_lines(examples: Iterable[LabelledExample]) -> Iterator[str]:
    """The JSON Lines of ``examples`` (for a pipeline writing them elsewhere)."""
    for ex in examples:
        yield ex.to_json()
