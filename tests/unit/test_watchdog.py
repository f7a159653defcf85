"""The runner's watchdog: it kills the gangs it was told of when the runner's pipe ends without ``done``,
and nothing else, ever (a real watchdog process and real marked processes)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer_sidecar.contract.env import GANG_ENV
from trainguard.local import launch, watchdog


def sleeper(gang: str) -> subprocess.Popen[bytes]:
    """A process in a session of its own carrying ``gang``'s marker, as torchrun's workers do."""
    env = {**os.environ, GANG_ENV: gang}
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], env=env, start_new_session=True
    )


def gone(proc: subprocess.Popen[bytes], seconds: float = 10) -> bool:
    """Whether ``proc`` exits within ``seconds``."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def wait_marked(gang: str) -> None:
    """Until the sleeper of ``gang`` shows its environment in /proc (right after exec)."""
    deadline = time.monotonic() + 10
    while not launch.marked_processes(GANG_ENV, gang):
        assert time.monotonic() < deadline, f"no process of {gang} appeared"
        time.sleep(0.02)


def test_end_of_file_without_done_kills_the_announced_gangs_and_no_other() -> None:
    mine, theirs = sleeper("wd-test-mine"), sleeper("wd-test-theirs")
    try:
        wait_marked("wd-test-mine")
        wait_marked("wd-test-theirs")
        killed = watchdog.watch(io.BytesIO(b"gang wd-test-mine\ngang \ngarbage\n"))
        assert killed == [mine.pid]
        assert gone(mine)
        assert mine.returncode == -signal.SIGKILL
        assert theirs.poll() is None  # another run's gang, never announced here
    finally:
        theirs.kill()
        theirs.wait()


def test_done_kills_nothing() -> None:
    mine = sleeper("wd-test-done")
    try:
        wait_marked("wd-test-done")
        assert watchdog.watch(io.BytesIO(b"gang wd-test-done\ndone\n")) == []
        assert mine.poll() is None
    finally:
        mine.kill()
        mine.wait()


def test_a_runner_killed_with_sigkill_takes_its_gang_with_it_through_the_watchdog(tmp_path: Path) -> None:
    # A stand-in runner: starts the watchdog, announces a gang, starts a marked process in a session of
    # its own (out of reach of any parent-death signal), then is killed with SIGKILL.
    pid_file = tmp_path / "worker.pid"
    runner_script = tmp_path / "runner.py"
    runner_script.write_text(
        "import os, subprocess, sys, time\n"
        "from trainer_sidecar.contract.env import GANG_ENV\n"
        "from trainguard.local import watchdog\n"
        "dog = watchdog.Watchdog.start('test')\n"
        "assert dog.announce('wd-test-runner')\n"
        "env = {**os.environ, GANG_ENV: 'wd-test-runner'}\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], env=env,"
        " start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(f'{{p.pid}} {{dog.proc.pid}}')\n"
        "time.sleep(600)\n"
    )
    runner = subprocess.Popen([sys.executable, str(runner_script)])
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the stand-in runner did not start its worker"
        time.sleep(0.05)
    worker, dog = map(int, pid_file.read_text().split())
    wait_marked("wd-test-runner")
    runner.kill()
    runner.wait()
    deadline = time.monotonic() + 5
    while launch.marked_processes(GANG_ENV, "wd-test-runner") or _alive(dog):
        assert time.monotonic() < deadline, "the worker or the watchdog outlived the runner"
        time.sleep(0.05)
    assert not _alive(worker)


def test_the_watchdog_ignores_stop_signals_and_says_done_on_close() -> None:
    dog = watchdog.Watchdog.start("test")
    assert dog.proc is not None
    wanted = sum(1 << (int(sig) - 1) for sig in launch.STOP_SIGNALS)
    deadline = time.monotonic() + 30
    while _ignored(dog.proc.pid) & wanted != wanted:  # until it has started up and ignores them
        assert time.monotonic() < deadline, "the watchdog never ignored the stop signals"
        time.sleep(0.02)
    for sig in launch.STOP_SIGNALS:
        os.kill(dog.proc.pid, sig)
    time.sleep(0.2)
    assert dog.alive
    dog.close()
    assert dog.proc.returncode == 0
    assert not dog.alive
    assert not dog.announce("late")  # closed: nothing more is sent


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _ignored(pid: int) -> int:
    """The mask of signals ``pid`` ignores (/proc's SigIgn)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    return 0
