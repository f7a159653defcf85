"""The objects a training loop steps (model, optimizer, scheduler, grad scaler) and what the guardian does
to them as a whole: apply or drop an update, remediate, check that they are finite, save and restore them.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from trainer_sidecar.config import ConfigError
from trainer_sidecar.finite import nonfinite_flag


class StateMismatch(ValueError):
    """A saved state does not fit the live model or optimizer (another model, another configuration)."""


#: Prefixes that wrappers add to state-dict keys without changing the model: torch.compile's
#: ``_orig_mod.`` and DistributedDataParallel's ``module.``.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")
_SHOWN = 5


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DistributedDataParallel and torch.compile wrappers (in any order): the one whose
    state-dict keys name the model's own parameters, as checkpoints store them."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        else:
            inner = getattr(model, "_orig_mod", None)
            if not isinstance(inner, torch.nn.Module):
                return model
            model = inner


def _strip_wrappers(key: str) -> str:
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key, stripped = key[len(prefix) :], True
    return key


def fit_keys(saved: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """``saved`` with the wrapper prefixes of its keys removed where the live model does not have them (a
    checkpoint written through a compiled or DDP-wrapped model loads into the bare one)."""
    if set(saved) <= set(live):
        return saved
    return {(_strip_wrappers(key) if key not in live else key): value for key, value in saved.items()}


def describe_mismatch(saved: dict[str, Any], live: dict[str, Any]) -> str:
    """The keys missing from the checkpoint, the unexpected ones, and those of another shape, with a hint;
    empty when the two fit."""
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    shapes = sorted(
        f"{key} (checkpoint {tuple(saved[key].shape)}, model {tuple(live[key].shape)})"
        for key in set(saved) & set(live)
        if isinstance(saved[key], torch.Tensor)
        and isinstance(live[key], torch.Tensor)
        and saved[key].shape != live[key].shape
    )
    parts = [
        f"{what} ({len(keys)}): {', '.join(keys[:_SHOWN])}{', ...' if len(keys) > _SHOWN else ''}"
        for what, keys in (("missing", missing), ("unexpected", unexpected), ("another shape", shapes))
        if keys
    ]
    if not parts:
        return ""
    return "; ".join(parts) + (
        ". The checkpoint is of another model or configuration: was the model changed (its width, depth, "
        "vocabulary, or a layer renamed)? Start a new checkpoint directory for a new model."
    )


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and trainguard: the loop's own line."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and "/trainer_sidecar/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}"
    return "unknown line"


def check_training_objects(model: Any, optimizer: Any, scheduler: Any, scaler: Any) -> None:
    """Raise ConfigError, naming the argument, unless these are objects the guardian can step, save and
    roll back: a Module; one Optimizer whose parameters all belong to it (a parameter outside the model
    would be neither checkpointed nor rolled back); a scheduler of that optimizer that steps without a
    metric; a GradScaler."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"Guardian(model=...) must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(optimizer, list | tuple):
        raise ConfigError(
            f"Guardian(optimizer=...) takes one torch.optim.Optimizer, got a {type(optimizer).__name__} of "
            f"{len(optimizer)}; several optimizers stepped together are not supported"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"Guardian(optimizer=...) must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    own = {id(p) for p in model.parameters()}
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:_SHOWN])
        raise ConfigError(
            f"Guardian(optimizer=...) updates {len(foreign)} tensor(s) that are not parameters of the model "
            f"(shapes {shapes}): they would be neither checkpointed nor rolled back; make them nn.Parameter "
            "attributes of the model, or build the optimizer from model.parameters()"
        )
    if scheduler is not None:
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ConfigError(
                "Guardian(scheduler=...) cannot step ReduceLROnPlateau (it needs a metric): step it in "
                "the loop with the validation loss, and keep it in checkpoints with guardian.track(name, it)"
            )
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise ConfigError(
                "Guardian(scheduler=...) must be a torch.optim.lr_scheduler.LRScheduler, "
                f"got {type(scheduler).__name__}"
            )
        if scheduler.optimizer is not optimizer:
            raise ConfigError(
                "Guardian(scheduler=...) schedules another optimizer than Guardian(optimizer=...)"
            )
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise ConfigError(f"Guardian(scaler=...) must be a torch.amp.GradScaler, got {type(scaler).__name__}")


class TrainingObjects:
    """The model (``module``: unwrapped from DistributedDataParallel), the optimizer, and the optional
    scheduler and GradScaler of one worker."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        scaler: torch.amp.GradScaler | None,
    ) -> None:
        self.model = model
        self.module = unwrap(model)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self._stepping = False
        self._report: Callable[[ConfigError], None] = lambda error: None
        self._scheduler_epoch = scheduler.last_epoch if scheduler is not None else 0

    def refuse_loop_steps(self, report: Callable[[ConfigError], None]) -> None:
        """Make the loop's own ``optimizer.step()`` (or ``scaler.step(optimizer)``) raise ConfigError,
        naming the calling line, after ``report`` publishes it: the guardian steps the optimizer, and a
        second step would apply gradients it refused (NaN ones included) and skip its clipping."""

        def refuse(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self._stepping:
                return
            error = ConfigError(
                f"the training loop steps the optimizer itself ({_caller()}): guardian.step() does, "
                "after its checks; remove the loop's optimizer.step() (or scaler.step)"
            )
            report(error)
            raise error

        self.optimizer.register_step_pre_hook(refuse)
        self._report = report

    def backward(self, loss: torch.Tensor) -> None:
        """Backward ``loss`` (scaled by the GradScaler when there is one). Raises TypeError when ``loss``
        is not a one-element tensor that autograd can backward."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"the loss must be a torch.Tensor (the output of the forward pass), got {type(loss).__name__}"
            )
        if loss.numel() != 1:
            raise TypeError(
                f"the loss must be one value (reduce it, e.g. .mean()), got shape {tuple(loss.shape)}"
            )
        if not loss.requires_grad:
            raise TypeError(
                "the loss does not require grad: it was computed under torch.no_grad(), detached, or from no "
                "trainable parameter"
            )
        torch.autograd.backward(self.scaler.scale(loss) if self.scaler is not None else loss)

    def unscale(self) -> None:
        """Unscale the gradients in place (a no-op without a GradScaler, or when the loop already did, to
        clip them itself)."""
        if self.scaler is None or not self.scaler.is_enabled():
            return
        stage = self.scaler._per_optimizer_states[id(self.optimizer)].get("stage")
        if getattr(stage, "name", "") == "UNSCALED":
            return
        self.scaler.unscale_(self.optimizer)

    def apply_update(
        self,
        norm: float,
        max_norm: float,
        grads_of: Sequence[torch.nn.Parameter],
        norm_tensor: torch.Tensor,
        *,
        lr_scale: float = 1.0,
    ) -> None:
        """Clip (only when ``norm`` exceeds ``max_norm``), step the optimizer with every learning rate
        scaled by ``lr_scale``, step the scaler and the scheduler, and zero the gradients.

        The scale applies for the optimizer step only: the param groups keep the learning rates the loop
        or its scheduler set, so a loop that writes ``param_group["lr"]`` every iteration keeps the
        remediation, and a scheduler computes from the unscaled rates.
        """
        if norm > max_norm:
            torch.nn.utils.clip_grads_with_norm_(grads_of, max_norm, norm_tensor, foreach=True)
        # Gradients are known finite here, so the scaler's own found-inf check (another host sync) is
        # not needed: step the optimizer directly and let the scaler grow its scale.
        with _scaled_learning_rates(self.optimizer, lr_scale):
            self._stepping = True
            try:
                self.optimizer.step()
            finally:
                self._stepping = False
        if self.scaler is not None:
            self.scaler.update()
        if self.scheduler is not None:
            self._step_scheduler(self.scheduler)
        self.optimizer.zero_grad(set_to_none=True)

    def _step_scheduler(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        if scheduler.last_epoch != self._scheduler_epoch:
            error = ConfigError(
                f"the training loop steps the scheduler itself (its last_epoch is {scheduler.last_epoch}, "
                f"the guardian stepped it to {self._scheduler_epoch}): guardian.step() steps the scheduler "
                "it was given; remove the loop's scheduler.step(), or do not pass scheduler="
            )
            self._report(error)
            raise error
        scheduler.step()
        self._scheduler_epoch = scheduler.last_epoch

    def drop_update(self) -> None:
        """Zero the gradients without stepping; the GradScaler backs off after an overflow."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None and self.scaler.is_enabled():
            self.scaler.update()

    def small_state(self) -> dict[str, Any]:
        """The scheduler's and the scaler's state (None for the missing ones)."""
        return {
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_small_state(self, small: dict[str, Any]) -> None:
        """Put back ``small_state``'s output (a part that is None is left alone)."""
        if self.scheduler is not None and small.get("scheduler") is not None:
            self.scheduler.load_state_dict(small["scheduler"])
            self._scheduler_epoch = self.scheduler.last_epoch
        if self.scaler is not None and small.get("scaler") is not None:
            self.scaler.load_state_dict(small["scaler"])

    def nonfinite_flag(self) -> torch.Tensor:
        """1.0 when any value of the whole state (parameters, buffers, optimizer state, scheduler and
        scaler) is NaN or infinite, else 0.0: one fused reduction per device (``finite.nonfinite_flag``)."""
        return nonfinite_flag(
            self.module.state_dict(), self.optimizer.state_dict()["state"], self.small_state()
        )

    def state(self) -> dict[str, Any]:
        """Model, optimizer, scheduler and scaler state, for a checkpoint."""
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **self.small_state(),
        }

    def load(self, state: dict[str, Any]) -> None:
        """Load a checkpoint's ``state()``. Raises StateMismatch saying which part does not fit."""
        saved = state.get("model")
        if not isinstance(saved, dict):
            raise StateMismatch("holds no model state")
        live = self.module.state_dict()
        fitted = fit_keys(saved, live)
        mismatch = describe_mismatch(fitted, live)
        if mismatch:
            raise StateMismatch(f"does not fit this model: {mismatch}")
        try:
            self.module.load_state_dict(fitted)
        except (RuntimeError, KeyError, TypeError) as exc:
            raise StateMismatch(f"does not fit this model: {exc}") from exc
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StateMismatch(f"does not fit this optimizer: {exc}") from exc
        self.load_small_state(state)


@contextmanager
def _scaled_learning_rates(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[None]:
    """Every param group's ``lr`` times ``scale`` inside the block, the group's own value after it (a
    tensor learning rate is scaled in place and restored exactly)."""
    if scale == 1.0:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        if isinstance(lr, torch.Tensor):
            group["lr"] = lr.clone()  # the group's own tensor is left untouched
            group["lr"].mul_(scale)
        else:
            group["lr"] = lr * scale
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
