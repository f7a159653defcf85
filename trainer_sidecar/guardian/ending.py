"""How a worker ends, and the end of training when the loop did not say so (at interpreter exit).

``WorkerEnd`` publishes the final phase, message and exit code (the status and the termination message)
and ends a failed worker with its code (``end_worker``: at once in a gang, ``Diverged``, ``Fenced`` or the
configuration error raised with one process).

A loop that forgets ``guardian.finish()`` would lose the steps since its last checkpoint and leave the
worker's status at ``running``. The guardian arms one exit hook per process for the newest open
guardian (held weakly, so a guardian dropped earlier is never touched); the hook tells it whether the
interpreter is exiting over an unhandled exception, and the guardian decides (``exit_plan``).

No collective runs at exit: a peer may have crashed, or already torn down its process group, and a
collective would then hang until gloo's timeout or abort. What a gang needs agreed (the final
checkpoint) is started at the step boundary where the declared ``max_steps`` was reached, where every
rank is anyway; at exit each rank only waits for its own writes and publishes its own status.

The hook runs among ``threading``'s exit callbacks, not ``atexit``'s: those run first, while the main
thread waits for the others, and in reverse order of registration, so before ``concurrent.futures``
(registered on import, earlier) refuses new work. From ``atexit`` the checkpoint writer could no longer
schedule the stages of a write: the final checkpoint failed with "cannot schedule new futures after
shutdown". ``threading._register_atexit`` is private (Python 3.9 and later); without it the hook falls
back to ``atexit``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import NoReturn, ParamSpec, TypeVar

from trainer_sidecar.checkpoint import CheckpointError, FencedError
from trainer_sidecar.contract.exitcodes import ExitCode
from trainer_sidecar.contract.status import Phase
from trainer_sidecar.guardian.checkpointing import CheckpointManager
from trainer_sidecar.guardian.config import ConfigError
from trainer_sidecar.guardian.gang import Gang
from trainer_sidecar.guardian.reporting import StatusReporter

log = logging.getLogger("trainguard")
P = ParamSpec("P")
R = TypeVar("R")

__all__ = [
    "Diverged",
    "ExitPlan",
    "Fenced",
    "Lifecycle",
    "UncleanState",
    "WorkerEnd",
    "arm_at_exit",
    "crash_message",
    "disarm_at_exit",
    "end_worker",
    "exit_error",
    "exit_plan",
    "noting_escapes",
]


class ExitPlan(Enum):
    """What a guardian that was neither finished nor closed does when the interpreter exits."""

    #: An unhandled exception: never reported finished; writes in flight are waited for.
    CRASHED = "crashed"
    #: The end is known and reached: the final checkpoint, then ``finished``.
    FINISH = "finish"
    #: ``max_steps`` was declared and not reached (a loop counter of its own drifted after a rollback, or
    #: the loop stopped early without ``finish``): a checkpoint when that is safe, then exit code 1.
    SHORT = "short"
    #: A gang whose end was never declared: its final steps cannot be saved without a collective; it is
    #: not reported finished, and the log says how to declare the end.
    UNDECLARED = "undeclared"


def exit_plan(*, crashed: bool, distributed: bool, step: int, max_steps: int | None) -> ExitPlan:
    """Decide what to do at interpreter exit (pure: the guardian carries it out)."""
    if crashed:
        return ExitPlan.CRASHED
    if max_steps is None:
        # One process may save now: nothing to agree with anyone. A gang may not (see the module doc).
        return ExitPlan.UNDECLARED if distributed else ExitPlan.FINISH
    return ExitPlan.FINISH if step >= max_steps else ExitPlan.SHORT


def crash_message(error: BaseException | None) -> str:
    """What a worker that crashed over ``error`` reports: the exception's type and text, and where it was
    raised (the innermost frame's file name and line), on one line; the same text for the same failure,
    so that a repeat can be recognised. None (not known): "unhandled exception"."""
    if error is None:
        return "unhandled exception"
    text = " ".join(str(error).split())
    message = f"{type(error).__name__}: {text}" if text else type(error).__name__
    frames = traceback.extract_tb(error.__traceback__)
    if frames:
        message += f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"
    return message


def noting_escapes(method: Callable[P, R]) -> Callable[P, R]:
    """Decorate a guardian method so that an exception escaping it is kept (``exit_error``) before it
    goes on: a worker under ``torch.multiprocessing.spawn`` ends with ``sys.exit(1)`` over any exception
    (its wrapper catches it), so the interpreter sets no ``sys.last_value`` and the exit hook would take
    a crash (a peer's death breaking DDP's all-reduce in the backward pass, or the step's collective) for
    a loop that ended without ``finish``."""

    @functools.wraps(method)
    def noted(*args: P.args, **kwargs: P.kwargs) -> R:
        global _escaped
        try:
            return method(*args, **kwargs)
        except Exception as exc:
            _escaped = exc
            raise

    return noted


def exit_error() -> BaseException | None:
    """The exception the process exits over: the one the interpreter printed (``sys.last_value``), or
    one that escaped a guardian call since the guardian was armed (``noting_escapes``)."""
    return getattr(sys, "last_value", None) or _escaped


_escaped: BaseException | None = None
_armed: weakref.WeakMethod[Callable[[bool], None]] | None = None
_armed_pid: int | None = None
_registered = False


def arm_at_exit(on_exit: Callable[[bool], None]) -> None:
    """Call ``on_exit(crashed)`` at interpreter exit, unless disarmed first or its object is gone.

    ``on_exit`` is a bound method, held weakly; arming another replaces it (the newest guardian of the
    process is the one training). A child forked from this process never calls it."""
    global _armed, _armed_pid, _registered, _escaped
    _armed, _escaped = weakref.WeakMethod(on_exit), None
    _armed_pid = os.getpid()
    if not _registered:
        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise RuntimeError("no threading._register_atexit")
            register(_at_exit)
        except RuntimeError:  # missing, or the interpreter is shutting down already
            atexit.register(_at_exit)
        _registered = True


def disarm_at_exit(on_exit: Callable[[bool], None]) -> None:
    """Forget ``on_exit`` if it is the one armed (the guardian ended by itself)."""
    global _armed
    if _armed is not None and _armed() == on_exit:
        _armed = None


def _at_exit() -> None:
    global _armed
    armed, _armed = _armed, None
    if armed is None or os.getpid() != _armed_pid:
        return
    on_exit = armed()
    if on_exit is None:
        return
    # The interpreter sets sys.last_value when it printed an unhandled exception, before atexit runs.
    crashed = exit_error() is not None
    try:
        on_exit(crashed)
    except Exception:  # an exit hook must not hide the process's own outcome behind a second traceback
        log.exception("trainguard: the guardian's exit hook failed")


class Diverged(SystemExit):
    """Raised by ``Guardian.step`` when rollbacks are exhausted; exits with ExitCode.DIVERGED.

    In a process group of more than one rank the process exits with that code at once instead (after
    closing the checkpoints and writing the status), without raising: see ``WorkerEnd.diverge``."""

    def __init__(self, message: str) -> None:
        super().__init__(ExitCode.DIVERGED)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Fenced(SystemExit):
    """A newer writer claimed the checkpoint directory; the worker exits with ExitCode.FENCED."""

    def __init__(self, message: str) -> None:
        super().__init__(ExitCode.FENCED)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UncleanState(RuntimeError):
    """``Guardian.finish`` found the final training state not finite: it rolled back instead of saving it.

    The worker must not report success: the job is not done. ``Guardian.run`` handles this by training
    on; a loop of its own should do the same (or let the process fail, so the orchestrator restarts the
    gang from the last clean checkpoint)."""


def end_worker(gang: Gang, code: int, error: SystemExit) -> NoReturn:
    """End the worker with ``code``. In a gang of several ranks, the process exits at once, skipping the
    interpreter's teardown: left to interpreter exit, PyTorch's gloo teardown (its threads still hold
    work, or the store's) ends in std::terminate, SIGABRT instead of the code, in about 1 run of 12 to 40
    under load (destroy_process_group first did not change that); the orchestrator needs the code. The
    status and the message are published before this is called. With one process, ``error`` (a
    SystemExit carrying the code) is raised, for the script or the interpreter to handle."""
    if gang.distributed:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise error


@dataclass
class Lifecycle:
    """The worker's phase, message and exit code as its status publishes them, and whether it has ended
    (finished, closed, stopped or failed: nothing left for the exit hook); ``busy_since``: when the
    rollback under way began (None: none)."""

    phase: Phase = Phase.STARTING
    message: str = ""
    exit_code: int | None = None
    ended: bool = False
    busy_since: float | None = None


class WorkerEnd:
    """How the worker ends: its final phase, message and exit code published (the status and the
    termination message), then, for a failure, the worker ended with its code (``end_worker``)."""

    def __init__(self, life: Lifecycle, gang: Gang, reporter: StatusReporter) -> None:
        self._life, self._gang, self._reporter = life, gang, reporter

    def report(self, phase: Phase, message: str, code: int) -> None:
        """Publish the worker's final phase, message and exit code, in the status and the termination
        message (which outlives the sidecar)."""
        self._life.ended = True
        self._life.phase, self._life.message, self._life.exit_code = phase, message, code
        self._reporter.publish(self._life.phase, True)
        self._reporter.write_termination_message()

    def diverge(self, message: str, checkpoints: CheckpointManager) -> NoReturn:
        """Rollbacks are exhausted: publish ``diverged``, close ``checkpoints`` and end with
        ExitCode.DIVERGED (``Diverged`` raised with one process)."""
        log.error("diverged: %s; exiting with code %d", message, ExitCode.DIVERGED)
        self.report(Phase.DIVERGED, message, ExitCode.DIVERGED)
        try:
            checkpoints.close()
        except CheckpointError as exc:
            log.error("%s", exc)
        # Every rank diverges at the same step (the decision is collective) and ends here, now.
        end_worker(self._gang, ExitCode.DIVERGED, Diverged(message))

    def fenced(self, error: FencedError) -> NoReturn:
        """A newer writer claimed the checkpoint directory: this worker must stop writing there and end
        with ExitCode.FENCED, saying who took over (the status, the termination message, the log)."""
        message = f"fenced out of the checkpoint directory: {error}"
        log.error("%s; exiting with code %d", message, ExitCode.FENCED)
        self.report(Phase.FAILED, message, ExitCode.FENCED)
        end_worker(self._gang, ExitCode.FENCED, Fenced(message))

    def misused(self, error: ConfigError) -> NoReturn:
        """The loop did what the guardian does (stepped the optimizer or the scheduler): a permanent
        configuration error, published, then the worker ends (``end_worker``: with one process, ``error``
        is raised)."""
        self.report(Phase.FAILED, f"configuration error: {error.message}", ExitCode.CONFIG_ERROR)
        end_worker(self._gang, ExitCode.CONFIG_ERROR, error)

    def exit_short(self, message: str) -> NoReturn:
        """End the process with exit code 1 at interpreter exit: the job is not done (a restart resumes)."""
        log.error("%s; exiting with code 1", message)
        self.report(Phase.FAILED, message, 1)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
