"""The sidecar over real HTTP on 127.0.0.1, its health rules as properties, and its command line."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.support.paths import REPO_ROOT
from trainer_sidecar.sidecar import (
    Health,
    SidecarServer,
    WorkerStatusCollector,
    assess_health,
    main,
)
from trainer_sidecar.status import CheckpointRef, Phase, WorkerStatus, write_status

REPO_ROOT = REPO_ROOT
HANG = 2.0

Serve = Callable[..., SidecarServer]


def worker_status(**fields: Any) -> WorkerStatus:
    """A running worker that stepped just now, with ``fields`` on top."""
    now = time.time()
    values: dict[str, Any] = {
        "phase": Phase.RUNNING,
        "started_at": now - 100.0,
        "updated_at": now,
        "step": 42,
        "last_step_time": now,
        "loss": 1.25,
        "grad_norm": 0.5,
        "steps_total": 42,
        "samples_seen": 1000,
        "samples_dropped": 10,
    }
    values.update(fields)
    return WorkerStatus(**values)


def get(url: str) -> tuple[int, str]:
    """GET ``url``; returns (status code, body) for error statuses too."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read().decode()


def get_json(url: str) -> dict[str, Any]:
    code, body = get(url)
    assert code == 200, body
    document: dict[str, Any] = json.loads(body)
    return document


def scrape(server: SidecarServer) -> dict[str, list[Sample]]:
    """Samples of one /metrics scrape, by sample name."""
    code, body = get(f"{server.url}/metrics")
    assert code == 200, body
    samples: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list[Sample]], name: str) -> float:
    (sample,) = samples[name]
    return float(sample.value)


@pytest.fixture
def status_file(tmp_path: Path) -> Path:
    return tmp_path / "status.json"


@pytest.fixture
def serve(status_file: Path) -> Iterator[Serve]:
    """Start sidecars on 127.0.0.1 (free port) for ``status_file``; all are stopped after the test."""
    servers: list[SidecarServer] = []

    def start(**kwargs: Any) -> SidecarServer:
        options: dict[str, Any] = {"hang_timeout_seconds": HANG, "startup_grace_seconds": 60.0}
        options.update(kwargs)
        server = SidecarServer(status_file, host="127.0.0.1", port=0, **options)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


# --- over HTTP -----------------------------------------------------------------------------------------


def test_healthy_worker_is_alive_and_ready(serve: Serve, status_file: Path) -> None:
    write_status(status_file, worker_status(step=42))
    server = serve()
    assert server.port > 0
    assert get(f"{server.url}/healthz") == (200, "ok\n")
    assert get(f"{server.url}/readyz") == (200, "ok\n")
    document = get_json(f"{server.url}/status")
    assert document["status"]["step"] == 42
    assert document["status"]["phase"] == "running"
    assert document["status"]["drop_rate"] == pytest.approx(0.01)
    assert document["health"]["alive"] is True
    assert document["health"]["ready"] is True
    assert document["sidecar"]["hang_timeout_seconds"] == HANG
    assert document["sidecar"]["startup_grace_seconds"] == 60.0
    assert document["sidecar"]["started_at"] <= time.time()


def test_hung_worker_fails_liveness_with_the_reason(serve: Serve, status_file: Path) -> None:
    write_status(status_file, worker_status(step=7, last_step_time=time.time() - 10 * HANG))
    server = serve()
    code, body = get(f"{server.url}/healthz")
    assert code == 503
    assert "no step for" in body
    assert "hang timeout 2 s" in body
    assert "last step 7" in body
    assert get(f"{server.url}/readyz")[0] == 503
    document = get_json(f"{server.url}/status")
    assert document["health"] == {"alive": False, "ready": False, "reason": body.strip()}


def test_worker_recovers_once_it_steps_again(serve: Serve, status_file: Path) -> None:
    write_status(status_file, worker_status(last_step_time=time.time() - 10 * HANG))
    server = serve()
    assert get(f"{server.url}/healthz")[0] == 503
    write_status(status_file, worker_status(last_step_time=time.time()))
    assert get(f"{server.url}/healthz") == (200, "ok\n")


def test_missing_status_file_during_startup_grace(serve: Serve, status_file: Path) -> None:
    server = serve(startup_grace_seconds=60.0)
    assert get(f"{server.url}/healthz") == (200, "ok\n")
    code, body = get(f"{server.url}/readyz")
    assert code == 503
    assert "waiting for the worker status" in body
    assert "does not exist" in body


def test_missing_status_file_after_startup_grace(serve: Serve, status_file: Path) -> None:
    server = serve(startup_grace_seconds=0.0)
    code, body = get(f"{server.url}/healthz")
    assert code == 503
    assert "does not exist" in body
    document = get_json(f"{server.url}/status")
    assert document["status"] is None
    assert document["health"]["alive"] is False
    assert "does not exist" in document["health"]["reason"]
    assert "does not exist" in document["read_error"]


def _truncated_status() -> bytes:
    text = json.dumps(worker_status().model_dump(mode="json"))
    return text[: len(text) // 2].encode()


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"this is not json", id="garbage"),
        pytest.param(_truncated_status(), id="half-written"),
        pytest.param(b"", id="empty"),
        pytest.param(b"[1, 2, 3]", id="json-array"),
        pytest.param(b'{"phase": "running"}', id="no-started-at"),
        pytest.param(b"\xff\xfe\x00garbage", id="not-utf8"),
    ],
)
def test_unreadable_status_file_never_crashes_the_server(
    serve: Serve, status_file: Path, content: bytes
) -> None:
    status_file.write_bytes(content)
    server = serve(startup_grace_seconds=0.0)
    for _ in range(2):
        code, body = get(f"{server.url}/healthz")
        assert code == 503
        assert str(status_file) in body
        document = get_json(f"{server.url}/status")
        assert document["status"] is None
        assert str(status_file) in document["health"]["reason"]
        assert get(f"{server.url}/metrics")[0] == 200
    # The server is still there, and reads the file afresh once it is good.
    write_status(status_file, worker_status())
    assert get(f"{server.url}/healthz") == (200, "ok\n")


def test_directory_instead_of_status_file_is_a_reason(serve: Serve, status_file: Path) -> None:
    status_file.mkdir()
    server = serve(startup_grace_seconds=0.0)
    code, body = get(f"{server.url}/healthz")
    assert code == 503
    assert "is a directory, not a regular file" in body


@pytest.mark.parametrize("phase", [Phase.DIVERGED, Phase.FAILED])
def test_diverged_or_failed_worker_is_not_alive(serve: Serve, status_file: Path, phase: Phase) -> None:
    write_status(status_file, worker_status(phase=phase, message="too many rollbacks (5 in 2000 steps)"))
    server = serve()
    code, body = get(f"{server.url}/healthz")
    assert code == 503
    assert phase.value in body
    assert "too many rollbacks (5 in 2000 steps)" in body
    assert get(f"{server.url}/readyz")[0] == 503


def test_finished_worker_stays_alive_without_steps(serve: Serve, status_file: Path) -> None:
    write_status(status_file, worker_status(phase=Phase.FINISHED, last_step_time=time.time() - 1000))
    server = serve()
    assert get(f"{server.url}/healthz") == (200, "ok\n")
    assert get(f"{server.url}/readyz") == (200, "ok\n")


def test_restarted_worker_gets_its_startup_grace(serve: Serve, status_file: Path) -> None:
    # A worker restarted in the pod: a fresh started_at, the last step from the run before.
    now = time.time()
    write_status(status_file, worker_status(started_at=now - 1.0, last_step_time=now - 500.0))
    server = serve(startup_grace_seconds=60.0)
    assert get(f"{server.url}/healthz") == (200, "ok\n")
    code, body = get(f"{server.url}/readyz")
    assert code == 503
    assert "starting" in body


def test_unknown_path_is_404(serve: Serve) -> None:
    server = serve()
    assert get(f"{server.url}/nope")[0] == 404
    assert get(f"{server.url}/")[0] == 404
    assert get(f"{server.url}/healthz?verbose=1")[0] == 200  # the query string does not matter


def test_metrics_names_labels_and_values(serve: Serve, status_file: Path) -> None:
    now = time.time()
    write_status(
        status_file,
        worker_status(
            step=1234,
            last_step_time=now - 1.0,
            loss=0.75,
            grad_norm=3.5,
            lr_scale=0.5,
            steps_total=1234,
            skipped_steps=3,
            rollbacks=1,
            spikes=2,
            samples_seen=40000,
            samples_dropped=400,
            last_clean_checkpoint=CheckpointRef(step=1000, path="/ckpt/step-1000", time=now - 60.0),
        ),
    )
    server = serve(job="llm-pretrain", namespace="research")
    samples = scrape(server)

    expected_gauges = {
        "trainguard_worker_step": 1234,
        "trainguard_worker_loss": 0.75,
        "trainguard_worker_grad_norm": 3.5,
        "trainguard_worker_drop_ratio": 0.01,
        "trainguard_worker_lr_scale": 0.5,
        "trainguard_worker_alive": 1,
        "trainguard_worker_ready": 1,
        "trainguard_worker_last_clean_checkpoint_step": 1000,
    }
    for name, expected in expected_gauges.items():
        assert value(samples, name) == pytest.approx(expected), name
    assert value(samples, "trainguard_worker_last_step_timestamp_seconds") == pytest.approx(now - 1.0)
    assert value(samples, "trainguard_worker_last_clean_checkpoint_timestamp_seconds") == pytest.approx(
        now - 60.0
    )
    assert 1.0 <= value(samples, "trainguard_worker_seconds_since_last_step") < 30.0

    expected_counters = {
        "trainguard_worker_steps_total": 1234,
        "trainguard_worker_skipped_steps_total": 3,
        "trainguard_worker_rollbacks_total": 1,
        "trainguard_worker_loss_spikes_total": 2,
        "trainguard_worker_samples_total": 40000,
        "trainguard_worker_dropped_samples_total": 400,
    }
    for name, expected in expected_counters.items():
        assert value(samples, name) == expected, name

    phases = {sample.labels["phase"]: sample.value for sample in samples["trainguard_worker_phase"]}
    assert phases == {phase.value: (1.0 if phase is Phase.RUNNING else 0.0) for phase in Phase}

    for name, group in samples.items():
        assert name.startswith("trainguard_"), name
        for sample in group:
            extra = {"phase"} if name == "trainguard_worker_phase" else set()
            assert set(sample.labels) == {"job", "namespace"} | extra, name
            assert sample.labels["job"] == "llm-pretrain"
            assert sample.labels["namespace"] == "research"


def test_metrics_counter_types_and_help(serve: Serve, status_file: Path) -> None:
    write_status(status_file, worker_status())
    server = serve()
    code, body = get(f"{server.url}/metrics")
    assert code == 200
    types = {family.name: family.type for family in text_string_to_metric_families(body)}
    assert types["trainguard_worker_steps"] == "counter"  # the parser strips _total from the family name
    assert types["trainguard_worker_step"] == "gauge"
    assert "# TYPE trainguard_worker_steps_total counter" in body
    assert 'job="local"' in body
    assert 'namespace="default"' in body


def test_unknown_gauges_are_omitted_not_nan(serve: Serve, status_file: Path) -> None:
    write_status(status_file, worker_status(loss=None, grad_norm=None, last_step_time=None))
    server = serve()
    samples = scrape(server)
    for name in (
        "trainguard_worker_loss",
        "trainguard_worker_grad_norm",
        "trainguard_worker_last_step_timestamp_seconds",
        "trainguard_worker_seconds_since_last_step",
        "trainguard_worker_last_clean_checkpoint_step",
        "trainguard_worker_last_clean_checkpoint_timestamp_seconds",
    ):
        assert name not in samples, name
    assert value(samples, "trainguard_worker_step") == 42
    assert value(samples, "trainguard_worker_ready") == 0  # starting: no step yet


def test_metrics_without_a_status_still_export_health_and_counters(serve: Serve, status_file: Path) -> None:
    server = serve(startup_grace_seconds=0.0)
    samples = scrape(server)
    assert value(samples, "trainguard_worker_alive") == 0
    assert value(samples, "trainguard_worker_ready") == 0
    assert value(samples, "trainguard_worker_steps_total") == 0
    assert "trainguard_worker_step" not in samples
    assert "trainguard_worker_phase" not in samples


def test_counters_stay_monotonic_when_the_worker_resumes_from_an_older_checkpoint(
    serve: Serve, status_file: Path
) -> None:
    server = serve()
    totals: list[float] = []
    # The worker reaches 100 steps, resumes from a checkpoint at 60, then steps on to 90.
    for steps, rollbacks in [(100, 1), (60, 0), (90, 2)]:
        write_status(status_file, worker_status(steps_total=steps, rollbacks=rollbacks))
        samples = scrape(server)
        totals.append(value(samples, "trainguard_worker_steps_total"))
        if steps == 90:
            assert value(samples, "trainguard_worker_rollbacks_total") == 3
    assert totals == [100, 100, 130]
    # An unreadable file in between neither resets nor moves the totals.
    status_file.write_text("{")
    assert value(scrape(server), "trainguard_worker_steps_total") == 130


def test_probes_also_advance_the_counters(status_file: Path) -> None:
    # Counts seen by a probe between scrapes are not lost when the worker goes back before the next scrape.
    collector = WorkerStatusCollector(
        status_file, hang_timeout_seconds=HANG, startup_grace_seconds=60.0, job="j", namespace="n"
    )
    write_status(status_file, worker_status(steps_total=50))
    collector.snapshot()
    write_status(status_file, worker_status(steps_total=80))
    assert collector.snapshot().counters["steps_total"] == 80
    write_status(status_file, worker_status(steps_total=70))
    assert collector.snapshot().counters["steps_total"] == 80
    write_status(status_file, worker_status(steps_total=75))
    assert collector.snapshot().counters["steps_total"] == 85


def test_server_stops_and_releases_its_port(status_file: Path) -> None:
    with SidecarServer(status_file, host="127.0.0.1", port=0) as server:
        url = server.url
        assert get(f"{url}/healthz")[0] == 200
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/healthz", timeout=2)
    server.stop()  # a second stop is harmless


# --- assess_health as properties ------------------------------------------------------------------------

times = st.floats(min_value=1e9, max_value=2e9, allow_nan=False)
durations = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
positive_durations = st.floats(min_value=0.01, max_value=1e6, allow_nan=False)
live_phases = st.sampled_from([Phase.STARTING, Phase.RUNNING, Phase.ROLLING_BACK])
dead_phases = st.sampled_from([Phase.DIVERGED, Phase.FAILED])


@given(
    started=times,
    step_offset=st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    hang=positive_durations,
    grace=durations,
    over=positive_durations,
    sidecar_offset=st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    phase=live_phases,
)
def test_a_step_older_than_the_hang_timeout_past_grace_is_never_alive(
    started: float,
    step_offset: float,
    hang: float,
    grace: float,
    over: float,
    sidecar_offset: float,
    phase: Phase,
) -> None:
    last_step = started + step_offset
    now = max(last_step + hang, started + grace) + over
    status = WorkerStatus(phase=phase, started_at=started, last_step_time=last_step, step=5)
    health = assess_health(now, status, "", started + sidecar_offset, hang, grace)
    assert not health.alive
    assert not health.ready
    assert health.reason


@given(
    now=times,
    started=times,
    last_step=st.none() | times,
    sidecar_started=times,
    hang=positive_durations,
    grace=durations,
    phase=dead_phases,
    message=st.text(max_size=40),
)
def test_a_diverged_or_failed_worker_is_never_alive(
    now: float,
    started: float,
    last_step: float | None,
    sidecar_started: float,
    hang: float,
    grace: float,
    phase: Phase,
    message: str,
) -> None:
    status = WorkerStatus(phase=phase, started_at=started, last_step_time=last_step, message=message)
    health = assess_health(now, status, "", sidecar_started, hang, grace)
    assert not health.alive
    assert phase.value in health.reason
    assert message in health.reason


@given(
    sidecar_started=times,
    grace=st.floats(min_value=0.1, max_value=1e6, allow_nan=False),
    fraction=st.floats(min_value=0.0, max_value=0.99, allow_nan=False),
    hang=positive_durations,
    read_error=st.text(min_size=1, max_size=40),
)
def test_no_status_within_grace_is_alive_and_never_ready(
    sidecar_started: float, grace: float, fraction: float, hang: float, read_error: str
) -> None:
    now = sidecar_started + grace * fraction
    health = assess_health(now, None, read_error, sidecar_started, hang, grace)
    assert health.alive
    assert not health.ready
    assert read_error in health.reason


@given(sidecar_started=times, grace=durations, over=positive_durations, hang=positive_durations)
def test_no_status_after_grace_is_not_alive(
    sidecar_started: float, grace: float, over: float, hang: float
) -> None:
    health = assess_health(sidecar_started + grace + over, None, "gone", sidecar_started, hang, grace)
    assert health == Health(alive=False, ready=False, reason=health.reason)
    assert "gone" in health.reason


@given(
    started=times,
    stepped_after=durations,
    hang=positive_durations,
    fraction=st.floats(min_value=0.0, max_value=0.99, allow_nan=False),
    grace=durations,
    sidecar_started=times,
    phase=live_phases,
)
def test_a_recent_step_is_alive_and_ready(
    started: float,
    stepped_after: float,
    hang: float,
    fraction: float,
    grace: float,
    sidecar_started: float,
    phase: Phase,
) -> None:
    last_step = started + stepped_after
    status = WorkerStatus(phase=phase, started_at=started, last_step_time=last_step)
    health = assess_health(last_step + hang * fraction, status, "", sidecar_started, hang, grace)
    assert health.alive
    assert health.ready


@given(
    started=times,
    elapsed_fraction=st.floats(min_value=0.0, max_value=0.99, allow_nan=False),
    grace=st.floats(min_value=0.1, max_value=1e6, allow_nan=False),
    previous_step=st.none() | st.floats(min_value=1.0, max_value=1e6, allow_nan=False),
    hang=positive_durations,
    phase=live_phases,
)
def test_a_worker_without_a_step_in_this_run_gets_its_grace(
    started: float,
    elapsed_fraction: float,
    grace: float,
    previous_step: float | None,
    hang: float,
    phase: Phase,
) -> None:
    last_step = None if previous_step is None else started - previous_step
    status = WorkerStatus(phase=phase, started_at=started, last_step_time=last_step)
    health = assess_health(started + grace * elapsed_fraction, status, "", 0.0, hang, grace)
    assert health.alive
    assert not health.ready
    assert "starting" in health.reason


@given(now=times, started=times, last_step=st.none() | times, grace=durations, hang=positive_durations)
def test_a_finished_worker_is_alive_and_ready(
    now: float, started: float, last_step: float | None, grace: float, hang: float
) -> None:
    status = WorkerStatus(phase=Phase.FINISHED, started_at=started, last_step_time=last_step)
    assert assess_health(now, status, "", 0.0, hang, grace) == Health(
        alive=True, ready=True, reason="worker finished at step 0"
    )


@given(
    started=times,
    last_step_age=st.floats(min_value=0.0, max_value=10.0, allow_nan=False),  # a step of this run
    hang=positive_durations,
    grace=positive_durations,
    busy_fraction=st.floats(min_value=0.0, max_value=3.0, allow_nan=False),
)
def test_a_rollback_gets_the_startup_grace_not_the_hang_timeout(
    started: float, last_step_age: float, hang: float, grace: float, busy_fraction: float
) -> None:
    busy_since = started + 10.0
    now = busy_since + grace * busy_fraction
    status = WorkerStatus(
        phase=Phase.ROLLING_BACK,
        started_at=started,
        last_step_time=busy_since - last_step_age,
        busy_since=busy_since,
        step=7,
    )
    health = assess_health(now, status, "", 0.0, hang, grace)
    assert not health.ready
    assert health.alive == (now - busy_since < grace)
    assert "step 7" in health.reason
    # Without the marker (an older worker), the hang timeout applies as before.
    legacy = status.model_copy(update={"busy_since": None})
    last_step = busy_since - last_step_age
    assert assess_health(now, legacy, "", 0.0, hang, grace).alive == (now - last_step <= hang)


def test_reasons_name_the_numbers() -> None:
    status = WorkerStatus(started_at=1000.0, last_step_time=2000.0, step=17)
    health = assess_health(2010.5, status, "", 0.0, 5.0, 600.0)
    assert health.reason == "no step for 10.5 s (hang timeout 5 s), last step 17"
    late = WorkerStatus(started_at=1000.0)
    assert "no step within startup grace of 600 s" in assess_health(1700.0, late, "", 0.0, 5.0, 600.0).reason


# --- command line ----------------------------------------------------------------------------------------


def _read_line(stream: Any, timeout: float) -> str:
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"no line on stdout within {timeout} s")


def test_cli_serves_until_sigterm_and_exits_0(status_file: Path) -> None:
    write_status(status_file, worker_status())
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer_sidecar.sidecar",
            "--status-file",
            str(status_file),
            "--port",
            "0",
            "--host",
            "127.0.0.1",
            "--hang-timeout-seconds",
            "30",
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = _read_line(process.stdout, timeout=15.0)
        prefix = "trainguard-sidecar listening on "
        assert line.startswith(prefix), line
        url = line[len(prefix) :].strip()
        assert url.startswith("http://127.0.0.1:")
        assert get(f"{url}/healthz") == (200, "ok\n")
        assert get_json(f"{url}/status")["sidecar"]["hang_timeout_seconds"] == 30.0
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=10)
        assert process.returncode == 0, stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_cli_bad_flag_exits_2_naming_it_in_a_subprocess(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer_sidecar.sidecar",
            "--status-file",
            str(tmp_path / "s"),
            "--port",
            "x",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "--port" in result.stderr
    assert "TRAINGUARD_SIDECAR_PORT" in result.stderr


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        pytest.param(["--port", "abc"], {}, "--port", id="port-not-a-number"),
        pytest.param(["--port", "-1"], {}, "--port", id="port-negative"),
        pytest.param(["--port", "70000"], {}, "--port", id="port-too-large"),
        pytest.param([], {"TRAINGUARD_SIDECAR_PORT": "nine"}, "TRAINGUARD_SIDECAR_PORT", id="port-env"),
        pytest.param(["--hang-timeout-seconds", "0"], {}, "--hang-timeout-seconds", id="hang-zero"),
        pytest.param(["--hang-timeout-seconds", "-5"], {}, "--hang-timeout-seconds", id="hang-negative"),
        pytest.param(["--hang-timeout-seconds", "nan"], {}, "--hang-timeout-seconds", id="hang-nan"),
        pytest.param(
            [], {"TRAINGUARD_HANG_TIMEOUT_SECONDS": "soon"}, "TRAINGUARD_HANG_TIMEOUT_SECONDS", id="hang-env"
        ),
        pytest.param(["--startup-grace-seconds", "-1"], {}, "--startup-grace-seconds", id="grace-negative"),
        pytest.param(["--startup-grace-seconds", "x"], {}, "--startup-grace-seconds", id="grace-nan"),
        pytest.param(["--host", ""], {}, "--host", id="host-empty"),
        pytest.param(["--status-file", ""], {}, "--status-file", id="no-status-file"),
        pytest.param(["--bogus"], {}, "--bogus", id="unknown-flag"),
    ],
)
def test_cli_bad_values_exit_2_naming_the_flag(
    argv: list[str],
    env: dict[str, str],
    named: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for key in list(os.environ):
        if key.startswith("TRAINGUARD_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("TRAINGUARD_STATUS_FILE", str(tmp_path / "status.json"))
    for key, val in env.items():
        monkeypatch.setenv(key, val)
    assert main(argv) == 2
    assert named in capsys.readouterr().err


def test_cli_requires_a_status_file(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TRAINGUARD_STATUS_FILE", raising=False)
    assert main(["--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--status-file" in err
    assert "TRAINGUARD_STATUS_FILE" in err
