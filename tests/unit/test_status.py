"""The status contract: the model's validation, the one safe file reader, the JSON parsers, and a fuzz of
the status file's bytes."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from trainer_sidecar.contract.status import (
    MAX_MESSAGE_CHARS,
    MAX_STATUS_BYTES,
    TERMINATION_MESSAGE_LIMIT,
    CheckpointRef,
    Phase,
    SidecarStatusDocument,
    StatusRead,
    WorkerStatus,
    parse_status,
    parse_status_document,
    read_status,
    write_status,
    write_termination_message,
)

NOW = 1_700_000_000.0


def document(**fields: Any) -> dict[str, Any]:
    """A valid status document of a running worker, with ``fields`` on top."""
    values: dict[str, Any] = {
        "phase": "running",
        "started_at": NOW - 100,
        "updated_at": NOW,
        "step": 42,
        "last_step_time": NOW,
        "steps_total": 42,
        "samples_seen": 100,
    }
    values.update(fields)
    return values


# --- the model -----------------------------------------------------------------------------------------


def test_a_valid_document_reads_as_a_status() -> None:
    status, reason = parse_status(json.dumps(document()))
    assert reason == ""
    assert status is not None
    assert (status.phase, status.step, status.last_step_time) == (Phase.RUNNING, 42, NOW)


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        pytest.param({"step": True}, "step", id="bool-step"),
        pytest.param({"step": "42"}, "step", id="string-step"),
        pytest.param({"step": 4.5}, "step", id="float-step"),
        pytest.param({"step": -1}, "step", id="negative-step"),
        pytest.param({"rollbacks": -3}, "rollbacks", id="negative-counter"),
        pytest.param({"samples_seen": 10**30}, "samples_seen", id="huge-counter"),
        pytest.param({"pid": 2**40}, "pid", id="huge-pid"),
        pytest.param({"phase": "dancing"}, "phase", id="unknown-phase"),
        pytest.param({"started_at": -5.0}, "started_at", id="negative-timestamp"),
        pytest.param({"started_at": "yesterday"}, "started_at", id="string-timestamp"),
        pytest.param({"started_at": True}, "started_at", id="bool-timestamp"),
        pytest.param({"loss": "nan"}, "loss", id="string-loss"),
        pytest.param({"grad_norm": -1.0}, "grad_norm", id="negative-grad-norm"),
        pytest.param({"lr_scale": -0.5}, "lr_scale", id="negative-lr-scale"),
        pytest.param({"rank": 3, "world_size": 2}, "(document)", id="rank-outside-the-gang"),
        pytest.param({"world_size": 0}, "world_size", id="empty-gang"),
        pytest.param({"explosion_pattern": "x" * 65}, "explosion_pattern", id="long-pattern"),
        pytest.param(
            {"last_clean_checkpoint": {"step": 1, "path": "/c/" + "x" * 5000}},
            "last_clean_checkpoint.path",
            id="long-checkpoint-path",
        ),
        pytest.param(
            {"last_clean_checkpoint": {"step": 1, "path": "/c", "sha256": "not hex"}},
            "last_clean_checkpoint.sha256",
            id="bad-sha256",
        ),
        pytest.param({"started_at": None}, "started_at", id="null-started-at"),
    ],
)
def test_the_model_refuses_what_readers_could_not_rely_on(fields: dict[str, Any], where: str) -> None:
    status, reason = parse_status(json.dumps(document(**fields)), "the test's status")
    assert status is None
    assert reason.startswith("the test's status is not a valid worker status")
    assert f"({where}:" in reason


@pytest.mark.parametrize(
    "text",
    [
        pytest.param('{"started_at": 1, "last_step_time": NaN}', id="nan"),
        pytest.param('{"started_at": 1, "last_step_time": Infinity}', id="infinity"),
        pytest.param('{"started_at": 1, "busy_since": -Infinity}', id="minus-infinity"),
        pytest.param('{"started_at": 1e400}', id="overflow-to-infinity"),
        pytest.param('{"started_at": 1, "loss": NaN}', id="nan-loss"),
    ],
)
def test_non_finite_numbers_are_refused_from_json(text: str) -> None:
    status, reason = parse_status(text)
    assert status is None
    assert "finite number" in reason


def test_non_finite_numbers_are_refused_from_python_too() -> None:
    with pytest.raises(ValidationError, match="finite number"):
        WorkerStatus(started_at=NOW, last_step_time=math.nan)
    with pytest.raises(ValidationError, match="finite number"):
        CheckpointRef(step=1, path="/c", time=math.inf)


def test_a_long_message_is_shortened_not_refused() -> None:
    status = WorkerStatus(started_at=NOW, message="x" * 10_000)
    assert len(status.message) == MAX_MESSAGE_CHARS
    assert status.message.endswith("...")
    read, _ = parse_status(json.dumps(document(message="y" * 5000)))
    assert read is not None
    assert len(read.message) == MAX_MESSAGE_CHARS


def test_unknown_fields_are_ignored_and_drop_rate_is_derived() -> None:
    status, reason = parse_status(json.dumps(document(drop_rate=0.5, from_the_future={"x": 1})))
    assert reason == ""
    assert status is not None
    assert status.drop_rate == 0.0
    assert status.to_document()["drop_rate"] == 0.0


# --- parsers of JSON from elsewhere ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        pytest.param([1, 2], id="list"),
        pytest.param(None, id="null"),
        pytest.param(42, id="number"),
        pytest.param(WorkerStatus(started_at=NOW), id="a-model-not-json"),
    ],
)
def test_parse_status_refuses_what_is_not_a_json_object(data: object) -> None:
    assert parse_status(data, "X") == StatusRead(None, "X is not a JSON object")


def test_parse_status_takes_text_bytes_and_decoded_objects_alike() -> None:
    text = json.dumps(document(step=7))
    results = [parse_status(text), parse_status(text.encode()), parse_status(json.loads(text))]
    assert [r.reason for r in results] == ["", "", ""]
    assert {r.status.step for r in results if r.status is not None} == {7}
    # Strictness holds for decoded objects too: a bool from json.loads is not a step.
    assert parse_status(json.loads(json.dumps(document(step=True)))).status is None


def test_parse_status_refuses_oversized_text_unparsed() -> None:
    text = json.dumps(document(message="x" * MAX_STATUS_BYTES))
    status, reason = parse_status(text, "the termination message")
    assert status is None
    assert reason.startswith(f"the termination message is {len(text)} bytes, more than")


def test_a_termination_message_parses_back_within_the_kubelet_limit(tmp_path: Path) -> None:
    path = tmp_path / "termination-log"
    status = WorkerStatus(started_at=NOW, step=9, message="\u00e9" * 5000)
    write_termination_message(path, status)
    assert len(path.read_bytes()) <= TERMINATION_MESSAGE_LIMIT
    read, reason = parse_status(path.read_text(), "the termination message")
    assert reason == ""
    assert read is not None
    assert read.step == 9


def test_the_status_document_round_trips_and_refuses_a_bad_nested_status() -> None:
    good = {
        "status": document(step=5),
        "read_error": "",
        "health": {"alive": True, "ready": True, "reason": "running: step 5"},
        "time": NOW,
        "sidecar": {"started_at": NOW - 10, "hang_timeout_seconds": 300, "startup_grace_seconds": 600},
    }
    parsed, reason = parse_status_document(json.dumps(good))
    assert reason == ""
    assert parsed is not None
    assert parsed.status is not None
    assert parsed.status.step == 5
    assert parsed.health.alive
    again = parse_status_document(parsed.to_document()).document
    assert again == parsed
    bad = {**good, "status": document(step=-1)}
    assert parse_status_document(bad).reason.endswith(
        "is not a valid sidecar status (status.step: Input should be greater than or equal to 0)"
    )
    no_health = {**good, "health": {"alive": "yes", "ready": True}}
    assert "health.alive" in parse_status_document(no_health).reason
    unreadable = {**good, "status": None, "read_error": "status file x does not exist yet"}
    parsed_unreadable = parse_status_document(unreadable).document
    assert isinstance(parsed_unreadable, SidecarStatusDocument)
    assert parsed_unreadable.status is None


# --- the file reader -------------------------------------------------------------------------------------


def test_read_status_reads_what_write_status_wrote(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    written = WorkerStatus.model_validate(document(loss=0.5))
    write_status(path, written)
    assert read_status(path) == StatusRead(written, "")


def test_a_missing_file_is_a_reason(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    assert read_status(path) == StatusRead(None, f"status file {path} does not exist yet")


def test_a_directory_is_a_reason(tmp_path: Path) -> None:
    status, reason = read_status(tmp_path)
    assert status is None
    assert reason == f"status file {tmp_path} is a directory, not a regular file"


def _returns_promptly(path: Path) -> StatusRead:
    """``read_status(path)`` on a helper thread; fails the test if it does not return within 10 s."""
    result: list[StatusRead] = []
    reader = threading.Thread(target=lambda: result.append(read_status(path)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), f"read_status({path}) blocked"
    return result[0]


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "status.json"
    os.mkfifo(fifo)
    status, reason = _returns_promptly(fifo)
    assert status is None
    assert reason == f"status file {fifo} is a FIFO, not a regular file"
    # Also when the path turns into a FIFO between the stat and the open: the fstat of what was opened.
    regular = tmp_path / "regular"
    regular.write_text("{}")
    real_stat = os.stat
    swapped = {"done": False}

    def stat_then_swap(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        result = real_stat(path, *args, **kwargs)
        if Path(path) == regular and not swapped["done"]:
            swapped["done"] = True
            regular.unlink()
            os.mkfifo(regular)
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "stat", stat_then_swap)
        status, reason = _returns_promptly(regular)
    assert swapped["done"]
    assert reason == f"status file {regular} is a FIFO, not a regular file"


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_dev_zero_is_refused_unread() -> None:
    status, reason = _returns_promptly(Path("/dev/zero"))
    assert status is None
    assert reason == "status file /dev/zero is a character device, not a regular file"


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the byte counts ``read_status`` asks ``os.read`` for."""
    asked: list[int] = []
    real_read = os.read

    def counting_read(fd: int, size: int) -> bytes:
        asked.append(size)
        return real_read(fd, size)

    monkeypatch.setattr(os, "read", counting_read)
    return asked


def test_a_huge_file_and_a_symlink_to_it_are_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    huge = tmp_path / "huge"
    with huge.open("wb") as handle:
        handle.truncate(2**32)  # sparse: 4 GiB that take no disk
    link = tmp_path / "status.json"
    link.symlink_to(huge)
    asked = _count_reads(monkeypatch)
    for path in (huge, link):
        status, reason = read_status(path)
        assert status is None
        assert reason == f"status file {path} is {2**32} bytes, more than the {MAX_STATUS_BYTES} allowed"
    assert asked == []


def test_a_file_at_the_cap_is_read_and_one_byte_more_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = json.dumps(document())
    padded = text + " " * (MAX_STATUS_BYTES - len(text))
    path = tmp_path / "status.json"
    path.write_text(padded)
    assert read_status(path).reason == ""
    path.write_text(padded + " ")
    assert read_status(path).reason.endswith(f"more than the {MAX_STATUS_BYTES} allowed")


def test_a_file_that_lies_about_its_size_is_read_boundedly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Files in /proc say 0 bytes and yield more; the read stops one byte past the cap whatever fstat said.
    path = tmp_path / "status.json"
    path.write_bytes(b" " * (4 * MAX_STATUS_BYTES))
    real_fstat = os.fstat

    def small_fstat(fd: int) -> Any:
        result = real_fstat(fd)
        fields = list(result)
        fields[6] = 0  # st_size
        return os.stat_result(fields)

    monkeypatch.setattr(os, "fstat", small_fstat)
    asked = _count_reads(monkeypatch)
    status, reason = read_status(path)
    assert status is None
    assert reason == f"status file {path} is more than the {MAX_STATUS_BYTES} bytes allowed"
    assert sum(asked) == MAX_STATUS_BYTES + 1


def test_a_path_with_a_nul_byte_is_a_reason() -> None:
    status, reason = read_status(Path("/tmp/status\0.json"))
    assert status is None
    assert "cannot be read" in reason


# --- fuzz -------------------------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30)
)
field_names = st.sampled_from([*list(WorkerStatus.model_fields), "drop_rate", "unknown"])
status_like = st.dictionaries(
    field_names,
    json_scalars
    | st.sampled_from([p.value for p in Phase])
    | st.dictionaries(st.text(max_size=8), json_scalars),
    max_size=12,
)


def _bytes_of(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, allow_nan=True).encode()


status_bytes = st.one_of(
    st.binary(max_size=2048),
    status_like.map(_bytes_of),
    status_like.map(lambda overrides: _bytes_of({**document(), **overrides})),
    st.binary(min_size=1, max_size=64).map(lambda b: b * (MAX_STATUS_BYTES // len(b) + 1)),
)


def _check(read: StatusRead) -> None:
    status, reason = read
    assert (status is None) != (reason == "")
    if status is not None:
        assert status.rank < status.world_size
        for value in (status.started_at, status.updated_at, status.last_step_time, status.busy_since):
            assert value is None or (math.isfinite(value) and value >= 0)
        assert len(status.message) <= MAX_MESSAGE_CHARS


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=status_bytes)
def test_any_bytes_in_the_status_file_give_a_status_or_a_reason(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "status.json"
    path.write_bytes(data)
    _check(read_status(path))
    _check(parse_status(data))


@settings(max_examples=200)
@given(doc=status_like)
def test_any_decoded_object_gives_a_status_or_a_reason(doc: dict[str, Any]) -> None:
    _check(parse_status(doc))
    outcome = parse_status_document({"status": doc, "health": {"alive": True, "ready": True}, "time": 1})
    assert (outcome.document is None) != (outcome.reason == "")


def test_deeply_nested_json_is_a_reason_not_a_crash() -> None:
    text = '{"started_at": 1, "message": ' + "[" * 20_000 + "]" * 20_000 + "}"
    status, reason = parse_status(text)
    assert status is None
    assert reason


def test_read_status_measures_the_file_not_the_clock(tmp_path: Path) -> None:
    # The reader never judges time: a status from the far future reads fine (the sidecar judges it).
    path = tmp_path / "status.json"
    path.write_text(json.dumps(document(last_step_time=time.time() + 1e9)))
    assert read_status(path).reason == ""
