"""The worker's status as the guardian publishes it, read from its collaborators.

``StatusView.status`` gathers one ``WorkerStatus`` (``contract.status``) from the counters, the data
feed, the busy sections, the lifecycle, the activity, the compute window, the progress clock, the
checkpoint manager, the step pipeline and the start; the status reporter (``guardian.reporting``)
publishes it. Reading it changes nothing.

Built by the Guardian with what it reads, called only by it.
"""

from __future__ import annotations

import math
import os

from trainer_sidecar.contract.compute import ComputeWindow
from trainer_sidecar.contract.status import WorkerStatus
from trainer_sidecar.guardian.activity import ActivityTracker
from trainer_sidecar.guardian.busy import BusySections
from trainer_sidecar.guardian.checkpointing import CheckpointManager
from trainer_sidecar.guardian.config import GuardianConfig
from trainer_sidecar.guardian.counters import GuardCounters
from trainer_sidecar.guardian.ending import Lifecycle
from trainer_sidecar.guardian.feed import DataFeed
from trainer_sidecar.guardian.gang import Gang
from trainer_sidecar.guardian.pipeline import StepPipeline
from trainer_sidecar.guardian.progress import ProgressClock
from trainer_sidecar.guardian.starting import Start
from trainer_sidecar.guardian.watch import ActivityWatch

__all__ = ["StatusView"]


def _json_float(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class StatusView:
    """One worker's status, read on demand (``status``); ``started_at``: when its guardian was made."""

    def __init__(
        self,
        config: GuardianConfig,
        gang: Gang,
        counters: GuardCounters,
        feed: DataFeed,
        checkpoints: CheckpointManager,
        status: tuple[Lifecycle, BusySections, ActivityWatch, ActivityTracker, ComputeWindow, ProgressClock],
        steps: tuple[StepPipeline, Start],
        started_at: float,
    ) -> None:
        self.config, self.gang, self.counters = config, gang, counters
        self.feed, self.checkpoints = feed, checkpoints
        self._life, self._busy, self._watch, self._activity, self._compute, self._progress = status
        self._pipeline, self._start = steps
        self.started_at = started_at

    def status(self) -> WorkerStatus:
        """The worker's current status, as published to the sidecar."""
        data = self.feed.loader.counters if self.feed.loader is not None else None
        counters = self.counters
        busy = self._busy.view(self._life.phase, self._life.busy_since, self._watch.progress())
        activity, activity_since = self._activity.current
        compute, best_compute = self._compute.reading()
        return WorkerStatus(
            rank=self.gang.rank,
            world_size=self.gang.world_size,
            pid=os.getpid(),
            phase=busy.phase,
            started_at=self.started_at,
            step=counters.step,
            resumed_step=self._start.resumed_step,
            last_step_time=self._progress.last,
            busy_since=busy.since,
            busy_reason=busy.reason,
            busy_seconds=busy.seconds,
            busy_sections=list(busy.sections),
            local_rank=self.config.local_rank,
            local_world_size=self.config.local_world_size,
            loss=_json_float(counters.last_loss),
            grad_norm=_json_float(self._pipeline.last_grad_norm),
            lr_scale=counters.lr_scale,
            max_grad_norm=counters.max_grad_norm,
            steps_total=counters.iterations,
            skipped_steps=counters.skipped_steps,
            consecutive_bad_steps=counters.history.consecutive_bad,
            rollbacks=counters.rollbacks,
            spikes=counters.spikes,
            samples_seen=data.seen if data else 0,
            samples_dropped=data.dropped if data else 0,
            explosion_pattern=counters.explosion_pattern,
            last_clean_checkpoint=self.checkpoints.last_clean,
            message=self._life.message,
            exit_code=self._life.exit_code,
            checkpoint_seconds=self.checkpoints.last_write_seconds,
            max_steps=self.checkpoints.last_step,
            checkpoint_every_steps=self.checkpoints.interval,
            checkpoint_cadence=self.checkpoints.cadence,
            checkpoint_stall_seconds=self.checkpoints.stall_seconds or None,
            checkpoint_write_since=self.checkpoints.writing_since,
            activity=activity,
            activity_since=activity_since,
            compute_seconds=compute,
            best_compute_seconds=best_compute,
        )
