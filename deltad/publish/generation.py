"""A new run's generation id: newer than every one in the spool, the same on every rank."""

from __future__ import annotations

import time

from deltad.errors import SpoolError
from deltad.publish.ranks import RankGroup
from deltad.segment.spool import SpoolLayout

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
