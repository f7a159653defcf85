"""What a reconcile step takes from the gang it observes into the job's status: its progress (step,
counters, checkpoint, cadence, the step history), the dropped-sample ratio, the end of a recovery, and the
straggler scores, each with the Events it posts. Mixed into ``reconcile._Step``, whose status draft,
previous status and clock they read (``_Tracked``)."""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from trainguard_operator.goodput import record_progress
from trainguard_operator.pods import GangReading
from trainguard_operator.status import (
    ConditionType,
    JobStatus,
    StepRecord,
    checkpoint_status,
    clip,
    parse_time,
)

from trainguard.core.observation import GangView
from trainguard.core.policy import StragglerObservation
from trainguard.core.spec import GuardedTrainingJob, StragglerStatus

#: Ranks scored in the status (and the metric) at most: beyond, the status would grow with the world.
MAX_SCORED_RANKS = 256


def rounded(value: float | None, digits: int) -> float | None:
    """``value`` rounded to ``digits`` (None stays None)."""
    return round(value, digits) if value is not None else None


class _Tracked(Protocol):
    """What the trackers read and write of the step they are mixed into."""

    @property
    def st(self) -> JobStatus: ...
    @property
    def old(self) -> JobStatus: ...
    @property
    def now(self) -> datetime: ...
    @property
    def attempt(self) -> int: ...
    @property
    def job(self) -> GuardedTrainingJob: ...
    def event(self, type_: str, reason: str, message: str) -> None: ...
    def condition(self, type_: str, status: bool | None, reason: str, message: str = "") -> None: ...
    def track_drop_rate(self, rate: float) -> None: ...
    def track_recovery(self, view: GangView, previous: StepRecord | None) -> float | None: ...


class Trackers:
    """The trackers of a reconcile step (see the module docstring)."""

    def track_progress(self: _Tracked, view: GangView) -> float | None:
        """Take the gang's reported progress into the status; the recovery's duration when this step
        ends one (the new attempt stepped), else None."""
        st = self.st
        if view.rollbacks is not None and view.rollbacks > (self.old.rollbacks or 0):
            new = view.rollbacks - (self.old.rollbacks or 0)
            at = f" at step {view.progress.step}" if view.progress is not None else ""
            self.event(
                "Warning",
                "RollbackSeen",
                f"the guardian rolled back to its last clean snapshot {new} time(s) "
                f"(total {view.rollbacks}){at}",
            )
        st.take_reported(view.reported)
        if view.checkpoint is not None:
            st.last_clean_checkpoint = checkpoint_status(view.checkpoint.as_dict())
        if view.hang_timeout_seconds is not None:
            st.hang_timeout_seconds = round(view.hang_timeout_seconds, 3)
        if view.drop_rate is not None:
            self.track_drop_rate(view.drop_rate)
        if not view.stepped or view.progress is None or view.progress.step < 0:
            return None
        previous = st.step_history[-1] if st.step_history else None
        resumed = view.resumed_step
        st.step_history, st.step_history_folded = record_progress(
            st.step_history or [],
            st.step_history_folded,
            attempt=self.attempt,
            started_at=st.attempt_started_at,
            resumed_step=resumed if resumed is not None and resumed >= 0 else None,
            step=view.progress.step,
            now=self.now,
        )
        return self.track_recovery(view, previous)

    def track_drop_rate(self: _Tracked, rate: float) -> None:
        limit = self.job.spec.data_quality.max_drop_rate
        high = rate > limit
        message = f"dropped-sample ratio {rate:.3g} (limit {limit:g})"
        if high and not self.old.is_true(ConditionType.DROP_RATE_HIGH):
            self.event("Warning", "DropRateHigh", message)
        self.condition(
            ConditionType.DROP_RATE_HIGH, high, "AboveMaxDropRate" if high else "WithinMaxDropRate", message
        )

    def track_recovery(self: _Tracked, view: GangView, previous: StepRecord | None) -> float | None:
        """End the recovery in progress, if any, now that the gang steps again: the Recovered event says
        where the new attempt resumed and what of the failed attempt it redid."""
        since = parse_time(self.st.recovering_since)
        if since is None or view.progress is None:
            return None
        self.st.recovering_since = None
        seconds = max(0.0, (self.now - since).total_seconds())
        resumed = ""
        if view.resumed_step is not None:
            resumed = f", resumed from step {view.resumed_step}"
            if previous is not None and previous.attempt != self.attempt:
                redone = max(0, previous.last_step - view.resumed_step)
                resumed += (
                    f" (attempt {previous.attempt} was last seen at step {previous.last_step}: "
                    f"{redone} step(s) redone)"
                )
        self.event(
            "Normal",
            "Recovered",
            f"attempt {self.attempt} is training again at step {view.progress.step}{resumed}, "
            f"{seconds:.0f} s after the failure",
        )
        return seconds

    def track_straggler(self: _Tracked, gang: GangReading) -> StragglerObservation | None:
        """Score the ranks (``GangView.straggler``, as ``trainguard run`` does), keep the scores and the
        straggler in the status, and post an Event when a straggler is named or no longer is."""
        threshold = self.job.spec.health.straggler.threshold
        view = gang.view
        scores = {s.rank: s.score for s in view.straggler_scores(threshold)}
        replicas = self.job.spec.replicas
        self.st.straggler_scores = (
            [rounded(scores.get(r), 3) for r in range(replicas)]
            if scores and replicas <= MAX_SCORED_RANKS
            else None
        )
        found = view.straggler(threshold, {r.rank: r.place for r in gang.ranks})
        before = self.old.straggler
        if found is None and not scores:
            return None  # a gang not scored now (starting, ending): the last straggler seen stays
        if found is None:
            self.st.straggler = None
            if before is not None:
                self.event("Normal", "StragglerCleared", f"rank {before.rank} is no straggler any more")
            return None
        pod, node = gang.pods.get(found.rank, ("", ""))
        message = f"rank {found.rank} ({found.place or 'not placed'}) is a straggler: {found.reason}"
        self.st.straggler = StragglerStatus(
            rank=found.rank,
            score=round(found.score, 3),
            own_score=rounded(found.own_score, 3),
            pod=pod,
            node=node,
            step=view.last_step,
            message=clip(message),
        )
        if before is None or before.rank != found.rank or before.node != node:
            action = self.job.spec.health.straggler.action
            self.event("Warning", "StragglerDetected", f"{message} (action: {action})")
        return found
