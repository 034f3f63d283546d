"""Multi-rank alignment: the one trainer step every rank's window of a pull ends at, from Status."""

from __future__ import annotations

from dataclasses import dataclass

from deltad.consume.sidecars import RankStatus


@dataclass(frozen=True)
class Alignment:
    """Where an aligned pull goes, chosen from every rank's Status before any GetDelta."""

    #: the step every rank's window is asked to end at (``max_step`` of each GetDelta)
    target: int
    #: the newest step any rank has published
    head_step: int
    #: the newest step the release state lets this consumer be served (None: no cap)
    cap_step: int | None
    #: the newest step this consumer can reach now (``head_step`` without a cap)
    release_step: int


def unaligned(statuses: list[RankStatus]) -> dict[int, str]:
    """Why each rank cannot be pulled aligned yet (empty: it can): its server does not know
    the release state (it serves nothing), nothing published yet, or ranks at different
    generations."""
    generations = {s.generation for s in statuses}
    unknown = {s.rank: f"release state {s.state_unknown}" for s in statuses if s.state_unknown}
    if unknown:  # (served nothing until it is known: say why, not "nothing published")
        return unknown
    if len(generations) <= 1 and all(s.head_seq >= 0 for s in statuses):
        return {}
    return {
        s.rank: (
            "nothing published yet"
            if s.head_seq < 0
            else f"generation {s.generation} head seq {s.head_seq}: ranks not aligned yet"
        )
        for s in statuses
    }


def align(statuses: list[RankStatus], max_step: int | None, dense: bool) -> Alignment:
    """The step of an aligned pull (see :func:`unaligned` first): the lowest head, at most
    the release cap and ``max_step``, and with ``dense`` a step that has a dense state
    (:func:`dense_target`)."""
    target = min(s.head_step for s in statuses)
    caps = [s.cap_step for s in statuses if s.cap_step is not None]
    head_step = max(s.head_step for s in statuses)
    release_step = head_step
    cap_step = None
    if caps:  # the release state caps this consumer: caught up at the release
        cap_step = min(caps)
        target = min(target, cap_step)
        release_step = reachable(statuses, min(head_step, cap_step))
    if max_step is not None:
        target = min(target, max_step)
    if dense:
        target = dense_target(statuses, target)
    return Alignment(target, head_step, cap_step, release_step)


def dense_target(statuses: list[RankStatus], target: int) -> int:
    """The step an aligned pull that wants dense weights goes to, at most ``target``: the
    newest step that has a dense state and that every rank's log can end a window at (a
    retention merge may have swallowed a step on some rank). With dense states published with
    every segment (the default) that is ``target`` itself: no freshness is lost. If no such
    step exists (none published, or all swallowed), ``target``: rows move on, and the pull's
    ``dense_step`` (older) says which dense state the predictor holds."""
    dense = sorted({t for s in statuses for t in s.dense_steps if t <= target}, reverse=True)
    ends = [set(s.steps) for s in statuses]
    for t in dense:
        if all(t in e for e in ends if e):  # a rank that reports no steps: an older sidecar
            return t
    return target


def reachable(statuses: list[RankStatus], bound: int) -> int:
    """The newest step at or below ``bound`` that a rank can end a window at (as
    ``head_step`` is the newest any rank published; ``bound`` when ranks report no steps)."""
    ends = set().union(*(s.steps for s in statuses))
    return max((t for t in ends if t <= bound), default=bound)


def source_unix(statuses: list[RankStatus], step: int) -> float | None:
    """When ``step`` was published (host clock), if it is some rank's head."""
    at_step = [s.head_created_unix for s in statuses if s.head_step == step]
    return max(at_step) if at_step else None
