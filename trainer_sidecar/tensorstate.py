"""Nested training state (dicts, lists, tuples of tensors and plain values) as a flat list of tensors.

Snapshots and asynchronous checkpoints both need the same trick: copy every tensor of a state into
host buffers that were allocated once and are reused, because allocating fresh memory on every copy
costs page faults that dwarf the copy itself (``python -m bench.checkpoint`` measures both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Slot:
    """Placeholder for the i-th tensor inside a skeleton."""

    index: int


def flatten(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split ``state`` into a skeleton (the structure, tensors replaced by slots) and its tensors."""
    tensors: list[torch.Tensor] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            tensors.append(node)
            return Slot(len(tensors) - 1)
        if isinstance(node, dict):
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(value) for value in node]
        if isinstance(node, tuple):
            return tuple(walk(value) for value in node)
        return node

    return walk(state), tensors


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuild the nested state of ``flatten`` with ``tensors`` in the slots."""

    def walk(node: Any) -> Any:
        if isinstance(node, Slot):
            return tensors[node.index]
        if isinstance(node, dict):
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(value) for value in node]
        if isinstance(node, tuple):
            return tuple(walk(value) for value in node)
        return node

    return walk(skeleton)


def signature(tensors: list[torch.Tensor]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """Shapes and dtypes: two states with the same signature can share host buffers."""
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


class HostBuffers:
    """Host-memory copies of a list of tensors, allocated on first use and reused while shapes match.

    ``capture`` is the only part a training loop waits for: one copy per tensor into memory that is
    already mapped (pinned when CUDA is present, so device-to-host copies run asynchronously).
    """

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._signature: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()

    @property
    def nbytes(self) -> int:
        """Total bytes held."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def capture(self, sources: list[torch.Tensor]) -> None:
        """Copy ``sources`` into the buffers (reallocating only if shapes or dtypes changed)."""
        sig = signature(sources)
        if sig != self._signature:
            pin = torch.cuda.is_available()
            self.tensors = [
                torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for t in sources
            ]
            self._signature = sig
        detached = [t.detach() for t in sources]
        copy_all(self.tensors, detached)

    def restore_into(self, targets: list[torch.Tensor]) -> None:
        """Copy the buffers back into live tensors of the same signature (in place, no allocation)."""
        if signature(targets) != self._signature:
            raise ValueError("live state no longer matches the captured signature")
        with torch.no_grad():
            copy_all([t.detach() for t in targets], self.tensors)


def copy_all(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair, fused where the devices allow, synchronised once at the end."""
    if not destinations:
        return
    same_device = all(d.device == s.device for d, s in zip(destinations, sources, strict=True))
    foreach_copy: Callable[..., Any] | None = getattr(torch, "_foreach_copy_", None)
    if same_device and foreach_copy is not None:
        foreach_copy(destinations, sources)
    else:
        for dst, src in zip(destinations, sources, strict=True):
            dst.copy_(src, non_blocking=True)
        if any(t.is_cuda for t in (*destinations, *sources)):
            torch.cuda.synchronize()
