"""Linux's ``prctl(2)`` for the processes that start workers: the local runner and the launcher (a worker
dies with either, even by SIGKILL; the launcher also adopts its workers' orphans)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

#: ``prctl`` options (linux/prctl.h).
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def load_prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, its five arguments typed (an int option, then four unsigned longs), or None off
    Linux or where libc has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child SIGKILLed when this process dies (``PR_SET_PDEATHSIG``), and
    exit 1 at once if it already has; a no-op where there is no ``prctl``.

    Looked up and its arguments built here, in the parent: between fork and exec the child only makes
    the call (no import, no allocation that could wait on a lock another thread of the parent held). The
    kernel sends the signal when the *thread* that forked the child ends: start such children from a
    thread that lives as long as the process (the main thread)."""
    prctl = load_prctl()
    parent = os.getpid()
    arguments = (
        ctypes.c_int(PR_SET_PDEATHSIG),
        ctypes.c_ulong(int(signal.SIGKILL)),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
    )

    def child_setup() -> None:
        if prctl is not None:
            prctl(*arguments)
        if os.getppid() != parent:  # the parent died before the death signal was armed
            os._exit(1)

    return child_setup
