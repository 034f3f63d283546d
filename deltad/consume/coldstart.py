"""Cold start from the archive: a predictor reads the newest archived base and segments
straight from the object store, applies them, and pulls only the tail from its sidecars.

::

    cfg = ConsumerConfig("ranker-1", sidecars=(...), bootstrap_from="s3://bucket/prefix")
    state = cold_start(cfg, applier)       # the tables now hold state.step; cursors set
    with DeltaConsumer(resumed(cfg)) as c: # resume: each rank's first pull is the tail
        c.sync(applier)

:func:`read_archived_state` reads every rank's archive manifest (deltad.serve.archive), picks
the newest step every rank holds (one generation; ``max_step`` caps it), fetches the objects
with parallel ranged reads into a private directory, verifies each (size and checksum, then the
spool's own validation) and rebuilds each rank's shards at that step as one resync window per
rank: what a sidecar bootstrap of that step delivers (fp32 values, a managed-collision table's
raw ids, rank 0's dense state at or before the step).

Cursors: a sidecar moves a consumer's cursor only by a commit of a pull it issued. So
:func:`cold_start` first pulls from each sidecar naming the archived state it holds
(``GetDeltaRequest.holding``: the sidecar answers an empty window at it, no rows and no window
built; a sidecar without the field answers the ids of that step instead: ``FORM_IDS``,
``from_base``, ``max_step``, 8 bytes a row) and checks that every rank's window ends exactly at
the archived (generation, seq, step); only then does it
apply the archived state and commit those cursors. Any disagreement (the sidecar's log moved
to another generation, a step merged away, a consumer committed past the archive) raises
:class:`ColdStartUnavailable` before anything is applied: the caller bootstraps from the
sidecars instead.

Without the trainer: a rank whose sidecar does not answer (one retry, at most
``HANDSHAKE_DEADLINE_S`` each) is listed in :attr:`ArchivedState.pending`; the state is applied
all the same, and :func:`resumed` has that rank's pulls name it until a commit from it is
acknowledged (a sidecar whose log no longer holds it refuses it: that rank's full tables
come next). The step is capped by the release state the sidecars archive with every
manifest, computed for this consumer as a sidecar would: a held fleet is held here too. A predictor killed during a cold start has applied nothing it keeps (its
tables die with it) and, at worst, committed the archived cursors: its next cold start finds
them and goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from deltad.config import ConsumerConfig, PullOptions
from deltad.consume.window import RankDelta, ShardUpdate
from deltad.errors import ConsumerError, DeltadError, SegmentCorruptError
from deltad.segment.spool import GenerationManifest, SpoolLayout
from deltad.segment.validate import load_verified, load_verified_dense
from deltad.serve.archive.fetch import fetch_objects, read_generation, read_manifest
from deltad.serve.archive.layout import ArchivedObject, ArchiveManifest
from deltad.serve.archive.opening import open_store
from deltad.serve.archive.store import ArchiveError, ObjectStore
from deltad.types import Cursor, Form, ShardKey, WireDtype

__all__ = [
    "ArchivedState",
    "ColdStartUnavailable",
    "cold_start",
    "read_archived_state",
    "resumed",
]

log = logging.getLogger(__name__)

#: Each handshake RPC's deadline (one retry): a sidecar that does not answer by then is told
#: the archived state by the consumer's later pulls instead.
HANDSHAKE_DEADLINE_S = 5.0


class ColdStartUnavailable(ConsumerError):
    """The archive cannot start this consumer (nothing archived, ranks disagree, the sidecars'
    logs are elsewhere): bootstrap from the sidecars instead. Nothing was applied."""


@dataclass
class ArchivedState:
    """Every rank's state at one step, read from the archive: one resync window per rank."""

    generation: int
    step: int
    #: rank -> (seq, step) of the newest archived entry used
    heads: dict[int, tuple[int, int]]
    deltas: list[RankDelta]
    #: bytes read from the store
    nbytes: int
    seconds: float
    #: ranks whose sidecar did not answer the cold start (their tables hold the archived
    #: state all the same; :func:`resumed` has their pulls name it until one answers)
    pending: tuple[int, ...] = ()
    #: the newest step the archived release state lets this consumer be served (None: no
    #: cap recorded), which bounded :attr:`step`
    release_cap: int | None = None


def resumed(config: ConsumerConfig, state: ArchivedState | None = None) -> ConsumerConfig:
    """``config`` for the consumer that goes on after a cold start: its tables hold the
    committed cursors' state (``resume``), and it does not cold-start again. With ``state``,
    the ranks whose sidecar did not answer the cold start (``state.pending``) name the
    archived state in their pulls until one answers (``ConsumerConfig.holding``)."""
    holding: tuple[tuple[int, int, int, int], ...] = ()
    if state is not None:
        holding = tuple((r, state.generation, *state.heads[r]) for r in state.pending)
    return dataclasses.replace(
        config, resume=True, bootstrap_from=None, bootstrap_endpoint=None, holding=holding
    )


def _release_cap(manifests: list[ArchiveManifest], consumer: str) -> int | None:
    """The newest step of the archived generation the release state recorded with the
    manifests (the newest version among the ranks') lets ``consumer`` be served: its cap
    and a validation gate's failure, as a sidecar computes them (None: no cap, or no state
    recorded); ColdStartUnavailable if nothing of the generation is released to it."""
    from deltad.serve.rollout import NOTHING, ReleaseState, cap_for, gate_open, lower

    states = []
    for m in manifests:
        raw = m.extra.get("release") if isinstance(m.extra, dict) else None
        if not isinstance(raw, str):
            continue
        try:
            states.append(ReleaseState.from_json(raw))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ColdStartUnavailable(
                f"rank {m.rank}'s archived release state is unreadable ({e}): not started "
                "from the store (the fleet may be held)"
            ) from None
    if not states:
        return None
    state = max(states, key=lambda st: st.version)
    generation = manifests[0].generation
    cap = cap_for(state, consumer, generation)
    if cap.max_step == NOTHING:
        raise ColdStartUnavailable(f"the archived release state: {cap.reasons[0]}")
    bad = gate_open(state, generation)
    return lower(cap.max_step, None if bad is None else bad - 1)


def _manifests(store: ObjectStore, model: str) -> list[ArchiveManifest]:
    m0 = read_manifest(store, model, 0)
    if m0 is None:
        raise ColdStartUnavailable(f"nothing of model {model!r} is archived in {store.url}")
    with ThreadPoolExecutor(8, thread_name_prefix="deltad-coldstart") as pool:
        rest = list(pool.map(lambda r: read_manifest(store, model, r), range(1, m0.world_size)))
    out = [m0]
    for r, m in enumerate(rest, 1):
        if m is None:
            raise ColdStartUnavailable(f"rank {r} of model {model!r} is not archived")
        out.append(m)
    gens = {m.generation for m in out}
    if len(gens) > 1 or {m.world_size for m in out} != {m0.world_size}:
        raise ColdStartUnavailable(
            f"the archived ranks are at generations {sorted(gens)}: a trainer restart is being "
            "archived; try again"
        )
    return out


def _target(
    manifests: list[ArchiveManifest], max_step: int | None
) -> tuple[int, list[tuple[ArchivedObject, ...]]]:
    step = min(m.head.step for m in manifests)
    if max_step is not None:
        step = min(step, max_step)
    oldest = max(m.entries[0].step for m in manifests)
    if step < oldest:
        raise ColdStartUnavailable(
            f"step {step} (the release cap or max_step) is older than the archive's oldest "
            f"state (step {oldest})"
        )
    picked = [m.upto_step(step) for m in manifests]
    steps = {p[-1].step for p in picked}
    if len(steps) != 1:
        raise ColdStartUnavailable(
            f"the archived ranks hold no common step at or before {step} (they end at "
            f"{sorted(steps)}: merged entries)"
        )
    return steps.pop(), picked


def read_archived_state(
    url: str,
    model: str,
    *,
    endpoint: str | None = None,
    max_step: int | None = None,
    tables: tuple[str, ...] = (),
    dense: bool = True,
    consumer: str = "",
) -> ArchivedState:
    """Every rank's state at the newest step all archived ranks hold (at most ``max_step``),
    verified, as resync windows (see the module docstring). ArchiveError if the store cannot
    be read or an object fails verification; ColdStartUnavailable if nothing fits."""
    started = time.monotonic()
    store = open_store(url, endpoint=endpoint)
    try:
        manifests = _manifests(store, model)
        release_cap = _release_cap(manifests, consumer)
        if release_cap is not None:
            max_step = release_cap if max_step is None else min(max_step, release_cap)
        step, picked = _target(manifests, max_step)
        gm = read_generation(store, manifests[0])
        with tempfile.TemporaryDirectory(prefix="deltad-coldstart-") as tmp:
            layout = SpoolLayout(Path(tmp), model)
            layout.write_manifest(gm, fsync=False)
            want: list[tuple[ArchivedObject, Path]] = []
            dense_obj: ArchivedObject | None = None
            for r, objs in enumerate(picked):
                want += [(o, layout.segment_path(gm.generation, r, o.seq)) for o in objs]
            if dense:
                dense_obj = manifests[0].dense_at(picked[0][-1].seq)
                if dense_obj is not None:
                    want.append((dense_obj, layout.dense_path(gm.generation, 0, dense_obj.seq)))
            fetch_objects(store, want)
            deltas = [
                _rank_delta(layout, gm, r, objs, set(tables), consumer)
                for r, objs in enumerate(picked)
            ]
            if dense_obj is not None:
                _add_dense(layout, gm, dense_obj, deltas[0])
    finally:
        store.close()
    state = ArchivedState(
        generation=gm.generation,
        step=step,
        heads={r: (p[-1].seq, p[-1].step) for r, p in enumerate(picked)},
        deltas=deltas,
        nbytes=sum(o.size for o, _ in want),
        seconds=time.monotonic() - started,
        release_cap=release_cap,
    )
    log.info(
        "cold start: read generation %d step %d from %s: %d objects, %d bytes, %.0f ms",
        state.generation, step, url, len(want), state.nbytes, state.seconds * 1000,
    )  # fmt: skip
    return state


def _rank_delta(
    layout: SpoolLayout,
    gm: GenerationManifest,
    rank: int,
    objs: tuple[ArchivedObject, ...],
    tables: set[str],
    consumer: str,
) -> RankDelta:
    """The rank's shards at its last entry: the base with every later entry applied in order
    (latest value wins), as a resync window."""
    values: dict[ShardKey, torch.Tensor] = {}
    raw: dict[ShardKey, torch.Tensor] = {}
    shards = {}
    for o in objs:
        path = layout.segment_path(gm.generation, rank, o.seq)
        try:
            seg = load_verified(
                path, layout.model_dir, gm, generation=gm.generation, rank=rank, seq=o.seq
            )
        except (SegmentCorruptError, DeltadError) as e:
            raise ArchiveError(f"archived {o.key} is refused: {e}") from None
        if (seg.header.first_seq, seg.header.step) != (o.first_seq, o.step):
            raise ArchiveError(f"archived {o.key} is not the segment its manifest names")
        for c in seg.shards:
            if tables and c.shard.table not in tables:
                continue
            k = c.shard.key
            if o.first_seq == 0:  # the base: every row of the shard
                shards[k] = c.shard
                values[k] = c.values.to(torch.float32).clone()
                if c.raw_ids is not None:
                    raw[k] = c.raw_ids.clone()
                continue
            if k not in values:
                raise ArchiveError(f"archived {o.key} has a shard {k} its base does not")
            at = c.ids - shards[k].row_start
            values[k][at] = c.values.to(torch.float32)
            if c.raw_ids is not None and k in raw:
                raw[k][at] = c.raw_ids
    head = objs[-1]
    updates = []
    for k, sh in shards.items():
        ids = torch.arange(sh.row_start, sh.row_end, dtype=torch.int64)
        updates.append(
            ShardUpdate(
                shard=type(sh).columns_of(sh.table, sh.num_rows, sh.dim, sh.col_start, sh.col_end),
                ids=ids,
                values=values[k],
                raw_ids=raw.get(k),
                evicted_raw_ids=None if k not in raw else torch.empty(0, dtype=torch.int64),
            )
        )
    return RankDelta(
        rank=rank,
        generation=gm.generation,
        resync=True,
        from_seq=-1,
        to_seq=head.seq,
        to_step=head.step,
        form=Form.ROWS,
        wire_dtype=WireDtype.FP32,
        cursor=Cursor(consumer, rank, gm.generation, head.seq, head.step),
        shards=updates,
        rows=sum(u.ids.numel() for u in updates),
        bytes=sum(int(u.values.nbytes) for u in updates if u.values is not None),
        resync_reason="cold start from the archive",
    )


def _add_dense(
    layout: SpoolLayout, gm: GenerationManifest, obj: ArchivedObject, d: RankDelta
) -> None:
    path = layout.dense_path(gm.generation, 0, obj.seq)
    try:
        state = load_verified_dense(
            path, layout.model_dir, gm, generation=gm.generation, rank=0, seq=obj.seq
        )
    except (SegmentCorruptError, DeltadError) as e:
        raise ArchiveError(f"archived {obj.key} is refused: {e}") from None
    d.dense = {k: v.clone() for k, v in state.tensors.items()}
    d.dense_step, d.dense_seq = state.header.step, state.header.seq
    d.dense_bytes = sum(int(v.nbytes) for v in d.dense.values())


def cold_start(config: ConsumerConfig, applier: object) -> ArchivedState:
    """Apply the archived state to ``applier`` (``applier.apply(deltas)``) and set this
    consumer's cursors at every rank to it; continue with ``DeltaConsumer(resumed(config))``.
    ColdStartUnavailable (nothing applied, nothing committed) if the archive and the sidecars
    do not agree on a state; ArchiveError if the store fails."""
    from deltad.consume.client import DeltaConsumer

    if config.bootstrap_from is None:
        raise ColdStartUnavailable("no bootstrap_from archive is configured")
    state = read_archived_state(
        config.bootstrap_from,
        config.model,
        endpoint=config.bootstrap_endpoint,
        max_step=config.pull.max_step,
        tables=config.pull.tables,
        dense=config.pull.dense,
        consumer=config.consumer,
    )
    ids_only = dataclasses.replace(
        config,
        align_steps=False,
        resume=False,  # from_base: a window from the base whatever the stored cursor says
        bootstrap_from=None,
        bootstrap_endpoint=None,
        holding=(),
        # a sidecar that is down is not waited for: the state is served without it
        max_retries=min(config.max_retries, 1),
        rpc_deadline_s=min(config.rpc_deadline_s, HANDSHAKE_DEADLINE_S),
        pull=PullOptions(
            form=Form.IDS, tables=config.pull.tables, max_step=state.step, dense=False
        ),
    )
    with DeltaConsumer(ids_only) as handshake:
        # the archived state named (GetDeltaRequest.holding): a sidecar that knows the field
        # answers with an empty window at it (no rows, no window built); one that does not,
        # with the ids of its base up to that step (8 bytes a row). Both end at the archived
        # state, or the cold start is not taken. A sidecar that does not answer (the trainer
        # is down) is told later: the consumer's pulls name the state (resumed(cfg, state)).
        handshake.hold(state.generation, state.heads)
        got = handshake.pull()
        refused = {r: why for r, why in got.missing.items() if r not in got.unanswered}
        if refused:
            raise ColdStartUnavailable(f"ranks refused the archived state: {refused}")
        if len(got.deltas) + len(got.unanswered) != len(state.deltas):
            raise ColdStartUnavailable(f"ranks did not answer: {got.missing}")
        for d in got.deltas:
            seq, step = state.heads[d.rank]
            if (d.generation, d.to_seq, d.to_step) != (state.generation, seq, step):
                raise ColdStartUnavailable(
                    f"rank {d.rank}'s sidecar serves generation {d.generation} seq {d.to_seq} "
                    f"step {d.to_step} for step {state.step}, the archive generation "
                    f"{state.generation} seq {seq} step {step}"
                )
        done = handshake.commit(got) if got.deltas else []
        if sorted(done) != sorted(d.rank for d in got.deltas):
            raise ColdStartUnavailable(
                "a rank refused the archived cursor (a commit past it: this consumer has "
                "followed further than the archive)"
            )
    if got.unanswered:
        state = dataclasses.replace(state, pending=tuple(sorted(got.unanswered)))
        log.warning(
            "cold start %s: the sidecars of ranks %s do not answer: serving generation %d step "
            "%d from the archive; they are told the state when they answer",
            config.consumer, list(state.pending), state.generation, state.step,
        )  # fmt: skip
    apply = getattr(applier, "apply", applier)
    assert callable(apply)
    apply(state.deltas)
    return state
