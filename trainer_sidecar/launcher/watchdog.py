"""The launcher's watchdog: whatever kills ``trainguard-launch``, the processes it started die with it.

The launcher's own children (the worker, its warm spare) carry a parent-death signal: the kernel
SIGKILLs them when the launcher dies, even by SIGKILL. Their own children do not: a data loader's
workers, torchrun's workers (each in a session of its own), anything the worker started. Inside the
container's PID namespace, where the launcher is PID 1, its death ends them all; outside one they would
be reparented to PID 1 and go on training, unsupervised, beside whatever starts next.

So where the launcher is not PID 1 it starts this watchdog, in a session of its own (a signal to the
launcher's process group misses it) and without a parent-death signal, holding the read end of a pipe
whose only write end the launcher holds; and it sets ``LAUNCH_TREE_ENV`` to a marker of its own, random,
in the environment of every process it starts, which their descendants inherit. End of file on the pipe
means the launcher is gone (the kernel closes its descriptors however it ended): the watchdog SIGKILLs
every process that carries the marker, sweeping again until several sweeps in a row find none, and
exits. The launcher's own exit ends the pipe too: by then it has reaped its worker's tree, and the sweep
finds nothing. Stop signals (SIGINT, SIGTERM, SIGHUP) are ignored: the watchdog ends when the launcher
does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys

from trainer_sidecar.contract.env import LAUNCH_TREE_ENV
from trainer_sidecar.contract.procs import sweep_marked

_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def wait_for_end(read_fd: int) -> None:
    """Read ``read_fd`` until end of file (what is written is not meant: only the end is)."""
    while True:
        try:
            if not os.read(read_fd, 4096):
                return
        except InterruptedError:
            continue


def main(argv: list[str] | None = None) -> int:
    """Wait for the launcher's end on standard input, then sweep its tree (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="trainguard-launch-watchdog")
    parser.add_argument("--tree", required=True, help=f"the launcher's {LAUNCH_TREE_ENV} marker")
    args = parser.parse_args(argv)
    if not args.tree:
        parser.error("--tree: the marker must not be empty")
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    wait_for_end(sys.stdin.fileno())
    killed = sweep_marked(LAUNCH_TREE_ENV, [args.tree])
    if killed:
        with contextlib.suppress(OSError):
            print(
                f"trainguard-launch watchdog: the launcher ended; killed {len(killed)} process(es) it left:",
                killed,
                file=sys.stderr,
                flush=True,
            )
    return 0


def start_watchdog(tree: str, executable: str = sys.executable) -> tuple[subprocess.Popen[bytes], int]:
    """Start the watchdog of the tree marked ``tree``; it and the write end of its pipe (to hold open for
    the launcher's life, never passed to a child). OSError if it cannot start."""
    read_fd, write_fd = os.pipe()  # both non-inheritable: no child of the launcher holds the write end
    try:
        proc = subprocess.Popen(
            [executable, "-m", "trainer_sidecar.launcher.watchdog", "--tree", tree],
            stdin=read_fd,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    return proc, write_fd


if __name__ == "__main__":
    raise SystemExit(main())
