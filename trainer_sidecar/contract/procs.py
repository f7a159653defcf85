"""Finding the processes a runner or a launcher started by the marker in their environment, and ending them.

A process's environment as it was started (``/proc/PID/environ``) is inherited by everything it starts,
whatever session or process group that is in, and whoever its parent becomes once its own has died: a
random marker set in a worker's environment finds the worker's whole tree (a data loader's workers,
torchrun's workers in sessions of their own), short of a process that starts a child with an
environment of its own making.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable

#: How long ``sweep_marked`` keeps looking by default, and how many empty looks in a row end it.
SWEEP_SECONDS = 10.0
_SWEEP_PAUSE = 0.05
_QUIET_SWEEPS = 3


def marked_processes(name: str, value: str) -> list[int]:
    """The live processes (this one excepted) whose environment holds ``name=value`` ([] for an empty
    ``value``; processes not ours to read are not seen)."""
    if not value:
        return []
    marker = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read()
        except OSError:  # gone, or not ours to read
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry))
    return found


def kill_marked(name: str, value: str) -> list[int]:
    """SIGKILL every process ``marked_processes`` finds; the PIDs signalled."""
    pids = marked_processes(name, value)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return pids


def sweep_marked(name: str, values: Iterable[str], *, seconds: float = SWEEP_SECONDS) -> list[int]:
    """SIGKILL every process whose ``name`` is one of ``values`` until several looks in a row find none
    (a process forking while it is killed) or ``seconds`` passed; the PIDs killed."""
    markers = sorted(set(values))
    killed: list[int] = []
    quiet = 0
    deadline = time.monotonic() + seconds
    while quiet < _QUIET_SWEEPS and time.monotonic() < deadline:
        found = [pid for value in markers for pid in kill_marked(name, value)]
        killed.extend(pid for pid in found if pid not in killed)
        quiet = 0 if found else quiet + 1
        time.sleep(_SWEEP_PAUSE)
    return killed
