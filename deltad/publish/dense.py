"""Dense state on the trainer: the parameters and buffers outside the tracked tables, cloned at a cut.

Rank 0 writes the model's dense parameters and buffers (everything outside the tracked
sharded EC / EBC modules, named as in the unwrapped model's ``state_dict``: DMP / DDP
prefixes removed) as ``dense-<seq>`` next to its segment ``seq`` of the same step, *before*
that segment (a sidecar that sees segment ``seq`` finds its dense state). They are cloned in
the loop at the publish call, which is the segment's cut: ``maybe_publish(step)`` runs after
step ``step``'s optimizer step (dense parameters are written there, synchronously, and the
fused optimizer wrote the rows in that step's backward) and before step ``step + 1``'s
forward. The clone cannot be left to the copier thread behind the update barrier: the
barrier guards only the backward, and a forward may write dense state (BatchNorm running
statistics are buffers updated in the forward). Replicated (DDP) parameters are equal on
every rank after the step, so rank 0's copy is the model's. The cost is one memcpy of the
dense state per dense publish (``SegmentStats.dense_s``); encoding and writing happen in the
writer thread (:mod:`deltad.publish.writer`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from deltad.config import PublisherConfig
from deltad.publish.mc import managed_collision_types
from deltad.publish.shards import _sharded_types, clean_fqn
from deltad.publish.stats import SegmentStats


def _sharded_tensor_types() -> tuple[type, ...]:
    """Tensor types that hold one shard of a sharded tensor (never dense state)."""
    types: list[type] = []
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        types.append(ShardedTensor)
    except ImportError:
        pass
    try:
        from torch.distributed.tensor import DTensor

        types.append(DTensor)
    except ImportError:
        pass
    return tuple(types)


class DenseCapture:
    """Takes rank 0's copy of the dense state when one is due (``PublisherConfig.publish_dense``,
    ``dense_every_steps`` / ``dense_every_seconds``); ``tracker`` names the tracked tables."""

    def __init__(self, model: nn.Module, tracker: Any, config: PublisherConfig, rank: int) -> None:
        self.model = model
        self.tracker = tracker
        self.config = config
        self.rank = rank
        self._last_step: int | None = None
        self._last_time = 0.0
        self._slots: list[tuple[str, nn.Module, str, bool]] | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The model's dense parameters and buffers (live, not copies), named as in the
        unwrapped model's ``state_dict``: everything outside the tracked sharded EC / EBC
        modules, and no ShardedTensor / DTensor (those are sharded, not replicated).

        Where they live (owner module and attribute) is found once: walking a DMP model's
        parameters and buffers took ~0.6 ms of the loop per dense publish (stop 45), against
        ~20 us to copy the reference model's dense state. Each call reads the attributes
        again, so a parameter or buffer replaced on its module is the one taken."""
        if self._slots is None:
            self._slots = self._find_slots()
        sharded = _sharded_tensor_types()
        out: dict[str, torch.Tensor] = {}
        for name, owner, attr, is_param in self._slots:
            t = owner._parameters.get(attr) if is_param else owner._buffers.get(attr)
            if t is None or isinstance(t, sharded):
                continue
            out[name] = t
        return out

    def _find_slots(self) -> list[tuple[str, nn.Module, str, bool]]:
        """(name, owner module, attribute, is a parameter) of every dense tensor, once."""
        # A sharded MC-EC / MC-EBC's own buffers (the MCH remapper, per rank) travel as
        # identities in the segments, never as (replicated) dense state.
        sharded_modules = _sharded_types() + (managed_collision_types() or ())
        skip = tuple(
            f"{clean_fqn(fqn)}."
            for fqn, mod in self.model.named_modules()
            if isinstance(mod, sharded_modules)
        ) + tuple(f"{t.module}." for t in self.tracker.tables)
        sharded = _sharded_tensor_types()
        # the owner of each tensor (DMP names its parameters without its wrapper's prefix,
        # so the names do not lead back to the modules: the tensors do)
        owners: dict[int, tuple[nn.Module, str, bool]] = {}
        for mod in nn.Module.modules(self.model):
            for attr, param in mod._parameters.items():
                owners.setdefault(id(param), (mod, attr, True))
            for attr, buf in mod._buffers.items():
                owners.setdefault(id(buf), (mod, attr, False))
        slots: list[tuple[str, nn.Module, str, bool]] = []
        seen: set[str] = set()
        for raw, t in [*self.model.named_parameters(), *self.model.named_buffers()]:
            name = clean_fqn(raw)
            if name in seen or name.startswith(skip) or isinstance(t, sharded):
                continue
            seen.add(name)
            owner = owners.get(id(t))
            if owner is None:
                raise RuntimeError(f"dense state {name}: no module holds it")
            slots.append((name, *owner))
        return slots

    def take(self, stats: SegmentStats, *, force: bool) -> dict[str, torch.Tensor] | None:
        """Rank 0: a copy of the dense state now (segment ``stats``' cut) if one is due;
        fills in ``stats.dense_s`` and ``stats.dense_bytes``."""
        cfg = self.config
        if not cfg.publish_dense or self.rank != 0 or not isinstance(self.model, nn.Module):
            return None
        now = time.monotonic()
        last = self._last_step
        due = force or last is None or (cfg.dense_every_steps == cfg.dense_every_seconds == 0)
        due = due or (
            cfg.dense_every_steps > 0 and stats.step - (last or 0) >= cfg.dense_every_steps
        )
        due = due or (
            cfg.dense_every_seconds > 0 and now - self._last_time >= cfg.dense_every_seconds
        )
        if not due:
            return None
        t0 = time.perf_counter()
        live = self.tensors()
        if not live:  # nothing but embedding tables: no dense states at all
            return None
        with torch.no_grad():
            dense = {n: t.detach().to("cpu", copy=True) for n, t in live.items()}
        stats.dense_s = time.perf_counter() - t0
        stats.dense_bytes = sum(t.nbytes for t in dense.values())
        self._last_step, self._last_time = stats.step, now
        return dense
