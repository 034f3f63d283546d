"""Predictors of managed-collision models: rows and identities applied together, bit-exact.

A float MC-EC / MC-EBC (MCH remapper, LRU or LFU eviction) is trained here unsharded, step by
step; each step's changes become ShardUpdates as a segment carries them (the slots whose row or
raw id changed, the raw id each now holds, the raw ids evicted). A predictor that applied them
must equal the trainer's final model quantized by torchrec: weights, the remapper's lookup
buffers, and forwards on raw ids that are held, evicted and never seen.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import (
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)

from deltad.consume.appliers import TensorDictApplier, TorchRecApplier
from deltad.consume.mc import (
    LOOKUP_BUFFERS,
    SlotMap,
    lookup_buffers,
    probe_forward,
    remappers,
    slot_raw_of,
    training_only_state,
)
from deltad.consume.quant import QuantApplier, ServingLock, quant_tables, quantize_model
from deltad.consume.window import RankDelta, ShardUpdate
from deltad.errors import ConsumerError
from deltad.types import EMPTY_RAW_ID, ApplyConsistency, Cursor, Form, ServeDtype, Shard, WireDtype

pytestmark = pytest.mark.timeout(120)

SLOTS = 24
DIM = 8
RAW_SPACE = 400  # >= 10x the slots: admissions evict all the time
NEVER_SEEN = torch.arange(RAW_SPACE + 1, RAW_SPACE + 9)
POLICIES = {"lru": LRU_EvictionPolicy, "lfu": LFU_EvictionPolicy}


class MCModel(nn.Module):
    """One managed-collision table ``mc`` (feature ``f``) as an EBC or an EC."""

    def __init__(self, kind: str, policy: str, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        cpu = torch.device("cpu")
        mch = MCHManagedCollisionModule(
            zch_size=SLOTS,
            device=cpu,
            eviction_policy=POLICIES[policy](),
            eviction_interval=1,
            input_hash_size=RAW_SPACE,
        )
        self.mc: nn.Module
        if kind == "ebc":
            bags = [EmbeddingBagConfig(name="mc", embedding_dim=DIM, num_embeddings=SLOTS, feature_names=["f"])]  # fmt: skip
            self.mc = ManagedCollisionEmbeddingBagCollection(
                EmbeddingBagCollection(tables=bags, device=cpu),
                ManagedCollisionCollection({"mc": mch}, bags),
            )
        else:
            seqs = [EmbeddingConfig(name="mc", embedding_dim=DIM, num_embeddings=SLOTS, feature_names=["f"])]  # fmt: skip
            self.mc = ManagedCollisionEmbeddingCollection(
                EmbeddingCollection(tables=seqs, device=cpu),
                ManagedCollisionCollection({"mc": mch}, seqs),
            )

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """Per sample (EBC: pooled) or per id (EC) embeddings, ``[n, DIM]``."""
        emb, _ = self.mc(kjt)
        out: torch.Tensor = emb["f"].values() if isinstance(emb, dict) else emb.values()
        return out


def kjt_of(raw: torch.Tensor, per_sample: int = 1) -> KeyedJaggedTensor:
    n = raw.numel() // per_sample
    return KeyedJaggedTensor.from_lengths_sync(["f"], raw, torch.full((n,), per_sample))


def mch_of(m: nn.Module) -> Any:
    return next(x for x in m.modules() if isinstance(x, MCHManagedCollisionModule))


def weight_of(m: nn.Module) -> torch.Tensor:
    w = next(p for n, p in m.named_parameters() if "mc." in n and "weight" in n)
    return w


def slot_raw(m: nn.Module) -> torch.Tensor:
    mch = mch_of(m)
    return slot_raw_of(mch._mch_sorted_raw_ids, mch._mch_remapped_ids_mapping, 0)


def mc_update(
    ids: torch.Tensor,
    values: torch.Tensor | None,
    raw_ids: torch.Tensor | None,
    evicted: torch.Tensor | None = None,
    *,
    table: str = "mc",
    rows: int = SLOTS,
) -> ShardUpdate:
    shard = Shard.columns_of(table, rows, DIM, 0, DIM)
    return ShardUpdate(shard, ids, values, raw_ids=raw_ids, evicted_raw_ids=evicted)


def delta(shards: list[ShardUpdate], *, resync: bool = False, rank: int = 0) -> RankDelta:
    return RankDelta(
        rank=rank, generation=0, resync=resync, from_seq=0, to_seq=1, to_step=1,
        form=Form.ROWS, wire_dtype=WireDtype.FP32, cursor=Cursor("c", rank, 0, 1, 1),
        shards=shards,
    )  # fmt: skip


class Trainer:
    """The float model trained step by step; each step's segment as a ShardUpdate."""

    def __init__(self, kind: str, policy: str, seed: int = 0) -> None:
        self.model = MCModel(kind, policy, seed)
        self.initial = copy.deepcopy(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.02)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.ever: set[int] = set()

    def step(self, space: int = RAW_SPACE) -> ShardUpdate:
        """One step on raw ids below ``space`` (skewed so LFU admits too); the update a
        segment would carry."""
        w0, m0 = weight_of(self.model).detach().clone(), slot_raw(self.model)
        self.model.train()
        hot = torch.randint(0, space, (4,), generator=self.gen).repeat(3)
        raw = torch.cat([hot, torch.randint(0, space, (12,), generator=self.gen)])
        out = self.model(kjt_of(raw, 2))
        loss = (out * torch.linspace(-1, 1, DIM)).sum() + out.pow(2).sum()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        w1, m1 = weight_of(self.model).detach().clone(), slot_raw(self.model)
        slots = ((w1 != w0).any(dim=1) | (m1 != m0)).nonzero().view(-1)
        evicted = torch.tensor(sorted(set(m0.tolist()) - set(m1.tolist()) - {EMPTY_RAW_ID}))
        self.ever |= set(m1.tolist()) - {EMPTY_RAW_ID}
        return mc_update(slots, w1[slots].clone(), m1[slots].clone(), evicted.to(torch.int64))

    def probe(self) -> torch.Tensor:
        """Raw ids held now, ids held once and evicted, ids never seen."""
        held = slot_raw(self.model)
        held = held[held != EMPTY_RAW_ID]
        evicted = torch.tensor(sorted(self.ever - set(held.tolist())), dtype=torch.int64)
        assert evicted.numel(), "the training evicted nothing: the probe would prove little"
        return torch.cat([held, evicted, NEVER_SEEN])

    def base(self) -> ShardUpdate:
        """Every slot, as a base segment lists it."""
        w, m = weight_of(self.model).detach().clone(), slot_raw(self.model)
        return mc_update(torch.arange(SLOTS), w, m, torch.empty(0, dtype=torch.int64))


def assert_bit_exact(served: nn.Module, ref: nn.Module, probe: torch.Tensor) -> None:
    """Tables' bytes, remapper lookup buffers and forwards on ``probe`` raw ids are equal."""
    a, b = served.state_dict(), ref.state_dict()
    keys = [k for k in b if "weight" in k or "_mch_sorted_raw_ids" in k or "_mch_remapped" in k]
    assert any("_mch_sorted_raw_ids" in k for k in keys)
    for k in keys:
        assert torch.equal(getattr(a[k], "elem", a[k]), getattr(b[k], "elem", b[k])), k
    with torch.inference_mode():
        out, want = served(kjt_of(probe)), ref(kjt_of(probe))
    assert bool(torch.isfinite(want).all())
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


def served_quant(t: Trainer, dtype: ServeDtype) -> nn.Module:
    return quantize_model(copy.deepcopy(t.initial).eval(), dtype)


def reference_quant(t: Trainer, dtype: ServeDtype) -> nn.Module:
    return quantize_model(copy.deepcopy(t.model).eval(), dtype)


def test_quantize_embeddings_builds_quant_mc_modules_on_cpu() -> None:
    from torchrec.quant.embedding_modules import (
        QuantManagedCollisionEmbeddingBagCollection,
        QuantManagedCollisionEmbeddingCollection,
    )

    for kind, cls in (
        ("ebc", QuantManagedCollisionEmbeddingBagCollection),
        ("ec", QuantManagedCollisionEmbeddingCollection),
    ):
        q = quantize_model(MCModel(kind, "lru").eval(), ServeDtype.INT8)
        assert isinstance(q.mc, cls)
        assert set(quant_tables(q)) == {"mc"}
        assert set(remappers(q)) == {"mc"}


def test_lookup_buffers_of_a_slot_map_are_the_trainers_sorted_buffers() -> None:
    t = Trainer("ec", "lru")
    for _ in range(12):
        t.step()
    mch = mch_of(t.model)
    sorted_raw, mapping = lookup_buffers(slot_raw(t.model), 0)
    assert torch.equal(sorted_raw, mch._mch_sorted_raw_ids)
    assert torch.equal(mapping, mch._mch_remapped_ids_mapping)
    assert int((sorted_raw == EMPTY_RAW_ID).sum()) >= 1  # empty slots: ties, in slot order


@pytest.mark.parametrize("dtype", [ServeDtype.INT8, ServeDtype.FP32], ids=lambda d: d.value)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_quantized_predictor_applying_each_step_equals_the_trainer_quantized(
    kind: str, policy: str, dtype: ServeDtype
) -> None:
    t = Trainer(kind, policy)
    served = served_quant(t, dtype)
    applier = QuantApplier(served, chunk_rows=3)
    remapped = 0
    for _ in range(15):
        applier.apply([delta([t.step()])])
        remapped += applier.stats.identities
    assert remapped >= 5  # windows that re-identified slots rebuilt the remapper
    assert_bit_exact(served, reference_quant(t, dtype), t.probe())


def merged(updates: list[ShardUpdate]) -> ShardUpdate:
    """A rows window over several steps: newest row and identity per slot, evicted = union
    of the steps' evicted minus the raw ids held at the end (the sidecar's merge)."""
    rows: dict[int, tuple[torch.Tensor, int]] = {}
    evicted: set[int] = set()
    for u in updates:
        assert u.values is not None and u.raw_ids is not None and u.evicted_raw_ids is not None
        for i, s in enumerate(u.ids.tolist()):
            rows[s] = (u.values[i], int(u.raw_ids[i]))
        evicted |= set(u.evicted_raw_ids.tolist())
    slots = sorted(rows)
    held = {rows[s][1] for s in slots}
    return mc_update(
        torch.tensor(slots, dtype=torch.int64),
        torch.stack([rows[s][0] for s in slots]),
        torch.tensor([rows[s][1] for s in slots], dtype=torch.int64),
        torch.tensor(sorted(evicted - held), dtype=torch.int64),
    )


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_merged_windows_and_a_base_bring_a_fresh_predictor_to_the_same_model(kind: str) -> None:
    t = Trainer(kind, "lru")
    served = served_quant(t, ServeDtype.INT8)
    applier = QuantApplier(served)
    steps = [t.step() for _ in range(12)]
    applier.apply([delta([merged(steps[:5])])])
    applier.apply([delta([merged(steps[5:])])])
    ref = reference_quant(t, ServeDtype.INT8)
    assert_bit_exact(served, ref, t.probe())
    # a killed predictor bootstraps again: a fresh model, one base (every slot's identity)
    again = served_quant(t, ServeDtype.INT8)
    QuantApplier(again).apply([delta([t.base()], resync=True)])
    assert_bit_exact(again, ref, t.probe())


def _send(
    owed: dict[int, tuple[torch.Tensor, int]], k: int, evicted: torch.Tensor, changed: set[int]
) -> ShardUpdate:
    must = sorted(s for s in owed if s in changed)
    rest = sorted(s for s in owed if s not in changed)[:k]
    slots = sorted(must + rest)
    out = mc_update(
        torch.tensor(slots, dtype=torch.int64),
        torch.stack([owed[s][0] for s in slots]) if slots else torch.empty(0, DIM),
        torch.tensor([owed[s][1] for s in slots], dtype=torch.int64),
        evicted,
    )
    for s in slots:
        del owed[s]
    return out


def test_topk_windows_then_catch_up_are_bit_exact() -> None:
    t = Trainer("ec", "lfu")
    served = served_quant(t, ServeDtype.INT8)
    applier = QuantApplier(served)
    owed: dict[int, tuple[torch.Tensor, int]] = {}
    prev = slot_raw(t.model)
    most_owed = 0
    for _ in range(12):
        u = t.step()
        now = slot_raw(t.model)
        changed = set((now != prev).nonzero().view(-1).tolist())
        prev = now
        raw = u.raw_ids
        assert u.values is not None and raw is not None and u.evicted_raw_ids is not None
        for i, s in enumerate(u.ids.tolist()):
            owed[s] = (u.values[i], int(raw[i]))
        applier.apply([delta([_send(owed, 1, u.evicted_raw_ids, changed)])])
        most_owed = max(most_owed, len(owed))
        # every slot is served under its current identity even while rows are owed
        assert torch.equal(remappers(served)["mc"].slot_raw, now)
    assert most_owed > 0  # top-k left rows owed ...
    applier.apply([delta([_send(owed, SLOTS, torch.empty(0, dtype=torch.int64), set())])])
    assert_bit_exact(served, reference_quant(t, ServeDtype.INT8), t.probe())  # ... caught up


def test_float_mc_module_serves_the_same_as_the_trainer() -> None:
    t = Trainer("ebc", "lru")
    served = copy.deepcopy(t.initial).eval()
    applier = TorchRecApplier(served)
    assert set(applier.remappers) == {"mc"}
    for _ in range(10):
        applier.apply([delta([t.step()])])
    mch, ref = mch_of(served), mch_of(t.model)
    assert torch.equal(mch._mch_sorted_raw_ids, ref._mch_sorted_raw_ids)
    assert torch.equal(mch._mch_remapped_ids_mapping, ref._mch_remapped_ids_mapping)
    assert torch.equal(weight_of(served), weight_of(t.model))
    trained = copy.deepcopy(t.model).eval()
    probe = t.probe()
    with applier.reading(), torch.inference_mode():
        assert torch.equal(served(kjt_of(probe)), trained(kjt_of(probe)))


def test_dict_applier_keeps_a_slot_map_of_managed_collision_tables() -> None:
    t = Trainer("ec", "lru")
    applier = TensorDictApplier()
    for _ in range(6):
        applier.apply([delta([t.step()])])
    assert torch.equal(applier.slot_maps()["mc"].slot_raw, slot_raw(t.model))
    with pytest.raises(ConsumerError, match="managed-collision: its rows need raw ids"):
        applier.apply([delta([mc_update(torch.tensor([0]), torch.zeros(1, DIM), None)])])


def test_bad_identities_are_refused_before_anything_is_written() -> None:
    t = Trainer("ec", "lru")
    served = served_quant(t, ServeDtype.INT8)
    applier = QuantApplier(served)
    applier.apply([delta([t.step()])])
    before = {k: v.clone() for k, v in served.state_dict().items() if hasattr(v, "clone")}
    held = remappers(served)["mc"].slot_raw
    kept = held[1:][held[1:] != EMPTY_RAW_ID][:1]  # a raw id slot 0's update leaves held
    assert kept.numel() == 1
    bad = [
        (mc_update(torch.tensor([0]), torch.zeros(1, DIM), None), "need raw ids"),
        (mc_update(torch.tensor([0, 1]), torch.zeros(2, DIM), torch.tensor([7, 7])), "two slots"),
        (mc_update(torch.tensor([0]), torch.zeros(1, DIM), torch.tensor([-3])), "negative"),
        (
            mc_update(torch.tensor([0]), torch.zeros(1, DIM), torch.tensor([5]), kept),
            "evicted but still held",
        ),
    ]
    for u, msg in bad:
        with pytest.raises(ConsumerError, match=msg):
            applier.apply([delta([u])])
    plain = mc_update(torch.tensor([0]), torch.zeros(1, DIM), torch.tensor([5]), table="x")
    with pytest.raises(ConsumerError, match="not in the inference model"):
        applier.apply([delta([plain])])
    after = served.state_dict()
    for k, v in before.items():
        assert torch.equal(getattr(after[k], "elem", after[k]), getattr(v, "elem", v)), k


class _Watched(ServingLock):
    """A serving lock that runs ``check`` each time a writer lets go (a forward's view
    between two write-lock holds)."""

    def __init__(self, check: Any) -> None:
        super().__init__()
        self.check = check
        self.holds = 0

    @contextmanager
    def write(self) -> Iterator[None]:
        with super().write():
            yield
        self.holds += 1
        self.check()


@pytest.mark.parametrize("consistency", list(ApplyConsistency), ids=lambda c: c.value)
def test_a_forward_between_chunks_never_pairs_a_raw_id_with_another_ids_row(
    consistency: ApplyConsistency,
) -> None:
    t = Trainer("ec", "lru")
    served = served_quant(t, ServeDtype.FP32)
    applier = QuantApplier(served, chunk_rows=1, consistency=consistency)
    steps = [t.step(space=SLOTS + 8) for _ in range(8)]  # ids recur: rows of kept identities
    applier.apply([delta([merged(steps[:4])])])
    probe = torch.cat([remappers(served)["mc"].slot_raw, t.probe()])
    probe = probe[probe != EMPTY_RAW_ID].unique()
    with torch.inference_mode():
        old = served(kjt_of(probe)).clone()
        new = reference_quant(t, ServeDtype.FP32)(kjt_of(probe))
    seen: list[torch.Tensor] = []

    def check() -> None:
        with applier.serving():
            out = served(kjt_of(probe))
        # each id's embedding is its old (old slot, old row) or new (new slot, new row) one
        ok = (out == old).all(dim=1) | (out == new).all(dim=1)
        assert bool(ok.all()), probe[~ok]
        seen.append(out.clone())

    applier.serving_lock = _Watched(check)
    window = merged(steps[4:])
    assert int(window.ids.numel()) > 2  # several chunks of one row each
    applier.apply([delta([window])])
    assert applier.serving_lock.holds >= (1 if consistency is ApplyConsistency.WINDOW else 2)
    assert torch.equal(seen[-1], new)


def test_a_streamed_resync_leaves_managed_collision_tables_to_the_assembled_window() -> None:
    t = Trainer("ebc", "lfu")
    for _ in range(10):
        t.step()
    served = served_quant(t, ServeDtype.INT8)
    applier = QuantApplier(served)
    stage = applier.stage()
    base = t.base()
    assert not stage.open(0, base.shard, 0)  # the rows and raw ids stay in the window
    d = delta([base], resync=True)
    d.stage = stage
    applier.apply([d])
    assert_bit_exact(served, reference_quant(t, ServeDtype.INT8), t.probe())


def test_slot_map_checks_ranges() -> None:
    m = SlotMap.empty("t", 4, offset=4)
    with pytest.raises(ConsumerError, match="out of range"):
        m.plan([(torch.tensor([3]), torch.tensor([1]))])
    p = m.plan([(torch.tensor([5, 7]), torch.tensor([9, 2]))])
    assert p.mapping.tolist() == [7, 5, 4, 6] and p.changed.tolist() == [5, 7]


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_probe_forward_answers_one_embedding_per_raw_id_as_the_model_does(kind: str) -> None:
    t = Trainer(kind, "lru")
    served = served_quant(t, ServeDtype.INT8)
    applier = QuantApplier(served)
    for _ in range(6):
        applier.apply([delta([t.step()])])
    ref = reference_quant(t, ServeDtype.INT8)
    probe = t.probe()
    with applier.serving():
        got = probe_forward(served, "mc", probe)
    with torch.inference_mode():
        want = probe_forward(ref, "mc", probe)
        assert torch.equal(want, ref(kjt_of(probe)))  # one id per sample: the model's output
    assert got.shape == (probe.numel(), DIM) and torch.equal(got, want)
    # what a comparison leaves out: the trainer's eviction bookkeeping, not the lookup buffers
    skipped = training_only_state(ref)
    assert skipped and not any(b in k for k in skipped for b in LOOKUP_BUFFERS)
    with pytest.raises(ConsumerError, match="no managed-collision module"):
        probe_forward(served, "nope", probe)


def test_merged_lookup_buffers_equal_sorting_the_new_map_whole() -> None:
    gen = torch.Generator().manual_seed(5)
    m = SlotMap.empty("t", 64, offset=128)
    for i in range(60):
        n = int(torch.randint(1, 20, (1,), generator=gen))
        slots = torch.randperm(64, generator=gen)[:n] + 128
        raw = torch.randperm(10_000, generator=gen)[:n] + 1000 * i
        raw[torch.rand(n, generator=gen) < 0.2] = EMPTY_RAW_ID  # slots emptied too
        held = set(m.slot_raw.tolist()) - {EMPTY_RAW_ID}
        keep = torch.tensor([int(r) not in held for r in raw])  # a raw id moves only via merge
        p = m.plan([(slots[keep], raw[keep])])
        sorted_raw, mapping = lookup_buffers(p.slot_raw, 128)
        assert torch.equal(p.sorted_raw_ids, sorted_raw) and torch.equal(p.mapping, mapping)
        m.install(p)
    assert int((m.slot_raw == EMPTY_RAW_ID).sum()) not in (0, 64)


# ---- end to end: a DMP trainer (gloo) -> sidecars (-> relay) -> a quantized predictor -------


def _train_worker(
    rank: int, world_size: int, spool: str, kind: str, policy: str, generation: int, out: str
) -> None:
    """Train the trainer tests' MC toy under DMP, publish every step, save the final state."""
    from pathlib import Path

    from test_zch_trainer import STEPS, mc_batch, mc_dmp

    from deltad.config import PublisherConfig
    from deltad.publish.mc import slot_raw_ids
    from deltad.publish.publisher import SegmentPublisher

    torch.manual_seed(rank + 100 * generation)
    dmp = mc_dmp(world_size, kind, policy)
    cfg = PublisherConfig(Path(spool), model="m", every_steps=1, fsync=False, generation=generation)
    pub = SegmentPublisher(dmp, cfg)
    pub.start(0)
    for step in range(1, STEPS + 1):
        dmp(mc_batch(rank, step + 1000 * generation))[0].backward()
        dmp.fused_optimizer.step()
        pub.maybe_publish(step)
    pub.close(STEPS)
    mch = dmp.module.mc._managed_collision_collection._managed_collision_modules["z"]
    final = {
        "rows": {
            s.shard.table: (s.shard.row_start, s.weight.detach().clone())
            for s in pub.tracker.shards
        },
        "slots": (int(mch._output_global_offset), slot_raw_ids(mch)),
    }
    torch.save(final, Path(out) / f"final-{generation}-{rank}.pt")


class E2EModel(nn.Module):
    """The trainer tests' toy (MC table ``z`` on feature ``fz``, plain table ``p``) on CPU."""

    def __init__(self, kind: str, policy: str) -> None:
        super().__init__()
        from deltad.reference.trainer.zch import mc_module
        from test_zch_trainer import DIM as TDIM
        from test_zch_trainer import RAW_IDS
        from test_zch_trainer import SLOTS as TSLOTS

        cpu = torch.device("cpu")
        self.mc = mc_module(
            kind, "z", "fz", slots=TSLOTS, raw_ids=RAW_IDS, dim=TDIM, policy=policy,
            eviction_interval=2, device=cpu,
        )  # fmt: skip
        bags = [EmbeddingBagConfig(name="p", embedding_dim=TDIM, num_embeddings=16, feature_names=["fp"])]  # fmt: skip
        self.ebc = EmbeddingBagCollection(tables=bags, device=cpu)


def e2e_reference(
    out: Any, kind: str, policy: str, generation: int, world: int, dtype: ServeDtype
) -> tuple[nn.Module, torch.Tensor]:
    """The trainer's final model, unsharded (rows of every rank, the slot map of every rank
    in the MCH's order), quantized by torchrec; and its global slot -> raw id map."""
    from test_zch_trainer import SLOTS as TSLOTS

    m = E2EModel(kind, policy).eval()
    weights = {"z": weight_of(m), "p": m.ebc.embedding_bags["p"].weight}
    slot_map = torch.full((TSLOTS,), EMPTY_RAW_ID, dtype=torch.int64)
    for rank in range(world):
        final = torch.load(out / f"final-{generation}-{rank}.pt", weights_only=True)
        with torch.no_grad():
            for table, (start, w) in final["rows"].items():
                weights[table][start : start + w.shape[0]] = w
        offset, local = final["slots"]
        slot_map[offset : offset + local.numel()] = local
    mch = mch_of(m)
    sorted_raw, mapping = lookup_buffers(slot_map, 0)
    mch._mch_sorted_raw_ids.copy_(sorted_raw)
    mch._mch_remapped_ids_mapping.copy_(mapping)
    return quantize_model(m, dtype), slot_map


def e2e_sync(consumer: Any, applier: QuantApplier, step: int, evicted: set[int]) -> bool:
    """Pull and apply until the predictor serves ``step`` and nothing is owed or new;
    whether a pull was a resync."""
    resync = False
    for _ in range(200):
        r = consumer.pull(applier=applier)
        if r.deltas:
            applier.apply(r.deltas)
            consumer.commit(r)
            resync = resync or r.resync
        for d in r.deltas:
            for s in d.shards:
                if s.evicted_raw_ids is not None:
                    evicted.update(s.evicted_raw_ids.tolist())
        owed = sum(s.owed for d in r.deltas for s in d.shards)
        if r.step == step and owed == 0 and r.rows == 0:
            return resync
    raise AssertionError(f"never caught up with step {step}")


def e2e_check(
    served: nn.Module, applier: QuantApplier, ref: nn.Module, slot_map: torch.Tensor,
    evicted: set[int],
) -> None:  # fmt: skip
    """Weights and lookup buffers equal; forwards on held, evicted, never-seen raw ids equal."""
    from test_zch_trainer import RAW_IDS

    skip = training_only_state(ref)
    a, b = served.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    for k in b:
        if k not in skip:
            assert torch.equal(getattr(a[k], "elem", a[k]), getattr(b[k], "elem", b[k])), k
    held = slot_map[slot_map != EMPTY_RAW_ID]
    gone = torch.tensor(sorted(evicted - set(held.tolist())), dtype=torch.int64)
    assert held.numel() and gone.numel(), "the run must admit and evict raw ids"
    probe = torch.cat([held, gone, torch.arange(RAW_IDS, RAW_IDS + 5)])
    with applier.serving():
        got = probe_forward(served, "z", probe)
    with torch.inference_mode():
        want = probe_forward(ref, "z", probe)
    assert torch.equal(got, want)


E2E = [
    # (world size, kind, policy, form, k, serving dtype, relay levels)
    (1, "ebc", "lru", "rows", 0, ServeDtype.INT8, 0),
    (2, "ec", "lfu", "topk", 3, ServeDtype.FP32, 0),
    (2, "ebc", "lru", "rows", 0, ServeDtype.INT8, 1),
]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world", "kind", "policy", "form", "k", "dtype", "relays"), E2E)
def test_a_predictor_of_a_trained_mc_model_is_bit_exact_after_restart_and_new_generation(
    tmp_path: Any, redis_url: str, world: int, kind: str, policy: str, form: str, k: int,
    dtype: ServeDtype, relays: int,
) -> None:  # fmt: skip
    from shardkit import spawn
    from test_relay import tree
    from test_zch_trainer import STEPS

    from deltad.config import ConsumerConfig, PullOptions
    from deltad.consume.client import DeltaConsumer

    spool = tmp_path / "spool"
    spawn(_train_worker, world, tmp_path, str(spool), kind, policy, 1, str(tmp_path))
    pull = PullOptions(form=Form(form), k=k, wire_dtype=WireDtype.FP32)

    def predictor(endpoints: list[str], name: str) -> tuple[Any, nn.Module, QuantApplier]:
        c = DeltaConsumer(
            ConsumerConfig(consumer=name, model="m", sidecars=tuple(endpoints), pull=pull)
        )
        c.connect()
        served = quantize_model(E2EModel(kind, policy).eval(), dtype)
        return c, served, QuantApplier(served, chunk_rows=5)

    with tree(tmp_path, redis_url, world, relays) as levels:
        ends = levels[-1]
        evicted: set[int] = set()
        c, served, applier = predictor(ends, "p")
        try:
            assert e2e_sync(c, applier, STEPS, evicted)  # bootstrapped from the bases
            ref, slot_map = e2e_reference(tmp_path, kind, policy, 1, world, dtype)
            e2e_check(served, applier, ref, slot_map, evicted)
            # killed and started again: a new process bootstraps from the bases
            again, served2, applier2 = predictor(ends, "p")
            try:
                assert e2e_sync(again, applier2, STEPS, set())
                e2e_check(served2, applier2, ref, slot_map, evicted)
            finally:
                again.close()
            # the trainer restarts: a new generation; the first predictor follows it
            spawn(_train_worker, world, tmp_path, str(spool), kind, policy, 2, str(tmp_path))
            e2e_sync(c, applier, STEPS, evicted)
            ref2, slot_map2 = e2e_reference(tmp_path, kind, policy, 2, world, dtype)
            e2e_check(served, applier, ref2, slot_map2, evicted)
        finally:
            c.close()


def test_a_plain_slot_map_lets_the_window_win_over_stale_identities() -> None:
    """A TensorDictApplier's map may lack identities (a streamed base carries none): a slot
    the window does not list that holds a raw id the window moves or evicts is emptied."""
    applier = TensorDictApplier()
    applier.apply([delta([mc_update(torch.tensor([0, 1]), torch.zeros(2, DIM), torch.tensor([5, 6]))])])  # fmt: skip
    moved = mc_update(torch.tensor([2]), torch.ones(1, DIM), torch.tensor([5]), torch.tensor([6]))
    applier.apply([delta([moved])])
    raw = applier.slot_maps()["mc"].slot_raw
    assert raw[:3].tolist() == [EMPTY_RAW_ID, EMPTY_RAW_ID, 5]
    strict = SlotMap(
        "mc", torch.tensor([5, 6] + [EMPTY_RAW_ID] * (SLOTS - 2), dtype=torch.int64)
    )  # a remapper's map is held whole: the same window is refused
    with pytest.raises(ConsumerError, match="two slots"):
        strict.plan([(torch.tensor([2]), torch.tensor([5]))])
