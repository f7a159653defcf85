"""The sidecar's collector without its server: a real status file, the sidecar's clocks by hand."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer_sidecar.contract.hang import WARMUP_GAPS, GapLearner
from trainer_sidecar.contract.inplace import LAUNCHER_FILE, LauncherPhase, LauncherState, write_launcher_state
from trainer_sidecar.contract.status import Phase, WorkerStatus, parse_status_document, write_status
from trainer_sidecar.sidecar.server import COUNTER_FIELDS, WorkerStatusCollector, fold_counters

WALL0 = 1_700_000_000.0
HANG = 30.0
GRACE = 120.0


class FakeClocks:
    """A monotonic and a wall clock that move only when told."""

    def __init__(self) -> None:
        self.monotonic = 500.0
        self.wall = WALL0

    def advance(self, seconds: float) -> None:
        self.monotonic += seconds
        self.wall += seconds


def collector(status_file: Path, clocks: FakeClocks) -> WorkerStatusCollector:
    return WorkerStatusCollector(
        status_file,
        hang_timeout_seconds=HANG,
        startup_grace_seconds=GRACE,
        job="j",
        namespace="n",
        monotonic=lambda: clocks.monotonic,
        wall=lambda: clocks.wall,
    )


def worker(**fields: Any) -> WorkerStatus:
    values: dict[str, Any] = {"pid": 3, "phase": Phase.RUNNING, "started_at": WALL0 - 50, "step": 1}
    values.update(fields)
    return WorkerStatus(**values)


def samples(source: WorkerStatusCollector) -> dict[str, float]:
    return {sample.name: sample.value for family in source.collect() for sample in family.samples}


def test_a_frozen_status_is_a_hang_on_the_sidecar_clock_whatever_it_claims(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    clocks = FakeClocks()
    source = collector(path, clocks)
    write_status(path, worker(step=5, steps_total=5, last_step_time=clocks.wall))
    assert source.read().health.alive
    clocks.advance(HANG + 1)
    # The worker rewrites its file with a fresh last_step_time, but its step has not moved.
    write_status(path, worker(step=5, steps_total=5, last_step_time=clocks.wall, updated_at=clocks.wall))
    reading = source.read()
    assert not reading.health.alive
    assert reading.health.reason.startswith("no step for 31.0 s (hang timeout 30 s), last step 5;")
    assert samples(source)["trainguard_worker_seconds_since_last_step"] == HANG + 1
    write_status(path, worker(step=6, steps_total=6, last_step_time=clocks.wall))
    assert source.read().health.alive


def test_seconds_since_last_step_is_omitted_for_an_implausible_claim(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    clocks = FakeClocks()
    source = collector(path, clocks)
    write_status(path, worker(last_step_time=clocks.wall + 3600))
    exported = samples(source)
    assert "trainguard_worker_seconds_since_last_step" not in exported
    assert "trainguard_worker_last_step_timestamp_seconds" not in exported
    assert exported["trainguard_worker_ready"] == 0


def test_probes_also_advance_the_counters(tmp_path: Path) -> None:
    # Counts seen by a probe between scrapes are not lost when the worker goes back before the next scrape.
    path = tmp_path / "status.json"
    source = collector(path, FakeClocks())
    write_status(path, worker(steps_total=50))
    source.read()
    write_status(path, worker(steps_total=80))
    assert source.read().counters["steps_total"] == 80
    write_status(path, worker(steps_total=70))
    assert source.read().counters["steps_total"] == 80
    write_status(path, worker(steps_total=75))
    assert source.read().counters["steps_total"] == 85


@given(
    sequence=st.lists(
        st.fixed_dictionaries({name: st.integers(0, 1000) for name in COUNTER_FIELDS}) | st.none(),
        max_size=20,
    )
)
def test_folded_counters_never_decrease_and_count_every_rise(sequence: list[dict[str, int] | None]) -> None:
    seen = dict.fromkeys(COUNTER_FIELDS, 0)
    totals = dict.fromkeys(COUNTER_FIELDS, 0.0)
    rises = dict.fromkeys(COUNTER_FIELDS, 0)
    for counts in sequence:
        if counts is None:
            continue
        for name, value in counts.items():
            rises[name] += max(0, value - seen[name])
        before = dict(totals)
        seen, totals = fold_counters(seen, totals, worker(**counts))
        assert all(totals[name] >= before[name] for name in COUNTER_FIELDS)
    assert totals == {name: float(rise) for name, rise in rises.items()}


def test_the_status_document_is_the_contract(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    clocks = FakeClocks()
    source = collector(path, clocks)
    empty = source.document(source.read())
    assert empty.status is None
    assert empty.read_error == f"status file {path} does not exist yet"
    assert empty.health.alive
    assert not empty.health.ready
    write_status(path, worker(step=9, samples_seen=10, samples_dropped=1, last_step_time=clocks.wall))
    served = source.document(source.read()).to_document()
    parsed, reason = parse_status_document(served)
    assert reason == ""
    assert parsed is not None
    assert parsed.status is not None
    assert parsed.status.step == 9
    assert served["status"]["drop_rate"] == 0.1  # type: ignore[index]
    assert parsed.sidecar.hang_timeout_seconds == HANG
    assert parsed.time == clocks.wall


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=512), advance=st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_any_file_content_gives_a_reading_and_metrics(tmp_path: Path, data: bytes, advance: float) -> None:
    path = tmp_path / "status.json"
    path.write_bytes(data)
    clocks = FakeClocks()
    source = collector(path, clocks)
    clocks.advance(advance)
    reading = source.read()
    assert (reading.status is None) != (reading.read_error == "")
    assert "trainguard_worker_alive" in samples(source)
    assert parse_status_document(source.document(reading).to_document()).reason == ""


def test_concurrent_reads_see_the_file_in_order(tmp_path: Path) -> None:
    # Reads are serialised: many probes at once over a changing file never raise or deadlock, and the
    # counters end at the last count written.
    path = tmp_path / "status.json"
    source = WorkerStatusCollector(
        path, hang_timeout_seconds=HANG, startup_grace_seconds=GRACE, job="j", namespace="n"
    )
    errors: list[BaseException] = []

    def probe() -> None:
        try:
            for _ in range(50):
                source.read()
        except BaseException as exc:  # pragma: no cover - only on failure
            errors.append(exc)

    threads = [threading.Thread(target=probe) for _ in range(4)]
    for thread in threads:
        thread.start()
    for steps in range(1, 101):
        write_status(path, worker(steps_total=steps, step=steps, last_step_time=time.time()))
    for thread in threads:
        thread.join()
    assert errors == []
    assert source.read().counters["steps_total"] == 100


def test_a_pod_of_several_local_ranks_is_alive_only_while_all_are(tmp_path: Path) -> None:
    clocks = FakeClocks()
    pod = WorkerStatusCollector(
        tmp_path / "status.json", hang_timeout_seconds=HANG, startup_grace_seconds=GRACE, job="j",
        namespace="n", local_ranks=2, monotonic=lambda: clocks.monotonic, wall=lambda: clocks.wall,
    )  # fmt: skip
    files = [tmp_path / "status-0.json", tmp_path / "status-1.json"]
    for step in range(1, 4):  # both local ranks step; then local rank 1 stops stepping
        for local, path in enumerate(files):
            write_status(path, worker(rank=local, world_size=2, pid=10 + local, step=step, steps_total=step,
                                     samples_seen=10 * step, last_step_time=clocks.wall))  # fmt: skip
        reading = pod.read()
        assert reading.health.alive
        clocks.advance(1)
    assert reading.counters["samples_seen"] == 60  # sharded data: summed over the local ranks
    assert reading.counters["steps_total"] == 3  # one collective decision: not summed
    for step in range(4, 4 + int(HANG) + 2):
        write_status(files[0], worker(rank=0, world_size=2, pid=10, step=step, steps_total=step,
                                      last_step_time=clocks.wall))  # fmt: skip
        reading = pod.read()
        clocks.advance(1)
    assert not reading.health.alive
    assert reading.health.reason.startswith("local rank 1: no step for")
    assert reading.status is not None
    assert reading.status.rank == 1  # the failing local rank's status stands for the pod


# --- the pod's status files, found whatever nprocPerNode says -------------------------------------------


def pod(tmp_path: Path, clocks: FakeClocks, local_ranks: int = 1) -> WorkerStatusCollector:
    return WorkerStatusCollector(
        tmp_path / "status.json", hang_timeout_seconds=HANG, startup_grace_seconds=GRACE, job="j",
        namespace="n", local_ranks=local_ranks, monotonic=lambda: clocks.monotonic, wall=lambda: clocks.wall,
    )  # fmt: skip


def local(rank: int, step: int, clocks: FakeClocks, width: int = 2, **fields: Any) -> WorkerStatus:
    """Local rank ``rank`` of a torchrun pod of ``width`` processes (global rank = local rank)."""
    values: dict[str, Any] = {"rank": rank, "world_size": width, "pid": 10 + rank, "step": step}
    values.update(steps_total=step, last_step_time=clocks.wall, local_rank=rank, local_world_size=width)
    values.update(fields)
    return worker(**values)


def test_a_command_that_runs_torchrun_itself_is_judged_by_its_per_rank_files(tmp_path: Path) -> None:
    # nprocPerNode 1 (local_ranks 1): the sidecar was told of status.json, the processes write status-N.
    clocks = FakeClocks()
    source = pod(tmp_path, clocks)
    assert "status.json does not exist yet" in source.read().health.reason
    for step in range(1, int(GRACE + HANG) + 10, 5):  # far beyond the startup grace: stepping all along
        for rank in range(2):
            write_status(tmp_path / f"status-{rank}.json", local(rank, step, clocks, samples_seen=step))
        reading = source.read()
        assert reading.health.alive, reading.health.reason
        assert reading.health.ready, reading.health.reason
        clocks.advance(5)
    assert reading.health.reason.startswith("2 local ranks: running: step")
    assert reading.read_error == ""  # status.json is not expected once the files say 2 local ranks
    assert reading.counters["samples_seen"] == 2 * step  # summed over the two processes
    # Then local rank 1 hangs: the pod is not alive, and says which process.
    for later in range(step + 1, step + int(HANG) + 3):
        write_status(tmp_path / "status-0.json", local(0, later, clocks))
        reading = source.read()
        clocks.advance(1)
    assert not reading.health.alive
    assert reading.health.reason.startswith("local rank 1: no step for")


def test_a_pods_kill_waits_only_while_every_hung_rank_has_a_write_in_flight(tmp_path: Path) -> None:
    clocks = FakeClocks()
    source = pod(tmp_path, clocks, local_ranks=2)
    files = [tmp_path / f"status-{rank}.json" for rank in range(2)]
    for rank, path in enumerate(files):
        write_status(path, local(rank, 5, clocks, checkpoint_seconds=10.0))
    assert source.read().health.alive
    stepped_at = clocks.wall
    clocks.advance(HANG + 1)  # both hang; rank 0's write began a second ago (expected within 20 s)
    writing: dict[str, Any] = {"checkpoint_write_since": clocks.wall - 1, "last_step_time": stepped_at}
    write_status(files[0], local(0, 5, clocks, checkpoint_seconds=10.0, **writing))
    write_status(files[1], local(1, 5, clocks, checkpoint_seconds=10.0, last_step_time=stepped_at))
    health = source.read().health
    assert (health.alive, health.kill_held) == (False, False)  # rank 1 has nothing to finish
    writing = {"checkpoint_write_since": clocks.wall - 2, "last_step_time": stepped_at}
    write_status(files[1], local(1, 5, clocks, checkpoint_seconds=10.0, **writing))
    health = source.read().health
    assert (health.alive, health.kill_held) == (False, True)
    assert "local rank 0:" in health.reason
    assert "local rank 1:" in health.reason


def test_a_missing_expected_rank_file_is_reported_then_fails_the_pod(tmp_path: Path) -> None:
    clocks = FakeClocks()
    source = pod(tmp_path, clocks)
    write_status(tmp_path / "status-0.json", local(0, 1, clocks))
    reading = source.read()
    assert reading.health.alive  # within the startup grace
    assert not reading.health.ready
    assert reading.health.reason.startswith("local rank 1: waiting for the worker status")
    assert f"{tmp_path / 'status-1.json'} does not exist yet" in reading.read_error
    for step in range(2, int(GRACE) + 3):
        write_status(tmp_path / "status-0.json", local(0, step, clocks))
        clocks.advance(1)
        reading = source.read()
    assert not reading.health.alive
    assert reading.health.reason.startswith("local rank 1: no readable worker status after the startup grace")


def test_a_rank_file_that_goes_away_still_counts(tmp_path: Path) -> None:
    clocks = FakeClocks()
    source = pod(tmp_path, clocks)
    for step in (1, 2):  # seen stepping
        for rank in range(2):
            write_status(tmp_path / f"status-{rank}.json", local(rank, step, clocks))
        assert source.read().health.ready
        clocks.advance(1)
    (tmp_path / "status-1.json").unlink()
    (tmp_path / "status-0.json").unlink()  # the claim of two processes goes with it: still expected
    clocks.advance(HANG + 1)
    reading = source.read()
    assert not reading.health.alive
    assert "local rank 0: no readable worker status and no step for" in reading.health.reason
    assert "local rank 1: no readable worker status and no step for" in reading.health.reason


def test_files_named_almost_like_status_files_are_never_judged(tmp_path: Path) -> None:
    clocks = FakeClocks()
    source = pod(tmp_path, clocks)
    hung = local(1, 1, clocks, last_step_time=WALL0 - 10 * GRACE)
    for name in (
        "status-999999.json",
        "status-x.json",
        "status-01.json",
        "status-256.json",
        "status--1.json",
    ):
        write_status(tmp_path / name, hung)
    (tmp_path / "status-7.json").write_bytes(b"\x00garbage{")
    (tmp_path / "status-8.json").write_bytes(b" " * (2 * 1024 * 1024))
    (tmp_path / "status-1.json").mkdir()  # a directory by a status file's name
    write_status(tmp_path / "status.json", worker(step=1, steps_total=1, last_step_time=clocks.wall))
    for step in range(2, int(GRACE + HANG), 10):
        clocks.advance(10)
        write_status(
            tmp_path / "status.json", worker(step=step, steps_total=step, last_step_time=clocks.wall)
        )
        reading = source.read()
        assert reading.health.alive, reading.health.reason
        assert reading.health.ready, reading.health.reason
    assert reading.status is not None
    assert reading.status.pid == 3  # status.json's worker stands for the pod
    for name in ("status-1.json", "status-7.json", "status-8.json"):
        assert f"{tmp_path / name}: ignored, not a status this pod is expected to write" in reading.read_error
    for name in ("999999", "-x.", "-01.", "256", "--1"):
        assert name not in reading.read_error
    assert samples(source)["trainguard_worker_alive"] == 1


def test_an_expected_rank_file_that_is_a_directory_fails_the_pod_after_the_grace(tmp_path: Path) -> None:
    clocks = FakeClocks()
    source = pod(tmp_path, clocks, local_ranks=2)
    (tmp_path / "status-1.json").mkdir()
    for step in range(1, int(GRACE) + 3):
        write_status(tmp_path / "status-0.json", local(0, step, clocks))
        reading = source.read()
        clocks.advance(1)
    assert not reading.health.alive
    assert "local rank 1: no readable worker status after the startup grace" in reading.health.reason
    assert "status-1.json is a directory, not a regular file" in reading.health.reason


def test_a_file_claiming_another_local_rank_than_its_name_is_not_believed(tmp_path: Path) -> None:
    clocks = FakeClocks()
    source = pod(tmp_path, clocks)
    write_status(tmp_path / "status-0.json", local(0, 1, clocks))
    write_status(tmp_path / "status-1.json", local(0, 1, clocks))  # a copy of local rank 0's
    reading = source.read()
    assert not reading.health.ready
    assert "status-1.json claims local rank 0 of 2" in reading.health.reason
    write_status(tmp_path / "status.json", local(1, 1, clocks))  # status.json is a pod of one's
    assert "status.json claims local rank 1 of 2, not a pod of one" in source.read().read_error


def test_a_claim_of_many_local_ranks_names_a_few_and_counts_the_rest(tmp_path: Path) -> None:
    clocks = FakeClocks()
    source = pod(tmp_path, clocks)
    write_status(tmp_path / "status-0.json", local(0, 1, clocks, width=256, world_size=256))
    reading = source.read()
    assert not reading.health.ready
    assert reading.health.reason.endswith("; and 247 more")
    assert len(reading.health.reason) < 4096


def test_a_monotonic_clock_that_goes_backwards_does_not_revive_a_hung_worker(tmp_path: Path) -> None:
    clocks = FakeClocks()
    source = pod(tmp_path, clocks)
    write_status(tmp_path / "status.json", worker(step=5, steps_total=5, last_step_time=clocks.wall))
    assert source.read().health.alive
    clocks.advance(HANG + 1)
    assert not source.read().health.alive
    clocks.monotonic -= 1000  # and the monotonic clock jumps back
    reading = source.read()
    assert not reading.health.alive
    assert reading.health.reason.startswith("no step for 31.0 s (hang timeout 30 s), last step 5;")


def test_a_fast_worker_that_stops_is_hung_at_the_learned_deadline_far_before_the_ceiling(
    tmp_path: Path,
) -> None:
    """A worker publishing every 0.5 s (a 0.1 s step under the default status interval), as the guardian's
    reporter does (its gaps learned on the way), then nothing: not alive once the floor has passed, with
    the ceiling at 300 s; the learned value is in /status and /metrics."""
    path = tmp_path / "status.json"
    clocks = FakeClocks()
    source = WorkerStatusCollector(
        path,
        hang_timeout_seconds=300.0,
        startup_grace_seconds=GRACE,
        job="j",
        namespace="n",
        monotonic=lambda: clocks.monotonic,
        wall=lambda: clocks.wall,
        hang_timeout_floor_seconds=5.0,
    )
    learner = GapLearner()
    step = 0

    def publish() -> None:
        nonlocal learner
        learner = learner.published(("running", step, step), True, clocks.monotonic)
        status = worker(step=step, steps_total=step, last_step_time=clocks.wall)
        status.progress_gaps, status.longest_progress_gap_seconds = learner.gaps.count, learner.gaps.longest
        write_status(path, status)

    for step in range(1, WARMUP_GAPS + 1):  # noqa: B007 - ``publish`` reads it
        publish()
        assert source.read().hang_timeout_seconds == 300.0, "learned before the warm-up"
        clocks.advance(0.5)
    for step in range(WARMUP_GAPS + 1, WARMUP_GAPS + 40):  # noqa: B007
        publish()
        reading = source.read()
        assert reading.health.alive, reading.health.reason
        clocks.advance(0.5)
    step += 1
    publish()  # the last step, then nothing
    assert source.read().hang_timeout_seconds == 5.0  # 4 x 0.5 s is below the floor
    document = source.document(source.read())
    assert document.health.hang_timeout_seconds == 5.0
    assert document.sidecar.hang_timeout_floor_seconds == 5.0
    assert samples(source)["trainguard_worker_hang_timeout_seconds"] == 5.0
    clocks.advance(5.0)
    assert source.read().health.alive  # exactly the deadline: not yet more than it
    clocks.advance(0.5)
    reading = source.read()
    assert not reading.health.alive
    assert reading.health.reason.startswith(
        "no step for 5.5 s (hang timeout 5.0 s, learned from its pace, at most 300 s)"
    )


def test_what_a_worker_publishes_never_loosens_the_ceiling(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    clocks = FakeClocks()
    source = collector(path, clocks)  # no floor: the fixed rule
    loose = {"progress_gaps": 10**6, "longest_progress_gap_seconds": 1e9}
    write_status(path, worker(step=5, steps_total=5, last_step_time=clocks.wall, **loose))
    assert source.read().hang_timeout_seconds == HANG
    clocks.advance(HANG + 1)
    assert not source.read().health.alive
    learning = WorkerStatusCollector(
        path, hang_timeout_seconds=HANG, startup_grace_seconds=GRACE, job="j", namespace="n",
        hang_timeout_floor_seconds=1.0,
    )  # fmt: skip
    assert learning.read().hang_timeout_seconds == HANG


def test_a_pod_under_the_launcher_reports_its_state_and_is_judged_by_it(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    clocks = FakeClocks()
    source = collector(path, clocks)
    # Attempt 1's worker hung: no step for longer than the hang timeout.
    write_status(path, worker(step=5, steps_total=5, last_step_time=clocks.wall))
    source.read()
    clocks.advance(HANG + 1)
    assert not source.read().health.alive
    # Its launcher starts attempt 2 in place; the old status is still there.
    state = LauncherState(attempt=2, phase=LauncherPhase.RUNNING, since=clocks.wall, updated_at=clocks.wall)
    write_launcher_state(tmp_path, state)
    clocks.advance(1)
    reading = source.read()
    assert (reading.health.alive, reading.health.ready) == (True, False)
    document, reason = parse_status_document(source.document(reading).to_document())
    assert document is not None, reason
    assert document.launcher == state
    assert document.launcher_error == ""
    # Attempt 2's worker exits; the launcher waits for an order: not alive, the kubelet's kill held.
    write_launcher_state(tmp_path, state.model_copy(update={"phase": LauncherPhase.EXITED, "exit_code": 139}))
    exited = source.read().health
    assert (exited.alive, exited.kill_held) == (False, True)
    assert "exited with code 139" in exited.reason


def test_a_spoiled_launcher_file_is_reported_and_changes_no_verdict(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    clocks = FakeClocks()
    source = collector(path, clocks)
    write_status(path, worker(step=5, steps_total=5, last_step_time=clocks.wall))
    (tmp_path / LAUNCHER_FILE).write_text('{"attempt": "two"}')
    reading = source.read()
    assert reading.health.alive
    assert reading.launcher is None
    assert "attempt" in reading.launcher_error
