"""``trainguard-launch -- COMMAND...``: a worker container's entrypoint that can restart its worker in place.

The launcher runs COMMAND (the user's worker command) as its child, in a session of its own, and
stays for the container's life. What a restart in place needs from it:

- **An order starts the next attempt** (``trainer_sidecar.contract.inplace``). It watches the order file
  in the pod's status directory; an order for an attempt newer than the one it runs stops the worker as
  the order says (SIGKILL at once for a broken gang, or SIGTERM and a grace), reaps it and everything in
  its process group, and starts COMMAND again with the order's variables over the container's own. The
  pod, its network, its volumes and its sidecar stay; the rendezvous is done again by the new workers.
- **A warm spare makes that start near zero** where COMMAND is a plain ``python SCRIPT`` or ``python -m
  MODULE`` of the launcher's own interpreter (``contract.handoff.plan_warm_start``): once the worker has
  stepped, the launcher starts one spare (``trainer_sidecar.guardian.spare``: torch imported, waiting)
  and hands the next attempt to it. Any other command (torchrun for several processes per pod, a shell
  script) is restarted cold, still in place.
- **An exit is reported, then passed on.** When the worker exits, the launcher writes its exit code to
  its state file and, for a failure, waits up to ``--order-wait-seconds`` for an order; without one it
  exits with the worker's code (128 + N for a signal, as a container shows it), so the pod fails as it
  would have without the launcher. A success is passed on at once.
- **A stop is passed on.** SIGTERM or SIGINT to the launcher (the kubelet stopping the pod) is sent to
  the worker's process group; the launcher exits with the worker's code once it has exited. SIGHUP (the
  terminal or session the launcher was started from ending) stops the worker as SIGTERM does, SIGTERM
  sent: a hangup asks the job to stop, and SIGTERM is what the guardian stops on at a step boundary,
  where a hangup's default would kill the worker mid-step (as it would kill the launcher, the worker
  left running).
- **Its tree dies with it.** Every process it starts (the worker, the spare) is SIGKILLed by the kernel
  when the launcher dies, even by SIGKILL (``PR_SET_PDEATHSIG``), and where the launcher is not PID 1
  (outside a PID namespace of its own, whose end would end them all) a watchdog of its own session
  (``trainer_sidecar.launcher.watchdog``) SIGKILLs what they started in turn, found by a marker in
  their environment (``LAUNCH_TREE_ENV``).
- **It is a good PID 1.** It reaps every child, the orphans the kernel gives it included. It is also a
  child subreaper (Linux's ``PR_SET_CHILD_SUBREAPER``) where it is not PID 1, so what a worker leaves
  behind becomes its child there too: a stopped attempt leaves nothing running, not even processes that
  left the worker's process group (torchrun starts each of its workers in a session of its own).

The launcher is torch-free and imports only the contract: it is in the worker's image, but must cost the
worker nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from trainer_sidecar.contract.env import ATTEMPT_ENV, LAUNCH_TREE_ENV, STATUS_FILE_ENV
from trainer_sidecar.contract.handoff import Handoff, WarmStart, plan_warm_start
from trainer_sidecar.contract.inplace import (
    FIRST_SIGNAL,
    MAX_OUTPUT_TAIL_CHARS,
    ORDER_FILE,
    LauncherPhase,
    LauncherState,
    RestartOrder,
    StopMode,
    container_exit_code,
    read_order,
    write_launcher_state,
)
from trainer_sidecar.contract.prctl import PR_SET_CHILD_SUBREAPER, die_with_parent, load_prctl
from trainer_sidecar.contract.status import read_status
from trainer_sidecar.contract.warmspare import WarmSpare
from trainer_sidecar.launcher.cgroup import MEMORY_FILES as MEMORY_FILES
from trainer_sidecar.launcher.cgroup import MEMORY_LOOK_SECONDS
from trainer_sidecar.launcher.cgroup import OOM_COUNTERS as OOM_COUNTERS
from trainer_sidecar.launcher.cgroup import SPARE_MEMORY_BYTES as SPARE_MEMORY_BYTES
from trainer_sidecar.launcher.cgroup import memory_use as memory_use
from trainer_sidecar.launcher.cgroup import oom_kills as oom_kills
from trainer_sidecar.launcher.cgroup import spare_room as spare_room
from trainer_sidecar.launcher.watchdog import start_watchdog

#: How often the launcher looks at its children and the order file.
POLL_SECONDS = 0.05
#: The signals that stop the launcher, and the one each is passed on to the worker as (module docstring).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FORWARDED: dict[int, int] = {signal.SIGHUP: signal.SIGTERM}
#: The exit codes of a shell that cannot run a command: not found, and found but not executable.
NOT_FOUND, NOT_EXECUTABLE = 127, 126


#: How long an exit waits for the worker's last output to arrive through its pipe (a child that keeps
#: the pipe open, such as a data loader still dying, must not hold the exit's report up).
OUTPUT_DRAIN_SECONDS = 0.5


class _OutputTee(threading.Thread):
    """Copies a worker's output pipe to one of the launcher's own descriptors (the container's log) as it
    arrives, and keeps its last bytes: the reason of a crash, which the container's log fallback would
    have shown had the container ended."""

    def __init__(self, read_fd: int, target_fd: int) -> None:
        super().__init__(name="trainguard-launch-output", daemon=True)
        self._read_fd, self._target_fd = read_fd, target_fd
        self.tail = b""

    def run(self) -> None:
        try:
            while chunk := os.read(self._read_fd, 65536):
                with contextlib.suppress(OSError):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(self._target_fd, view) :]
                self.tail = (self.tail + chunk)[-4 * MAX_OUTPUT_TAIL_CHARS :]
        except OSError:
            pass
        finally:
            os.close(self._read_fd)

    def text(self) -> str:
        """The kept tail as text, at most ``MAX_OUTPUT_TAIL_CHARS`` characters."""
        return self.tail.decode("utf-8", errors="replace")[-MAX_OUTPUT_TAIL_CHARS:]


def _tee(target_fd: int) -> tuple[int, _OutputTee]:
    """A pipe whose write end a worker writes to, and the started tee that copies it to ``target_fd``."""
    read_fd, write_fd = os.pipe()
    tee = _OutputTee(read_fd, target_fd)
    tee.start()
    return write_fd, tee


class LaunchError(Exception):
    """The launcher cannot start: the message names the flag, variable or command."""


@dataclass
class _Process:
    """A child the launcher started: its process, and its exit status once reaped."""

    proc: subprocess.Popen[bytes]
    returncode: int | None = None

    @property
    def alive(self) -> bool:
        return self.returncode is None


@dataclass
class _Attempt:
    """One attempt's worker and what the launcher saw of it: made afresh when the attempt starts."""

    worker: _Process
    #: Whether it runs in the warm spare (else it started cold).
    warm: bool
    #: Copies its standard error to the launcher's and keeps the end.
    output: _OutputTee
    #: When it started (``time.time()``).
    started_at: float
    #: The container's OOM kills when it started (None: no counter to read).
    oom_kills_at_start: int | None = field(default_factory=oom_kills)
    #: When the launcher first saw it exited (``time.monotonic()``; None while it runs).
    exited_at: float | None = None
    #: The end of its standard error and whether the OOM killer killed it, once it exited.
    output_tail: str = ""
    oom_killed: bool = False
    #: Why this attempt keeps no spare ("" while it may).
    no_room: str = ""

    def note_exit(self) -> None:
        """Take what its exit leaves: when, its output's end (waited for briefly), an OOM kill."""
        self.exited_at = time.monotonic()
        self.output.join(OUTPUT_DRAIN_SECONDS)
        self.output_tail = self.output.text()
        kills = oom_kills()
        before = self.oom_kills_at_start
        self.oom_killed = kills is not None and before is not None and kills > before


@dataclass
class Launcher:
    """Runs ``command`` and restarts it in place on orders found in ``status_dir`` (module docstring).

    ``order_wait_seconds``: how long a failed worker's exit waits for an order before the launcher exits
    with it (0: at once). ``warm``: keep a warm spare where the command allows one. A worker, cold or in
    the spare, writes its standard output to the launcher's own and its standard error through a pipe
    the launcher copies to its own (keeping the end: the reason of a crash).
    """

    command: list[str]
    status_dir: Path
    order_wait_seconds: float = 0.0
    warm: bool = True
    executable: str = sys.executable
    attempt: int = 1
    #: The attempt running (or the last one), None before the first starts.
    _current: _Attempt | None = None
    _spare: WarmSpare | None = None
    _children: dict[int, _Process] = field(default_factory=dict)
    _stop_signal: int | None = None
    _order_seen: tuple[int, int, int] | None = None
    _message: str = ""
    _phase: LauncherPhase | None = None
    _exit_code: int | None = None
    _since: float = 0.0
    _starts_at: float | None = None
    _memory_looked_at: float = float("-inf")
    _tree: str = field(default_factory=lambda: secrets.token_hex(8))
    _watchdog_pid: int | None = None
    _watchdog_fd: int = -1

    def __post_init__(self) -> None:
        self.plan: WarmStart | str = plan_warm_start(self.command, self.executable)
        if not self.warm:
            self.plan = "warm spares are turned off"

    # ------------------------------------------------------------------------------- the loop ---
    def run(self) -> int:
        """Run the worker and every ordered restart until the launcher is done; its exit code."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        if os.getpid() != 1:
            if not become_subreaper():
                self._note("not a child subreaper: what a stopped worker leaves outside its group may go on")
            self._start_watchdog()
        try:
            self._start(dict(os.environ))
            while True:
                self._reap()
                if self._stop_signal is not None:
                    return self._stop()
                order = self._new_order()
                if order is not None:
                    self._restart(order)
                    continue
                done = self._after_exit()
                if done is not None:
                    return done
                self._tend_spare()
                time.sleep(POLL_SECONDS)
        finally:
            self._drop_spare()
            if self._current is not None:
                # What the worker left ends with the launcher, as with a container.
                _signal_group(self._current.worker.proc.pid, signal.SIGKILL)
                self._sweep(timeout=2.0)
            if self._watchdog_fd >= 0:  # its end of file: the watchdog sweeps what may be left, and exits
                os.close(self._watchdog_fd)
                self._watchdog_fd = -1

    def _start_watchdog(self) -> None:
        """Start the watchdog that ends this launcher's tree if the launcher is killed (module docstring)."""
        try:
            proc, self._watchdog_fd = start_watchdog(self._tree, self.executable)
        except OSError as exc:
            self._note(f"no watchdog ({exc}): what the worker starts may outlive a killed launcher")
            return
        self._watchdog_pid = proc.pid

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop_signal = signum

    def _after_exit(self) -> int | None:
        """The launcher's exit code once it should exit after its worker's exit, else None."""
        current = self._current
        if current is None or current.worker.alive:
            return None
        assert current.worker.returncode is not None
        code = container_exit_code(current.worker.returncode)
        if current.exited_at is None:
            self._since = time.time()
            current.note_exit()
            self._publish(LauncherPhase.EXITED, exit_code=code)
        assert current.exited_at is not None
        if code == 0 or time.monotonic() - current.exited_at >= self.order_wait_seconds:
            return code
        return None

    def _stop(self) -> int:
        """Pass the stop signal on to the worker and exit with the worker's code once it has exited (the
        kubelet's SIGKILL ends a worker that outlives the pod's grace, and the launcher with it)."""
        assert self._stop_signal is not None
        self._drop_spare()
        worker = self._current.worker if self._current is not None else None
        if worker is not None and worker.alive:
            _signal_group(worker.proc.pid, FORWARDED.get(self._stop_signal, self._stop_signal))
            while worker.alive:
                time.sleep(POLL_SECONDS)
                self._reap()
        if worker is None:
            return 128 + self._stop_signal
        assert worker.returncode is not None
        return container_exit_code(worker.returncode)

    # ------------------------------------------------------------------------------- children ---
    def _spawn(self, argv: Sequence[str], env: dict[str, str], **options: Any) -> _Process:
        """Start a child in a session of its own that dies with the launcher (always spawned from the main
        thread: the parent-death signal follows the thread that forked), marked as of its tree."""
        proc = subprocess.Popen(
            argv,
            env={**env, LAUNCH_TREE_ENV: self._tree},
            start_new_session=True,
            preexec_fn=die_with_parent(),
            **options,
        )
        child = _Process(proc)
        self._children[proc.pid] = child
        return child

    def _reap(self) -> None:
        """Collect every exited child (orphans too: as PID 1 the launcher inherits them)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self._children.pop(pid, None)
            if child is not None:
                child.returncode = os.waitstatus_to_exitcode(status)
                child.proc.returncode = child.returncode  # reaped here, not by Popen

    def _sweep(self, timeout: float = 10.0) -> None:
        """SIGKILL every process the old attempt left as the launcher's child (orphans it inherited, in
        other sessions) but the spare, until none is left or ``timeout`` passed; a process killed here
        may leave orphans of its own, which become the launcher's next."""
        keep = {os.getpid()}
        if self._watchdog_pid is not None:
            keep.add(self._watchdog_pid)
        if self._spare is not None:
            keep.add(self._spare.pid)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._reap()
            strays = [pid for pid in _children_of(os.getpid()) if pid not in keep]
            if not strays:
                return
            for pid in strays:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(POLL_SECONDS / 5)
        self._note(f"processes of the previous attempt outlived {timeout:g} s of SIGKILL")

    def _wait_gone(self, child: _Process, deadline: float) -> bool:
        """Reap until ``child`` has exited or ``deadline`` (monotonic) passed; whether it exited."""
        while child.alive and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS / 5)
            self._reap()
        return not child.alive

    # ------------------------------------------------------------------------------- attempts ---
    def _start(self, env: dict[str, str]) -> None:
        """Start the worker of ``self.attempt`` with ``env``: in the spare if one is alive, else cold."""
        self.attempt = _attempt_of(env, self.attempt)
        started = self._start_in_spare(env)
        if started is None:
            write_fd, output = _tee(2)
            try:
                started = self._spawn(self.command, env, stderr=write_fd), False, output
            finally:
                os.close(write_fd)
        worker, warm, output = started
        self._current = _Attempt(worker, warm, output, started_at=time.time())
        self._since = self._current.started_at
        self._publish(LauncherPhase.RUNNING)

    def _start_in_spare(self, env: dict[str, str]) -> tuple[_Process, bool, _OutputTee] | None:
        """Hand the attempt to the spare if one is alive (the worker, True, its output's tee); None when
        there is none or it could not be told (it is dropped either way but when it became the worker)."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        worker = self._children.get(spare.pid)
        if worker is None or not spare.alive() or not isinstance(self.plan, WarmStart):
            spare.drop()
            return None
        handoff = Handoff.for_command(self.plan, environment=env, cwd=None)
        write_fd, tee = _tee(2)
        try:  # standard output and error as a cold worker has them (_start)
            spare.hand_off(handoff, 1, write_fd)
        except OSError as exc:
            self._note(f"attempt {self.attempt}: the warm spare could not be told ({exc}); starting cold")
            spare.drop()
            return None
        finally:
            os.close(write_fd)
        return worker, True, tee

    def _restart(self, order: RestartOrder) -> None:
        """Stop the worker that runs as ``order`` says, reap its process group, and start
        ``order.attempt`` once the order's delay has passed (a stop signal in the meantime ends the wait,
        and the launcher exits as its stopped worker did)."""
        self.attempt = order.attempt
        self._since = time.time()
        due = time.monotonic() + order.start_delay_seconds
        self._starts_at = self._since + order.start_delay_seconds if order.start_delay_seconds else None
        self._publish(LauncherPhase.STOPPING)
        worker = self._current.worker if self._current is not None else None
        if worker is not None:
            if worker.alive:
                _signal_group(worker.proc.pid, FIRST_SIGNAL[order.stop])
                grace = order.grace_seconds if order.stop is StopMode.GRACEFUL else 0.0
                if not self._wait_gone(worker, time.monotonic() + grace):
                    _signal_group(worker.proc.pid, signal.SIGKILL)
                self._wait_gone(worker, float("inf"))
            _signal_group(worker.proc.pid, signal.SIGKILL)  # what it left in its group (data loaders)
            self._sweep()
        # Looked at once more after the wait: a stop signal that came while the old worker stopped, with
        # no delay left to wait, must not start the attempt either.
        while self._stop_signal is None and time.monotonic() < due:
            self._reap()
            time.sleep(POLL_SECONDS)
        if self._stop_signal is not None:
            return
        env = {**os.environ, **order.environment, ATTEMPT_ENV: str(order.attempt)}
        self._start(env)

    def _new_order(self) -> RestartOrder | None:
        """An order not acted on yet for a newer attempt than the one running, read when the file changed."""
        path = self.status_dir / ORDER_FILE
        try:
            st = os.stat(path)
        except OSError:
            return None
        seen = (st.st_mtime_ns, st.st_size, st.st_ino)
        if seen == self._order_seen:
            return None
        self._order_seen = seen
        order, reason = read_order(self.status_dir)
        if order is None:
            self._note(f"ignored the order file: {reason}")
            return None
        if order.attempt <= self.attempt:
            self._note(f"ignored an order for attempt {order.attempt}: attempt {self.attempt} runs")
            return None
        return order

    # ---------------------------------------------------------------------------- warm spares ---
    def _tend_spare(self) -> None:
        """Start a spare once the worker has stepped (earlier, its imports would compete with the worker's
        start for the cores); note when it is ready; forget one that died."""
        spare, current = self._spare, self._current
        if spare is not None:
            if not spare.alive():
                self._drop_spare()
            elif not spare.warm and spare.is_warm():
                if self._phase is not None:
                    self._publish(self._phase, self._exit_code)
            elif self._memory_due() and (why := spare_room(memory_use(), keeping=True)):
                # The worker needs the room more than its restart does; no spare again this attempt.
                self._drop_spare()
                if current is not None:
                    current.no_room = f"dropped the warm spare: {why}"
                    self._note(current.no_room)
            return
        if current is None or not current.worker.alive or current.no_room:
            return
        if not isinstance(self.plan, WarmStart) or not self._stepped() or not self._memory_due():
            return
        why = spare_room(memory_use(), keeping=False)
        if why:
            current.no_room = f"no warm spare for attempt {self.attempt}: {why}"
            self._note(current.no_room)
            return
        self._start_spare(self.plan)

    def _start_spare(self, plan: WarmStart) -> None:
        """Start the spare of the next attempt (or say why it could not, and keep none from then on)."""

        def spawn_spare(argv: list[str], channel_fd: int) -> subprocess.Popen[Any]:
            env = dict(os.environ)
            return self._spawn(argv, env, pass_fds=(channel_fd,), stdin=subprocess.DEVNULL).proc

        try:
            self._spare = WarmSpare.start(plan, self.executable, spawn_spare, reaped_by_keeper=True)
        except OSError as exc:
            self.plan = f"the warm spare could not start ({exc})"
            self._note(self.plan)

    def _memory_due(self) -> bool:
        """Whether it is time to look at the container's memory again (at most every
        ``MEMORY_LOOK_SECONDS``)."""
        now = time.monotonic()
        if now - self._memory_looked_at < MEMORY_LOOK_SECONDS:
            return False
        self._memory_looked_at = now
        return True

    def _stepped(self) -> bool:
        """Whether the running worker has published a step it took (not merely the step it resumed at)."""
        status_file = os.environ.get(STATUS_FILE_ENV)
        if not status_file:
            return False
        status, _ = read_status(Path(status_file))
        return (
            status is not None
            and self._current is not None
            and status.started_at >= self._current.started_at - 1.0
            and status.last_step_time is not None
            and status.last_step_time >= status.started_at
        )

    def _drop_spare(self) -> None:
        """Drop the spare if there is one (its exit is reaped with the launcher's other children)."""
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.drop()

    # -------------------------------------------------------------------------------- the state ---
    def _note(self, message: str) -> None:
        """Say ``message`` on standard error and in the state file (republished as it is)."""
        with contextlib.suppress(OSError):  # a standard error gone with its terminal (SIGHUP)
            print(f"trainguard-launch: {message}", file=sys.stderr, flush=True)
        self._message = message
        if self._phase is not None:
            self._publish(self._phase, self._exit_code)

    def _publish(self, phase: LauncherPhase, exit_code: int | None = None) -> None:
        """Write the launcher's state file: ``phase`` of ``self.attempt`` (OSError only said)."""
        self._phase, self._exit_code = phase, exit_code
        current = self._current
        worker = current.worker if current is not None else None
        exited = phase is LauncherPhase.EXITED
        started_at = current.started_at if current is not None else 0.0
        state = LauncherState(
            attempt=self.attempt,
            phase=phase,
            since=self._since,
            pid=worker.proc.pid if worker is not None and worker.alive else None,
            exit_code=exit_code,
            warm=current is not None and current.warm,
            spare_ready=self._spare is not None and self._spare.warm,
            updated_at=time.time(),
            message=self._message[:1024],
            starts_at=self._starts_at if phase is LauncherPhase.STOPPING else None,
            started_at=started_at if phase is not LauncherPhase.STOPPING else None,
            output_tail=current.output_tail if current is not None and exited else "",
            oom_killed=current is not None and exited and current.oom_killed,
        )
        try:
            write_launcher_state(self.status_dir, state)
        except OSError as exc:
            print(f"trainguard-launch: cannot write its state in {self.status_dir}: {exc}", file=sys.stderr)


def _children_of(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (from /proc; [] where there is none)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and int(fields[1]) == parent and fields[0] != b"Z":
            found.append(int(name))
    return found


def become_subreaper() -> bool:
    """Make this process adopt its descendants' orphans (Linux); whether it could."""
    prctl = load_prctl()
    return prctl is not None and prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _attempt_of(env: dict[str, str], default: int) -> int:
    try:
        return max(1, int(env.get(ATTEMPT_ENV, default)))
    except ValueError:
        return default


def resolve(command: Sequence[str]) -> list[str]:
    """``command`` with its program found on PATH (as exec would); LaunchError if it is not there."""
    if not command:
        raise LaunchError("no command: give it after --, e.g. trainguard-launch -- python train.py")
    program = command[0]
    found = program if os.sep in program else shutil.which(program)
    if found is None:
        raise LaunchError(f"the command {program!r} is not found on PATH")
    return [found, *command[1:]]


def status_dir_from(flag: str | None) -> Path:
    """The status directory: ``flag``, or the folder of ``$TRAINGUARD_STATUS_FILE``; LaunchError if
    neither names a directory."""
    if flag:
        directory = Path(flag)
    elif os.environ.get(STATUS_FILE_ENV):
        directory = Path(os.environ[STATUS_FILE_ENV]).parent
    else:
        raise LaunchError(f"--status-dir is not given and {STATUS_FILE_ENV} is not set")
    if not directory.is_dir():
        raise LaunchError(f"--status-dir: {directory} is not a directory")
    return directory


def main(argv: list[str] | None = None) -> None:
    """The ``trainguard-launch`` command (module docstring)."""
    parser = argparse.ArgumentParser(
        prog="trainguard-launch", description="Run a worker command and restart it in place when ordered."
    )
    parser.add_argument(
        "--status-dir", help="the pod's status directory (default: the folder of $TRAINGUARD_STATUS_FILE)"
    )
    parser.add_argument(
        "--order-wait-seconds",
        type=float,
        default=0.0,
        help="after a failed exit, how long to wait for an order before exiting with it (default 0)",
    )
    parser.add_argument("--no-spare", action="store_true", help="never keep a warm spare")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not 0.0 <= args.order_wait_seconds <= 3600.0:
        parser.error(f"--order-wait-seconds: {args.order_wait_seconds} is not between 0 and 3600")
    try:
        launcher = Launcher(
            resolve(command),
            status_dir_from(args.status_dir),
            order_wait_seconds=args.order_wait_seconds,
            warm=not args.no_spare,
            attempt=_attempt_of(dict(os.environ), 1),
        )
    except LaunchError as exc:
        parser.error(str(exc))
    try:
        code = launcher.run()
    except PermissionError as exc:
        print(f"trainguard-launch: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        code = NOT_EXECUTABLE
    except OSError as exc:
        print(f"trainguard-launch: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        code = NOT_FOUND
    sys.exit(code)


if __name__ == "__main__":
    main()
