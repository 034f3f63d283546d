"""One pull's outcome: the windows to apply, the step they serve, and whether it is caught up."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltad.consume.window import RankDelta


@dataclass
class PullResult:
    """One pull: the windows to apply (one per rank) and what serving them means."""

    deltas: list[RankDelta] = field(default_factory=list)
    #: Trainer step the tables serve once ``deltas`` are applied (None: nothing pulled). With
    #: dense states asked for and published, the dense weights of that step come with it (in
    #: the window of the rank that publishes them), unless the predictor holds them already.
    step: int | None = None
    #: Newest step any rank has published.
    head_step: int | None = None
    #: The newest step the model's release state lets this consumer be served (hold, pin,
    #: canary, a validation gate failure; None: no cap: the head). Aligned pulls only.
    cap_step: int | None = None
    #: The newest step this consumer can reach now: ``head_step`` without a cap, else the
    #: newest step at or below the cap every rank can end a window at. Aligned pulls only.
    release_step: int | None = None
    #: When the last segment of ``step`` was created (host clock), if known.
    source_unix: float | None = None
    #: Ranks not read this time, with the reason (the rows come next time).
    missing: dict[int, str] = field(default_factory=dict)
    #: The ranks of ``missing`` whose sidecar did not answer (as opposed to one that
    #: answered with a refusal, or another step or generation).
    unanswered: set[int] = field(default_factory=set)
    pulled_unix: float = 0.0
    #: Why the applier refused these windows (None: not refused). A refused pull applied
    #: nothing and is never committed; its ranks are asked for their full tables at the next
    #: pull, which waits ``retry_in_s`` first (:meth:`DeltaConsumer.refuse`).
    refused: str | None = None
    #: Seconds the next pull waits after a refusal (0: none).
    retry_in_s: float = 0.0

    @property
    def caught_up(self) -> bool:
        """Every rank read, the tables serve the newest step this consumer may have (the
        head, or the release step while a hold, pin or gate caps it: a capped consumer is
        caught up to the release, not behind), no row is owed and no dense state is
        missing, and no relay that served it lost its upstream: nothing more to pull until
        the trainer publishes or an operator releases."""
        if self.missing or self.dense_missing or self.upstream_lost or self.refused:
            return False
        if self.step is None or self.owed:
            return False
        reach = self.release_step if self.release_step is not None else self.head_step
        return reach is not None and self.step >= reach

    @property
    def rows(self) -> int:
        return sum(d.rows for d in self.deltas)

    @property
    def bytes(self) -> int:
        return sum(d.bytes for d in self.deltas)

    @property
    def resync(self) -> bool:
        return any(d.resync for d in self.deltas)

    @property
    def generation_diff(self) -> bool:
        """A rank moved to a new generation by a generation diff (only the rows that differ,
        applied in place) rather than a full resync."""
        return any(d.generation_diff is not None for d in self.deltas)

    @property
    def rollback_to(self) -> int | None:
        """The step of the rollback this pull followed (the tables and dense state go back
        to ``step``, the newest published step at or before it); None: no rollback."""
        return next((d.rollback_to for d in self.deltas if d.rollback_to is not None), None)

    @property
    def rolled_back(self) -> bool:
        """Whether this pull took the predictor back to an earlier step (a rollback)."""
        return self.rollback_to is not None

    @property
    def resync_reasons(self) -> dict[int, str]:
        """Why each resynced rank resynced, as its sidecar said (e.g. "new generation: ...")."""
        return {d.rank: d.resync_reason for d in self.deltas if d.resync}

    @property
    def owed(self) -> int:
        """Rows still owed after this pull (top-k or ``max_rows``: sent by later pulls)."""
        return sum(s.owed for d in self.deltas for s in d.shards)

    @property
    def served_step(self) -> int | None:
        """The step the predictor serves once it applied this pull (= ``step``)."""
        return self.step

    @property
    def dense(self) -> dict[str, torch.Tensor]:
        """The dense state this pull carries (empty: none new)."""
        return next((d.dense for d in self.deltas if d.dense_step is not None), {})

    @property
    def dense_step(self) -> int | None:
        """The step of the dense state this pull carries (None: none new)."""
        return next((d.dense_step for d in self.deltas if d.dense_step is not None), None)

    @property
    def dense_bytes(self) -> int:
        return sum(d.dense_bytes for d in self.deltas)

    @property
    def upstream_lost(self) -> dict[int, str]:
        """Ranks served by a relay that has lost its upstream (unreachable for a while), with
        the reason: the relay's head may be behind the model's, so this pull cannot be
        caught up (the rows applied are right for what the relay holds)."""
        return {d.rank: d.upstream_lost for d in self.deltas if d.upstream_lost}

    @property
    def dense_missing(self) -> dict[int, str]:
        """Ranks whose sidecar (or relay) says this pull lacks the dense state it should
        bring, with the reason (asked with ``PullOptions.dense``). The rows applied are of
        ``step``; the dense weights held are older (or the model's init): not caught up."""
        return {d.rank: d.dense_missing for d in self.deltas if d.dense_missing}
