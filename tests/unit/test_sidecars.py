"""trainguard.local.sidecars: liveness judged as the kubelet does, restarts backed off as the kubelet does."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from trainguard.core.probes import probe_timing
from trainguard.local import sidecars


def test_the_threshold_is_the_one_rendered_for_the_kubelet() -> None:
    assert sidecars.LIVENESS_FAILURE_THRESHOLD == probe_timing(10)["liveness_failure_threshold"] == 3


def test_liveness_fails_only_at_the_threshold() -> None:
    assert [sidecars.liveness(n) for n in range(5)] == [True, None, None, False, False]


def test_a_worker_that_reported_failed_gets_the_grace_to_exit_with_its_code() -> None:
    threshold = sidecars.LIVENESS_FAILURE_THRESHOLD
    assert sidecars.liveness(threshold, failed_for=2.0, exit_grace=10.0) is None
    assert sidecars.liveness(threshold + 20, failed_for=9.9, exit_grace=10.0) is None
    assert sidecars.liveness(threshold, failed_for=10.0, exit_grace=10.0) is False  # it never exited
    assert sidecars.liveness(threshold - 1, failed_for=30.0, exit_grace=10.0) is None
    assert sidecars.liveness(0, failed_for=2.0, exit_grace=10.0) is True


@given(st.lists(st.sampled_from([0, 200, 204, 301, 404, 500, 503]), max_size=40))
def test_any_run_of_probes_is_judged_by_the_failures_at_its_end(codes: list[int]) -> None:
    failures = 0
    for code in codes:
        failures = 0 if sidecars.probe_passed(code) else failures + 1
    tail = 0
    for code in reversed(codes):
        if sidecars.probe_passed(code):
            break
        tail += 1
    assert failures == tail
    assert sidecars.liveness(failures) is (
        True if tail == 0 else False if tail >= sidecars.LIVENESS_FAILURE_THRESHOLD else None
    )


def test_a_probe_passes_on_200_to_399_only() -> None:
    assert [sidecars.probe_passed(c) for c in (0, 199, 200, 302, 399, 400, 503)] == [
        False,
        False,
        True,
        True,
        True,
        False,
        False,
    ]


def test_restarts_back_off_like_the_kubelet() -> None:
    assert [sidecars.restart_delay(n) for n in range(8)] == [0, 10, 20, 40, 80, 160, 300, 300]
    assert sidecars.restart_delay(10**6) == 300


def test_a_probe_without_a_sidecar_url_is_no_answer() -> None:
    assert sidecars.http_get("/healthz", 1.0) == (0, b"")
