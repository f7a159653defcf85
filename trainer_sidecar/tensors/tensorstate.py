"""Nested training state (dicts, lists, tuples of tensors and plain values) as a flat list of tensors.

Snapshots and asynchronous checkpoints both need the same trick: copy every tensor of a state into
host buffers that were allocated once and are reused, because allocating fresh memory on every copy
costs page faults that dwarf the copy itself (``python -m bench.checkpoint`` measures both). And as
parameters and optimizer state change only in the optimizer step, their copy can run while the next
forward and backward passes do (``PendingCopy``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from trainer_sidecar.tensors.sharding import Layout, layout_of, local_tensor


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


def unflatten(skeleton: Any, tensors: Sequence[Any]) -> Any:
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
    """Local shapes and dtypes: two states with the same signature can share host buffers (a DTensor
    counts by its local tensor, this rank's shard)."""
    return tuple((tuple(local.shape), local.dtype) for local in map(local_tensor, tensors))


_COPIER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-copy")


class PendingCopy:
    """Copies into host buffers that may still be running, started by ``HostBuffers.capture``.

    On a CUDA device they run on a side stream into pinned buffers, and an event marks their end; on
    the CPU they run in a background thread. ``wait`` makes the host wait until the buffers hold the
    values; ``settle`` is what must happen before the sources change (before the next optimizer step):
    the current CUDA stream waits for the event (no host sync), and the host waits for a CPU copy.

    Whether that contract was kept is checked, not assumed: each source's version counter (which every
    in-place change bumps) is recorded at capture. ``settle`` reports a source changed in place before it
    (by the training loop, between steps), the same way on every rank whatever the copy's progress.
    ``landed_whole`` tells a consumer of the buffers on another thread (the checkpoint writer) whether
    the copy is certainly free of such a change.
    """

    def __init__(
        self,
        future: Future[None] | None = None,
        event: Any = None,
        device: torch.device | None = None,
        sources: Sequence[torch.Tensor] = (),
        destinations: Sequence[torch.Tensor] = (),
    ) -> None:
        self._future = future
        self._event = event
        self._device = device
        self._sources = list(sources)
        self._destinations = list(destinations)
        self._versions = [source._version for source in self._sources]
        self._lock = threading.Lock()
        self._settled = not self._sources
        self._changed = False

    @property
    def done(self) -> bool:
        """Whether nothing is left to wait for (never blocks)."""
        cpu_done = self._future is None or self._future.done()
        return cpu_done and (self._event is None or bool(self._event.query()))

    def wait(self) -> None:
        """Block until every copy has landed in the host buffers (re-raising a copy's error)."""
        if self._future is not None:
            self._future.result()
        if self._event is not None:
            self._event.synchronize()

    def settle(self) -> bool:
        """Order the copies before any later change of their sources: the current CUDA stream waits for
        the side stream's event (the host does not), and the host waits for a copy on the CPU.

        Returns True from the call that finds a source changed in place since the capture (the buffers
        may then hold part of that change), False from every other call."""
        if self._future is not None:
            self._future.result()
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        with self._lock:
            if self._settled:
                return False
            self._settled = True
            self._changed = self._any_source_changed()
            if not self._changed:
                self._forget_sources()  # hold no live tensor longer than needed
            return self._changed

    def landed_whole(self) -> bool:
        """Block until the copies have landed; True unless a source may have changed in place before they
        did. Before ``settle``, no version moved by now means the copy finished first (a later change is
        harmless); after it, ``settle``'s verdict stands (the optimizer step may have moved them since)."""
        self.wait()
        with self._lock:
            return not (self._changed if self._settled else self._any_source_changed())

    def recopy(self) -> None:
        """Copy the sources into the buffers again, synchronously, after a ``settle`` that found them
        changed: the buffers then hold the sources as they are now, whole."""
        self.wait()
        with self._lock:
            copy_all(self._destinations, self._sources)
            self._forget_sources()
            self._changed = False

    def _forget_sources(self) -> None:
        self._sources, self._destinations, self._versions = [], [], []

    def _any_source_changed(self) -> bool:
        pairs = zip(self._sources, self._versions, strict=True)
        return any(source._version != version for source, version in pairs)


DONE = PendingCopy()
"""A copy with nothing left to wait for."""


class HostBuffers:
    """Host-memory copies of a list of tensors, allocated on first use and reused while shapes match.

    ``capture`` is the only part a training loop waits for. Tensors it is told are stable (they change
    only in the optimizer step: parameters and optimizer state) are copied in the background while the
    loop runs its next forward and backward passes (see ``PendingCopy``); the others (buffers that a
    forward pass updates, generator states) are copied at once. Buffers are pinned when CUDA is present,
    so device-to-host copies run asynchronously. A DTensor is copied by its local tensor (this rank's
    shard), and its layout kept (``layouts``) to wrap it back.
    """

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        #: Each captured source's DTensor layout (None for a plain tensor), from the last capture.
        self.layouts: list[Layout | None] = []
        self._signature: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()
        self._pending = DONE

    @property
    def nbytes(self) -> int:
        """Total bytes held."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def pending(self) -> PendingCopy:
        """The copies of the last capture (``DONE`` once nothing is left of them)."""
        return self._pending

    def capture(self, sources: list[torch.Tensor], stable: set[int] | None = None) -> PendingCopy:
        """Copy ``sources`` into the buffers (reallocating only if shapes or dtypes changed).

        ``stable``: the ``data_ptr`` of the local tensors that do not change before the caller settles
        the returned copy (``PendingCopy.settle``); those are copied in the background. Without it,
        every copy has landed when this returns.
        """
        self._pending.wait()  # never write into buffers a previous copy is still filling
        sig = signature(sources)
        if sig != self._signature:
            pin = torch.cuda.is_available()
            self.tensors = [
                torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin) for shape, dtype in sig
            ]
            self._signature = sig
        self.layouts = [layout_of(t) for t in sources]
        locals_ = [local_tensor(t).detach() for t in sources]
        now = [i for i, t in enumerate(locals_) if not (stable and t.numel() and t.data_ptr() in stable)]
        later = sorted(set(range(len(locals_))) - set(now))
        copy_all([self.tensors[i] for i in now], [locals_[i] for i in now])
        self._pending = _start_copy([self.tensors[i] for i in later], [locals_[i] for i in later])
        return self._pending

    def wait(self) -> None:
        """Block until the last capture's copies have landed."""
        self._pending.wait()

    def restore_into(self, targets: list[torch.Tensor]) -> None:
        """Copy the buffers back into live tensors of the same signature (in place, no allocation; a
        DTensor's local tensor is written)."""
        self._pending.wait()
        if signature(targets) != self._signature:
            raise ValueError("live state no longer matches the captured signature")
        with torch.no_grad():
            copy_all([local_tensor(t).detach() for t in targets], self.tensors)

    def rebuilt(self) -> list[torch.Tensor]:
        """Fresh copies of the buffers, each a DTensor again where its source was one."""
        self._pending.wait()
        return [
            layout.wrap(t.clone()) if layout is not None else t.clone()
            for t, layout in zip(self.tensors, self.layouts, strict=True)
        ]


def _start_copy(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> PendingCopy:
    """Start copying ``sources`` into ``destinations`` in the background (see ``PendingCopy``)."""
    if not destinations:
        return DONE
    cuda = [i for i, s in enumerate(sources) if s.is_cuda]
    event, device = None, None
    if cuda:
        device = sources[cuda[0]].device
        side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for i in cuda:
                destinations[i].copy_(sources[i], non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(side)
    rest = [i for i in range(len(sources)) if not sources[i].is_cuda]
    future = None
    if rest:
        future = _COPIER.submit(copy_all, [destinations[i] for i in rest], [sources[i] for i in rest])
    return PendingCopy(future, event, device, sources, destinations)


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
