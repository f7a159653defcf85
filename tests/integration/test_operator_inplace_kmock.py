"""A restart in place through the real operator: kopf's test runner against kmock's API emulator, real
sidecar servers that take the operator's orders over HTTP, and the test playing the launchers (their
state files) and the workers (their status files)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import kmock
import pytest
from trainguard_operator.inplace import order_signing_key, order_token
from trainguard_operator.render import SIDECAR_CONTAINER

from tests.support.kube_emulator import Emulator
from tests.support.operator_harness import (
    GTJ_PATH,
    PTJ,
    Samples,
    Sidecars,
    alive,
    configure_operator,
    creations,
    event_reasons,
    events,
    eventually,
    gtj,
    operator,
    post,
    scrape,
    start_pods,
    status,
    value,
)
from trainer_sidecar.contract.env import ATTEMPT_ENV, ORDER_SIGNING_KEY_ENV, ORDER_TOKEN_DIGEST_ENV
from trainer_sidecar.contract.inplace import (
    LAUNCHER_MODULE,
    LauncherPhase,
    LauncherState,
    StopMode,
    order_token_digest,
    read_order,
    write_launcher_state,
)

pytestmark = [pytest.mark.kmock(cls=Emulator), pytest.mark.slow, pytest.mark.asyncio]

KEY = "0123456789abcdef" * 3
#: The digest of the token the operator derives for attempt 1's PyTorchJob of ``gtj()`` (its uid).
DIGEST = order_token_digest(order_token(KEY, "uid-tiny-lm", "tiny-lm-1"))
SIGNING_KEY = order_signing_key(KEY, "uid-tiny-lm", "tiny-lm-1")


def metrics_port() -> int:
    """The port the operator serves its metrics on (``configure_operator`` set it)."""
    return int(os.environ["TRAINGUARD_OPERATOR_METRICS_PORT"])


def restarts_by_way(seen: Samples) -> dict[str, float]:
    """The tiny-lm job's restarts counted, by way."""
    return {
        dict(labels)["way"]: count
        for (name, labels), count in seen.items()
        if name == "trainguard_job_restarts_total" and dict(labels)["job"] == "tiny-lm"
    }


def launcher(sidecars: Sidecars, rank: int, attempt: int, phase: LauncherPhase, **fields: object) -> None:
    """Play rank ``rank``'s launcher: its state file beside the worker's status."""
    now = time.time()
    state = LauncherState(
        attempt=attempt, phase=phase, since=now, updated_at=now, started_at=now - 5, **fields
    )
    write_launcher_state(sidecars.files[rank].parent, state)


@pytest.fixture
def ordered(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Sidecars]:
    """Two ranks' sidecars that take orders (rank 1's with the digest the parameter gives), and the
    operator configured with the key."""
    digests = (DIGEST, getattr(request, "param", DIGEST))
    found = Sidecars(
        tmp_path / "sidecars", 2, order_digests=digests, signing_key=SIGNING_KEY, pytorchjob="tiny-lm-1"
    )
    configure_operator(monkeypatch, found.port, order_key=KEY)
    yield found
    found.stop()


async def crash_rank_one(cluster: kmock.KubernetesEmulator, sidecars: Sidecars) -> None:
    """The job is applied (2 s backoff); attempt 1 runs under launchers and steps; then rank 1's worker
    exits 137."""
    await post(cluster, GTJ_PATH, gtj(recovery={"maxRestarts": 3, "backoffSeconds": [2]}))
    job = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-1"))
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert worker["command"][1:3] == ["-m", LAUNCHER_MODULE]
    init = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["initContainers"]
    sidecar = next(c for c in init if c["name"] == SIDECAR_CONTAINER)
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert (env[ORDER_TOKEN_DIGEST_ENV], env[ORDER_SIGNING_KEY_ENV]) == (DIGEST, SIGNING_KEY)
    for rank in (0, 1):
        launcher(sidecars, rank, 1, LauncherPhase.RUNNING)
        sidecars.write(rank, step=20, started_at=time.time())
    await start_pods(cluster, job, ["127.0.0.1", "127.0.0.2"])
    await eventually(lambda: status(cluster).get("step") == 20, what="attempt 1 stepping")
    launcher(sidecars, 1, 1, LauncherPhase.EXITED, exit_code=137, output_tail="RuntimeError: boom\n")


async def test_a_crash_is_restarted_in_the_same_pods_by_orders_through_the_sidecars(
    cluster: kmock.KubernetesEmulator, ordered: Sidecars
) -> None:
    async with operator():
        await crash_rank_one(cluster, ordered)
        orders = await eventually(
            lambda: (
                all(read_order(f.parent).order for f in ordered.files)
                and [read_order(f.parent).order for f in ordered.files]
            ),
            what="both sidecars to take the order",
        )
        for order in orders:
            assert (order.attempt, order.stop, order.start_delay_seconds) == (2, StopMode.GRACEFUL, 2)
            assert order.environment[ATTEMPT_ENV] == "2"
        st = status(cluster)
        assert (st["attempt"], st["restarts"], st["hostAttempt"], st["inPlaceRestarts"]) == (2, 1, 1, 1)
        crashed = next(e["message"] for e in events(cluster) if e["reason"] == "Crashed")
        assert "killed by signal 9: RuntimeError: boom" in crashed
        # The launchers take it: attempt 2 runs in the same pods, and steps.
        for rank in (0, 1):
            launcher(ordered, rank, 2, LauncherPhase.RUNNING)
            ordered.write(rank, step=21, resumed_step=20, started_at=time.time())
        await eventually(lambda: "Recovered" in event_reasons(cluster), what="the recovery")
        assert creations(cluster, PTJ, "tiny-lm-2") == 0
        assert alive(cluster, PTJ, "tiny-lm-1") is not None
        assert "InPlaceRestartFailed" not in event_reasons(cluster)
        seen = await scrape(metrics_port())
        assert restarts_by_way(seen) == {"in_place": 1}
        assert "trainguard_job_in_place_fallbacks_total" not in {name for name, _ in seen}


@pytest.mark.parametrize("ordered", ["0" * 64], indirect=True)  # rank 1's sidecar knows another token
async def test_an_order_a_sidecar_refuses_falls_back_to_a_new_pytorchjob_at_once(
    cluster: kmock.KubernetesEmulator, ordered: Sidecars
) -> None:
    async with operator():
        await crash_rank_one(cluster, ordered)
        await eventually(lambda: alive(cluster, PTJ, "tiny-lm-2"), what="attempt 2 as a new PyTorchJob")
        failed = next(e["message"] for e in events(cluster) if e["reason"] == "InPlaceRestartFailed")
        assert "tiny-lm-1-worker-1" in failed
        assert "401" in failed
        assert alive(cluster, PTJ, "tiny-lm-1") is None
        st = status(cluster)
        assert (st["attempt"], st["restarts"]) == (2, 1)
        assert "hostAttempt" not in st
        seen = await scrape(metrics_port())
        assert restarts_by_way(seen) == {"in_place": 1}  # the same restart, counted once
        assert value(seen, "trainguard_job_in_place_fallbacks_total") == 1
