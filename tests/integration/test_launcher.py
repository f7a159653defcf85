"""``trainguard-launch``: a worker restarted in place on an order, and exits passed on as a container's.

Every test runs the real launcher as a process over a real worker script, in a status directory of its
own, and reads what the worker itself recorded (its pid, attempt and environment), never the launcher's
word alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from trainer_sidecar.contract.env import ATTEMPT_ENV, REMEDIATION_ENV, STATUS_FILE_ENV
from trainer_sidecar.contract.inplace import (
    ORDER_FILE,
    LauncherPhase,
    LauncherState,
    RestartOrder,
    StopMode,
    read_launcher_state,
    write_order,
)

pytestmark = pytest.mark.slow

# A worker that records each start (pid, attempt, remediation, its process group's child) and then acts
# as its first argument says. "hang" ignores SIGTERM, as a rank stuck in a collective cannot act on it.
WORKER = """\
import json, os, signal, subprocess, sys, time
from pathlib import Path
record = Path(os.environ["RECORD"])
# A child that ignores SIGTERM, as a data loader's worker may.
IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", IGNORE_TERM])
# And one in a session of its own, out of the worker's process group, as torchrun starts its workers.
escaped = subprocess.Popen([sys.executable, "-c", IGNORE_TERM], start_new_session=True)
with record.open("a") as out:
    out.write(json.dumps({"pid": os.getpid(), "child": child.pid, "escaped": escaped.pid,
                          "argv": sys.argv[1:],
                          "attempt": os.environ.get("TRAINGUARD_ATTEMPT"),
                          "remediation": os.environ.get("TRAINGUARD_REMEDIATION"),
                          "kept": os.environ.get("KEPT")}) + "\\n")
mode = sys.argv[1] if int(os.environ.get("TRAINGUARD_ATTEMPT", "1")) == 1 else sys.argv[2]
print("out of attempt", os.environ.get("TRAINGUARD_ATTEMPT"), flush=True)
print("err of attempt", os.environ.get("TRAINGUARD_ATTEMPT"), file=sys.stderr, flush=True)
if mode == "sleep2exit1":
    time.sleep(2)
    sys.exit(1)
if mode.startswith("exit"):
    sys.exit(int(mode[4:]))
if mode == "raise":
    raise ValueError("mat1 and mat2 shapes cannot be multiplied")
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "hang":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "graceful":
    def stop(signum, frame):
        with record.open("a") as out:
            out.write(json.dumps({"stopped": os.getpid()}) + "\\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
if mode == "stepexit":
    from trainer_sidecar.contract.status import WorkerStatus, write_status
    now = time.time()
    write_status(Path(os.environ["TRAINGUARD_STATUS_FILE"]),
                 WorkerStatus(pid=os.getpid(), started_at=now, step=1, last_step_time=now + 0.01))
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "step":
    from trainer_sidecar.contract.status import WorkerStatus, write_status
    now = time.time()
    write_status(Path(os.environ["TRAINGUARD_STATUS_FILE"]),
                 WorkerStatus(pid=os.getpid(), started_at=now, step=1, last_step_time=now + 0.01))
time.sleep(600)
"""


class Launch:
    """One launcher process over WORKER in its own status directory."""

    def __init__(self, tmp: Path, *modes: str, order_wait: float = 0.0, spare: bool = False) -> None:
        self.dir = tmp / "status"
        self.dir.mkdir()
        self.record = tmp / "record.jsonl"
        script = tmp / "worker.py"
        script.write_text(WORKER)
        env = {
            **os.environ,
            "RECORD": str(self.record),
            "KEPT": "from the pod",
            STATUS_FILE_ENV: str(self.dir / "status.json"),
            ATTEMPT_ENV: "1",
        }
        flags = ["--order-wait-seconds", str(order_wait), *([] if spare else ["--no-spare"])]
        # Files, not pipes: what the worker started may hold them open after the launcher's end.
        self.stdout_file, self.stderr_file = tmp / "launcher.out", tmp / "launcher.err"
        command = [sys.executable, "-m", "trainer_sidecar.launcher.launcher", *flags, "--"]
        with self.stdout_file.open("wb") as out, self.stderr_file.open("wb") as err:
            self.proc = subprocess.Popen(
                [*command, sys.executable, str(script), *modes],
                env=env,
                cwd=tmp,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def starts(self) -> list[dict[str, object]]:
        """The starts the worker recorded, oldest first."""
        if not self.record.exists():
            return []
        lines = [json.loads(line) for line in self.record.read_text().splitlines()]
        return [line for line in lines if "pid" in line]

    def stops(self) -> list[int]:
        lines = [json.loads(line) for line in self.record.read_text().splitlines()]
        return [int(line["stopped"]) for line in lines if "stopped" in line]

    def current(self) -> LauncherState | None:
        """The launcher's state, None before its first write."""
        return read_launcher_state(self.dir).state

    def state(self) -> LauncherState:
        state, reason = read_launcher_state(self.dir)
        assert state is not None, reason or "no launcher state yet"
        return state

    def order(
        self,
        attempt: int,
        stop: StopMode,
        grace: float = 0.0,
        environment: dict[str, str] | None = None,
        delay: float = 0.0,
    ) -> None:
        write_order(
            self.dir,
            RestartOrder(
                attempt=attempt,
                environment=environment or {},
                stop=stop,
                grace_seconds=grace,
                start_delay_seconds=delay,
            ),
        )

    def stderr(self) -> str:
        return self.stderr_file.read_text()

    def stdout(self) -> str:
        return self.stdout_file.read_text()


def wait_for(what: Callable[[], object], timeout: float = 60.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for every purpose here, but reaped only by its parent.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture
def launches(tmp_path: Path) -> Iterator[Callable[..., Launch]]:
    made: list[Launch] = []

    def make(*modes: str, **options: object) -> Launch:
        launch = Launch(tmp_path, *modes, **options)  # type: ignore[arg-type]
        made.append(launch)
        return launch

    yield make
    for launch in made:
        if launch.proc.poll() is None:
            os.killpg(launch.proc.pid, signal.SIGKILL)
            launch.proc.wait()
        for start in launch.starts():
            for pid in (start["pid"], start["child"], start["escaped"]):
                assert isinstance(pid, int)
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(("mode", "code"), [("exit0", 0), ("exit3", 3), ("kill", 128 + signal.SIGKILL)])
def test_without_an_order_the_launcher_exits_as_the_worker_did(
    launches: Callable[..., Launch], mode: str, code: int
) -> None:
    launch = launches(mode, "unused")
    assert launch.proc.wait(timeout=60) == code
    state = launch.state()
    assert (state.phase, state.exit_code, state.attempt) == (LauncherPhase.EXITED, code, 1)


def test_a_kill_order_replaces_a_hung_worker_and_its_process_group_with_the_ordered_attempt(
    launches: Callable[..., Launch],
) -> None:
    launch = launches("hang", "hang")
    first = wait_for(lambda: launch.starts())[0]  # type: ignore[index]
    launch.order(2, StopMode.KILL, environment={REMEDIATION_ENV: '{"id": "r2"}'})
    starts = wait_for(lambda: launch.starts()[1:] and launch.starts())
    assert isinstance(starts, list)
    second = starts[1]
    assert second["attempt"] == "2"
    assert second["remediation"] == '{"id": "r2"}'
    assert second["kept"] == "from the pod"  # the rest of the environment is the container's
    assert second["pid"] != first["pid"]
    wait_for(lambda: not any(alive(first[key]) for key in ("pid", "child", "escaped")), timeout=10)
    state = wait_for(lambda: (s := launch.current()) and s.pid == second["pid"] and s)
    assert isinstance(state, LauncherState)
    assert (state.attempt, state.phase, state.warm) == (2, LauncherPhase.RUNNING, False)
    assert launch.proc.poll() is None  # the container stays


def test_a_graceful_order_lets_the_worker_stop_itself_first(launches: Callable[..., Launch]) -> None:
    launch = launches("graceful", "hang")
    first = wait_for(lambda: launch.starts())[0]  # type: ignore[index]
    launch.order(2, StopMode.GRACEFUL, grace=30)
    wait_for(lambda: len(launch.starts()) == 2)
    assert launch.stops() == [first["pid"]]
    # What the worker left in its process group (a data loader's workers) goes with it.
    wait_for(lambda: not alive(first["child"]), timeout=10)


def test_a_graceful_stop_that_outlives_its_grace_is_killed(launches: Callable[..., Launch]) -> None:
    launch = launches("hang", "hang")
    first = wait_for(lambda: launch.starts())[0]  # type: ignore[index]
    began = time.monotonic()
    launch.order(2, StopMode.GRACEFUL, grace=1.0)
    wait_for(lambda: len(launch.starts()) == 2)
    assert time.monotonic() - began >= 1.0
    assert not alive(first["pid"])


def test_a_crash_is_reported_with_the_end_of_its_output_which_still_reaches_the_log(
    launches: Callable[..., Launch],
) -> None:
    launch = launches("raise", "hang", order_wait=60)
    exited = wait_for(lambda: (s := launch.current()) and s.phase is LauncherPhase.EXITED and s)
    assert isinstance(exited, LauncherState)
    assert exited.exit_code == 1
    assert exited.output_tail.rstrip().endswith("ValueError: mat1 and mat2 shapes cannot be multiplied")
    assert "Traceback (most recent call last)" in exited.output_tail
    launch.order(2, StopMode.KILL)
    running = wait_for(lambda: (s := launch.current()) and s.phase is LauncherPhase.RUNNING and s)
    assert isinstance(running, LauncherState)
    assert running.output_tail == ""  # a new attempt starts without the old one's
    wait_for(lambda: len(launch.starts()) == 2)  # recorded, so the fixture ends it too
    os.killpg(launch.proc.pid, signal.SIGKILL)
    launch.proc.wait()
    assert "ValueError: mat1 and mat2 shapes cannot be multiplied" in launch.stderr()


def test_a_delayed_order_stops_the_worker_at_once_and_starts_the_attempt_after_the_delay(
    launches: Callable[..., Launch],
) -> None:
    launch = launches("hang", "hang")
    first = wait_for(lambda: launch.starts())[0]  # type: ignore[index]
    ordered = time.time()
    launch.order(2, StopMode.KILL, delay=3.0)
    wait_for(lambda: not alive(first["pid"]) and not alive(first["escaped"]), timeout=2.5)
    waiting = launch.state()
    assert (waiting.attempt, waiting.phase) == (2, LauncherPhase.STOPPING)
    assert waiting.starts_at is not None
    assert ordered + 2.5 <= waiting.starts_at <= ordered + 4
    assert len(launch.starts()) == 1
    wait_for(lambda: len(launch.starts()) == 2)
    assert time.time() - ordered >= 3.0
    running = wait_for(lambda: (s := launch.current()) and s.phase is LauncherPhase.RUNNING and s)
    assert isinstance(running, LauncherState)
    assert running.starts_at is None


def test_a_stop_signal_during_a_delayed_start_ends_the_launcher_without_the_attempt(
    launches: Callable[..., Launch],
) -> None:
    launch = launches("hang", "hang")
    wait_for(lambda: launch.starts())
    launch.order(2, StopMode.KILL, delay=60.0)
    wait_for(lambda: (s := launch.current()) and s.starts_at is not None)
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.proc.wait(timeout=10) == 128 + signal.SIGKILL  # as the stopped worker ended
    assert len(launch.starts()) == 1


def test_a_stop_signal_while_the_old_worker_stops_ends_the_launcher_without_the_attempt(
    launches: Callable[..., Launch],
) -> None:
    """No delay to wait: the kubelet's SIGTERM came during the old worker's grace, so the attempt the
    order asked for is never started (a worker started only to be stopped at once)."""
    launch = launches("hang", "hang")
    wait_for(lambda: launch.starts())
    launch.order(2, StopMode.GRACEFUL, grace=2.0)  # the hung worker ignores SIGTERM: it is killed at 2 s
    wait_for(lambda: (s := launch.current()) and s.phase is LauncherPhase.STOPPING)
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.proc.wait(timeout=10) == 128 + signal.SIGKILL  # as the stopped worker ended
    assert len(launch.starts()) == 1


def test_a_failed_worker_waits_for_an_order_then_restarts_in_place(launches: Callable[..., Launch]) -> None:
    launch = launches("exit1", "hang", order_wait=60)
    wait_for(lambda: (s := launch.current()) and s.phase is LauncherPhase.EXITED)
    assert launch.state().exit_code == 1
    assert launch.proc.poll() is None
    launch.order(2, StopMode.KILL)
    wait_for(lambda: len(launch.starts()) == 2)
    assert launch.state().attempt == 2


def test_an_exit_is_dated_from_the_exit_not_from_the_workers_start(launches: Callable[..., Launch]) -> None:
    # The sidecar holds the kubelet's kill for a grace counted from this date: a worker that ran for an
    # hour must still get it.
    launch = launches("sleep2exit1", "hang", order_wait=60)
    running = wait_for(lambda: (s := launch.current()) and s.phase is LauncherPhase.RUNNING and s)
    exited = wait_for(lambda: (s := launch.current()) and s.phase is LauncherPhase.EXITED and s)
    assert isinstance(running, LauncherState)
    assert isinstance(exited, LauncherState)
    assert exited.since - running.since >= 2.0


def test_a_failed_worker_without_an_order_is_passed_on_after_the_wait(
    launches: Callable[..., Launch],
) -> None:
    launch = launches("exit5", "unused", order_wait=1.0)
    began = time.monotonic()
    assert launch.proc.wait(timeout=60) == 5
    assert time.monotonic() - began >= 1.0


def test_a_success_is_passed_on_at_once_whatever_the_wait(launches: Callable[..., Launch]) -> None:
    launch = launches("exit0", "unused", order_wait=600)
    assert launch.proc.wait(timeout=60) == 0


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        '{"attempt": 2, "environment": {"PATH": "/evil"}, "stop": "kill"}',
        '{"attempt": 2, "environment": {}, "stop": "later"}',
        '{"attempt": 1, "environment": {}, "stop": "kill"}',
        '{"attempt": 0, "environment": {}, "stop": "kill"}',
        '{"attempt": 2, "environment": {}, "stop": "kill", "grace_seconds": 1e9}',
        '{"attempt": 2, "environment": {}, "stop": "kill", "command": ["sh"]}',
    ],
)
def test_an_order_that_is_malformed_stale_or_oversteps_is_ignored_and_said(
    launches: Callable[..., Launch], content: str
) -> None:
    launch = launches("hang", "graceful")
    first = wait_for(lambda: launch.starts())[0]  # type: ignore[index]
    (launch.dir / ORDER_FILE).write_text(content)
    wait_for(lambda: (s := launch.current()) and "ignored" in s.message, timeout=10)
    assert len(launch.starts()) == 1
    assert alive(first["pid"])
    # The launcher still acts on a good order after a bad one.
    launch.order(3, StopMode.KILL)
    wait_for(lambda: len(launch.starts()) == 2)
    launch.proc.send_signal(signal.SIGTERM)
    launch.proc.wait(timeout=30)
    assert "ignored" in launch.stderr()


def test_an_order_file_that_is_a_fifo_does_not_block_the_launcher(launches: Callable[..., Launch]) -> None:
    launch = launches("hang", "hang")
    wait_for(lambda: launch.starts())
    os.mkfifo(launch.dir / ORDER_FILE)
    time.sleep(0.5)
    (launch.dir / ORDER_FILE).unlink()
    launch.order(2, StopMode.KILL)
    wait_for(lambda: len(launch.starts()) == 2, timeout=10)


def test_a_stop_signal_is_passed_to_the_worker_and_its_code_returned(launches: Callable[..., Launch]) -> None:
    launch = launches("graceful", "unused")
    first = wait_for(lambda: launch.starts())[0]  # type: ignore[index]
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.proc.wait(timeout=30) == 0  # the worker's own exit after its handler
    assert launch.stops() == [first["pid"]]
    # Nothing the worker started outlives the launcher, in its group or not.
    wait_for(lambda: not alive(first["child"]) and not alive(first["escaped"]), timeout=10)


def test_a_command_that_is_not_there_is_a_clear_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer_sidecar.launcher.launcher",
            "--status-dir",
            str(tmp_path),
            "--",
            "no-such-program-here",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "no-such-program-here" in done.stderr
    assert "not found" in done.stderr


def test_a_status_dir_that_is_not_a_directory_is_named(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != STATUS_FILE_ENV}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer_sidecar.launcher.launcher",
            "--status-dir",
            str(tmp_path / "none"),
            "--",
            sys.executable,
            "-V",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2
    assert "--status-dir" in done.stderr


def test_an_attempt_after_the_worker_stepped_starts_in_a_warm_spare(launches: Callable[..., Launch]) -> None:
    launch = launches("step", "hang", spare=True)
    wait_for(lambda: launch.starts())
    wait_for(lambda: (s := launch.current()) and s.spare_ready, timeout=120)
    spares = _spares_of(launch.proc.pid)
    assert len(spares) == 1
    launch.order(2, StopMode.KILL)
    starts = wait_for(lambda: launch.starts()[1:] and launch.starts())
    assert isinstance(starts, list)
    assert starts[1]["pid"] == spares[0]  # the spare, started before the order, became attempt 2
    assert launch.state().warm
    # Its standard output and error reach the launcher's own, apart, as the cold attempt 1's did.
    wait_for(lambda: "err of attempt 2" in launch.stderr())
    os.killpg(launch.proc.pid, signal.SIGKILL)
    launch.proc.wait()
    assert launch.stdout().splitlines() == ["out of attempt 1", "out of attempt 2"]
    assert [line for line in launch.stderr().splitlines() if "attempt" in line] == [
        "err of attempt 1",
        "err of attempt 2",
    ]


def _spares_of(launcher: int) -> list[int]:
    return _children_running(launcher, b"trainer_sidecar.guardian.spare")


def _children_running(launcher: int, module: bytes) -> list[int]:
    """The launcher's children whose command line names ``module``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.split(") ")[1].split()[1]) == launcher and module in cmdline:
            found.append(int(entry.name))
    return found


def _tree(launch: Launch) -> list[int]:
    """Every process the worker's starts recorded: the worker, its child in its process group, and its
    child in a session of its own."""
    pids = [start[key] for start in launch.starts() for key in ("pid", "child", "escaped")]
    assert all(isinstance(pid, int) for pid in pids)
    return [int(str(pid)) for pid in pids]


def _survivors(pids: list[int], timeout: float = 60.0) -> list[int]:
    """``pids`` still alive after up to ``timeout`` seconds ([] as soon as none is)."""
    deadline = time.monotonic() + timeout
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_a_launcher_killed_leaves_nothing_of_what_it_started_running(launches: Callable[..., Launch]) -> None:
    """Outside a PID namespace (as here), SIGKILL of the launcher: its worker, the worker's child in its
    process group and the one in a session of its own (as torchrun's workers) all end, and so does the
    launcher's watchdog."""
    launch = launches("hang", "unused")
    wait_for(lambda: launch.starts())
    watchdogs = _children_running(launch.proc.pid, b"trainer_sidecar.launcher.watchdog")
    tree = _tree(launch)
    assert [pid for pid in tree if alive(pid)] == tree
    os.kill(launch.proc.pid, signal.SIGKILL)
    assert launch.proc.wait(timeout=60) == -signal.SIGKILL
    assert _survivors(tree) == []
    assert len(watchdogs) == 1
    assert _survivors(watchdogs) == []


def test_a_hangup_stops_the_worker_as_sigterm_does_and_leaves_nothing_running(
    launches: Callable[..., Launch],
) -> None:
    """SIGHUP (the launcher's terminal or session ended): the worker gets SIGTERM, its own stop runs,
    the launcher exits with the worker's code, and nothing the worker started is left."""
    launch = launches("graceful", "unused")
    wait_for(lambda: launch.starts())
    tree = _tree(launch)
    os.kill(launch.proc.pid, signal.SIGHUP)
    assert launch.proc.wait(timeout=60) == 0
    assert launch.stops() == [tree[0]]  # the worker's SIGTERM handler ran
    assert _survivors(tree) == []


def test_a_launcher_killed_while_it_keeps_a_warm_spare_leaves_neither_running(
    launches: Callable[..., Launch],
) -> None:
    launch = launches("step", "hang", spare=True)
    wait_for(lambda: launch.starts())
    wait_for(lambda: (s := launch.current()) and s.spare_ready, timeout=120)
    spares = _spares_of(launch.proc.pid)
    assert len(spares) == 1
    os.kill(launch.proc.pid, signal.SIGKILL)
    launch.proc.wait(timeout=60)
    assert _survivors([*_tree(launch), *spares]) == []


def test_a_spare_ready_after_the_worker_died_keeps_the_exit_reported_and_takes_the_order(
    launches: Callable[..., Launch],
) -> None:
    launch = launches("stepexit", "hang", spare=True, order_wait=120)
    wait_for(lambda: (s := launch.current()) and s.phase is LauncherPhase.EXITED)
    state = wait_for(lambda: (s := launch.current()) and s.spare_ready and s, timeout=120)
    assert isinstance(state, LauncherState)
    assert (state.phase, state.exit_code) == (LauncherPhase.EXITED, 128 + signal.SIGKILL)
    spares = _spares_of(launch.proc.pid)
    launch.order(2, StopMode.KILL)
    starts = wait_for(lambda: launch.starts()[1:] and launch.starts())
    assert isinstance(starts, list)
    assert [starts[1]["pid"]] == spares
    assert launch.proc.poll() is None
