"""``trainguard simulate``: the simulator's arithmetic by hand, its properties, and the command."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.cli import main
from trainguard.core import simulate as simulate_module
from trainguard.core import spec as spec_module
from trainguard.core.failure_models import LLAMA3, FailureModel, Shows
from trainguard.core.simulate import Costs, Scenario, simulate

DAY = 86_400.0
NONE = FailureModel("none", (), 1, DAY, "no failures")
JOB: dict[str, Any] = {
    "apiVersion": "trainguard.dev/v1alpha1",
    "kind": "GuardedTrainingJob",
    "metadata": {"name": "sim"},
    "spec": {
        "template": {"spec": {"containers": [{"name": "pytorch", "command": ["python", "t.py"]}]}},
        "checkpoint": {"claimName": "c", "everySteps": 10, "everySeconds": None},
        "recovery": {"maxRestarts": 100, "backoffSeconds": [10, 30]},
    },
}


def job_spec(**checkpoint: Any) -> spec_module.GuardedTrainingJobSpec:
    document = copy.deepcopy(JOB)
    document["spec"]["checkpoint"].update(checkpoint)
    return spec_module.parse_job(document, "job.yaml").spec


COSTS = Costs(step_seconds=10, save_stall_seconds=5, restart_seconds=300, crash_detection_seconds=10)


def test_without_failures_goodput_is_one_minus_the_save_stalls_share() -> None:
    # A checkpoint every 10 steps of 10 s stalls 5 s: 822 whole intervals of 105 s fill 86,310 s of the
    # day, the last 90 s make 9 more steps.
    outcome = simulate(Scenario(job_spec(), NONE, 8, 1, COSTS))
    assert outcome.kept_steps == 822 * 10 + 9
    assert outcome.stall_seconds == 822 * 5
    assert outcome.goodput(10) == pytest.approx(1 - 822 * 5 / DAY)
    assert outcome.ettr(10) == pytest.approx(1.0)
    assert (outcome.failures, outcome.rework_seconds) == (0, 0.0)


def test_one_crash_loses_the_steps_since_the_checkpoint_and_the_recovery() -> None:
    # The crash at 1000 s: 9 intervals (945 s, 90 steps) are checkpointed, 55 s are lost; detection 10 s,
    # the first backoff 10 s, the restart 300 s; from 1320 s, 810 intervals and 3 steps.
    outcome = simulate(Scenario(job_spec(), NONE, 8, 1, COSTS, scripted=((1000.0, Shows.CRASH),)))
    assert (outcome.failures, outcome.restarts) == (1, 1)
    assert outcome.rework_seconds == pytest.approx(55)
    assert (outcome.detection_seconds, outcome.backoff_seconds, outcome.restart_seconds) == (10, 10, 300)
    assert outcome.kept_steps == 90 + 810 * 10 + 3
    assert outcome.goodput(10) == pytest.approx((90 + 8103) * 10 / DAY)


def test_a_hang_waits_out_the_hang_timeout_and_the_probe() -> None:
    outcome = simulate(Scenario(job_spec(), NONE, 8, 1, COSTS, scripted=((1000.0, Shows.HANG),)))
    assert outcome.detection_seconds == 300 + 3 * 10  # the defaults: hangTimeoutSeconds 300, probe 10 s


def test_the_policy_gives_up_when_restarts_are_spent() -> None:
    document = job_spec().model_copy(
        update={"recovery": job_spec().recovery.model_copy(update={"max_restarts": 1})}
    )
    failures = ((1000.0, Shows.CRASH), (5000.0, Shows.CRASH))
    outcome = simulate(Scenario(document, NONE, 8, 1, COSTS, scripted=failures))
    assert outcome.gave_up_at == pytest.approx(5010)
    assert "restarts exhausted" in outcome.gave_up_reason
    assert outcome.idle_seconds == pytest.approx(DAY - 5010)


def test_auto_takes_the_young_daly_interval() -> None:
    # sqrt(2 x 5 s x 3600 s) = 189.7 s: 19 steps of 10 s, after a first checkpoint at 60 s (6 steps).
    outcome = simulate(Scenario(job_spec(everySteps="auto", assumedMtbfSeconds=3600), NONE, 8, 1, COSTS))
    assert outcome.last_interval_steps == 19
    assert outcome.checkpoints == 1 + (DAY - 65) // (19 * 10 + 5)


times = st.lists(st.floats(min_value=1.0, max_value=DAY - 1), max_size=8)
kinds = st.sampled_from(list(Shows))


@settings(max_examples=60, deadline=None)
@given(times, kinds, st.sampled_from([1, 7, 100]), st.sampled_from([10, "auto"]))
def test_a_later_failure_never_raises_goodput(
    at: list[float], kind: Shows, every: int, cadence: int | str
) -> None:
    spec = job_spec(everySteps=cadence if cadence == "auto" else every)
    scripted = tuple((t, kind) for t in at)
    before = simulate(Scenario(spec, NONE, 8, 1, COSTS, scripted=scripted))
    later = max(at, default=0.0) + 1.0
    after = simulate(Scenario(spec, NONE, 8, 1, COSTS, scripted=(*scripted, (later, kind))))
    assert after.goodput(10) <= before.goodput(10)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.floats(0.1, 20.0), st.sampled_from([3, 30, "auto"]))
def test_the_time_adds_up(seed: int, scale: float, every: int | str) -> None:
    """Every second of the window is kept steps, stalls, rework, detection, backoff, restart or idle
    (less than a step is left over at the end), and goodput <= ETTR <= 1."""
    outcome = simulate(Scenario(job_spec(everySteps=every), LLAMA3, 16_384, 3, COSTS, scale, seed))
    parts = (
        outcome.useful_seconds(10) + outcome.stall_seconds + outcome.rework_seconds
        + outcome.detection_seconds + outcome.backoff_seconds + outcome.restart_seconds + outcome.idle_seconds
    )  # fmt: skip
    assert -1e-6 <= outcome.wall_seconds - parts < 10 + 1e-6
    assert 0 <= outcome.goodput(10) <= outcome.ettr(10) <= 1


def test_more_failures_lower_goodput_on_average() -> None:
    spec = job_spec(everySteps="auto")
    mean = {
        scale: sum(
            simulate(Scenario(spec, LLAMA3, 16_384, 7, COSTS, scale, seed)).goodput(10) for seed in range(20)
        )
        for scale in (0.5, 1.0, 2.0, 4.0)
    }
    assert mean[0.5] > mean[1.0] > mean[2.0] > mean[4.0]


def test_the_same_seed_gives_the_same_outcome() -> None:
    scenario = Scenario(job_spec(everySteps="auto"), LLAMA3, 16_384, 10, COSTS, seed=7)
    assert simulate(scenario) == simulate(scenario)
    assert simulate(scenario) != simulate(Scenario(scenario.spec, LLAMA3, 16_384, 10, COSTS, seed=8))


def test_the_llama3_model_is_table_5() -> None:
    assert LLAMA3.failures == 419
    assert LLAMA3.job_rate(16_384) * 54 * DAY == pytest.approx(419)
    assert LLAMA3.job_rate(8_192, scale=2.0) == pytest.approx(LLAMA3.job_rate(16_384))
    rows = {c.name: (c.count, c.published_percent) for c in LLAMA3.causes}
    assert rows["Faulty GPU"] == (148, 30.1)
    assert rows["GPU HBM3 memory"] == (72, 17.2)
    assert rows["NCCL watchdog timeouts"] == (7, 1.7)
    assert len(rows) == 18


# ----------------------------------------------------------------------------------- the command ---
def write_job(tmp_path: Path, **checkpoint: Any) -> Path:
    document = copy.deepcopy(JOB)
    document["spec"]["checkpoint"].update(checkpoint)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_simulate_prints_the_figures_the_inputs_and_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = write_job(tmp_path, everySteps="auto")
    assert main(["simulate", str(job), "--days", "5", "--max-restarts", "10000", "--step-seconds", "2"]) == 0
    out = capsys.readouterr().out
    assert "16,384 GPUs for 5 days, failure model llama3, seed 0" in out
    assert "step time                   2 s" in out
    assert "given (--step-seconds)" in out
    assert "assumed (default; --save-stall-seconds)" in out
    assert "published: 419 in 54 d on 16,384 GPUs" in out
    assert "job: hangTimeoutSeconds + 3 x probePeriodSeconds" in out
    assert "goodput " in out
    assert "ETTR " in out
    assert "vs Llama 3" in out
    assert "vs ByteRobust" in out
    assert "ByteRobust 97%" in out  # the plot's reference line
    assert "*" in out.split("goodput by checkpoint interval")[1]
    assert main(["simulate", str(job), "--days", "5", "--max-restarts", "10000", "--step-seconds", "2"]) == 0
    assert capsys.readouterr().out == out  # deterministic


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (["--gpus", "0"], "argument --gpus: '0' must be above 0"),
        (["--gpus", "1.5"], "argument --gpus: '1.5' is not a whole number"),
        (["--days", "soon"], "argument --days: 'soon' is not a number"),
        (["--failure-model", "mine"], "argument --failure-model: invalid choice: 'mine'"),
        (["--step-seconds", "nan"], "argument --step-seconds: 'nan' must be above 0"),
        (["--save-stall-seconds", "inf"], "argument --save-stall-seconds: 'inf' must be above 0"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["simulate", str(write_job(tmp_path)), *arguments])
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_a_bad_job_file_exits_2_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(write_job(tmp_path, everySteps="often"))]) == 2
    assert "spec.checkpoint.everySteps" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_a_scenario_too_large_to_play_exits_2_saying_what_to_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A century on a million GPUs with restarts unbounded: refused, not played for hours (the bound
    # lowered so that the test plays few events before it).
    monkeypatch.setattr(simulate_module, "MAX_EVENTS", 10_000)
    arguments = ["--days", "36500", "--gpus", "1000000", "--max-restarts", "1000000000"]
    assert main(["simulate", str(write_job(tmp_path)), *arguments]) == 2
    assert "shorten --days" in capsys.readouterr().err
