"""The sidecar's collector without its server: a real status file, the sidecar's clocks by hand."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    assert reading.health.reason == "no step for 31.0 s (hang timeout 30 s), last step 5"
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
