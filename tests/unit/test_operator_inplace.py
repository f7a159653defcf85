"""Restarting a gang in place on a cluster: the rendered launcher and token, which restarts keep the pods,
how the ordered attempt is read, and every fallback to a new PyTorchJob (``inplace``, ``pods``,
``reconcile``)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from trainguard_operator.inplace import (
    launcher_command,
    order_signer,
    order_signing_key,
    order_token,
    order_wait_seconds,
)
from trainguard_operator.pods import pods_to_poll
from trainguard_operator.reconcile import Plan, PlanAction
from trainguard_operator.render import SIDECAR_CONTAINER, Owner, render_pytorchjob
from trainguard_operator.settings import OperatorSettings, OperatorSettingsError

from tests.support.manifests import gtj_manifest
from tests.support.operator_world import T0, UID, Cluster, pod, reasons, worker_report
from trainer_sidecar.contract.env import (
    ATTEMPT_ENV,
    ORDER_SIGNING_KEY_ENV,
    ORDER_TOKEN_DIGEST_ENV,
    POD_NAME_ENV,
    RESTARTS_ENV,
)
from trainer_sidecar.contract.inplace import (
    LAUNCHER_MODULE,
    LauncherPhase,
    Refusal,
    RestartOrder,
    StopMode,
    check_order,
)
from trainguard.core.observation import SidecarReport
from trainguard.core.spec import parse_job

KEY = "k" * 40
SETTINGS = OperatorSettings(
    stale_attempt_grace_seconds=60, crd_retry_seconds=60, order_key=KEY, order_timeout_seconds=30
)
WALL0 = T0.timestamp()


def both(attempt: int, name: str = "tiny-lm-1", **fields: Any) -> dict[str, SidecarReport]:
    return {f"{name}-worker-{rank}": worker_report(attempt, **fields) for rank in range(2)}


def running_in_place(settings: OperatorSettings = SETTINGS, **spec: Any) -> Cluster:
    cluster = Cluster.of(gtj_manifest(recovery={"backoffSeconds": [10, 30, 90], "maxRestarts": 5}, **spec))
    cluster.settings = settings
    assert cluster.step(T0).action is PlanAction.CREATE
    cluster.run_pods(1)
    assert cluster.step(T0 + timedelta(seconds=5), both(1)).action is PlanAction.NOTHING
    return cluster


def crash(
    cluster: Cluster, at: datetime, attempt: int = 1, host: str = "tiny-lm-1", output: str = ""
) -> Plan:
    """Rank 1's worker exits 137 under its launcher, which holds the container for an order."""
    sidecars = both(attempt, host)
    sidecars[f"{host}-worker-1"] = worker_report(
        attempt, LauncherPhase.EXITED, alive=False, exit_code=137, started=at.timestamp() - 1, output=output
    )
    return cluster.step(at, sidecars)


def test_an_oom_kill_under_a_launcher_is_named_as_a_containers() -> None:
    cluster = running_in_place()
    failed = T0 + timedelta(seconds=60)
    sidecars = both(1)
    report = worker_report(
        1, LauncherPhase.EXITED, alive=False, exit_code=137, started=failed.timestamp() - 1
    )
    assert report.launcher is not None
    sidecars["tiny-lm-1-worker-1"] = replace(
        report, launcher=report.launcher.model_copy(update={"oom_killed": True})
    )
    plan = cluster.step(failed, sidecars)
    assert "killed by signal 9 (OOMKilled)" in plan.events[0].message
    # The pod keeps its memory limit either way: the restart stays in place.
    assert plan.action is PlanAction.RESTART_IN_PLACE


def test_a_crash_under_a_launcher_is_named_with_the_last_line_of_its_output() -> None:
    cluster = running_in_place()
    output = (
        "Traceback (most recent call last):\n  ...\nRuntimeError: CUDA error: an illegal memory access\n\n"
    )
    plan = crash(cluster, T0 + timedelta(seconds=60), output=output)
    crashed = plan.events[0]
    assert crashed.reason == "Crashed"
    assert "killed by signal 9: RuntimeError: CUDA error: an illegal memory access" in crashed.message


# --------------------------------------------------------------------------------------- render ---
def test_the_worker_runs_under_the_launcher_of_its_own_interpreter_and_the_sidecar_knows_the_digest() -> None:
    job = parse_job(gtj_manifest(), "research/tiny-lm")
    manifest = render_pytorchjob(job, Owner("tiny-lm", "research", UID), 1, None, SETTINGS)
    pod_spec = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    worker = pod_spec["containers"][0]
    container = job.spec.template.spec.containers[0]
    user = [*(container.command or []), *(container.args or [])]
    wait = str(order_wait_seconds(job.spec.health.probe_period_seconds))
    assert worker["command"] == [user[0], "-m", LAUNCHER_MODULE, "--order-wait-seconds", wait, "--", *user]
    assert "args" not in worker
    sidecar = next(c for c in pod_spec["initContainers"] if c["name"] == SIDECAR_CONTAINER)
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in sidecar["env"]}
    # The sidecar writes the order into the status directory, so it mounts it writable.
    assert [m["readOnly"] for m in sidecar["volumeMounts"] if m["name"] == "trainguard-status"] == [False]
    token = order_token(KEY, UID, "tiny-lm-1")
    assert env[ORDER_TOKEN_DIGEST_ENV] == hashlib.sha256(token.encode()).hexdigest()
    assert env[ORDER_SIGNING_KEY_ENV] == order_signing_key(KEY, UID, "tiny-lm-1")
    # Each pod's sidecar knows its own name: an order names the pod it is for.
    assert env[POD_NAME_ENV] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}
    assert KEY not in str(manifest)
    assert token not in str(manifest)
    # Another PyTorchJob of the job, or another job, takes another token and another signing key.
    assert order_token(KEY, UID, "tiny-lm-2") != token != order_token(KEY, "other-uid", "tiny-lm-1")
    signing = {order_signing_key(KEY, UID, "tiny-lm-2"), order_signing_key(KEY, "other-uid", "tiny-lm-1")}
    assert len(signing | {env[ORDER_SIGNING_KEY_ENV], token}) == 4


def test_the_operator_signs_an_order_for_one_pod_of_one_pytorchjob() -> None:
    signer = order_signer(KEY, UID, "research", "tiny-lm-1")
    order = RestartOrder(attempt=2, environment={ATTEMPT_ENV: "2"}, stop=StopMode.GRACEFUL)
    body = signer.body("tiny-lm-1-worker-1", order, WALL0)
    key = order_signing_key(KEY, UID, "tiny-lm-1")
    claims, refusal, reason = check_order(key, body, "research/tiny-lm-1-worker-1", WALL0 + 1)
    assert (refusal, reason) == (None, "")
    assert claims is not None
    assert claims.order == order
    assert check_order(key, body, "research/tiny-lm-1-worker-0", WALL0 + 1).refusal is Refusal.MISDIRECTED
    other = order_signing_key(KEY, UID, "tiny-lm-2")  # the next PyTorchJob's pods
    assert check_order(other, body, "research/tiny-lm-1-worker-1", WALL0 + 1).refusal is Refusal.FORGED
    assert signer.token.encode() not in body
    assert signer.signing_key.encode() not in body
    assert signer.token not in repr(signer)
    assert signer.signing_key not in repr(signer)


def test_no_launcher_without_a_key_or_without_a_command_and_no_spare_when_turned_off() -> None:
    job = parse_job(gtj_manifest(), "research/tiny-lm")
    owner = Owner("tiny-lm", "research", UID)

    def worker(settings: OperatorSettings, container: Mapping[str, Any] | None = None) -> dict[str, Any]:
        changed = job
        if container is not None:
            template = job.spec.template.model_dump(mode="json", exclude_none=True)
            template["spec"]["containers"][0] = {**template["spec"]["containers"][0], **container}
            spec = job.spec.model_dump(by_alias=True, mode="json") | {"template": template}
            changed = job.model_copy(update={"spec": type(job.spec).model_validate(spec)})
        manifest = render_pytorchjob(changed, owner, 1, None, settings)
        result: dict[str, Any] = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"][
            "containers"
        ][0]
        return result

    plain = worker(OperatorSettings())
    assert LAUNCHER_MODULE not in plain["command"]
    assert LAUNCHER_MODULE not in worker(SETTINGS.model_copy(update={"in_place_restarts": 0}))["command"]
    entrypoint = worker(SETTINGS, {"command": None, "args": ["--steps", "5"]})
    assert "command" not in entrypoint
    assert entrypoint["args"] == ["--steps", "5"]
    # Under a memory limit too: the launcher keeps a spare only while the container has room for it.
    limited = worker(SETTINGS, {"resources": {"limits": {"memory": "8Gi"}}})
    assert "--no-spare" not in limited["command"]
    assert "--no-spare" in worker(SETTINGS.model_copy(update={"warm_spares": False}))["command"]
    assert "--no-spare" not in worker(SETTINGS)["command"]


def test_a_command_that_is_not_python_runs_under_the_launchers_script() -> None:
    assert launcher_command(["torchrun", "train.py"], order_wait_seconds=30, warm=True) == [
        "trainguard-launch",
        "--order-wait-seconds",
        "30",
        "--",
        "torchrun",
        "train.py",
    ]
    assert launcher_command(["/usr/bin/python3.12", "t.py"], order_wait_seconds=5, warm=False)[:3] == [
        "/usr/bin/python3.12",
        "-m",
        LAUNCHER_MODULE,
    ]


@pytest.mark.parametrize("key", ["short", "x" * 31])
def test_a_short_order_key_is_refused_without_repeating_it(key: str) -> None:
    with pytest.raises(OperatorSettingsError) as caught:
        OperatorSettings.from_env({"TRAINGUARD_OPERATOR_ORDER_KEY": key})
    assert "TRAINGUARD_OPERATOR_ORDER_KEY" in str(caught.value)
    assert key not in str(caught.value)
    assert KEY not in repr(SETTINGS)


# -------------------------------------------------------------------------------------- restart ---
def test_a_crash_restarts_the_gang_in_its_pods_with_the_backoff_in_the_order() -> None:
    cluster = running_in_place()
    failed = T0 + timedelta(seconds=60)
    plan = crash(cluster, failed)
    assert plan.action is PlanAction.RESTART_IN_PLACE
    assert plan.write_status_first
    assert plan.delete == ()
    assert plan.create is None
    assert [(t.pod, t.ip) for t in plan.orders] == [
        ("tiny-lm-1-worker-0", "10.0.0.1"),
        ("tiny-lm-1-worker-1", "10.0.0.2"),
    ]
    order = plan.order
    assert order is not None
    assert (order.attempt, order.stop, order.grace_seconds, order.start_delay_seconds) == (
        2,
        StopMode.GRACEFUL,
        1,
        10,
    )
    assert order.environment[ATTEMPT_ENV] == "2"
    assert order.environment[RESTARTS_ENV] == "1"
    status = cluster.status
    assert (status.attempt, status.attempt_created, status.host_attempt, status.in_place_restarts) == (
        2,
        2,
        1,
        1,
    )
    assert (status.restarts, status.pytorch_job, status.phase) == (1, "tiny-lm-1", "Restarting")
    assert reasons(plan) == ["Crashed", "GangRestart"]
    assert "in place" in plan.events[-1].message
    # The pods stay the ones polled, though their label says attempt 1.
    assert [name for name, _ in pods_to_poll(cluster.body, cluster.pods)] == [
        "tiny-lm-1-worker-0",
        "tiny-lm-1-worker-1",
    ]

    # During the backoff the launchers hold the stopped workers: nothing to decide, nothing created.
    waiting = both(2, phase=LauncherPhase.STOPPING, alive=False, started=failed.timestamp())
    plan = cluster.step(failed + timedelta(seconds=5), waiting)
    # Its pods run, but attempt 2 does not yet: the job says Restarting until the launchers start it.
    assert cluster.status.phase == "Restarting"
    assert plan.action is PlanAction.NOTHING
    assert plan.create is None
    assert plan.delete == ()
    # Attempt 2 runs; until its workers write a status of their own, the old one counts for nothing.
    began = (failed + timedelta(seconds=10)).timestamp()
    stale = both(2, started=began, status_started=began - 50, step=100)
    plan = cluster.step(failed + timedelta(seconds=11), stale)
    assert plan.action is PlanAction.NOTHING
    assert cluster.status.phase == "Running"
    assert "Recovered" not in reasons(plan)
    plan = cluster.step(failed + timedelta(seconds=13), both(2, started=began, step=101))
    assert plan.action is PlanAction.NOTHING
    assert "Recovered" in reasons(plan)
    assert cluster.status.step == 101
    assert cluster.status.recovering_since is None


def test_a_crash_of_an_attempt_restarted_in_place_is_read_from_its_launcher_and_restarts_again() -> None:
    cluster = running_in_place()
    failed = T0 + timedelta(seconds=60)
    crash(cluster, failed)
    began = (failed + timedelta(seconds=10)).timestamp()
    cluster.step(failed + timedelta(seconds=13), both(2, started=began, step=101))
    again = failed + timedelta(seconds=120)
    plan = crash(cluster, again, attempt=2)
    assert plan.action is PlanAction.RESTART_IN_PLACE
    assert plan.order is not None
    assert plan.order.attempt == 3
    assert plan.order.start_delay_seconds == 30
    assert (cluster.status.host_attempt, cluster.status.in_place_restarts) == (1, 2)


@pytest.mark.parametrize(
    "why",
    ["no key", "cap reached", "a launcher missing", "a pod failed", "world size changed"],
)
def test_a_restart_that_cannot_keep_the_pods_makes_a_new_pytorchjob(why: str) -> None:
    settings = SETTINGS
    if why == "no key":
        settings = OperatorSettings(stale_attempt_grace_seconds=60, crd_retry_seconds=60)
    if why == "cap reached":
        settings = SETTINGS.model_copy(update={"in_place_restarts": 0})
    cluster = running_in_place(settings)
    failed = T0 + timedelta(seconds=60)
    sidecars = both(1)
    sidecars["tiny-lm-1-worker-1"] = worker_report(
        1, LauncherPhase.EXITED, alive=False, exit_code=137, started=failed.timestamp() - 1
    )
    if why == "a launcher missing":
        sidecars["tiny-lm-1-worker-0"] = SidecarReport(reachable=True, alive=True, status=None)
    if why == "a pod failed":
        cluster.set_pod(pod(1, 1, exit_code=137))
    if why == "world size changed":
        cluster.body["spec"]["replicas"] = 3
    plan = cluster.step(failed, sidecars)
    assert plan.action is PlanAction.RESTART
    assert plan.delete == ("tiny-lm-1",)
    assert plan.order is None
    assert cluster.status.host_attempt is None


def test_an_attempt_adopted_after_its_status_write_was_lost_keeps_the_world_size_it_runs_at() -> None:
    """The step that created attempt 1's PyTorchJob (2 replicas) lost its status write to a conflict: the
    user had just asked for 1 replica. The step that adopts the PyTorchJob pins the 2 replicas it runs
    with, so the gang is read as two ranks, and the next restart is a new PyTorchJob of one."""
    cluster = Cluster.of(gtj_manifest(recovery={"backoffSeconds": [10, 30, 90], "maxRestarts": 5}))
    cluster.settings = SETTINGS
    created = cluster.plan(T0)
    assert created.action is PlanAction.CREATE
    cluster.effects(created)  # the PyTorchJob exists; the status write conflicted and is lost
    cluster.body["spec"]["replicas"] = 1
    cluster.run_pods(1)
    adopted = cluster.step(T0 + timedelta(seconds=5), both(1))
    assert adopted.action is PlanAction.NOTHING
    status = cluster.status
    assert status.pinned is not None
    assert status.pinned["replicas"] == 2
    assert status.attempt_created == 1
    plan = crash(cluster, T0 + timedelta(seconds=60))
    assert plan.action is PlanAction.RESTART  # the gang of two cannot host a gang of one
    assert plan.order is None
    started = cluster.step(T0 + timedelta(seconds=75))
    assert started.action is PlanAction.CREATE
    assert started.create is not None
    assert started.create["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    assert "WorldSizeChanged" in reasons(started)


def test_pods_of_a_larger_gang_are_never_ordered_in_part() -> None:
    """The status says one rank, but the host attempt runs a pod of rank 1 too (a world size pinned
    wrong): ordering rank 0 alone would restart half a gang, so the restart is a new PyTorchJob."""
    cluster = running_in_place(replicas=1)  # which runs the pods of ranks 0 and 1
    assert len(cluster.pods) == 2
    sidecars = both(1)
    sidecars["tiny-lm-1-worker-0"] = worker_report(
        1, LauncherPhase.EXITED, alive=False, exit_code=137, started=WALL0 + 59
    )
    plan = cluster.step(T0 + timedelta(seconds=60), sidecars)
    assert plan.action is PlanAction.RESTART
    assert plan.order is None


def test_the_cap_of_restarts_in_place_makes_the_next_restart_a_new_pytorchjob_and_resets() -> None:
    cluster = running_in_place(SETTINGS.model_copy(update={"in_place_restarts": 1}))
    failed = T0 + timedelta(seconds=60)
    assert crash(cluster, failed).action is PlanAction.RESTART_IN_PLACE
    began = (failed + timedelta(seconds=10)).timestamp()
    cluster.step(failed + timedelta(seconds=13), both(2, started=began, step=101))
    plan = crash(cluster, failed + timedelta(seconds=120), attempt=2)
    assert plan.action is PlanAction.RESTART
    assert plan.delete == ("tiny-lm-1",)
    created = cluster.step(failed + timedelta(seconds=150))
    assert created.action is PlanAction.CREATE
    assert created.create is not None
    assert created.create["metadata"]["name"] == "tiny-lm-3"
    assert (cluster.status.host_attempt, cluster.status.in_place_restarts) == (None, 0)


# ------------------------------------------------------------------------------------ fallbacks ---
def fallen_back(plan: Plan, cluster: Cluster) -> None:
    assert plan.action is PlanAction.FALL_BACK
    assert plan.write_status_first
    assert plan.delete == ("tiny-lm-1",)
    assert plan.stop_pods_within_seconds is not None
    assert reasons(plan) == ["InPlaceRestartFailed"]
    status = cluster.status
    assert (status.attempt, status.restarts, status.host_attempt, status.attempt_created) == (2, 1, None, 1)


def test_an_order_refused_falls_back_to_a_new_pytorchjob_of_the_same_attempt() -> None:
    cluster = running_in_place()
    failed = T0 + timedelta(seconds=60)
    crash(cluster, failed)
    plan = cluster.step(
        failed + timedelta(seconds=1), both(1), {"tiny-lm-1-worker-0": "/restart answered 401"}
    )
    fallen_back(plan, cluster)
    assert "401" in plan.events[0].message
    # The new PyTorchJob of attempt 2 comes once the backoff is over and the old one is gone.
    plan = cluster.step(failed + timedelta(seconds=10))
    assert plan.action is PlanAction.CREATE
    assert plan.create is not None
    assert plan.create["metadata"]["name"] == "tiny-lm-2"
    assert cluster.status.restarts == 1  # the fallback is the same restart, not another


def test_a_pod_lost_while_the_attempt_waits_to_start_falls_back_at_once() -> None:
    cluster = running_in_place()
    failed = T0 + timedelta(seconds=60)
    crash(cluster, failed)
    gone = pod(1, 0)
    gone["metadata"]["deletionTimestamp"] = "2030-01-01T00:01:02Z"
    cluster.set_pod(gone)
    waiting = both(2, phase=LauncherPhase.STOPPING, alive=False, started=failed.timestamp())
    fallen_back(cluster.step(failed + timedelta(seconds=2), waiting), cluster)


def test_a_launcher_that_never_takes_the_order_falls_back_after_the_timeout() -> None:
    cluster = running_in_place()
    failed = T0 + timedelta(seconds=60)
    crash(cluster, failed)
    due = failed + timedelta(seconds=10)
    # Still at attempt 1 (the order never arrived), within the timeout: wait.
    assert cluster.step(due + timedelta(seconds=29), both(1)).action is PlanAction.NOTHING
    fallen_back(cluster.step(due + timedelta(seconds=30), both(1)), cluster)


def test_once_the_gang_stepped_in_place_a_later_failure_is_the_policys_not_a_fallback() -> None:
    cluster = running_in_place()
    failed = T0 + timedelta(seconds=60)
    crash(cluster, failed)
    began = (failed + timedelta(seconds=10)).timestamp()
    cluster.step(failed + timedelta(seconds=13), both(2, started=began, step=101))
    cluster.set_pod(pod(1, 0, exit_code=1))
    plan = cluster.step(failed + timedelta(seconds=200), both(2, started=began, step=105))
    assert plan.action is PlanAction.RESTART
    assert cluster.status.restarts == 2
    assert cluster.status.attempt == 3
