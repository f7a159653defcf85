"""NaN localisation: which module's output went non-finite first.

Hooks are registered only after an anomaly ("armed"), so the training hot path pays nothing. Armed,
every module's forward output is checked (one host sync per module: acceptable for the one forward
that is being diagnosed); modules finish innermost-first, so the first hit is where the NaN was born.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle


def _nonfinite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return bool(value.is_floating_point() and not torch.isfinite(value).all())
    if isinstance(value, (list, tuple)):
        return any(_nonfinite(v) for v in value)
    if isinstance(value, dict):
        return any(_nonfinite(v) for v in value.values())
    return False


class NaNLocator:
    """Finds the first module (by qualified name) whose forward output held a NaN or an Inf."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.found: str | None = None
        self._handles: list[RemovableHandle] = []
        self._budget = 0

    @property
    def armed(self) -> bool:
        """Whether hooks are currently installed."""
        return bool(self._handles)

    def arm(self) -> None:
        """Install the hooks; the next forward passes are inspected until ``disarm``."""
        if self.armed:
            return
        self.found = None
        for name, module in self.model.named_modules():
            label = name or type(module).__name__

            def hook(_module: torch.nn.Module, _inputs: Any, output: Any, label: str = label) -> None:
                if self.found is None and _nonfinite(output):
                    self.found = label

            self._handles.append(module.register_forward_hook(hook))

    def disarm(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def locate(self, forward: Callable[[], Any]) -> str | None:
        """Run ``forward`` once (without gradients) with hooks armed; return the first non-finite module."""
        self.arm()
        try:
            with torch.no_grad():
                forward()
        finally:
            self.disarm()
        return self.found

    def after_nonfinite_loss(self, replay: Callable[[], Any] | None, budget: int) -> str | None:
        """A step's loss was non-finite: with ``replay`` (the step's forward pass), the module whose output
        went non-finite first, at once; without, arm the hooks to inspect the next ``budget`` forward
        passes (``after_good_step`` collects what they found) and return None."""
        if replay is not None:
            return self.locate(replay) or "(no module output: the loss itself)"
        self.arm()
        self._budget = budget
        return None

    def after_good_step(self) -> str | None:
        """While armed: what the inspected forward passes found (disarming), or None (disarming once the
        budget of steps is spent)."""
        if not self.armed:
            return None
        if self.found is not None:
            self.disarm()
            return self.found
        self._budget -= 1
        if self._budget <= 0:
            self.disarm()
        return None
