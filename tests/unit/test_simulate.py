"""``trainguard simulate``: the simulator's arithmetic by hand, its properties, and the command."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import event, given, settings
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


def exit_code(argv: list[str]) -> int:
    """``main``'s exit code, whether it returns it or argparse exits."""
    try:
        return main(argv)
    except SystemExit as exited:
        return int(str(exited.code))


MAX_RESTARTS = spec_module.RecoverySpec.model_json_schema()["properties"]["maxRestarts"]["maximum"]
SPEC_PROPERTIES = spec_module.GuardedTrainingJobSpec.model_json_schema()["properties"]
MAX_GPUS = SPEC_PROPERTIES["replicas"]["maximum"] * SPEC_PROPERTIES["nprocPerNode"]["maximum"]


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (["--gpus", "0"], "argument --gpus: '0' must be at least 1 and at most 1,048,576"),
        (["--gpus", str(MAX_GPUS + 1)], f"argument --gpus: '{MAX_GPUS + 1}' must be at least 1"),
        (["--gpus", "1.5"], "argument --gpus: '1.5' is not a whole number"),
        (["--days", "soon"], "argument --days: 'soon' is not a number"),
        (["--days", "3651"], "argument --days: '3651' must be above 0 and at most 3,650 (ten years)"),
        (["--failure-model", "mine"], "argument --failure-model: invalid choice: 'mine'"),
        (["--step-seconds", "nan"], "argument --step-seconds: 'nan' must be a finite number"),
        (["--step-seconds", "1e-9"], "argument --step-seconds: '1e-9' must be at least 0.001 and at most"),
        (["--save-stall-seconds", "inf"], "argument --save-stall-seconds: 'inf' must be a finite number"),
        (["--restart-seconds", "1e308"], "'1e308' must be at least 0.001 and at most 86,400"),
        (["--crash-detection-seconds", "-1"], "argument --crash-detection-seconds: '-1' must be at least"),
        (["--lost-detection-seconds", "1e999"], "--lost-detection-seconds: '1e999' must be a finite"),
        (["--failure-scale", "0"], "argument --failure-scale: '0' must be above 0"),
        (["--failure-scale", "1e308"], "1e+308 with --gpus 16,384 and --days 54: countless failures"),
        (["--failure-scale", "1e4"], "4.19e+06 failures expected, more than the 2,000,000 events"),
        (["--seed", "-1"], "argument --seed: '-1' must be at least 0"),
        (["--seed", str(2**64)], f"argument --seed: '{2**64}' must be at least 0 and at most {2**64 - 1:,}"),
        (["--max-restarts", "many"], "argument --max-restarts: 'many' is not a whole number"),
        (["--max-restarts", "-1"], "--max-restarts -1: spec.recovery.maxRestarts: Input should be"),
        (["--max-restarts", str(MAX_RESTARTS + 1)], "spec.recovery.maxRestarts: Input should be less"),
        (["--max-restarts", str(10**20)], f"--max-restarts {10**20}: spec.recovery.maxRestarts: Input"),
    ],
)  # fmt: skip
def test_bad_flags_exit_2_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], says: str
) -> None:
    # --failure-scale 1e308 used to print "failures per day inf", --restart-seconds 1e308 a 300-digit
    # time, and --max-restarts 20000 or 10^20 (above the spec's bound) were simulated: all exit 0.
    assert exit_code(["simulate", str(write_job(tmp_path)), *arguments]) == 2
    err = capsys.readouterr().err
    assert says in err
    assert arguments[0] in err


def test_the_bounds_of_a_field_the_flags_override_are_the_specs(tmp_path: Path) -> None:
    # maxRestarts: 0 is a valid job (no restart): --max-restarts 0 used to be refused ("must be above 0").
    job = str(write_job(tmp_path))
    for restarts in (0, MAX_RESTARTS):
        assert exit_code(["simulate", job, "--days", "0.5", "--max-restarts", str(restarts)]) == 0
    assert exit_code(["simulate", job, "--days", "0.01", "--gpus", str(MAX_GPUS)]) == 0


def test_no_restart_allowed_gives_up_at_the_first_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", str(write_job(tmp_path)), "--days", "5", "--max-restarts", "0"]) == 0
    out = capsys.readouterr().out
    assert "restarts allowed, backoff   0, [10, 30] s" in out
    assert "failures      1 (" in out
    assert "restarts 0" in out
    assert "gave up       after" in out


NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
WIDE = st.floats(allow_nan=True, allow_infinity=True)
DURATION = st.floats(0.001, DAY)
#: Each flag's values: extreme but accepted ones, and any at all.
FLAG_VALUES = {
    "--gpus": (st.integers(1, MAX_GPUS), st.integers(-(10**30), 10**30)),
    "--days": (st.floats(1e-9, 3650), WIDE),
    "--failure-scale": (st.floats(1e-300, 1e4), WIDE),
    "--step-seconds": (DURATION, WIDE),
    "--save-stall-seconds": (DURATION, WIDE),
    "--restart-seconds": (DURATION, WIDE),
    "--crash-detection-seconds": (DURATION, WIDE),
    "--lost-detection-seconds": (DURATION, WIDE),
    "--max-restarts": (st.integers(0, MAX_RESTARTS), st.integers(-(10**20), 10**20)),
    "--seed": (st.integers(0, 2**64 - 1), st.integers(-(2**70), 2**70)),
}
#: Values near the edges of the ranges.
EDGES = st.sampled_from(["0", "1e-3", "0.001", "1", "86400", "86401", "3650", "1e308", "5e-324", "-0", "1e4"])


def flag_value(flag: str) -> st.SearchStrategy[str]:
    accepted, wide = FLAG_VALUES[flag]
    return st.one_of(accepted.map(str), accepted.map(str), accepted.map(str), wide.map(str), EDGES)


@settings(max_examples=80, deadline=None)
@given(
    flags=st.sets(st.sampled_from(sorted(FLAG_VALUES)), max_size=6).flatmap(
        lambda chosen: st.fixed_dictionaries({flag: flag_value(flag) for flag in sorted(chosen)})
    )
)
def test_any_flags_exit_2_naming_a_flag_or_0_with_finite_numbers_only(
    flags: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    argv = [item for flag, value in flags.items() for item in (flag, value)]
    job = tmp_path_factory.getbasetemp() / "any-flags-job.yaml"
    job.write_text(yaml.safe_dump(JOB))
    out, err = io.StringIO(), io.StringIO()
    with (
        pytest.MonkeyPatch.context() as patch,
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        # The bound on events lowered, so that an example plays few (the bound itself is tested below).
        patch.setattr(simulate_module, "MAX_EVENTS", 20_000)
        code = exit_code(["simulate", str(job), "--days", "2", *argv])
    event(f"exit {code}")
    if code == 2:
        assert any(flag in err.getvalue() for flag in ("--days", *flags)), err.getvalue()
        return
    assert code == 0, err.getvalue()
    text = out.getvalue()
    assert not re.search(r"\b(inf|nan)\b", text, re.IGNORECASE), text
    for number in NUMBER.findall(text):
        assert len(number) <= 30, number  # no 300-digit time
        assert math.isfinite(float(number.replace(",", "")))


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
    arguments = ["--days", "3650", "--gpus", "1000000", "--max-restarts", "10000"]
    assert main(["simulate", str(write_job(tmp_path)), *arguments]) == 2
    assert "more than 10,000 checkpoints and failures to play: shorten --days" in capsys.readouterr().err


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3000), st.floats(0.01, 3.0), st.sampled_from([1, 10, "auto"]), st.integers(0, 2**32))
def test_a_simulation_plays_at_most_its_events(limit: int, days: float, every: int | str, seed: int) -> None:
    """The work of one simulation is bounded: it plays at most ``max_events`` checkpoints and failures
    (each counted), or it is refused."""
    scenario = Scenario(job_spec(everySteps=every), LLAMA3, 16_384, days, COSTS, 20.0, seed)
    full = simulate(scenario)
    # Each event is a checkpoint or a failure, and one more for the window's end mid-interval.
    assert full.checkpoints + full.failures <= full.events <= full.checkpoints + full.failures + 1
    if full.events > limit:
        with pytest.raises(simulate_module.ScenarioTooLarge, match=f"more than {limit:,} checkpoints and"):
            simulate(scenario, max_events=limit)
        return
    assert simulate(scenario, max_events=limit) == full  # the bound changes nothing that fits in it


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 200_000), st.floats(0.5, 4.0), st.integers(0, 2**32))
def test_the_sweep_plays_at_most_its_budget_in_all(budget: int, days: float, seed: int) -> None:
    """The sweep's points share one budget of events: a point that does not fit what is left is left
    off the plot, and the points kept are those a full simulation gives."""
    scenario = Scenario(job_spec(), LLAMA3, 16_384, days, COSTS, 1.0, seed)
    alone = {s.spec.checkpoint.every_steps: simulate(s) for s in _sweep_scenarios(scenario)}
    points = simulate_module.sweep(scenario, simulate_module.SWEEP_STEPS, budget=budget)
    for every, goodput in points:
        assert alone[every].goodput(10) == goodput
    assert sum(alone[every].events for every, _ in points) <= budget
    if budget >= sum(outcome.events for outcome in alone.values()):
        assert [every for every, _ in points] == simulate_module.SWEEP_STEPS


def _sweep_scenarios(scenario: Scenario) -> list[Scenario]:
    """The sweep's points as scenarios of their own: a fixed everySteps, no time cadence."""
    out = []
    for every in simulate_module.SWEEP_STEPS:
        update = {"every_steps": every, "every_seconds": None}
        spec = scenario.spec.model_copy(
            update={"checkpoint": scenario.spec.checkpoint.model_copy(update=update)}
        )
        out.append(dataclasses.replace(scenario, spec=spec))
    return out
