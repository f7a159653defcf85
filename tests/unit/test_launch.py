"""trainguard.local.launch: stop signals, command checks, and why a worker exited (in-process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer_sidecar.contract.env import GANG_ENV
from trainer_sidecar.contract.exitcodes import with_detail
from trainer_sidecar.contract.status import Phase, WorkerStatus, write_termination_message
from trainguard.local import launch
from trainguard.local.launch import RunRefused, Stopped, StopSignals


def signal_self(sig: signal.Signals, wait: float = 5.0) -> None:
    """Send ``sig`` to this process and sleep (a handler that raises ends the sleep at once)."""
    os.kill(os.getpid(), sig)
    time.sleep(wait)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_stop_signal_raises_stopped_with_the_shells_exit_code(sig: signal.Signals, code: int) -> None:
    with StopSignals() as signals, pytest.raises(Stopped) as caught:
        signal_self(sig)
    assert caught.value.exit_code == code
    assert caught.value.name == sig.name
    assert signals.received == sig


def test_the_previous_handlers_come_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in launch.STOP_SIGNALS}
    with StopSignals():
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
    assert {sig: signal.getsignal(sig) for sig in launch.STOP_SIGNALS} == before


def test_a_signal_inside_deferred_is_raised_when_the_block_ends() -> None:
    registered = []

    def start_and_register(signals: StopSignals) -> None:
        with signals.deferred():
            signal_self(signal.SIGTERM, wait=0.05)
            registered.append("child")  # still runs: the signal waits for the block's end
        registered.append("after the block")  # never runs: Stopped is raised as the block ends

    with StopSignals() as signals, pytest.raises(Stopped) as caught:
        start_and_register(signals)
    assert registered == ["child"]
    assert caught.value.signum == signal.SIGTERM


def test_after_disarm_signals_are_only_recorded() -> None:
    with StopSignals() as signals:
        signals.disarm()
        signal_self(signal.SIGTERM, wait=0.05)
        signal_self(signal.SIGINT, wait=0.05)
    assert signals.received == signal.SIGTERM


def test_only_the_first_signal_raises() -> None:
    with StopSignals() as signals:
        with pytest.raises(Stopped):
            signal_self(signal.SIGINT)
        signal_self(signal.SIGINT, wait=0.05)  # the runner is cleaning up: noted, not raised
    assert signals.received == signal.SIGINT


# ------------------------------------------------------------------------------------- commands ---
FIELD = "spec.template.spec.containers[pytorch].command[0]"


def resolve(command: list[str], cwd: Path | None = None, path: str | None = None) -> list[str]:
    return launch.resolve_command(command, field=FIELD, cwd=cwd, path=path)


def test_python_is_this_interpreter() -> None:
    assert resolve(["python", "train.py"]) == [sys.executable, "train.py"]
    assert resolve(["/usr/bin/python3", "-u"]) == [sys.executable, "-u"]


def test_programs_are_found_on_the_workers_path_or_relative_to_its_working_dir(tmp_path: Path) -> None:
    program = tmp_path / "bin" / "train"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    assert resolve(["train", "-x"], path=str(program.parent)) == [str(program), "-x"]
    assert resolve(["bin/train"], cwd=tmp_path) == [str(program)]
    assert resolve(["./bin/train"], cwd=tmp_path) == [str(tmp_path / "bin" / "train")]


@pytest.mark.parametrize(
    ("program", "complaint"),
    [
        ("train", "was not found on the worker's PATH"),
        ("bin", "is a directory"),
        ("script.sh", "is not executable"),
        ("./bin", "is a directory"),
        ("./script.sh", "is not executable"),
        ("./missing", "does not exist"),
        ("", "is empty"),
    ],
)
def test_a_program_that_cannot_run_is_refused_naming_the_field(
    tmp_path: Path, program: str, complaint: str
) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "script.sh").write_text("#!/bin/sh\n")
    with pytest.raises(RunRefused) as caught:
        resolve([program], cwd=tmp_path, path=str(tmp_path))
    assert str(caught.value).startswith(f"{FIELD}: ")
    assert complaint in str(caught.value)


def test_the_working_dir_must_be_a_directory(tmp_path: Path) -> None:
    field = "spec.template.spec.containers[pytorch].workingDir"
    assert launch.check_working_dir(None, field=field) is None
    assert launch.check_working_dir(str(tmp_path), field=field) == tmp_path
    (tmp_path / "file").write_text("")
    for bad in ("", str(tmp_path / "file"), str(tmp_path / "missing")):
        with pytest.raises(RunRefused, match=r"workingDir: "):
            launch.check_working_dir(bad, field=field)


def test_omp_threads_share_the_cores_out_and_never_drop_to_zero() -> None:
    cores = len(os.sched_getaffinity(0))
    assert launch.omp_threads(1) == str(cores)
    assert launch.omp_threads(cores * 4) == "1"
    assert launch.omp_threads(0) == str(cores)


# ---------------------------------------------------------------------------------- exit details ---
def test_the_termination_message_explains_an_exit_before_the_log(tmp_path: Path) -> None:
    message, log = tmp_path / "termination-log", tmp_path / "worker.log"
    write_termination_message(
        message, WorkerStatus(started_at=1.0, phase=Phase.FAILED, message="TRAINGUARD_FAULTS: bad\nspec")
    )
    log.write_text("Traceback\nValueError: not this\n")
    assert (
        launch.exit_detail(2, message, log) == "configuration error (permanent): TRAINGUARD_FAULTS: bad spec"
    )
    assert launch.exit_detail(0, message, log) == ""
    assert launch.exit_detail(-9, message, log) == ""
    assert launch.exit_detail(None, message, log) == ""


def test_without_a_termination_message_the_logs_last_lines_explain(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    log.write_bytes(b"x" * 200_000 + b"\nstep 1\n\n  File x\nZeroDivisionError: \x1b[31mdivision\x00\n\n")
    detail = launch.exit_detail(1, tmp_path / "missing", log)
    assert detail == "exited with code 1: step 1 | File x | ZeroDivisionError: [31mdivision"
    assert launch.exit_detail(1, tmp_path / "missing", tmp_path / "no-log") == ""


@pytest.mark.parametrize("content", [b"", b"not json", b"[1]", b'{"phase": "nonsense"}', b"\xff" * 5000])
def test_a_termination_message_that_is_no_status_is_ignored(tmp_path: Path, content: bytes) -> None:
    message = tmp_path / "termination-log"
    message.write_bytes(content)
    assert launch.termination_message(message) == ""


def test_files_that_are_not_regular_are_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nothing writes: a blocking read would never return
    assert launch.termination_message(fifo) == ""
    assert launch.log_tail(fifo) == ""
    target = tmp_path / "target"
    write_termination_message(target, WorkerStatus(started_at=1.0, message="secret"))
    (tmp_path / "link").symlink_to(target)
    assert launch.termination_message(tmp_path / "link") == ""
    assert launch.termination_message(target) == "secret"


def test_a_long_message_is_cut_short(tmp_path: Path) -> None:
    message = tmp_path / "termination-log"
    write_termination_message(message, WorkerStatus(started_at=1.0, message="y" * 3000))
    text = launch.termination_message(message)
    assert len(text) <= 600
    assert text.endswith("...")


def test_a_gang_is_killed_down_to_the_workers_a_launcher_started_in_sessions_of_their_own(
    tmp_path: Path,
) -> None:
    # torchrun starts each worker with start_new_session=True: signalling torchrun's group missed them,
    # and a hung worker outlived its gang by an hour.
    pid_file = tmp_path / "grandchild.pid"
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        "import subprocess, sys, time\n"
        "worker = [sys.executable, '-c', 'import time; time.sleep(600)']\n"
        "p = subprocess.Popen(worker, start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, GANG_ENV: "test-gang-1"}
    child = launch.spawn([sys.executable, str(launcher)], env=env)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the launcher did not start its worker"
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    launch.signal_group(child, signal.SIGKILL)
    child.wait()
    assert os.path.exists(f"/proc/{grandchild}"), "the worker died with its launcher's group after all"
    assert launch.marked_processes(GANG_ENV, "test-gang-2") == []  # another gang's marker: none
    assert launch.marked_processes(GANG_ENV, "") == []
    assert launch.kill_marked(GANG_ENV, "test-gang-1") == [grandchild]
    deadline = time.monotonic() + 10
    while _alive(grandchild):
        assert time.monotonic() < deadline, "the launcher's worker outlived kill_marked"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.mark.parametrize(
    ("description", "detail", "joined"),
    [
        (
            "configuration error (permanent)",
            "configuration error: X: bad",
            "configuration error (permanent): X: bad",
        ),
        ("exited with code 1", "Traceback: boom", "exited with code 1: Traceback: boom"),
        ("exited with code 1", "no colon here", "exited with code 1: no colon here"),
        (
            "configuration error (permanent)",
            "configuration error: ",
            "configuration error (permanent): configuration error: ",
        ),
    ],
)
def test_an_exit_described_with_its_detail_says_nothing_twice(
    description: str, detail: str, joined: str
) -> None:
    assert with_detail(description, detail) == joined


LEADER = """
import signal, subprocess, sys, time
child = '''
import signal, sys, time
def stop(*_):
    time.sleep(float(sys.argv[2]))  # a stop checkpoint's write
    open(sys.argv[1], "w").write("checkpointed")
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    time.sleep(0.01)
'''
worker = subprocess.Popen([sys.executable, "-c", child, sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE)
worker.stdout.readline()
print("ready", flush=True)
time.sleep(60)  # dies of the SIGTERM at once, as torch.multiprocessing.spawn's parent does
"""


@pytest.mark.parametrize(("write_seconds", "gone"), [(0.5, True), (30.0, False)])
def test_a_stopped_group_is_waited_for_after_its_leader_dies(
    tmp_path: Path, write_seconds: float, gone: bool
) -> None:
    marker = tmp_path / "marker"
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER, str(marker), str(write_seconds)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert leader.stdout is not None
    assert leader.stdout.readline().strip() == b"ready"
    os.killpg(leader.pid, signal.SIGTERM)
    leader.wait(timeout=30)
    assert leader.returncode == -signal.SIGTERM
    assert launch.wait_for_group(leader, time.monotonic() + 3) is gone
    launch.signal_group(leader, signal.SIGKILL)
    # The leader's worker was given the grace its stop checkpoint needed, or (a write that outlasts the
    # grace) it was not waited for beyond it.
    assert (marker.exists() and marker.read_text() == "checkpointed") is gone
