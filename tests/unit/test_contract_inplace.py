"""The restart-in-place contract: orders and launcher states are written whole and read without trust;
an order is signed for one pod, once, for a minute, and a pod takes one attempt at a time."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import stat
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer_sidecar.contract.env import ATTEMPT_ENV, CHECKPOINT_DIR_ENV, REMEDIATION_ENV, RESTARTS_ENV
from trainer_sidecar.contract.inplace import (
    LAUNCHER_FILE,
    MAX_FILE_BYTES,
    ORDER_CLOCK_SKEW_SECONDS,
    ORDER_FILE,
    ORDER_LIFETIME_SECONDS,
    LauncherPhase,
    LauncherState,
    OrderClaims,
    Refusal,
    RestartOrder,
    SignedOrder,
    StopMode,
    Verdict,
    check_order,
    container_exit_code,
    order_verdict,
    read_launcher_state,
    read_order,
    sign_order,
    write_launcher_state,
    write_order,
)
from trainer_sidecar.contract.settings import SETTINGS_ENV


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


# --- signed orders ------------------------------------------------------------------------------------

KEY = "ab" * 32
POD = "research/tiny-lm-1-worker-1"
NOW = 1_800_000_000.0
ORDER = RestartOrder(
    attempt=3, environment={ATTEMPT_ENV: "3", RESTARTS_ENV: "2"}, stop=StopMode.GRACEFUL, grace_seconds=5.0
)


def signed_text(key: str, claims: str) -> bytes:
    """An order's body whose claims are ``claims`` exactly, signed with ``key`` (as a signer would)."""
    signature = hmac.new(bytes.fromhex(key), claims.encode(), hashlib.sha256).hexdigest()
    return SignedOrder(claims=claims, signature=signature).model_dump_json().encode()


def test_a_signed_order_verifies_for_its_pod_within_its_minute() -> None:
    body = sign_order(KEY, POD, ORDER, NOW)
    for now in (NOW - ORDER_CLOCK_SKEW_SECONDS, NOW, NOW + ORDER_LIFETIME_SECONDS + ORDER_CLOCK_SKEW_SECONDS):
        claims, refusal, reason = check_order(KEY, body, POD, now)
        assert (refusal, reason) == (None, "")
        assert claims is not None
        assert (claims.order, claims.pod, claims.issued_at) == (ORDER, POD, NOW)
    # Every order is unlike every other: a nonce of its own.
    assert sign_order(KEY, POD, ORDER, NOW) != body


@pytest.mark.parametrize(
    "changes",
    [
        {"start_delay_seconds": 86400.0},  # a day's wait
        {"attempt": 2**31 - 1},  # every later order of the operator's ignored
        {"environment": {SETTINGS_ENV: '{"guard": {}}'}},  # the guard loosened
        {"stop": "kill"},
    ],
)
def test_an_order_altered_in_any_part_is_refused_as_forged(changes: dict[str, object]) -> None:
    envelope = SignedOrder.model_validate_json(sign_order(KEY, POD, ORDER, NOW))
    claims = json.loads(envelope.claims)
    claims["order"] |= changes
    altered = SignedOrder(claims=json.dumps(claims), signature=envelope.signature).model_dump_json().encode()
    assert check_order(KEY, altered, POD, NOW)[1:] == (
        Refusal.FORGED,
        "the order's signature does not verify",
    )


@given(st.data())
def test_any_byte_of_the_signed_text_changed_is_refused(data: st.DataObject) -> None:
    envelope = SignedOrder.model_validate_json(sign_order(KEY, POD, ORDER, NOW))
    where = data.draw(st.integers(0, len(envelope.claims) - 1))
    char = data.draw(st.characters(codec="ascii").filter(lambda c: c != envelope.claims[where]))
    text = envelope.claims[:where] + char + envelope.claims[where + 1 :]
    altered = SignedOrder(claims=text, signature=envelope.signature).model_dump_json().encode()
    claims, refusal, _ = check_order(KEY, altered, POD, NOW)
    assert (claims, refusal) == (None, Refusal.FORGED)


def test_an_order_signed_with_another_key_is_forged() -> None:
    body = sign_order("cd" * 32, POD, ORDER, NOW)
    assert check_order(KEY, body, POD, NOW)[1] is Refusal.FORGED


def test_an_order_for_another_pod_is_refused_by_this_one() -> None:
    body = sign_order(KEY, "research/tiny-lm-1-worker-0", ORDER, NOW)
    claims, refusal, reason = check_order(KEY, body, POD, NOW)
    assert (claims, refusal) == (None, Refusal.MISDIRECTED)
    assert "tiny-lm-1-worker-0" in reason


@pytest.mark.parametrize(
    ("now", "said"),
    [
        (NOW + ORDER_LIFETIME_SECONDS + ORDER_CLOCK_SKEW_SECONDS + 1, "expired"),
        (NOW + 3600, "expired"),
        (NOW - ORDER_CLOCK_SKEW_SECONDS - 1, "ahead of this clock"),
    ],
)
def test_an_expired_order_or_one_from_a_clock_too_far_ahead_is_refused(now: float, said: str) -> None:
    claims, refusal, reason = check_order(KEY, sign_order(KEY, POD, ORDER, NOW), POD, now)
    assert (claims, refusal) == (None, Refusal.EXPIRED)
    assert said in reason


def test_a_signed_order_cannot_live_longer_than_a_minute() -> None:
    """Even its signer cannot make an order good for longer: what a sidecar remembers stays bounded."""
    envelope = SignedOrder.model_validate_json(sign_order(KEY, POD, ORDER, NOW))
    claims = json.loads(envelope.claims) | {"expires_at": NOW + 86400}
    claims_, refusal, reason = check_order(KEY, signed_text(KEY, json.dumps(claims)), POD, NOW)
    assert (claims_, refusal) == (None, Refusal.MALFORMED)
    assert "expires_at" in reason
    with pytest.raises(ValueError, match="expires_at"):
        OrderClaims(pod=POD, issued_at=NOW, expires_at=NOW, nonce="0" * 32, order=ORDER)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (ORDER.model_dump_json().encode(), "unsigned restart order"),  # an older operator's
        (b"{}", "not a signed restart order"),
        (b"\xff" * 10, "not a signed restart order"),
        (b'{"claims": "{}", "signature": "zz"}', "signature"),
    ],
)
def test_what_is_not_a_signed_order_is_refused_as_malformed(body: bytes, said: str) -> None:
    claims, refusal, reason = check_order(KEY, body, POD, NOW)
    assert (claims, refusal) == (None, Refusal.MALFORMED)
    assert said in reason


def running(attempt: int) -> LauncherState:
    return LauncherState(attempt=attempt, phase=LauncherPhase.RUNNING, since=0.0, updated_at=0.0)


def ordered(attempt: int) -> RestartOrder:
    return RestartOrder(attempt=attempt, environment={}, stop=StopMode.KILL)


@given(
    st.integers(1, 50),
    st.one_of(st.none(), st.integers(1, 50)),
    st.integers(1, 50),
)
def test_a_pod_takes_only_an_attempt_newer_than_it_runs_or_was_ordered_one_at_a_time(
    runs: int, pending: int | None, attempt: int
) -> None:
    verdict, reason = order_verdict(attempt, running(runs), None if pending is None else ordered(pending))
    waiting = pending if pending is not None and pending > runs else None
    current = runs if waiting is None else waiting
    if attempt == current:
        assert verdict is Verdict.TAKEN
    elif attempt > current and waiting is None:
        assert verdict is Verdict.TAKE
    else:
        assert verdict is Verdict.REFUSE
    assert str(attempt) in reason
