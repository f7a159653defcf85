"""The runner's watchdog: whatever kills ``trainguard run``, its gangs die with it.

The parent-death signal (``launch.spawn``) reaches only the runner's own children. A launcher between the
runner and the workers (torchrun, whether the runner starts it for ``nprocPerNode`` above 1 or the user's
command runs it) starts each worker in a session of its own: when the runner is killed with SIGKILL,
the kernel kills the launcher and the workers go on training, unsupervised.

The watchdog is a small process of its own session (not a child the kernel kills with the runner) that
holds the read end of a pipe whose only write end the runner holds. The runner tells it, one line each:

- ``gang <id>``: the marker (``launch.GANG_ENV``) the processes of a new attempt will carry, written
  before any of them starts;
- ``done``: the runner has stopped its gang itself; the watchdog exits without killing anything.

End of file without ``done`` means the runner died (the kernel closes its descriptors whatever killed
it): the watchdog SIGKILLs every process that carries one of the gang markers it was told, and sweeps
again until none is left (a process forking while it is killed), for at most ``SWEEP_SECONDS``. A gang
marker is random per attempt, so the sweep can never hit another run's processes, even one of the same
job started the moment the lock was free. Stop signals (Ctrl-C at the terminal, SIGTERM, SIGHUP) are
ignored: the watchdog ends when the runner does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from typing import IO, Any

from trainer_sidecar.contract.env import GANG_ENV
from trainer_sidecar.contract.procs import sweep_marked
from trainguard.local.launch import STOP_SIGNALS

#: How long the watchdog keeps sweeping for processes of a dead runner's gangs.
SWEEP_SECONDS = 10.0
_DONE = "done"
_GANG = "gang "


def sweep(gangs: set[str], *, seconds: float = SWEEP_SECONDS) -> list[int]:
    """SIGKILL every process carrying one of the ``gangs`` markers until several sweeps in a row find none
    (or ``seconds`` passed); the PIDs killed."""
    return sweep_marked(GANG_ENV, gangs, seconds=seconds)


def watch(stream: IO[bytes]) -> list[int]:
    """Read the runner's lines from ``stream`` until ``done`` (returns []) or end of file (the runner
    died: sweeps its gangs and returns the PIDs killed)."""
    gangs: set[str] = set()
    for raw in stream:
        line = raw.decode(errors="replace").strip()
        if line == _DONE:
            return []
        if line.startswith(_GANG) and line[len(_GANG) :]:
            gangs.add(line[len(_GANG) :])
    return sweep(gangs)


def main(argv: list[str] | None = None) -> int:
    """Watch the runner through standard input (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="trainguard-watchdog")
    parser.add_argument("--run-of", default="", help="the checkpoint directory of the run (for ps only)")
    parser.parse_args(argv)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    killed = watch(sys.stdin.buffer)
    if killed:
        with contextlib.suppress(OSError):
            print(
                f"trainguard watchdog: the runner died; killed {len(killed)} process(es) of its gang:",
                killed,
                file=sys.stderr,
                flush=True,
            )
    return 0


class Watchdog:
    """The runner's side: start the watchdog, announce each gang, say ``done`` at the end.

    ``announce`` before a gang's first process starts; ``close`` once the gang is stopped (it waits for
    the watchdog to exit, so nothing of the run outlives it). If the watchdog cannot be started or has
    died, announcing fails quietly: the runner's other safeguards (the parent-death signal, killing what
    an earlier run left) still hold, and ``alive`` says so.
    """

    def __init__(self, proc: subprocess.Popen[Any] | None, write_fd: int) -> None:
        self.proc = proc
        self._fd = write_fd

    @classmethod
    def start(cls, run_of: str) -> Watchdog:
        """Start a watchdog in a session of its own, reading a pipe only this process can write to."""
        read_fd, write_fd = os.pipe()  # both non-inheritable: no other child ever holds the write end
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "trainguard.local.watchdog", "--run-of", run_of],
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # not in the runner's process group: a Ctrl-C or killpg misses it
            )
        except OSError:
            os.close(write_fd)
            return cls(None, -1)
        finally:
            os.close(read_fd)
        return cls(proc, write_fd)

    @property
    def alive(self) -> bool:
        """Whether the watchdog is running."""
        return self.proc is not None and self.proc.poll() is None and self._fd >= 0

    def announce(self, gang: str) -> bool:
        """Tell the watchdog the marker of a gang about to start; False if it could not be told."""
        return self._send(f"{_GANG}{gang}\n")

    def close(self, timeout: float = 5.0) -> None:
        """Tell the watchdog the runner stopped its gang itself, and wait for it to exit."""
        self._send(f"{_DONE}\n")
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.proc is not None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _send(self, line: str) -> bool:
        if self._fd < 0:
            return False
        try:
            os.write(self._fd, line.encode())
        except OSError:  # the watchdog died (EPIPE): SIGPIPE is ignored in Python
            return False
        return True


if __name__ == "__main__":
    raise SystemExit(main())
