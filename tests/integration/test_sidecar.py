"""The sidecar over real HTTP on 127.0.0.1 (its health rules are unit-tested in
``tests/unit/test_sidecar_health.py``), the attacks on it through its status file, and its command line
in a real process."""

from __future__ import annotations

import http.client
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
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.support.paths import REPO_ROOT
from trainer_sidecar.contract.env import (
    ORDER_SIGNING_KEY_ENV,
    ORDER_TOKEN_DIGEST_ENV,
    POD_NAME_ENV,
    STATUS_FILE_ENV,
)
from trainer_sidecar.contract.inplace import (
    MAX_FILE_BYTES,
    ORDER_CLOCK_SKEW_SECONDS,
    ORDER_LIFETIME_SECONDS,
    LauncherPhase,
    LauncherState,
    RestartOrder,
    SignedOrder,
    StopMode,
    order_token_digest,
    pod_identity,
    read_order,
    sign_order,
    write_launcher_state,
)
from trainer_sidecar.contract.settings import SETTINGS_ENV
from trainer_sidecar.contract.status import (
    CheckpointRef,
    Phase,
    WorkerStatus,
    parse_status_document,
    write_status,
)
from trainer_sidecar.sidecar.server import SettingsError, SidecarServer, load_settings, main

#: Long enough that no test is judged hung by the time it takes on a loaded machine; a hung worker is
#: written with a last step ten hang timeouts old.
HANG = 30.0

Serve = Callable[..., SidecarServer]


def worker_status(**fields: Any) -> WorkerStatus:
    """A running worker that stepped just now, with ``fields`` on top."""
    now = time.time()
    values: dict[str, Any] = {
        "phase": Phase.RUNNING,
        "started_at": now - 100.0 * HANG,
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
    parsed, reason = parse_status_document(json.dumps(document))
    assert reason == ""
    assert parsed is not None
    assert parsed.status is not None
    assert parsed.status.step == 42


def test_hung_worker_fails_liveness_with_the_reason(serve: Serve, status_file: Path) -> None:
    write_status(status_file, worker_status(step=7, last_step_time=time.time() - 10 * HANG))
    server = serve()
    code, body = get(f"{server.url}/healthz")
    assert code == 503
    assert "no step for" in body
    assert "hang timeout 30 s" in body
    assert "last step 7" in body
    assert get(f"{server.url}/readyz")[0] == 503
    health = get_json(f"{server.url}/status")["health"]
    # The same reason, but for its age (".1f" s), which moves on between the two requests under load.
    assert health.pop("reason").split("s (hang timeout")[1] == body.strip().split("s (hang timeout")[1]
    assert health == {
        "alive": False,
        "ready": False,
        "hang_timeout_seconds": HANG,  # nothing learned: the worker published no gaps
        "kill_held": False,
    }


def test_a_hung_workers_checkpoint_write_in_flight_holds_its_kill(serve: Serve, status_file: Path) -> None:
    # Hung, but a write it started 1 s ago is expected to finish (its last took 30 s): the kubelet's kill
    # (a moment's grace) waits; the verdict the operator reads stays "not alive".
    now = time.time()
    write_status(
        status_file,
        worker_status(
            step=7, last_step_time=now - 10 * HANG, checkpoint_write_since=now - 1, checkpoint_seconds=30.0
        ),
    )
    server = serve()
    code, body = get(f"{server.url}/healthz")
    assert code == 200
    assert body.startswith("no step for")
    assert "the kill waits for its checkpoint write in flight for " in body
    assert body.endswith("s (expected within 60 s)\n")
    assert get(f"{server.url}/readyz")[0] == 503
    health = get_json(f"{server.url}/status")["health"]
    assert (health["alive"], health["kill_held"]) == (False, True)
    assert value(scrape(server), "trainguard_worker_alive") == 0.0
    # Once the status shows the write done (a worker that publishes again), the probe fails.
    write_status(status_file, worker_status(step=7, last_step_time=now - 10 * HANG, checkpoint_seconds=30.0))
    assert get(f"{server.url}/healthz")[0] == 503


def test_worker_recovers_once_it_steps_again(serve: Serve, status_file: Path) -> None:
    write_status(status_file, worker_status(last_step_time=time.time() - 10 * HANG))
    server = serve()
    assert get(f"{server.url}/healthz")[0] == 503
    write_status(status_file, worker_status(step=43, steps_total=43, last_step_time=time.time()))
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
            compute_seconds=0.125,
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
        "trainguard_worker_compute_seconds": 0.125,
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


def test_server_stops_and_releases_its_port(status_file: Path) -> None:
    with SidecarServer(status_file, host="127.0.0.1", port=0) as server:
        url = server.url
        assert get(f"{url}/healthz")[0] == 200
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/healthz", timeout=2)
    server.stop()  # a second stop is harmless


# --- attacks through the status file ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"last_step_time": float("nan")}, id="last-step-nan"),
        pytest.param({"last_step_time": 1e308}, id="last-step-1e308"),
        pytest.param({"last_step_time": "an hour ahead"}, id="last-step-an-hour-ahead"),
        pytest.param({"started_at": "an hour ahead", "last_step_time": "now"}, id="started-in-the-future"),
        pytest.param(
            {"phase": "rolling-back", "busy_since": "an hour ahead", "last_step_time": "now"},
            id="busy-since-in-the-future",
        ),
    ],
)
def test_untrusted_timestamps_never_pass_liveness(
    serve: Serve, status_file: Path, fields: dict[str, Any]
) -> None:
    now = time.time()
    named = {"an hour ahead": now + 3600, "now": now}
    document = worker_status().model_dump(mode="json")
    document.update({key: named.get(value, value) for key, value in fields.items()})
    status_file.write_text(json.dumps(document))  # json writes NaN as the model would not
    server = serve(startup_grace_seconds=0.0)
    for _ in range(3):
        code, body = get(f"{server.url}/healthz")
        assert code == 503, body
    assert "finite number" in body or "ahead of the sidecar's clock" in body


def _wait_for_threads(at_most: int) -> int:
    """The thread count once it is at most ``at_most`` (handler threads end after their answer), or after
    10 s, whichever comes first."""
    deadline = time.monotonic() + 10.0
    while threading.active_count() > at_most and time.monotonic() < deadline:
        time.sleep(0.05)
    return threading.active_count()


def test_a_fifo_status_file_neither_hangs_probes_nor_grows_threads(serve: Serve, status_file: Path) -> None:
    os.mkfifo(status_file)
    server = serve(startup_grace_seconds=0.0)
    baseline = _wait_for_threads(threading.active_count())
    for _ in range(20):
        code, body = get(f"{server.url}/healthz")  # urlopen's own 5 s timeout fails a hung probe
        assert code == 503
        assert body.strip().endswith("is a FIFO, not a regular file")
    assert get(f"{server.url}/metrics")[0] == 200
    assert get_json(f"{server.url}/status")["read_error"].endswith("is a FIFO, not a regular file")
    assert _wait_for_threads(baseline) <= baseline


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_dev_zero_as_the_status_file_is_refused_unread(tmp_path: Path) -> None:
    with SidecarServer(Path("/dev/zero"), host="127.0.0.1", port=0, startup_grace_seconds=0) as server:
        code, body = get(f"{server.url}/healthz")
    assert code == 503
    assert "/dev/zero is a character device, not a regular file" in body


@pytest.mark.parametrize("through_a_symlink", [False, True], ids=["file", "symlink"])
def test_a_huge_status_file_is_refused_unread(
    serve: Serve, status_file: Path, tmp_path: Path, through_a_symlink: bool
) -> None:
    huge = tmp_path / "huge" if through_a_symlink else status_file
    with huge.open("wb") as handle:
        handle.truncate(64 * 2**20)  # sparse
    if through_a_symlink:
        status_file.symlink_to(huge)
    server = serve(startup_grace_seconds=0.0)
    code, body = get(f"{server.url}/healthz")
    assert code == 503
    assert f"is {64 * 2**20} bytes, more than the 65536 allowed" in body


def test_a_status_path_that_is_not_utf8_still_gets_its_reason(tmp_path: Path) -> None:
    status_file = tmp_path / os.fsdecode(b"st\xffatus.json")
    with SidecarServer(status_file, host="127.0.0.1", port=0, startup_grace_seconds=0) as server:
        code, body = get(f"{server.url}/healthz")
        assert code == 503
        assert "st\\udcffatus.json does not exist yet" in body
        assert get_json(f"{server.url}/status")["read_error"].endswith("does not exist yet")


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


def test_cli_port_in_use_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TRAINGUARD_SIDECAR_PORT", raising=False)
    with SidecarServer(tmp_path / "s", host="127.0.0.1", port=0) as taken:
        code = main(["--status-file", str(tmp_path / "s"), "--host", "127.0.0.1", "--port", str(taken.port)])
    assert code == 2
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


# --- restart orders (POST /restart) ----------------------------------------------------------------------

TOKEN = "s3cret-token-of-the-job"
SIGNING_KEY = "5e" * 32
POD_NAME = "tiny-lm-1-worker-1"
#: The sidecars of these tests run in the default namespace.
POD = pod_identity("default", POD_NAME)
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    """POST ``body`` to ``url``; (status code, body) for error statuses too."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read().decode()


def an_order(attempt: int = 2, pod: str = POD, at: float | None = None, **fields: Any) -> bytes:
    """A kill order for ``attempt``, signed for ``pod`` at ``at`` (now) as the operator signs it."""
    order = RestartOrder(attempt=attempt, environment={}, stop=StopMode.KILL, **fields)
    return sign_order(SIGNING_KEY, pod, order, time.time() if at is None else at)


def altered(body: bytes, **fields: Any) -> bytes:
    """``body`` with its order's ``fields`` changed, and its signature kept: what a captured order
    replayed with another body is."""
    envelope = SignedOrder.model_validate_json(body)
    claims = json.loads(envelope.claims)
    claims["order"] |= fields
    return SignedOrder(claims=json.dumps(claims), signature=envelope.signature).model_dump_json().encode()


def with_launcher(status_file: Path, attempt: int = 1) -> LauncherState:
    state = LauncherState(
        attempt=attempt, phase=LauncherPhase.RUNNING, since=time.time(), updated_at=time.time()
    )
    write_launcher_state(status_file.parent, state)
    return state


@pytest.fixture
def ordering(serve: Serve, status_file: Path) -> SidecarServer:
    """A sidecar of pod ``POD`` that takes signed orders, beside a launcher that runs attempt 1."""
    with_launcher(status_file)
    return serve(
        order_token_sha256=order_token_digest(TOKEN), order_signing_key=SIGNING_KEY, pod_name=POD_NAME
    )


def test_an_order_with_the_token_and_signed_for_the_pod_is_written_for_the_launcher(
    ordering: SidecarServer, status_file: Path
) -> None:
    code, body = post(f"{ordering.url}/restart", an_order(start_delay_seconds=2.0), BEARER)
    assert (code, body.strip()) == (202, "attempt 2 ordered")
    order, reason = read_order(status_file.parent)
    assert order is not None, reason
    assert (order.attempt, order.stop, order.start_delay_seconds) == (2, StopMode.KILL, 2.0)


UNSIGNED = RestartOrder(attempt=2, environment={}, stop=StopMode.KILL)


@pytest.mark.parametrize(
    ("headers", "body", "expected", "said"),
    [
        ({}, an_order, 401, "token"),
        ({"Authorization": "Bearer not-the-token"}, an_order, 401, "token"),
        ({"Authorization": f"Basic {TOKEN}"}, an_order, 401, "token"),
        (BEARER, lambda: b"{}", 400, "not a signed restart order"),
        (BEARER, lambda: b"\xff" * 10, 400, "not a signed restart order"),
        (BEARER, lambda: UNSIGNED.model_dump_json().encode(), 400, "unsigned"),  # an older operator's
        (BEARER, lambda: sign_order("00" * 32, POD, UNSIGNED, time.time()), 401, "signature"),
        (BEARER, lambda: an_order(attempt=1), 200, "attempt 1 already runs"),
    ],
)
def test_an_order_that_is_not_the_jobs_or_not_an_order_is_refused_and_nothing_written(
    ordering: SidecarServer,
    status_file: Path,
    headers: dict[str, str],
    body: Callable[[], bytes],
    expected: int,
    said: str,
) -> None:
    code, answer = post(f"{ordering.url}/restart", body(), headers)
    assert code == expected
    assert said in answer
    assert read_order(status_file.parent) == (None, "")


def test_a_replayed_order_is_refused_as_is_or_with_another_body(
    ordering: SidecarServer, status_file: Path
) -> None:
    """One order seen on the pod network is good for its own pod, once: sent again it is refused, and with
    another body (a day's start delay, the last attempt there is, looser settings) its signature fails."""
    captured = an_order(attempt=2)
    assert post(f"{ordering.url}/restart", captured, BEARER)[0] == 202
    code, answer = post(f"{ordering.url}/restart", captured, BEARER)
    assert (code, "replay" in answer) == (409, True)
    for fields in (
        {"start_delay_seconds": 86400.0},
        {"attempt": 2**31 - 1},
        {"environment": {SETTINGS_ENV: '{"guard": {"enabled": false}}'}},
    ):
        code, answer = post(f"{ordering.url}/restart", altered(captured, **fields), BEARER)
        assert (code, "signature does not verify" in answer) == (401, True), fields
    order = read_order(status_file.parent).order
    assert order is not None
    assert (order.attempt, order.start_delay_seconds, order.environment) == (2, 0.0, {})


def test_an_expired_order_is_refused(ordering: SidecarServer, status_file: Path) -> None:
    late = time.time() - ORDER_LIFETIME_SECONDS - ORDER_CLOCK_SKEW_SECONDS - 60
    code, answer = post(f"{ordering.url}/restart", an_order(at=late), BEARER)
    assert (code, "expired" in answer) == (403, True)
    early = time.time() + ORDER_CLOCK_SKEW_SECONDS + 60
    code, answer = post(f"{ordering.url}/restart", an_order(at=early), BEARER)
    assert (code, "ahead of this clock" in answer) == (403, True)
    assert read_order(status_file.parent) == (None, "")


def test_an_order_for_another_pod_of_the_job_is_refused(ordering: SidecarServer, status_file: Path) -> None:
    code, answer = post(f"{ordering.url}/restart", an_order(pod="default/tiny-lm-1-worker-0"), BEARER)
    assert (code, "is for pod default/tiny-lm-1-worker-0" in answer) == (403, True)
    assert read_order(status_file.parent) == (None, "")


def test_an_order_sent_again_for_the_attempt_taken_is_answered_taken_and_changes_nothing(
    ordering: SidecarServer, status_file: Path
) -> None:
    """An operator that restarted between its status write and its orders signs them again: the attempt
    already ordered is answered 200 and the order written first stays (its start delay too)."""
    assert post(f"{ordering.url}/restart", an_order(attempt=2, start_delay_seconds=5.0), BEARER)[0] == 202
    code, answer = post(f"{ordering.url}/restart", an_order(attempt=2, start_delay_seconds=1.0), BEARER)
    assert (code, answer.strip()) == (200, "attempt 2 was already ordered in this pod")
    with_launcher(status_file, attempt=2)  # the launcher started it
    code, answer = post(f"{ordering.url}/restart", an_order(attempt=2), BEARER)
    assert (code, answer.strip()) == (200, "attempt 2 already runs in this pod")
    order = read_order(status_file.parent).order
    assert order is not None
    assert order.start_delay_seconds == 5.0


def concurrently(url: str, bodies: list[bytes]) -> list[tuple[int, str]]:
    """POST every body at once, each from a thread of its own released together; the answers in order."""
    answers: list[tuple[int, str]] = [(0, "")] * len(bodies)
    start = threading.Barrier(len(bodies))

    def send(i: int) -> None:
        start.wait()
        answers[i] = post(url, bodies[i], BEARER)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def test_sixteen_orders_at_once_are_each_taken_or_refused_whole_and_one_attempt_wins(
    ordering: SidecarServer, status_file: Path
) -> None:
    """Sixteen competing attempts at once: exactly one is taken, every other refused saying why (none
    lost to a race in the order's own temporary file), and the file holds the one taken, whole. Five
    rounds, the launcher taking each round's order before the next."""
    runs = 1
    for _ in range(5):
        attempts = range(runs + 1, runs + 17)
        answers = concurrently(f"{ordering.url}/restart", [an_order(attempt=a) for a in attempts])
        taken = [a for a, (code, _) in zip(attempts, answers, strict=True) if code == 202]
        assert len(taken) == 1, answers
        refused = [answer for code, answer in answers if code != 202]
        assert {code for code, _ in answers if code != 202} == {409}, answers
        assert all(f"attempt {taken[0]}" in answer for answer in refused), refused
        order, reason = read_order(status_file.parent)
        assert order is not None, reason
        assert order.attempt == taken[0]
        assert [p.name for p in status_file.parent.iterdir() if p.name.endswith(".tmp")] == []
        runs = max(attempts)  # the launcher takes the order; the next round's attempts are newer
        with_launcher(status_file, attempt=runs)


def test_sixteen_orders_at_once_for_one_attempt_write_it_once(
    ordering: SidecarServer, status_file: Path
) -> None:
    answers = concurrently(f"{ordering.url}/restart", [an_order(attempt=3) for _ in range(16)])
    assert sorted(code for code, _ in answers) == [200] * 15 + [202], answers
    order = read_order(status_file.parent).order
    assert order is not None
    assert order.attempt == 3


def test_status_and_metrics_tell_no_token_digest_or_key(ordering: SidecarServer, status_file: Path) -> None:
    assert post(f"{ordering.url}/restart", an_order(), BEARER)[0] == 202
    write_status(status_file, worker_status())
    for path in ("/status", "/metrics", "/healthz", "/readyz"):
        _, body = get(f"{ordering.url}{path}")
        for secret in (TOKEN, order_token_digest(TOKEN), SIGNING_KEY):
            assert secret not in body, path


def test_an_oversized_order_is_refused_before_it_is_read(ordering: SidecarServer, status_file: Path) -> None:
    # Only the headers are sent: the sidecar must answer from the length alone, without waiting for a body.
    connection = http.client.HTTPConnection("127.0.0.1", ordering.port, timeout=5)
    connection.putrequest("POST", "/restart")
    connection.putheader("Authorization", f"Bearer {TOKEN}")
    connection.putheader("Content-Length", str(MAX_FILE_BYTES + 1))
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413
    connection.close()
    assert read_order(status_file.parent) == (None, "")


def test_without_a_launcher_or_a_token_setting_no_order_is_taken(serve: Serve, status_file: Path) -> None:
    ordering = serve(
        order_token_sha256=order_token_digest(TOKEN), order_signing_key=SIGNING_KEY, pod_name=POD_NAME
    )
    code, answer = post(f"{ordering.url}/restart", an_order(), BEARER)
    assert (code, "no launcher" in answer) == (409, True)
    with_launcher(status_file)
    closed = serve()
    code, answer = post(f"{closed.url}/restart", an_order(), BEARER)
    assert (code, "takes no restart orders" in answer) == (404, True)
    assert read_order(status_file.parent) == (None, "")


def test_an_order_token_digest_without_a_signing_key_or_a_pod_name_is_a_settings_error() -> None:
    environ = {STATUS_FILE_ENV: "/tmp/status.json", ORDER_TOKEN_DIGEST_ENV: order_token_digest(TOKEN)}
    with pytest.raises(SettingsError, match="--order-signing-key"):
        load_settings({"pod_name": POD_NAME}, environ)
    with pytest.raises(SettingsError, match="--pod-name"):
        load_settings({"order_signing_key": SIGNING_KEY}, environ)
    # A bad key is not repeated in the error.
    with pytest.raises(SettingsError, match="64 hex digits") as raised:
        load_settings({"order_signing_key": "Z" + SIGNING_KEY[1:], "pod_name": POD_NAME}, environ)
    assert SIGNING_KEY[1:] not in str(raised.value)
    settings = load_settings({}, environ | {ORDER_SIGNING_KEY_ENV: SIGNING_KEY, POD_NAME_ENV: POD_NAME})
    assert (settings.order_signing_key.get_secret_value(), settings.pod_name) == (SIGNING_KEY, POD_NAME)
    assert SIGNING_KEY not in repr(settings)


def test_an_order_token_digest_that_is_not_one_is_a_settings_error_naming_the_flag() -> None:
    with pytest.raises(SettingsError, match="--order-token-sha256"):
        load_settings({"order_token_sha256": TOKEN}, {STATUS_FILE_ENV: "/tmp/status.json"})
