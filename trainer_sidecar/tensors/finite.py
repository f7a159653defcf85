"""Whether a whole training state is finite, in one fused reduction per device.

A state is clean only if every floating value in it is finite: parameters, buffers (a BatchNorm running
mean is not a parameter, and a NaN there poisons evaluation), optimizer moments (a NaN in Adam's
``exp_avg_sq`` poisons the next update), scheduler and scaler values. The check runs where a state is
saved (a snapshot, a checkpoint), never on every step: it reads the whole state once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from trainer_sidecar.tensors.sharding import local_tensor


def _leaves(state: Any) -> Iterable[Any]:
    stack = [state]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        else:
            yield node


def nonfinite_flag(*states: Any) -> torch.Tensor:
    """A 0-dim float tensor on the CPU: 1.0 if any floating value in ``states`` (nested dicts, lists and
    tuples of tensors and numbers) is NaN or infinite, else 0.0.

    Tensors are reduced with one ``_foreach_norm(ord=inf)`` per device (the maximum absolute value, which
    is NaN or inf exactly when the tensor holds one, and never overflows), so the caller pays one host
    sync when it reads the flag, not one per tensor. A DTensor counts by its local tensor (this rank's
    shard): no collective here; the caller agrees on the flag with the other ranks.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    plain_bad = False
    for leaf in (leaf for state in states for leaf in _leaves(state)):
        if isinstance(leaf, torch.Tensor):
            leaf = local_tensor(leaf)
            if leaf.is_complex():
                leaf = torch.view_as_real(leaf)
            if leaf.is_floating_point() and leaf.numel():
                by_device.setdefault(leaf.device, []).append(leaf.detach())
        elif isinstance(leaf, float) and not math.isfinite(leaf):
            plain_bad = True
    flags = [torch.tensor(float(plain_bad))]
    for tensors in by_device.values():
        norms = torch._foreach_norm(tensors, ord=math.inf)
        worst = torch.stack([n.float() for n in norms]).max()
        flags.append((~torch.isfinite(worst)).float().cpu())
    return torch.stack(flags).max()
