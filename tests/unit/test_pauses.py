"""Pauses the guardian can see (``trainer_sidecar.guardian.pauses``): a long fetch from its loader and a
long step whose thread computes are busy sections, not hangs; a thread that sleeps is still a hang.

The guardian's statuses are judged by the sidecar's pure health rule on the real clocks, after a warm-up
that taught it a deadline of the policy's floor (4 s: above the 2 s after which a pause is announced)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.support.health import Sidecar
from trainer_sidecar import Guardian, GuardianSettings
from trainer_sidecar.contract.hang import WARMUP_GAPS, ProgressGaps, hang_deadline
from trainer_sidecar.contract.status import Activity, Phase, WorkerStatus, read_status
from trainer_sidecar.guardian.pauses import (
    COMPUTE_ACTIVITIES,
    COMPUTING_CPU_SHARE,
    MIN_PAUSE_SECONDS,
    PauseChange,
    PauseKind,
    PauseLook,
    ThreadClock,
    pause_change,
    pause_threshold,
)
from trainer_sidecar.sidecar.health import Health, HealthPolicy, hang_timeout

FLOOR = 4.0
POLICY = HealthPolicy(
    hang_timeout_seconds=300.0, startup_grace_seconds=600.0, hang_timeout_floor_seconds=FLOOR
)
#: How long the pauses below last: past the learned deadline (the floor) by a margin.
PAUSE = FLOOR + 5.0


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

shares = st.none() | st.floats(0, 4)


@given(
    st.none() | st.sampled_from(PauseKind),
    st.booleans(),
    st.sampled_from(Phase),
    st.sampled_from(Activity),
    st.floats(0, 50),
    st.floats(0, 50),
    shares,
    st.floats(MIN_PAUSE_SECONDS, 20),
)
def test_a_pause_begins_only_while_running_past_the_threshold_and_ends_with_what_made_it(
    opened: PauseKind | None,
    moved: bool,
    phase: Phase,
    activity: Activity,
    lasted: float,
    age: float,
    share: float | None,
    threshold: float,
) -> None:
    change = pause_change(opened, moved, PauseLook(phase, activity, lasted, age, share), threshold)
    busy_cpu = share is not None and share >= COMPUTING_CPU_SHARE
    if opened is None:
        if phase is Phase.RUNNING and activity is Activity.DATA and lasted >= threshold:
            assert change is PauseChange.BEGIN_DATA
        elif phase is Phase.RUNNING and activity in COMPUTE_ACTIVITIES and age >= threshold and busy_cpu:
            assert change is PauseChange.BEGIN_COMPUTING
        else:
            assert change is PauseChange.NONE
        return
    if moved or phase is not Phase.RUNNING:
        assert change is PauseChange.STEPPED
    elif opened is PauseKind.DATA:
        assert change is (PauseChange.NONE if activity is Activity.DATA else PauseChange.END)
    else:
        still = activity in COMPUTE_ACTIVITIES and busy_cpu
        assert change is (PauseChange.NONE if still else PauseChange.END)


@given(st.floats(0, 1e4), st.floats(2 * MIN_PAUSE_SECONDS, 1e4), st.floats(1, 1e5))
def test_a_pause_is_announced_well_inside_the_learned_timeout(
    longest: float, floor: float, ceiling: float
) -> None:
    """The learned timeout is at least the floor and GAP_MARGIN x the longest gap; a pause is announced at
    half of that at most (unless the ceiling, the user's own bound, is lower)."""
    deadline = hang_deadline(ceiling, floor, ProgressGaps(WARMUP_GAPS, longest))
    threshold = pause_threshold(longest)
    assert threshold >= MIN_PAUSE_SECONDS
    if deadline < ceiling:
        assert threshold <= deadline / 2


@pytest.mark.parametrize("longest", [math.nan, math.inf, -1.0])
def test_a_longest_gap_that_is_no_duration_announces_at_the_least_threshold(longest: float) -> None:
    assert pause_threshold(longest) == MIN_PAUSE_SECONDS


def test_a_thread_clock_tells_a_computing_thread_from_a_sleeping_one() -> None:
    stop = threading.Event()

    def spin() -> None:
        a = torch.full((32, 32), 0.01)
        while not stop.is_set():
            a = torch.tanh(a @ a + 0.01)

    sleeper = threading.Thread(target=stop.wait)
    spinner = threading.Thread(target=spin)
    sleeper.start()
    spinner.start()
    try:
        assert sleeper.ident is not None
        assert spinner.ident is not None
        clocks = ThreadClock(sleeper.ident), ThreadClock(spinner.ident)
        assert [clock.share() for clock in clocks] == [None, None]  # nothing to compare with yet
        time.sleep(1.0)
        sleeping, spinning = (clock.share() for clock in clocks)
    finally:
        stop.set()
        sleeper.join()
        spinner.join()
    assert sleeping is not None
    assert sleeping < COMPUTING_CPU_SHARE
    # A spinning thread on a loaded 2-core machine still has far more than a tenth of a core.
    assert spinning is not None
    assert spinning >= COMPUTING_CPU_SHARE


# --- the guardian, judged by the sidecar's rule -------------------------------------------------------------


def published(path: Path) -> WorkerStatus:
    status, reason = read_status(path)
    assert status is not None, reason
    return status


def wait_for(path: Path, wanted: Callable[[WorkerStatus], bool], seconds: float = 20.0) -> WorkerStatus:
    """The first status in the file that is ``wanted`` (the latest one after ``seconds``; the file may
    not be written yet when called)."""
    deadline = time.monotonic() + seconds
    status = read_status(path).status
    while (status is None or not wanted(status)) and time.monotonic() < deadline:
        time.sleep(0.05)
        status = read_status(path).status
    return status if status is not None else published(path)


def look(sidecar: Sidecar, status: WorkerStatus) -> Health:
    """The sidecar's verdict on ``status`` now (its clocks set to the real ones)."""
    sidecar.monotonic, sidecar.wall = time.monotonic(), time.time()
    return sidecar.read(status)


class PausingData:
    """A dataset whose fetch number ``pause_at`` takes ``PAUSE`` seconds (blocked, as a loader waiting
    for its worker's ``worker_init_fn``)."""

    def __init__(self, pause_at: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.xs, self.ys = torch.randn(64, 4, generator=generator), torch.randn(64, 1, generator=generator)
        self.fetches, self.pause_at = 0, pause_at

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.fetches += 1
        if self.fetches == self.pause_at:
            time.sleep(PAUSE)
        return self.xs[index], self.ys[index]


def compute_for(seconds: float) -> None:
    ends = time.monotonic() + seconds
    a = torch.full((32, 32), 0.01)
    while time.monotonic() < ends:
        a = torch.tanh(a @ a + 0.01)


def train_in_a_thread(
    tmp_path: Path, dataset: PausingData, forward: Callable[[int], None], steps: int
) -> tuple[Path, threading.Thread, list[BaseException]]:
    """``guardian.run`` over ``dataset`` in a thread of its own (the training thread), every status
    published; ``forward(step)`` runs before each step's loss."""
    status_file = tmp_path / "status.json"
    errors: list[BaseException] = []

    def train() -> None:
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
            settings = GuardianSettings.model_validate({"statusIntervalSeconds": 0})
            guardian = Guardian(
                model,
                torch.optim.SGD(model.parameters(), lr=0.01),
                status_file=status_file,
                settings=settings,
            )
            batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = guardian.run(
                guardian.loader(dataset, batch_size=1), max_steps=steps
            )
            for x, y in batches:
                forward(guardian.step_count)
                guardian.step(torch.nn.functional.mse_loss(model(x), y))
                time.sleep(0.005)
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    thread = threading.Thread(target=train, name="training")
    thread.start()
    return status_file, thread, errors


LEARNED = WARMUP_GAPS + 5  # steps after which the deadline is learned, and the pause comes


def sleep_past_the_deadline(learned: WorkerStatus) -> None:
    """Sleep until the last step of ``learned`` is older than its learned deadline (about the floor: the
    steps are milliseconds apart), and a little more."""
    deadline = hang_timeout(POLICY, learned)
    assert deadline < FLOOR + 1, learned
    assert learned.last_step_time is not None
    time.sleep(max(0.0, learned.last_step_time + deadline + 1.5 - time.time()))


def judged_through_the_pause(status_file: Path, reason: str) -> tuple[WorkerStatus, Health, Health]:
    """The sidecar's view: its verdict once the deadline is learned (before the pause), and once the
    pause has lasted past that deadline, with the status then."""
    sidecar = Sidecar(policy=POLICY, monotonic=time.monotonic(), wall=time.time())
    learned = wait_for(status_file, lambda s: s.step >= LEARNED - 1 and s.gaps.learned())
    before = look(sidecar, learned)
    paused = wait_for(status_file, lambda s: s.step >= LEARNED and s.phase is Phase.BUSY, seconds=PAUSE)
    sleep_past_the_deadline(learned)
    status = published(status_file)
    assert [s.reason for s in status.busy_sections] == [reason], (paused, status)
    return status, before, look(sidecar, status)


def test_a_fetch_longer_than_the_learned_timeout_is_the_loaders_pause_not_a_hang(tmp_path: Path) -> None:
    status_file, thread, errors = train_in_a_thread(
        tmp_path, PausingData(pause_at=LEARNED + 1), lambda step: None, steps=LEARNED + 5
    )
    status, before, during = judged_through_the_pause(status_file, PauseKind.DATA.value)
    assert before.alive, before.reason
    assert during.alive, during.reason
    assert status.activity is Activity.DATA
    thread.join(60)
    assert not errors, errors
    final = published(status_file)
    assert final.step == LEARNED + 5
    # The pause was no step gap: the deadline is still what the steps taught.
    assert hang_timeout(POLICY, final) < FLOOR + 1


def test_a_step_computing_longer_than_the_learned_timeout_is_no_hang(tmp_path: Path) -> None:
    def forward(step: int) -> None:
        if step == LEARNED:
            compute_for(PAUSE)

    status_file, thread, errors = train_in_a_thread(
        tmp_path, PausingData(pause_at=-1), forward, steps=LEARNED + 5
    )
    status, before, during = judged_through_the_pause(status_file, PauseKind.COMPUTING.value)
    assert before.alive, before.reason
    assert during.alive, during.reason
    assert status.activity is Activity.LOOP  # the forward pass: a hang in it is still its own work
    thread.join(60)
    assert not errors, errors
    final = published(status_file)
    assert final.step == LEARNED + 5
    assert hang_timeout(POLICY, final) < FLOOR + 1


def test_a_step_that_sleeps_as_long_is_still_a_hang(tmp_path: Path) -> None:
    def forward(step: int) -> None:
        if step == LEARNED:
            time.sleep(PAUSE)

    status_file, thread, errors = train_in_a_thread(
        tmp_path, PausingData(pause_at=-1), forward, steps=LEARNED + 1
    )
    sidecar = Sidecar(policy=POLICY, monotonic=time.monotonic(), wall=time.time())
    learned = wait_for(status_file, lambda s: s.step >= LEARNED and s.gaps.learned())
    sleep_past_the_deadline(learned)
    status = published(status_file)
    verdict = look(sidecar, status)
    thread.join(60)
    assert not errors, errors
    assert status.phase is Phase.RUNNING, status
    assert status.step == LEARNED, status
    assert not verdict.alive
    assert "no step for" in verdict.reason
