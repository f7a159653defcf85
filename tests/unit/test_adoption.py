"""Adoption without traps (issue 21), in one process: the step number a loop trains is the guardian's,
a run continues a checkpoint of the loop's own, the declared end is kept, and the exit plan."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from trainer_sidecar.contract.settings import GuardianSettings
from trainer_sidecar.contract.status import Phase
from trainer_sidecar.guardian.config import ConfigError
from trainer_sidecar.guardian.ending import ExitPlan, exit_plan
from trainer_sidecar.guardian.guardian import Guardian

SETTINGS = GuardianSettings.model_validate(
    {"checkpoint": {"everySteps": 4, "snapshotEverySteps": 2}, "guard": {"maxConsecutiveBadSteps": 2}}
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "TRAINGUARD_CHECKPOINT_DIR",
        "TRAINGUARD_SETTINGS",
        "TRAINGUARD_FAULTS",
        "RANK",
        "WORLD_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)


def model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def loss_of(model: torch.nn.Linear) -> torch.Tensor:
    loss: torch.Tensor = model(torch.ones(2, 4)).pow(2).mean()
    return loss


def steps_on_disk(directory: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in directory.glob("step-*"))


def test_steps_yields_the_guardian_step_which_goes_back_with_a_rollback(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=SETTINGS)
    trained: list[int] = []
    for iter_num in guardian.steps(8):
        trained.append(iter_num)
        poisoned = len(trained) in (4, 5)  # the loop's 4th and 5th iterations: steps 3 and 4
        guardian.step(loss_of(model) * (math.nan if poisoned else 1.0))
    # Two bad steps in a row roll back to the snapshot of step 2: the number goes back with the model.
    assert trained == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7]
    assert guardian.rollbacks == 1
    assert guardian.step_count == 8
    assert guardian.phase is Phase.FINISHED  # the end of the iterator is the end of training
    assert steps_on_disk(tmp_path)[-1] == 8


def test_an_iteration_of_steps_without_a_step_boundary_raises() -> None:
    model, optimizer = model_and_optimizer()
    guardian = Guardian(model, optimizer)
    iterations = guardian.steps(3)
    assert next(iterations) == 0
    guardian.backward(loss_of(model))  # and no guardian.step()
    with pytest.raises(RuntimeError, match="reached no step boundary"):
        next(iterations)
    guardian.close()


def test_a_run_has_one_end() -> None:
    model, optimizer = model_and_optimizer()
    guardian = Guardian(model, optimizer, max_steps=5)
    with pytest.raises(ConfigError, match="a run has one end"):
        next(guardian.steps(7))
    guardian.close()


def test_the_declared_end_is_published_for_the_eta() -> None:
    model, optimizer = model_and_optimizer()
    undeclared = Guardian(model, optimizer)
    assert undeclared.status().max_steps is None
    next(undeclared.steps(9))  # declared by the loop
    assert undeclared.status().max_steps == 9
    undeclared.close()
    declared = Guardian(*model_and_optimizer(), max_steps=5)
    assert declared.status().max_steps == 5
    declared.close()


def test_steps_without_any_declared_end_is_refused() -> None:
    model, optimizer = model_and_optimizer()
    guardian = Guardian(model, optimizer)
    with pytest.raises(TypeError, match="needs max_steps"):
        next(guardian.steps())
    guardian.close()


def test_a_step_past_the_declared_end_changes_nothing(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=SETTINGS, max_steps=3)
    iter_num = 0
    while True:  # nanoGPT's loop: the end is tested after the step
        guardian.step(loss_of(model))
        iter_num += 1
        if iter_num > 3:
            break
    assert guardian.step_count == 3
    assert guardian.checkpoints.saved(3)  # the declared end is checkpointed at its step; cadence: none
    guardian.finish()
    assert steps_on_disk(tmp_path) == [3]
    weights = model.weight.detach().clone()

    model, optimizer = model_and_optimizer(seed=1)
    rerun = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=SETTINGS, max_steps=3)
    outcome = rerun.step(loss_of(model))  # a do-while loop trains once on every start
    assert not outcome.applied
    assert rerun.step_count == 3
    assert torch.equal(model.weight, weights)
    rerun.finish()
    assert steps_on_disk(tmp_path) == [3]


def test_start_step_continues_a_run_of_the_loop_own_until_the_guardian_has_a_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = model_and_optimizer()
    guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=SETTINGS, start_step=6)
    assert guardian.step_count == 6
    assert guardian.resumed_step == 6
    assert [n for n in guardian.steps(9) if guardian.step(loss_of(model)).boundary] == [6, 7, 8]
    assert steps_on_disk(tmp_path)[-1] == 9

    model, optimizer = model_and_optimizer()
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        again = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=SETTINGS, start_step=6)
    assert again.step_count == 9  # the guardian's own checkpoint takes over
    assert "start_step=6 is not used: the guardian's own checkpoint at step 9 takes over" in caplog.text
    assert list(again.steps(9)) == []
    assert again.phase is Phase.FINISHED


def test_start_step_warns_about_a_scheduler_that_restarts(caplog: pytest.LogCaptureFixture) -> None:
    model, optimizer = model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        guardian = Guardian(model, optimizer, scheduler=scheduler, start_step=40)
    assert "has stepped 0 times" in caplog.text
    guardian.close()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_step_numbers_must_be_non_negative_integers(bad: object) -> None:
    model, optimizer = model_and_optimizer()
    with pytest.raises(ConfigError, match="start_step must be a step number"):
        Guardian(model, optimizer, start_step=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("crashed", "distributed", "step", "max_steps", "plan"),
    [
        (True, False, 10, 10, ExitPlan.CRASHED),  # an exception is never finished, even at the end
        (True, True, 10, None, ExitPlan.CRASHED),
        (False, False, 7, None, ExitPlan.FINISH),  # one process may save at exit
        (False, True, 7, None, ExitPlan.UNDECLARED),  # a gang may not: no collective at exit
        (False, True, 10, 10, ExitPlan.FINISH),  # its final checkpoint was started at the step
        (False, True, 8, 10, ExitPlan.SHORT),
        (False, False, 8, 10, ExitPlan.SHORT),
    ],
)
def test_the_exit_plan(
    crashed: bool, distributed: bool, step: int, max_steps: int | None, plan: ExitPlan
) -> None:
    assert exit_plan(crashed=crashed, distributed=distributed, step=step, max_steps=max_steps) is plan
