"""In-memory snapshots: capture, let training move on, restore in place, bit for bit."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.checkpoints import assert_same_state, clone_state, make_training, train
from tests.support.copies import copies_held
from trainer_sidecar.guardian.snapshot import Snapshot
from trainer_sidecar.tensors.tensorstate import HostBuffers


def live_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    cloned: dict[str, Any] = clone_state({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    return cloned


def storage_pointers(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """data_ptr of every parameter, buffer and optimizer state tensor, by a stable name."""
    pointers = {f"model.{name}": t.data_ptr() for name, t in model.state_dict(keep_vars=True).items()}
    for index, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                pointers[f"optimizer.{index}.{key}"] = value.data_ptr()
    return pointers


def lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(group["lr"]) for group in optimizer.param_groups]


@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
def test_restore_after_more_adamw_steps_is_bit_exact_and_in_place(lr_kind: str) -> None:
    lr: float | torch.Tensor = 1e-2 if lr_kind == "float" else torch.tensor(1e-2)
    model, optimizer = make_training(lr=lr)
    train(model, optimizer, 3, seed=1)
    small = {"scheduler": {"last_epoch": 3, "values": [1, 2]}, "scaler": None}
    extra = {"losses": [1.0, 0.9], "optimizer_steps": 3}

    snapshot = Snapshot()
    assert not snapshot.taken
    snapshot.capture(3, model, optimizer, small, extra)
    assert snapshot.taken
    assert snapshot.step == 3
    assert snapshot.nbytes > 0
    expected = live_state(model, optimizer)
    expected_lrs = lrs(optimizer)
    pointers = storage_pointers(model, optimizer)

    # Training moves on: weights, buffers, moments, step counters and the learning rate all change.
    small["scheduler"]["values"].append(3)
    extra["losses"].append(123.0)
    train(model, optimizer, 4, seed=2)
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(0.5)
        else:
            group["lr"] = 0.5
    moved = live_state(model, optimizer)
    assert not torch.equal(moved["model"]["0.weight"], expected["model"]["0.weight"])
    assert not torch.equal(moved["model"]["1.running_mean"], expected["model"]["1.running_mean"])
    assert not torch.equal(
        moved["optimizer"]["state"][0]["exp_avg"], expected["optimizer"]["state"][0]["exp_avg"]
    )

    returned = snapshot.restore(model, optimizer)

    assert_same_state(live_state(model, optimizer), expected)
    assert lrs(optimizer) == expected_lrs
    assert storage_pointers(model, optimizer) == pointers  # nothing reallocated
    assert returned == {"scheduler": {"last_epoch": 3, "values": [1, 2]}, "scaler": None}
    assert snapshot.extra == {"losses": [1.0, 0.9], "optimizer_steps": 3}

    # The restored state trains exactly like the original did from the same point.
    reference_model, reference_optimizer = make_training(lr=lr)
    train(reference_model, reference_optimizer, 3, seed=1)
    assert train(model, optimizer, 3, seed=5) == train(reference_model, reference_optimizer, 3, seed=5)
    assert_same_state(live_state(model, optimizer), live_state(reference_model, reference_optimizer))


@pytest.mark.parametrize("path", ["in place", "first optimizer step after the capture"])
def test_the_loop_state_is_completed_once_when_the_next_step_begins(path: str) -> None:
    # What the loop does after the captured step (a per-epoch scheduler.step(), a best score) belongs
    # with that step's weights: the learning rates and tracked state are taken again, once.
    model, optimizer = make_training(lr=0.1)
    if path == "in place":
        train(model, optimizer, 1, seed=1)  # the optimizer has its state: restored in place
    snapshot = Snapshot()
    snapshot.capture(1, model, optimizer, {}, {"tracked": {"best": 1.0}})
    expected = live_state(model, optimizer)
    for group in optimizer.param_groups:
        group["lr"] = 0.01  # the loop's epoch end
    seen = [1]
    snapshot.complete_loop_state(lambda: {"best": 0.5, "seen": seen}, optimizer)
    seen.append(2)  # the snapshot holds a copy
    for group in optimizer.param_groups:
        group["lr"] = 0.001
    snapshot.complete_loop_state(lambda: {"best": 0.25}, optimizer)  # the next step: nothing taken again
    assert snapshot.extra["tracked"] == {"best": 0.5, "seen": [1]}
    train(model, optimizer, 2, seed=2)

    snapshot.restore(model, optimizer)

    assert lrs(optimizer) == [0.01]
    restored = live_state(model, optimizer)
    assert_same_state(restored["model"], expected["model"])


def test_the_snapshot_is_not_aliased_to_live_tensors_and_restores_repeatedly() -> None:
    model, optimizer = make_training()
    train(model, optimizer, 2, seed=1)
    snapshot = Snapshot()
    snapshot.capture(2, model, optimizer, {}, {})
    expected = live_state(model, optimizer)

    returned = snapshot.restore(model, optimizer)
    returned["mutated"] = True  # the caller's copy, not the snapshot's
    for seed in (3, 4):
        train(model, optimizer, 2, seed=seed)
        assert snapshot.restore(model, optimizer) == {}
        assert_same_state(live_state(model, optimizer), expected)


def test_restore_of_a_snapshot_taken_before_the_optimizer_had_state() -> None:
    model, optimizer = make_training()
    snapshot = Snapshot()
    snapshot.capture(0, model, optimizer, {"scheduler": None}, {"optimizer_steps": 0})
    assert len(optimizer.state) == 0
    expected_model = clone_state(model.state_dict())
    param_pointers = {name: p.data_ptr() for name, p in model.named_parameters()}

    train(model, optimizer, 3, seed=1)
    optimizer.param_groups[0]["lr"] = 0.25
    assert len(optimizer.state) > 0

    assert snapshot.restore(model, optimizer) == {"scheduler": None}

    assert_same_state(clone_state(model.state_dict()), expected_model)
    assert len(optimizer.state) == 0  # the moments are gone, as at step 0
    assert lrs(optimizer) == [3e-3]  # the learning rate it was made with
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == param_pointers
    # From here training is that of a fresh model and optimizer.
    fresh_model, fresh_optimizer = make_training()
    assert train(model, optimizer, 3, seed=7) == train(fresh_model, fresh_optimizer, 3, seed=7)
    assert_same_state(live_state(model, optimizer), live_state(fresh_model, fresh_optimizer))


def test_small_state_is_copied_at_capture_time() -> None:
    model, optimizer = make_training()
    small: dict[str, Any] = {"scheduler": {"milestones": [10, 20]}}
    snapshot = Snapshot()
    snapshot.capture(1, model, optimizer, small, {"k": [1]})
    original = copy.deepcopy(small)
    small["scheduler"]["milestones"].append(30)
    assert snapshot.restore(model, optimizer) == original


def test_restore_without_a_snapshot_raises() -> None:
    model, optimizer = make_training()
    with pytest.raises(RuntimeError, match="no snapshot"):
        Snapshot().restore(model, optimizer)


def test_a_change_in_place_before_settle_is_found_and_the_snapshot_copies_the_state_again() -> None:
    model, optimizer = make_training()
    train(model, optimizer, 2, seed=1)
    first = next(model.parameters())
    snapshot = Snapshot()
    with copies_held() as release:
        snapshot.capture(2, model, optimizer, {}, {}, background=True)
        with torch.no_grad():
            first.mul_(0.5)  # the loop's change, before the copy has run
        release.set()
        snapshot._buffers.wait()
    with torch.no_grad():
        first.add_(1.0)  # and another after it: the buffers hold neither whole state
    now = live_state(model, optimizer)
    assert snapshot.settle() is True
    assert snapshot.settle() is False  # found once
    train(model, optimizer, 2, seed=2)
    snapshot.restore(model, optimizer)
    assert_same_state(live_state(model, optimizer), now)


def test_a_copy_settled_before_the_state_changes_is_whole() -> None:
    model, optimizer = make_training()
    train(model, optimizer, 2, seed=1)
    before = live_state(model, optimizer)
    snapshot = Snapshot()
    with copies_held() as release:
        snapshot.capture(2, model, optimizer, {}, {}, background=True)
        pending = snapshot._buffers.pending
        release.set()
        assert snapshot.settle() is False
    train(model, optimizer, 1, seed=2)  # the optimizer step, after the settle
    assert pending.landed_whole()
    snapshot.restore(model, optimizer)
    assert_same_state(live_state(model, optimizer), before)


def test_a_copy_is_whole_only_if_nothing_changed_before_it_landed_or_was_settled() -> None:
    source = torch.arange(8.0)
    buffers = HostBuffers()
    with copies_held() as release:
        pending = buffers.capture([source], stable={source.data_ptr()})
        source.mul_(2)
        release.set()
        assert not pending.landed_whole()
    assert pending.settle() is True
    assert not pending.landed_whole()  # the verdict stands once taken

    pending = buffers.capture([source], stable={source.data_ptr()})
    pending.wait()
    assert pending.landed_whole()  # landed, and nothing moved before
    assert torch.equal(buffers.tensors[0], source)
