"""A rollback takes what the loop gave ``guardian.track`` back with the weights: a per-epoch scheduler the
loop steps itself, a best score, the loop's own counters; the optimizer's learning rate and a tracked
scheduler agree after it, and the run ends with the schedule of an uninterrupted one."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainer_sidecar import Guardian, GuardianSettings
from trainer_sidecar.guardian.feed import DataFeed, rolls_back

STEPS_PER_EPOCH = 8
EPOCHS = 3


class Progress(dict[str, Any]):
    """The loop's own counters and best score, tracked."""

    def state_dict(self) -> dict[str, Any]:
        return dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.update(state)


def tiny_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def loss_of(model: torch.nn.Module, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator)
    return torch.nn.functional.mse_loss(model(x), y)


def train_epochs(snapshot_every: int, nan_from: int, bad_steps: int) -> dict[str, Any]:
    """EPOCHS epochs of STEPS_PER_EPOCH steps, a StepLR (x0.1) stepped by the loop at each epoch's end
    (the loop's data moves on over a skipped step, so its epoch ends then too) and tracked, with a best
    score and an epoch counter; ``bad_steps`` NaN losses in a row from step ``nan_from`` (three make a
    rollback). Returns the end state, and every step at which the optimizer's lr and the scheduler's
    disagreed."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    progress = Progress(epochs=0, best=math.inf)
    settings = GuardianSettings.model_validate({"checkpoint": {"snapshotEverySteps": snapshot_every}})
    guardian = Guardian(model, optimizer, settings=settings)
    guardian.track("scheduler", scheduler)
    guardian.track("progress", progress)
    disagreements: list[int] = []
    burst_start: int | None = None
    for iteration, _ in enumerate(guardian.steps(EPOCHS * STEPS_PER_EPOCH)):
        if burst_start is None and guardian.step_count == nan_from:
            burst_start = iteration
        poisoned = burst_start is not None and iteration < burst_start + bad_steps
        outcome = guardian.step(loss_of(model, iteration) * (math.nan if poisoned else 1.0))
        if not outcome.rolled_back and guardian.step_count % STEPS_PER_EPOCH == 0:  # the epoch's end
            scheduler.step()
            progress["epochs"] += 1
            if outcome.applied:
                progress["best"] = min(progress["best"], outcome.loss)
        if optimizer.param_groups[0]["lr"] != scheduler.get_last_lr()[0]:
            disagreements.append(guardian.step_count)
    return {
        "rollbacks": guardian.rollbacks,
        "last_epoch": scheduler.last_epoch,
        "last_lr": scheduler.get_last_lr(),
        "lr": optimizer.param_groups[0]["lr"],
        "epochs": progress["epochs"],
        "disagreements": disagreements,
    }


@pytest.mark.parametrize(
    ("snapshot_every", "nan_from"),
    [
        # Steps 7-9 bad: epoch 1 ends (lr 0.01) within the burst, the rollback returns to step 6.
        pytest.param(6, 6, id="burst-across-the-epoch-end"),
        # Steps 9-11 bad: the rollback returns to step 8, whose snapshot was taken before the loop's
        # scheduler.step() of that epoch's end.
        pytest.param(4, 8, id="snapshot-at-the-epoch-end"),
    ],
)
def test_a_rollback_across_an_epoch_end_keeps_the_tracked_scheduler_and_the_lr_together(
    snapshot_every: int, nan_from: int
) -> None:
    # The uninterrupted run skips the same steps but one (too few bad steps in a row for a rollback).
    uninterrupted = train_epochs(snapshot_every, nan_from, bad_steps=2)
    rolled_back = train_epochs(snapshot_every, nan_from, bad_steps=3)
    assert uninterrupted["rollbacks"] == 0
    assert rolled_back["rollbacks"] == 1
    assert rolled_back["disagreements"] == []
    assert uninterrupted["last_epoch"] == EPOCHS
    for key in ("last_epoch", "last_lr", "lr", "epochs"):
        assert rolled_back[key] == uninterrupted[key], key
    assert rolled_back["lr"] == pytest.approx(0.1 * 0.1**EPOCHS)


def test_a_data_loader_keeps_its_position_on_a_rollback() -> None:
    # A rollback skips the window that led to it rather than rewinding the data (as the guardian's own
    # loader does); everything else tracked goes back with the weights.
    loader = DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2)
    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)], lr=0.1), step_size=1)
    assert not rolls_back(loader)
    assert rolls_back(scheduler)
    assert rolls_back(Progress())
    feed = DataFeed()
    feed.track("scheduler", scheduler)
    feed.track("progress", Progress(epochs=1))
    assert set(feed.rollback_state()) == {"scheduler", "progress"}


def test_a_rolled_back_state_stays_as_saved_for_a_further_rollback() -> None:
    progress = Progress(epochs=1, seen=[1])
    feed = DataFeed()
    feed.track("progress", progress)
    saved = {"progress": {"epochs": 1, "seen": [1]}}
    feed.roll_back(saved)
    progress["seen"].append(2)
    progress["epochs"] = 5
    assert saved == {"progress": {"epochs": 1, "seen": [1]}}
    feed.roll_back(saved)
    assert progress == {"epochs": 1, "seen": [1]}
