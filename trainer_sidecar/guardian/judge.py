"""The step judge: what to do with one training step, from its numbers and the recent history. Pure.

The guardian measures a step (the mean loss over ranks, the total gradient norm, whether any rank's
loss was non-finite) with one collective and one host sync, and hands the numbers to ``judge_step``. The
judge answers with a verdict: apply the update, skip it (saying why), roll back to the last clean
snapshot, or give up (diverge). It never touches a tensor, a file or a clock, so every rule is tested
without torch or a process group, and every rank, holding the same history and the same agreed numbers,
takes the same decision.

The rules, in order:

* A non-finite loss (on any rank) or a non-finite gradient norm is a bad step.
* With at least ``spike_history`` finite steps in the window, a loss above ``loss_spike_factor``
  times the window's mean loss is a bad step ("loss spike"), and likewise a gradient norm above
  ``grad_norm_spike_factor`` times the mean norm ("grad-norm spike").
* A non-finite gradient under an fp16 GradScaler whose scale is still at least 1 is the scaler's own
  business (it backs the scale off): the step is skipped but does not count towards a rollback.
* ``max_consecutive_bad_steps`` bad steps in a row roll back, unless ``max_rollbacks`` rollbacks already
  happened within the last ``rollback_window_steps`` iterations: then the job has diverged.
* A training state that is not finite where it is saved (a buffer, an optimizer moment: see
  ``judge_saved_state``) rolls back at once, or diverges under the same rollback budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from trainer_sidecar.contract.settings import GuardThresholds
from trainer_sidecar.guardian.explosion import classify_explosion

NON_FINITE_LOSS = "non-finite loss"
NON_FINITE_GRADIENTS = "non-finite gradients"
LOSS_SPIKE = "loss spike"
GRAD_NORM_SPIKE = "grad-norm spike"
NON_FINITE_STATE = "non-finite training state"


class Action(StrEnum):
    """What the guardian does with a step."""

    APPLY = "apply"  # clip and step the optimizer
    SKIP = "skip"  # drop the update (zero the gradients); training goes on
    ROLL_BACK = "roll-back"  # drop the update and restore the last clean snapshot
    DIVERGE = "diverge"  # give up: the worker exits with the "diverged" code


@dataclass(frozen=True)
class StepReading:
    """One step's agreed numbers (the same on every rank).

    ``loss`` is the mean loss over ranks; ``loss_nonfinite`` whether any rank's loss was non-finite
    (a NaN on one rank makes the mean NaN too, but an inf on one rank and a -inf on another would not);
    ``grad_norm`` the total gradient norm before clipping; ``scaler_overflow_benign`` whether an fp16
    GradScaler with a scale of at least 1 is in use, so that a non-finite gradient is an overflow the
    scaler handles by itself.
    """

    loss: float
    grad_norm: float
    loss_nonfinite: bool = False
    scaler_overflow_benign: bool = False


@dataclass(frozen=True)
class StepHistory:
    """What the judge remembers between steps.

    ``losses`` and ``grad_norms`` are the finite values of the last kept steps, oldest first, at most
    ``loss_spike_window`` long; ``consecutive_bad`` counts bad steps in a row (benign overflows
    excluded); ``rollback_iterations`` holds the iteration of each past rollback; ``iteration`` counts
    every step boundary ever judged (it never goes back, unlike the step, which a rollback reverts).
    """

    losses: tuple[float, ...] = ()
    grad_norms: tuple[float, ...] = ()
    consecutive_bad: int = 0
    rollback_iterations: tuple[int, ...] = ()
    iteration: int = 0


@dataclass(frozen=True)
class Verdict:
    """The judge's answer for one step, and the history after it.

    ``cause`` is what was wrong with the step (a ``NON_FINITE_*`` or ``*_SPIKE`` constant; empty for
    APPLY) and ``reason`` the text for people (for DIVERGE it also says how many rollbacks were spent);
    ``counts_as_bad`` is False only for a benign scaler overflow;
    ``spike`` tells a spike from a non-finite step; ``pattern`` names the loss explosion's shape when one
    is recognised (see ``trainer_sidecar.guardian.explosion``). ``history`` is the history to keep: for a
    ROLL_BACK, the rollback is already recorded in it (the restored snapshot's windows replace its
    ``losses`` and ``grad_norms`` afterwards: ``StepHistory`` with ``replace``).
    """

    action: Action
    history: StepHistory
    cause: str = ""
    reason: str = ""
    counts_as_bad: bool = False
    spike: bool = False
    pattern: str | None = None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def classify_step(thresholds: GuardThresholds, history: StepHistory, reading: StepReading) -> str:
    """Why the step is bad ("" when it is good). Non-finite values first, then spikes."""
    if reading.loss_nonfinite or not math.isfinite(reading.loss):
        return NON_FINITE_LOSS
    if not math.isfinite(reading.grad_norm):
        return NON_FINITE_GRADIENTS
    enough = thresholds.spike_history
    if len(history.losses) >= enough and reading.loss > thresholds.loss_spike_factor * _mean(history.losses):
        return LOSS_SPIKE
    if len(history.grad_norms) >= enough and reading.grad_norm > thresholds.grad_norm_spike_factor * _mean(
        history.grad_norms
    ):
        return GRAD_NORM_SPIKE
    return ""


def _window(values: tuple[float, ...], value: float, size: int) -> tuple[float, ...]:
    kept = (*values, value)
    return kept[-size:] if len(kept) > size else kept


def rollbacks_in_window(thresholds: GuardThresholds, history: StepHistory) -> int:
    """Past rollbacks within ``rollback_window_steps`` iterations of the history's current iteration."""
    start = history.iteration - thresholds.rollback_window_steps
    return sum(1 for i in history.rollback_iterations if i > start)


def _roll_back_or_diverge(
    thresholds: GuardThresholds, history: StepHistory, reason: str
) -> tuple[Action, str]:
    recent = rollbacks_in_window(thresholds, history)
    if recent >= thresholds.max_rollbacks:
        return Action.DIVERGE, (
            f"{recent} rollbacks within {thresholds.rollback_window_steps} steps and still {reason}"
        )
    return Action.ROLL_BACK, reason


def judge_step(thresholds: GuardThresholds, history: StepHistory, reading: StepReading) -> Verdict:
    """The verdict on one step boundary (see the module docstring for the rules)."""
    reason = classify_step(thresholds, history, reading)
    iteration = history.iteration + 1
    if not reason:
        window = thresholds.loss_spike_window
        kept = StepHistory(
            losses=_window(history.losses, reading.loss, window),
            grad_norms=_window(history.grad_norms, reading.grad_norm, window),
            consecutive_bad=0,
            rollback_iterations=history.rollback_iterations,
            iteration=iteration,
        )
        return Verdict(Action.APPLY, kept)
    benign = reason == NON_FINITE_GRADIENTS and reading.scaler_overflow_benign
    bad_in_a_row = history.consecutive_bad + (0 if benign else 1)
    after = replace(history, consecutive_bad=bad_in_a_row, iteration=iteration)
    pattern = classify_explosion([*history.losses, reading.loss], thresholds.loss_spike_factor)
    verdict = Verdict(
        Action.SKIP,
        after,
        cause=reason,
        reason=reason,
        counts_as_bad=not benign,
        spike=reason in (LOSS_SPIKE, GRAD_NORM_SPIKE),
        pattern=pattern.value if pattern else None,
    )
    if bad_in_a_row < thresholds.max_consecutive_bad_steps:
        return verdict
    return _escalate(thresholds, verdict)


def judge_saved_state(thresholds: GuardThresholds, history: StepHistory, state_finite: bool) -> Verdict:
    """The verdict on the whole training state just before it is saved (a snapshot or a checkpoint).

    A finite state is applied as it is. A state that holds a NaN or an Inf anywhere (a parameter, a
    buffer such as BatchNorm's running mean, an optimizer moment, the scaler) can never be saved as
    clean: it rolls back at once to the last clean snapshot, or diverges when the rollback budget is
    spent. The step itself is not counted again.
    """
    if state_finite:
        return Verdict(Action.APPLY, history)
    verdict = Verdict(
        Action.SKIP, history, cause=NON_FINITE_STATE, reason=NON_FINITE_STATE, counts_as_bad=True
    )
    return _escalate(thresholds, verdict)


def _escalate(thresholds: GuardThresholds, verdict: Verdict) -> Verdict:
    action, reason = _roll_back_or_diverge(thresholds, verdict.history, verdict.cause)
    history = verdict.history
    if action is Action.ROLL_BACK:
        # Rollbacks older than the window never count again: the history stays bounded.
        start = history.iteration - thresholds.rollback_window_steps
        recent = tuple(i for i in history.rollback_iterations if i > start)
        history = replace(history, consecutive_bad=0, rollback_iterations=(*recent, history.iteration))
    return replace(verdict, action=action, reason=reason, history=history)
