"""The operator fed by watches (issue 22), against kmock's emulator: a job with nothing running makes no
API request at rest; a pod's change wakes its job's reconcile at once rather than at the next probe
period; and after a watch breaks and the API server no longer has its place (410 Gone), the relist
drops what was deleted meanwhile."""

from __future__ import annotations

import time
from typing import Any

import kmock
import pytest

from tests.support.kube_emulator import Emulator
from tests.support.operator_harness import (
    GTJ,
    GTJ_PATH,
    NS,
    POD_PATH,
    PTJ,
    Sidecars,
    alive,
    conditions,
    eventually,
    gtj,
    operator,
    patch,
    post,
    start_pods,
    status,
    terminate,
)

pytestmark = [pytest.mark.kmock(cls=Emulator), pytest.mark.asyncio]

#: A probe period far beyond the tests' waits: whatever happens within them was not the clock's doing.
LONG_PERIOD: dict[str, Any] = {
    "health": {"hangTimeoutSeconds": 600, "startupGraceSeconds": 600, "probePeriodSeconds": 300},
    "recovery": {"maxRestarts": 3, "backoffSeconds": [1]},
}


def api_requests(emulator: kmock.KubernetesEmulator) -> list[str]:
    """Every request the emulator served but the opening of a watch, as ``ACTION path``."""
    return [
        f"{request.action} {request.url.path}"
        for request in emulator
        if request.action != kmock.action.WATCH and "watch" not in request.params
    ]


async def quiet(emulator: kmock.KubernetesEmulator, seconds: float, timeout: float) -> None:
    """Wait for ``seconds`` in which the emulator serves no request (watches aside); fail after ``timeout``
    naming the requests that kept coming."""
    deadline = time.monotonic() + timeout
    while True:
        before = len(api_requests(emulator))
        await _sleep(seconds)
        latest = api_requests(emulator)[before:]
        if not latest:
            return
        assert time.monotonic() < deadline, f"requests kept coming for {timeout:g} s: {latest}"


def ready_message(emulator: kmock.KubernetesEmulator) -> str:
    return str(conditions(emulator).get("Ready", {}).get("message", ""))


async def test_a_job_with_nothing_running_makes_no_api_request_over_several_probe_periods(
    cluster: kmock.KubernetesEmulator, operator_env: int
) -> None:
    async with operator():
        await post(cluster, GTJ_PATH, gtj())  # probePeriodSeconds 1
        await eventually(lambda: alive(cluster, PTJ, "tiny-lm-1"), what="attempt 1's PyTorchJob")
        await eventually(
            lambda: (
                "trainguard.dev/last-handled-configuration"
                in (alive(cluster, GTJ, "tiny-lm") or {})["metadata"].get("annotations", {})
            ),
            what="kopf's record of the creation",
        )
        await eventually(lambda: "0 of 2 pod(s) running" in ready_message(cluster), what="the status")
        # What the creation set off (its status write, a conflict's retry, its event) ends: a second
        # without a request comes within a few (a daemon that looked every period would never give one).
        await quiet(cluster, seconds=1.0, timeout=6.0)
        # Four probe periods at rest: the daemon does not look, so nothing is asked of the API server.
        before = len(api_requests(cluster))
        await _sleep(4.0)
        assert api_requests(cluster)[before:] == []
        # Still watched: a pod of the attempt that starts running is seen at once.
        job = alive(cluster, PTJ, "tiny-lm-1")
        assert job is not None
        await start_pods(cluster, job, ["127.0.0.1", "127.0.0.2"])
        await eventually(
            lambda: "2 of 2 pod(s) running" in ready_message(cluster), timeout=5, what="the pods"
        )


async def two_pods_stepping(cluster: kmock.KubernetesEmulator, sidecars: Sidecars) -> list[Any]:
    """A job with a 300 s probe period whose attempt 1 has two pods started, their sidecars at step 5;
    the pods."""
    await post(cluster, GTJ_PATH, gtj(**LONG_PERIOD))
    job = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-1"), what="attempt 1's PyTorchJob")
    sidecars.write(0, step=5)
    sidecars.write(1, step=5)
    return list(await start_pods(cluster, job, ["127.0.0.1", "127.0.0.2"]))


async def test_a_pod_failure_wakes_the_reconcile_without_waiting_for_the_probe_period(
    cluster: kmock.KubernetesEmulator, sidecars: Sidecars, operator_env: int
) -> None:
    async with operator():
        pods = await two_pods_stepping(cluster, sidecars)
        # The pods' start is a change: the job is Running long before a 300 s probe period.
        await eventually(lambda: status(cluster).get("phase") == "Running", timeout=5, what="Running")
        failed = time.monotonic()
        await terminate(cluster, pods[1], 137)
        await eventually(lambda: status(cluster).get("handledAttempt") == 1, timeout=5, what="the failure")
        seen = time.monotonic() - failed
        st = status(cluster)
        assert (st["lastFailure"]["rank"], st["lastFailure"]["exitCode"]) == (1, 137)
        # The restart's backoff (1 s) is kept by the clock: attempt 2 follows without another change.
        await eventually(lambda: alive(cluster, PTJ, "tiny-lm-2"), timeout=10, what="attempt 2")
        print(f"pod failure recorded in the job's status {seen:.3f} s after the kubelet's write")


async def test_pods_deleted_while_the_watch_was_down_are_gone_after_the_relist(
    cluster: kmock.KubernetesEmulator, sidecars: Sidecars, operator_env: int
) -> None:
    assert isinstance(cluster, Emulator)
    async with operator():
        pods = await two_pods_stepping(cluster, sidecars)
        await eventually(lambda: "2 of 2 pod(s) running" in ready_message(cluster), timeout=5, what="Running")

        # The pods' watch breaks; while it is down both pods go (their kubelet lets them go: finalizer
        # removed), and the API server no longer has the watch's place when it comes back.
        await eventually(lambda: cluster.watches_open("pods") > 0, what="the pods' watch")
        cluster.break_watches("pods")
        await eventually(lambda: cluster.watches_open("pods") == 0, what="the watch to end")
        for pod in pods:
            async with cluster.delete(f"{POD_PATH}/{pod}") as response:
                assert response.status < 300
            await patch(cluster, f"{POD_PATH}/{pod}", {"metadata": {"finalizers": None}})
        assert all(alive(cluster, "v1/pods", pod) is None for pod in pods)
        cluster.resume_watches("pods")

        # The relist is a change: the job looks at once, and sees no pod.
        await eventually(
            lambda: "0 of 2 pod(s) running" in ready_message(cluster), timeout=5, what="the relist"
        )
        assert alive(cluster, PTJ, "tiny-lm-1") is not None
        assert NS == "default"


#: Longer than kopf's default retries of a failed request (1+1+2+3+5+8+13+21 s): with them, its watch of
#: the jobs escalated the error and stopped the operator; with a shorter outage it came back up to 21 s
#: after the API server did.
OUTAGE_SECONDS = 60.0


@pytest.mark.timeout(180)
async def test_after_an_api_server_outage_a_new_job_is_taken_up_within_seconds(
    cluster: kmock.KubernetesEmulator, operator_env: int
) -> None:
    assert isinstance(cluster, Emulator)
    async with operator():
        await post(cluster, GTJ_PATH, gtj(**LONG_PERIOD))
        await eventually(lambda: alive(cluster, PTJ, "tiny-lm-1"), what="attempt 1's PyTorchJob")
        cluster.go_down()
        await _sleep(OUTAGE_SECONDS)
        cluster.come_back()
        back = time.monotonic()
        await post(cluster, GTJ_PATH, gtj("after-outage", **LONG_PERIOD))
        # The operator's retries are capped at a few seconds: the job is seen soon after the server is.
        await eventually(
            lambda: alive(cluster, PTJ, "after-outage-1"), timeout=10, what="the new job's PyTorchJob"
        )
        assert time.monotonic() - back < 10
        # The first job's status write that the outage refused is retried every api_retry_seconds, not
        # necessarily before the new job's PyTorchJob appears; it lands soon after the server is back.
        await eventually(
            lambda: "0 of 2 pod(s) running" in ready_message(cluster),
            timeout=10,
            what="the first job's status written after the outage",
        )


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)
