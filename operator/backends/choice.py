"""Every backend by its kind, and which one a job runs as. Pure."""

from __future__ import annotations

from collections.abc import Callable

from trainguard_operator.backends import Backend
from trainguard_operator.backends.pytorchjob import PYTORCHJOB
from trainguard_operator.backends.trainjob import TRAINJOB

#: The backends, in the order ``spec.backend: Auto`` prefers them (PyTorchJob first: a cluster that has
#: both runs a job as it did before there were two).
BACKENDS: dict[str, Backend] = {PYTORCHJOB.kind: PYTORCHJOB, TRAINJOB.kind: TRAINJOB}
AUTO = "Auto"


def backend_of(kind: str | None) -> Backend:
    """The backend of ``kind`` as a status records it (unset, or unknown to this operator: PyTorchJob,
    the one backend before there were two)."""
    return BACKENDS.get(kind or "", PYTORCHJOB)


def choose(
    asked: str, recorded: str | None, started: bool, served: Callable[[str], bool]
) -> tuple[Backend | None, tuple[Backend, ...]]:
    """The backend a job runs as, and the backends it waits for when there is none.

    ``recorded``: the one its status records (``started``: it has an attempt already, so unset means
    PyTorchJob); otherwise ``asked`` (``spec.backend``), or for Auto the first of ``BACKENDS`` whose
    CRD the cluster serves (``served(kind)``). A backend whose CRD is not served is no choice: the job
    waits for it (for Auto, for any)."""
    if recorded or started:
        fixed: Backend | None = backend_of(recorded)
    else:
        fixed = BACKENDS.get(asked)
    if fixed is not None:
        return (fixed, ()) if served(fixed.kind) else (None, (fixed,))
    for backend in BACKENDS.values():
        if served(backend.kind):
            return backend, ()
    return None, tuple(BACKENDS.values())
