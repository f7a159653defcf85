"""Fault schedules: parsing, once-per-job firing across restarts, rank filtering, per-rank ledgers."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.paths import REPO_ROOT
from trainer_sidecar.contract.env import FAULTS_ENV
from trainer_sidecar.contract.exitcodes import ExitCode
from trainer_sidecar.guardian.config import ConfigError, GuardianConfig
from trainer_sidecar.guardian.faults import (
    MAX_STEP,
    Fault,
    FaultInjector,
    FaultKind,
    FaultSchedule,
    FaultSpecError,
    parse_faults,
)

REPO_ROOT = REPO_ROOT

# --- parsing -------------------------------------------------------------------------------------------


def test_parse_single_fault_burst_and_rank() -> None:
    assert parse_faults("crash@500").faults == (Fault(FaultKind.CRASH, 500),)
    assert parse_faults("hang@300:1").faults == (Fault(FaultKind.HANG, 300, rank=1),)
    assert parse_faults("nan_loss@120x4").faults == (Fault(FaultKind.NAN_LOSS, 120, 4),)
    assert parse_faults("inf_grad@7x2:3").faults == (Fault(FaultKind.INF_GRAD, 7, 2, 3),)
    assert parse_faults("bad_sample@0x1").faults == (Fault(FaultKind.BAD_SAMPLE, 0),)


def test_parse_a_list_with_spaces_and_empty_items() -> None:
    assert parse_faults(" loss_spike@5 , ,crash@9:0,").faults == (
        Fault(FaultKind.LOSS_SPIKE, 5),
        Fault(FaultKind.CRASH, 9, rank=0),
    )
    assert parse_faults("") == FaultSchedule()
    assert parse_faults(" , ") == FaultSchedule()


def test_a_huge_burst_is_a_range_not_a_list() -> None:
    # nan_loss@1x1000000000 once allocated ~146 bytes per repetition and died with MemoryError.
    tracemalloc.start()
    try:
        schedule = parse_faults("nan_loss@1x1000000000")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    injector = FaultInjector(schedule, rank=0, ledger_dir=None)
    assert injector.fires(FaultKind.NAN_LOSS, 999_999_999)
    assert not injector.fires(FaultKind.NAN_LOSS, 1_000_000_001)


@pytest.mark.parametrize(
    "text",
    [
        "nan_loss@9007199254740992",  # beyond 2^53
        "nan_loss@1x9007199254740992",
        "hang@1:1048576",  # rank out of range
        "crash@1," * 300,  # too many items
        "nan_loss@" + "9" * 30,
    ],
)
def test_out_of_range_schedules_are_refused(text: str) -> None:
    with pytest.raises(FaultSpecError, match=FAULTS_ENV):
        parse_faults(text)


def test_a_malformed_schedule_is_a_configuration_error_naming_the_variable() -> None:
    with pytest.raises(ConfigError) as caught:
        GuardianConfig.from_env({FAULTS_ENV: "nan_loss@1x1000000000,explode@5"})
    assert caught.value.code == ExitCode.CONFIG_ERROR
    assert FAULTS_ENV in str(caught.value)
    assert "explode@5" in str(caught.value)


@pytest.mark.parametrize(
    "item",
    [
        "nan_loss",
        "nan_loss@",
        "nan_loss@x3",
        "@5",
        "nan_loss@5:r",
        "nan_loss@-1",
        "nan_loss@5x",
        "nan_loss@1.5",
        "NAN_LOSS@5",
        "nan_loss@5:1:2",
        "nan_loss@5x0",
    ],
)
def test_bad_items_raise_quoting_the_item(item: str) -> None:
    with pytest.raises(FaultSpecError) as caught:
        parse_faults(f"crash@1, {item} ,hang@2")
    message = str(caught.value)
    assert repr(item) in message
    assert FAULTS_ENV in message
    assert isinstance(caught.value, ValueError)


def test_unknown_kind_lists_the_known_kinds() -> None:
    with pytest.raises(FaultSpecError) as caught:
        parse_faults("nan_loss@1,explode@5")
    message = str(caught.value)
    assert "'explode@5'" in message
    assert "unknown fault kind" in message
    for kind in FaultKind:
        assert kind.value in message


_items = st.tuples(
    st.sampled_from(list(FaultKind)),
    st.integers(0, 10_000),
    st.one_of(st.none(), st.integers(1, 5)),
    st.one_of(st.none(), st.integers(0, 7)),
    st.sampled_from(["1", "1.5", "2", "100", "3.25"]),
)


@given(st.lists(_items, max_size=6))
def test_parse_reads_any_well_formed_schedule(
    items: list[tuple[FaultKind, int, int | None, int | None, str]],
) -> None:
    text = ",".join(
        kind.value
        + (f"*{factor}" if kind is FaultKind.SLOW else "")
        + f"@{step}"
        + (f"x{count}" if count is not None else "")
        + (f":{rank}" if rank is not None else "")
        for kind, step, count, rank, factor in items
    )
    # slow is a condition: without a count it lasts to the end.
    expected = tuple(
        Fault(kind, step, count or (MAX_STEP - step if kind is FaultKind.SLOW else 1), rank, float(factor))
        if kind is FaultKind.SLOW
        else Fault(kind, step, count or 1, rank)
        for kind, step, count, rank, factor in items
    )
    assert parse_faults(text).faults == expected


# --- firing --------------------------------------------------------------------------------------------


def ledger(directory: Path, rank: int) -> list[str]:
    keys: list[str] = json.loads((directory / f"faults-fired-rank{rank}.json").read_text())
    return keys


def test_fires_exactly_once_and_is_recorded_before_it_returns(tmp_path: Path) -> None:
    injector = FaultInjector(parse_faults("nan_loss@5,crash@9"), rank=0, ledger_dir=tmp_path)
    assert injector.active
    assert not injector.fires(FaultKind.NAN_LOSS, 4)
    assert not injector.fires(FaultKind.INF_GRAD, 5)  # right step, wrong kind
    assert not (tmp_path / "faults-fired-rank0.json").exists()

    assert injector.fires(FaultKind.NAN_LOSS, 5)
    assert ledger(tmp_path, 0) == ["nan_loss@5:*"]
    assert not injector.fires(FaultKind.NAN_LOSS, 5)  # a rolled-back step re-run does not re-fire
    assert injector.active

    assert injector.fires(FaultKind.CRASH, 9)
    assert ledger(tmp_path, 0) == ["crash@9:*", "nan_loss@5:*"]
    assert not injector.active


def test_fires_once_per_job_across_a_restart(tmp_path: Path) -> None:
    schedule = "crash@500,nan_loss@10x3"
    first = FaultInjector(parse_faults(schedule), rank=0, ledger_dir=tmp_path)
    assert first.fires(FaultKind.NAN_LOSS, 10)
    assert first.fires(FaultKind.CRASH, 500)
    # ... the process crashes here; the job restarts from an earlier checkpoint and replays the steps.
    second = FaultInjector(parse_faults(schedule), rank=0, ledger_dir=tmp_path)
    assert second.active  # nan_loss@11 and @12 have not fired yet
    assert not second.fires(FaultKind.NAN_LOSS, 10)
    assert second.fires(FaultKind.NAN_LOSS, 11)
    assert not second.fires(FaultKind.CRASH, 500)
    third = FaultInjector(parse_faults(schedule), rank=0, ledger_dir=tmp_path)
    assert [third.fires(FaultKind.NAN_LOSS, step) for step in (10, 11, 12)] == [False, False, True]
    assert ledger(tmp_path, 0) == ["crash@500:*", "nan_loss@10x3:*"]


def test_without_a_ledger_a_fault_fires_once_per_injector(tmp_path: Path) -> None:
    injector = FaultInjector(parse_faults("hang@3"), rank=0, ledger_dir=None)
    assert injector.fires(FaultKind.HANG, 3)
    assert not injector.fires(FaultKind.HANG, 3)
    assert list(tmp_path.iterdir()) == []


def test_a_garbage_ledger_is_treated_as_empty(tmp_path: Path) -> None:
    (tmp_path / "faults-fired-rank0.json").write_text("{not json")
    injector = FaultInjector(parse_faults("hang@3"), rank=0, ledger_dir=tmp_path)
    assert injector.fires(FaultKind.HANG, 3)
    assert ledger(tmp_path, 0) == ["hang@3:*"]


def test_rank_filtering(tmp_path: Path) -> None:
    faults = parse_faults("hang@300:1,nan_loss@10,crash@20:0")
    rank0 = FaultInjector(faults, rank=0, ledger_dir=tmp_path)
    rank1 = FaultInjector(faults, rank=1, ledger_dir=tmp_path)
    rank2 = FaultInjector(parse_faults("hang@300:1"), rank=2, ledger_dir=tmp_path)

    assert not rank0.fires(FaultKind.HANG, 300)
    assert rank1.fires(FaultKind.HANG, 300)
    assert rank0.fires(FaultKind.CRASH, 20)
    assert not rank1.fires(FaultKind.CRASH, 20)
    assert not rank2.active
    assert not rank2.fires(FaultKind.HANG, 300)
    # A fault for every rank fires once on each rank.
    assert rank0.fires(FaultKind.NAN_LOSS, 10)
    assert rank1.fires(FaultKind.NAN_LOSS, 10)
    assert sorted(ledger(tmp_path, 0)) == ["crash@20:0", "nan_loss@10:*"]
    assert sorted(ledger(tmp_path, 1)) == ["hang@300:1", "nan_loss@10:*"]
    assert not (tmp_path / "faults-fired-rank2.json").exists()


def test_the_config_reads_the_schedule_from_the_environment(tmp_path: Path) -> None:
    schedule = GuardianConfig.from_env({FAULTS_ENV: "inf_grad@4:1"}).faults
    assert FaultInjector(schedule, 1, tmp_path).fires(FaultKind.INF_GRAD, 4)
    assert not FaultInjector(schedule, 0, tmp_path).active
    assert GuardianConfig.from_env({}).faults == FaultSchedule()
    with pytest.raises(ConfigError, match="'oops'"):
        GuardianConfig.from_env({FAULTS_ENV: "oops"})


@pytest.mark.parametrize("schedule", ["", "nan_loss@5"])
def test_a_new_checkpoint_directory_is_no_ledger_warning(
    schedule: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A first run's directory does not exist before the guardian makes it: "faults may fire again" was
    # a false alarm every new user saw.
    injector = FaultInjector(parse_faults(schedule), rank=0, ledger_dir=tmp_path / "new")
    assert injector.active is bool(schedule)
    assert "fault ledger" not in caplog.text
    (tmp_path / "file").write_text("not a directory")
    FaultInjector(parse_faults("nan_loss@5"), rank=0, ledger_dir=tmp_path / "file")
    assert "fault ledger not read" in caplog.text  # an unreadable one is still reported
