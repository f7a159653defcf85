"""A warm spare's life as its keeper sees it (``trainer_sidecar.contract.warmspare``): started, watched,
handed off, dropped. Real processes, torch-free: the spawner runs a stand-in for the spare's module that
speaks the same protocol (``READY``, then one handoff) without importing torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trainer_sidecar.contract.handoff import Handoff, RunMode, WarmStart
from trainer_sidecar.contract.warmspare import WarmSpare

PLAN = WarmStart(RunMode.PATH, "train.py", ("--steps", "3"))

#: Stands in for ``trainer_sidecar.guardian.spare``: says READY (after a grandchild is started in its
#: process group, whose pid it writes first), takes one handoff and writes what it was handed to the
#: standard output it received; exits 7, or 0 at end of file (not needed).
STAND_IN = """
import os, socket, subprocess, sys, time
from trainer_sidecar.contract.handoff import READY, receive_handoff
channel = socket.socket(fileno=int(sys.argv[sys.argv.index("--channel") + 1]))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
if os.environ.get("STAND_IN_SLOW"):
    time.sleep(float(os.environ["STAND_IN_SLOW"]))
try:
    channel.sendall(READY)
except BrokenPipeError:  # the keeper handed off and closed its end before the spare was warm
    pass
got = receive_handoff(channel)
if got is None:
    sys.exit(0)
handoff, out, err = got
os.write(out, f"{handoff.environment['RANK_SAYS']} {' '.join(handoff.argv)} {handoff.cwd}\\n".encode())
os.write(err, b"to stderr\\n")
child.kill()
sys.exit(7)
"""


def stand_in_spawner(tmp_path: Path, env: dict[str, str] | None = None) -> Any:
    """A spawner that starts the stand-in in a session of its own with the argv's channel descriptor."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    started: list[subprocess.Popen[bytes]] = []

    def spawn(argv: list[str], channel_fd: int) -> subprocess.Popen[bytes]:
        assert argv[argv.index("--channel") + 1] == str(channel_fd)
        assert "trainer_sidecar.guardian.spare" in argv
        assert "--preload-script" in argv
        proc = subprocess.Popen(
            [sys.executable, str(script), *argv[1:]],
            pass_fds=(channel_fd,),
            stdout=subprocess.PIPE,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        started.append(proc)
        return proc

    spawn.started = started  # type: ignore[attr-defined]
    return spawn


def wait_warm(spare: WarmSpare, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not spare.is_warm():
        assert time.monotonic() < deadline, "the spare never said READY"
        time.sleep(0.02)


def gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (exited: gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except FileNotFoundError:
        return True


def test_a_spare_started_says_warm_and_once_handed_off_runs_what_it_was_handed(tmp_path: Path) -> None:
    spare = WarmSpare.start(PLAN, sys.executable, stand_in_spawner(tmp_path))
    assert spare.alive()
    wait_warm(spare)
    assert spare.warm
    assert spare.is_warm()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    handoff = Handoff.for_command(PLAN, environment={"RANK_SAYS": "rank-3"}, cwd=tmp_path)
    spare.hand_off(handoff, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    assert spare.channel.fileno() == -1  # closed by the handoff
    assert spare.proc.wait(timeout=30) == 7
    assert os.read(out_r, 4096) == f"rank-3 train.py --steps 3 {tmp_path}\n".encode()
    assert os.read(err_r, 4096) == b"to stderr\n"
    assert not spare.alive()
    for fd in (out_r, err_r):
        os.close(fd)
    assert spare.proc.stdout is not None
    spare.proc.stdout.close()


def test_a_dropped_spare_and_what_it_started_in_its_group_are_gone(tmp_path: Path) -> None:
    spare = WarmSpare.start(PLAN, sys.executable, stand_in_spawner(tmp_path))
    wait_warm(spare)
    assert spare.proc.stdout is not None
    grandchild = int(spare.proc.stdout.readline())
    spare.drop(wait=True)
    assert spare.proc.returncode == -signal.SIGKILL
    assert spare.channel.fileno() == -1
    deadline = time.monotonic() + 10
    while not gone(grandchild):
        assert time.monotonic() < deadline, "the spare's process group outlived its drop"
        time.sleep(0.02)
    assert not spare.alive()
    spare.drop(wait=True)  # dropping twice is harmless
    spare.proc.stdout.close()


def test_a_spare_handed_off_before_it_is_warm_still_takes_the_handoff(tmp_path: Path) -> None:
    spare = WarmSpare.start(PLAN, sys.executable, stand_in_spawner(tmp_path, {"STAND_IN_SLOW": "0.5"}))
    assert not spare.is_warm()
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        spare.hand_off(Handoff.for_command(PLAN, environment={"RANK_SAYS": "r"}, cwd=None), devnull, devnull)
    finally:
        os.close(devnull)
    assert spare.proc.wait(timeout=30) == 7
    assert spare.proc.stdout is not None
    spare.proc.stdout.close()


def test_a_spare_its_keeper_reaps_is_never_reaped_by_the_spare(tmp_path: Path) -> None:
    spare = WarmSpare.start(PLAN, sys.executable, stand_in_spawner(tmp_path), reaped_by_keeper=True)
    wait_warm(spare)
    spare.channel.close()  # end of file: the stand-in exits 0 (not needed)
    deadline = time.monotonic() + 30
    while not gone(spare.pid):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert spare.alive()  # exited, but its keeper has not reaped it yet: the spare does not look itself
    spare.drop(wait=True)  # neither waits
    pid, status = os.waitpid(spare.pid, 0)  # still the keeper's to reap
    assert pid == spare.pid
    assert os.waitstatus_to_exitcode(status) == 0
    spare.proc.returncode = 0  # as the launcher's reaping records it
    assert not spare.alive()
    assert spare.proc.stdout is not None
    spare.proc.stdout.close()


def test_a_spawner_that_fails_leaves_no_spare_and_no_socket(tmp_path: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))

    def refuse(argv: list[str], channel_fd: int) -> subprocess.Popen[bytes]:
        raise OSError("no room")

    with pytest.raises(OSError, match="no room"):
        WarmSpare.start(PLAN, sys.executable, refuse)
    assert len(os.listdir("/proc/self/fd")) == before
