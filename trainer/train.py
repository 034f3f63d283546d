"""The reference online trainer: multi-rank (gloo) DMP training that publishes segments.

:func:`run_training` spawns ``world_size`` processes. Each builds the :class:`ClickModel`,
shards it with a planner whose ``ParameterConstraints`` force each table's sharding type,
trains with the fused EXACT_ROWWISE_ADAGRAD optimizer (dense part: Adagrad) in a plain loop
or a TorchRec train pipeline, and publishes segments through :mod:`deltad.publish.publisher`.

TorchRec's ``EmbeddingBagCollectionSharder`` offers row-wise and table-row-wise sharding only
on CUDA; both run on CPU with gloo, so the trainer's EBC sharder offers them on CPU too. On
one host (every rank in one "node") table-row-wise places a table on all the host's ranks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import multiprocessing.util
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from deltad import errors
from deltad.config import PublisherConfig, check_name
from deltad.errors import ConfigError, DeltadError
from deltad.publish.publisher import SegmentPublisher
from deltad.publish.tracker import clean_fqn
from deltad.segment.spool import SpoolLayout
from deltad.signals import handle_signals
from deltad.types import TrainLoop

from .data import SEQ_FEATURE, ZCH_TABLE, Batch, ClickStream
from .model import ClickModel
from .zch import (
    POLICIES,
    ZCH_RAW_PER_SLOT,
    ZCH_SLOTS,
    enable_cpu_eviction,
    mc_sharders,
    mc_tables,
)

log = logging.getLogger(__name__)

#: Short sharding names accepted by the trainer -> TorchRec ShardingType values.
SHARDING_TYPES = {
    "tw": "table_wise",
    "rw": "row_wise",
    "cw": "column_wise",
    "twrw": "table_row_wise",
}
#: What TorchRec's EmbeddingCollectionSharder supports (the sequence table).
EC_SHARDINGS = ("tw", "rw", "cw")
CPU_LOOPS = (TrainLoop.PLAIN, TrainLoop.PIPELINE_BASE, TrainLoop.PIPELINE_SPARSE_DIST)
INPUT_FORMATS = ("kjt", "tensordict")
_WARMUP_STEPS = 3
#: Set in a rank by SIGTERM / SIGINT: finish the step, stop with the others, publish, save.
_STOP = threading.Event()


@dataclass
class TrainConfig:
    """Everything one training run needs. ``sharding`` maps each table (and ``seq``) to
    ``tw`` / ``rw`` / ``cw`` / ``twrw``; tables missing from it are table-wise."""

    spool_dir: Path | None = None
    model: str = "model"
    world_size: int = 1
    #: Pooled (EBC) tables: name -> rows. The sequence (EC) table is always named ``seq``.
    tables: dict[str, int] = field(default_factory=lambda: {"t0": 1000, "t1": 1000})
    seq_rows: int = 1000
    dim: int = 16
    #: Slots of the managed-collision table ``zch`` (0: the model has none), the size of its
    #: raw-id space (0: ``ZCH_RAW_PER_SLOT`` x the slots) and its MCH eviction policy.
    zch_slots: int = ZCH_SLOTS
    zch_raw_ids: int = 0
    zch_policy: str = "lru"
    sharding: dict[str, str] = field(default_factory=dict)
    #: Stop after this many steps (0 = no step limit) or this many seconds (0 = none).
    steps: int = 100
    duration_s: float = 0.0
    #: At most one step every this many seconds (0: as fast as it can): an online trainer's
    #: pace is its stream's. The wait is not part of a step's measured time.
    step_interval_s: float = 0.0
    batch_size: int = 128
    publish_every_steps: int = 0
    publish_every_seconds: float = 0.0
    #: False: train without tracker and publisher (the overhead baseline).
    publish: bool = True
    generation: int | None = None
    loop: TrainLoop = TrainLoop.PLAIN
    input_format: str = "kjt"
    #: Save {table: full tensor} at the end (torch.save, written by rank 0).
    final_tables: Path | None = None
    #: Save the final model at the end (torch.save, written by rank 0): the ``state_dict`` of
    #: the unsharded :class:`ClickModel`, every table gathered and the dense state, so that
    #: ``ClickModel(...).load_state_dict`` rebuilds the trained model.
    final_model: Path | None = None
    seed: int = 0
    learning_rate: float = 0.05
    fsync: bool = True
    progress: bool = True
    #: Save the model at these steps (after the step's optimizer update and publish, before the
    #: next step): ``dump_dir/model-step-<S>.pt`` (the unsharded state_dict, as
    #: ``final_model``) and ``dump_dir/tables-step-<S>.pt`` ({table: tensor}); what a rollback
    #: to S must restore (tests, ``deltad demo --scenario bad-update``).
    dump_steps: tuple[int, ...] = ()
    dump_dir: Path | None = None
    #: A bad update at this step (0: none): the loss is multiplied by NaN, so every row the
    #: step looks up and every dense parameter become NaN (and the following steps spread
    #: them); the validation gate must hold it. Plain loop only.
    inject_nan_step: int = 0
    #: Held-out examples (plain loop, KJT input): each rank's batch gets ``holdout_examples``
    #: more samples, never trained on, written to ``holdout_dir`` after the step
    #: (deltad.evaluate.labelled; the newest ``holdout_keep`` files per rank are kept).
    holdout_dir: Path | None = None
    holdout_examples: int = 16
    holdout_keep: int = 64
    #: Write a golden set of ``golden_examples`` labelled examples here at start (rank 0).
    golden_out: Path | None = None
    golden_examples: int = 2048
    #: Silent bad updates (plain loop; 0 = off), for ``corrupt_steps`` steps (0: to the end):
    #: the training labels flipped or shuffled (``corrupt_labels_mode``, a
    #: ``corrupt_fraction`` of each batch's samples), or the first pooled table fed the second
    #: table's ids. Held-out and golden examples stay clean.
    corrupt_labels_from_step: int = 0
    corrupt_feature_from_step: int = 0
    corrupt_steps: int = 0
    corrupt_labels_mode: str = "flip"
    corrupt_fraction: float = 1.0

    def corrupt_at(self, start: int, step: int) -> bool:
        """Whether a corruption starting at ``start`` (0: off) hits ``step``."""
        return (
            bool(start)
            and step >= start
            and (not self.corrupt_steps or step < start + self.corrupt_steps)
        )

    def __post_init__(self) -> None:
        if self.spool_dir is not None:
            self.spool_dir = Path(self.spool_dir)
        if self.final_tables is not None:
            self.final_tables = Path(self.final_tables)
        if self.final_model is not None:
            self.final_model = Path(self.final_model)
        if self.dump_dir is not None:
            self.dump_dir = Path(self.dump_dir)
        self.dump_steps = tuple(sorted(set(self.dump_steps)))
        if self.dump_steps and (self.dump_dir is None or self.dump_steps[0] < 1):
            raise ConfigError("--dump-steps needs --dump-dir, and steps >= 1 (dump_steps)")
        if self.inject_nan_step < 0:
            raise ConfigError("inject_nan_step must be >= 0 (0 = none)")
        if self.inject_nan_step and self.loop is not TrainLoop.PLAIN:
            raise ConfigError("inject_nan_step needs the plain loop")
        for p in ("holdout_dir", "golden_out"):
            if getattr(self, p) is not None:
                setattr(self, p, Path(getattr(self, p)))
        corrupt = self.corrupt_labels_from_step or self.corrupt_feature_from_step
        if min(self.corrupt_labels_from_step, self.corrupt_feature_from_step,
               self.corrupt_steps) < 0:  # fmt: skip
            raise ConfigError("corruption steps must be >= 0 (0 = off)")
        if (corrupt or self.holdout_dir is not None) and (
            self.loop is not TrainLoop.PLAIN or self.input_format != "kjt"
        ):
            raise ConfigError("held-out examples and corruptions need the plain loop, KJT input")
        if self.corrupt_labels_mode not in ("flip", "shuffle"):
            raise ConfigError("corrupt_labels_mode must be flip or shuffle")
        if not 0 < self.corrupt_fraction <= 1:
            raise ConfigError("corrupt_fraction must be in (0, 1]")
        if self.corrupt_feature_from_step and len(self.tables) < 2:
            raise ConfigError("corrupt_feature_from_step needs at least two pooled tables")
        if self.holdout_examples < 1 or self.holdout_keep < 1 or self.golden_examples < 1:
            raise ConfigError("holdout examples, holdout keep and golden examples must be >= 1")
        check_name("model", self.model)
        if self.world_size < 1:
            raise ConfigError("world_size must be >= 1")
        if not self.tables:
            raise ConfigError("at least one pooled table is needed")
        for name, rows in self.tables.items():
            check_name("table", name)
            if name == SEQ_FEATURE:
                raise ConfigError(f"table name {SEQ_FEATURE!r} is reserved for the sequence table")
            if rows < 1:
                raise ConfigError(f"table {name}: rows must be >= 1")
        if self.seq_rows < 1:
            raise ConfigError("seq_rows must be >= 1")
        if ZCH_TABLE in self.tables:
            raise ConfigError(
                f"table name {ZCH_TABLE!r} is reserved for the managed-collision table"
            )
        if self.zch_slots < 0 or self.zch_raw_ids < 0:
            raise ConfigError("zch slots and raw ids must be >= 0")
        if self.zch_slots and self.zch_slots < self.world_size:
            raise ConfigError("the managed-collision table needs at least one slot per rank")
        if self.zch_slots and 0 < self.zch_raw_ids < self.zch_slots:
            raise ConfigError("the zch raw-id space must be at least as large as its slots")
        if self.zch_policy not in POLICIES:
            raise ConfigError(f"zch policy must be one of {', '.join(POLICIES)}")
        if self.dim < 4 or self.dim % 4:
            raise ConfigError("dim must be a positive multiple of 4 (TBE kernels)")
        for name, st in self.sharding.items():
            if name == ZCH_TABLE and self.zch_slots:
                # (listed by `deltad status` like any table: naming it is no typo)
                if st != "rw":
                    raise ConfigError(
                        f"table {ZCH_TABLE} is the managed-collision table: always row-wise "
                        f"(the only sharding TorchRec has for it), not {st!r}"
                    )
                continue
            if name != SEQ_FEATURE and name not in self.tables:
                raise ConfigError(f"sharding names unknown table {name!r}")
            allowed = EC_SHARDINGS if name == SEQ_FEATURE else tuple(SHARDING_TYPES)
            if st not in allowed:
                raise ConfigError(f"table {name}: sharding {st!r} not in {', '.join(allowed)}")
        if self.step_interval_s < 0:
            raise ConfigError("step_interval_s must be >= 0")
        if self.steps < 0 or self.duration_s < 0:
            raise ConfigError("steps and duration must be >= 0")
        if self.steps == 0 and self.duration_s == 0:
            raise ConfigError("set steps or duration")
        if self.batch_size < 1:
            raise ConfigError("batch_size must be >= 1")
        if self.loop not in CPU_LOOPS:
            raise ConfigError(
                f"loop {self.loop.value} needs CUDA; on CPU use one of "
                + ", ".join(lp.value for lp in CPU_LOOPS)
            )
        if self.input_format not in INPUT_FORMATS:
            raise ConfigError(f"input must be one of {', '.join(INPUT_FORMATS)}")
        if self.publish:
            if self.spool_dir is None:
                raise ConfigError("publishing needs a spool directory")
            self.publisher_config()  # validates the intervals

    def publisher_config(self) -> PublisherConfig:
        assert self.spool_dir is not None
        return PublisherConfig(
            spool_dir=self.spool_dir,
            model=self.model,
            every_steps=self.publish_every_steps,
            every_seconds=self.publish_every_seconds,
            generation=self.generation,
            fsync=self.fsync,
            train_loop=self.loop,
        )

    @property
    def zch_raw_space(self) -> int:
        """Raw ids of the managed-collision table are in ``[0, zch_raw_space)`` (0: none)."""
        if not self.zch_slots:
            return 0
        return self.zch_raw_ids or ZCH_RAW_PER_SLOT * self.zch_slots

    def sharding_of(self, table: str) -> str:
        if table == ZCH_TABLE:
            return "rw"  # the only sharding TorchRec has for managed-collision tables
        return self.sharding.get(table, "tw")


@dataclass
class RankStats:
    """One rank's publishing costs."""

    rank: int
    segments: int
    rows: int
    nbytes: int
    stall_s: float  # training-loop time spent publishing (decide + drain + waits for copies)
    write_s: float  # writer-thread time
    hooks_s: float  # tracker hooks inside forward passes (record ids + fold into bitmaps)
    dense_bytes: int = 0  # rank 0: bytes of the dense states published with its segments
    #: The loop after its warm-up steps: wall time of its steps (publishing included), the
    #: process's CPU time meanwhile (every thread: the publisher's too), and how many steps.
    loop_s: float = 0.0
    loop_cpu_s: float = 0.0
    loop_steps: int = 0
    #: of ``loop_s``: what the publisher accounts as the loop's (``PublisherStats.stall_s``:
    #: the decision, drains, the publish's all-reduce, backward waits for copies)
    loop_publish_s: float = 0.0
    #: of ``loop_s``: the tracker's hooks (recording lookups and folding them in the forward,
    #: the update hooks in the backward), less the copy waits ``loop_publish_s`` counts
    loop_hooks_s: float = 0.0
    #: ``loop_hooks_s`` by part: ``record`` (the post-lookup hooks), ``fold`` (the post-odist
    #: hooks), ``backward`` (the update hooks, less the copy waits), and the calls of each
    loop_hook_parts: dict[str, float] = field(default_factory=dict)
    #: ``loop_publish_s`` by part: ``decide`` (every step's call; waits for the last
    #: publish's all-reduce included), ``publish`` (the publishes themselves, of which
    #: ``dense`` cloned the dense state), ``barrier_wait`` (backward passes waiting for a
    #: copy), and ``segments``
    loop_publish_parts: dict[str, float] = field(default_factory=dict)
    #: off the loop, over the whole run: CPU seconds of the publisher's writer and copier
    #: threads and of the tracker's fold thread (the publisher's own accounting), less the
    #: base segment that ``start()`` writes before the loop
    offloop_cpu_s: float = 0.0
    #: ``offloop_cpu_s`` by thread: ``write_s``, ``copy_s``, ``fold_s``
    offloop_parts: dict[str, float] = field(default_factory=dict)
    #: of the publisher's loop time, over the whole run: its per-publish all-reduce
    agree_s: float = 0.0


@dataclass
class TrainResult:
    """What a run did; ``step_s_*`` are rank 0's step times after a short warm-up."""

    generation: int | None
    steps: int
    step_s_mean: float
    step_s_median: float
    ranks: list[RankStats]
    final_tables: str | None


def run_training(cfg: TrainConfig) -> TrainResult:
    """Train with ``cfg.world_size`` spawned processes (gloo) and return what happened.

    SIGTERM or SIGINT stops training gracefully: every rank finishes the step it is in, stops
    at the same step, publishes its final segment and the final tables are saved. A
    DeltadError raised in a rank (e.g. an unwritable spool) is raised here with its type.
    """
    if cfg.publish:
        assert cfg.spool_dir is not None
        SpoolLayout(cfg.spool_dir, cfg.model).ensure_writable()
    with tempfile.TemporaryDirectory(prefix="deltad-train-") as tmp:
        work = Path(tmp)
        try:
            ctx = mp.start_processes(
                _worker, args=(cfg, work), nprocs=cfg.world_size, join=False, start_method="spawn"
            )
            with _forward_stop_signals(ctx.pids()):
                while not ctx.join():
                    pass
        except mp.ProcessRaisedException:
            _reraise_rank_error(work)
            raise
        raw = json.loads((work / "result.json").read_text())
    raw["ranks"] = [RankStats(**r) for r in raw["ranks"]]
    return TrainResult(**raw)


@contextlib.contextmanager
def _forward_stop_signals(pids: list[int]) -> Iterator[None]:
    """While training runs, SIGTERM / SIGINT to this process ask the ranks to stop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: Any) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _reraise_rank_error(work: Path) -> None:
    for p in sorted(work.glob("error-*.json")):
        e = json.loads(p.read_text())
        cls = getattr(errors, e["type"], None)
        if isinstance(cls, type) and issubclass(cls, DeltadError):
            raise cls(f"rank {e['rank']}: {e['message']}")


def _worker(rank: int, cfg: TrainConfig, work: Path) -> None:
    # Keep the console to the progress bar: TorchRec / torch deprecation chatter is not ours.
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in ("torchrec", "torch.distributed", "torch.fx", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ["LOCAL_WORLD_SIZE"] = str(cfg.world_size)  # one host
    os.environ["LOCAL_RANK"] = str(rank)
    with handle_signals({sig: lambda _: _STOP.set() for sig in (signal.SIGTERM, signal.SIGINT)}):
        dist.init_process_group(
            "gloo", init_method=f"file://{work}/pg", rank=rank, world_size=cfg.world_size
        )
        try:
            _train(rank, cfg, work)
            dist.barrier()  # no rank tears its process group down while another still talks
        except DeltadError as e:
            (work / f"error-{rank}.json").write_text(
                json.dumps({"rank": rank, "type": type(e).__name__, "message": str(e)})
            )
            raise
        finally:
            dist.destroy_process_group()
    # Everything this rank owes is on disk (segments flushed by the publisher's close, the
    # result and the final tables written). Leave without interpreter teardown: destroying
    # gloo's / TorchRec's C++ state at exit intermittently aborted a rank with "terminate
    # called without an active exception" after a clean SIGTERM stop.
    # Python's own finalizers still run: multiprocessing's release the semaphores this rank
    # created (skipped, the parent's resource tracker warned of "leaked semaphore objects").
    multiprocessing.util._run_finalizers(0)  # type: ignore[attr-defined]
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def build_unsharded(cfg: TrainConfig, device: torch.device | None = None) -> ClickModel:
    """The :class:`ClickModel` of ``cfg`` (on ``device``; ``meta`` to shard it)."""
    return ClickModel(
        cfg.tables,
        cfg.seq_rows,
        dim=cfg.dim,
        zch_slots=cfg.zch_slots,
        zch_raw_ids=cfg.zch_raw_ids,
        zch_policy=cfg.zch_policy,
        zch_buckets=cfg.world_size,  # the planner wants a multiple of the world size
        device=device,
    )


def build_model(cfg: TrainConfig) -> Any:
    """The sharded :class:`ClickModel` (a DistributedModelParallel); needs torch.distributed."""
    model = build_unsharded(cfg, device=torch.device("meta"))
    zch = [ZCH_TABLE] if cfg.zch_slots else []
    sharding = {t: cfg.sharding_of(t) for t in [*cfg.tables, SEQ_FEATURE, *zch]}
    # Column-wise: ask for shards narrow enough that every rank gets some (two per rank).
    min_partition = max(4, cfg.dim // (2 * cfg.world_size) // 4 * 4)
    return shard_model(
        model,
        sharding,
        world_size=cfg.world_size,
        learning_rate=cfg.learning_rate,
        cw_min_partition=min_partition,
    )


def shard_model(
    model: torch.nn.Module,
    sharding: dict[str, str],
    *,
    world_size: int,
    learning_rate: float,
    cw_min_partition: int = 4,
) -> Any:
    """Shard ``model``'s EC / EBC tables as ``sharding`` says (table -> tw / rw / cw / twrw,
    or any TorchRec ShardingType value) with the planner and the fused EXACT_ROWWISE_ADAGRAD
    optimizer, on CPU; return the DistributedModelParallel (torch.distributed must be up)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )

    class CpuEBCSharder(EmbeddingBagCollectionSharder):  # type: ignore[misc]
        """Offers row-wise and table-row-wise on CPU as well (they run with gloo)."""

        def sharding_types(self, compute_device_type: str) -> list[str]:
            types: list[str] = super().sharding_types(compute_device_type)
            return types + [t for t in ("row_wise", "table_row_wise") if t not in types]

    managed = mc_tables(model)
    if managed:
        enable_cpu_eviction()  # fbgemm has no CPU kernel for the reset eviction does
    constraints = {
        t: ParameterConstraints(
            sharding_types=[SHARDING_TYPES.get(st, st)],
            min_partition=cw_min_partition if st == "cw" else None,
            # MC sharders also offer UVM / KV kernels, which the CPU planner cannot price
            compute_kernels=["fused"] if t in managed else None,
        )
        for t, st in sharding.items()
    }
    fused = {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": learning_rate,
        "eps": 1e-8,
    }
    ebc_sharder = CpuEBCSharder(fused_params=fused)
    ec_sharder = EmbeddingCollectionSharder(fused_params=fused)
    sharders = [ebc_sharder, ec_sharder, *mc_sharders(ebc_sharder, ec_sharder)]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)


def _optimizer(dmp: Any, lr: float) -> Any:
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=lr),
    )
    return CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])


def _step_fn(
    cfg: TrainConfig,
    dmp: Any,
    optimizer: Any,
    batches: Iterator[Batch],
    at: list[int],
    holdout: Any = None,
) -> Any:
    """A callable running one training step (``at[0]``: the step it runs, counted by the
    caller); raises StopIteration when data runs out."""
    if cfg.loop is TrainLoop.PLAIN:
        from .holdout import corrupt_feature, corrupt_labels, examples_of, split_batch

        corrupt_gen = torch.Generator().manual_seed(cfg.seed + 4099)

        def plain() -> None:
            batch = next(batches)
            if holdout is not None:
                batch, held = split_batch(batch, cfg.batch_size)
                holdout.write(at[0], examples_of(held, step=at[0], rank=holdout.rank))
            if cfg.corrupt_at(cfg.corrupt_labels_from_step, at[0]):
                batch = corrupt_labels(
                    batch, corrupt_gen, mode=cfg.corrupt_labels_mode,
                    fraction=cfg.corrupt_fraction,
                )  # fmt: skip
            if cfg.corrupt_at(cfg.corrupt_feature_from_step, at[0]):
                batch = corrupt_feature(batch, cfg.tables)
            loss, _ = dmp(batch)
            if cfg.inject_nan_step and at[0] == cfg.inject_nan_step:
                loss = loss * float("nan")  # a bad update: NaN gradients everywhere
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        return plain
    from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    cls = TrainPipelineBase if cfg.loop is TrainLoop.PIPELINE_BASE else TrainPipelineSparseDist
    pipeline = cls(dmp, optimizer, torch.device("cpu"))
    return lambda: pipeline.progress(batches)


def _train(rank: int, cfg: TrainConfig, work: Path) -> None:
    torch.manual_seed(cfg.seed)
    dmp = build_model(cfg)
    optimizer = _optimizer(dmp, cfg.learning_rate)
    stream = ClickStream(
        cfg.tables,
        cfg.seq_rows,
        # (held-out samples come on top of the batch trained on)
        batch_size=cfg.batch_size + (cfg.holdout_examples if cfg.holdout_dir else 0),
        input_format=cfg.input_format,
        seed=cfg.seed,
        rank=rank,
        zch_raw_ids=cfg.zch_raw_space,
    )
    batches = stream.take(cfg.steps) if cfg.steps else iter(stream)
    publisher = None
    if cfg.publish:
        publisher = SegmentPublisher(dmp, cfg.publisher_config())
        publisher.start(0)
    holdout = None
    if cfg.holdout_dir is not None:
        from deltad.evaluate.labelled import HoldoutWriter

        gen = publisher.generation if publisher is not None else 0
        holdout = HoldoutWriter(
            cfg.holdout_dir, rank=rank, generation=gen or 0, keep=cfg.holdout_keep
        )
    if cfg.golden_out is not None and rank == 0:
        from deltad.evaluate.labelled import write_examples

        from .holdout import golden_examples

        write_examples(
            cfg.golden_out,
            golden_examples(cfg.tables, cfg.seq_rows, cfg.golden_examples, seed=cfg.seed,
                            zch_raw_ids=cfg.zch_raw_space),
        )  # fmt: skip
    at = [1]  # the step step_fn runs next
    step_fn = _step_fn(cfg, dmp, optimizer, batches, at, holdout)
    deadline = time.monotonic() + cfg.duration_s if cfg.duration_s else math.inf
    times: list[float] = []
    step = 0
    cpu0 = time.process_time()
    parts0: dict[str, float] = {}
    pub0: dict[str, float] = {}
    with tqdm(total=cfg.steps or None, disable=rank != 0 or not cfg.progress, unit="step") as bar:
        while not cfg.steps or step < cfg.steps:
            t0 = time.perf_counter()
            try:
                step_fn()
            except StopIteration:
                break
            step += 1
            at[0] = step + 1
            if publisher is not None:
                publisher.maybe_publish(step)
            if step in cfg.dump_steps:
                assert cfg.dump_dir is not None
                state, tables = _full_state(dmp, rank)  # collective: every rank at this step
                if rank == 0:
                    _save_atomic(state, cfg.dump_dir / f"model-step-{step}.pt")
                    _save_atomic(tables, cfg.dump_dir / f"tables-step-{step}.pt")
            times.append(time.perf_counter() - t0)
            if cfg.step_interval_s > 0:  # paced: the rest of the interval (bounded by it)
                time.sleep(max(0.0, cfg.step_interval_s - times[-1]))
            if step == _WARMUP_STEPS:
                cpu0 = time.process_time()
                parts0 = _hook_parts(publisher)
                pub0 = _publish_parts(publisher)
            bar.update()
            # Stop together: on a signal (any rank) or at the deadline (rank clocks differ).
            if _any_rank(_STOP.is_set() or time.monotonic() >= deadline):
                break
    loop_cpu = time.process_time() - cpu0
    loop_parts = {k: v - parts0.get(k, 0.0) for k, v in _hook_parts(publisher).items()}
    pub_parts = {k: v - pub0.get(k, 0.0) for k, v in _publish_parts(publisher).items()}
    # (``PublisherStats.stall_s`` and ``TrackerStats.hooks_s`` less the copy waits, over the
    # measured steps: the sums of their parts)
    loop_publish = sum(pub_parts.get(k, 0.0) for k in ("decide_s", "publish_s", "barrier_wait_s"))
    loop_hooks = sum(loop_parts.get(k, 0.0) for k in ("record_s", "fold_s", "backward_s"))
    if publisher is not None:
        publisher.close(step)
    if cfg.final_tables is not None or cfg.final_model is not None:
        state, tables = _full_state(dmp, rank)
        if rank == 0 and cfg.final_model is not None:
            _save_atomic(state, cfg.final_model)
        if rank == 0 and cfg.final_tables is not None:
            _save_atomic(tables, cfg.final_tables)
    mine = RankStats(rank, 0, 0, 0, 0.0, 0.0, 0.0)
    if publisher is not None:
        s = publisher.stats
        hooks = publisher.tracker.stats.forward_s
        mine = RankStats(
            rank, len(s.segments), s.rows, s.nbytes, s.stall_s, s.write_s, hooks, s.dense_bytes
        )
    steady = times[_WARMUP_STEPS:]
    mine.loop_s, mine.loop_cpu_s, mine.loop_steps = sum(steady), loop_cpu, len(steady)
    mine.loop_publish_s, mine.loop_hooks_s = loop_publish, loop_hooks
    mine.loop_hook_parts, mine.loop_publish_parts = loop_parts, pub_parts
    if publisher is not None:
        s = publisher.stats
        # the base written by start(), before the loop (a one-off, like loading a
        # checkpoint), is not a cost of the steps: every later segment is counted, the
        # final one and any fresh base included
        start_base = s.segments[0].write_cpu_s if s.segments else 0.0
        mine.offloop_parts = {
            "write_s": s.write_cpu_s - start_base,
            "copy_s": sum(x.copy_cpu_s for x in s.segments),
            "fold_s": publisher.tracker.stats.background_s,
        }
        mine.offloop_cpu_s = sum(mine.offloop_parts.values())
        mine.agree_s = sum(x.agree_s for x in s.segments)
    gathered: list[Any] = [None] * cfg.world_size if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    if rank == 0:
        steady = times[_WARMUP_STEPS:] or times or [0.0]
        result = TrainResult(
            generation=publisher.generation if publisher is not None else None,
            steps=step,
            step_s_mean=statistics.fmean(steady),
            step_s_median=statistics.median(steady),
            ranks=list(gathered),
            final_tables=str(cfg.final_tables) if cfg.final_tables else None,
        )
        (work / "result.json").write_text(json.dumps(asdict(result)))


def _hook_parts(publisher: Any) -> dict[str, float]:
    """The tracker's hook time so far by part, and their calls (see ``loop_hook_parts``)."""
    if publisher is None:
        return {}
    t, p = publisher.tracker.stats, publisher.stats
    return {
        "record_s": t.record_s, "fold_s": t.fold_s,
        "backward_s": t.backward_s - p.barrier_wait_s,
        "lookups": float(t.lookups), "update_hooks": float(t.update_hooks),
    }  # fmt: skip


def _publish_parts(publisher: Any) -> dict[str, float]:
    """The publisher's loop time so far by part (see ``loop_publish_parts``)."""
    if publisher is None:
        return {}
    p = publisher.stats
    return {
        "decide_s": p.decide_s, "publish_s": sum(s.stall_s for s in p.segments),
        "dense_s": sum(s.dense_s for s in p.segments), "barrier_wait_s": p.barrier_wait_s,
        "segments": float(len(p.segments)),
    }  # fmt: skip


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _save_atomic(obj: Any, path: Path) -> None:
    """torch.save atomically: a reader polling for the file never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _full_state(dmp: Any, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The unsharded model's state_dict and its ``{table: tensor}``, on rank 0 (collective;
    empty elsewhere): every table gathered from all ranks' shards, dense parameters and
    buffers (replicated) copied. Names are the unsharded :class:`ClickModel`'s (DMP / DDP
    prefixes removed)."""
    state: dict[str, torch.Tensor] = {}
    tables: dict[str, torch.Tensor] = {}
    for key, value in dmp.state_dict().items():
        name = clean_fqn(key)
        if hasattr(value, "local_shards"):
            dtype = value.metadata().tensor_properties.dtype
            if dtype.is_floating_point:
                full = torch.empty(value.size(), dtype=dtype) if rank == 0 else None
                value.gather(dst=0, out=full)
            else:  # MCH buffers: ShardedTensor.gather turns int64 max (empty slot) into min
                full = _gather_exact(value, dtype, rank)
            if full is not None:
                state[name] = full
                if key.endswith(".weight"):
                    tables[key.split(".")[-2]] = full
        elif rank == 0 and isinstance(value, torch.Tensor):
            state[name] = value.detach().clone()
    return state, tables


def _gather_exact(value: Any, dtype: torch.dtype, rank: int) -> torch.Tensor | None:
    """A sharded integer tensor (a managed-collision module's buffers) whole on rank 0, bit
    for bit (collective; None elsewhere)."""
    parts = [
        (list(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in value.local_shards()
    ]
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(parts, gathered, dst=0)
    if gathered is None:
        return None
    full = torch.empty(value.size(), dtype=dtype)
    for rank_parts in gathered:
        for offsets, t in rank_parts:
            full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape, strict=True))] = t
    return full
