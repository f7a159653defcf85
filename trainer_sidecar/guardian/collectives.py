"""The loop's own torch.distributed collectives, seen waiting.

A rank blocked in a collective the guardian did not issue (the loop's all-reduce of its sample count or
of a metric, its optimizer's broadcast) read as its own work, and a hang beside it was blamed on it
rather than on the rank it waited for. While a guardian runs, ``torch.distributed.Work.wait`` is wrapped
(``watch``): a wait on the guardian's training thread marks ``Activity.LOOP_COLLECTIVE`` on its tracker
until it returns, then gives back the activity it interrupted as it was (its start unchanged, the wait
not counted as own work: ``ActivityTracker.resume``).

Why the work's wait and not each public function: every collective and point-to-point call of the
Python API ends in its work's ``wait()`` (a synchronous call waits itself before returning;
``async_op=True`` hands the work to the loop, which waits later), so one wrapper sees them all, under
whatever name the loop imported them, the object, coalesced and ``*_into_tensor`` variants included, and
an async call's issue (which does not wait) is not taken for a wait. Not seen: DDP's gradient all-reduce
(in C++, inside the backward pass, which is marked as before), functional collectives (C++
``wait_tensor``), gloo's ``monitored_barrier`` (it blocks in C++), a backend that blocks in the call
itself, a wait on another thread than the one that made the guardian. FSDP's waits on the training
thread (its forward pass's all-gather) are seen, as the waits they are.

GPU: under NCCL a work's ``wait()`` only makes the current CUDA stream wait for the collective and
returns (unless ``TORCH_NCCL_BLOCKING_WAIT``); the host blocks later, at the loop's next host sync
(``.item()``, ``.cpu()``), which reads as its own work: a hang beside a NCCL collective of the loop's is
named as before this module. Under gloo the wait is where the host blocks.

Cost: no host sync is added. A wait outside any guardian's thread pays a dictionary lookup; a wait of
the loop's two activity marks (two clock readings). The guardian's own collectives (already marked
``COLLECTIVE``) and its checkpoints (``CHECKPOINT``) keep their marks.

Several guardians: one wrapper is installed for all; each ``watch`` returns a token for its ``unwatch``;
the newest guardian of a thread is the one marked; the original ``wait`` is put back when the last one
ends (unless something wrapped ``wait`` after this module did: then ours stays under it, passing
through).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainer_sidecar.contract.status import Activity
from trainer_sidecar.guardian.activity import ActivityTracker

#: What a wait leaves as marked: the guardian's own collectives and checkpoints, and a wait inside a wait
#: (a synchronous call's own ``wait()`` inside an outer one).
_LEFT_ALONE = frozenset({Activity.COLLECTIVE, Activity.LOOP_COLLECTIVE, Activity.CHECKPOINT})

Wait = Callable[..., Any]


class _Watches:
    """The guardians watched, by token (their thread and tracker), and the ``wait`` this module wrapped."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: list[tuple[object, int, ActivityTracker]] = []
        #: The newest watched tracker of each thread: replaced whole, read by ``wait`` without the lock.
        self.by_thread: dict[int, ActivityTracker] = {}
        self.original: Wait | None = None
        self.wrapper: Wait | None = None

    def refresh(self) -> None:
        """Recompute ``by_thread`` from ``entries`` (under the lock)."""
        self.by_thread = {thread: tracker for _, thread, tracker in self.entries}


_WATCHES = _Watches()


def _work_type() -> Any | None:
    """torch.distributed's ``Work`` (None where this torch has no distributed package)."""
    return getattr(dist, "Work", None) if dist.is_available() else None


def _marking(original: Wait) -> Wait:
    """``original`` (``Work.wait``) with the wait marked on the calling thread's watched tracker."""
    get_ident = threading.get_ident
    is_compiling = torch.compiler.is_compiling

    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        tracker = None if is_compiling() else _WATCHES.by_thread.get(get_ident())
        if tracker is None:
            return original(work, *args, **kwargs)
        entry = tracker.current
        if entry[0] in _LEFT_ALONE:
            return original(work, *args, **kwargs)
        tracker.mark(Activity.LOOP_COLLECTIVE)
        try:
            return original(work, *args, **kwargs)
        finally:
            tracker.resume(entry)

    wait.__doc__ = getattr(original, "__doc__", None)
    wait.__name__ = "wait"
    wait.__wrapped__ = original  # type: ignore[attr-defined]
    return wait


def watch(tracker: ActivityTracker) -> object:
    """Mark the waits of torch.distributed's collectives on the calling thread on ``tracker`` from now
    on (see the module docstring); returns the token ``unwatch`` takes. A no-op without
    torch.distributed."""
    token = object()
    work = _work_type()
    if work is None:
        return token
    with _WATCHES.lock:
        if _WATCHES.original is None:
            _WATCHES.original = work.wait
            _WATCHES.wrapper = _marking(work.wait)
            work.wait = _WATCHES.wrapper
        _WATCHES.entries.append((token, threading.get_ident(), tracker))
        _WATCHES.refresh()
    return token


def unwatch(token: object) -> None:
    """End the watch ``token`` stands for (again, or an unknown token: nothing); the last one puts
    ``Work.wait`` back as it was, unless it was wrapped again since."""
    work = _work_type()
    with _WATCHES.lock:
        _WATCHES.entries = [entry for entry in _WATCHES.entries if entry[0] is not token]
        _WATCHES.refresh()
        if _WATCHES.entries or _WATCHES.original is None or work is None:
            return
        if work.wait is _WATCHES.wrapper:
            work.wait = _WATCHES.original
        _WATCHES.original = _WATCHES.wrapper = None


def watching() -> bool:
    """Whether some guardian's watch is on (``Work.wait`` wrapped by this module)."""
    return bool(_WATCHES.entries)
