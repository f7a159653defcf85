"""The step guard, rollback, remediation, resume and data guard of the in-process Guardian."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.copies import copies_held
from trainer_sidecar import ConfigError, Diverged, ExitCode, Guardian, GuardianSettings, Phase
from trainer_sidecar.checkpoint import CheckpointStore
from trainer_sidecar.contract.hang import RESUMED_WARMUP_GAPS, WARMUP_GAPS, ProgressGaps
from trainer_sidecar.contract.status import (
    Activity,
    StatusPublisher,
    WorkerStatus,
    read_status,
    write_termination_message,
)
from trainer_sidecar.guardian import reporting
from trainer_sidecar.guardian.config import GuardianConfig
from trainer_sidecar.guardian.counters import CountersError, GuardCounters
from trainer_sidecar.guardian.data import GuardedLoader, sample_is_bad
from trainer_sidecar.guardian.gang import Gang
from trainer_sidecar.guardian.guardian import Fenced, UncleanState
from trainer_sidecar.guardian.reporting import StatusReporter
from trainer_sidecar.guardian.stopping import STOP, StopRequest
from trainer_sidecar.guardian.training import fit_keys


def settings(**sections: Any) -> GuardianSettings:
    """Settings from camelCase sections, e.g. settings(guard={"maxRollbacks": 1})."""
    return GuardianSettings.model_validate(sections)


def tiny_model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def linear(model: torch.nn.Sequential, index: int) -> torch.nn.Linear:
    layer = model[index]
    assert isinstance(layer, torch.nn.Linear)
    return layer


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator)


def loss_of(model: torch.nn.Module, seed: int = 1, scale: float = 1.0) -> torch.Tensor:
    x, y = batch(seed)
    return torch.nn.functional.mse_loss(model(x), y) * scale


def clone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def stepping_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    """The learning rate of the first param group each time the optimizer steps (what the update used)."""
    seen: list[float] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(float(opt.param_groups[0]["lr"])))
    return seen


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "TRAINGUARD_SETTINGS",
        "TRAINGUARD_FAULTS",
        "TRAINGUARD_CHECKPOINT_DIR",
        "TRAINGUARD_STATUS_FILE",
        "TRAINGUARD_TERMINATION_MESSAGE_PATH",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TRAINGUARD_REMEDIATION", raising=False)
    # A stop signal concerns the process: one a test sent must not stop the next test's guardian.
    monkeypatch.setattr(STOP, "signal", None)


def test_finite_step_clips_to_max_grad_norm_and_steps_scheduler() -> None:
    model = tiny_model()
    seen_norms: list[float] = []

    class RecordingSGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            seen_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
            return super().step(closure)

    optimizer = RecordingSGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    guardian = Guardian(model, optimizer, scheduler=scheduler, settings=settings(guard={"maxGradNorm": 0.01}))
    outcome = guardian.step(loss_of(model, scale=100.0))
    assert outcome.applied
    assert outcome.grad_norm > 0.01  # the reported norm is the one before clipping
    assert seen_norms[0] == pytest.approx(0.01, rel=1e-4)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert all(p.grad is None for p in model.parameters())


def test_gradients_within_the_norm_reach_the_optimizer_unchanged() -> None:
    model = tiny_model()
    reference = tiny_model()
    guardian = Guardian(
        model, torch.optim.SGD(model.parameters(), lr=0.1), settings=settings(guard={"maxGradNorm": 1e6})
    )
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    assert guardian.step(loss_of(model)).applied
    torch.autograd.backward(loss_of(reference))
    plain.step()
    assert_same(clone_state(reference), clone_state(model))


def test_a_healthy_loop_under_the_defaults_trains_bit_for_bit_like_the_plain_loop() -> None:
    # No clip unless asked: gradients far above any usual clipping norm reach the optimizer unchanged,
    # step after step, with the learning-rate schedule and momentum of the plain loop.
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)

    reference, plain, plain_scheduler = build()
    guarded, optimizer, scheduler = build()
    guardian = Guardian(guarded, optimizer, scheduler=scheduler)
    assert guardian.max_grad_norm is None
    for seed in range(10):
        torch.autograd.backward(loss_of(reference, seed=seed, scale=100.0))
        plain.step()
        plain.zero_grad()
        plain_scheduler.step()
        outcome = guardian.step(loss_of(guarded, seed=seed, scale=100.0))
        assert outcome.applied
        assert outcome.grad_norm > 10.0  # a default clip of 1 (as before) would have changed the update
    assert_same(clone_state(reference), clone_state(guarded))


def test_a_remediation_clips_a_loop_that_was_not_clipped_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert guardian.max_grad_norm is None
    for _ in range(3):
        guardian.step(loss_of(model) * math.nan)
    assert guardian.rollbacks == 1
    assert guardian.max_grad_norm == pytest.approx(0.5)  # the remediation's maxGradNorm
    assert "max grad norm 0.5" in caplog.text
    assert guardian.status().max_grad_norm == pytest.approx(0.5)


def test_non_finite_loss_skips_the_update_and_the_scheduler(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    status_file = tmp_path / "status.json"
    guardian = Guardian(model, optimizer, scheduler=scheduler, status_file=status_file)
    before = clone_state(model)
    outcome = guardian.step(loss_of(model) * math.nan)
    assert not outcome.applied
    assert outcome.reason == "non-finite loss"
    assert_same(before, clone_state(model))
    assert all(p.grad is None for p in model.parameters())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    assert guardian.skipped_steps == 1
    status, _ = read_status(status_file)
    assert status is not None
    assert status.skipped_steps == 1
    assert status.consecutive_bad_steps == 1


def test_inf_gradient_with_finite_loss_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_FAULTS", "inf_grad@0")
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = clone_state(model)
    outcome = guardian.step(loss_of(model))
    assert math.isfinite(outcome.loss)
    assert outcome.reason == "non-finite gradients"
    assert_same(before, clone_state(model))
    assert guardian.step(loss_of(model)).applied


def test_grad_scaler_backs_off_on_a_non_finite_step() -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guardian = Guardian(model, optimizer, scaler=scaler)
    assert guardian.step(loss_of(model)).applied
    scale = scaler.get_scale()
    before = clone_state(model)
    assert not guardian.step(loss_of(model) * math.inf).applied
    assert scaler.get_scale() < scale
    assert_same(before, clone_state(model))


def test_loss_spike_is_detected_after_the_minimum_history() -> None:
    model = tiny_model()
    guard = {"spikeMinHistory": 5, "lossSpikeWindow": 10, "maxConsecutiveBadSteps": 10}
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=1e-4), settings=settings(guard=guard))
    for _ in range(4):
        assert guardian.step(loss_of(model)).applied
    assert guardian.step(loss_of(model, scale=10.0)).applied  # too little history to call it a spike
    for _ in range(5):
        assert guardian.step(loss_of(model)).applied
    outcome = guardian.step(loss_of(model, scale=10.0))  # now > 2x the window's mean of 1.9x
    assert outcome.reason == "loss spike"
    assert guardian.spikes == 1
    assert guardian.step(loss_of(model, scale=1.5)).applied  # below twice the mean


def test_grad_norm_spike_is_detected() -> None:
    model = tiny_model()
    guard = {"spikeMinHistory": 3, "lossSpikeFactor": 1000.0, "maxConsecutiveBadSteps": 10}
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=1e-4), settings=settings(guard=guard))
    for _ in range(3):
        assert guardian.step(loss_of(model)).applied
    assert guardian.step(loss_of(model, scale=50.0)).reason == "grad-norm spike"


def test_repeated_bad_steps_roll_back_to_the_snapshot_and_remediate(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    config = settings(checkpoint={"snapshotEverySteps": 4, "everySteps": 1000})
    guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=config)
    for _ in range(4):
        assert guardian.step(loss_of(model)).applied
    at_snapshot = clone_state(model)
    adam_state = {k: v.clone() for k, v in optimizer.state[next(iter(model.parameters()))].items()}
    for _ in range(2):
        assert guardian.step(loss_of(model)).applied
    outcomes = [guardian.step(loss_of(model) * math.nan) for _ in range(3)]
    assert [o.rolled_back for o in outcomes] == [False, False, True]
    assert guardian.rollbacks == 1
    assert guardian.step_count == 4
    assert_same(at_snapshot, clone_state(model))
    restored = optimizer.state[next(iter(model.parameters()))]
    for key, value in adam_state.items():
        assert torch.equal(restored[key], value), key
    lrs = stepping_lrs(optimizer)
    assert guardian.step(loss_of(model)).applied
    assert lrs == [pytest.approx(0.05)]  # the remediation halves the learning rate the update uses
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # the loop's own value is untouched
    assert guardian.max_grad_norm == pytest.approx(0.5)
    assert guardian.lr_scale == pytest.approx(0.5)
    forensics = sorted((tmp_path / "forensics").glob("*.json"))
    assert len(forensics) == 3
    bundle = json.loads(forensics[-1].read_text())
    assert bundle["reason"] == "non-finite loss"
    assert len(bundle["losses"]) == 6


def test_a_rollback_reports_itself_busy_until_its_validation_is_done(tmp_path: Path) -> None:
    # The restore and the held-out validation make no steps; the status says "rolling back" with the
    # time it began (the sidecar then allows the startup grace, not the hang timeout), and afterwards
    # the hang clock restarts from the end of the rollback.
    status_file = tmp_path / "status.json"
    seen: list[Any] = []

    def validate() -> float:
        status, _ = read_status(status_file)
        seen.append(status)
        return 1.0

    model = tiny_model()
    guardian = Guardian(
        model, torch.optim.SGD(model.parameters(), lr=0.1), status_file=status_file, validate=validate
    )
    for _ in range(3):
        guardian.step(loss_of(model))
    before = guardian.last_step_time
    assert before is not None
    for _ in range(3):
        guardian.step(loss_of(model) * math.nan)
    assert guardian.rollbacks == 1
    [during] = seen
    assert during is not None
    assert during.phase is Phase.ROLLING_BACK
    assert during.busy_since is not None
    assert during.busy_since >= before
    after, _ = read_status(status_file)
    assert after is not None
    assert after.phase is Phase.RUNNING
    assert after.busy_since is None
    assert after.last_step_time is not None
    assert after.last_step_time >= during.busy_since


def test_finishing_writes_the_final_status_as_the_termination_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    message_file = tmp_path / "termination-log"
    monkeypatch.setenv("TRAINGUARD_TERMINATION_MESSAGE_PATH", str(message_file))
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(5):
        guardian.step(loss_of(model))
    guardian.message = "x" * 10_000  # a free text too long for the kubelet's 4096 bytes
    guardian.finish()
    text = message_file.read_text()
    assert len(text.encode()) <= 4096
    final = json.loads(text)
    assert final["phase"] == "finished"
    assert final["step"] == 5
    assert final["message"].endswith("...")


def test_a_termination_message_that_cannot_be_written_does_not_fail_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINGUARD_TERMINATION_MESSAGE_PATH", str(tmp_path / "missing-dir" / "log"))
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    guardian.step(loss_of(model))
    guardian.finish()
    assert guardian.phase is Phase.FINISHED


def test_a_second_rollback_from_the_same_snapshot_compounds_the_remediation() -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guardian = Guardian(model, optimizer, settings=settings(checkpoint={"snapshotEverySteps": 100}))
    for _ in range(2):
        for _ in range(3):
            guardian.step(loss_of(model) * math.nan)
    assert guardian.rollbacks == 2
    lrs = stepping_lrs(optimizer)
    guardian.step(loss_of(model))
    assert lrs == [pytest.approx(0.025)]


def test_too_many_rollbacks_diverge_with_the_documented_exit_code(tmp_path: Path) -> None:
    model = tiny_model()
    status_file = tmp_path / "status.json"
    config = settings(guard={"maxRollbacks": 2, "maxConsecutiveBadSteps": 1})
    guardian = Guardian(
        model, torch.optim.SGD(model.parameters(), lr=0.1), settings=config, status_file=status_file
    )
    guardian.step(loss_of(model) * math.nan)
    guardian.step(loss_of(model) * math.nan)
    with pytest.raises(Diverged) as caught:
        guardian.step(loss_of(model) * math.nan)
    assert caught.value.code == ExitCode.DIVERGED >= 128
    status, _ = read_status(status_file)
    assert status is not None
    assert status.phase == Phase.DIVERGED
    assert "rollbacks" in status.message


def test_rollbacks_outside_the_window_do_not_count() -> None:
    model = tiny_model()
    config = settings(guard={"maxRollbacks": 1, "maxConsecutiveBadSteps": 1, "rollbackWindowSteps": 3})
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.01), settings=config)
    guardian.step(loss_of(model) * math.nan)
    for _ in range(3):
        guardian.step(loss_of(model))
    guardian.step(loss_of(model) * math.nan)  # the first rollback is out of the window by now
    assert guardian.rollbacks == 2


def test_gradient_accumulation_steps_once_per_boundary_with_the_mean_gradient() -> None:
    reference = tiny_model()
    accumulated = tiny_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    acc_opt = torch.optim.SGD(accumulated.parameters(), lr=0.1)
    ref_guard = Guardian(reference, ref_opt)
    acc_guard = Guardian(accumulated, acc_opt, accumulation_steps=2)
    x, y = batch()
    ref_guard.step(torch.nn.functional.mse_loss(reference(x), y))
    # The guardian never rescales a loss: the loop divides by its micro-batches, as it would without it.
    first = acc_guard.step(torch.nn.functional.mse_loss(accumulated(x[:8]), y[:8]) / 2)
    assert not first.boundary
    assert acc_guard.step_count == 0
    second = acc_guard.step(torch.nn.functional.mse_loss(accumulated(x[8:]), y[8:]) / 2)
    assert second.boundary
    assert second.applied
    for a, b in zip(reference.parameters(), accumulated.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_nan_localisation_names_the_first_module_with_a_non_finite_output() -> None:
    model = tiny_model()
    with torch.no_grad():
        linear(model, 2).weight.fill_(math.inf)
    x, y = batch()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not guardian._locator.armed
    guardian.step(torch.nn.functional.mse_loss(model(x), y) * math.nan, replay=lambda: model(x))
    assert guardian.nan_location == "2"
    assert not guardian._locator.armed  # hooks are gone again: the hot path pays nothing


def test_nan_localisation_without_replay_inspects_the_next_forward() -> None:
    model = tiny_model()
    x, y = batch()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    guardian.step(torch.nn.functional.mse_loss(model(x), y) * math.nan)
    assert guardian._locator.armed
    with torch.no_grad():
        linear(model, 0).bias.fill_(math.nan)
    guardian.step(torch.nn.functional.mse_loss(model(x), y))
    assert guardian._locator.found == "0"


def test_resume_restores_weights_optimizer_counters_and_data_position(tmp_path: Path) -> None:
    dataset = [(torch.randn(4), torch.randn(1)) for _ in range(64)]
    config = settings(checkpoint={"everySteps": 5, "snapshotEverySteps": 5})

    def train(until: int) -> tuple[Guardian, torch.nn.Module, GuardedLoader]:
        model = tiny_model()
        guardian = Guardian(
            model, torch.optim.AdamW(model.parameters(), lr=0.01), checkpoint_dir=tmp_path, settings=config
        )
        loader = guardian.loader(dataset, batch_size=4)
        for x, y in guardian.run(loader, max_steps=until):
            guardian.step(torch.nn.functional.mse_loss(model(x), y))
        return guardian, model, loader

    first, first_model, first_loader = train(12)
    assert first.checkpoints.enabled
    assert first.checkpoints.last_clean is not None
    assert first.checkpoints.last_clean.step == 12  # finish() saves the final step
    resumed, model, loader = train(12)
    assert resumed.step_count == 12
    assert loader.position == first_loader.position
    assert_same(clone_state(first_model), clone_state(model))
    continued, _, loader = train(20)
    assert continued.step_count == 20
    assert loader.position.epoch == 1  # 16 batches per epoch


def test_a_resumed_run_starts_from_the_pace_its_checkpoint_saved(tmp_path: Path) -> None:
    status_file = tmp_path / "status.json"
    config = settings(checkpoint={"everySteps": 100}, statusIntervalSeconds=0)

    def train(until: int) -> tuple[Guardian, list[WorkerStatus]]:
        model = tiny_model()
        guardian = Guardian(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            checkpoint_dir=tmp_path / "ckpt",
            status_file=status_file,
            settings=config,
        )
        published = []
        while guardian.step_count < until:
            guardian.step(loss_of(model))
            status, _ = read_status(status_file)
            assert status is not None
            published.append(status)
        guardian.finish()
        return guardian, published

    first, _ = train(WARMUP_GAPS + 10)
    learned = first.counters.pace  # as its last checkpoint saved it
    assert learned.learned()
    assert learned.longest > 0
    # The resumed run counts a short warm-up of its own, then judges by what the first run learned.
    _, published = train(WARMUP_GAPS + 10 + RESUMED_WARMUP_GAPS + 2)
    counts = [status.progress_gaps for status in published]
    assert min(counts) >= WARMUP_GAPS - RESUMED_WARMUP_GAPS, counts
    first_learned = next(i for i, status in enumerate(published) if status.gaps.learned())
    assert first_learned <= RESUMED_WARMUP_GAPS, counts  # not after WARMUP_GAPS steps, as a new job
    assert all(status.longest_progress_gap_seconds >= learned.longest for status in published)


def test_a_checkpoint_saved_in_a_resumed_runs_warm_up_keeps_the_carried_pace(tmp_path: Path) -> None:
    def reporter() -> StatusReporter:
        return StatusReporter(tmp_path / "status.json", 0.0, None, lambda: WorkerStatus(started_at=1.0))

    resumed = reporter()
    resumed.carry(ProgressGaps(40, 0.3))
    assert resumed.pace == ProgressGaps(40, 0.3)  # not the 15 gaps and no own gap of its warm-up
    fresh = reporter()
    fresh.carry(ProgressGaps(3, 0.0))  # a record still in its warm-up carries nothing
    assert fresh.pace == ProgressGaps()


def test_counters_saved_before_the_pace_was_saved_load_with_nothing_learned() -> None:
    saved = GuardCounters(1.0, step=7, pace=ProgressGaps(30, 0.4)).to_state()
    assert GuardCounters.from_state(saved, 10).pace == ProgressGaps(30, 0.4)
    older = {k: v for k, v in saved.items() if k not in ("progress_gaps", "longest_progress_gap_seconds")}
    assert GuardCounters.from_state(older, 10).pace == ProgressGaps()
    assert GuardCounters(1.0, pace=ProgressGaps(30, math.inf)).to_state()["progress_gaps"] == 0
    for field, bad in (("progress_gaps", -1), ("longest_progress_gap_seconds", math.nan)):
        with pytest.raises(CountersError, match=field):
            GuardCounters.from_state({**saved, field: bad}, 10)


def test_checkpoint_of_another_model_is_a_config_error_and_deletes_nothing(tmp_path: Path) -> None:
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=tmp_path)
    guardian.step(loss_of(model))
    guardian.finish()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    with pytest.raises(ConfigError) as caught:
        Guardian(other, torch.optim.SGD(other.parameters(), lr=0.1), checkpoint_dir=tmp_path)
    assert caught.value.code == ExitCode.CONFIG_ERROR
    assert "does not fit this model" in str(caught.value)
    assert str(tmp_path) in str(caught.value)
    # Nothing was deleted or changed (the attempt only claimed an epoch of its own, beside the others).
    assert {p: p.read_bytes() for p in before} == before


@pytest.mark.parametrize(
    ("env", "value", "named"),
    [
        ("TRAINGUARD_SETTINGS", '{"guard": {"lossSpikeWindow": -1}}', "guard.lossSpikeWindow"),
        ("TRAINGUARD_SETTINGS", '{"guard": {"lossSpikeFactor": 1.0}}', "guard.lossSpikeFactor"),
        ("TRAINGUARD_SETTINGS", "not json", "TRAINGUARD_SETTINGS"),
        ("TRAINGUARD_FAULTS", "nan_loss@x", "nan_loss@x"),
        ("TRAINGUARD_REMEDIATION", '{"lrScale": 2}', "lrScale"),
    ],
)
def test_invalid_settings_fail_at_start_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, named: str
) -> None:
    monkeypatch.setenv(env, value)
    model = tiny_model()
    with pytest.raises(ConfigError) as caught:
        Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert named in str(caught.value)
    assert caught.value.code == ExitCode.CONFIG_ERROR


def test_unusable_checkpoint_directory_fails_at_start(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    model = tiny_model()
    with pytest.raises(ConfigError) as caught:
        Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=afile / "ckpt")
    assert str(afile / "ckpt") in str(caught.value)


def test_remediation_from_the_orchestrator_applies_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINGUARD_REMEDIATION", '{"id": "attempt-2", "lrScale": 0.5, "maxGradNorm": 0.25}')
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path)
    assert guardian.lr_scale == pytest.approx(0.5)
    assert guardian.max_grad_norm == pytest.approx(0.25)
    lrs = stepping_lrs(optimizer)
    guardian.step(loss_of(model))
    assert lrs == [pytest.approx(0.05)]
    guardian.finish()
    again = torch.optim.SGD(model.parameters(), lr=0.1)
    resumed = Guardian(model, again, checkpoint_dir=tmp_path)  # same attempt restarted after a crash
    assert resumed.lr_scale == pytest.approx(0.5)  # not halved a second time
    lrs = stepping_lrs(again)
    resumed.step(loss_of(model))
    assert lrs == [pytest.approx(0.05)]


def test_data_guard_drops_bad_samples_and_counts_them() -> None:
    good = [(torch.randn(4), torch.randn(1)) for _ in range(30)]
    bad: list[Any] = [
        (torch.full((4,), math.nan), torch.randn(1)),
        (torch.randn(4), torch.tensor([math.inf])),
        (torch.empty(0), torch.randn(1)),
        None,
    ]
    dataset = good[:10] + bad + good[10:]
    loader = GuardedLoader(dataset, batch_size=17, shuffle=False)
    batches = list(loader)
    assert len(batches) == 2
    assert loader.counters.seen == 34
    assert loader.counters.dropped == 4
    assert loader.counters.drop_rate == pytest.approx(4 / 34)
    assert all(torch.isfinite(b.data[0]).all() for b in batches)
    assert batches[0].data[0].shape[0] == 13
    assert sample_is_bad({"x": torch.tensor([1.0, math.nan])})
    assert not sample_is_bad({"ids": torch.tensor([1, 2])})


def test_data_order_is_deterministic_sharded_and_resumable() -> None:
    dataset = list(range(40))
    rank0 = GuardedLoader(dataset, batch_size=5, rank=0, world_size=2, seed=7)
    rank1 = GuardedLoader(dataset, batch_size=5, rank=1, world_size=2, seed=7)
    assert not set(rank0.epoch_order(0)) & set(rank1.epoch_order(0))
    assert rank0.epoch_order(0) != rank0.epoch_order(1)
    full = [b.sample_ids for b in rank0]
    resumed = GuardedLoader(dataset, batch_size=5, rank=0, world_size=2, seed=7)
    resumed.load_state_dict({"epoch": 0, "batch": 2})
    assert [b.sample_ids for b in resumed] == full[2:]
    assert resumed.position.epoch == 1


def test_iterating_the_loader_leaves_the_global_rng_alone() -> None:
    loader = GuardedLoader(list(range(40)), batch_size=5, seed=3)
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    next(iter(loader))
    assert torch.equal(torch.rand(3), expected)


def test_bf16_autocast_steps_are_guarded_like_fp32() -> None:
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    assert guardian.step(loss).applied
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bad = torch.nn.functional.mse_loss(model(x).float(), y) * math.nan
    before = clone_state(model)
    assert guardian.step(bad).reason == "non-finite loss"
    assert_same(before, clone_state(model))


# --- the whole state must be finite to be saved ----------------------------------------------------------


class Poisonable(torch.nn.Module):
    """An embedding, a linear layer and a BatchNorm: state that no gradient check sees (buffers, rows
    no batch looks up, optimizer moments) can be poisoned from outside."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.embed(ids)))
        return out


def poisonable_loss(model: Poisonable) -> torch.Tensor:
    ids = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])  # rows 4-9 are never looked up
    loss: torch.Tensor = model(ids).pow(2).mean()
    return loss


def buffer(module: torch.nn.Module, name: str) -> torch.Tensor:
    found = getattr(module, name)
    assert isinstance(found, torch.Tensor)
    return found


def finite_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    tensors = [*model.state_dict().values()]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


POISONS: dict[str, Any] = {
    "batchnorm running mean": lambda m, o: m.norm.running_mean.fill_(math.nan),
    "embedding row never looked up": lambda m, o: m.embed.weight.data[7].fill_(math.nan),
    "adam exp_avg_sq": lambda m, o: o.state[m.head.weight]["exp_avg_sq"].fill_(math.inf),
}


def test_a_rollback_returns_to_the_newest_checkpoint_when_snapshots_are_rarer(tmp_path: Path) -> None:
    # everySteps 3 with the default snapshotEverySteps (100), a new user's first job: it used to be
    # refused, and would have rolled back to the start past three clean checkpoints.
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = settings(checkpoint={"everySteps": 3}, guard={"maxConsecutiveBadSteps": 2})
    guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=config)
    for _ in range(6):
        assert guardian.step(loss_of(model)).applied
    at_six = clone_state(model)
    assert guardian.step(loss_of(model)).applied
    outcomes = [guardian.step(loss_of(model) * math.nan) for _ in range(2)]
    assert outcomes[-1].rolled_back
    assert guardian.step_count == 6
    assert all(torch.equal(at_six[k], v) for k, v in clone_state(model).items())


@pytest.mark.parametrize("poison", list(POISONS))
def test_a_poisoned_state_is_never_saved_as_clean_and_rolls_back(tmp_path: Path, poison: str) -> None:
    model = Poisonable()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    config = settings(checkpoint={"snapshotEverySteps": 2, "everySteps": 4})
    guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=config)
    for _ in range(4):
        assert guardian.step(poisonable_loss(model)).applied
    assert guardian.checkpoints.enabled
    guardian.checkpoints.wait()
    assert guardian.checkpoints.newest_valid() == 4
    for _ in range(2):
        assert guardian.step(poisonable_loss(model)).applied
    guardian.settle()  # the state changes outside a step: the snapshot's background copy must be done
    with torch.no_grad():
        POISONS[poison](model, optimizer)
    outcomes = [guardian.step(poisonable_loss(model)) for _ in range(2)]  # step 8: snapshot and checkpoint
    assert outcomes[-1].rolled_back
    assert not outcomes[-1].applied
    assert outcomes[-1].reason == "non-finite training state"
    assert guardian.rollbacks == 1
    assert guardian.step_count == 6  # the snapshot at step 6 was clean
    assert finite_state(model, optimizer)
    guardian.checkpoints.wait()
    assert guardian.checkpoints.newest_valid() == 4  # nothing was written from the poisoned state


def test_a_state_of_huge_but_finite_values_is_saved_as_clean(tmp_path: Path) -> None:
    # 1e30 squared overflows float32: the fast screen (a Euclidean norm) cannot prove this state finite,
    # and only the exact check may refuse it. It is finite, so it is snapshotted and checkpointed.
    model = Poisonable()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    with torch.no_grad():
        model.embed.weight[7].fill_(1e30)  # a row no batch looks up: no gradient ever reaches it
    config = settings(checkpoint={"snapshotEverySteps": 1, "everySteps": 2})
    guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=config)
    outcomes = [guardian.step(poisonable_loss(model)) for _ in range(4)]
    assert all(outcome.applied for outcome in outcomes)
    assert guardian.rollbacks == 0
    guardian.checkpoints.wait()
    assert guardian.checkpoints.newest_valid() == 4
    saved = CheckpointStore(tmp_path).load(4)["model"]["embed.weight"]
    assert torch.equal(saved[7], torch.full((4,), 1e30))
    guardian.close()


def test_a_state_that_stays_poisoned_diverges_instead_of_finishing(tmp_path: Path) -> None:
    model = Poisonable()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def poison(*_: Any) -> None:
        with torch.no_grad():
            buffer(model.norm, "running_var").fill_(math.nan)  # a broken update: every step poisons a buffer

    optimizer.register_step_post_hook(poison)
    config = settings(checkpoint={"snapshotEverySteps": 1, "everySteps": 1}, guard={"maxRollbacks": 2})
    guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=config)

    def train() -> None:
        for _ in range(10):
            guardian.step(poisonable_loss(model))

    with pytest.raises(Diverged, match="non-finite training state"):
        train()
    assert guardian.rollbacks == 2
    assert guardian.phase is Phase.DIVERGED
    assert guardian.checkpoints.enabled
    assert guardian.checkpoints.newest_valid() is None


def test_finish_never_reports_success_over_a_poisoned_final_state(tmp_path: Path) -> None:
    model = Poisonable()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=settings())
    for _ in range(3):
        guardian.step(poisonable_loss(model))
    with torch.no_grad():
        buffer(model.norm, "running_mean").fill_(math.nan)
    with pytest.raises(UncleanState, match="step 3"):
        guardian.finish()
    assert guardian.phase is not Phase.FINISHED
    assert guardian.step_count == 0  # rolled back to the starting snapshot
    assert finite_state(model, optimizer)


def test_run_trains_on_after_a_poisoned_final_state_until_it_is_clean(tmp_path: Path) -> None:
    model = Poisonable()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=settings())
    dataset = [torch.tensor(i % 4) for i in range(64)]
    poisoned = False
    for ids in guardian.run(guardian.loader(dataset, batch_size=8), max_steps=5):
        guardian.step(model(ids).pow(2).mean())
        if guardian.step_count == 5 and not poisoned:
            poisoned = True
            with torch.no_grad():
                buffer(model.norm, "running_mean").fill_(math.nan)
    assert guardian.phase is Phase.FINISHED
    assert guardian.rollbacks == 1
    assert guardian.step_count == 5
    assert finite_state(model, optimizer)
    assert guardian.checkpoints.enabled
    assert guardian.checkpoints.newest_valid() == 5


def test_a_configuration_error_is_the_final_status_and_termination_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    status_file, message_file = tmp_path / "status.json", tmp_path / "termination-log"
    monkeypatch.setenv("TRAINGUARD_STATUS_FILE", str(status_file))
    monkeypatch.setenv("TRAINGUARD_TERMINATION_MESSAGE_PATH", str(message_file))
    monkeypatch.setenv("TRAINGUARD_SETTINGS", '{"guard": {"maxGradNorm": -1}}')
    model = tiny_model()
    with pytest.raises(ConfigError):
        Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for path in (status_file, message_file):
        status, reason = read_status(path)
        assert status is not None, reason
        assert status.phase is Phase.FAILED
        assert "TRAINGUARD_SETTINGS" in status.message
        assert "guard.maxGradNorm" in status.message


def test_a_crash_at_exit_writes_the_status_and_the_termination_message_once_with_its_step_and_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    status_file, message_file = tmp_path / "status.json", tmp_path / "termination-log"
    monkeypatch.setenv("TRAINGUARD_STATUS_FILE", str(status_file))
    monkeypatch.setenv("TRAINGUARD_TERMINATION_MESSAGE_PATH", str(message_file))
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        guardian.step(loss_of(model))
    guardian._reporter.stop_watching()  # only the exit hook writes from here on
    writes: list[tuple[str, Phase]] = []
    publish = StatusPublisher.publish

    def counted_publish(self: StatusPublisher, status: WorkerStatus, *, force: bool = False) -> bool:
        writes.append(("status", status.phase))
        return publish(self, status, force=force)

    def counted_message(path: Path, status: WorkerStatus) -> None:
        writes.append(("termination message", status.phase))
        write_termination_message(path, status)

    monkeypatch.setattr(StatusPublisher, "publish", counted_publish)
    monkeypatch.setattr(reporting, "write_termination_message", counted_message)  # as reporting calls it
    try:
        raise ValueError("mat1 and mat2 shapes cannot be multiplied")
    except ValueError as exc:
        monkeypatch.setattr(sys, "last_value", exc, raising=False)  # as the interpreter sets it
    guardian._at_exit(True)
    assert writes == [("status", Phase.FAILED), ("termination message", Phase.FAILED)]
    for path in (status_file, message_file):
        status, reason = read_status(path)
        assert status is not None, reason
        assert (status.phase, status.step, status.exit_code) == (Phase.FAILED, 3, 1)
        assert re.fullmatch(
            r"ValueError: mat1 and mat2 shapes cannot be multiplied \(at test_guardian\.py:\d+\)",
            status.message,
        )


def test_an_explicit_checkpoint_dir_that_contradicts_the_orchestrator_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_DIR", str(tmp_path / "mounted"))
    model = tiny_model()
    with pytest.raises(ConfigError, match="TRAINGUARD_CHECKPOINT_DIR") as caught:
        Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=tmp_path / "mine")
    assert "checkpoint_dir" in str(caught.value)
    same = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=tmp_path / "mounted")
    assert same.checkpoint_dir == tmp_path / "mounted"


def test_a_job_of_the_same_name_in_another_namespace_is_refused_the_directory(tmp_path: Path) -> None:
    # Issue 19: the guardian named the job in its claim by name alone, so "train" of namespace team-b
    # resumed team-a's weights and fenced it out.
    config = settings(checkpoint={"everySteps": 2, "snapshotEverySteps": 2})

    def guardian(namespace: str, seed: int) -> Guardian:
        model = tiny_model(seed=seed)
        job = GuardianConfig(
            settings=config, checkpoint_dir=tmp_path, job="train", namespace=namespace, attempt=1
        )
        return Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), config=job)

    first = guardian("team-a", 1)
    for _ in range(2):
        first.step(loss_of(first.module))
    first.finish()
    with pytest.raises(ConfigError, match="belongs to job team-a/train") as caught:
        guardian("team-b", 2)
    assert caught.value.code == ExitCode.CONFIG_ERROR
    assert "not to job team-b/train" in str(caught.value)
    assert guardian("team-a", 3).step_count == 2  # the job itself resumes


def test_a_newer_guardian_on_the_same_directory_fences_the_older_one_out(tmp_path: Path) -> None:
    config = settings(checkpoint={"everySteps": 2, "snapshotEverySteps": 2})
    old_model, new_model = tiny_model(seed=1), tiny_model(seed=2)
    old = Guardian(
        old_model, torch.optim.SGD(old_model.parameters(), lr=0.1), checkpoint_dir=tmp_path, settings=config
    )
    for _ in range(2):
        old.step(loss_of(old_model))
    assert old.checkpoints.enabled
    old.checkpoints.wait()
    new = Guardian(
        new_model, torch.optim.SGD(new_model.parameters(), lr=0.1), checkpoint_dir=tmp_path, settings=config
    )
    assert new.step_count == 2  # it resumed the old writer's clean checkpoint, then claimed a newer epoch
    for _ in range(2):
        old.step(loss_of(old_model))  # step 4: its save starts, and meets the fence in the background
    while old.checkpoints.writing:
        time.sleep(0.01)
    with pytest.raises(Fenced) as caught:
        old.step(loss_of(old_model))
    assert caught.value.code == ExitCode.FENCED
    assert "epoch 2" in str(caught.value)
    assert old.phase is Phase.FAILED
    for _ in range(4):
        new.step(loss_of(new_model))
    new.finish()
    assert new.checkpoints.enabled
    weights = {k: v.clone() for k, v in new_model.state_dict().items()}
    reader_model = tiny_model(seed=3)
    reader = Guardian(
        reader_model,
        torch.optim.SGD(reader_model.parameters(), lr=0.1),
        checkpoint_dir=tmp_path,
        settings=config,
    )
    assert reader.step_count == 6
    assert_same(weights, clone_state(reader.module))


def test_a_loop_that_sets_its_own_learning_rate_keeps_the_remediation() -> None:
    # A loop that writes param_group["lr"] every iteration (a hand-written schedule) used to undo the
    # guardian's lr x 0.5 after a rollback while the status still said 0.5.
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guardian = Guardian(model, optimizer, settings=settings())
    lrs = stepping_lrs(optimizer)
    for iteration in range(8):
        for group in optimizer.param_groups:
            group["lr"] = 0.1 / (1 + iteration)
        guardian.step(loss_of(model) * (math.nan if 2 <= iteration <= 4 else 1.0))
    assert guardian.rollbacks == 1
    assert guardian.lr_scale == pytest.approx(0.5)
    assert lrs == [pytest.approx(x) for x in (0.1, 0.05, 0.1 / 6 * 0.5, 0.1 / 7 * 0.5, 0.1 / 8 * 0.5)]


def test_a_nested_accumulation_loop_keeps_its_shape_and_its_gradients() -> None:
    # The loop's own micro-batch loop and division, with backward() per micro-batch and step() at the
    # boundary, give the same update as the same loop without the guardian.
    reference, guarded = tiny_model(), tiny_model()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    optimizer = torch.optim.SGD(guarded.parameters(), lr=0.1)
    guardian = Guardian(guarded, optimizer)
    x, y = batch()
    expected_loss = float(torch.nn.functional.mse_loss(reference(x), y).detach())
    for model, step in ((reference, None), (guarded, guardian)):
        for micro in range(4):
            loss = torch.nn.functional.mse_loss(
                model(x[micro * 4 : micro * 4 + 4]), y[micro * 4 : micro * 4 + 4]
            )
            if step is None:
                torch.autograd.backward(loss / 4)
            else:
                step.backward(loss / 4)
    plain.step()
    outcome = guardian.step()
    assert outcome.boundary
    assert outcome.applied
    assert outcome.loss == pytest.approx(expected_loss)  # the sum of the micro-batch losses given
    for a, b in zip(reference.parameters(), guarded.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(ConfigError, match=r"no guardian.backward\(loss\) since the last step"):
        guardian.step()


# --- busy sections and being told to stop -------------------------------------------------------------


def test_a_busy_section_is_published_with_its_reason_and_bound(tmp_path: Path) -> None:
    status_file = tmp_path / "status.json"
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), status_file=status_file)
    guardian.step(loss_of(model))
    with guardian.busy("eval", seconds=900):
        inside, _ = read_status(status_file)
        with guardian.busy("save"):
            nested, _ = read_status(status_file)
        back, _ = read_status(status_file)
    after, _ = read_status(status_file)
    assert inside is not None
    assert inside.phase is Phase.BUSY
    assert inside.busy_reason == "eval"
    assert inside.busy_seconds == 900
    assert inside.busy_since is not None
    assert [(s.reason, s.seconds) for s in inside.busy_sections] == [("eval", 900)]
    assert nested is not None
    assert nested.busy_reason == "save"
    # The eval's bound still ends the unbounded save inside it: what an older sidecar reads says so too.
    assert nested.busy_seconds == 900
    assert nested.busy_since == inside.busy_since  # one busy stretch
    assert [(s.reason, s.seconds) for s in nested.busy_sections] == [("eval", 900), ("save", None)]
    assert nested.busy_sections[0].since == inside.busy_since
    assert nested.busy_sections[1].since >= inside.busy_since  # the save's own start
    assert back is not None
    assert back.busy_reason == "eval"
    assert [s.reason for s in back.busy_sections] == ["eval"]
    assert after is not None
    assert after.phase is Phase.RUNNING
    assert after.busy_since is None
    assert after.busy_sections == []
    with pytest.raises(ConfigError, match="busy seconds"), guardian.busy("eval", seconds=math.inf):
        pass


def test_a_bounded_section_inside_an_unbounded_one_states_its_own_start_and_deadline(tmp_path: Path) -> None:
    status_file = tmp_path / "status.json"
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), status_file=status_file)
    guardian.step(loss_of(model))
    with guardian.busy("eval"):
        time.sleep(0.3)
        with guardian.busy("save", seconds=4):
            nested, _ = read_status(status_file)
    assert nested is not None
    assert nested.busy_since is not None
    eval_section, save_section = nested.busy_sections
    assert save_section.since - eval_section.since >= 0.3
    # For an older sidecar: 4 s from the save's start, stated from the stretch's start.
    assert nested.busy_seconds == pytest.approx(save_section.since + 4 - nested.busy_since)


def test_busy_sections_close_by_token_in_any_order_and_once(tmp_path: Path) -> None:
    from trainer_sidecar.contract.status import MAX_BUSY_SECTIONS
    from trainer_sidecar.guardian.busy import BusySections

    sections = BusySections()
    outer = sections.enter("eval", None)
    inner = sections.enter("save", 4.0)
    started = sections.since
    sections.leave(outer)  # out of order: the save stays open, the stretch goes on
    view = sections.view(Phase.RUNNING, None)
    assert [s.reason for s in view.sections] == ["save"]
    assert view.since == started
    sections.leave(outer)  # closed twice: nothing else is closed
    assert [s.reason for s in sections.view(Phase.RUNNING, None).sections] == ["save"]
    sections.leave(inner)
    assert sections.view(Phase.RUNNING, None).phase is Phase.RUNNING
    assert sections.since is None
    tokens = [sections.enter(f"s{i}", None) for i in range(MAX_BUSY_SECTIONS)]
    with pytest.raises(ConfigError, match=f"at most {MAX_BUSY_SECTIONS} busy sections"):
        sections.enter("one too many", None)
    assert len(sections.view(Phase.RUNNING, None).sections) == MAX_BUSY_SECTIONS
    for token in reversed(tokens):
        sections.leave(token)
    assert sections.since is None


def test_the_end_of_a_busy_stretch_restarts_the_hang_clock(tmp_path: Path) -> None:
    status_file = tmp_path / "status.json"
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), status_file=status_file)
    guardian.step(loss_of(model))
    stepped = guardian.last_step_time
    with guardian.busy("eval"):
        time.sleep(0.2)
        with guardian.busy("save"):
            pass
        inner_closed, _ = read_status(status_file)
        ended = time.time()
    after, _ = read_status(status_file)
    assert stepped is not None
    assert inner_closed is not None
    assert after is not None
    assert inner_closed.last_step_time == stepped  # still busy: nothing to restart
    assert after.last_step_time is not None
    assert after.last_step_time >= ended  # else the sidecar reads "no step for" the whole evaluation


@pytest.mark.parametrize("clean", [True, False])
def test_sigterm_checkpoints_at_the_next_boundary_and_exits_143(tmp_path: Path, clean: bool) -> None:
    status_file = tmp_path / "status.json"
    model = tiny_model()
    config = settings(checkpoint={"everySteps": 1000, "snapshotEverySteps": 1000})
    guardian = Guardian(
        model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=tmp_path / "ckpt",
        status_file=status_file, settings=config,
    )  # fmt: skip
    for _ in range(3):
        guardian.step(loss_of(model))
    os.kill(os.getpid(), signal.SIGTERM)  # delivered at once; the guardian only takes note
    with pytest.raises(SystemExit) as caught:
        guardian.step(loss_of(model) * (1.0 if clean else math.nan))  # the boundary it stops at
    assert caught.value.code == 128 + signal.SIGTERM
    status, _ = read_status(status_file)
    assert status is not None
    assert status.phase is Phase.STOPPED
    assert "SIGTERM" in status.message
    reader = CheckpointStore(tmp_path / "ckpt")
    if clean:
        assert reader.newest_valid() == 4
        assert "checkpoint is written" in status.message
    else:
        assert reader.newest_valid() is None  # a bad step was the last: nothing saved
        assert "not clean" in status.message


def test_the_stop_handlers_are_held_while_a_guardian_trains_and_handed_back_after() -> None:
    previous = {  # other tests' guardians may hold the process's own request
        signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_DFL),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
    }
    try:
        request = StopRequest()
        request.acquire()
        request.acquire()
        assert signal.getsignal(signal.SIGTERM) == request._on_signal
        os.kill(os.getpid(), signal.SIGTERM)
        assert request.signal is signal.SIGTERM
        request.release()
        assert signal.getsignal(signal.SIGTERM) == request._on_signal  # still held by the other
        request.release()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# --- checkpoints across wrappers and changed models -----------------------------------------------------


def compile_model(model: torch.nn.Module) -> torch.nn.Module:
    compiled = torch.compile(model)
    assert isinstance(compiled, torch.nn.Module)
    return compiled


def test_a_checkpoint_of_a_compiled_model_loads_into_the_plain_one_and_back(tmp_path: Path) -> None:
    plain = tiny_model(seed=4)
    compiled = compile_model(plain)  # no forward is run through it: only its state-dict keys matter
    guardian = Guardian(compiled, torch.optim.SGD(plain.parameters(), lr=0.1), checkpoint_dir=tmp_path)
    for _ in range(2):
        guardian.step(loss_of(plain))
    guardian.finish()
    saved = clone_state(plain)
    fresh = tiny_model(seed=5)
    resumed = Guardian(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), checkpoint_dir=tmp_path)
    assert resumed.step_count == 2
    assert_same(saved, clone_state(fresh))
    again = tiny_model(seed=6)
    back = Guardian(
        compile_model(again), torch.optim.SGD(again.parameters(), lr=0.1), checkpoint_dir=tmp_path
    )
    assert back.step_count == 2
    assert_same(saved, clone_state(again))


def test_keys_saved_through_wrappers_are_fitted_to_the_bare_model() -> None:
    live = {"0.weight": torch.zeros(2), "0.bias": torch.zeros(1)}
    saved = {"_orig_mod.module.0.weight": torch.ones(2), "module.0.bias": torch.ones(1)}
    assert set(fit_keys(saved, live)) == set(live)
    assert fit_keys(live, live) is live


def test_a_changed_model_names_the_missing_unexpected_and_reshaped_keys(tmp_path: Path) -> None:
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=tmp_path)
    guardian.step(loss_of(model))
    guardian.finish()
    extra = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1), torch.nn.Linear(1, 1)
    )
    with pytest.raises(ConfigError) as caught:
        Guardian(extra, torch.optim.SGD(extra.parameters(), lr=0.1), checkpoint_dir=tmp_path)
    message = str(caught.value)
    assert "another shape (3): 0.bias (checkpoint (8,), model (16,))" in message
    assert "missing (2): 3.bias, 3.weight" in message
    assert "was the model changed" in message
    assert "unexpected" not in message


# --- the loop's own data ------------------------------------------------------------------------------


class Cursor:
    """A data stream of the loop's own: where it is, as state."""

    def __init__(self) -> None:
        self.position = 0
        self.seed = torch.tensor([7, 8])

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.seed = state["seed"]


def test_tracked_state_of_the_loop_is_checkpointed_per_rank_and_restored(tmp_path: Path) -> None:
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=tmp_path)
    cursor = Cursor()
    guardian.track("stream", cursor)
    for _ in range(3):
        cursor.position += 10
        guardian.step(loss_of(model))
    guardian.finish()
    again = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=tmp_path)
    restored = Cursor()
    again.track("stream", restored)  # tracked after the resume: restored when it is tracked
    assert restored.position == 30
    assert torch.equal(restored.seed, torch.tensor([7, 8]))


def test_tracking_something_that_cannot_be_checkpointed_fails_at_once() -> None:
    class Opaque(Cursor):
        def state_dict(self) -> dict[str, Any]:
            return {"handle": object()}

    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match=r"'stream'.*cannot be checkpointed"):
        guardian.track("stream", Opaque())


def test_a_dataloader_is_taken_over_with_its_batch_size_and_shuffling() -> None:
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = guardian.loader(torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True))
    assert loader.batch_size == 8
    assert loader.shuffle
    assert loader.batches_per_epoch == 5

    class Stream(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(3))

    with pytest.raises(ConfigError, match="StatefulDataLoader"):
        guardian.loader(torch.utils.data.DataLoader(Stream(), batch_size=2))


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_taken_over_dataloader_trains_its_last_partial_batch_unless_it_drops_it(drop_last: bool) -> None:
    # shuffle=False, 50 samples in batches of 8: samples 48 and 49 were never trained, in any epoch.
    data = torch.utils.data.TensorDataset(torch.randn(50, 4), torch.arange(50))
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.01), resume=False)
    source = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False, drop_last=drop_last)
    plain = [ids.tolist() for _ in range(2) for _, ids in source]
    trained = []
    for x, ids in guardian.run(source, max_steps=len(plain)):
        trained.append(ids.tolist())
        guardian.step(model(x).square().mean())
    assert trained == plain
    assert ([48, 49] in trained) is not drop_last


def test_a_dataloader_that_cannot_be_taken_over_is_refused_saying_why() -> None:
    class Unsized(torch.utils.data.Dataset[int]):
        def __getitem__(self, index: int) -> int:
            return index

    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), resume=False)
    with pytest.raises(ConfigError, match=r"\(Unsized\) has no length.*needs __len__"):
        guardian.loader(torch.utils.data.DataLoader(Unsized(), batch_size=4))
    with pytest.raises(ConfigError, match="batch_size=None"):
        guardian.loader(
            torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8)), batch_size=None)
        )


def _mark_worker(worker_id: int) -> None:
    torch.utils.data.get_worker_info().dataset.dataset.marks.append(worker_id)  # type: ignore[union-attr]


class _Marked(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self) -> None:
        self.marks: list[int] = []

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index), float(len(self.marks))])  # the worker's init ran: 1


def test_a_dataloader_taken_over_keeps_how_its_workers_load() -> None:
    # worker_init_fn (a per-worker handle, a seed) used to be dropped with the rest of the DataLoader.
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    source = torch.utils.data.DataLoader(
        _Marked(), batch_size=4, num_workers=1, worker_init_fn=_mark_worker, prefetch_factor=3, timeout=60
    )
    loader = guardian.loader(source)
    assert loader.loading == {
        "worker_init_fn": _mark_worker,
        "pin_memory": False,
        "timeout": 60,
        "multiprocessing_context": None,
        "prefetch_factor": 3,
    }
    first = next(iter(loader))
    assert bool((first.data[:, 1] == 1).all())


def _sampled(kind: str, dataset: torch.utils.data.TensorDataset) -> torch.utils.data.Sampler[int]:
    from torch.utils import data

    samplers: dict[str, Callable[[], data.Sampler[int]]] = {
        "distributed shuffling": lambda: data.DistributedSampler(dataset, num_replicas=1, rank=0),
        "distributed in order": lambda: data.DistributedSampler(
            dataset, num_replicas=1, rank=0, shuffle=False
        ),
        "sequential": lambda: data.SequentialSampler(dataset),
        "subset": lambda: data.SubsetRandomSampler(range(20)),
        "weighted": lambda: data.WeightedRandomSampler([1.0] * 40, 40),
        "with replacement": lambda: data.RandomSampler(dataset, replacement=True),
        "fewer samples": lambda: data.RandomSampler(dataset, num_samples=10),
    }
    return samplers[kind]()


@pytest.mark.parametrize(
    ("kind", "shuffles"),
    [("distributed shuffling", True), ("distributed in order", False), ("sequential", False)],
)
def test_a_dataloaders_sampler_that_orders_the_whole_dataset_is_taken_over(kind: str, shuffles: bool) -> None:
    # A DistributedSampler (shuffling by default) used to be taken as "no shuffling".
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    source = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=_sampled(kind, dataset))
    assert guardian.loader(source).shuffle is shuffles


@pytest.mark.parametrize(
    ("kind", "named"),
    [
        ("subset", "is a SubsetRandomSampler"),
        ("weighted", "is a WeightedRandomSampler"),
        ("with replacement", "draws with replacement"),
        ("fewer samples", "draws 10 samples"),
    ],
)
def test_a_dataloaders_sampler_that_chooses_samples_is_refused_not_dropped(kind: str, named: str) -> None:
    # A SubsetRandomSampler (a train split) used to be replaced by the whole dataset, silently.
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    source = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=_sampled(kind, dataset))
    with pytest.raises(ConfigError, match=named) as caught:
        guardian.loader(source)
    assert "torch.utils.data.Subset" in str(caught.value)


def test_each_local_rank_of_a_pod_writes_a_status_file_of_its_own(tmp_path: Path) -> None:
    env = {
        "TRAINGUARD_STATUS_FILE": str(tmp_path / "status.json"),
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    assert GuardianConfig.from_env(env).status_file == tmp_path / "status-1.json"
    assert GuardianConfig.from_env({**env, "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}).status_file == (
        tmp_path / "status.json"
    )
    with pytest.raises(ConfigError, match="LOCAL_RANK 2 of LOCAL_WORLD_SIZE 2"):
        GuardianConfig.from_env({**env, "LOCAL_RANK": "2"})
    # A launcher that sets LOCAL_RANK alone (one process per pod) keeps the file as it is.
    alone = {"TRAINGUARD_STATUS_FILE": str(tmp_path / "status.json"), "LOCAL_RANK": "3"}
    assert GuardianConfig.from_env(alone).status_file == tmp_path / "status.json"


def test_a_checkpoint_is_also_due_by_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    model = tiny_model()
    config = settings(checkpoint={"everySteps": 1000, "snapshotEverySteps": 1000, "everySeconds": 60})
    guardian = Guardian(
        model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=tmp_path, settings=config
    )
    for _ in range(3):
        clock[0] += 10
        guardian.step(loss_of(model))
    assert guardian.checkpoints.enabled
    guardian.checkpoints.wait()
    assert guardian.checkpoints.newest_valid() is None  # 30 s: not due yet
    clock[0] += 31
    guardian.step(loss_of(model))  # 61 s since the start: due
    guardian.checkpoints.wait()
    assert guardian.checkpoints.newest_valid() == 4
    clock[0] += 59
    guardian.step(loss_of(model))
    guardian.checkpoints.wait()
    assert guardian.checkpoints.newest_valid() == 4  # 59 s since that one: not yet


def _adopted_wrongly(case: str, status_file: Path) -> Guardian:
    model = tiny_model()
    other = tiny_model(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    arguments: dict[str, Any] = {"model": model, "optimizer": optimizer}
    if case == "optimizer of another model":
        arguments["optimizer"] = torch.optim.SGD(other.parameters(), lr=0.1)
    elif case == "a tensor outside the model":
        extra = torch.zeros(3, requires_grad=True)
        arguments["optimizer"] = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    elif case == "two optimizers":
        arguments["optimizer"] = [optimizer, torch.optim.SGD(model.parameters(), lr=0.1)]
    elif case == "not a module":
        arguments["model"] = lambda x: x
    elif case == "plateau scheduler":
        arguments["scheduler"] = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    elif case == "scheduler of another optimizer":
        other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
        arguments["scheduler"] = torch.optim.lr_scheduler.StepLR(other_optimizer, 10)
    elif case == "scaler of another kind":
        arguments["scaler"] = object()
    elif case == "fractional accumulation":
        arguments["accumulation_steps"] = 2.5
    return Guardian(**arguments, status_file=status_file, resume=False)


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("optimizer of another model", "not parameters of the model"),
        ("a tensor outside the model", "1 tensor(s) that are not parameters of the model (shapes (3,))"),
        ("two optimizers", "takes one torch.optim.Optimizer, got a list of 2"),
        ("not a module", "Guardian(model=...) must be a torch.nn.Module"),
        ("plateau scheduler", "ReduceLROnPlateau"),
        ("scheduler of another optimizer", "schedules another optimizer"),
        ("scaler of another kind", "Guardian(scaler=...) must be a torch.amp.GradScaler"),
        ("fractional accumulation", "accumulation_steps must be an integer"),
    ],
)
def test_objects_the_guardian_cannot_roll_back_are_refused_at_construction(
    case: str, named: str, tmp_path: Path
) -> None:
    # Each used to fail later or silently: an AttributeError at the first step, or a rollback that left
    # the optimizer's own parameters (those of another model) where they were.
    status_file = tmp_path / "status.json"
    with pytest.raises(ConfigError) as caught:
        _adopted_wrongly(case, status_file)
    assert named in str(caught.value)
    assert caught.value.code == ExitCode.CONFIG_ERROR
    status, _ = read_status(status_file)
    assert status is not None
    assert named in status.message  # the orchestrator shows it


@pytest.mark.parametrize(
    ("loss", "named"),
    [
        (1.0, "must be a torch.Tensor"),
        (torch.ones(4, requires_grad=True), "must be one value"),
        (torch.tensor(1.0), "does not require grad"),
    ],
)
def test_a_loss_autograd_cannot_backward_is_a_configuration_error(
    loss: Any, named: str, tmp_path: Path
) -> None:
    # It used to be a TypeError: exit code 1, a crash the orchestrator retried with backoff until the
    # restarts ran out, though the README promised the configuration error of a half-done adoption.
    model = tiny_model()
    status_file = tmp_path / "status.json"
    guardian = Guardian(
        model, torch.optim.SGD(model.parameters(), lr=0.1), status_file=status_file, resume=False
    )
    with pytest.raises(ConfigError, match=named) as caught:
        guardian.step(loss)
    assert caught.value.code == ExitCode.CONFIG_ERROR
    status, _ = read_status(status_file)
    assert status is not None
    assert status.exit_code == ExitCode.CONFIG_ERROR
    assert named in status.message


@pytest.mark.parametrize("stepped", ["optimizer", "scheduler"])
def test_a_loop_that_still_steps_what_the_guardian_steps_is_stopped_at_once(
    stepped: str, tmp_path: Path
) -> None:
    # A half-done adoption (guardian.step added, the loop's own optimizer.step() or scheduler.step()
    # kept) used to apply refused, even NaN, gradients or decay the learning rate twice as fast.
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    status_file = tmp_path / "status.json"
    guardian = Guardian(model, optimizer, scheduler=scheduler, status_file=status_file, resume=False)

    def half_adopted_loop() -> None:
        for _ in range(3):
            guardian.step(loss_of(model))
            if stepped == "optimizer":
                optimizer.step()  # the line the loop forgot to delete
            else:
                scheduler.step()

    with pytest.raises(ConfigError) as caught:
        half_adopted_loop()
    assert caught.value.code == ExitCode.CONFIG_ERROR
    assert f"the training loop steps the {stepped} itself" in str(caught.value)
    if stepped == "optimizer":
        assert f"{Path(__file__).name}:" in str(caught.value)  # the loop's own line is named
    assert guardian.step_count == 1  # found at the first step that shows it
    status, _ = read_status(status_file)
    assert status is not None
    assert status.phase is Phase.FAILED
    assert status.exit_code == ExitCode.CONFIG_ERROR


def test_a_loop_that_backwards_its_loss_itself_is_a_configuration_error(tmp_path: Path) -> None:
    # The loop kept loss.backward() and called guardian.step() without the loss: a RuntimeError used to
    # end the worker with exit code 1, a crash retried with backoff until the restarts ran out.
    model = tiny_model()
    status_file = tmp_path / "status.json"
    guardian = Guardian(
        model, torch.optim.SGD(model.parameters(), lr=0.1), status_file=status_file, resume=False
    )
    torch.autograd.backward(loss_of(model))  # the line the adoption forgot to change
    with pytest.raises(ConfigError) as caught:
        guardian.step()
    assert caught.value.code == ExitCode.CONFIG_ERROR
    message = str(caught.value)
    assert "the loop's own loss.backward()" in message
    assert "guardian.backward(loss)" in message  # what to change
    assert f"{Path(__file__).name}:" in message  # the loop's line
    status, _ = read_status(status_file)
    assert status is not None
    assert status.phase is Phase.FAILED
    assert status.exit_code == ExitCode.CONFIG_ERROR
    assert "guardian.backward(loss)" in status.message


@pytest.mark.parametrize("misuse", ["loader without batch_size", "busy seconds", "untrackable state"])
def test_every_misuse_of_the_api_publishes_a_configuration_error(misuse: str, tmp_path: Path) -> None:
    model = tiny_model()
    status_file = tmp_path / "status.json"
    guardian = Guardian(
        model, torch.optim.SGD(model.parameters(), lr=0.1), status_file=status_file, resume=False
    )
    misuses: dict[str, Callable[[], object]] = {
        "loader without batch_size": lambda: guardian.loader(torch.utils.data.TensorDataset(torch.randn(8))),
        "busy seconds": lambda: guardian.busy("eval", seconds=-1).__enter__(),
        "untrackable state": lambda: guardian.track("opaque", _Opaque()),
    }
    with pytest.raises(ConfigError) as caught:
        misuses[misuse]()
    status, _ = read_status(status_file)
    assert status is not None
    assert status.exit_code == ExitCode.CONFIG_ERROR
    assert caught.value.message in status.message


class _Opaque:
    def state_dict(self) -> dict[str, Any]:
        return {"handle": object()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


def test_the_scheduler_check_survives_a_rollback_and_a_resume(tmp_path: Path) -> None:
    # Restoring a scheduler's state moves its last_epoch: that is the guardian's doing, not the loop's.
    def build() -> tuple[torch.nn.Module, Guardian]:
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        config = settings(checkpoint={"everySteps": 3, "snapshotEverySteps": 3})
        return model, Guardian(
            model, optimizer, scheduler=scheduler, checkpoint_dir=tmp_path, settings=config
        )

    model, guardian = build()
    for _ in range(4):
        assert guardian.step(loss_of(model)).applied
    outcomes = [guardian.step(loss_of(model) * math.nan) for _ in range(3)]
    assert outcomes[-1].rolled_back
    assert guardian.step_count == 3
    for _ in range(3):
        assert guardian.step(loss_of(model)).applied
    guardian.finish()
    model, resumed = build()
    assert resumed.step_count == 6
    assert resumed.step(loss_of(model)).applied


@pytest.mark.parametrize("created", ["before the guardian", "after the guardian"])
def test_a_scheduler_the_guardian_neither_steps_nor_keeps_is_refused_at_the_first_step(
    created: str, tmp_path: Path
) -> None:
    # The MNIST example's shape: a per-epoch StepLR the loop steps itself. Unkept, a resume restored the
    # decayed learning rate but restarted the schedule: every later decay came epochs late.
    model = tiny_model()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    if created == "before the guardian":
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    status_file = tmp_path / "status.json"
    guardian = Guardian(model, optimizer, status_file=status_file, resume=False)
    if created == "after the guardian":
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    before = clone_state(model)
    with pytest.raises(ConfigError, match="learning-rate scheduler the guardian was not given") as caught:
        guardian.step(loss_of(model))
    assert caught.value.code == ExitCode.CONFIG_ERROR
    assert 'guardian.track("scheduler", scheduler)' in str(caught.value)
    assert all(torch.equal(before[k], v) for k, v in clone_state(model).items())  # refused before stepping
    status, _ = read_status(status_file)
    assert status is not None
    assert status.phase is Phase.FAILED
    assert "learning-rate scheduler" in status.message
    assert "StepLR `scheduler`" in status.message  # named by the loop's variable
    assert scheduler.last_epoch == 0


def test_a_second_scheduler_beside_the_given_one_is_refused_naming_it(tmp_path: Path) -> None:
    # A warm-up the loop steps itself next to the cosine schedule it gave: only the given one was
    # checkpointed, so a resume ran the warm-up again and the learning rate differed from then on.
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    status_file = tmp_path / "status.json"
    guardian = Guardian(model, optimizer, scheduler=cosine, status_file=status_file, resume=False)
    before = clone_state(model)
    with pytest.raises(
        ConfigError, match="scheduler the guardian was not given: LambdaLR `warmup`"
    ) as caught:
        guardian.step(loss_of(model))
    assert caught.value.code == ExitCode.CONFIG_ERROR
    assert "besides the one given, CosineAnnealingLR" in str(caught.value)
    assert "ChainedScheduler or SequentialLR" in str(caught.value)
    assert_same(before, clone_state(model))  # refused before stepping
    status, _ = read_status(status_file)
    assert status is not None
    assert status.phase is Phase.FAILED
    assert status.exit_code == ExitCode.CONFIG_ERROR
    assert "LambdaLR `warmup`" in status.message
    assert warmup.last_epoch == 0


@pytest.mark.parametrize("tracked", [False, True])
def test_an_untracked_plateau_scheduler_is_refused_and_a_tracked_one_kept(tracked: bool) -> None:
    # ReduceLROnPlateau wraps nothing of the optimizer: it used to go unnoticed, its reductions lost.
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
    guardian = Guardian(model, optimizer, resume=False)
    if tracked:
        guardian.track("plateau", plateau)
        assert guardian.step(loss_of(model)).applied
    else:
        with pytest.raises(ConfigError, match="ReduceLROnPlateau `plateau`"):
            guardian.step(loss_of(model))


def test_a_scheduler_the_loop_dropped_is_not_refused() -> None:
    # Nothing of a scheduler that no longer exists is lost, even one that waited in a reference cycle.
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dropped = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    dropped.cycle = dropped  # type: ignore[attr-defined]
    del dropped
    guardian = Guardian(model, optimizer, resume=False)
    assert guardian.step(loss_of(model)).applied


def _wrapped_schedule(optimizer: torch.optim.Optimizer, wrapper: str) -> torch.optim.lr_scheduler.LRScheduler:
    from torch.optim import lr_scheduler

    warmup = lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    if wrapper == "SequentialLR":
        cosine = lr_scheduler.CosineAnnealingLR(optimizer, T_max=8)
        return lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[3])
    return lr_scheduler.ChainedScheduler([warmup, lr_scheduler.ExponentialLR(optimizer, gamma=0.9)])


@pytest.mark.parametrize("wrapper", ["SequentialLR", "ChainedScheduler"])
def test_a_wrapper_scheduler_covers_its_children_and_resumes_bit_exactly(
    tmp_path: Path, wrapper: str
) -> None:
    # The wrapper's state holds its children's: given it, the guardian keeps them all.
    def build(directory: Path) -> tuple[torch.nn.Module, Guardian, list[float]]:
        model = tiny_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        scheduler = _wrapped_schedule(optimizer, wrapper)
        config = settings(checkpoint={"everySteps": 4})
        guardian = Guardian(model, optimizer, scheduler=scheduler, checkpoint_dir=directory, settings=config)
        return model, guardian, stepping_lrs(optimizer)

    model, straight, lrs = build(tmp_path / "straight")
    for step in range(10):
        assert straight.step(loss_of(model, seed=step)).applied
    straight.finish()
    expected, expected_lrs = clone_state(model), lrs[4:]

    model, crashed, _ = build(tmp_path / "crashed")
    for step in range(6):
        assert crashed.step(loss_of(model, seed=step)).applied
    assert crashed.checkpoints.enabled
    crashed.checkpoints.wait()
    crashed.close()  # a crash after step 6: the newest checkpoint is step 4's
    model, resumed, lrs = build(tmp_path / "crashed")
    assert resumed.step_count == 4
    for step in range(4, 10):
        assert resumed.step(loss_of(model, seed=step)).applied
    resumed.finish()
    assert lrs == expected_lrs
    assert_same(expected, clone_state(model))


def test_a_scheduler_the_loop_steps_itself_and_tracks_is_kept_across_a_resume(tmp_path: Path) -> None:
    def build() -> tuple[torch.nn.Module, torch.optim.lr_scheduler.StepLR, Guardian]:
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        config = settings(checkpoint={"everySteps": 5})
        guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=config)
        guardian.track("scheduler", scheduler)
        return model, scheduler, guardian

    model, scheduler, guardian = build()
    for step in range(1, 8):  # "epochs" of 2 steps: the loop steps its scheduler after steps 2, 4, 6
        assert guardian.step(loss_of(model)).applied
        if step % 2 == 0:
            scheduler.step()
    assert guardian.checkpoints.enabled
    guardian.checkpoints.wait()
    guardian.close()  # a crash after step 7: the newest checkpoint is step 5's, after two epochs' ends
    model, scheduler, resumed = build()
    assert resumed.step_count == 5
    assert scheduler.last_epoch == 2
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


def test_a_loop_that_changes_weights_between_steps_without_settle_gets_no_torn_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = settings(checkpoint={"everySteps": 2, "snapshotEverySteps": 2})
    guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=config)
    at_step: dict[int, dict[str, torch.Tensor]] = {}

    def clamp() -> None:  # the loop's own change between steps, without guardian.settle() first
        at_step[guardian.step_count] = clone_state(model)
        with torch.no_grad():
            for param in model.parameters():
                param.clamp_(-0.1, 0.1)

    assert guardian.step(loss_of(model)).applied
    with copies_held() as release:
        assert guardian.step(loss_of(model)).applied  # step 2: snapshot and checkpoint copied later
        clamp()
        release.set()
    for _ in range(4):
        assert guardian.step(loss_of(model)).applied
        clamp()
    guardian.finish()
    warnings = [r.message for r in caplog.records if "without calling guardian.settle()" in r.message]
    assert len(warnings) == 1, warnings
    assert "the checkpoint of step 2 may be lost" in warnings[0]
    store = CheckpointStore(tmp_path)
    kept = [step for step in store.steps() if store.verify(step).valid]
    assert kept == [4, 6]  # step 2's copy ran after the clamp: not written; later copies synchronous
    for step in kept:
        assert_same(store.load(step)["model"], at_step[step])


def test_weights_changed_in_place_after_the_declared_end_need_no_settle(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop of its own (example 05's epochs) that loads the best model to test it after its last step:
    the final checkpoint is the trained model, not the loaded one, without guardian.settle()."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = settings(checkpoint={"everySteps": 2, "snapshotEverySteps": 2})
    guardian = Guardian(model, optimizer, checkpoint_dir=tmp_path, settings=config, max_steps=4)
    for _ in range(3):
        assert guardian.step(loss_of(model)).applied
    with copies_held() as release:
        threading.Timer(0.3, release.set).start()  # the last step's copies wait, as on a busy machine
        assert guardian.step(loss_of(model)).applied
        trained = clone_state(model)
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()  # the loop's own change after the end, without guardian.settle()
    guardian.finish()  # what interpreter exit does for a loop of its own
    assert guardian.phase is Phase.FINISHED
    assert not [r for r in caplog.records if "without calling guardian.settle()" in r.message]
    store = CheckpointStore(tmp_path)
    assert store.newest_valid() == 4
    assert_same(store.load(4)["model"], trained)


def test_a_status_file_that_cannot_be_written_is_a_configuration_error_naming_it(tmp_path: Path) -> None:
    # It used to be a traceback (exit 1) from the constructor.
    in_the_way = tmp_path / "status.json"
    in_the_way.mkdir()
    model = tiny_model()
    with pytest.raises(ConfigError, match="TRAINGUARD_STATUS_FILE") as caught:
        Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), status_file=in_the_way, resume=False)
    assert caught.value.code == ExitCode.CONFIG_ERROR
    assert str(in_the_way) in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]  # no temp file left behind


def test_a_status_file_that_stops_being_writable_is_logged_once_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    status_file = tmp_path / "status.json"
    model = tiny_model()
    config = settings(statusIntervalSeconds=0)
    guardian = Guardian(
        model, torch.optim.SGD(model.parameters(), lr=0.1), status_file=status_file, settings=config
    )
    assert guardian.step(loss_of(model)).applied
    status_file.unlink()
    status_file.mkdir()  # a write now fails, as on a full disk
    for _ in range(3):
        assert guardian.step(loss_of(model)).applied
    assert caplog.text.count("cannot be written") == 1
    status_file.rmdir()
    assert guardian.step(loss_of(model)).applied
    status, _ = read_status(status_file)
    assert status is not None
    assert status.step == 5


# --- the random generators in checkpoints -------------------------------------------------------------


def _prefetching_loop(
    guardian: Guardian, model: torch.nn.Module, steps: int, stop_after_forward_at: int | None = None
) -> dict[int, float]:
    """A loop that draws its batches from the global generator and prefetches the next one right after
    the forward pass (as nanoGPT's does); the loss of each step, by step."""
    losses: dict[int, float] = {}
    x = torch.randn(16, 4)
    while guardian.step_count < steps:
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        x = torch.randn(16, 4)  # the next batch, drawn before this step ends
        step = guardian.step_count
        if step == stop_after_forward_at:
            os.kill(os.getpid(), signal.SIGTERM)  # after this rank's forward pass: it did not foresee it
        losses[step] = guardian.step(loss).loss
    return losses


def test_the_generators_are_read_only_before_a_boundary_that_may_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reading them at every forward pass cost 0.34 ms, about a tenth of a small model's guarded step.
    from trainer_sidecar.tensors.rng import rng_state as real

    reads: list[int] = []

    def counted() -> dict[str, Any]:
        reads.append(guardian.step_count)
        return real()

    monkeypatch.setattr("trainer_sidecar.guardian.checkpointing.rng_state", counted)
    model = tiny_model()
    config = settings(checkpoint={"everySteps": 25, "snapshotEverySteps": 10})
    guardian = Guardian(
        model, torch.optim.SGD(model.parameters(), lr=0.01), checkpoint_dir=tmp_path, settings=config
    )
    _prefetching_loop(guardian, model, 30)
    guardian.checkpoints.wait()
    assert reads == [24]  # the forward pass of the step that checkpoints, and no other
    assert guardian.checkpoints.newest_valid() == 25


def test_a_prefetching_loop_resumes_exactly_after_a_stop_that_came_after_its_forward_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = settings(checkpoint={"everySteps": 4, "snapshotEverySteps": 4})

    def guarded(directory: Path) -> tuple[Guardian, torch.nn.Module]:
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        return Guardian(model, optimizer, checkpoint_dir=directory, settings=config), model

    whole = _prefetching_loop(*guarded(tmp_path / "whole"), 12)
    guardian, model = guarded(tmp_path / "stopped")
    with pytest.raises(SystemExit) as caught:
        _prefetching_loop(guardian, model, 12, stop_after_forward_at=5)
    assert caught.value.code == 128 + signal.SIGTERM
    # The gang stopped one boundary later, having kept the generators at that step's forward pass.
    assert guardian.step_count == 7
    assert CheckpointStore(tmp_path / "stopped").newest_valid() == 7
    monkeypatch.setattr(STOP, "signal", None)
    torch.manual_seed(1234)  # whatever the generators hold now, the resume restores them
    resumed = _prefetching_loop(*guarded(tmp_path / "stopped"), 12)
    assert sorted(resumed) == list(range(7, 12))
    assert [resumed[step] for step in range(7, 12)] == [whole[step] for step in range(7, 12)]


# --- the loop's own clip ------------------------------------------------------------------------------


@pytest.mark.parametrize("loop", ["no clip", "own clip", "own unscale and clip"])
def test_a_gradient_spike_is_skipped_whether_or_not_the_loop_clips_itself(loop: str) -> None:
    # The README lets a loop keep its clip_grad_norm_; the guardian then saw norms of at most the clip
    # value, and a x100 gradient spike was applied instead of skipped.
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if "unscale" in loop else None
    config = settings(guard={"gradNormSpikeFactor": 5, "spikeMinHistory": 3})
    guardian = Guardian(model, optimizer, scaler=scaler, settings=config, resume=False)
    outcomes = []
    for step in range(6):
        loss = loss_of(model)
        spike = 100.0 if step == 4 else 1.0
        guardian.backward(loss + (spike - 1.0) * (loss - loss.detach()))  # same value, x100 gradient
        if scaler is not None:
            scaler.unscale_(optimizer)
        if loop != "no clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)  # below every norm of this run
        outcomes.append(guardian.step())
    assert [o.applied for o in outcomes] == [True, True, True, True, False, True]
    assert outcomes[4].reason == "grad-norm spike"
    assert outcomes[4].grad_norm > 50 * outcomes[3].grad_norm  # the norm before the loop's clip
    assert guardian.spikes == 1
    # Only a loop that changes its gradients pays for a norm at every backward.
    assert guardian._meter.measure_at_backward is (loop != "no clip")


def test_the_guardians_clip_works_from_the_norm_after_the_loops_own_clip() -> None:
    # The loop clips to 0.5, the guardian's maxGradNorm is 1: the update is the loop's, not clipped again.
    reference, guarded = tiny_model(), tiny_model()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    guardian = Guardian(guarded, torch.optim.SGD(guarded.parameters(), lr=0.1), resume=False)
    for model in (reference, guarded):
        loss = loss_of(model, scale=50.0)
        if model is reference:
            torch.autograd.backward(loss)
        else:
            guardian.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    plain.step()
    outcome = guardian.step()
    assert outcome.applied
    assert outcome.grad_norm > 0.5  # reported and judged before the loop's clip
    for a, b in zip(reference.parameters(), guarded.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def stalling_saves(monkeypatch: pytest.MonkeyPatch, stall: float) -> tuple[list[float], list[int]]:
    """A monotonic clock the test moves (its one entry, from 1000 s) and checkpoint saves that each stall
    the training thread ``stall`` seconds on it; returns the clock and the steps saved, in order."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    saved: list[int] = []
    original = CheckpointStore.save_async

    def save(store: CheckpointStore, step: int, *args: Any, **kwargs: Any) -> None:
        saved.append(step)
        clock[0] += stall
        original(store, step, *args, **kwargs)

    monkeypatch.setattr(CheckpointStore, "save_async", save)
    return clock, saved


def test_every_steps_auto_checkpoints_at_the_young_daly_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of 1 s, saves that stall the loop 2 s, an assumed MTBF of an hour: after a first checkpoint
    by time, one every sqrt(2 x 2 x 3600) = 120 steps, and the status says so and why."""
    clock, saved = stalling_saves(monkeypatch, 2.0)
    model = tiny_model()
    config = settings(
        checkpoint={
            "everySteps": "auto",
            "everySeconds": None,
            "autoFirstSeconds": 5,
            "assumedMtbfSeconds": 3600,
            "snapshotEverySteps": 1000,
        }
    )
    guardian = Guardian(
        model, torch.optim.SGD(model.parameters(), lr=0.01), checkpoint_dir=tmp_path, settings=config
    )
    assert guardian.status().checkpoint_every_steps is None
    assert "first checkpoint after 5 s" in guardian.status().checkpoint_cadence
    for _ in range(250):
        clock[0] += 1.0
        guardian.step(loss_of(model))
    guardian.checkpoints.wait()
    assert saved == [5, 125, 245]
    status = guardian.status()
    assert status.checkpoint_every_steps == 120
    assert status.checkpoint_stall_seconds == 2.0
    assert "every 120 steps (save 2 s, MTBF 3600 s assumed, step 1 s" in status.checkpoint_cadence


@pytest.mark.parametrize(("stall", "interval"), [(0.0, 4), (1000.0, 7)])
def test_every_steps_auto_keeps_within_its_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stall: float, interval: int
) -> None:
    """A free save would checkpoint every step and a costly one never: autoMinSteps and autoMaxSteps hold."""
    clock, saved = stalling_saves(monkeypatch, stall)
    model = tiny_model()
    config = settings(
        checkpoint={
            "everySteps": "auto",
            "everySeconds": None,
            "autoFirstSeconds": 3,
            "autoMinSteps": 4,
            "autoMaxSteps": 7,
            "snapshotEverySteps": 1000,
        }
    )
    guardian = Guardian(
        model, torch.optim.SGD(model.parameters(), lr=0.01), checkpoint_dir=tmp_path, settings=config
    )
    for _ in range(20):
        clock[0] += 1.0
        guardian.step(loss_of(model))
    guardian.checkpoints.wait()
    assert saved == list(range(3, 21, interval))
    assert guardian.status().checkpoint_every_steps == interval
    assert f"held at the {'min' if interval == 4 else 'max'}imum" in guardian.status().checkpoint_cadence


@pytest.mark.parametrize(
    ("restarts", "saved_at", "mtbf"),
    [(None, [5, 65, 125], "MTBF 3600 s assumed"), ("3", [5, 35, 65, 95, 125], "MTBF 900 s observed")],
)
def test_every_steps_auto_checkpoints_more_often_after_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restarts: str | None, saved_at: list[int], mtbf: str
) -> None:
    """The runner's failure history (3 restarts, no run time yet) quarters the assumed hour: the interval
    halves, from sqrt(2 x 0.5 x 3600) = 60 steps of 1 s to sqrt(2 x 0.5 x 900) = 30."""
    if restarts is not None:
        monkeypatch.setenv("TRAINGUARD_RESTARTS", restarts)
        monkeypatch.setenv("TRAINGUARD_RUN_SECONDS", "0")
    clock, saved = stalling_saves(monkeypatch, 0.5)
    model = tiny_model()
    config = settings(
        checkpoint={
            "everySteps": "auto",
            "everySeconds": None,
            "autoFirstSeconds": 5,
            "assumedMtbfSeconds": 3600,
            "snapshotEverySteps": 1000,
        }
    )
    guardian = Guardian(
        model, torch.optim.SGD(model.parameters(), lr=0.01), checkpoint_dir=tmp_path, settings=config
    )
    for _ in range(125):
        clock[0] += 1.0
        guardian.step(loss_of(model))
    guardian.checkpoints.wait()
    assert saved == saved_at
    assert mtbf in guardian.status().checkpoint_cadence


# ---------------------------------------------------------------- activity: waiting or own work ---
def test_a_rank_blocked_in_the_steps_collective_has_published_that_it_waits(tmp_path: Path) -> None:
    """The peer never enters the step's all-reduce: this rank blocks there. It marked the collective
    before entering it, and its status file says so while it is blocked (so its sidecar's verdict, and
    the policy, see a rank waiting for a peer, not one stuck in its own work)."""
    status_file = tmp_path / "status.json"
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), status_file=status_file)
    guardian.step(loss_of(model))
    entered, release = threading.Event(), threading.Event()
    marked: list[Activity | None] = []

    @dataclasses.dataclass(frozen=True)
    class PeerNeverComes(Gang):
        def all_reduce(self, values: torch.Tensor, op: Any = None) -> torch.Tensor:
            marked.append(guardian.status().activity)
            entered.set()
            assert release.wait(60)
            return values.to(self.device, copy=True) * self.world_size

    guardian._meter.gang = PeerNeverComes(rank=0, world_size=2, tracker=guardian.gang.tracker)
    loss = loss_of(model)
    before = time.time()
    stepping = threading.Thread(target=guardian.step, args=(loss,))
    stepping.start()
    try:
        assert entered.wait(30)
        deadline = time.monotonic() + 20
        published = read_status(status_file).status
        while (published is None or published.activity is not Activity.COLLECTIVE) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
            published = read_status(status_file).status
    finally:
        release.set()
        stepping.join(60)
    assert marked == [Activity.COLLECTIVE]
    assert published is not None
    assert published.activity is Activity.COLLECTIVE
    assert published.activity_since is not None
    assert before <= published.activity_since <= time.time()
    assert guardian.status().activity is Activity.LOOP  # the step returned to the loop
    guardian.close()


def test_the_activity_is_republished_only_when_it_lasts_a_watch_period(tmp_path: Path) -> None:
    """A stepping rank changes activity several times a step and writes no status for it; one that stays
    in an activity the file does not say yet for a watch period is due a write."""
    published: list[WorkerStatus] = []
    reporter = StatusReporter(tmp_path / "status.json", 0.5, None, lambda: WorkerStatus(started_at=1.0))
    original = reporter._publisher.publish

    def counting(status: WorkerStatus, *, force: bool = False) -> bool:
        published.append(status)
        return original(status, force=force)

    reporter._publisher.publish = counting  # type: ignore[method-assign]
    reporter.publish(Phase.RUNNING, force=True)
    _, since = reporter.tracker.current
    assert not reporter.stale_activity(since + 10, 0.5)  # the file says this very activity
    reporter.tracker.mark(Activity.COLLECTIVE)
    _, since = reporter.tracker.current
    assert not reporter.stale_activity(since + 0.1, 0.5)  # a passing activity: no write
    assert reporter.stale_activity(since + 0.5, 0.5)  # it lasted: due
    reporter.publish(Phase.RUNNING, force=True)
    assert not reporter.stale_activity(since + 5, 0.5)
    assert len(published) == 2


def test_a_quickly_stepping_guardian_writes_its_status_no_more_often_than_the_interval(
    tmp_path: Path,
) -> None:
    status_file = tmp_path / "status.json"
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), status_file=status_file)
    writes: list[float] = []
    original = guardian._reporter._publisher.publish

    def counting(status: WorkerStatus, *, force: bool = False) -> bool:
        wrote = original(status, force=force)
        if wrote:
            writes.append(time.monotonic())
        return wrote

    guardian._reporter._publisher.publish = counting  # type: ignore[method-assign]
    started = time.monotonic()
    for _ in range(200):
        guardian.step(loss_of(model))
    elapsed = time.monotonic() - started
    # Five activity changes a step, none lasting a watch period: the interval alone paces the writes.
    assert len(writes) <= 2 + elapsed / 0.5, (len(writes), elapsed)
    guardian.close()


def test_the_status_says_since_when_a_checkpoint_write_is_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a stop of a broken gang waits for (contract.stopping): set while the background write
    # runs, gone once it is durable.
    model = tiny_model()
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=tmp_path / "ckpt")
    assert guardian.step(loss_of(model)).applied
    store = guardian.checkpoints.store
    assert store is not None
    release = threading.Event()
    write = store._write

    def held(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(30)
        return write(*args, **kwargs)

    monkeypatch.setattr(store, "_write", held)
    before = time.time()
    assert guardian.status().checkpoint_write_since is None
    assert guardian.save_checkpoint()
    since = guardian.status().checkpoint_write_since
    assert since is not None
    assert before <= since <= time.time()
    release.set()
    store.wait()
    status = guardian.status()
    assert status.checkpoint_write_since is None
    assert status.checkpoint_seconds is not None
    guardian.close()
