"""A loop of epochs driven by ``guardian.epochs`` and ``guardian.batches`` (issue 39): its own DataLoader,
DistributedSampler and ``set_epoch``, a StepLR it steps at each epoch's end, an evaluation and a best
score. A rollback (across an epoch's end too), a resume mid-epoch or exactly at an epoch's end, and a
finished job rerun each end with the weights, lr, scheduler state and best score of an uninterrupted plain
loop that skips the same batches; a resumed epoch loads none of the batches it skips."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from trainer_sidecar import CheckpointStore, ConfigError, Guardian, GuardianSettings, Variables

SAMPLES, BATCH, EPOCHS = 32, 4, 3  # 8 batches an epoch


class Counted(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A small regression set that counts the samples loaded."""

    def __init__(self, samples: int = SAMPLES) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(samples, 4, generator=generator)
        self.y = torch.randn(samples, 1, generator=generator)
        self.loaded = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded += 1
        return self.x[index], self.y[index]


def objects(
    dataset: Counted, workers: int = 0
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, DataLoader[Any], Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=1, rank=0, shuffle=True, seed=3
    )
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers)
    return model, optimizer, scheduler, loader, sampler


def score(model: torch.nn.Module, dataset: Counted) -> float:
    model.eval()
    with torch.no_grad():
        value = -torch.nn.functional.mse_loss(model(dataset.x), dataset.y).item()
    model.train()
    return value


def end_state(model: torch.nn.Module, optimizer: Any, scheduler: Any, best: float) -> dict[str, Any]:
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "lr": optimizer.param_groups[0]["lr"],
        "scheduler": scheduler.state_dict(),
        "best": best,
    }


def plain(skips: set[tuple[int, int]], epochs: int = EPOCHS) -> dict[str, Any]:
    """The uninterrupted loop without the guardian, skipping the ``(epoch, batch)`` in ``skips``."""
    dataset = Counted()
    model, optimizer, scheduler, loader, sampler = objects(dataset)
    best = -math.inf
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for index, (x, y) in enumerate(loader):
            if (epoch, index) in skips:
                continue
            optimizer.zero_grad()
            torch.autograd.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
        best = max(best, score(model, dataset))
        scheduler.step()
    return end_state(model, optimizer, scheduler, best)


def settings(**checkpoint: int) -> GuardianSettings:
    return GuardianSettings.model_validate(
        {
            "checkpoint": {"snapshotEverySteps": 4, "everySteps": 4, **checkpoint},
            # A rollback changes nothing but the state, so that an uninterrupted loop can match it.
            "remediation": {"lrScale": 1.0, "maxGradNorm": None},
        }
    )


def guarded(
    directory: Path | None,
    poisoned: set[tuple[int, int]] = frozenset(),  # type: ignore[assignment]
    stop_after: int | None = None,
    dataset: Counted | None = None,
    config: GuardianSettings | None = None,
    workers: int = 0,
) -> dict[str, Any]:
    """The same loop adopted: ``poisoned`` batches give a NaN loss; ``stop_after`` steps end the process's
    loop early (a crash: the guardian is closed, not finished)."""
    dataset = dataset or Counted()
    model, optimizer, scheduler, loader, sampler = objects(dataset, workers)
    guardian = Guardian(model, optimizer, checkpoint_dir=directory, settings=config or settings())
    guardian.track("scheduler", scheduler)
    namespace = {"best": -math.inf}
    guardian.track("best", Variables(namespace, "best"))
    ends, trained = [], 0
    for epoch in guardian.epochs(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in guardian.batches(loader):
            current = guardian._acc.current
            assert current is not None
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            guardian.step(loss * math.nan if (current.epoch, current.index) in poisoned else loss)
            trained += 1
            if stop_after is not None and trained == stop_after:
                guardian.close()
                return {"stopped": guardian.step_count}
        namespace["best"] = max(namespace["best"], score(model, dataset))
        scheduler.step()
        ends.append(epoch)
    skips = guardian.dead_letters.skip
    return {
        **end_state(model, optimizer, scheduler, namespace["best"]),
        "skips": set(skips),
        "rollbacks": guardian.rollbacks,
        "ends": ends,
        "loaded": dataset.loaded,
    }


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for name in ("lr", "scheduler", "best"):
        assert got[name] == want[name], name
    for a, b in zip(got["weights"], want["weights"], strict=True):
        assert torch.equal(a, b)


def test_the_adopted_loop_trains_bit_for_bit_like_the_plain_one() -> None:
    got = guarded(None)
    assert got["skips"] == set()
    assert got["ends"] == [0, 1, 2]
    assert_same(got, plain(set()))


@pytest.mark.parametrize(
    "poisoned",
    [
        # Epoch 0's batches 6 and 7 and epoch 1's first: the third bad step in a row rolls back to the
        # snapshot at step 4, before epoch 0's end (its scheduler.step and best score go back too).
        pytest.param({(0, 6), (0, 7), (1, 0)}, id="across-an-epoch-end"),
        # Epoch 0's last batch and epoch 1's first two: the snapshot at step 8 is the epoch's last.
        pytest.param({(0, 7), (1, 0), (1, 1)}, id="from-the-last-batch-of-an-epoch"),
        # Epoch 1's first three: the snapshot at step 8 is epoch 0's last batch; its loop state is taken
        # when the next step begins, after epoch 0's end, which therefore does not run again.
        pytest.param({(1, 0), (1, 1), (1, 2)}, id="snapshot-at-the-last-batch-of-an-epoch"),
        # Epoch 1's last two and epoch 2's first: the same across the second epoch's end.
        pytest.param({(1, 6), (1, 7), (2, 0)}, id="across-the-second-epoch-end"),
        pytest.param({(1, 2), (1, 3), (1, 4)}, id="within-an-epoch"),
        # The rollback at an epoch's very last batch: its data ends right after, and its end runs once.
        pytest.param({(1, 5), (1, 6), (1, 7)}, id="at-the-last-batch-of-an-epoch"),
    ],
)
def test_a_rollback_ends_like_an_uninterrupted_loop_that_skips_the_same_batches(
    poisoned: set[tuple[int, int]],
) -> None:
    got = guarded(None, poisoned)
    assert got["rollbacks"] == 1
    assert poisoned <= got["skips"]
    # The data ran out at its own end: every epoch's end ran once more for an epoch rolled back into.
    assert got["ends"][-1] == EPOCHS - 1
    assert_same(got, plain(got["skips"]))


@pytest.mark.parametrize(
    "stop_after",
    [
        pytest.param(13, id="mid-epoch"),  # the checkpoint of step 12: batch 4 of epoch 1
        pytest.param(17, id="at-an-epoch-end"),  # the checkpoint of step 16: epoch 1's last batch
    ],
)
def test_a_resume_ends_like_the_uninterrupted_loop(tmp_path: Path, stop_after: int) -> None:
    assert guarded(tmp_path, stop_after=stop_after)["stopped"] == stop_after
    dataset = Counted()
    got = guarded(tmp_path, dataset=dataset)
    assert_same(got, plain(set()))
    resumed_at = stop_after - 1
    # The resumed epoch loaded only the batches it trained: none of the skipped ones.
    assert dataset.loaded == (EPOCHS * 8 - resumed_at) * BATCH
    # At an epoch's end the resumed run ran that end (the checkpoint was taken before it), once.
    assert got["ends"][0] == resumed_at // 8 - (resumed_at % 8 == 0)


def test_a_finished_job_rerun_trains_nothing_and_keeps_its_numbers(tmp_path: Path) -> None:
    first = guarded(tmp_path)
    dataset = Counted()
    again = guarded(tmp_path, dataset=dataset)
    assert dataset.loaded == 0
    assert again["ends"] in ([], [EPOCHS - 1])  # at most the last end, from the state before it
    assert_same(again, first)


def test_a_rollback_then_a_resume_skip_the_same_batches(tmp_path: Path) -> None:
    poisoned = {(0, 6), (0, 7), (1, 0)}
    assert guarded(tmp_path, poisoned, stop_after=20)["stopped"] < 24
    got = guarded(tmp_path, poisoned)
    assert_same(got, plain(got["skips"]))


def test_a_shorter_loader_on_resume_ends_its_epoch_at_its_new_end(tmp_path: Path) -> None:
    guarded(tmp_path, stop_after=7)  # checkpoint at step 4: batch 4 of epoch 0 next
    smaller = Counted(samples=12)  # 3 batches an epoch now: epoch 0 is over
    got = guarded(tmp_path, dataset=smaller)
    assert got["ends"] == [0, 1, 2]
    assert smaller.loaded == 2 * 12


def test_batches_outside_epochs_or_twice_in_an_epoch_is_refused() -> None:
    dataset = Counted()
    model, optimizer, _, loader, _ = objects(dataset)
    guardian = Guardian(model, optimizer, settings=settings())
    with pytest.raises(ConfigError, match="runs inside `for epoch in"):
        next(iter(guardian.batches(loader)))
    for _ in guardian.epochs(1):
        for x, y in guardian.batches(loader):
            guardian.step(torch.nn.functional.mse_loss(model(x), y))
        with pytest.raises(ConfigError, match="twice in epoch 0"):
            next(iter(guardian.batches(loader)))
    with pytest.raises(ConfigError, match="epochs"):
        next(iter(guardian.epochs(-1)))
    stream = DataLoader(Stream(), batch_size=2)
    with pytest.raises(ConfigError, match="IterableDataset"):
        next(iter(guardian.batches(stream)))


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from torch.zeros(4, 1)


def test_variables_track_a_module_global() -> None:
    namespace: dict[str, Any] = {"best_acc1": 0.25}
    tracked = Variables(namespace, "best_acc1")
    saved = tracked.state_dict()
    namespace["best_acc1"] = 0.5
    tracked.load_state_dict(saved)
    assert namespace["best_acc1"] == 0.25
    with pytest.raises(ConfigError, match="missing"):
        Variables({}, "missing").state_dict()


def test_an_epochs_data_ends_with_its_last_checkpoint_durable(tmp_path: Path) -> None:
    # The checkpoint of an epoch's last step is written in the background; a crash in the evaluation
    # that follows would lose it, so the end of the epoch's data waits for it.
    dataset = Counted()
    model, optimizer, scheduler, loader, sampler = objects(dataset)
    guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=settings(everySteps=8))
    guardian.track(scheduler=scheduler)
    durable = []
    for epoch in guardian.epochs(2):
        sampler.set_epoch(epoch)
        for x, y in guardian.batches(loader):
            guardian.step(torch.nn.functional.mse_loss(model(x), y))
        durable.append(CheckpointStore(tmp_path, world_size=1).newest_valid())
        scheduler.step()
    assert durable == [8, 16]


def test_track_takes_several_objects_by_name_or_refuses_a_half_call() -> None:
    dataset = Counted()
    model, optimizer, scheduler, _, _ = objects(dataset)
    guardian = Guardian(model, optimizer, settings=settings())
    namespace = {"best": 1.0}
    guardian.track(scheduler=scheduler, best=Variables(namespace, "best"))
    assert set(guardian.feed.rollback_state()) == {"scheduler", "best"}
    with pytest.raises(ConfigError, match="track"):
        guardian.track("alone")
    guardian.close()


def test_a_resume_mid_epoch_with_loader_workers_ends_like_the_uninterrupted_loop(tmp_path: Path) -> None:
    assert guarded(tmp_path, stop_after=13, workers=2)["stopped"] == 13
    assert_same(guarded(tmp_path, workers=2), plain(set()))


def test_a_start_epoch_of_the_loops_own_gives_way_to_the_guardians_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    guarded(tmp_path, stop_after=13)  # the checkpoint of step 12: epoch 1
    dataset = Counted()
    model, optimizer, *_ = objects(dataset)
    guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=settings())
    with caplog.at_level("WARNING"):
        epochs = iter(guardian.epochs(EPOCHS, start=2))
        assert next(epochs) == 1
    assert "start=2) is not used" in caplog.text
    guardian.close()
