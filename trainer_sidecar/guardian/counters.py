"""The guardian's counters: one model, serialised in one place for checkpoints, snapshots and the status.

Some counters describe the model's progress and go back with it on a rollback (the step, the optimizer
steps, the loss and gradient-norm windows); the others describe the job and never go back (iterations,
skipped steps, spikes, rollbacks, the remediation applied, the pace the hang deadline learned).
``GuardCounters.rewind_to`` is where that difference is written down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer_sidecar.contract.hang import ProgressGaps
from trainer_sidecar.contract.settings import describe_validation_error
from trainer_sidecar.guardian.judge import StepHistory

_NonNegative = Field(ge=0)


class CountersError(ValueError):
    """Saved counters are not valid (a checkpoint from elsewhere, or damaged); names the field."""


class _SavedCounters(BaseModel):
    """The wire form of ``GuardCounters`` inside a checkpoint: strict, because a checkpoint is input."""

    model_config = ConfigDict(extra="forbid", strict=True)

    step: int = _NonNegative
    iterations: int = _NonNegative
    optimizer_steps: int = _NonNegative
    skipped_steps: int = _NonNegative
    spikes: int = _NonNegative
    rollbacks: int = _NonNegative
    rollback_iterations: list[int] = Field(max_length=100_000)
    consecutive_bad: int = _NonNegative
    lr_scale: float = Field(gt=0, le=1, allow_inf_nan=False)
    # None: no clipping (checkpoints written before clipping became opt-in always hold a norm).
    max_grad_norm: float | None = Field(gt=0, allow_inf_nan=False)
    losses: list[float] = Field(max_length=1_000_000)
    grad_norms: list[float] = Field(max_length=1_000_000)
    remediations_applied: list[str] = Field(max_length=10_000)
    # Absent from checkpoints written before the pace was saved: nothing learned.
    progress_gaps: int = Field(default=0, ge=0)
    longest_progress_gap_seconds: float = Field(default=0.0, ge=0, allow_inf_nan=False)


@dataclass
class GuardCounters:
    """Everything the guardian counts, cumulative over the job (restored on resume).

    ``step`` counts the steps kept in the model (a rollback reverts it); ``history.iteration`` counts
    every step boundary ever attempted; ``optimizer_steps`` the updates applied (reverts with the model).
    """

    #: The clipping norm in force; None: gradients are not clipped.
    max_grad_norm: float | None
    step: int = 0
    optimizer_steps: int = 0
    skipped_steps: int = 0
    spikes: int = 0
    rollbacks: int = 0
    lr_scale: float = 1.0
    remediations_applied: list[str] = field(default_factory=list)
    history: StepHistory = field(default_factory=StepHistory)
    explosion_pattern: str | None = None
    #: The job's pace as the status reporter learned it (``contract.hang``), as of the last save; a
    #: resumed run starts its hang deadline from it.
    pace: ProgressGaps = field(default_factory=ProgressGaps)

    @property
    def iterations(self) -> int:
        """Every step boundary ever judged (never reverts)."""
        return self.history.iteration

    @property
    def last_loss(self) -> float | None:
        """The loss of the newest kept step (None before any)."""
        return self.history.losses[-1] if self.history.losses else None

    def to_state(self) -> dict[str, Any]:
        """The counters as plain values, for a checkpoint or a snapshot."""
        history = self.history
        return _SavedCounters(
            step=self.step,
            iterations=history.iteration,
            optimizer_steps=self.optimizer_steps,
            skipped_steps=self.skipped_steps,
            spikes=self.spikes,
            rollbacks=self.rollbacks,
            rollback_iterations=list(history.rollback_iterations),
            consecutive_bad=history.consecutive_bad,
            lr_scale=self.lr_scale,
            max_grad_norm=self.max_grad_norm,
            losses=list(history.losses),
            grad_norms=list(history.grad_norms),
            remediations_applied=list(self.remediations_applied),
            **_saved_pace(self.pace),
        ).model_dump()

    @classmethod
    def from_state(cls, state: Any, window: int) -> GuardCounters:
        """Counters saved by ``to_state``; the windows are cut to ``window`` values.

        Raises CountersError naming the field when ``state`` is not a valid saved form.
        """
        try:
            saved = _SavedCounters.model_validate(state)
        except ValidationError as exc:
            raise CountersError(describe_validation_error(exc, "guardian counters")) from exc
        if not all(math.isfinite(x) for x in (*saved.losses, *saved.grad_norms)):
            raise CountersError("guardian counters: losses and grad_norms must be finite")
        history = StepHistory(
            losses=tuple(saved.losses[-window:]),
            grad_norms=tuple(saved.grad_norms[-window:]),
            consecutive_bad=saved.consecutive_bad,
            rollback_iterations=tuple(saved.rollback_iterations),
            iteration=saved.iterations,
        )
        return cls(
            max_grad_norm=saved.max_grad_norm,
            step=saved.step,
            optimizer_steps=saved.optimizer_steps,
            skipped_steps=saved.skipped_steps,
            spikes=saved.spikes,
            rollbacks=saved.rollbacks,
            lr_scale=saved.lr_scale,
            remediations_applied=list(saved.remediations_applied),
            history=history,
            pace=ProgressGaps(saved.progress_gaps, saved.longest_progress_gap_seconds),
        )

    def rewind_to(self, saved: GuardCounters) -> None:
        """Go back to a snapshot's progress: its step, optimizer steps and windows. The job's counters
        (iterations, skipped steps, spikes, rollbacks, remediation) stay as they are."""
        self.step = saved.step
        self.optimizer_steps = saved.optimizer_steps
        self.history = replace(self.history, losses=saved.history.losses, grad_norms=saved.history.grad_norms)

    def tighten_clip(self, limit: float | None) -> None:
        """Clip to at most ``limit`` from now on (None: unchanged); a loop not clipped until now is clipped
        to ``limit``."""
        self.max_grad_norm = clip_within(self.max_grad_norm, limit)

    def adopt(self, restored: GuardCounters) -> None:
        """Become ``restored`` (a checkpoint's counters) in place: every holder of this object sees them."""
        for name in (f.name for f in fields(self)):
            setattr(self, name, getattr(restored, name))

    def copy(self) -> GuardCounters:
        """An independent copy (the history is immutable; the list is copied)."""
        return replace(self, remediations_applied=list(self.remediations_applied))


def _saved_pace(pace: ProgressGaps) -> dict[str, Any]:
    """The pace's saved fields; a longest gap that is no finite duration (an unbounded one: the deadline
    is the ceiling anyway) is saved as nothing learned."""
    if not (math.isfinite(pace.longest) and pace.longest >= 0 and pace.count >= 0):
        return {}
    return {"progress_gaps": pace.count, "longest_progress_gap_seconds": pace.longest}


def clip_within(current: float | None, limit: float | None) -> float | None:
    """The clipping norm ``current`` (None: no clipping) tightened to at most ``limit`` (None: no limit)."""
    if limit is None:
        return current
    return limit if current is None else min(current, limit)


def describe_clip(max_grad_norm: float | None) -> str:
    """The clipping in force, for a log line: ``max grad norm 0.5`` or ``no gradient clipping``."""
    return "no gradient clipping" if max_grad_norm is None else f"max grad norm {max_grad_norm:.4g}"
