"""In-memory snapshots of model and optimizer state, restored in place for a fast rollback.

A snapshot copies every tensor into host buffers allocated once and reused, and keeps the small
non-tensor state (learning rates, scheduler and scaler state, the state of what the loop gave
``guardian.track``) as plain values. Of a sharded model (FSDP2 DTensors) it holds this rank's shards
only, and restores into them in place. Restoring copies the buffers back into the live tensors, so the
optimizer keeps its own storage and nothing is reallocated.

The loop's own state (its tracked objects, and the learning rates in the optimizer's param groups) is
taken when the next step begins (``complete_loop_state``; the guardian's recovery also asks for it before
a rollback that comes first, and leaves the tracked objects out of the capture, so they are copied once):
what the loop does between two steps (a per-epoch ``scheduler.step()``, a best score after an evaluation)
belongs with the weights of the step before, so a rollback restores a learning rate and a tracked
scheduler that agree.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer_sidecar.tensors.sharding import local_tensor
from trainer_sidecar.tensors.tensorstate import HostBuffers, Slot, flatten, signature, unflatten


@dataclass
class Snapshot:
    """The last clean state of model, optimizer, scheduler and scaler, plus the guardian's step counters."""

    step: int = -1
    extra: dict[str, Any] = field(default_factory=dict)
    _buffers: HostBuffers = field(default_factory=HostBuffers)
    _skeleton: Any = None
    _small: dict[str, Any] = field(default_factory=dict)
    _loop_state_pending: bool = False

    @property
    def taken(self) -> bool:
        """Whether a snapshot exists to roll back to."""
        return self.step >= 0

    @property
    def nbytes(self) -> int:
        """Host memory held by the snapshot's tensors."""
        return self._buffers.nbytes

    def capture(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        small_state: dict[str, Any],
        extra: dict[str, Any],
        *,
        background: bool = False,
    ) -> None:
        """Copy the live state into the snapshot (the only cost the training loop pays).

        With ``background``, parameters and optimizer state are copied while the loop goes on, and the
        caller must ``settle`` before they next change (the optimizer step); buffers, which a forward
        pass may update, are copied before this returns. A sharded model's snapshot holds this rank's
        shards only."""
        optimizer_state = optimizer.state_dict()
        skeleton, tensors = flatten({"model": model.state_dict(), "optimizer": optimizer_state})
        stable = stable_storage(model, optimizer_state) if background else None
        self._buffers.capture(tensors, stable)
        self._skeleton = skeleton
        self._small = copy.deepcopy(small_state)
        self.extra = copy.deepcopy(extra)
        self.step = step
        self._loop_state_pending = True

    def complete_loop_state(
        self, tracked: Callable[[], dict[str, Any]], optimizer: torch.optim.Optimizer
    ) -> None:
        """Once after each capture, when the next step begins: take the loop's tracked state (``tracked()``,
        into ``extra["tracked"]``) and the optimizer's non-tensor hyperparameters (its learning rates)
        again, as the loop left them after the captured step; any other step costs one test. No tensor is
        copied to the host."""
        if not self._loop_state_pending or not self.taken:
            return
        self._loop_state_pending = False
        self.extra["tracked"] = copy.deepcopy(tracked())
        saved_groups = self._skeleton["optimizer"]["param_groups"]
        for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
            for key in saved:
                # Tensor-valued hyperparameters are the buffers' (copied at the capture).
                if key != "params" and not isinstance(saved[key], Slot) and key in group:
                    saved[key] = copy.deepcopy(group[key])

    def settle(self) -> bool:
        """Order a background copy before any change of the live state (see ``PendingCopy.settle``).

        Returns True when the state had already changed in place since the capture; the snapshot then
        copies it again, whole, as it is now (a consistent state to roll back to, the loop's change
        included)."""
        pending = self._buffers.pending
        changed = pending.settle()
        if changed:
            pending.recopy()
        return changed

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Put the snapshot back into ``model`` and ``optimizer``; returns the small state to re-apply."""
        if not self.taken:
            raise RuntimeError("no snapshot to restore")
        self._buffers.wait()
        live_skeleton, live = flatten({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        if signature(live) == signature(self._buffers.tensors) and _same_keys(live_skeleton, self._skeleton):
            self._buffers.restore_into(live)
            saved_groups = self._skeleton["optimizer"]["param_groups"]
            for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
                for key, value in saved.items():
                    # Tensor-valued hyperparameters (a tensor lr) were already copied back in place.
                    if key != "params" and not isinstance(value, Slot):
                        group[key] = copy.deepcopy(value)
        else:
            # The optimizer created state after the snapshot (for example its first step): load a copy.
            state = unflatten(self._skeleton, self._buffers.rebuilt())
            model.load_state_dict(state["model"])
            optimizer.state.clear()
            optimizer.load_state_dict(state["optimizer"])
        return copy.deepcopy(self._small)


def stable_storage(model: torch.nn.Module, optimizer_state: dict[str, Any]) -> set[int]:
    """The storage (``data_ptr``) of every parameter's and optimizer state tensor's local tensor: what
    changes only in the optimizer step, so a copy of it may run while a forward and backward pass do."""
    _, state_tensors = flatten(optimizer_state.get("state", {}))
    tensors = [*model.parameters(), *state_tensors]
    return {local.data_ptr() for local in map(local_tensor, tensors) if local.numel()}


def _same_keys(a: Any, b: Any) -> bool:
    """Structural equality of two skeletons, ignoring plain values (learning rates may differ)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_keys(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_keys(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) or not isinstance(a, (dict, list, tuple))
