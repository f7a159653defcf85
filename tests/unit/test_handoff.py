"""Which worker commands can run in a warm spare, and the handoff message between runner and spare."""

from __future__ import annotations

import copy
import os
import socket
import struct
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer_sidecar.contract.handoff import (
    Handoff,
    HandoffError,
    RunMode,
    WarmStart,
    plan_warm_start,
    receive_handoff,
    send_handoff,
)
from trainguard.core.spec import parse_job
from trainguard.local.runner import LocalRunner

PYTHON = sys.executable
ARGS = st.lists(st.text(min_size=0, max_size=12), max_size=6)


@given(script=st.text(min_size=1, max_size=20).filter(lambda s: not s.startswith("-")), args=ARGS)
def test_a_script_of_the_same_interpreter_runs_warm_with_its_arguments_untouched(
    script: str, args: list[str]
) -> None:
    assert plan_warm_start([PYTHON, script, *args], PYTHON) == WarmStart(RunMode.PATH, script, tuple(args))


@given(module=st.from_regex(r"[a-z_][a-z0-9_.]{0,15}", fullmatch=True), args=ARGS)
def test_a_module_of_the_same_interpreter_runs_warm(module: str, args: list[str]) -> None:
    assert plan_warm_start([PYTHON, "-m", module, *args], PYTHON) == WarmStart(
        RunMode.MODULE, module, tuple(args)
    )


@given(option=st.from_regex(r"-[A-Za-z]{1,3}", fullmatch=True).filter(lambda o: o != "-m"), args=ARGS)
def test_any_interpreter_option_starts_cold(option: str, args: list[str]) -> None:
    """-u, -X dev, -O, -c ... change how the interpreter starts, which a spare started earlier cannot."""
    reason = plan_warm_start([PYTHON, option, *args], PYTHON)
    assert isinstance(reason, str)
    assert option in reason


@pytest.mark.parametrize(
    ("command", "why"),
    [
        ([], "empty"),
        ([PYTHON], "interactive"),
        ([PYTHON, "-m"], "module name"),
        ([PYTHON, "-m", "-u"], "module name"),
        (["/bin/sh", "train.sh"], "not the interpreter"),
        (["/no/such/python3", "train.py"], "not the interpreter"),
    ],
)
def test_other_commands_start_cold_and_say_why(command: list[str], why: str) -> None:
    reason = plan_warm_start(command, PYTHON)
    assert isinstance(reason, str)
    assert why in reason


def test_a_link_to_the_interpreter_is_the_same_interpreter(tmp_path: Path) -> None:
    link = tmp_path / "python"
    link.symlink_to(PYTHON)
    assert isinstance(plan_warm_start([str(link), "train.py"], PYTHON), WarmStart)


def test_a_handoff_arrives_whole_with_its_two_descriptors(tmp_path: Path) -> None:
    """An environment far larger than one read (a long PATH, settings JSON) still arrives whole, with
    standard output and standard error as the two descriptors they were sent as."""
    handoff = Handoff(
        {"BIG": "x" * 300_000, "EMPTY": "", "ÜNICODE": "ü"}, "/w", RunMode.PATH, "t.py", ("t.py", "-a", "")
    )
    ours, theirs = socket.socketpair()
    out_log, err_log = tmp_path / "out", tmp_path / "err"
    with ours, theirs, open(out_log, "wb") as out, open(err_log, "wb") as err:
        sender = threading.Thread(target=send_handoff, args=(ours, handoff, out.fileno(), err.fileno()))
        sender.start()  # more than the socket's buffer: the sender waits for the reader
        received = receive_handoff(theirs)
        sender.join()
    assert received is not None
    got, stdout_fd, stderr_fd = received
    assert got == handoff
    os.write(stdout_fd, b"to standard output")
    os.write(stderr_fd, b"to standard error")
    os.close(stdout_fd)
    os.close(stderr_fd)
    assert (out_log.read_bytes(), err_log.read_bytes()) == (b"to standard output", b"to standard error")


@pytest.mark.parametrize("count", [1, 3])
def test_a_handoff_without_exactly_two_descriptors_is_refused_and_closes_them(
    tmp_path: Path, count: int
) -> None:
    ours, theirs = socket.socketpair()
    body = Handoff({}, "/", RunMode.PATH, "t.py", ("t.py",)).to_bytes()
    with open(tmp_path / "log", "wb") as out:
        socket.send_fds(ours, [struct.pack("!I", len(body)) + body], [out.fileno()] * count)
    ours.close()
    before = len(os.listdir("/proc/self/fd"))
    with theirs, pytest.raises(HandoffError, match="two descriptors"):
        receive_handoff(theirs)
    assert len(os.listdir("/proc/self/fd")) == before - 1  # the socket's own: none leaked


def test_a_closed_channel_is_no_handoff() -> None:
    ours, theirs = socket.socketpair()
    ours.close()
    with theirs:
        assert receive_handoff(theirs) is None


def test_a_message_cut_short_is_an_error_and_its_descriptor_is_closed(tmp_path: Path) -> None:
    ours, theirs = socket.socketpair()
    with open(tmp_path / "log", "wb") as out:
        socket.send_fds(ours, [struct.pack("!I", 1000) + b"{"], [out.fileno(), out.fileno()])
    ours.close()
    before = len(os.listdir("/proc/self/fd"))
    with theirs, pytest.raises(HandoffError, match="cut short"):
        receive_handoff(theirs)
    assert len(os.listdir("/proc/self/fd")) == before - 1  # the socket's own, at most: none leaked


@pytest.mark.parametrize(
    "body",
    [b"[]", b"{}", b'{"environment": {"A": 1}, "cwd": "/", "mode": "path", "target": "t", "argv": []}',
     b'{"environment": {}, "cwd": "/", "mode": "shell", "target": "t", "argv": []}'],
)  # fmt: skip
def test_a_malformed_handoff_names_the_problem(body: bytes) -> None:
    with pytest.raises(HandoffError, match="handoff"):
        Handoff.from_bytes(body)


MANIFEST: dict[str, Any] = {
    "apiVersion": "trainguard.dev/v1alpha1",
    "kind": "GuardedTrainingJob",
    "metadata": {"name": "demo", "namespace": "ml"},
    "spec": {
        "replicas": 2,
        "template": {"spec": {"containers": [{"name": "pytorch", "command": ["python", "train.py"]}]}},
        "checkpoint": {"claimName": "ckpt"},
    },
}


def runner(tmp_path: Path, command: list[str], *, nproc: int = 1, warm: bool = True) -> LocalRunner:
    document = copy.deepcopy(MANIFEST)
    document["spec"]["template"]["spec"]["containers"][0]["command"] = command
    document["spec"]["nprocPerNode"] = nproc
    return LocalRunner(
        parse_job(document, "job.yaml"), checkpoint_root=tmp_path, run_dir=tmp_path, warm_spares=warm
    )


def test_the_runner_plans_warm_restarts_for_a_plain_python_command(tmp_path: Path) -> None:
    plan = runner(tmp_path, ["python", "train.py", "--steps", "3"]).warm_plan
    assert plan == WarmStart(RunMode.PATH, "train.py", ("--steps", "3"))


def test_the_runner_starts_a_shell_script_cold(tmp_path: Path) -> None:
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\nexec python train.py\n")
    script.chmod(0o755)
    plan = runner(tmp_path, [str(script)]).warm_plan
    assert isinstance(plan, str)
    assert "not the interpreter" in plan


def test_the_runner_starts_torchrun_pods_and_a_turned_off_run_cold(tmp_path: Path) -> None:
    assert runner(tmp_path, ["python", "train.py"], nproc=2).warm_plan == (
        "nprocPerNode above 1 starts the workers under torchrun"
    )
    assert runner(tmp_path, ["python", "train.py"], warm=False).warm_plan == "warm spares are turned off"
