"""An evaluation the loop did not declare: the guarded model in eval mode between steps counts as a busy
section (``guardian.busy.evaluation_change``, opened by the activity watch), so the learned hang timeout
does not take it for a hang; and the end of a wait for a busy peer restarts the hang clock.

The guardian's statuses are judged by the sidecar's pure health rule on the real clocks, with a learned
timeout's floor of a second, so that a pause of a couple of seconds is past the learned deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.support.health import Sidecar
from trainer_sidecar import Guardian, GuardianSettings
from trainer_sidecar.contract.hang import WARMUP_GAPS
from trainer_sidecar.contract.status import Activity, Phase, WorkerStatus, read_status
from trainer_sidecar.guardian import busy
from trainer_sidecar.guardian.busy import (
    EVAL_MODE_REASON,
    STEP_ACTIVITIES,
    EvalChange,
    PeerBoard,
    evaluation_change,
)
from trainer_sidecar.sidecar.health import Health, HealthPolicy, hang_timeout

FLOOR = 1.0
POLICY = HealthPolicy(
    hang_timeout_seconds=300.0, startup_grace_seconds=600.0, hang_timeout_floor_seconds=FLOOR
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "TRAINGUARD_SETTINGS",
        "TRAINGUARD_FAULTS",
        "TRAINGUARD_CHECKPOINT_DIR",
        "TRAINGUARD_STATUS_FILE",
    ):
        monkeypatch.delenv(name, raising=False)


# --- the pure rule ----------------------------------------------------------------------------------------

progresses = st.tuples(st.integers(0, 3), st.integers(0, 3))


@given(
    st.none() | progresses,
    progresses,
    st.sampled_from(Phase),
    st.sampled_from(Activity),
    st.floats(0, 5),
    st.booleans(),
    st.booleans(),
)
def test_an_evaluation_is_inferred_only_in_the_loops_code_in_eval_mode_and_ends_with_a_step(
    open_at: tuple[int, int] | None,
    progress: tuple[int, int],
    phase: Phase,
    activity: Activity,
    lasted: float,
    eval_mode: bool,
    trains_in_eval_mode: bool,
) -> None:
    change = evaluation_change(
        open_at, progress, phase, activity, lasted, 0.5, eval_mode, trains_in_eval_mode
    )
    if open_at is None:
        begins = (
            eval_mode and not trains_in_eval_mode and phase is Phase.RUNNING and activity is Activity.LOOP
        ) and lasted >= 0.5
        assert change is (EvalChange.BEGIN if begins else EvalChange.NONE)
        return
    stepped = open_at != progress or phase is not Phase.RUNNING or activity in STEP_ACTIVITIES
    if stepped:
        assert change is EvalChange.STEPPED
    else:  # the loop's code or its own busy sections, data, a checkpoint: open while in eval mode
        assert change is (EvalChange.NONE if eval_mode else EvalChange.END)


# --- the guardian, judged by the sidecar's rule -------------------------------------------------------------


def look(sidecar: Sidecar, status: WorkerStatus) -> Health:
    """The sidecar's verdict on ``status`` now (its clocks set to the real ones)."""
    sidecar.monotonic, sidecar.wall = time.monotonic(), time.time()
    return sidecar.read(status)


def published(path: Path) -> WorkerStatus:
    status, reason = read_status(path)
    assert status is not None, reason
    return status


def wait_for(path: Path, wanted: Callable[[WorkerStatus], bool], seconds: float = 20.0) -> WorkerStatus:
    """The first status in the file that is ``wanted`` (the latest one after ``seconds``)."""
    deadline = time.monotonic() + seconds
    status = published(path)
    while not wanted(status) and time.monotonic() < deadline:
        time.sleep(0.05)
        status = published(path)
    return status


def learned_guardian(tmp_path: Path, **kwargs: Any) -> tuple[Guardian, torch.nn.Module, Path, Sidecar]:
    """A guardian whose published pace has taught the sidecar a deadline of about the floor (every step
    published, a few ms apart), with a sidecar that has read its last status."""
    status_file = tmp_path / "status.json"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    settings = GuardianSettings.model_validate({"statusIntervalSeconds": 0})
    guardian = Guardian(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        status_file=status_file,
        settings=settings,
        **kwargs,
    )
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for _ in range(WARMUP_GAPS + 5):
        guardian.step(torch.nn.functional.mse_loss(model(x), y))
        time.sleep(0.005)
    sidecar = Sidecar(policy=POLICY, monotonic=time.monotonic(), wall=time.time())
    status = published(status_file)
    assert status.gaps.learned()
    assert hang_timeout(POLICY, status) < 2 * FLOOR  # learned: far below the 300 s ceiling
    assert look(sidecar, status).alive
    return guardian, model, status_file, sidecar


def sleep_past_the_deadline(status: WorkerStatus) -> None:
    """Sleep until the status's last step is older than its learned deadline, and a little more."""
    assert status.last_step_time is not None
    time.sleep(max(0.0, status.last_step_time + hang_timeout(POLICY, status) + 0.5 - time.time()))


def evaluating(status: WorkerStatus) -> bool:
    return status.phase is Phase.BUSY and [s.reason for s in status.busy_sections] == [EVAL_MODE_REASON]


def test_a_model_in_eval_mode_between_steps_is_an_evaluation_not_a_hang(tmp_path: Path) -> None:
    guardian, model, status_file, sidecar = learned_guardian(tmp_path)
    model.eval()
    status = wait_for(status_file, evaluating)
    assert evaluating(status), status
    assert status.busy_sections[0].seconds is None  # unbounded, as busy("eval"): the startup grace
    assert status.activity is Activity.LOOP  # still the loop's own code: a hang in it is its own work
    sleep_past_the_deadline(status)
    status = published(status_file)
    verdict = look(sidecar, status)
    assert verdict.alive, verdict.reason
    assert EVAL_MODE_REASON in verdict.reason
    # Back in train mode: running again, and the end of the pause restarts the hang clock.
    ended = time.time()
    model.train()
    status = wait_for(status_file, lambda s: s.phase is Phase.RUNNING)
    assert status.phase is Phase.RUNNING
    assert status.last_step_time is not None
    assert status.last_step_time >= ended
    verdict = look(sidecar, status)
    assert verdict.alive, verdict.reason
    # The pause was no step gap: the deadline is what the steps taught.
    assert hang_timeout(POLICY, status) < 2 * FLOOR
    guardian.close()


def test_the_same_pause_in_train_mode_is_still_a_hang(tmp_path: Path) -> None:
    guardian, _, status_file, sidecar = learned_guardian(tmp_path)
    status = published(status_file)
    sleep_past_the_deadline(status)
    status = published(status_file)
    assert status.phase is Phase.RUNNING
    verdict = look(sidecar, status)
    assert not verdict.alive
    assert "no step for" in verdict.reason
    guardian.close()


def test_a_step_ends_the_inferred_evaluation_at_once(tmp_path: Path) -> None:
    guardian, model, status_file, _ = learned_guardian(tmp_path)
    model.eval()
    assert evaluating(wait_for(status_file, evaluating))
    model.train()
    guardian.step(torch.nn.functional.mse_loss(model(torch.randn(16, 4)), torch.randn(16, 1)))
    # The step's own status says running, before the watch has closed the section.
    assert guardian.status().phase is Phase.RUNNING
    assert published(status_file).phase is Phase.RUNNING
    guardian.close()


def test_a_busy_section_inside_the_inferred_evaluation_nests_in_it(tmp_path: Path) -> None:
    guardian, model, status_file, sidecar = learned_guardian(tmp_path)
    model.eval()
    before = wait_for(status_file, evaluating)
    assert evaluating(before)
    with guardian.busy("save", seconds=30):
        inside = published(status_file)
    after = published(status_file)
    assert [(s.reason, s.seconds) for s in inside.busy_sections] == [(EVAL_MODE_REASON, None), ("save", 30)]
    assert evaluating(after)  # the evaluation goes on after the loop's own section
    assert after.last_step_time == before.last_step_time  # still busy: nothing to restart
    sleep_past_the_deadline(after)
    verdict = look(sidecar, published(status_file))
    assert verdict.alive, verdict.reason
    guardian.close()


def stop_the_watch(guardian: Guardian) -> None:
    """Stop the activity watch's thread: the test looks itself, as that thread would."""
    guardian._reporter.stop_watching()
    watch = guardian._reporter._watch
    assert watch is not None
    watch.join(5)


def test_an_evaluation_that_ends_in_the_next_backward_pass_restarts_the_hang_clock(tmp_path: Path) -> None:
    """model.train() and the next backward pass within one look of the watch: the section ends on the
    step's own work, before the step; the status then says running, and must not carry the step time from
    before the evaluation until the step's own status."""
    guardian, model, _, _ = learned_guardian(tmp_path)
    stop_the_watch(guardian)
    model.eval()
    time.sleep(0.6)
    assert guardian._watch.evaluation(0.5) is not None
    assert guardian.status().phase is Phase.BUSY
    ended = time.time()
    model.train()
    guardian._mark(Activity.BACKWARD)
    assert guardian._watch.evaluation(0.5) is not None
    status = guardian.status()
    assert status.phase is Phase.RUNNING
    assert status.last_step_time is not None
    assert status.last_step_time >= ended
    guardian._mark(Activity.LOOP)
    guardian.close()


def test_a_loop_that_trains_in_eval_mode_has_no_inferred_evaluations(tmp_path: Path) -> None:
    """Frozen batch norm and no dropout: a loop may train with the model in eval mode. Once the watch
    sees it in a step's own work in eval mode, eval mode says nothing of an evaluation any more."""
    guardian, model, _, _ = learned_guardian(tmp_path)
    stop_the_watch(guardian)
    model.eval()
    guardian._mark(Activity.BACKWARD)  # as the watch would see a backward pass in eval mode
    assert guardian._watch.evaluation(0.5) is None
    guardian._mark(Activity.LOOP)
    time.sleep(0.6)
    assert guardian._watch.evaluation(0.5) is None
    assert guardian.status().phase is Phase.RUNNING
    guardian.close()


# --- the end of a wait for a busy peer ---------------------------------------------------------------------


class FakeStore:
    """The part of a c10d store the busy board uses, in memory."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return bytes(self.values[key])

    def add(self, key: str, amount: int) -> int:
        self.values[key] = int(self.values.get(key, 0)) + amount
        return int(self.values[key])


def test_the_end_of_a_wait_for_a_busy_peer_restarts_the_hang_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 waits for rank 0's evaluation longer than its learned deadline. When rank 0 is done, rank
    1's peer watch publishes "running" before rank 1 steps again: that status must not carry the step
    time from before the wait, which the sidecar would count as a hang."""
    store = FakeStore()
    monkeypatch.setattr(busy, "default_store", lambda: store)
    monkeypatch.setattr(busy, "WATCH_SECONDS", 0.1)
    guardian, _, status_file, sidecar = learned_guardian(tmp_path)
    guardian._busy.watch_peers(1, guardian._watch.peer_changed)  # as a distributed guardian's start does
    peer = PeerBoard(store, 0)
    peer.announce("eval", None)
    waiting = wait_for(status_file, lambda s: s.phase is Phase.BUSY)
    assert waiting.busy_reason == "waiting for rank 0: eval"
    sleep_past_the_deadline(waiting)
    assert look(sidecar, published(status_file)).alive
    peer.withdraw()
    running = wait_for(status_file, lambda s: s.phase is Phase.RUNNING)
    assert running.phase is Phase.RUNNING
    assert running.step == waiting.step  # the main thread has not stepped: the peer watch published it
    verdict = look(sidecar, running)
    assert verdict.alive, verdict.reason
    guardian.close()


@pytest.mark.parametrize("end", ["close", "crash"])
def test_an_inferred_evaluation_open_when_the_guardian_ends_is_withdrawn_from_the_peers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """The guardian closed (or the interpreter exits over an exception) while the model is in eval mode
    between steps: the evaluation it announced to its peers is withdrawn, else a peer still running
    would read this rank as busy for the rest of the run (and report itself waiting, not hung)."""
    store = FakeStore()
    monkeypatch.setattr(busy, "default_store", lambda: store)
    guardian, model, status_file, _ = learned_guardian(tmp_path)
    guardian._busy.watch_peers(0, guardian._watch.peer_changed)  # as a distributed guardian's start does
    peer = PeerBoard(store, 1)
    model.eval()
    assert evaluating(wait_for(status_file, evaluating))
    seen = peer.busy_peer()
    assert seen is not None
    assert (seen.rank, seen.reason) == (0, EVAL_MODE_REASON)
    if end == "close":
        guardian.close()
    else:
        monkeypatch.setattr("sys.last_value", RuntimeError("the evaluation failed"), raising=False)
        guardian._at_exit(True)
    assert peer.busy_peer() is None
    assert store.add("trainguard/busy-count", 0) == 0
    assert not evaluating(guardian.status())
    time.sleep(1.2)  # two looks of the activity watch, had it gone on: nothing is announced again
    assert peer.busy_peer() is None
