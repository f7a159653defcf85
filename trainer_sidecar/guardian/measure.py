"""The step pipeline's measurement: the gradients' norms and the numbers every rank agrees on.

After each backward the gradients are marked (``StepMeasure.after_backward``), so that a loop changing
them before the step (its own clip) is noticed; at the boundary ``measure`` unscales, takes the fused
total norm, packs the step's values (``guardian.agreement``), runs the step's one collective in a gang and
reads everything back with one host sync. What to do with the numbers is the judge's (``guardian.judge``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer_sidecar.contract.status import Activity
from trainer_sidecar.guardian import agreement
from trainer_sidecar.guardian.agreement import StepValues
from trainer_sidecar.guardian.checkpointing import CheckpointManager
from trainer_sidecar.guardian.faults import FaultInjector
from trainer_sidecar.guardian.gang import Gang
from trainer_sidecar.guardian.judge import StepReading
from trainer_sidecar.guardian.training import TrainingObjects

log = logging.getLogger("trainguard")

__all__ = ["Agreed", "StepMeasure"]


@dataclass(frozen=True)
class Agreed:
    """A step's numbers as agreed by every rank, and what this rank alone saw."""

    reading: StepReading
    locally_nonfinite: bool
    stop: bool
    checkpoint_due: bool
    #: The total norm of the gradients as they are now (after a clip of the loop's own): what the
    #: guardian's clipping works from. ``reading.grad_norm`` is the one the backward pass produced.
    current_norm: float
    #: Whether any rank's last forward pass did not keep the random generators (see the checkpoint
    #: manager's ``_rng_wanted``).
    rng_missing: bool = False
    #: The checkpoint interval rank 0 chose (``everySteps: auto``; 0: none), the same on every rank.
    interval: int = 0


class StepMeasure:
    """The step pipeline's measurement: what a backward leaves, and at the boundary the step's numbers,
    agreed by every rank with one collective and one host sync (``measure``).

    Holds the step's local gradients and their total norm on the device (``grads``, ``norm``) for the
    update to clip with, without a host sync of its own."""

    def __init__(
        self,
        training: TrainingObjects,
        checkpoints: CheckpointManager,
        faults: FaultInjector,
        mark: Callable[[Activity], Activity],
        gang: Gang,
    ) -> None:
        self._training, self._checkpoints, self._faults = training, checkpoints, faults
        self.gang = gang
        self._mark = mark
        self.grads: list[torch.Tensor] = []  # this rank's local gradients of the step being measured
        self.norm = torch.zeros(())  # the step's total norm on the device, for clipping without a sync
        # The gradients as the last backward left them (each with its version counter), to notice a loop
        # that changes them before the step (its own clip_grad_norm_ or unscale_), and their norm then,
        # measured while the loop is known (or not yet known not) to do that: see ``_pre_clip_norm``.
        self._grad_marks: list[tuple[torch.Tensor, int]] = []
        self._norm_at_backward: torch.Tensor | None = None
        self.measure_at_backward = True

    def measure(self, step_loss: torch.Tensor, step: int, stop: bool) -> Agreed:
        """Unscale, the fused total norm, one collective and one host sync: the step's agreed numbers,
        whether this rank's own loss was non-finite, and whether any rank was told to stop (``stop``:
        this one was). ``step`` is the number of the step being measured.

        Alone, the norm is this process's. In a gang each rank contributes the squared norm of its local
        gradients, each value counted once over the world (``TrainingObjects.norm_contribution``: a DDP
        replica's share is 1/world size, an FSDP shard's 1/its replicas), the collective sums them and the
        norm is the square root: the true global norm over shards, NaN on every rank when any shard holds
        a NaN, and still one small collective."""
        # Before anything of the guardian's own changes the gradients.
        pre_clip = self._pre_clip_norm(step)
        if self._faults.active:
            self._faults.grad_hook(self._training.params, step)
        self._training.unscale()
        self.grads = self._training.local_grads()
        gang, distributed = self.gang, self.gang.distributed
        # The clipping multiply waits for the host sync below and is skipped when the norm is already
        # within bounds (or the step is skipped anyway).
        norm_part = self._norm_part(self.grads, gang)
        if not distributed:
            self.norm = norm_part
        pre_part = norm_part if pre_clip is None else pre_clip
        local = agreement.pack(
            step_loss,
            norm_part,
            pre_part,
            stop=stop,
            time_due=self._checkpoints.time_due(),
            rng_missing=not self._checkpoints.rng_captured,
            interval=self._checkpoints.proposal(),  # exact: a sum of one integer and zeros
        )
        if distributed:
            # Marked before the collective and until its host sync (where NCCL's wait is): a rank that
            # waits here for a peer says so (``trainer_sidecar.guardian.activity``).
            self._mark(Activity.COLLECTIVE)
            reduced = gang.all_reduce(local)
            self.norm = reduced[StepValues.index("norm")].sqrt()
            # One host sync for both the agreed values and this rank's own loss flag.
            values, locally_nonfinite = agreement.read_reduced(reduced, local)
            self._mark(Activity.STEP)
            squares, pre_squares = values.norm, values.pre_clip_norm
            loss_v = values.loss / gang.world_size
            norm_v = math.sqrt(squares) if not squares < 0 else math.nan
            pre_v = math.sqrt(pre_squares) if not pre_squares < 0 else math.nan
        else:
            values, locally_nonfinite = agreement.read_local(local)  # one host sync
            loss_v, norm_v, pre_v = values.loss, values.norm, values.pre_clip_norm
        # The larger of the norm the backward produced and the one about to be applied (NaN if either is).
        judged = math.nan if math.isnan(pre_v) or math.isnan(norm_v) else max(pre_v, norm_v)
        reading = StepReading(loss_v, judged, values.nonfinite > 0, self._benign_overflow(judged))
        return Agreed(
            reading,
            locally_nonfinite,
            values.stop > 0,
            values.time_due > 0,
            norm_v,
            values.rng_missing > 0,
            round(values.interval),
        )

    def _norm_part(self, grads: list[torch.Tensor], gang: Gang) -> torch.Tensor:
        """This rank's part of the total norm of ``grads`` (this rank's local gradients): the norm alone,
        the share of the squared global norm in a gang (``TrainingObjects.norm_contribution``)."""
        if gang.distributed:
            return self._training.norm_contribution(gang.world_size)
        return torch.nn.utils.get_total_norm(grads, foreach=True)

    def after_backward(self) -> None:
        """After a backward: remember the gradients (and their version counters), and while the loop is
        known to change them before the step, measure their norm now, unscaled (no host sync). Costs one
        norm per micro-batch only in a loop that clips (or unscales) the gradients itself."""
        gang, grads = self.gang, self._training.local_grads()
        self._grad_marks = [(g, g._version) for g in grads]
        if not self.measure_at_backward:
            self._norm_at_backward = None
            return
        part = self._norm_part(grads, gang).double()
        scale = self._training.loss_scale()
        if scale is not None:
            scale = scale.double().to(part.device)
            part = part / (scale.square() if gang.distributed else scale)
        self._norm_at_backward = part

    def _grads_changed(self) -> bool:
        """Whether the loop changed the gradients (in place, or replaced them) since the last backward."""
        grads = self._training.local_grads()
        marks = self._grad_marks
        return len(grads) != len(marks) or any(
            g is not marked or g._version != version
            for g, (marked, version) in zip(grads, marks, strict=True)
        )

    def _pre_clip_norm(self, step: int) -> torch.Tensor | None:
        """The norm part of the gradients as the backward left them, when the loop has changed them since
        (its own clip would otherwise blind the spike check: a x100 gradient clipped to 1 reads as 1);
        None when it has not (the norm measured now is the same). Learns whether to measure at backward:
        from the first step on only a loop seen changing its gradients pays for it."""
        changed = self._grads_changed()
        self._grad_marks = []  # holding them would keep this step's gradients alive into the next
        measured, self._norm_at_backward = self._norm_at_backward, None
        if changed and measured is None:
            log.log(
                logging.WARNING if self.gang.rank == 0 else logging.DEBUG,
                "step %d: the training loop changed the gradients between guardian.backward() and "
                "guardian.step() (its own clip_grad_norm_?); their norm is measured after each backward "
                "from now on, so that the spike check sees the norm before the loop's clip",
                step,
            )
        self.measure_at_backward = changed
        return measured if changed else None

    def _benign_overflow(self, norm: float) -> bool:
        """fp16 overflow is the scaler's business (it backs off); it is only a real anomaly once the scale
        is below 1, where a non-finite gradient cannot be blamed on the scale. (Asked only for a
        non-finite norm: reading the scale is a host sync.)"""
        scaler = self._training.scaler
        if math.isfinite(norm) or scaler is None or not scaler.is_enabled():
            return False
        return scaler.get_scale() >= 1.0
