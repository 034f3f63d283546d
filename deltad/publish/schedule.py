"""When to publish: a delta every N steps or at the step the ranks agreed on; a fresh base when owed.

Time-based publishing (``every_seconds``) off the step
------------------------------------------------------
The ranks agree *in advance* on the step of the next time-based publish: at each publish, rank
0 predicts it from its measured step time (the steps since the previous publish over the
seconds they took: the first step at which ``every_seconds`` will have passed), and the value
rides the publish's own all-reduce (``[failed, next step]``, MAX; the other ranks send -1).
``maybe_publish(step)`` is then ``step >= next`` on every rank: a pure function of the step,
like ``every_steps``, so uneven step times across ranks cannot make them disagree, and no step
that does not publish issues a collective. The first time-based publish after ``start`` comes
at the first step (nothing is measured yet); each publish re-measures, so a change of pace is
followed one interval later. A loop that slows down after a prediction publishes late by that
much (bound it with ``every_steps`` as well; both set: whichever comes first).

Where the publish runs does not change (the same ``maybe_publish(step)`` call after step
``step``'s optimizer step), so the drain point stays what it is for step-based publishing
under every pipeline: the plain loop and TrainPipelineBase/SparseDist (run here) call it
between steps; TrainPipelineFusedSparseDist and TrainPipelineSemiSync (GPU only) have already
started batch ``step + 1``'s lookup there, but its row writes happen in a backward after this
call, behind the update barrier (see :mod:`deltad.publish.publisher`). Only *whether* a step
publishes is decided differently, and deciding it earlier (at the previous publish) instead of
at the call changes no cut: the publish at step ``n`` is the same drain at the same point, and
every rank drains at the same ``n`` (previously a per-step all-reduce made that so; now the
agreed ``n`` does).
"""

from __future__ import annotations

import logging
import math
import os
import time

from deltad.segment.spool import SpoolLayout

log = logging.getLogger(__name__)


class PublishSchedule:
    """Whether a step publishes: ``every_steps`` since the last segment, or the agreed step
    of the next time-based publish (``every_seconds``); both are pure functions of the step
    on every rank, so deciding needs no collective."""

    def __init__(self, every_steps: int, every_seconds: float, rank: int) -> None:
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.rank = rank
        #: the step and clock of the last segment (any kind)
        self.last_step = 0
        self.last_time = 0.0
        #: time-based publishing: the step of the next publish, agreed by every rank at the
        #: previous one (None: not started, or every_seconds is off)
        self.next_timed: int | None = None

    def due(self, step: int) -> bool:
        """Whether ``step`` publishes (the same answer on every rank)."""
        due = self.every_steps > 0 and step - self.last_step >= self.every_steps
        # the step every rank agreed on at the last publish: no collective
        return due or (self.next_timed is not None and step >= self.next_timed)

    def segment(self, step: int) -> None:
        """A segment was cut at ``step`` now (the pace is measured from here)."""
        self.last_step = step
        self.last_time = time.monotonic()

    def started(self, step: int) -> None:
        """The base is written at ``step``: nothing measured yet, so the first step publishes."""
        if self.every_seconds > 0:
            self.next_timed = step + 1

    def predict_next(self, step: int) -> int:
        """Rank 0, time-based: the first step after ``step`` at which ``every_seconds`` will
        have passed since now, at the pace of the steps since the previous publish (the
        other ranks, or without every_seconds: -1, which the MAX ignores)."""
        every = self.every_seconds
        if every <= 0 or self.rank != 0:
            return -1
        steps = step - self.last_step
        elapsed = time.monotonic() - self.last_time
        if steps <= 0 or elapsed <= 0:
            return step + 1
        per_step = elapsed / steps
        return step + max(1, math.ceil(every / per_step - 1e-9))

    def agreed(self, next_step: int) -> None:
        """The ranks' MAX of :meth:`predict_next`: the step of the next time-based publish."""
        if self.every_seconds > 0:
            self.next_timed = next_step


class RebaseSchedule:
    """Whether a publish writes a fresh base of this rank instead of a delta: after a failed
    write, or when the sidecar asked for one (``rebase.request``), at most every
    ``retry_s`` (rank-local: no collective)."""

    def __init__(self, layout: SpoolLayout, rank: int, retry_s: float) -> None:
        self.layout = layout
        self.rank = rank
        self.retry_s = retry_s
        self._last = -float("inf")
        #: (generation, its request's path as a str): building the Path each publish cost
        #: the loop ~150 us of a publish's ~1 ms here; one stat of a str costs a few
        self._request: tuple[int, str] | None = None

    def due(self, generation: int, write_failed: bool) -> bool:
        """Whether this publish is a fresh base; consumes the sidecar's request if it is."""
        if self._request is None or self._request[0] != generation:
            self._request = (
                generation,
                str(self.layout.rebase_request_path(generation, self.rank)),
            )
        path = self._request[1]
        asked = os.path.exists(path)
        if not (asked or write_failed):
            return False
        if time.monotonic() - self._last < self.retry_s:
            return False
        if asked:
            log.warning("rank %d: the sidecar asked for a fresh base", self.rank)
            try:
                os.unlink(path)
            except OSError:
                pass
        return True

    def taken(self) -> None:
        """A fresh base is being published now (the next waits ``retry_s``)."""
        self._last = time.monotonic()
