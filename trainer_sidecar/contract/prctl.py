"""Linux's ``prctl(2)`` for the processes that start workers: the local runner (a worker dies with it)
and the launcher (it adopts its workers' orphans)."""

from __future__ import annotations

import ctypes
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
