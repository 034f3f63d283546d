"""The canary evaluator: scores every step the trainer publishes before the fleet gets it,
and releases, holds or rolls back through the model's release state.

Two consumers of the model, two float copies of it:

* the **candidate**, consumer ``config.consumer``, in a canary group of its own (its exact
  name; added with ``rollout canary`` if no canary group matches it), follows the head,
  bounded by the validation gate as canaries are;
* the **release**, consumer ``config.consumer + ".release"`` (in no canary group), is capped
  at the release step like every predictor, so it holds exactly what the fleet serves.

For each new candidate step S past the release step R, both models score the golden set and
the newest held-out examples (progressive validation: never trained on), the same examples
for both; :func:`deltad.evaluate.verdict.decide` says pass or fail. On the golden set (fixed,
so NEs of different steps compare) the candidate's NE is held against the best of the recent
releases (``anchor_verdicts``), so a model that gets a little worse at every step cannot pass
step by step. The first verdict on a
step is recorded in Redis (SET NX, :class:`VerdictStore`): a replica that comes second
adopts it. Then, one replica at a time (a lock in Redis), through the ``Rollout`` RPC:

* **pass**: ``release --to-step S`` once S has survived ``release_delay_s`` of later verdicts
  and ``min_release_interval_s`` has passed since the last release (meanwhile S waits; a later
  failure drops it), then ``unpin`` the canary groups an earlier failure rolled back;
* **fail**: ``hold`` (the release step stays R) and ``rollback --group G --to-step R`` for
  every canary group G but the evaluators' own (their exact names) (the canaries that followed the head past R).

A model released to the head (no release step: at start, or an operator's ``release``) is
held at the head it has then: nothing is released unscored from then on, and if the
evaluator stops or lags, the fleet stays where it was. An operator overrides with the same
verbs (``release --to-step S`` is kept: later steps are judged against S).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltad.config import ConsumerConfig
from deltad.consume.appliers import TorchRecApplier
from deltad.consume.client import DeltaConsumer
from deltad.errors import ConfigError, DeltadError
from deltad.evaluate.control import RolloutClient
from deltad.evaluate.labelled import LabelledExample, newest_examples
from deltad.evaluate.metrics import Metric, default_metrics
from deltad.evaluate.record import VerdictStore
from deltad.evaluate.scoring import Scorer, score
from deltad.evaluate.verdict import FAIL, PASS, Thresholds, Verdict, decide
from deltad.serve import rollout as ro

log = logging.getLogger(__name__)


@dataclass
class EvalConfig:
    """How the evaluator judges and acts."""

    consumer: ConsumerConfig
    thresholds: Thresholds = field(default_factory=Thresholds)
    #: the newest held-out examples scored per step (0: the golden set alone)
    progressive_examples: int = 2048
    labelled_dir: Path | None = None
    min_release_interval_s: float = 0.0
    #: a passed step is released only once it has survived this many seconds of later
    #: verdicts (a failure meanwhile drops it): the first corrupt steps, whose harm is still
    #: below eps, then stay off the fleet (0: release at once)
    release_delay_s: float = 0.0
    #: the golden NE is compared with the best of the newest this many passed verdicts'
    #: (0: with the release step's alone; see CanaryEvaluator._anchor)
    anchor_verdicts: int = 20
    #: the longest wait for a new step before looking at the state again
    poll_s: float = 1.0
    #: an evaluator's heartbeat lives this long in Redis
    alive_ttl_s: float = 10.0
    #: stop after this many seconds (0: run until stopped)
    duration_s: float = 0.0

    @property
    def release_consumer(self) -> str:
        return f"{self.consumer.consumer}.release"


@dataclass
class Copy:
    """One consumer and the model it writes."""

    consumer: DeltaConsumer
    model: Any
    applier: TorchRecApplier
    step: int | None = None
    generation: int | None = None

    def sync(self) -> Any:
        r = self.consumer.sync(self.applier)
        if r.step is not None:
            self.step = r.step
            gens = {d.generation for d in r.deltas}
            if gens:
                self.generation = max(gens)
        return r


class CanaryEvaluator:
    """See the module docstring. ``make_model()`` builds one float model copy (e.g.
    :func:`deltad.evaluate.scoring.reference_model`); ``on_verdict`` is called with every
    verdict this evaluator reaches or adopts (metrics)."""

    def __init__(
        self,
        config: EvalConfig,
        *,
        make_model: Callable[[], Any],
        scorer: Scorer,
        golden: Sequence[LabelledExample],
        control: RolloutClient,
        store: VerdictStore,
        metrics: Sequence[Metric] | None = None,
        on_verdict: Callable[[Verdict], None] | None = None,
    ) -> None:
        self.config = config
        self.name = config.consumer.consumer
        self.model_name = config.consumer.model
        self.scorer, self.golden = scorer, list(golden)
        self.control, self.store = control, store
        self.metrics = list(metrics) if metrics is not None else default_metrics()
        self.on_verdict = on_verdict
        c = config.consumer
        rel = dataclasses.replace(c, consumer=config.release_consumer)
        m1, m2 = make_model(), make_model()
        self.candidate = Copy(DeltaConsumer(c), m1, TorchRecApplier(m1))
        self.release = Copy(DeltaConsumer(rel), m2, TorchRecApplier(m2))
        #: passed steps waiting for the release delay or the minimum interval: step -> when
        self.pending: dict[int, float] = {}
        self.last_judged: tuple[int, int] | None = None
        self.verdicts: list[Verdict] = []
        self.stop = threading.Event()

    # ---- setup ---------------------------------------------------------------------------

    def check_groups(self, state: ro.ReleaseState) -> list[str]:
        """The canary groups to add so the candidate follows the head (ConfigError if the
        names clash: the release copy in a canary group, the candidate in a group a failure
        rolls back)."""
        rel = self.config.release_consumer
        for g in state.canary:
            if ro.matches(g, rel):
                raise ConfigError(
                    f"the evaluator's release consumer {rel} matches canary group {g}: it "
                    "must stay at the release step; name the evaluator outside that group"
                )
            if g != self.name and ro.matches(g, self.name):
                raise ConfigError(
                    f"the evaluator's consumer {self.name} matches canary group {g}, which "
                    "it rolls back on a failure; name it outside the predictors' groups "
                    f"(e.g. eval-{self.model_name})"
                )
        return [] if self.name in state.canary else [self.name]

    def start(self) -> None:
        """Check the names, join the canary, hold a model released to the head, connect."""
        with self.store.lock() as ok:
            if not ok:
                raise DeltadError("another evaluator holds the action lock; try again")
            self.store.add_group(self.name)
            st = self.control.status()
            for g in self.check_groups(st.state):
                self.control.canary(g)
            if st.state.release_step is None and st.head_step >= 0:
                self.control.hold()  # nothing released unscored from now on
        self.candidate.consumer.connect()
        self.release.consumer.connect()

    def close(self) -> None:
        for c in (self.candidate, self.release):
            c.consumer.close()

    # ---- one round -----------------------------------------------------------------------

    def _release_copy_at(
        self, want: int, generation: int | None = None, deadline_s: float = 20.0
    ) -> bool:
        """Pull the release copy until it serves the release step ``want`` (bounded).

        A copy that holds the release state already (``want`` of the release's
        ``generation``) is there without a pull: after a trainer restart while held, the
        sidecars refuse it the new generation (it keeps what it holds) until a release
        names that generation, so a pull would only wait out the deadline."""
        if generation is not None and (self.release.generation, self.release.step) == (
            generation,
            want,
        ):
            return True
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and not self.stop.is_set():
            r = self.release.sync()
            if r.step is not None and r.step == want:
                return True
            if r.caught_up and r.step is not None and r.step <= want:
                # (a release step that was not published: its state is the step before)
                return r.step == (r.release_step if r.release_step is not None else r.step)
            self.release.consumer.wait_for_new(0.2, stop=self.stop)
        return False

    def judge(self, step: int, generation: int, published_unix: float) -> Verdict | None:
        """The verdict on ``step`` (recorded, or reached now and recorded); None when there
        is nothing to judge (the release step is at or past it) or the release copy cannot
        be had yet."""
        got = self.store.get(generation, step)
        if got is not None:
            return got
        st = self.control.status().state
        rel = st.release_step
        if rel is None:  # released to the head (no head at start, or an operator): hold it
            with self.store.lock() as ok:
                if ok and self.control.status().state.release_step is None:
                    self.control.hold()
            return None
        if step <= rel:
            return None
        if not self._release_copy_at(rel, st.release_generation):
            log.warning("evaluator: release copy not at step %d yet; step %d waits", rel, step)
            return None
        assert self.release.step is not None
        sets = []
        progressive: list[LabelledExample] = []
        if self.config.labelled_dir is not None and self.config.progressive_examples:
            progressive = newest_examples(
                self.config.labelled_dir, self.config.progressive_examples
            )
        for name, examples in (("golden", self.golden), ("progressive", progressive)):
            if not examples:
                continue
            with self.candidate.applier.reading(), self.release.applier.reading():
                pc = self.scorer.predict(self.candidate.model, examples)
                pr = self.scorer.predict(self.release.model, examples)
            sets.append(score(name, examples, pc, pr, self.metrics))
        self._anchor(sets, generation)
        verdict, reasons = decide(sets, self.metrics, self.config.thresholds)
        v = Verdict(
            model=self.model_name, generation=generation, step=step,
            release_step=self.release.step, verdict=verdict, reasons=reasons,
            sets=tuple(sets), published_unix=published_unix, decided_unix=time.time(),
            by=self.name,
        )  # fmt: skip
        recorded, mine = self.store.put_first(v)
        if not mine:
            log.info("evaluator: step %d: adopting %s's verdict", step, recorded.by)
        return recorded

    def _anchor(self, sets: list[Any], generation: int) -> None:
        """Compare the golden NE with the best of the recent releases, not the newest alone:
        a model that gets a little worse every step would pass each step against the one
        before (the golden set is fixed, so its NE of different steps compare). The
        release's own NE stays in ``ne_release``."""
        if not self.config.anchor_verdicts:
            return
        best = [
            s.candidate["ne"]
            for v in self.store.recent(self.config.anchor_verdicts)
            if v.passed and v.generation == generation
            for s in v.sets
            if s.name == "golden" and "ne" in s.candidate
        ]
        for s in sets:
            if s.name == "golden" and "ne" in s.release and best and min(best) < s.release["ne"]:
                s.release["ne_release"] = s.release["ne"]
                s.release["ne"] = min(best)

    def act(self, v: Verdict) -> None:
        """Release, or hold and roll back, as ``v`` says (one replica at a time)."""
        if v.verdict == PASS:
            self.pending.setdefault(v.step, time.monotonic())
            self.maybe_release()
            return
        self.pending.clear()
        with self.store.lock() as ok:
            if not ok:
                log.warning("evaluator: action lock not had; the failure of step %d", v.step)
                return
            st = self.control.status().state
            if not st.held or st.release_step is None:
                st = self.control.hold().state
            to = st.release_step
            assert to is not None
            mine = self.store.groups() | {self.name}
            for g in st.canary:
                if g in mine:  # (the evaluators' own: they must go on following the head)
                    continue
                if ro.Pin(g, to) in st.pins:
                    continue
                self.control.rollback(g, to)
                self.store.add_rolled_back(g)

    def maybe_release(self) -> None:
        """Release to the newest passed step that has waited the release delay, if the
        minimum interval since the last release has passed."""
        now = time.monotonic()
        ripe = [s for s, t in self.pending.items() if now - t >= self.config.release_delay_s]
        if not ripe:
            return
        wait = self.config.min_release_interval_s
        if wait and time.time() - self.store.released_unix() < wait:
            return
        with self.store.lock() as ok:
            if not ok:
                return
            st = self.control.status().state
            step = max(ripe)
            self.pending = {s: t for s, t in self.pending.items() if s > step}
            if st.release_step is not None and st.release_step >= step:
                return
            self.control.release(step)
            self.store.mark_released(time.time())
            pinned = {p.group for p in st.pins}
            for g in self.store.rolled_back():
                if g in pinned:
                    self.control.unpin(g)
                self.store.clear_rolled_back(g)

    def round(self) -> Verdict | None:
        """One pull of the candidate and, if it moved to a new step, its verdict, acted on."""
        self.store.heartbeat(
            self.name, self.config.alive_ttl_s,
            {"step": self.candidate.step, "release_step": self.release.step,
             "pid": os.getpid(), "unix": time.time()},
        )  # fmt: skip
        r = self.candidate.sync()
        v = None
        if r.step is not None and self.candidate.generation is not None:
            key = (self.candidate.generation, r.step)
            if key != self.last_judged:
                v = self.judge(r.step, self.candidate.generation, r.source_unix or 0.0)
                if v is not None or self._nothing_to_judge(r.step):
                    self.last_judged = key
                if v is not None:
                    log.warning("evaluator: %s", v.line())
                    self.verdicts.append(v)
                    if self.on_verdict is not None:
                        self.on_verdict(v)
                    self.act(v)
        self.maybe_release()
        return v

    def _nothing_to_judge(self, step: int) -> bool:
        rel = self.control.status().state.release_step
        return rel is not None and step <= rel

    def run(self) -> None:
        """Rounds until :attr:`stop` is set (or ``duration_s``): each waits for the next
        publish (a long poll) at most ``poll_s``."""
        end = time.monotonic() + self.config.duration_s if self.config.duration_s else None
        while not self.stop.is_set() and (end is None or time.monotonic() < end):
            try:
                self.round()
            except DeltadError as e:
                log.warning("evaluator: round failed (the fleet stays where it is): %s", e)
                self.stop.wait(self.config.poll_s)
                continue
            self.candidate.consumer.wait_for_new(self.config.poll_s, stop=self.stop)


__all__ = ["FAIL", "PASS", "CanaryEvaluator", "EvalConfig"]
