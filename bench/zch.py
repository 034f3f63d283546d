"""Managed-collision tables: what identities cost on the wire and in a predictor's apply.

One MC-EBC table (``slots`` x ``dim``, an ``MCHManagedCollisionModule`` with LRU or LFU
eviction, eviction every step) sees batches of raw ids from a space 10x its slots (skewed:
a hot set plus uniform ids), so ids are admitted and evicted every step (measured after a warm-up that fills every
slot). Each step's segment
shard is what the trainer publishes: the slots looked up (their rows changed) plus the slots
whose raw id changed, each with its row (fp32) and the raw id it now holds, and the raw ids
evicted. Written with :func:`deltad.segment.format.write_segment` (version 3) and, as the
baseline, the same rows as an ordinary shard (version 2).

* **bytes per step**: the file bytes the identities add (v3 - v2) against shipping the whole
  remapper state each step (``_mch_sorted_raw_ids`` + ``_mch_remapped_ids_mapping``: 16 B per
  slot), and against the rows.
* **apply cost**: :class:`deltad.consume.quant.QuantApplier` applying each step's window into
  an int8 quantized MC-EBC (rows and identities: the remapper's buffers rebuilt) against the
  same rows into an ordinary int8 EBC of the same shape (rows only), interleaved window by
  window, order alternating.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from bench.common import Context, med, metric, ratio, summarize

POLICIES = ("lru", "lfu")


def _models(kind: str, slots: int, dim: int, raw_space: int, policy: str) -> Any:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        LFU_EvictionPolicy,
        LRU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    cpu = torch.device("cpu")
    tables = [EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=slots, feature_names=["f"])]  # fmt: skip
    ebc = EmbeddingBagCollection(tables=tables, device=cpu)
    if kind == "plain":
        return torch.nn.ModuleDict({"m": ebc})
    mch = MCHManagedCollisionModule(
        zch_size=slots,
        device=cpu,
        eviction_policy=(LRU_EvictionPolicy if policy == "lru" else LFU_EvictionPolicy)(),
        eviction_interval=1,
        input_hash_size=raw_space,
    )
    mc = ManagedCollisionEmbeddingBagCollection(ebc, ManagedCollisionCollection({"t": mch}, tables))
    return torch.nn.ModuleDict({"m": mc})


def _steps(
    slots: int, dim: int, raw_space: int, batch: int, steps: int, policy: str, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per step ``(slots listed, their rows, their raw ids, raw ids evicted)``."""
    from torchrec import KeyedJaggedTensor

    from deltad.consume.mc import slot_raw_of
    from deltad.types import EMPTY_RAW_ID

    torch.manual_seed(seed)
    model = _models("mc", slots, dim, raw_space, policy).train()
    mc = model["m"]
    mch = mc._managed_collision_collection._managed_collision_modules["t"]
    weight = mc._embedding_module.embedding_bags["t"].weight
    gen = torch.Generator().manual_seed(seed)
    out = []
    before = slot_raw_of(mch._mch_sorted_raw_ids, mch._mch_remapped_ids_mapping, 0)
    warmup = slots // max(1, batch // 2) + 3  # until every slot is taken: evictions each step
    for i in range(warmup + steps):
        hot = torch.randint(0, raw_space // 20, (batch // 2,), generator=gen)
        raw = torch.cat([hot, torch.randint(0, raw_space, (batch - batch // 2,), generator=gen)])
        kjt = KeyedJaggedTensor.from_lengths_sync(["f"], raw, torch.ones(batch, dtype=torch.int64))
        remapped = mc._managed_collision_collection(kjt)  # admission / eviction, as training
        touched = torch.unique(remapped.values())
        with torch.no_grad():  # the optimizer writes the looked-up rows
            weight[touched] += 0.01 * torch.randn(touched.numel(), dim, generator=gen)
        after = slot_raw_of(mch._mch_sorted_raw_ids, mch._mch_remapped_ids_mapping, 0)
        if i < warmup:
            before = after
            continue
        listed = torch.unique(torch.cat([touched, (after != before).nonzero().view(-1)]))
        held = after[after != EMPTY_RAW_ID]
        gone = before[(before != EMPTY_RAW_ID) & ~torch.isin(before, held)]
        out.append((listed, weight[listed].detach().clone(), after[listed].clone(), gone.sort()[0]))
        before = after
    return out


def _segment_bytes(
    d: Path, slots: int, dim: int, step: tuple[torch.Tensor, ...], identities: bool
) -> int:
    from deltad.segment.format import ShardRows, write_segment
    from deltad.types import SegmentKind, Shard

    ids, rows, raw, evicted = step
    shard = Shard("t", slots, dim, 0, slots, 0, dim)
    chunk = ShardRows(
        shard, ids, rows, raw if identities else None, evicted if identities else None
    )
    path = d / f"seg-{int(identities)}.dseg"
    write_segment(
        path, model="m", generation=0, rank=0, world_size=1, seq=1, step=1,
        kind=SegmentKind.DELTA, shards=[chunk], fsync=False,
    )  # fmt: skip
    return path.stat().st_size


def _window(step: tuple[torch.Tensor, ...], slots: int, dim: int, mc: bool) -> Any:
    from deltad.consume.window import RankDelta, ShardUpdate
    from deltad.types import Cursor, Form, Shard, WireDtype

    ids, rows, raw, evicted = step
    u = ShardUpdate(Shard.columns_of("t", slots, dim, 0, dim), ids, rows)
    if mc:
        u.raw_ids, u.evicted_raw_ids = raw, evicted
    return RankDelta(
        rank=0, generation=0, resync=False, from_seq=0, to_seq=1, to_step=1, form=Form.ROWS,
        wire_dtype=WireDtype.FP32, cursor=Cursor("b", 0, 0, 1, 1), shards=[u],
    )  # fmt: skip


def run(ctx: Context) -> dict[str, Any]:
    """Bytes per step and apply cost of MC identities, LRU and LFU."""
    from deltad.consume.quant import QuantApplier, quantize_model
    from deltad.types import ServeDtype

    slots = ctx.pick(500_000, 100_000, 2_000)
    dim = ctx.pick(64, 64, 16)
    batch = ctx.pick(16_384, 8_192, 256)
    steps = ctx.pick(24, 12, 3)
    raw_space = 10 * slots
    points: list[dict[str, Any]] = []
    for policy in POLICIES:
        ctx.status(f"zch {policy}: training")
        trace = _steps(slots, dim, raw_space, batch, steps, policy, seed=7)
        warm = trace  # steps after the warm-up: every slot taken, ids evicted each step
        with ctx.tmpdir("zch") as d:
            v3 = [_segment_bytes(d, slots, dim, s, True) for s in warm]
            v2 = [_segment_bytes(d, slots, dim, s, False) for s in warm]
        ident = [a - b for a, b in zip(v3, v2, strict=True)]
        whole = 16 * slots
        ctx.status(f"zch {policy}: apply")
        served = {
            k: QuantApplier(
                quantize_model(_models(k, slots, dim, raw_space, policy).eval(), ServeDtype.INT8)
            )
            for k in ("mc", "plain")
        }
        times: dict[str, list[float]] = {"mc": [], "plain": []}
        for i, s in enumerate(trace):
            order = ("mc", "plain") if i % 2 == 0 else ("plain", "mc")
            for k in order:
                w = [_window(s, slots, dim, k == "mc")]
                t0 = time.perf_counter()
                served[k].apply(w)
                times[k].append(time.perf_counter() - t0)
        listed = [int(s[0].numel()) for s in warm]
        evicted = [int(s[3].numel()) for s in warm]
        mc_s, plain_s = summarize(times["mc"][1:]), summarize(times["plain"][1:])
        points.append(
            {
                "policy": policy,
                "slots_listed_per_step": summarize(listed),
                "evicted_per_step": summarize(evicted),
                "identity_bytes_per_step": summarize(ident),
                "segment_bytes_per_step": summarize(v3),
                "rows_segment_bytes_per_step": summarize(v2),
                "whole_remapper_bytes": whole,
                "identity_vs_whole_remapper": ratio(med(summarize(ident)), whole),
                "identity_share_of_segment": ratio(med(summarize(ident)), med(summarize(v3))),
                "apply_mc_s": mc_s,
                "apply_rows_only_s": plain_s,
                "apply_cost_ratio": ratio(med(mc_s), med(plain_s)),
            }
        )
        ctx.log(
            f"zch {policy}: {med(summarize(listed)):.0f} slots listed, "
            f"{med(summarize(evicted)):.0f} evicted per step; identities "
            f"{med(summarize(ident)):.0f} B vs whole remapper {whole} B; apply "
            f"{ratio(med(mc_s), med(plain_s)):.2f}x rows only"
        )
    headline = []
    for p in points:
        none = {"target": None, "met": None}
        headline += [
            metric(f"{p['policy']}: identity bytes per step", med(p["identity_bytes_per_step"]),
                   "B", baseline=float(p["whole_remapper_bytes"]),
                   ratio=p["identity_vs_whole_remapper"], **none),
            metric(f"{p['policy']}: apply with identities (int8 MC-EBC)", med(p["apply_mc_s"]),
                   "s", baseline=med(p["apply_rows_only_s"]), ratio=p["apply_cost_ratio"], **none),
        ]  # fmt: skip
    return {
        "headline": headline,
        "params": {
            "slots": slots, "dim": dim, "batch": batch, "steps": steps, "raw_space": raw_space,
            "serve_dtype": "int8", "wire": "fp32 rows",
        },
        "points": points,
    }  # fmt: skip


def main() -> None:
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    res = run(Context(quick=a.quick, tiny=a.tiny))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
