"""A pull's resync stage: kept only if every rank that staged rows into it delivered its window."""

from __future__ import annotations

from collections.abc import Sequence

from deltad.consume.result import PullResult
from deltad.consume.sidecars import RankLink
from deltad.consume.window import ResyncStage


def keep_stage(result: PullResult, stage: ResyncStage, ranks: Sequence[RankLink]) -> str | None:
    """Discard ``stage`` unless every rank that staged rows into it delivered its window
    in ``result``: a rank that failed mid-stream left rows of a window that will not be
    applied, which nothing can tell from the rows other ranks staged next to them (a
    row-wise shard shares its tables). The windows that were streamed go with it: their
    ranks count as missing and ask for their full tables again. Returns why the streamed
    windows were dropped (None: none were); raises the applier's refusal of a window."""
    if stage.error is not None:
        stage.discard(str(stage.error))
        for d in result.deltas:
            if d.stage is stage:
                ranks[d.rank].needs_base = True
        raise stage.error  # the applier refused the window, as apply would have
    delivered = {d.rank for d in result.deltas if d.stage is stage}
    spoiled = sorted(stage.ranks - delivered)
    if not spoiled:
        if not delivered:
            stage.discard("nothing streamed")
        return None
    why = f"resync discarded: rank(s) {spoiled} failed after staging rows"
    stage.discard(why)
    kept = []
    for d in result.deltas:
        if d.stage is stage:  # (auto-committed or not) the full tables come again
            result.missing[d.rank] = why
            ranks[d.rank].needs_base = True
        else:
            kept.append(d)
    result.deltas = kept
    if not kept:
        result.step = None
    return why
