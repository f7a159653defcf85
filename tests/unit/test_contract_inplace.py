"""The restart-in-place contract: orders and launcher states are written whole and read without trust."""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer_sidecar.contract.env import ATTEMPT_ENV, CHECKPOINT_DIR_ENV, REMEDIATION_ENV
from trainer_sidecar.contract.inplace import (
    LAUNCHER_FILE,
    MAX_FILE_BYTES,
    ORDER_FILE,
    LauncherPhase,
    LauncherState,
    RestartOrder,
    StopMode,
    container_exit_code,
    read_launcher_state,
    read_order,
    write_launcher_state,
    write_order,
)


def test_an_order_and_a_state_read_back_as_written(tmp_path: Path) -> None:
    order = RestartOrder(
        attempt=7, environment={REMEDIATION_ENV: '{"id":"x"}'}, stop=StopMode.GRACEFUL, grace_seconds=2.5
    )
    write_order(tmp_path, order)
    assert read_order(tmp_path) == (order, "")
    state = LauncherState(attempt=7, phase=LauncherPhase.EXITED, since=0.5, exit_code=137, updated_at=1.0)
    write_launcher_state(tmp_path, state)
    assert read_launcher_state(tmp_path) == (state, "")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ORDER_FILE, LAUNCHER_FILE])  # no temp left


def test_no_file_is_no_order_and_no_reason(tmp_path: Path) -> None:
    assert read_order(tmp_path) == (None, "")
    assert read_launcher_state(tmp_path) == (None, "")


@pytest.mark.parametrize(
    ("environment", "named"),
    [
        ({CHECKPOINT_DIR_ENV: "/elsewhere"}, CHECKPOINT_DIR_ENV),  # fixed for the pod's life
        ({"LD_PRELOAD": "/tmp/x.so"}, "LD_PRELOAD"),
        ({ATTEMPT_ENV: "2\0"}, "NUL"),
    ],
)
def test_an_order_sets_only_what_an_attempt_changes(
    tmp_path: Path, environment: dict[str, str], named: str
) -> None:
    (tmp_path / ORDER_FILE).write_text(json.dumps({"attempt": 2, "stop": "kill", "environment": environment}))
    order, reason = read_order(tmp_path)
    assert order is None
    assert named in reason
    assert ORDER_FILE in reason


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"attempt": 0, "stop": "kill", "environment": {}}', "attempt"),
        ('{"attempt": 2147483648, "stop": "kill", "environment": {}}', "attempt"),
        ('{"attempt": 2, "stop": "soon", "environment": {}}', "stop"),
        ('{"attempt": 2, "stop": "kill", "environment": {}, "grace_seconds": -1}', "grace_seconds"),
        ('{"attempt": 2, "stop": "kill", "environment": {}, "grace_seconds": 1e308}', "grace_seconds"),
        ('{"attempt": 2, "stop": "kill", "environment": {}, "argv": ["sh"]}', "argv"),
        ('{"attempt": 2, "stop": "kill", "environment": []}', "environment"),
        ("[]", "(document)"),
        ("\xff\xfe", "(document)"),
    ],
)
def test_a_malformed_order_is_refused_naming_its_field(tmp_path: Path, text: str, field: str) -> None:
    (tmp_path / ORDER_FILE).write_text(text, errors="surrogateescape")
    order, reason = read_order(tmp_path)
    assert order is None
    assert field in reason


def test_special_and_oversized_files_are_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / ORDER_FILE)
    assert "FIFO" in read_order(tmp_path).reason
    (tmp_path / LAUNCHER_FILE).write_bytes(b" " * (MAX_FILE_BYTES + 1))
    assert "larger" in read_launcher_state(tmp_path).reason or "bytes" in read_launcher_state(tmp_path).reason


@pytest.mark.parametrize(
    ("returncode", "shown"),
    [(0, 0), (1, 1), (255, 255), (-signal.SIGKILL, 137), (-signal.SIGTERM, 143), (-signal.SIGSEGV, 139)],
)
def test_an_exit_is_shown_as_a_container_shows_it(returncode: int, shown: int) -> None:
    assert container_exit_code(returncode) == shown


@given(st.integers(min_value=-64, max_value=2**16))
def test_every_exit_code_fits_a_state(returncode: int) -> None:
    code = container_exit_code(returncode)
    LauncherState(attempt=1, phase=LauncherPhase.EXITED, since=0.0, exit_code=code, updated_at=0.0)
    assert (code == 0) == (returncode in (0, 256, 512) or (returncode % 256 == 0 and returncode >= 0))


def test_orders_written_at_once_by_many_threads_leave_one_whole_order_and_no_error(tmp_path: Path) -> None:
    """The sidecar's request handlers are threads of one process: each write has a temporary file of its
    own (a name per process made one thread's rename take another's file away)."""
    errors: list[BaseException] = []
    start = threading.Barrier(16)

    def write(attempt: int) -> None:
        start.wait()
        for _ in range(20):
            try:
                write_order(tmp_path, RestartOrder(attempt=attempt, environment={}, stop=StopMode.KILL))
            except OSError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=write, args=(a,)) for a in range(2, 18)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    order, reason = read_order(tmp_path)
    assert order is not None, reason
    assert 2 <= order.attempt < 18
    assert [p.name for p in tmp_path.iterdir()] == [ORDER_FILE]  # no temporary file left


def test_an_order_and_a_state_are_readable_by_the_other_containers_user(tmp_path: Path) -> None:
    write_order(tmp_path, RestartOrder(attempt=2, environment={}, stop=StopMode.KILL))
    write_launcher_state(
        tmp_path, LauncherState(attempt=1, phase=LauncherPhase.RUNNING, since=0, updated_at=0)
    )
    for name in (ORDER_FILE, LAUNCHER_FILE):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) & 0o044 == 0o044
