"""The real operator (kopf's test runner, the kubernetes client, real sidecar servers) against kmock's
Kubernetes API emulator, with the test playing the training operator and the kubelet: it creates the
pods of each attempt and writes their states, and the workers' status files behind real sidecars."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from datetime import datetime
from typing import Any

import kmock
import pytest
from trainguard_operator.__main__ import main
from trainguard_operator.metrics import OperatorMetrics
from trainguard_operator.render import (
    ATTEMPT_LABEL,
    SIDECAR_CONTAINER,
)
from trainguard_operator.status import parse_time

from tests.support.kube_emulator import Emulator
from tests.support.kubeflow import pytorchjob_crd
from tests.support.operator_harness import (
    GTJ,
    GTJ_PATH,
    NS,
    PTJ,
    PTJ_PATH,
    Samples,
    Sidecars,
    Workers,
    alive,
    conditions,
    creations,
    env_of,
    event_reasons,
    events,
    eventually,
    graceful_pod_deletions,
    gtj,
    install_crd,
    operator,
    patch,
    post,
    scrape,
    start_pods,
    status,
    terminate,
    value,
)
from tests.support.paths import REPO_ROOT as ROOT
from trainer_sidecar.contract.status import Phase
from trainer_sidecar.contract.stopping import BROKEN_GANG_GRACE_SECONDS

pytestmark = pytest.mark.kmock(cls=Emulator)


# ------------------------------------------------------------------------------------------ tests ---
@pytest.mark.slow
@pytest.mark.asyncio
async def test_render_poll_crash_restart_divergence_remediation_success(
    cluster: kmock.KubernetesEmulator, sidecars: Sidecars, operator_env: int
) -> None:
    async with operator():
        await post(cluster, GTJ_PATH, gtj())
        job1 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-1"), what="attempt 1's PyTorchJob")
        owner = job1["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "GuardedTrainingJob",
            "tiny-lm",
            "uid-tiny-lm",
            True,
        )
        init = job1["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["initContainers"]
        assert [c["name"] for c in init] == [SIDECAR_CONTAINER]
        assert init[0]["image"] == "registry.example/trainguard:test"
        assert job1["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "Never"

        # The kubelet runs the pods; the workers step, and the operator reads them through the sidecars.
        sidecars.write(0, step=50, rollbacks=1, skipped_steps=4, samples_seen=1000, samples_dropped=0)
        sidecars.write(1, step=50, rollbacks=1, skipped_steps=4, samples_seen=1000, samples_dropped=1)
        pods = await start_pods(cluster, job1, ["127.0.0.1", "127.0.0.2"])
        await eventually(
            # Both ranks' sidecars polled: the dropped samples are summed over them.
            lambda: status(cluster).get("phase") == "Running" and status(cluster).get("samplesSeen") == 2000,
            what="both ranks' progress",
        )
        assert status(cluster)["step"] == 50
        assert (status(cluster)["rollbacks"], status(cluster)["skippedSteps"]) == (1, 4)
        assert status(cluster)["dropRate"] == 0.0005
        assert conditions(cluster)["Ready"]["status"] == "True"
        await eventually(lambda: "RollbackSeen" in event_reasons(cluster), what="the rollback event")
        seen = await scrape(operator_env)
        assert value(seen, "trainguard_job_step") == 50
        assert value(seen, "trainguard_job_rollbacks") == 1
        assert value(seen, "trainguard_job_skipped_steps") == 4
        assert value(seen, "trainguard_job_dropped_samples") == 1
        assert value(seen, "trainguard_job_drop_ratio") == 0.0005
        assert value(seen, "trainguard_job_phase", phase="Running") == 1

        # Rank 1 is killed: after the 1 s backoff, attempt 1 is deleted and attempt 2 created.
        failed_at = time.monotonic()
        await terminate(cluster, pods[1], 137)
        job2 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-2"), what="attempt 2's PyTorchJob")
        assert time.monotonic() - failed_at >= 0.9  # the backoff was waited
        assert alive(cluster, PTJ, "tiny-lm-1") is None
        st = status(cluster)
        assert (st["attempt"], st["restarts"], st["handledAttempt"]) == (2, 1, 1)
        assert st["lastFailure"]["reason"] == "Crashed"
        assert (st["lastFailure"]["rank"], st["lastFailure"]["exitCode"]) == (1, 137)
        assert st["phase"] == "Restarting"  # until attempt 2's pods run
        assert conditions(cluster)["Restarting"]["status"] == "True"
        assert conditions(cluster)["Ready"]["status"] == "False"
        assert env_of(job2)["TRAINGUARD_ATTEMPT"] == "2"
        assert "TRAINGUARD_REMEDIATION" not in env_of(job2)
        assert (
            job2["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"][ATTEMPT_LABEL]
            == "2"
        )
        await eventually(
            lambda: {"AttemptCreated", "Crashed", "GangRestart"} <= set(event_reasons(cluster)), what="events"
        )
        warnings = [e for e in events(cluster) if e["reason"] == "GangRestart"]
        assert warnings[0]["type"] == "Warning"
        assert "restart 1 of 3" in warnings[0]["message"]
        seen = await scrape(operator_env)
        assert value(seen, "trainguard_job_restarts_total", way="new_pytorchjob") == 1
        assert value(seen, "trainguard_job_failures_total", kind="Crashed") == 1
        assert value(seen, "trainguard_job_attempt") == 2
        assert value(seen, "trainguard_job_last_restart_timestamp_seconds") > 0

        # Attempt 2 steps again (recovery is timed), then rank 0's guardian reports "diverged": the
        # gang restarts with the divergence remediation.
        sidecars.write(0, step=60, rollbacks=2)
        sidecars.write(1, step=60, rollbacks=2)
        await start_pods(cluster, job2, ["127.0.0.1", "127.0.0.2"])
        await eventually(lambda: "Recovered" in event_reasons(cluster), what="the recovery")
        seen = await scrape(operator_env)
        assert value(seen, "trainguard_job_time_to_recover_seconds_count") == 1
        sidecars.write(0, step=61, rollbacks=5, phase=Phase.DIVERGED, message="5 rollbacks within 2000 steps")
        job3 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-3"), what="attempt 3's PyTorchJob")
        st = status(cluster)
        assert st["lastFailure"]["reason"] == "Diverged"
        assert st["restarts"] == 2
        assert json.loads(env_of(job3)["TRAINGUARD_REMEDIATION"]) == {
            "id": "attempt-3",
            "lrScale": 0.5,
            "maxGradNorm": 0.5,
        }
        assert "Diverged" in event_reasons(cluster)

        # The training operator marks attempt 3 Succeeded: the job is done, and stays done.
        await patch(
            cluster,
            f"{PTJ_PATH}/tiny-lm-3/status",
            {
                "status": {
                    "conditions": [{"type": "Succeeded", "status": "True", "reason": "PyTorchJobSucceeded"}]
                }
            },
        )
        await eventually(lambda: status(cluster).get("phase") == "Succeeded", what="success")
        assert conditions(cluster)["Succeeded"]["status"] == "True"
        await eventually(lambda: "Succeeded" in event_reasons(cluster), what="the success event")
        await asyncio.sleep(1.5)
        assert status(cluster)["phase"] == "Succeeded"
        assert alive(cluster, PTJ, "tiny-lm-3") is not None
        assert creations(cluster, PTJ, "tiny-lm-4") == 0
        seen = await scrape(operator_env)
        assert value(seen, "trainguard_job_phase", phase="Succeeded") == 1
        assert value(seen, "trainguard_job_restarts_total", way="new_pytorchjob") == 2


@pytest.mark.slow
@pytest.mark.asyncio
async def test_operator_restart_mid_recovery_restarts_the_gang_once(
    cluster: kmock.KubernetesEmulator, sidecars: Sidecars, operator_env: int
) -> None:
    # A backoff longer than kopf's shutdown (it lets in-flight handlers finish for up to 5 s), so the
    # handover surely happens while the restart is pending.
    manifest = gtj(recovery={"maxRestarts": 3, "backoffSeconds": [8]})
    async with operator():
        await post(cluster, GTJ_PATH, manifest)
        job1 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-1"))
        pods = await start_pods(cluster, job1, ["127.0.0.1", "127.0.0.2"])
        await terminate(cluster, pods[0], 137)
        await eventually(lambda: status(cluster).get("restarts") == 1, what="the restart decision")
        # Events are posted in the background: let this one out before the operator goes.
        await eventually(lambda: "GangRestart" in event_reasons(cluster), what="the restart event")
    # The operator is gone in the middle of the backoff; a new one takes over from the status alone.
    assert alive(cluster, PTJ, "tiny-lm-2") is None
    async with operator():
        await eventually(lambda: alive(cluster, PTJ, "tiny-lm-2"), what="attempt 2")
        await asyncio.sleep(1.5)
    st = status(cluster)
    assert (st["attempt"], st["restarts"]) == (2, 1)
    assert creations(cluster, PTJ, "tiny-lm-2") == 1
    assert creations(cluster, PTJ, "tiny-lm-3") == 0
    assert alive(cluster, PTJ, "tiny-lm-1") is None
    assert event_reasons(cluster).count("GangRestart") == 1


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_crash_repeated_at_the_same_step_across_an_operator_restart_fails_as_deterministic(
    cluster: kmock.KubernetesEmulator, sidecars: Sidecars, operator_env: int
) -> None:
    # The guardian's final status of a crash: the step it failed at and why (the termination message).
    final = json.dumps(
        {"phase": "failed", "step": 70, "started_at": 1.0, "exit_code": 1,
         "message": "ValueError: mat1 and mat2 shapes cannot be multiplied (at train.py:9)"}
    )  # fmt: skip
    async with operator():
        await post(cluster, GTJ_PATH, gtj(recovery={"maxRestarts": 5, "backoffSeconds": [1]}))
        job1 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-1"), what="attempt 1")
        pods = await start_pods(cluster, job1, ["127.0.0.1", "127.0.0.2"])
        await terminate(cluster, pods[0], 1, final)
        await eventually(lambda: status(cluster).get("restarts") == 1, what="the restart decision")
        await eventually(lambda: "GangRestart" in event_reasons(cluster), what="the restart event")
    # A new operator knows the first failure only from the status.
    assert status(cluster)["lastFailure"]["step"] == 70
    async with operator():
        job2 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-2"), what="attempt 2")
        pods = await start_pods(cluster, job2, ["127.0.0.1", "127.0.0.2"])
        await terminate(cluster, pods[0], 1, final)
        await eventually(lambda: status(cluster).get("phase") == "Failed", what="the verdict")
        await eventually(lambda: "Failed" in event_reasons(cluster), what="the failure event")
        seen = await scrape(operator_env)
        assert value(seen, "trainguard_job_failures_total", kind="DeterministicFailure") == 1
        await asyncio.sleep(1.5)
    st = status(cluster)
    assert (st["attempt"], st["restarts"]) == (2, 1)
    assert conditions(cluster)["Failed"]["reason"] == "DeterministicFailure"
    assert st["lastFailure"]["message"].startswith(
        "deterministic failure: attempts 1 and 2 failed alike at step 70"
    )
    assert creations(cluster, PTJ, "tiny-lm-3") == 0
    assert alive(cluster, PTJ, "tiny-lm-2") is None  # the failed gang is stopped


@pytest.mark.slow
@pytest.mark.asyncio
async def test_missing_crd_invalid_spec_and_refused_change_do_not_stop_the_operator(
    bare_cluster: kmock.KubernetesEmulator, operator_env: int
) -> None:
    cluster = bare_cluster
    invalid = gtj("broken")
    invalid["spec"]["checkpoint"] = {"mountPath": "relative/path"}
    async with operator():
        await post(cluster, GTJ_PATH, gtj())
        await post(cluster, GTJ_PATH, invalid)
        missing = await eventually(lambda: conditions(cluster).get("BackendCRDMissing"), what="CRD condition")
        assert (missing["status"], missing["reason"]) == ("True", "NoBackendCRD")
        assert "kubeflow.org/v1 pytorchjobs" in missing["message"]
        assert "trainer.kubeflow.org/v1alpha1 trainjobs" in missing["message"]
        assert conditions(cluster)["Ready"]["status"] == "False"
        spec_invalid = await eventually(lambda: conditions(cluster, "broken").get("SpecInvalid"))
        assert spec_invalid["status"] == "True"
        assert "spec.checkpoint.claimName" in spec_invalid["message"]
        assert "spec.checkpoint.mountPath" in spec_invalid["message"]
        await eventually(lambda: "SpecInvalid" in event_reasons(cluster, "broken"), what="SpecInvalid event")
        await eventually(lambda: "NoBackendCRD" in event_reasons(cluster), what="CRD event")
        # Retried with a delay, not in a hot loop: ~1 s apart (crdRetrySeconds) for a few seconds.
        before = len(cluster)
        await asyncio.sleep(2.0)
        assert len(cluster) - before < 60

        # The Kubeflow training operator gets installed: the job starts, the broken one still does not.
        await install_crd(cluster, pytorchjob_crd())
        await eventually(lambda: alive(cluster, PTJ, "tiny-lm-1"), what="the PyTorchJob once the CRD exists")
        await eventually(lambda: conditions(cluster)["BackendCRDMissing"]["status"] == "False")
        assert alive(cluster, PTJ, "broken-1") is None
        # kopf has finished the creation (its handler retried while the CRD was missing) before the
        # change: a change made while it still retries is admitted as part of the creation.
        await eventually(
            lambda: (
                "trainguard.dev/last-handled-configuration"
                in (alive(cluster, GTJ, "tiny-lm") or {})["metadata"].get("annotations", {})
            ),
            what="kopf's record of the creation",
        )

        # A change of the checkpoint's place is refused with a condition; changes of recovery and of
        # replicas (from the next gang restart) are accepted.
        await patch(
            cluster,
            f"{GTJ_PATH}/tiny-lm",
            {
                "spec": {
                    "replicas": 4,
                    "checkpoint": {"mountPath": "/elsewhere"},
                    "recovery": {"maxRestarts": 9, "backoffSeconds": [1]},
                }
            },
        )
        refused = await eventually(
            lambda: conditions(cluster).get("SpecChangeRefused", {}).get("status") == "True"
        )
        assert refused
        message = conditions(cluster)["SpecChangeRefused"]["message"]
        assert "spec.checkpoint.mountPath" in message
        assert "recovery" not in message
        assert "spec.replicas" not in message
        await eventually(lambda: "SpecChangeRefused" in event_reasons(cluster), what="refusal event")
        await eventually(lambda: "SpecChangeAccepted" in event_reasons(cluster), what="acceptance event")
        accepted = [e for e in events(cluster) if e["reason"] == "SpecChangeAccepted"]
        assert "spec.recovery.maxRestarts" in accepted[0]["message"]
        assert "spec.replicas" in accepted[0]["message"]
        assert "spec.checkpoint" not in accepted[0]["message"]


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("sidecars", [2.0], indirect=True)  # the sidecars' hang timeout: 2 s
async def test_a_hang_on_one_rank_restarts_the_gang_once_after_the_backoff_and_is_measured(
    cluster: kmock.KubernetesEmulator, sidecars: Sidecars, operator_env: int
) -> None:
    async with operator():
        await post(cluster, GTJ_PATH, gtj(recovery={"maxRestarts": 3, "backoffSeconds": [2]}))
        job1 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-1"), what="attempt 1")
        async with Workers(sidecars) as workers:
            pods = await start_pods(cluster, job1, ["127.0.0.1", "127.0.0.2"])
            await eventually(
                lambda: status(cluster).get("phase") == "Running" and status(cluster).get("step", 0) >= 5,
                what="attempt 1 training",
            )
            assert sidecars.healthz(1) == 200
            # Rank 1 stops stepping: 2 s later its sidecar says it is not alive, in /status for the
            # operator and on /healthz for the kubelet's liveness probe.
            workers.hang(1)
            await eventually(lambda: status(cluster).get("restarts") == 1, what="the restart decision")
            assert sidecars.healthz(1) == 503
            # A hung gang cannot checkpoint on SIGTERM, and no write was in flight (no checkpoint yet):
            # its pods get a second to flush their output, not their grace.
            floor = str(math.ceil(BROKEN_GANG_GRACE_SECONDS))
            await eventually(
                lambda: sorted(graceful_pod_deletions(cluster)) == [(pods[0], floor), (pods[1], floor)],
                what="the hung gang's pods stopped with a short grace",
            )
            # The kubelet's liveness probe fails too, and it kills the container (restartPolicy Never:
            # exit 137, the pod fails). The failure is already being handled: no second restart.
            await terminate(cluster, pods[1], 137)
            job2 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-2"), what="attempt 2")
            # The 2 s backoff was waited, by the operator's own clock (the test sees its decisions late).
            # The status records the new attempt's start in the patch after its PyTorchJob's creation.
            await eventually(lambda: status(cluster).get("attemptCreated") == 2, what="attempt 2 recorded")
            st = status(cluster)
            started, failed = parse_time(st["attemptStartedAt"]), parse_time(st["recoveringSince"])
            assert started is not None, st
            assert failed is not None, st
            assert (started - failed).total_seconds() >= 2.0, st
        st = status(cluster)
        assert (st["attempt"], st["restarts"], st["handledAttempt"]) == (2, 1, 1)
        failure = st["lastFailure"]
        assert (failure["reason"], failure["rank"]) == ("Hung", 1)
        assert re.search(r"rank 1 hung at step \d+: no step for", failure["message"])
        assert "hang timeout 2 s" in failure["message"]
        assert alive(cluster, PTJ, "tiny-lm-1") is None
        await eventually(
            lambda: {"Hung", "GangRestart"} <= set(event_reasons(cluster)), what="the hang's events"
        )
        hung = next(e for e in events(cluster) if e["reason"] == "Hung")
        assert hung["type"] == "Warning"
        assert "rank 1 hung" in hung["message"]

        # Attempt 2 starts from scratch (no checkpoint yet): attempt 1's work is lost to goodput.
        async with Workers(sidecars, resumed=0):
            await start_pods(cluster, job2, ["127.0.0.1", "127.0.0.2"])
            await eventually(lambda: "Recovered" in event_reasons(cluster), what="the recovery")
            await asyncio.sleep(1.5)  # attempt 2 keeps training; nothing else happens
            st = status(cluster)
            assert (st["attempt"], st["restarts"], st["phase"]) == (2, 1, "Running")
            assert creations(cluster, PTJ, "tiny-lm-2") == 1
            assert creations(cluster, PTJ, "tiny-lm-3") == 0
            assert event_reasons(cluster).count("GangRestart") == 1

            # The metrics over HTTP: one restart for a hang, one recovery timed (failure to the first
            # step of attempt 2: at least the backoff), the phase, and the goodput of the status.
            async def metrics_match_status() -> tuple[Samples, dict[str, Any]]:
                seen = await scrape(operator_env)
                return seen, status(cluster)

            seen, st = await metrics_match_status()

            def pace_matches(seen: Samples, st: dict[str, Any]) -> bool:
                return all(
                    (name, labels) in seen and seen[name, labels] == st.get(key)
                    for name, key in (
                        ("trainguard_job_goodput_ratio", "goodput"),
                        ("trainguard_job_steps_per_second", "stepsPerSecond"),
                        ("trainguard_job_lost_seconds", "lostSeconds"),
                    )
                    for labels in [(("job", "tiny-lm"), ("namespace", NS))]
                )

            for _ in range(40):
                if pace_matches(seen, st):
                    break
                await asyncio.sleep(0.05)
                seen, st = await metrics_match_status()
            assert value(seen, "trainguard_job_restarts_total", way="new_pytorchjob") == 1
            assert value(seen, "trainguard_job_failures_total", kind="Hung") == 1
            assert value(seen, "trainguard_job_time_to_recover_seconds_count") == 1
            assert value(seen, "trainguard_job_time_to_recover_seconds_sum") >= 2
            assert value(seen, "trainguard_job_phase", phase="Running") == 1
            assert value(seen, "trainguard_job_phase", phase="Restarting") == 0
            goodput = value(seen, "trainguard_job_goodput_ratio")
            assert goodput == st["goodput"]
            # The pace, as the status gives it: the workers step every 0.1 s; at least the backoff is
            # lost; no end declared, so no ETA.
            assert pace_matches(seen, st), st
            assert 2 <= st["stepsPerSecond"] <= 12, st
            assert st["lostSeconds"] >= 2, st
            assert "etaSeconds" not in st
            # Only attempt 2's time is kept: at most its share of the wall time since attempt 1 started.
            history = st["stepHistory"]
            assert [(r["attempt"], r["resumedStep"]) for r in history] == [(1, 0), (2, 0)]
            started, second = (datetime.fromisoformat(st[k]) for k in ("jobStartedAt", "attemptStartedAt"))
            seen_at = datetime.fromisoformat(history[-1]["lastStepAt"])
            assert 0 < goodput <= (seen_at - second) / (seen_at - started) + 0.01


@pytest.mark.slow
@pytest.mark.asyncio
async def test_repeated_divergence_applies_remediation_each_time_and_fails_at_the_limit(
    cluster: kmock.KubernetesEmulator, sidecars: Sidecars, operator_env: int
) -> None:
    async with operator():
        await post(cluster, GTJ_PATH, gtj(recovery={"maxRestarts": 2, "backoffSeconds": [1]}))
        job1 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-1"), what="attempt 1")
        sidecars.write(0, step=40)
        sidecars.write(1, step=40)
        await start_pods(cluster, job1, ["127.0.0.1", "127.0.0.2"])
        await eventually(lambda: status(cluster).get("step") == 40, what="attempt 1 training")
        # Attempt 1: rank 0's guardian runs out of rollbacks and says so in its status.
        sidecars.write(0, step=41, phase=Phase.DIVERGED, message="5 rollbacks within 2000 steps")
        job2 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-2"), what="attempt 2")
        st = status(cluster)
        assert (st["restarts"], st["lastFailure"]["reason"], st["lastFailure"]["rank"]) == (1, "Diverged", 0)
        order2 = json.loads(env_of(job2)["TRAINGUARD_REMEDIATION"])
        assert order2 == {"id": "attempt-2", "lrScale": 0.5, "maxGradNorm": 0.5}

        # Attempt 2: rank 1's guardian exits with the diverged exit code.
        sidecars.write(0, step=30, resumed_step=20)
        sidecars.write(1, step=30, resumed_step=20)
        pods2 = await start_pods(cluster, job2, ["127.0.0.1", "127.0.0.2"])
        await eventually(lambda: status(cluster).get("phase") == "Running", what="attempt 2 running")
        await terminate(cluster, pods2[1], 200)
        job3 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-3"), what="attempt 3")
        st = status(cluster)
        assert (st["restarts"], st["lastFailure"]["reason"]) == (2, "Diverged")
        assert (st["lastFailure"]["rank"], st["lastFailure"]["exitCode"]) == (1, 200)
        # A new order with its own id: a guardian that applied attempt-2's applies this one on top.
        order3 = json.loads(env_of(job3)["TRAINGUARD_REMEDIATION"])
        assert order3 == {"id": "attempt-3", "lrScale": 0.5, "maxGradNorm": 0.5}

        # Attempt 3 diverges too: the two restarts allowed are used up, the job fails for good.
        sidecars.write(0, step=25, resumed_step=20)
        sidecars.write(1, step=25, resumed_step=20)
        await start_pods(cluster, job3, ["127.0.0.1", "127.0.0.2"])
        await eventually(
            lambda: status(cluster).get("phase") == "Running" and status(cluster)["attempt"] == 3,
            what="attempt 3 running",
        )
        sidecars.write(1, step=26, phase=Phase.DIVERGED, message="loss explosion pattern persists")
        await eventually(lambda: status(cluster).get("phase") == "Failed", what="the give-up")
        failed = conditions(cluster)["Failed"]
        assert (failed["status"], failed["reason"]) == ("True", "RestartsExhausted")
        assert "restarts exhausted (2 of 2)" in failed["message"]
        assert re.search(r"rank 1 diverged at step \d+: loss explosion pattern persists", failed["message"])
        assert conditions(cluster)["Ready"]["status"] == "False"
        await eventually(lambda: "Failed" in event_reasons(cluster), what="the give-up event")
        gave_up = next(e for e in events(cluster) if e["reason"] == "Failed")
        assert gave_up["type"] == "Warning"
        assert "giving up: restarts exhausted" in gave_up["message"]
        await eventually(lambda: alive(cluster, PTJ, "tiny-lm-3") is None, what="attempt 3 stopped")
        await asyncio.sleep(1.5)
        assert status(cluster)["phase"] == "Failed"
        assert creations(cluster, PTJ, "tiny-lm-4") == 0
        assert event_reasons(cluster).count("Diverged") == 3
        assert event_reasons(cluster).count("GangRestart") == 2
        seen = await scrape(operator_env)
        assert value(seen, "trainguard_job_phase", phase="Failed") == 1
        assert value(seen, "trainguard_job_restarts_total", way="new_pytorchjob") == 2
        assert value(seen, "trainguard_job_failures_total", kind="Diverged") == 3
        assert value(seen, "trainguard_job_goodput_ratio") == status(cluster)["goodput"]


def test_every_operator_metric_is_documented() -> None:
    readme = (ROOT / "examples/k8s/README.md").read_text()
    registry = OperatorMetrics().registry
    names = {family.name + ("_total" if family.type == "counter" else "") for family in registry.collect()}
    assert len(names) >= 15
    assert sorted(n for n in names if f"`{n}`" not in readme and f"`{n}{{" not in readme) == []


def test_the_operator_entry_point_refuses_bad_settings(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINGUARD_OPERATOR_POLL_CONCURRENCY", "zero")
    assert main(["--namespace", NS]) == 2
    assert "TRAINGUARD_OPERATOR_POLL_CONCURRENCY" in capsys.readouterr().err
