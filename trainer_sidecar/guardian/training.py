"""The objects a training loop steps (model, optimizer, scheduler, grad scaler) and what the guardian does
to them as a whole: apply or drop an update, remediate, check that they are finite, save and restore them.
"""

from __future__ import annotations

import gc
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from trainer_sidecar.guardian.config import ConfigError
from trainer_sidecar.guardian.snapshot import stable_storage
from trainer_sidecar.tensors.finite import maybe_nonfinite_flag, nonfinite_flag
from trainer_sidecar.tensors.sharding import (
    Readable,
    check_placements,
    copies_of,
    fit_to,
    is_sharded,
    local_tensor,
    writes_shard,
)


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
        if isinstance(saved[key], (torch.Tensor, Readable))
        and isinstance(live[key], torch.Tensor)
        and tuple(saved[key].shape) != tuple(live[key].shape)
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


def caller() -> str:
    """``file:line`` of the innermost frame outside torch and trainguard: the loop's own line."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and "/trainer_sidecar/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}"
    return "unknown line"


def check_loss(loss: object) -> None:
    """Raise ConfigError, naming the loop's line and the reason, unless ``loss`` is what a plain
    ``loss.backward()`` takes as a loss: a tensor of one element (of any shape: ``[]``, ``[1]``,
    ``[1, 1]``), of a floating dtype, computed by autograd (it has a ``grad_fn``)."""
    if not isinstance(loss, torch.Tensor):
        reason = f"must be a torch.Tensor (the output of the forward pass), got {type(loss).__name__}"
    elif loss.numel() != 1:
        reason = f"must be one value (reduce it, e.g. .mean()), got shape {tuple(loss.shape)}"
    elif not loss.dtype.is_floating_point:
        reason = f"must be of a floating dtype (autograd backwards no other), got {loss.dtype}"
    elif not loss.requires_grad:
        reason = (
            "does not require grad: it was computed under torch.no_grad(), detached, or from no "
            "trainable parameter"
        )
    elif loss.grad_fn is None:
        reason = "is a leaf tensor (no grad_fn): it was not computed from the model's parameters"
    else:
        return
    raise ConfigError(f"the loss given to the guardian ({caller()}) {reason}")


def _is_scheduler(obj: object) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau)


def schedulers_of(optimizer: torch.optim.Optimizer) -> list[Any]:
    """Every live learning-rate scheduler (``LRScheduler``, ``ReduceLROnPlateau``) of ``optimizer``.

    Each holds its optimizer as ``.optimizer``, so it is among the objects that refer to the optimizer
    (``gc.get_referrers``: one pass over the objects the collector tracks, about 25 ms per million) or,
    once its ``__dict__`` was materialised (``load_state_dict`` does), that dict is, and the scheduler
    refers to the dict. Neither torch's wrapping of ``optimizer.step`` (done once, by the first
    scheduler only) nor a hook on the optimizer can count them. A scheduler unreachable but not yet
    collected (in a reference cycle) is found too."""
    found: dict[int, Any] = {}
    for referrer in gc.get_referrers(optimizer):
        if _is_scheduler(referrer) and referrer.optimizer is optimizer:
            found[id(referrer)] = referrer
        elif (
            isinstance(referrer, dict)
            and referrer.get("optimizer") is optimizer
            and "last_epoch" in referrer  # a scheduler's attributes, not a module's globals
        ):
            for owner in gc.get_referrers(referrer):
                if _is_scheduler(owner) and getattr(owner, "__dict__", None) is referrer:
                    found[id(owner)] = owner
    return list(found.values())


def _with_children(scheduler: object) -> Iterator[object]:
    """``scheduler`` and, for a ChainedScheduler or SequentialLR, the schedulers it wraps (whose state
    its ``state_dict`` holds), recursively."""
    yield scheduler
    children = getattr(scheduler, "_schedulers", None) if _is_scheduler(scheduler) else None
    for child in children if isinstance(children, list | tuple) else ():
        yield from _with_children(child)


def _progress(scheduler: object) -> tuple[int, ...]:
    """How far ``scheduler`` was stepped: the ``last_epoch`` of it and of the schedulers it wraps (a
    ChainedScheduler has none of its own); empty for None."""
    epochs = (getattr(s, "last_epoch", None) for s in _with_children(scheduler))
    return tuple(epoch for epoch in epochs if isinstance(epoch, int))


def _shown(progress: tuple[int, ...]) -> str:
    return str(progress[0]) if len(progress) == 1 else ", ".join(map(str, progress))


def _describe(scheduler: object) -> str:
    """``StepLR`` and, when a frame of the loop holds it in a variable, `` `decay` (train.py:12)``."""
    frame = sys._getframe(1)
    while frame is not None:
        if "/torch/" not in frame.f_code.co_filename and "/trainer_sidecar/" not in frame.f_code.co_filename:
            for names in (frame.f_locals, frame.f_globals):
                for name, value in names.items():
                    if value is scheduler:
                        where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
                        return f"{type(scheduler).__name__} `{name}` ({where})"
        frame = frame.f_back  # type: ignore[assignment]
    return type(scheduler).__name__


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
    scheduler and GradScaler of one worker.

    The model may be replicated (a plain module, DistributedDataParallel) or sharded (FSDP2's
    ``fully_shard``, HSDP): then parameters, gradients and optimizer state are DTensors, and everything
    here works on this rank's local tensors (``trainer_sidecar.tensors.sharding``). With ``refuse``, the
    loop's own optimizer steps are refused from the start (``refuse_loop_steps``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        scaler: torch.amp.GradScaler | None,
        *,
        refuse: Callable[[ConfigError], None] | None = None,
    ) -> None:
        self.model = model
        self.module = unwrap(model)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        for index, param in enumerate(self.params):
            if is_sharded(param):
                check_placements(param, f"optimizer parameter {index}")
        self.sharded = any(is_sharded(p) for p in self.params)
        names = {id(p): name for name, p in self.module.named_parameters()}
        #: The model's name of each optimizer parameter, in the optimizer's order (None: not the model's).
        self.param_names: list[str | None] = [names.get(id(p)) for p in self.params]
        self._stepping = False
        self._report: Callable[[ConfigError], None] = lambda error: None
        self._scheduler_epoch = _progress(scheduler)
        if refuse is not None:
            self.refuse_loop_steps(refuse)

    def refuse_loop_steps(self, report: Callable[[ConfigError], None]) -> None:
        """Make the loop's own ``optimizer.step()`` (or ``scaler.step(optimizer)``) raise ConfigError,
        naming the calling line, after ``report`` publishes it: the guardian steps the optimizer, and a
        second step would apply gradients it refused (NaN ones included) and skip its clipping."""

        def refuse(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self._stepping:
                return
            error = ConfigError(
                f"the training loop steps the optimizer itself ({caller()}): guardian.step() does, "
                "after its checks; remove the loop's optimizer.step() (or scaler.step)"
            )
            report(error)
            raise error

        self.optimizer.register_step_pre_hook(refuse)
        self._report = report

    def check_scheduler_kept(self, tracked: Iterable[object]) -> None:
        """Raise ConfigError, naming it, when a learning-rate scheduler of the optimizer is one the guardian
        neither steps (``scheduler=``) nor keeps (``tracked``: what the loop gave ``guardian.track``): a
        resume or a rollback would restore the learning rate and restart that schedule, so it silently
        drifts (a per-epoch StepLR decays epochs late, a second scheduler's warm-up runs again). A
        ChainedScheduler or SequentialLR given or tracked covers the schedulers it wraps.

        The schedulers are found by what refers to the optimizer (``schedulers_of``), once, at the first
        step: every scheduler holds its optimizer, so none is missed, ReduceLROnPlateau included."""
        kept: set[int] = set()
        for root in (self.scheduler, *tracked):
            if root is not None:
                kept.update(id(s) for s in _with_children(root))
        if not any(id(s) not in kept for s in schedulers_of(self.optimizer)):
            return
        gc.collect()  # a scheduler the loop dropped may live on in a reference cycle until collected
        unkept = [s for s in schedulers_of(self.optimizer) if id(s) not in kept]
        if not unkept:
            return
        named = ", ".join(_describe(s) for s in unkept)
        given = (
            f" (besides the one given, {type(self.scheduler).__name__})" if self.scheduler is not None else ""
        )
        raise ConfigError(
            f"the optimizer has a learning-rate scheduler the guardian was not given: {named}{given}. A "
            "resume or a rollback would restore the learning rate but restart its schedule. Give it as "
            "Guardian(scheduler=...) when it steps once per optimizer step (the guardian then steps it; "
            "several go in one ChainedScheduler or SequentialLR, given as the one scheduler), or keep "
            'stepping it in the loop (per epoch) and call guardian.track("scheduler", scheduler) with it '
            "so that checkpoints keep it"
        )

    def backward(self, loss: torch.Tensor) -> None:
        """Backward ``loss`` (scaled by the GradScaler when there is one). Raises ConfigError when ``loss``
        is not a loss autograd can backward (``check_loss``)."""
        check_loss(loss)
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

    def loss_scale(self) -> torch.Tensor | None:
        """The GradScaler's current scale (a tensor on its device, no host sync), None without one."""
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        return self.scaler._scale

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's part of every gradient there is (a DTensor's local tensor, sharing its storage)."""
        return [local_tensor(g) for p in self.params if (g := p.grad) is not None]

    def norm_contribution(self, world_size: int) -> torch.Tensor:
        """This rank's share of the squared global gradient norm, as a 0-dim float64 tensor: the sum of
        squares of its local gradients, each divided by how many ranks hold the same values
        (``sharding.copies_of``), so that summed over the world every value counts once. NaN or inf
        when any local gradient holds one. No collective: the caller sums it in its own."""
        groups: dict[int, list[torch.Tensor]] = {}
        for param in self.params:
            if param.grad is not None:
                groups.setdefault(copies_of(param, world_size), []).append(local_tensor(param.grad))
        parts = [
            torch.nn.utils.get_total_norm(grads, foreach=True).double().square() / copies
            for copies, grads in groups.items()
        ]
        if not parts:
            return torch.zeros((), dtype=torch.float64)
        total = parts[0]
        for part in parts[1:]:
            total = total + part.to(total.device)
        return total

    def apply_update(
        self,
        norm: float,
        max_norm: float | None,
        grads: Sequence[torch.Tensor],
        norm_tensor: torch.Tensor,
        *,
        lr_scale: float = 1.0,
    ) -> None:
        """Clip ``grads`` (this rank's local gradients) with the total ``norm`` when it exceeds
        ``max_norm`` (None: never), step the optimizer with every learning rate scaled by ``lr_scale``,
        step the scaler and the scheduler, and zero the gradients.

        The scale applies for the optimizer step only: the param groups keep the learning rates the loop
        or its scheduler set, so a loop that writes ``param_group["lr"]`` every iteration keeps the
        remediation, and a scheduler computes from the unscaled rates.
        """
        if max_norm is not None and norm > max_norm:
            clip_with_norm(grads, max_norm, norm_tensor)
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
        if _progress(scheduler) != self._scheduler_epoch:
            error = ConfigError(
                "the training loop steps the scheduler itself (its last_epoch is "
                f"{_shown(_progress(scheduler))}, the guardian stepped it to "
                f"{_shown(self._scheduler_epoch)}): guardian.step() steps the scheduler it was given; "
                "remove the loop's scheduler.step(), or do not pass scheduler="
            )
            self._report(error)
            raise error
        scheduler.step()
        self._scheduler_epoch = _progress(scheduler)

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
            self._scheduler_epoch = _progress(self.scheduler)
        if self.scaler is not None and small.get("scaler") is not None:
            self.scaler.load_state_dict(small["scaler"])

    def nonfinite_flag(self) -> torch.Tensor:
        """1.0 when any value of the whole state (parameters, buffers, optimizer state, scheduler and
        scaler) is NaN or infinite, else 0.0: one fused reduction per device (``finite.nonfinite_flag``)."""
        return nonfinite_flag(
            self.module.state_dict(), self.optimizer.state_dict()["state"], self.small_state()
        )

    def state(self) -> dict[str, Any]:
        """Model, optimizer, scheduler and scaler state, and the model's name of each optimizer parameter,
        for a checkpoint. A sharded model's tensors are DTensors (this rank's shards)."""
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "param_names": list(self.param_names),
            **self.small_state(),
        }

    def maybe_nonfinite_flag(self) -> torch.Tensor:
        """``nonfinite_flag``'s fast screen over the same state (``finite.maybe_nonfinite_flag``): 0.0
        proves it finite; 1.0 means it may not be, and only ``nonfinite_flag`` can tell."""
        return maybe_nonfinite_flag(
            self.module.state_dict(), self.optimizer.state_dict()["state"], self.small_state()
        )

    def stable_storage(self) -> set[int]:
        """The storage of the parameters and the optimizer state: what changes only in the optimizer
        step, so that a copy of it may overlap the next forward and backward passes."""
        return stable_storage(self.module, self.optimizer.state_dict())

    def shard_state(self) -> dict[str, Any]:
        """The sharded tensors of ``state()`` this rank writes to a checkpoint beside rank 0's (the first
        replica of each shard: ``sharding.writes_shard``), under the same names; empty for a replicated
        model."""
        if not self.sharded:
            return {}
        optimizer = self.optimizer.state_dict()["state"]
        return {
            "model": {k: v for k, v in self.module.state_dict().items() if writes_shard(v)},
            "optimizer": {
                "state": {
                    index: {k: v for k, v in entry.items() if writes_shard(v)}
                    for index, entry in optimizer.items()
                }
            },
        }

    def load(self, state: dict[str, Any]) -> None:
        """Load a checkpoint's ``state()``. Raises StateMismatch saying which part does not fit.

        Saved tensors may be plain or ``sharding.Readable`` (not read yet); each is read as the live model
        holds it: for a sharded parameter only this rank's box, whatever the world size that saved it.
        """
        saved = state.get("model")
        if not isinstance(saved, dict):
            raise StateMismatch("holds no model state")
        live = self.module.state_dict()
        fitted = fit_keys(saved, live)
        mismatch = describe_mismatch(fitted, live)
        if mismatch:
            raise StateMismatch(f"does not fit this model: {mismatch}")
        self._check_param_names(state.get("param_names"))
        # Read first (a damaged file raises CheckpointError, not a mismatch), then load.
        model_state = {key: fit_to(value, live.get(key)) for key, value in fitted.items()}
        optimizer_state = self._fit_optimizer(state.get("optimizer"))
        try:
            self.module.load_state_dict(model_state)
        except (RuntimeError, KeyError, TypeError) as exc:
            raise StateMismatch(f"does not fit this model: {exc}") from exc
        try:
            self.optimizer.load_state_dict(optimizer_state)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise StateMismatch(f"does not fit this optimizer: {exc}") from exc
        self.load_small_state(state)

    def _check_param_names(self, saved: Any) -> None:
        """Where a checkpoint and this optimizer both name a parameter, the names must be the same."""
        if not isinstance(saved, list):
            return
        differ = [
            f"{index}: checkpoint {s!r}, live {live!r}"
            for index, (s, live) in enumerate(zip(saved, self.param_names, strict=False))
            if s is not None and live is not None and s != live
        ]
        if not differ:
            return  # the count is the optimizer's own check; a parameter the model lacks has no name
        raise StateMismatch(
            "does not fit this optimizer: its parameters are in another order or of another model ("
            + "; ".join(differ[:_SHOWN])
            + ")"
        )

    def _fit_optimizer(self, saved: Any) -> Any:
        """The optimizer's saved state with each per-parameter tensor read as its parameter is held."""
        if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
            return saved
        fitted_state: dict[Any, Any] = {}
        for index, entry in saved["state"].items():
            param = self.params[index] if isinstance(index, int) and 0 <= index < len(self.params) else None
            if isinstance(entry, dict):
                entry = {key: fit_to(value, param) for key, value in entry.items()}
            fitted_state[index] = entry
        return {**saved, "state": fitted_state}


def clip_with_norm(grads: Sequence[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale ``grads`` in place by ``min(max_norm / (total_norm + 1e-6), 1)``: what
    ``torch.nn.utils.clip_grads_with_norm_`` does, for gradients given as tensors (a sharded parameter's
    local gradients, clipped with the global norm). No host sync."""
    if not grads:
        return
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    with torch.no_grad():
        for (device, _), group in groups.items():
            torch._foreach_mul_(group, coefficient.to(device))


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
