"""Starting and stopping the processes of ``trainguard run`` so that none outlives the runner.

- ``spawn`` starts a child in its own session (so its whole process group can be signalled) with a
  parent-death signal: if the runner dies, even by SIGKILL, the kernel kills the child (Linux).
- ``StopSignals`` turns SIGINT, SIGTERM and SIGHUP into a ``Stopped`` exception, but only where the
  runner can clean up: a signal that arrives while a child is being started and registered is held
  back until the child is registered, and one that arrives while the gang is being stopped is noted
  and nothing more (the stop goes on; SIGKILL remains the way to end the runner at once).
- ``resolve_command`` checks the worker's command and working directory before anything starts.
- ``exit_detail`` says why a worker exited: the message of the final status the guardian wrote to its
  termination-message file, else the last lines of its log.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any

from trainer_sidecar.contract.exitcodes import describe_exit, with_detail
from trainer_sidecar.contract.prctl import die_with_parent
from trainer_sidecar.contract.procs import kill_marked as kill_marked
from trainer_sidecar.contract.procs import marked_processes as marked_processes
from trainer_sidecar.contract.status import parse_status

#: Signals that stop a run like Ctrl-C; the exit code is 128 + the signal's number (130, 143, 129).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: How much of a termination message or a log is read to explain an exit.
_READ_LIMIT = 64 * 1024
_DETAIL_LIMIT = 600
_LOG_TAIL_LINES = 3


class RunRefused(Exception):
    """``trainguard run`` cannot start (or go on): the message names the field, file or other run."""


class Stopped(Exception):
    """The runner was asked to stop by a signal."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal number."""
        return 128 + self.signum


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP as ``Stopped``, raised only where the runner can clean up.

    Use as a context manager (the previous handlers come back at exit). While armed, the first stop
    signal raises ``Stopped`` at once and disarms: the runner is cleaning up from then on, and further
    signals are only recorded. Inside ``deferred()`` a signal is held back and raised when the block
    ends. ``received`` is the first stop signal seen, raised or not.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._pending: int | None = None
        self._armed = True
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        if self._armed:
            self._armed = False
            raise Stopped(signum)
        if self._pending is None:
            self._pending = signum

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold a stop signal back until the block ends (start a child and register it in here)."""
        armed, self._armed = self._armed, False
        try:
            yield
        finally:
            self._armed = armed
        if armed and self._pending is not None:
            self._armed = False
            raise Stopped(self._pending)

    def disarm(self) -> None:
        """From now on only record stop signals (the runner is stopping anyway)."""
        self._armed = False


def spawn(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    pass_fds: Sequence[int] = (),
    text: bool = False,
) -> subprocess.Popen[Any]:
    """Start ``argv`` in a new session that is killed with SIGKILL when this process dies (Linux)."""
    return subprocess.Popen(
        list(argv),
        env=env,
        cwd=cwd,
        stdout=stdout,
        stderr=stderr,
        pass_fds=tuple(pass_fds),
        text=text,
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )


def signal_group(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``proc`` leads (its session: see ``spawn``); gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def wait_for_group(proc: subprocess.Popen[Any], deadline: float) -> bool:
    """Wait until no process is left in the group ``proc`` led, or until ``deadline`` (``time.monotonic``);
    True when none is. The leader may exit before the processes it started: the parent of
    ``torch.multiprocessing.spawn`` dies of a SIGTERM at once, while its workers, told too, write their
    stop checkpoint."""
    while True:
        try:
            os.killpg(proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def resolve_command(command: Sequence[str], *, field: str, cwd: Path | None, path: str | None) -> list[str]:
    """``command`` with its program made an absolute path, or RunRefused naming ``field``.

    ``python`` or ``python3`` (the image's interpreter) becomes the interpreter trainguard runs in. A
    program with a ``/`` is taken relative to ``cwd``; a bare name is looked up on ``path`` (the worker's
    PATH). A program that is missing, a directory or not executable is refused before anything starts.
    """
    program, rest = command[0], list(command[1:])
    if Path(program).name in ("python", "python3"):
        return [sys.executable, *rest]
    if not program:
        raise RunRefused(f"{field}: the program name is empty")
    if "/" not in program:
        found = shutil.which(program, path=path)
        if found is not None:
            return [str(Path(found).absolute()), *rest]
        # Say why: a directory or a file without the execute bit is skipped by the search.
        directories = (path if path is not None else os.defpath).split(os.pathsep)
        unusable = [Path(d or ".", program) for d in directories if Path(d or ".", program).exists()]
        if not unusable:
            raise RunRefused(f"{field}: {program!r} was not found on the worker's PATH")
        candidate = unusable[0]
    else:
        candidate = Path(program) if Path(program).is_absolute() else (cwd or Path.cwd()) / program
    if not candidate.exists():
        raise RunRefused(f"{field}: {program!r} does not exist ({candidate})")
    if candidate.is_dir():
        raise RunRefused(f"{field}: {program!r} is a directory, not a program ({candidate})")
    if not os.access(candidate, os.X_OK):
        raise RunRefused(f"{field}: {program!r} is not executable ({candidate})")
    return [str(candidate.absolute()), *rest]


def check_working_dir(working_dir: str | None, *, field: str) -> Path | None:
    """The worker's working directory as an absolute path (None: the runner's own), or RunRefused."""
    if working_dir is None:
        return None
    if not working_dir:
        raise RunRefused(f"{field}: must not be empty")
    path = Path(working_dir).absolute()
    if not path.is_dir():
        raise RunRefused(f"{field}: {working_dir!r} is not a directory on this machine")
    return path


def omp_threads(local_processes: int) -> str:
    """OMP_NUM_THREADS for one of ``local_processes`` workers: this process's cores shared out, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return str(max(1, cores // max(1, local_processes)))


def _read_regular(path: Path, *, tail: bool) -> bytes | None:
    """Up to _READ_LIMIT bytes of a regular file (its end when ``tail``); None for anything else.

    The worker writes these files, so they are untrusted: no symlink is followed and a FIFO or device
    is refused before it can block or stream without end.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        offset = max(0, info.st_size - _READ_LIMIT) if tail else 0
        return os.pread(fd, _READ_LIMIT, offset)
    except OSError:
        return None
    finally:
        os.close(fd)


def printable(text: str) -> str:
    """``text`` on one line, without control characters, at most a few hundred characters."""
    cleaned = "".join(c if c.isprintable() else " " for c in text)
    cleaned = " ".join(cleaned.split())
    return cleaned if len(cleaned) <= _DETAIL_LIMIT else cleaned[: _DETAIL_LIMIT - 3] + "..."


def termination_message(path: Path) -> str:
    """The ``message`` of the final status a guardian wrote to ``path`` ("" when there is none)."""
    data = _read_regular(path, tail=False)
    if not data:
        return ""
    status, _ = parse_status(data, str(path))
    return printable(status.message) if status is not None else ""


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    """The last non-empty ``lines`` of a log, joined with " | " ("" when there are none)."""
    data = _read_regular(path, tail=True)
    if not data:
        return ""
    kept = [line.strip() for line in data.decode(errors="replace").splitlines() if line.strip()]
    return printable(" | ".join(kept[-lines:]))


def exit_detail(code: int | None, termination_file: Path, log_file: Path) -> str:
    """Why a worker exited with ``code``, for the failure's reason ("" for success, a signal or none).

    The guardian's final status (termination message) says it best; Python's own errors (a missing
    script, a traceback) are only in the log.
    """
    if code is None or code <= 0:
        return ""
    detail = termination_message(termination_file) or log_tail(log_file)
    return with_detail(describe_exit(code), detail) if detail else ""
