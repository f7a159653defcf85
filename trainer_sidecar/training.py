"""The objects a training loop steps (model, optimizer, scheduler, grad scaler) and what the guardian does
to them as a whole: apply or drop an update, remediate, check that they are finite, save and restore them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

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

    def backward(self, loss: torch.Tensor) -> None:
        """Backward ``loss`` (scaled by the GradScaler when there is one)."""
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
            self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

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
