"""The Guardian: a training step that cannot be poisoned and checkpoints that cannot be lost.

Adopting it in a plain PyTorch loop::

    guardian = Guardian(model, optimizer, scheduler=scheduler, checkpoint_dir="ckpt")
    loader = guardian.loader(dataset, batch_size=32)
    for batch in guardian.run(loader, max_steps=10_000):
        loss = compute_loss(model, batch)
        guardian.step(loss)          # replaces backward(), optimizer.step(), scheduler.step(), zero_grad()

Every step: backward (always, on every rank: skipping it alone would deadlock DDP's all-reduce), unscale,
one fused total-norm reduction that also clips, one tiny all-reduce of (loss, non-finite flag, norm)
under DDP so every rank takes the same decision, and one host sync to read those three numbers.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from pydantic import ValidationError
from torch.nn.parallel import DistributedDataParallel

from trainer_sidecar.checkpoint import CheckpointError, CheckpointStore
from trainer_sidecar.data import DEAD_LETTER_NAME, DeadLetters, GuardedLoader, SizedDataset
from trainer_sidecar.exitcodes import ExitCode
from trainer_sidecar.explosion import classify_explosion
from trainer_sidecar.faults import FaultInjector, FaultKind, FaultSpecError
from trainer_sidecar.localize import NaNLocator
from trainer_sidecar.settings import (
    GuardianSettings,
    Remediation,
    SettingsError,
    describe_validation_error,
    load_settings,
)
from trainer_sidecar.snapshot import Snapshot
from trainer_sidecar.status import (
    STATUS_FILE_ENV,
    TERMINATION_MESSAGE_ENV,
    Phase,
    StatusPublisher,
    WorkerStatus,
    write_termination_message,
)

log = logging.getLogger("trainguard")

CHECKPOINT_DIR_ENV = "TRAINGUARD_CHECKPOINT_DIR"
REMEDIATION_ENV = "TRAINGUARD_REMEDIATION"
FORENSICS_DIR = "forensics"
FORENSICS_KEEP = 20


class ConfigError(SystemExit):
    """A setting, file or directory makes the job unable to start; exits with ExitCode.CONFIG_ERROR.

    It is a SystemExit so that an unhandled one ends the worker with the documented permanent code;
    the message is printed to stderr when raised.
    """

    def __init__(self, message: str) -> None:
        super().__init__(ExitCode.CONFIG_ERROR)
        self.message = message
        print(f"trainguard: {message}", file=sys.stderr, flush=True)

    def __str__(self) -> str:
        return self.message


class Diverged(SystemExit):
    """Raised by ``Guardian.step`` when rollbacks are exhausted; exits with ExitCode.DIVERGED.

    In a process group of more than one rank the process exits with that code at once instead (after
    closing the checkpoints and writing the status), without raising: see ``Guardian._diverge``."""

    def __init__(self, message: str) -> None:
        super().__init__(ExitCode.DIVERGED)
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class StepOutcome:
    """What one call to ``Guardian.step`` did."""

    boundary: bool
    applied: bool = False
    loss: float = math.nan
    grad_norm: float = math.nan
    reason: str = ""
    rolled_back: bool = False


def _rng_state() -> dict[str, Any]:
    np_state: tuple[Any, ...] = tuple(np.random.get_state(legacy=True))
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Guardian:
    """Guards one worker's training loop: finite checks, clipping, spikes, rollback, checkpoints, status.

    Promises: a non-finite or spiking step never reaches the weights; every rank takes the same
    decision; a checkpoint is written only from finite weights and only counted once durable; on
    start the newest valid checkpoint (agreed by all ranks) is restored with the exact data position.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        scaler: torch.amp.GradScaler | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        settings: GuardianSettings | None = None,
        status_file: str | os.PathLike[str] | None = None,
        accumulation_steps: int = 1,
        validate: Callable[[], float] | None = None,
        resume: bool = True,
    ) -> None:
        try:
            self.settings = settings if settings is not None else load_settings()
        except SettingsError as exc:
            raise ConfigError(str(exc)) from exc
        if accumulation_steps < 1:
            raise ConfigError(f"accumulation_steps must be at least 1, got {accumulation_steps}")
        self.model = model
        self.module = model.module if isinstance(model, DistributedDataParallel) else model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.accumulation_steps = accumulation_steps
        self.validate = validate
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self._collective_device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.distributed and dist.get_backend() == "nccl"
            else torch.device("cpu")
        )

        guard = self.settings.guard
        self.step_count = 0  # completed steps kept in the model (reverts on rollback)
        self.iterations = 0  # every step boundary ever attempted (never reverts)
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.spikes = 0
        self.rollbacks = 0
        self.rollback_iterations: list[int] = []
        self.consecutive_bad = 0
        self.lr_scale = 1.0
        self.max_grad_norm = guard.max_grad_norm
        self.explosion_pattern: str | None = None
        self.losses: deque[float] = deque(maxlen=guard.loss_spike_window)
        self.grad_norms: deque[float] = deque(maxlen=guard.loss_spike_window)
        self.remediations_applied: list[str] = []
        self.last_loss: float | None = None
        self.last_grad_norm: float | None = None
        self.last_step_time: float | None = None
        self.nan_location: str | None = None
        self.phase = Phase.STARTING
        self.busy_since: float | None = None
        self.resumed_step = 0
        self.message = ""
        self.started_at = time.time()
        self._micro = 0
        self._loss_sum: torch.Tensor | None = None
        self._with_grad: list[torch.nn.Parameter] = []
        self._norm = torch.zeros(())
        self._loader: GuardedLoader | None = None
        self._pending_data_state: dict[str, int] | None = None
        self._current_batch: tuple[int, int, tuple[int, ...]] | None = None
        self._window_batches: list[tuple[int, int]] = []
        self._snapshot = Snapshot()
        self._locator = NaNLocator(self.module)
        self._locator_budget = 0

        directory = checkpoint_dir if checkpoint_dir is not None else os.environ.get(CHECKPOINT_DIR_ENV)
        self.checkpoint_dir = Path(directory) if directory else None
        self.store: CheckpointStore | None = None
        if self.checkpoint_dir is not None:
            try:
                self.store = CheckpointStore(
                    self.checkpoint_dir,
                    rank=self.rank,
                    world_size=self.world_size,
                    keep_clean=self.settings.checkpoint.keep_clean,
                )
            except CheckpointError as exc:
                raise ConfigError(str(exc)) from exc
        else:
            log.warning(
                "no checkpoint directory (argument or %s): nothing will survive a restart", CHECKPOINT_DIR_ENV
            )
        try:
            self.faults = FaultInjector.from_env(self.rank, self.checkpoint_dir)
        except FaultSpecError as exc:
            raise ConfigError(str(exc)) from exc
        self.dead_letters = DeadLetters(
            self.checkpoint_dir / DEAD_LETTER_NAME if self.checkpoint_dir else None
        )
        self.dead_letters.load()

        status_path = status_file if status_file is not None else os.environ.get(STATUS_FILE_ENV)
        self._status = StatusPublisher(
            Path(status_path) if status_path else None, self.settings.status_interval_seconds
        )
        self._publish(force=True)

        if resume:
            self._resume()
        if not self._snapshot.taken:
            self._take_snapshot()  # the starting weights are the first thing a rollback can return to
        self._apply_env_remediation()
        self.phase = Phase.RUNNING
        self._publish(force=True)

    # ---------------------------------------------------------------------------------------- data ---
    def loader(
        self,
        dataset: SizedDataset,
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
    ) -> GuardedLoader:
        """A GuardedLoader for this worker's rank, positioned where the resumed checkpoint left off."""
        loader = GuardedLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            collate_fn=collate_fn,
            num_workers=num_workers,
            rank=self.rank,
            world_size=self.world_size,
            dead_letters=self.dead_letters,
            inject_bad_sample=self._inject_bad_sample if self.faults.active else None,
        )
        self.attach_loader(loader)
        return loader

    def attach_loader(self, loader: GuardedLoader) -> None:
        """Track ``loader``'s position in checkpoints (and restore a resumed position into it)."""
        self._loader = loader
        if self._pending_data_state is not None:
            loader.load_state_dict(self._pending_data_state)
            self._pending_data_state = None

    def run(self, loader: GuardedLoader, max_steps: int) -> Iterator[Any]:
        """Yield batches (one per micro-step) until ``max_steps`` steps are kept, then ``finish``.

        Epochs follow one another; a resumed job starts at the exact next batch.
        """
        if self._loader is not loader:
            self.attach_loader(loader)
        empty_epochs = 0
        while self.step_count < max_steps:
            yielded = False
            for batch in loader:
                yielded = True
                self._before_step()
                self._current_batch = (batch.epoch, batch.index, batch.sample_ids)
                yield batch.data
                if self.step_count >= max_steps and self._micro == 0:
                    break
            empty_epochs = 0 if yielded else empty_epochs + 1
            if empty_epochs >= 2:
                raise RuntimeError("the loader yields no batch (every batch dead-lettered or dataset empty)")
        self.finish()

    def _inject_bad_sample(self) -> bool:
        return self.faults.fires(FaultKind.BAD_SAMPLE, self.step_count)

    def _before_step(self) -> None:
        if not self.faults.active or self._micro != 0:
            return
        if self.faults.fires(FaultKind.CRASH, self.step_count):
            log.error("fault injection: crash at step %d (SIGKILL)", self.step_count)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.faults.fires(FaultKind.HANG, self.step_count):
            log.error("fault injection: hang at step %d", self.step_count)
            self.message = f"injected hang at step {self.step_count}"
            self._publish(force=True)
            while True:
                time.sleep(3600)

    # ---------------------------------------------------------------------------------------- step ---
    def step(self, loss: torch.Tensor, replay: Callable[[], Any] | None = None) -> StepOutcome:
        """Backward ``loss`` and, at an accumulation boundary, check, clip and step (or skip, or roll back).

        ``replay`` optionally re-runs this step's forward pass; on the first non-finite loss it is
        used to name the module whose output went non-finite first.
        """
        if self.faults.active and self._micro == 0:
            if self.faults.fires(FaultKind.NAN_LOSS, self.step_count):
                loss = loss * math.nan
            elif self.faults.fires(FaultKind.LOSS_SPIKE, self.step_count):
                loss = loss * 50.0
        micro_loss = loss / self.accumulation_steps if self.accumulation_steps > 1 else loss
        to_backward = self.scaler.scale(micro_loss) if self.scaler is not None else micro_loss
        torch.autograd.backward(to_backward)
        detached = loss.detach().float()
        self._loss_sum = detached if self._micro == 0 or self._loss_sum is None else self._loss_sum + detached
        if self._current_batch is not None:
            self._window_batches.append(self._current_batch[:2])
        self._micro += 1
        if self._micro < self.accumulation_steps:
            return StepOutcome(boundary=False)
        self._micro = 0
        assert self._loss_sum is not None
        mean_loss = self._loss_sum / self.accumulation_steps
        return self._boundary(mean_loss, replay)

    def _boundary(self, mean_loss: torch.Tensor, replay: Callable[[], Any] | None) -> StepOutcome:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.faults.active and self.faults.fires(FaultKind.INF_GRAD, self.step_count):
            with torch.no_grad():
                grad = next(p.grad for p in self.params if p.grad is not None)
                grad.view(-1)[0] = math.inf
        self._with_grad = [p for p in self.params if p.grad is not None]
        grads = [g for p in self._with_grad if (g := p.grad) is not None]
        # One fused reduction; the clipping multiply waits for the host sync below and is skipped when
        # the norm is already within bounds (or the step is skipped anyway).
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        self._norm = norm
        loss_flag = (~torch.isfinite(mean_loss)).float()
        local = torch.stack([mean_loss, loss_flag, norm.float().to(mean_loss.device)])
        if self.world_size > 1:
            reduced = local.to(self._collective_device, copy=True)
            dist.all_reduce(reduced)
            # One host sync for both the agreed values and this rank's own loss flag.
            loss_sum, bad_ranks, norm_sum, local_bad = torch.cat(
                [reduced, local[1:2].to(reduced.device)]
            ).tolist()
            loss_v, norm_v = loss_sum / self.world_size, norm_sum / self.world_size
            locally_nonfinite = local_bad > 0
        else:
            loss_v, bad_ranks, norm_v = local.tolist()  # the one host sync of the step
            locally_nonfinite = bad_ranks > 0
        return self._decide(loss_v, norm_v, bad_ranks > 0, locally_nonfinite, replay)

    def _decide(
        self,
        loss_v: float,
        norm_v: float,
        loss_bad: bool,
        locally_nonfinite: bool,
        replay: Callable[[], Any] | None,
    ) -> StepOutcome:
        guard = self.settings.guard
        finite = not loss_bad and math.isfinite(loss_v) and math.isfinite(norm_v)
        reason = ""
        if not finite:
            reason = "non-finite loss" if not math.isfinite(loss_v) or loss_bad else "non-finite gradients"
        elif len(self.losses) >= guard.spike_min_history and loss_v > guard.loss_spike_factor * _mean(
            self.losses
        ):
            reason = "loss spike"
        elif len(
            self.grad_norms
        ) >= guard.spike_min_history and norm_v > guard.grad_norm_spike_factor * _mean(self.grad_norms):
            reason = "grad-norm spike"
        self.iterations += 1
        self.last_loss, self.last_grad_norm = loss_v, norm_v

        if not reason:
            self._apply_update(norm_v)
            self.losses.append(loss_v)
            self.grad_norms.append(norm_v)
            self.consecutive_bad = 0
            self.explosion_pattern = None
            self.step_count += 1
            self.last_step_time = time.time()
            self._after_good_step(loss_v)
            return StepOutcome(boundary=True, applied=True, loss=loss_v, grad_norm=norm_v)

        # A bad step: nothing reaches the weights.
        self.optimizer.zero_grad(set_to_none=True)
        benign_overflow = False
        if self.scaler is not None and self.scaler.is_enabled():
            # fp16 overflow is the scaler's business (it backs off); it is only a real anomaly once the
            # scale is below 1, where a non-finite gradient cannot be blamed on the scale.
            benign_overflow = reason == "non-finite gradients" and self.scaler.get_scale() >= 1.0
            self.scaler.update()
        self.skipped_steps += 1
        self.step_count += 1
        self.last_step_time = time.time()
        if reason.endswith("spike"):
            self.spikes += 1
        if not benign_overflow:
            self.consecutive_bad += 1
        pattern = classify_explosion([*self.losses, loss_v], guard.loss_spike_factor)
        self.explosion_pattern = pattern.value if pattern else self.explosion_pattern
        log.warning(
            "step %d skipped: %s (loss %.4g, grad norm %.4g, %d bad in a row%s)",
            self.step_count - 1,
            reason,
            loss_v,
            norm_v,
            self.consecutive_bad,
            f", pattern {self.explosion_pattern}" if self.explosion_pattern else "",
        )
        if not finite and self._current_batch is not None:
            epoch, index, _ = self._current_batch
            self.dead_letters.add(
                epoch, index, write=self.rank == 0, step=self.step_count - 1, reason=reason, kind="non-finite"
            )
        if reason == "non-finite loss":
            self._localize(replay, locally_nonfinite)
        self._forensics(reason, loss_v, norm_v)
        rolled_back = False
        if self.consecutive_bad >= guard.max_consecutive_bad_steps:
            self._rollback(reason)
            rolled_back = True
        self._publish(force=True)
        return StepOutcome(
            boundary=True,
            applied=False,
            loss=loss_v,
            grad_norm=norm_v,
            reason=reason,
            rolled_back=rolled_back,
        )

    def _apply_update(self, norm_v: float) -> None:
        if norm_v > self.max_grad_norm:
            torch.nn.utils.clip_grads_with_norm_(
                self._with_grad, self.max_grad_norm, self._norm, foreach=True
            )
        # Gradients are known finite here, so the scaler's own found-inf check (another host sync) is
        # not needed: step the optimizer directly and let the scaler grow its scale.
        self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1

    def _after_good_step(self, loss_v: float) -> None:
        if self._locator.armed:
            self._collect_localization()
        policy = self.settings.checkpoint
        if self.step_count % policy.snapshot_every_steps == 0:
            self._take_snapshot()
        if self.store is not None and self.step_count % policy.every_steps == 0:
            self.save_checkpoint()
        self._publish()

    # ------------------------------------------------------------------------------------ rollback ---
    def _small_state(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def _take_snapshot(self) -> None:
        self._snapshot.capture(
            self.step_count,
            self.module,
            self.optimizer,
            self._small_state(),
            {
                "optimizer_steps": self.optimizer_steps,
                "losses": list(self.losses),
                "grad_norms": list(self.grad_norms),
            },
        )
        self._window_batches.clear()

    def _rollback(self, reason: str) -> None:
        guard = self.settings.guard
        window_start = self.iterations - guard.rollback_window_steps
        recent = [i for i in self.rollback_iterations if i > window_start]
        if len(recent) >= guard.max_rollbacks:
            self._diverge(
                f"{len(recent)} rollbacks within {guard.rollback_window_steps} steps and still {reason}"
            )
        # A rollback makes no steps for a while (the restore, then the held-out validation, which may take
        # minutes on a large model): the status says so, and the sidecar gives it the startup grace
        # instead of the hang timeout.
        self.phase = Phase.ROLLING_BACK
        self.busy_since = time.time()
        self._publish(force=True)
        from_step = self.step_count
        small = self._snapshot.restore(self.module, self.optimizer)
        if self.scheduler is not None and small["scheduler"] is not None:
            self.scheduler.load_state_dict(small["scheduler"])
        if self.scaler is not None and small["scaler"] is not None:
            self.scaler.load_state_dict(small["scaler"])
        extra = self._snapshot.extra
        self.step_count = self._snapshot.step
        self.optimizer_steps = extra["optimizer_steps"]
        self.losses = deque(extra["losses"], maxlen=self.losses.maxlen)
        self.grad_norms = deque(extra["grad_norms"], maxlen=self.grad_norms.maxlen)
        # The data does not rewind: the window that led here is skipped, and remembered for replays.
        for epoch, index in self._window_batches:
            self.dead_letters.add(epoch, index, write=self.rank == 0, kind="rolled-back window")
        self.rollbacks += 1
        self.rollback_iterations.append(self.iterations)
        self.consecutive_bad = 0
        self._remediate(self.settings.remediation)
        # The restored state is clean; re-snapshot it so a further rollback compounds the remediation.
        self._take_snapshot()
        log.warning(
            "rolled back from step %d to step %d after %s; lr scale now %.4g, max grad norm %.4g",
            from_step,
            self.step_count,
            reason,
            self.lr_scale,
            self.max_grad_norm,
        )
        self._check_validation("rollback")
        if self.world_size > 1:
            # Every rank stays "rolling back" until the slowest one has validated: otherwise the faster
            # ranks would wait for it in their next all-reduce and look hung.
            dist.barrier()
        self.phase = Phase.RUNNING
        self.busy_since = None
        self.last_step_time = time.time()  # the rollback itself is progress: the hang clock restarts
        self._publish(force=True)

    def _remediate(self, remediation: Remediation) -> None:
        factor = remediation.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * factor
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * factor
        if self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
            self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]
        self.lr_scale *= factor
        if remediation.max_grad_norm is not None:
            self.max_grad_norm = min(self.max_grad_norm, remediation.max_grad_norm)

    def _apply_env_remediation(self) -> None:
        text = os.environ.get(REMEDIATION_ENV, "").strip()
        if not text:
            return
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise ValueError("must be a JSON object")
            key = str(raw.pop("id", text))
            remediation = Remediation.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc, REMEDIATION_ENV)) from exc
        except ValueError as exc:
            raise ConfigError(f"{REMEDIATION_ENV}: {exc}") from exc
        if key in self.remediations_applied:
            return
        self._remediate(remediation)
        self.remediations_applied.append(key)
        log.warning("applied remediation %s from the orchestrator: lr scale %.4g", key, self.lr_scale)

    def _diverge(self, message: str) -> None:
        self.phase = Phase.DIVERGED
        self.message = message
        log.error("diverged: %s; exiting with code %d", message, ExitCode.DIVERGED)
        self._publish(force=True)
        self._write_termination_message()
        if self.store is not None:
            try:
                self.store.close()
            except CheckpointError as exc:
                log.error("%s", exc)
        if self.world_size > 1:
            # Every rank diverges at the same step (the decision is collective) and its process ends
            # here, now. Left to interpreter exit, PyTorch's gloo teardown (its worker threads still hold
            # DDP's work) ends in std::terminate, SIGABRT instead of exit code 200, in about 1 run of 12
            # to 40 under load (destroy_process_group first did not change that). The orchestrator
            # needs the 200 to choose the remediation, so the exit skips the interpreter's teardown;
            # the checkpoints are closed, the status and termination message written, logs flushed.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(ExitCode.DIVERGED)
        raise Diverged(message)

    def _check_validation(self, when: str) -> None:
        if self.validate is None:
            return
        value = float(self.validate())
        self.message = f"held-out loss after {when}: {value:.4g}"
        log.info("%s", self.message)

    # ------------------------------------------------------------------------- localisation, forensics ---
    def _localize(self, replay: Callable[[], Any] | None, locally_nonfinite: bool) -> None:
        if self.nan_location is not None or not locally_nonfinite:
            return
        if replay is not None:
            self.nan_location = self._locator.locate(replay) or "(no module output: the loss itself)"
            log.warning("NaN localisation: first non-finite output from %s", self.nan_location)
        else:
            self._locator.arm()  # inspect the next forward passes instead
            self._locator_budget = self.settings.guard.max_consecutive_bad_steps

    def _collect_localization(self) -> None:
        if self._locator.found is not None:
            self.nan_location = self._locator.found
            log.warning("NaN localisation: first non-finite output from %s", self.nan_location)
            self._locator.disarm()
            return
        self._locator_budget -= 1
        if self._locator_budget <= 0:
            self._locator.disarm()

    def _forensics(self, reason: str, loss_v: float, norm_v: float) -> None:
        if self.checkpoint_dir is None:
            return
        folder = self.checkpoint_dir / FORENSICS_DIR
        folder.mkdir(exist_ok=True)
        batch = self._current_batch
        bundle = {
            "step": self.step_count - 1,
            "iteration": self.iterations,
            "rank": self.rank,
            "time": time.time(),
            "reason": reason,
            "loss": _json_float(loss_v),
            "grad_norm": _json_float(norm_v),
            "explosion_pattern": self.explosion_pattern,
            "nan_location": self.nan_location,
            "batch": {"epoch": batch[0], "index": batch[1], "sample_ids": list(batch[2])} if batch else None,
            "losses": list(self.losses)[-100:],
            "grad_norms": list(self.grad_norms)[-100:],
        }
        path = folder / f"step-{self.step_count - 1:010d}-iter-{self.iterations:010d}-rank{self.rank}.json"
        path.write_text(json.dumps(bundle, indent=1))
        bundles = sorted(folder.glob(f"*-rank{self.rank}.json"))
        for old in bundles[:-FORENSICS_KEEP]:
            old.unlink(missing_ok=True)

    # --------------------------------------------------------------------------------- checkpoints ---
    def _checkpoint_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"rng": _rng_state()}
        if self._loader is not None:
            state["data"] = self._loader.state_dict()
        if self.rank == 0:
            state.update(
                model=self.module.state_dict(),
                optimizer=self.optimizer.state_dict(),
                guardian=self._guardian_state(),
                **self._small_state(),
            )
        return state

    def _guardian_state(self) -> dict[str, Any]:
        return {
            "step": self.step_count,
            "iterations": self.iterations,
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "spikes": self.spikes,
            "rollbacks": self.rollbacks,
            "rollback_iterations": list(self.rollback_iterations),
            "lr_scale": self.lr_scale,
            "max_grad_norm": self.max_grad_norm,
            "losses": list(self.losses),
            "grad_norms": list(self.grad_norms),
            "remediations_applied": list(self.remediations_applied),
        }

    def _weights_finite(self) -> bool:
        norms = torch._foreach_norm([p.detach() for p in self.module.parameters()])
        return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())

    def save_checkpoint(self) -> bool:
        """Start an asynchronous clean checkpoint of the current step; False if the state is not clean."""
        if self.store is None:
            return False
        if self.consecutive_bad or self.last_loss is None or not math.isfinite(self.last_loss):
            log.warning("step %d: last loss not finite; no checkpoint", self.step_count)
            return False
        if not self._weights_finite():
            log.error("step %d: weights are not finite; no checkpoint written", self.step_count)
            return False
        meta = {"loss": self.last_loss, "weights_finite": True, "clean": True}
        self.store.save_async(self.step_count, self._checkpoint_state(), meta)
        return True

    def _resume(self) -> None:
        if self.store is None:
            return
        step = self._agree_resume_step()
        if step is None:
            if self.store.steps():
                log.error(
                    "checkpoints exist under %s but none is valid: starting from scratch", self.store.root
                )
            return
        path = self.store.root
        state = self.store.load(step)
        try:
            self.module.load_state_dict(state["model"])
        except (RuntimeError, KeyError) as exc:
            raise ConfigError(
                f"checkpoint at step {step} under {path} does not fit this model: {exc}"
            ) from exc
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as exc:
            raise ConfigError(
                f"checkpoint at step {step} under {path} does not fit this optimizer: {exc}"
            ) from exc
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        g = state["guardian"]
        self.step_count = int(g["step"])
        self.iterations = int(g["iterations"])
        self.optimizer_steps = int(g["optimizer_steps"])
        self.skipped_steps = int(g["skipped_steps"])
        self.spikes = int(g["spikes"])
        self.rollbacks = int(g["rollbacks"])
        self.rollback_iterations = [int(i) for i in g["rollback_iterations"]]
        self.lr_scale = float(g["lr_scale"])
        self.max_grad_norm = float(g["max_grad_norm"])
        self.losses.extend(float(x) for x in g["losses"])
        self.grad_norms.extend(float(x) for x in g["grad_norms"])
        self.remediations_applied = [str(x) for x in g["remediations_applied"]]
        self.last_loss = self.losses[-1] if self.losses else None
        if "rng" in state:
            _set_rng_state(state["rng"])
        if "data" in state:
            if self._loader is not None:
                self._loader.load_state_dict(state["data"])
            else:
                self._pending_data_state = state["data"]
        self._take_snapshot()
        self.resumed_step = step
        log.warning("resumed from the clean checkpoint at step %d (%s)", step, path)
        self._check_validation("resume")

    def _agree_resume_step(self) -> int | None:
        """The newest checkpoint every rank can load; with one rank, simply the newest valid one."""
        assert self.store is not None
        if self.world_size == 1:
            return self.store.newest_valid()
        bound: int | None = None
        while True:
            mine = self.store.newest_valid(at_most=bound)
            candidate = torch.tensor([-1 if mine is None else mine], device=self._collective_device)
            dist.all_reduce(candidate, op=dist.ReduceOp.MIN)
            step = int(candidate.item())
            if step < 0:
                return None
            ok = torch.tensor([int(self.store.verify(step).valid)], device=self._collective_device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if int(ok.item()) == 1:
                return step
            bound = step - 1

    # ------------------------------------------------------------------------------------- status ---
    def status(self) -> WorkerStatus:
        """The worker's current status, as published to the sidecar."""
        counters = self._loader.counters if self._loader is not None else None
        return WorkerStatus(
            rank=self.rank,
            world_size=self.world_size,
            pid=os.getpid(),
            phase=self.phase,
            started_at=self.started_at,
            step=self.step_count,
            resumed_step=self.resumed_step,
            last_step_time=self.last_step_time,
            busy_since=self.busy_since,
            loss=_json_float(self.last_loss) if self.last_loss is not None else None,
            grad_norm=_json_float(self.last_grad_norm) if self.last_grad_norm is not None else None,
            lr_scale=self.lr_scale,
            max_grad_norm=self.max_grad_norm,
            steps_total=self.iterations,
            skipped_steps=self.skipped_steps,
            consecutive_bad_steps=self.consecutive_bad,
            rollbacks=self.rollbacks,
            spikes=self.spikes,
            samples_seen=counters.seen if counters else 0,
            samples_dropped=counters.dropped if counters else 0,
            explosion_pattern=self.explosion_pattern,
            last_clean_checkpoint=self.store.last_clean if self.store is not None else None,
            message=self.message,
        )

    def _publish(self, force: bool = False) -> None:
        if force or self._status.due(self.phase):
            self._status.publish(self.status(), force=True)

    def finish(self) -> None:
        """Write a final checkpoint (if due and clean), wait for every write, publish ``finished``."""
        if self.store is not None:
            self.store.wait()  # a save of this very step may still be in flight
            if self.store.last_clean is None or self.store.last_clean.step != self.step_count:
                self.save_checkpoint()
            try:
                self.store.wait()
            finally:
                self.store.close()
        if self.world_size > 1:
            # No rank reports success before every rank's final checkpoint is durable, and ranks leave
            # together (a rank tearing down gloo while a peer is still in it can abort the peer).
            dist.barrier()
        self.phase = Phase.FINISHED
        self._publish(force=True)
        self._write_termination_message()

    def _write_termination_message(self) -> None:
        """The final status into the container's termination message (``TRAINGUARD_TERMINATION_MESSAGE_PATH``,
        set by the operator): the orchestrator reads it from the pod after the sidecar has gone. Best
        effort: a worker never fails for it."""
        path = os.environ.get(TERMINATION_MESSAGE_ENV, "").strip()
        if not path:
            return
        try:
            write_termination_message(Path(path), self.status())
        except OSError as exc:
            log.warning("could not write the termination message to %s: %s", path, exc)

    def close(self) -> None:
        """Wait for a checkpoint in flight without marking the job finished (for interrupted loops)."""
        if self.store is not None:
            self.store.close()


def _mean(values: deque[float]) -> float:
    return sum(values) / len(values)


def _json_float(value: float) -> float | None:
    return value if math.isfinite(value) else None
