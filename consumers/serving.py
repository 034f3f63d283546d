"""The reference predictor's serving model: a quantized ClickModel answering forwards.

:func:`build_serving_model` builds the reference model's architecture from code
(:class:`~deltad.reference.trainer.model.ClickModel`), quantizes it with torchrec
(:func:`deltad.consume.quant.quantize_model`) and wraps it in a
:class:`~deltad.consume.quant.QuantApplier`; every table and the dense weights then come from
deltad (base plus log). :class:`ForwardLoop` runs forwards on a fixed batch in a thread while
the predictor pulls and applies, and records each forward's latency, marked by whether an
apply was in progress (to compare serving latency during apply with idle).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deltad.consume.quant import QuantApplier, quantize_model
from deltad.errors import ConfigError
from deltad.types import ApplyConsistency, ServeDtype

#: forward latencies kept (the newest), per kind
MAX_SAMPLES = 200_000


@dataclass
class ServingConfig:
    """The served model: reference architecture, serving dtype, the fixed forward batch."""

    dtype: ServeDtype
    tables: dict[str, int]
    seq_rows: int
    dim: int = 16
    consistency: ApplyConsistency = ApplyConsistency.CHUNK
    chunk_rows: int = 4096
    #: seed of the model code's initial weights (overwritten by the bootstrap) and the batch
    seed: int = 0
    batch_size: int = 64
    #: pause between forwards (0: back to back)
    interval_s: float = 0.002
    #: torch.save the model's state_dict here at exit
    final_state: Path | None = None
    #: the managed-collision table ``zch``: slots (None: the model code's default; 0: none),
    #: raw-id space (0: the model code's default multiple of the slots), eviction policy
    zch_slots: int | None = None
    zch_raw_ids: int = 0
    zch_policy: str = "lru"

    def __post_init__(self) -> None:
        self.dtype = ServeDtype(self.dtype)
        self.consistency = ApplyConsistency(self.consistency)
        if self.dtype is ServeDtype.BF16:
            raise ConfigError(
                "--serve-dtype bf16 is not supported: torchrec 1.8's quantize_embeddings("
                "dtype=torch.bfloat16) crashes (SIGFPE); use int8, int4, fp16 or fp32"
            )
        if not self.tables or self.seq_rows < 1 or self.dim < 4 or self.dim % 4:
            raise ConfigError("serving model: tables, seq rows >= 1 and dim a multiple of 4")
        if self.batch_size < 1 or self.interval_s < 0 or self.chunk_rows < 1:
            raise ConfigError("serving: batch size and chunk rows >= 1, interval >= 0")


def build_serving_model(cfg: ServingConfig) -> tuple[torch.nn.Module, QuantApplier]:
    """The reference ClickModel, quantized by torchrec, and the applier that updates it."""
    torch.manual_seed(cfg.seed)
    model = click_model(cfg).eval()
    served = quantize_model(model, cfg.dtype, inplace=True)
    applier = QuantApplier(served, consistency=cfg.consistency, chunk_rows=cfg.chunk_rows)
    return served, applier


def click_model(cfg: ServingConfig, device: torch.device | None = None) -> Any:
    """The reference ClickModel of ``cfg`` (float, fresh weights; tables on ``device``), as
    the trainer builds it."""
    from deltad.reference.trainer.model import ClickModel

    zch: dict[str, Any] = {"zch_raw_ids": cfg.zch_raw_ids, "zch_policy": cfg.zch_policy}
    if cfg.zch_slots is not None:
        zch["zch_slots"] = cfg.zch_slots
    return ClickModel(cfg.tables, cfg.seq_rows, dim=cfg.dim, device=device, **zch)


def fixed_batch(cfg: ServingConfig) -> Any:
    """The batch every forward answers (deterministic in the config); with raw ids of the
    managed-collision table if the model has one."""
    from deltad.reference.trainer.data import ClickStream

    raw_space = int(click_model(cfg, torch.device("meta")).zch_raw_ids)
    return ClickStream(
        cfg.tables, cfg.seq_rows, batch_size=cfg.batch_size, seed=cfg.seed + 7919,
        zch_raw_ids=raw_space,
    ).next_batch()  # fmt: skip


def serving_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict as plain tensors (torchrec's int4 wrapper unwrapped), copied."""
    out = {}
    for k, v in model.state_dict().items():
        out[k] = getattr(v, "elem", v).detach().clone()
    return out


def forward_path(state: Path) -> Path:
    """Where :func:`save_state` writes the fixed batch's logits next to ``state``."""
    state = Path(state)
    return state.with_name(f"{state.stem}-forward{state.suffix}")


def zch_path(state: Path) -> Path:
    """Where :func:`save_state` writes the managed-collision probe next to ``state``."""
    state = Path(state)
    return state.with_name(f"{state.stem}-zch{state.suffix}")


#: raw ids of each kind a managed-collision probe asks for (at most)
PROBE_IDS = 4096


def zch_probe(
    model: torch.nn.Module, applier: QuantApplier, evicted: dict[str, set[int]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Per managed-collision table, the served embeddings of raw ids it holds, raw ids
    evicted (seen in the windows, not held now) and raw ids never seen (beyond its raw-id
    space): ``{table: {"held", "evicted", "never", "out"}}`` (``out``: one row per raw id of
    ``held + evicted + never``, from a forward of the served MC module)."""
    from deltad.consume.mc import probe_forward
    from deltad.types import EMPTY_RAW_ID

    out: dict[str, dict[str, torch.Tensor]] = {}
    for table, rm in applier.remappers.items():
        held = rm.slot_raw[rm.slot_raw != EMPTY_RAW_ID][:PROBE_IDS].clone()
        keep = set(rm.slot_raw.tolist())
        gone = torch.tensor(sorted(x for x in evicted.get(table, set()) if x not in keep))
        gone = gone[:PROBE_IDS].to(torch.int64)
        space = int(getattr(rm.module, "_input_hash_size", 0))
        never = torch.arange(space, space + 8, dtype=torch.int64)
        with applier.serving():
            rows = probe_forward(model, table, torch.cat([held, gone, never])).clone()
        out[table] = {"held": held, "evicted": gone, "never": never, "out": rows}
    return out


def save_state(
    model: torch.nn.Module,
    path: Path,
    logits: torch.Tensor | None = None,
    zch: dict[str, dict[str, torch.Tensor]] | None = None,
) -> None:
    """torch.save :func:`serving_state` atomically (temp file, rename); ``logits`` (the
    served forward on the fixed batch) to :func:`forward_path`; ``zch`` (:func:`zch_probe`)
    to :func:`zch_path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    items: list[tuple[Path, Any]] = [(path, serving_state(model))]
    if logits is not None:
        items.insert(0, (forward_path(path), logits.detach().clone()))
    if zch:
        items.insert(0, (zch_path(path), zch))
    for dest, obj in items:
        tmp = dest.with_name(f".tmp-{dest.name}")
        torch.save(obj, tmp)
        tmp.replace(dest)


class ForwardLoop:
    """Forwards on a fixed batch in a thread; latencies split by apply in progress or idle."""

    def __init__(self, model: torch.nn.Module, applier: QuantApplier, cfg: ServingConfig) -> None:
        self.model = model
        self.applier = applier
        self.cfg = cfg
        self.batch = fixed_batch(cfg)
        self.forward = applier.serve(lambda b: model(b)[1])
        self.applying = threading.Event()
        self.idle_s: collections.deque[float] = collections.deque(maxlen=MAX_SAMPLES)
        self.apply_s: collections.deque[float] = collections.deque(maxlen=MAX_SAMPLES)
        self.forwards = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deltad-forward", daemon=True)

    def start(self) -> ForwardLoop:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def output(self) -> torch.Tensor:
        """One forward's logits on the fixed batch, now."""
        return self.forward(self.batch)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                during = self.applying.is_set()
                t0 = time.perf_counter()
                self.forward(self.batch)
                dt = time.perf_counter() - t0
                during = during or self.applying.is_set()
                (self.apply_s if during else self.idle_s).append(dt)
                self.forwards += 1
                if self.cfg.interval_s:
                    self._stop.wait(self.cfg.interval_s)
        except BaseException as e:  # reported by the predictor, not lost in the thread
            self.error = e
