"""A new run's generation: an id newer than every one in the spool, and its manifest, on every rank."""

from __future__ import annotations

import time
from collections.abc import Sequence

from deltad.config import PublisherConfig
from deltad.errors import SpoolError
from deltad.publish.ranks import RankGroup
from deltad.segment.spool import GenerationManifest, SpoolLayout, TableInfo

#: The largest generation id: generations travel as int64 (collectives, segment headers).
MAX_GENERATION = 2**63 - 1


def choose_generation(ranks: RankGroup, layout: SpoolLayout, requested: int | None) -> int:
    """The new run's generation, the same on every rank, or SpoolError on every rank.

    It must be larger than every generation already in the spool: a reused id would
    overwrite that run's manifest and first segments while its later segments stay
    (two runs mixed in one log), and a smaller one is never served (the sidecar only
    switches to a larger generation). Every rank reports the largest it sees (one
    shared spool, or one per host) and all of them agree on the maximum; rank 0's
    choice (the ``requested`` id, or the clock but past that maximum) is broadcast; then
    every rank checks it against the maximum alike, so a refusal is raised on all ranks
    with the same message and none is left waiting in a collective.
    """
    newest: int | None = None
    error: BaseException | None = None
    try:
        if requested is not None and not 0 <= requested <= MAX_GENERATION:
            raise SpoolError(f"generation {requested} is out of range 0..{MAX_GENERATION}")
        newest = max(layout.generations(), default=None)
        if newest is not None and newest >= MAX_GENERATION:
            raise SpoolError(
                f"generation {newest} in {layout.model_dir} leaves no larger id: "
                "move that generation out of the spool"
            )
    except SpoolError as e:
        error = e
    ranks.agree(error, "choosing the generation")
    newest = ranks.all_reduce_max(-1 if newest is None else newest)[0]
    gen = requested if requested is not None else max(time.time_ns(), newest + 1)
    gen = ranks.broadcast(gen)
    if gen <= newest:  # only a requested id can be; the same on every rank
        raise SpoolError(
            f"generation {gen} is not newer than generation {newest}, which already "
            f"exists in {layout.model_dir}: a restart is a new generation (reusing "
            f"an id would mix two runs in one log, a smaller one is never served); pass "
            f"generation {newest + 1} or larger (--generation), or none for a time-based "
            f"one past it"
        )
    return gen


def open_generation(
    ranks: RankGroup,
    layout: SpoolLayout,
    config: PublisherConfig,
    *,
    step: int,
    tables: Sequence[TableInfo],
) -> int:
    """Prepare the spool, choose the generation (:func:`choose_generation`) and write its
    manifest (starting at ``step``); every rank agrees each part succeeded, or all raise."""
    error: BaseException | None = None
    try:
        layout.ensure_writable()
    except SpoolError as e:
        error = e
    ranks.agree(error, "preparing the spool")
    gen = choose_generation(ranks, layout, config.generation)
    # Every rank writes the manifest, the same bytes: a spool shared by all ranks gets one
    # file (atomic renames of identical content), and a spool per host (a pod per rank,
    # each with its own sidecar) gets the manifest its sidecar needs to serve the rank.
    created_ns = ranks.broadcast(time.time_ns())
    try:
        layout.write_manifest(
            GenerationManifest(
                model=config.model,
                generation=gen,
                world_size=ranks.world_size,
                start_step=step,
                created_unix=created_ns / 1e9,
                tables=tuple(tables),
            ),
            fsync=config.fsync,
        )
    except SpoolError as e:
        error = e
    ranks.agree(error, "writing the generation manifest")  # also: manifest before segments
    return gen
