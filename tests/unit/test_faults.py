"""Fault schedules: parsing, once-per-job firing across restarts, rank filtering, per-rank ledgers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.paths import REPO_ROOT
from trainer_sidecar.faults import FAULTS_ENV, Fault, FaultInjector, FaultKind, FaultSpecError, parse_faults

REPO_ROOT = REPO_ROOT

# --- parsing -------------------------------------------------------------------------------------------


def test_parse_single_fault_burst_and_rank() -> None:
    assert parse_faults("crash@500") == [Fault(FaultKind.CRASH, 500)]
    assert parse_faults("hang@300:1") == [Fault(FaultKind.HANG, 300, rank=1)]
    assert parse_faults("nan_loss@120x4") == [
        Fault(FaultKind.NAN_LOSS, step) for step in (120, 121, 122, 123)
    ]
    assert parse_faults("inf_grad@7x2:3") == [
        Fault(FaultKind.INF_GRAD, 7, 3),
        Fault(FaultKind.INF_GRAD, 8, 3),
    ]
    assert parse_faults("bad_sample@0x1") == [Fault(FaultKind.BAD_SAMPLE, 0)]


def test_parse_a_list_with_spaces_and_empty_items() -> None:
    assert parse_faults(" loss_spike@5 , ,crash@9:0,") == [
        Fault(FaultKind.LOSS_SPIKE, 5),
        Fault(FaultKind.CRASH, 9, 0),
    ]
    assert parse_faults("") == []
    assert parse_faults(" , ") == []


def test_fault_keys_name_kind_step_and_rank() -> None:
    assert Fault(FaultKind.NAN_LOSS, 12).key == "nan_loss@12:*"
    assert Fault(FaultKind.HANG, 3, 2).key == "hang@3:2"


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
)


@given(st.lists(_items, max_size=6))
def test_parse_expands_any_well_formed_schedule(
    items: list[tuple[FaultKind, int, int | None, int | None]],
) -> None:
    text = ",".join(
        f"{kind.value}@{step}"
        + (f"x{count}" if count is not None else "")
        + (f":{rank}" if rank is not None else "")
        for kind, step, count, rank in items
    )
    expected = [
        Fault(kind, step + offset, rank)
        for kind, step, count, rank in items
        for offset in range(count if count is not None else 1)
    ]
    assert parse_faults(text) == expected


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
    assert sorted(ledger(tmp_path, 0)) == sorted(
        ["crash@500:*", "nan_loss@10:*", "nan_loss@11:*", "nan_loss@12:*"]
    )


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


def test_from_env_reads_the_schedule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULTS_ENV, "inf_grad@4:1")
    assert FaultInjector.from_env(1, tmp_path).fires(FaultKind.INF_GRAD, 4)
    assert not FaultInjector.from_env(0, tmp_path).active
    monkeypatch.delenv(FAULTS_ENV)
    assert not FaultInjector.from_env(0, tmp_path).active
    monkeypatch.setenv(FAULTS_ENV, "oops")
    with pytest.raises(FaultSpecError, match="'oops'"):
        FaultInjector.from_env(0, tmp_path)


# Each rank is a real process: all fire their faults at the same time into one ledger directory,
# then "restart" (a new process) and must fire nothing.
_RANK_PROCESS = r"""
import json
import sys
from pathlib import Path

from trainer_sidecar.faults import FaultInjector, FaultKind, parse_faults

rank, ledger_dir, steps = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
injector = FaultInjector(parse_faults(f"nan_loss@0x{steps},hang@0x{steps}:{rank}"), rank, ledger_dir)
fired = []
for step in range(steps):
    for kind in (FaultKind.NAN_LOSS, FaultKind.HANG):
        if injector.fires(kind, step):
            fired.append(f"{kind.value}@{step}")
print(json.dumps(fired))
"""


def _run_ranks(script: Path, ledger_dir: Path, ranks: int, steps: int) -> list[list[str]]:
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(ledger_dir), str(steps)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO_ROOT,
            text=True,
        )
        for rank in range(ranks)
    ]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        results.append(json.loads(out))
    return results


def test_per_rank_ledgers_do_not_clobber_each_other_across_processes(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_RANK_PROCESS)
    ledger_dir = tmp_path / "ckpt"
    ledger_dir.mkdir()
    ranks, steps = 4, 40

    first = _run_ranks(script, ledger_dir, ranks, steps)
    everything = [f"{kind}@{step}" for step in range(steps) for kind in ("nan_loss", "hang")]
    assert first == [everything] * ranks
    for rank in range(ranks):
        expected = {f"nan_loss@{step}:*" for step in range(steps)} | {
            f"hang@{step}:{rank}" for step in range(steps)
        }
        assert set(ledger(ledger_dir, rank)) == expected
    assert sorted(p.name for p in ledger_dir.iterdir()) == [
        f"faults-fired-rank{r}.json" for r in range(ranks)
    ]

    again = _run_ranks(script, ledger_dir, ranks, steps)
    assert again == [[]] * ranks
