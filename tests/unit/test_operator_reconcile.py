"""The pure reconcile step, scenario by scenario, against a tiny in-memory "API server" that stores only
what the real one would (objects and their status). Each step is a fresh ``reconcile`` call on that
state, so nothing can survive in memory between steps: that is the operator-restart property."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trainguard_operator.goodput import MAX_RECORDS, job_goodput, kept_seconds, record_progress
from trainguard_operator.metrics import OperatorMetrics
from trainguard_operator.pods import final_status, pod_rank, pods_to_poll
from trainguard_operator.reconcile import (
    MIN_REQUEUE_SECONDS,
    PlanAction,
    World,
    pin,
    reconcile,
    spec_change,
    without_nulls,
)
from trainguard_operator.render import (
    JOB_LABEL,
    RANK_LAYOUT_LABEL,
    REPLICA_INDEX_LABEL,
    REPLICA_TYPE_LABEL,
)
from trainguard_operator.status import (
    FoldedHistory,
    JobStatus,
    StepRecord,
    iso_precise,
    merge_patch,
    parse_time,
)

from tests.support.manifests import gtj_manifest, load, schema_errors
from tests.support.operator_world import (
    SETTINGS,
    T0,
    UID,
    Cluster,
    apply_merge_patch,
    pod,
    reasons,
    report,
    status_validator,
)
from trainguard.core.observation import SidecarReport


def condition(status: JobStatus, type_: str) -> tuple[str, str]:
    found = status.condition(type_)
    assert found is not None, type_
    return found.status, found.reason


def env(job: Mapping[str, Any]) -> dict[str, str]:
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in worker["env"]}


def started_cluster() -> Cluster:
    """A job whose attempt 1 runs on two healthy pods."""
    cluster = Cluster.of()
    plan = cluster.step(T0)
    assert plan.action is PlanAction.CREATE
    cluster.run_pods(1)
    assert cluster.step(T0 + timedelta(seconds=5)).action is PlanAction.NOTHING
    return cluster


# ---------------------------------------------------------------------------------- scenarios ---
def test_a_new_job_gets_attempt_one_rendered_and_owned() -> None:
    cluster = Cluster.of()
    plan = cluster.step(T0)
    assert plan.action is PlanAction.CREATE
    assert plan.create is not None
    assert plan.create["metadata"]["name"] == "tiny-lm-1"
    assert plan.create["metadata"]["ownerReferences"][0]["uid"] == UID
    assert schema_errors(plan.create) == []
    assert not plan.write_status_first  # a creation is recorded only once it happened
    status = cluster.status
    assert (status.attempt, status.restarts, status.attempt_created, status.phase) == (1, 0, 1, "Pending")
    assert status.pinned is not None
    assert status.pinned["replicas"] == 2
    assert reasons(plan) == ["AttemptCreated"]
    assert condition(status, "Ready")[0] == "False"
    assert condition(status, "SpecInvalid") == ("False", "SpecValid")
    assert all(c.observed_generation == 1 for c in status.conditions)
    cluster.run_pods(1)
    plan = cluster.step(T0 + timedelta(seconds=10), {"tiny-lm-1-worker-0": report(step=42)})
    assert plan.action is PlanAction.NOTHING
    assert plan.requeue_seconds == 10  # probePeriodSeconds
    assert cluster.status.phase == "Running"
    assert cluster.status.step == 42
    assert condition(cluster.status, "Ready") == ("True", "Running")
    assert condition(cluster.status, "Running") == ("True", "GangRunning")


def test_worker_killed_137_restarts_the_gang_after_the_first_backoff_without_remediation() -> None:
    cluster = started_cluster()
    failed_at = T0 + timedelta(seconds=60)
    cluster.set_pod(pod(1, 1, exit_code=137))
    plan = cluster.step(failed_at)
    assert plan.action is PlanAction.RESTART
    assert plan.write_status_first
    assert plan.delete == ("tiny-lm-1",)
    assert plan.stop_pods_within_seconds == 1  # the broken gang cannot use its long grace
    assert plan.decision is not None
    assert plan.decision.delay_seconds == 10
    status = cluster.status
    assert (status.attempt, status.restarts, status.handled_attempt) == (2, 1, 1)
    assert status.remediation is None
    assert status.next_attempt_at == "2030-01-01T00:01:10.000000Z"
    assert status.last_failure is not None
    assert status.last_failure.reason == "Crashed"
    assert (status.last_failure.rank, status.last_failure.exit_code) == (1, 137)
    assert "signal 9" in status.last_failure.message
    assert status.phase == "Restarting"
    assert condition(status, "Restarting") == ("True", "GangRestart")
    assert condition(status, "Ready")[0] == "False"
    assert reasons(plan) == ["Crashed", "GangRestart"]
    assert "tiny-lm-1" not in cluster.jobs

    # During the backoff: wait, and come back when it ends.
    plan = cluster.step(failed_at + timedelta(seconds=4))
    assert plan.action is PlanAction.WAIT
    assert plan.requeue_seconds == 6
    assert cluster.jobs == {}
    # At the end of the backoff: attempt 2, a fresh PyTorchJob with the attempt in its environment.
    plan = cluster.step(failed_at + timedelta(seconds=10))
    assert plan.action is PlanAction.CREATE
    assert plan.create is not None
    assert plan.create["metadata"]["name"] == "tiny-lm-2"
    assert env(plan.create)["TRAINGUARD_ATTEMPT"] == "2"
    assert "TRAINGUARD_REMEDIATION" not in env(plan.create)
    assert cluster.status.restarts == 1
    # The failure history everySteps auto sizes its interval from: one restart, the job's run time so far.
    started = parse_time(cluster.status.job_started_at)
    assert started is not None
    assert env(plan.create)["TRAINGUARD_RESTARTS"] == "1"
    run = (failed_at + timedelta(seconds=10) - started).total_seconds()
    assert env(plan.create)["TRAINGUARD_RUN_SECONDS"] == str(round(run))


def test_diverged_exit_200_restarts_with_remediation_that_later_attempts_keep_once() -> None:
    cluster = started_cluster()
    cluster.set_pod(pod(1, 0, exit_code=200))
    cluster.set_pod(pod(1, 1, exit_code=1))  # its peer dies in the collective
    plan = cluster.step(T0 + timedelta(seconds=60))
    assert plan.action is PlanAction.RESTART
    status = cluster.status
    assert status.last_failure is not None
    assert status.last_failure.reason == "Diverged"
    assert status.last_failure.rank == 0
    assert status.remediation is not None
    assert status.remediation.payload() == {"id": "attempt-2", "lrScale": 0.5, "maxGradNorm": 0.5}
    assert reasons(plan) == ["Diverged", "GangRestart"]
    plan = cluster.step(T0 + timedelta(seconds=70))
    assert plan.create is not None
    assert json.loads(env(plan.create)["TRAINGUARD_REMEDIATION"]) == {
        "id": "attempt-2",
        "lrScale": 0.5,
        "maxGradNorm": 0.5,
    }
    # A crash of attempt 2 is not a divergence: attempt 3 carries the same order (same id), which a
    # guardian that already applied it skips, rather than a second halving of the learning rate.
    cluster.run_pods(2)
    cluster.set_pod(pod(2, 1, exit_code=137))
    plan = cluster.step(T0 + timedelta(seconds=200))
    assert plan.action is PlanAction.RESTART
    assert plan.decision is not None
    assert plan.decision.delay_seconds == 30
    plan = cluster.step(T0 + timedelta(seconds=230))
    assert plan.create is not None
    assert json.loads(env(plan.create)["TRAINGUARD_REMEDIATION"])["id"] == "attempt-2"


def test_a_diverged_status_on_the_sidecar_is_acted_on_before_the_exit_code() -> None:
    cluster = started_cluster()
    diverged = report(
        alive=False, reason="worker phase is diverged", phase="diverged", message="6 rollbacks in 2000 steps"
    )
    plan = cluster.step(T0 + timedelta(seconds=60), {"tiny-lm-1-worker-1": diverged})
    assert plan.action is PlanAction.RESTART
    failure = cluster.status.last_failure
    assert failure is not None
    assert failure.reason == "Diverged"
    assert failure.message == "rank 1 diverged at step 100: 6 rollbacks in 2000 steps"
    assert cluster.status.remediation is not None


def test_a_hang_seen_by_the_sidecar_restarts_with_its_reason() -> None:
    cluster = started_cluster()
    why = "no step for 312.0 s (hang timeout 300 s), last step 4200"
    plan = cluster.step(T0 + timedelta(seconds=400), {"tiny-lm-1-worker-1": report(alive=False, reason=why)})
    assert plan.action is PlanAction.RESTART
    failure = cluster.status.last_failure
    assert failure is not None
    assert failure.reason == "Hung"
    assert why in failure.message
    assert failure.rank == 1
    assert reasons(plan) == ["Hung", "GangRestart"]


def test_a_hung_gang_is_stopped_at_once_unless_a_survivor_is_writing_a_checkpoint() -> None:
    now = T0 + timedelta(seconds=400)
    why = "no step for 312.0 s (hang timeout 300 s), last step 4200"
    hung = report(alive=False, reason=why)
    plan = started_cluster().step(now, {"tiny-lm-1-worker-1": hung})
    assert (plan.action, plan.stop_pods_within_seconds) == (PlanAction.RESTART, 1)
    # Rank 0 waits in a collective with its write of the last checkpoint in flight (started 1 s ago,
    # its last write took 4 s): its pods get until that write is expected durable (2 x 4 - 1 + 1 s).
    writing = report(checkpoint_write_since=now.timestamp() - 1, checkpoint_seconds=4.0)
    plan = started_cluster().step(now, {"tiny-lm-1-worker-1": hung, "tiny-lm-1-worker-0": writing})
    assert (plan.action, plan.stop_pods_within_seconds) == (PlanAction.RESTART, 8)
    # The hung rank's own write counts too: its process still runs.
    plan = started_cluster().step(
        now, {"tiny-lm-1-worker-1": report(False, why, checkpoint_write_since=now.timestamp() - 1)}
    )
    assert plan.stop_pods_within_seconds == 60  # its first write: nothing known, the pods' own grace


def test_a_hang_names_the_rank_in_its_own_work_with_its_pod_and_node_not_the_rank_waiting_for_it() -> None:
    # Both sidecars fail liveness: rank 1 is stuck in its forward pass, rank 0 waits for it in the step's
    # all-reduce. The failure used to read "rank 0 hung" (the lowest rank): only the victim.
    cluster = started_cluster()
    stuck = pod(1, 1)
    stuck["spec"] = {"nodeName": "node-b"}
    cluster.set_pod(stuck)
    why = "no step for 312.0 s (hang timeout 300 s), last step 4200"
    plan = cluster.step(
        T0 + timedelta(seconds=400),
        {
            "tiny-lm-1-worker-0": report(alive=False, reason=why, activity="collective", step=4200),
            "tiny-lm-1-worker-1": report(alive=False, reason=why, activity="loop", step=4200),
        },
    )
    assert plan.action is PlanAction.RESTART
    failure = cluster.status.last_failure
    assert failure is not None
    assert (failure.reason, failure.rank) == ("Hung", 1)
    assert failure.message.startswith(
        "rank 1 (pod tiny-lm-1-worker-1 on node node-b) hung at step 4200 in its own work"
    )
    assert failure.message.endswith("; rank 0 waited for it in a collective")
    hung = next(event for event in plan.events if event.reason == "Hung")
    assert "rank 1 (pod tiny-lm-1-worker-1 on node node-b) hung at step 4200 in its own work" in hung.message


def test_a_liveness_kill_carries_the_sidecars_reason() -> None:
    cluster = started_cluster()
    cluster.set_pod(pod(1, 1, exit_code=137))
    why = "no step for 331.0 s (hang timeout 300 s), last step 4200"
    cluster.step(T0 + timedelta(seconds=400), {"tiny-lm-1-worker-1": report(alive=False, reason=why)})
    failure = cluster.status.last_failure
    assert failure is not None
    assert failure.reason == "Crashed"
    assert failure.exit_code == 137
    assert "signal 9" in failure.message
    assert why in failure.message


def test_oom_kill_is_named() -> None:
    cluster = started_cluster()
    cluster.set_pod(pod(1, 0, exit_code=137, container_reason="OOMKilled"))
    cluster.step(T0 + timedelta(seconds=60))
    assert cluster.status.last_failure is not None
    assert "OOMKilled" in cluster.status.last_failure.message


@pytest.mark.parametrize(
    ("rank0_finished", "rank1_finished"),
    [("2030-01-01T00:01:05Z", "2030-01-01T00:01:04Z"), ("2030-01-01T00:01:04Z", "2030-01-01T00:01:04Z")],
    ids=["worker-ended-first", "same-second"],
)
def test_a_peer_that_exited_1_after_an_oom_kill_is_not_blamed_for_it(
    rank0_finished: str, rank1_finished: str
) -> None:
    # The OOM-killed rank 1 took rank 0 down with it (exit 1 from the collective); the operator sees both
    # ended at its next look. The container's finishedAt is in whole seconds: a tie goes to the signal.
    cluster = started_cluster()
    cluster.set_pod(pod(1, 0, exit_code=1, finished_at=rank0_finished))
    cluster.set_pod(pod(1, 1, exit_code=137, container_reason="OOMKilled", finished_at=rank1_finished))
    cluster.step(T0 + timedelta(seconds=60))
    failure = cluster.status.last_failure
    assert failure is not None
    assert (failure.rank, failure.exit_code) == (1, 137), failure
    assert "OOMKilled" in failure.message, failure.message
    assert failure.message.startswith("rank 1 crashed first: killed by signal 9 (OOMKilled)"), failure.message
    assert failure.message.endswith("; rank 0 too"), failure.message


def test_a_rank_that_crashed_first_is_blamed_though_a_later_one_was_killed() -> None:
    cluster = started_cluster()
    cluster.set_pod(pod(1, 0, exit_code=1, finished_at="2030-01-01T00:01:02Z"))
    cluster.set_pod(pod(1, 1, exit_code=137, finished_at="2030-01-01T00:01:09Z"))
    cluster.step(T0 + timedelta(seconds=60))
    failure = cluster.status.last_failure
    assert failure is not None
    assert (failure.rank, failure.exit_code) == (0, 1), failure


def test_eviction_and_disruption_are_a_lost_rank() -> None:
    cluster = started_cluster()
    cluster.set_pod(pod(1, 1, phase="Failed", reason="Evicted", message="The node was low on memory."))
    plan = cluster.step(T0 + timedelta(seconds=60))
    assert plan.action is PlanAction.RESTART
    failure = cluster.status.last_failure
    assert failure is not None
    assert failure.reason == "Lost"
    assert failure.rank == 1
    assert "evicted" in failure.message
    assert "low on memory" in failure.message

    cluster = started_cluster()
    disrupted = pod(
        1,
        0,
        conditions=[
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "DeletionByTaintManager",
                "message": "node lost",
            }
        ],
    )
    cluster.set_pod(disrupted)
    cluster.step(T0 + timedelta(seconds=60))
    failure = cluster.status.last_failure
    assert failure is not None
    assert failure.reason == "Lost"
    assert "DeletionByTaintManager" in failure.message


def test_a_pod_being_deleted_or_restarted_in_place_is_a_lost_rank() -> None:
    cluster = started_cluster()
    deleting = pod(1, 1)
    deleting["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:50Z"
    cluster.set_pod(deleting)
    cluster.step(T0 + timedelta(seconds=60))
    assert cluster.status.last_failure is not None
    assert "being deleted" in cluster.status.last_failure.message

    cluster = started_cluster()
    restarted = pod(1, 1)
    restarted["status"]["containerStatuses"][0] |= {
        "restartCount": 1,
        "lastState": {"terminated": {"exitCode": 137}},
    }
    cluster.set_pod(restarted)
    cluster.step(T0 + timedelta(seconds=60))
    assert cluster.status.last_failure is not None
    assert "restarted in place" in cluster.status.last_failure.message


def test_a_pytorchjob_deleted_by_someone_else_is_a_lost_gang() -> None:
    cluster = started_cluster()
    cluster.jobs.clear()
    plan = cluster.step(T0 + timedelta(seconds=60))
    assert plan.action is PlanAction.RESTART
    assert cluster.status.last_failure is not None
    assert "deleted" in cluster.status.last_failure.message


def test_success_is_final() -> None:
    cluster = started_cluster()
    cluster.current_job()["status"] = {
        "conditions": [{"type": "Succeeded", "status": "True", "reason": "PyTorchJobSucceeded"}]
    }
    plan = cluster.step(T0 + timedelta(seconds=60))
    assert plan.action is PlanAction.SUCCEED
    assert plan.done
    assert cluster.status.phase == "Succeeded"
    assert condition(cluster.status, "Succeeded") == ("True", "JobSucceeded")
    assert condition(cluster.status, "Ready") == ("True", "Succeeded")
    assert reasons(plan) == ["Succeeded"]
    # Whatever happens to the pods afterwards, the job stays succeeded and nothing is deleted.
    cluster.set_pod(pod(1, 1, exit_code=137))
    plan = cluster.step(T0 + timedelta(seconds=120))
    assert (plan.action, plan.done, plan.delete, plan.events) == (PlanAction.NOTHING, True, (), ())
    assert cluster.status.phase == "Succeeded"
    assert "tiny-lm-1" in cluster.jobs


def test_every_rank_exiting_zero_is_success_too() -> None:
    cluster = started_cluster()
    cluster.set_pod(pod(1, 0, exit_code=0))
    assert cluster.step(T0 + timedelta(seconds=60)).action is PlanAction.NOTHING
    cluster.set_pod(pod(1, 1, exit_code=0))
    assert cluster.step(T0 + timedelta(seconds=70)).action is PlanAction.SUCCEED


def test_the_final_step_comes_from_the_workers_termination_messages() -> None:
    # The sidecars are gone once the workers end; the guardian's final status in each container's
    # termination message is the record of the last steps (the last poll saw step 100 here).
    cluster = started_cluster()
    for rank in (0, 1):
        final = pod(1, rank, exit_code=0)
        terminated = final["status"]["containerStatuses"][0]["state"]["terminated"]
        message = {"phase": "finished", "step": 120, "started_at": 1.0, "last_step_time": 3.0, "rollbacks": 1}
        message["last_clean_checkpoint"] = {"step": 120, "path": "/ckpt/step-0000000120", "sha256": "ab" * 32}
        terminated["message"] = json.dumps(message)
        cluster.set_pod(final)
    assert cluster.step(T0 + timedelta(seconds=70)).action is PlanAction.SUCCEED
    assert cluster.status.step == 120
    assert cluster.status.rollbacks == 1
    assert cluster.status.last_clean_checkpoint is not None
    assert cluster.status.last_clean_checkpoint.step == 120


@pytest.mark.parametrize(
    "message",
    [None, "", "plain text from the user", "{not json", "[1, 2]", '{"phase": "finished"}', '{"step": "x"}'],
)
def test_a_termination_message_that_is_no_status_is_ignored(message: str | None) -> None:
    final = pod(1, 0, exit_code=0)
    if message is not None:
        final["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = message
    assert final_status(final) is None
    assert final_status(pod(1, 0)) is None  # still running


def terminated_with(attempt: int, rank: int, exit_code: int, message: str) -> dict[str, Any]:
    """A pod whose worker ended with ``exit_code`` and left ``message`` as its termination message."""
    ended = pod(attempt, rank, exit_code=exit_code)
    ended["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = message
    return ended


def test_a_configuration_error_names_the_field_and_reason_in_the_condition_and_the_event() -> None:
    cluster = started_cluster()
    why = "TRAINGUARD_SETTINGS: guard.lossSpikeFactor: Input should be greater than 1"
    final = {"phase": "failed", "step": 0, "started_at": 1.0, "message": why}
    cluster.set_pod(terminated_with(1, 1, 2, json.dumps(final)))
    plan = cluster.step(T0 + timedelta(seconds=60))
    assert plan.action is PlanAction.FAIL
    failed = cluster.status.condition("Failed")
    assert failed is not None
    assert (failed.status, failed.reason) == ("True", "ConfigError")
    assert failed.message == f"rank 1 stopped at step 0: configuration error (permanent): {why}"
    events = {e.reason: e.message for e in plan.events}
    assert why in events["ConfigError"]
    assert cluster.status.last_failure is not None
    assert why in cluster.status.last_failure.message


def test_a_plain_text_termination_message_is_quoted_in_the_reason() -> None:
    # Python's own error (the guardian never ran), kept by the kubelet from the log's tail.
    cluster = started_cluster()
    text = "Traceback...\npython: can't open file '/app/train.py': [Errno 2] No such file or directory\n"
    cluster.set_pod(terminated_with(1, 0, 2, text))
    cluster.step(T0 + timedelta(seconds=60))
    assert cluster.status.last_failure is not None
    assert "can't open file '/app/train.py'" in cluster.status.last_failure.message
    assert "Traceback" not in cluster.status.last_failure.message  # the last line only


def test_a_diverged_final_status_counts_before_an_exit_code_of_the_teardown() -> None:
    # The worker diverged (its final status says so) but died of SIGABRT in the collective's teardown
    # before it could exit 200: a divergence, restarted with the remediation, not a crash.
    cluster = started_cluster()
    final = {"phase": "diverged", "step": 61, "started_at": 1.0, "message": "5 rollbacks within 2000 steps"}
    cluster.set_pod(terminated_with(1, 1, 134, json.dumps(final)))
    plan = cluster.step(T0 + timedelta(seconds=60))
    assert plan.action is PlanAction.RESTART
    failure = cluster.status.last_failure
    assert failure is not None
    assert (failure.reason, failure.rank, failure.exit_code) == ("Diverged", 1, 134)
    assert failure.message == "rank 1 diverged at step 61: 5 rollbacks within 2000 steps"
    assert cluster.status.remediation is not None


def test_the_gangs_step_is_its_slowest_ranks() -> None:
    cluster = started_cluster()
    sidecars = {"tiny-lm-1-worker-0": report(step=2101), "tiny-lm-1-worker-1": report(step=2100)}
    cluster.step(T0 + timedelta(seconds=30), sidecars)
    assert cluster.status.step == 2100  # a step is done when every rank did it


def sidecar_body(worker: Any, alive: bool = True, reason: str = "running") -> dict[str, Any]:
    """A sidecar's ``/status`` body around ``worker``, as it comes over the wire."""
    return {
        "status": worker,
        "read_error": "",
        "health": {"alive": alive, "ready": alive, "reason": reason},
        "time": 10.0,
        "sidecar": {"started_at": 1.0, "hang_timeout_seconds": 30.0, "startup_grace_seconds": 60.0},
    }


def served(step: int, **fields: Any) -> dict[str, SidecarReport]:
    """Rank 0's sidecar serving a status, read by the status contract's parser."""
    worker = {"phase": "running", "step": step, "started_at": 1.0, "last_step_time": 2.0, **fields}
    report = SidecarReport.from_document(json.dumps(sidecar_body(worker)))
    assert report.status is not None, report.reason
    return {"tiny-lm-1-worker-0": report}


def test_a_checkpoint_reference_longer_than_the_crd_allows_is_clipped() -> None:
    # The status contract allows a path up to PATH_MAX; the CRD allows 1024 characters. The API server
    # refuses a status beyond the CRD's limits, and then every later write with it.
    cluster = started_cluster()
    checkpoint = {"step": 100, "path": "/ckpt/" + "x" * 2000, "sha256": "ab" * 32}
    plan = cluster.step(T0 + timedelta(seconds=30), served(120, last_clean_checkpoint=checkpoint))
    assert plan.action is PlanAction.NOTHING  # and write_status checked the status against the CRD
    stored = cluster.status.last_clean_checkpoint
    assert stored is not None
    assert stored.step == 100
    assert stored.path.startswith("/ckpt/xxx")
    assert len(stored.path) == 1024


def test_the_job_status_shows_the_checkpoint_cadence_and_why() -> None:
    cluster = started_cluster()
    reason = "auto: every 120 steps (save 2 s, MTBF 3600 s assumed, step 1 s: sqrt(2 x save x MTBF) = 120 s)"
    cadence = {"checkpoint_every_steps": 120, "checkpoint_cadence": reason}
    cluster.step(T0 + timedelta(seconds=30), served(120, **cadence))  # write_status checks it against the CRD
    status = cluster.status
    assert (status.checkpoint_every_steps, status.checkpoint_cadence) == (120, reason)


def test_a_checkpoint_time_beyond_the_calendar_is_no_crash() -> None:
    cluster = started_cluster()
    checkpoint = {"step": 100, "path": "/ckpt/step-100", "sha256": "ab" * 32, "time": 1e20}
    plan = cluster.step(T0 + timedelta(seconds=30), served(120, last_clean_checkpoint=checkpoint))
    assert plan.action is PlanAction.NOTHING
    stored = cluster.status.last_clean_checkpoint
    assert stored is not None
    assert (stored.step, stored.time) == (100, "")


def test_restarts_exhausted_fail_the_job_and_stop_the_gang() -> None:
    cluster = Cluster.of(gtj_manifest(recovery={"maxRestarts": 1, "backoffSeconds": [1]}))
    cluster.step(T0)
    cluster.run_pods(1)
    cluster.set_pod(pod(1, 0, exit_code=137))
    assert cluster.step(T0 + timedelta(seconds=10)).action is PlanAction.RESTART
    assert cluster.step(T0 + timedelta(seconds=11)).action is PlanAction.CREATE
    cluster.run_pods(2)
    cluster.set_pod(pod(2, 1, exit_code=139))
    plan = cluster.step(T0 + timedelta(seconds=30))
    assert plan.action is PlanAction.FAIL
    assert plan.done
    assert plan.write_status_first
    assert plan.delete == ("tiny-lm-2",)
    assert plan.stop_pods_within_seconds == 1
    status = cluster.status
    assert status.phase == "Failed"
    assert status.restarts == 1
    assert status.last_failure is not None
    assert "restarts exhausted (1 of 1)" in status.last_failure.message
    assert condition(status, "Failed") == ("True", "RestartsExhausted")
    assert condition(status, "Ready")[0] == "False"
    assert reasons(plan) == ["Crashed", "Failed"]
    assert cluster.jobs == {}


def crashed_pod(
    attempt: int, step: int, why: str = "ValueError: shapes (8,16) and (32,1) (at train.py:9)"
) -> dict[str, Any]:
    """Rank 0 of ``attempt`` exited 1 over an exception at ``step``: its guardian's final status says so."""
    final = {"phase": "failed", "step": step, "started_at": 1.0, "message": why, "exit_code": 1}
    return terminated_with(attempt, 0, 1, json.dumps(final))


def test_the_same_crash_at_the_same_step_in_two_attempts_fails_as_deterministic_from_the_status() -> None:
    cluster = started_cluster()  # maxRestarts 3
    cluster.set_pod(crashed_pod(1, 70))
    assert cluster.step(T0 + timedelta(seconds=60)).action is PlanAction.RESTART
    # What the next failure is compared with is in the status (every step here starts from it alone,
    # as an operator restarted in between would).
    failure = cluster.status.last_failure
    assert failure is not None
    assert (failure.reason, failure.kind, failure.attempt, failure.step, failure.repeats) == (
        "Crashed",
        "Crashed",
        1,
        70,
        1,
    )
    assert failure.cause == "exited with code 1: ValueError: shapes (8,16) and (32,1) (at train.py:9)"
    assert cluster.step(T0 + timedelta(seconds=71)).action is PlanAction.CREATE
    cluster.run_pods(2)
    cluster.set_pod(crashed_pod(2, 70))
    plan = cluster.step(T0 + timedelta(seconds=120))
    assert plan.action is PlanAction.FAIL
    status = cluster.status
    assert (status.phase, status.restarts, status.attempt) == ("Failed", 1, 2)
    assert condition(status, "Failed") == ("True", "DeterministicFailure")
    assert status.last_failure is not None
    assert status.last_failure.reason == "DeterministicFailure"
    assert (status.last_failure.kind, status.last_failure.repeats) == ("Crashed", 2)
    assert status.last_failure.message.startswith(
        "deterministic failure: attempts 1 and 2 failed alike at step 70 (exited with code 1: ValueError: "
    )
    assert reasons(plan) == ["DeterministicFailure", "Failed"]
    assert plan.delete == ("tiny-lm-2",)


def test_a_repeated_crash_whose_teardown_then_segfaults_is_still_deterministic() -> None:
    # PyTorch's gloo threads can end a worker's teardown by SIGSEGV after its exception (seen on the real
    # node): the container's code is 139 in one attempt and 1 in the next, the failure is the same.
    cluster = started_cluster()
    cluster.set_pod(crashed_pod(1, 70))
    assert cluster.step(T0 + timedelta(seconds=60)).action is PlanAction.RESTART
    cluster.step(T0 + timedelta(seconds=71))
    cluster.run_pods(2)
    segfaulted = crashed_pod(2, 70)
    segfaulted["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] = 139
    cluster.set_pod(segfaulted)
    plan = cluster.step(T0 + timedelta(seconds=120))
    assert plan.action is PlanAction.FAIL
    assert condition(cluster.status, "Failed") == ("True", "DeterministicFailure")


def test_workers_that_declared_their_finish_succeed_though_a_teardown_aborted_and_failed_the_pytorchjob() -> (
    None
):
    cluster = started_cluster()
    final = {"phase": "finished", "step": 120, "started_at": 1.0, "last_step_time": 3.0, "exit_code": 0}
    cluster.set_pod(terminated_with(1, 0, 0, json.dumps(final)))
    cluster.set_pod(terminated_with(1, 1, 134, json.dumps(final)))  # std::terminate at exit: SIGABRT
    cluster.current_job()["status"] = {
        "conditions": [{"type": "Failed", "status": "True", "reason": "PyTorchJobFailed", "message": "x"}]
    }
    plan = cluster.step(T0 + timedelta(seconds=60))
    assert plan.action is PlanAction.SUCCEED
    assert cluster.status.phase == "Succeeded"
    # A rank that never declared its finish and died by the same signal is a crash.
    cluster = started_cluster()
    cluster.set_pod(terminated_with(1, 0, 0, json.dumps(final)))
    cluster.set_pod(terminated_with(1, 1, 134, json.dumps(final | {"phase": "running", "exit_code": None})))
    assert cluster.step(T0 + timedelta(seconds=60)).action is PlanAction.RESTART


def test_a_crash_at_another_step_after_progress_restarts_again() -> None:
    cluster = started_cluster()
    cluster.set_pod(crashed_pod(1, 70))
    cluster.step(T0 + timedelta(seconds=60))
    cluster.step(T0 + timedelta(seconds=71))
    cluster.run_pods(2)
    cluster.set_pod(crashed_pod(2, 95))
    assert cluster.step(T0 + timedelta(seconds=120)).action is PlanAction.RESTART
    assert cluster.status.last_failure is not None
    assert (cluster.status.last_failure.step, cluster.status.last_failure.repeats) == (95, 1)


def test_a_last_failure_recorded_before_signatures_counts_as_none() -> None:
    # An operator upgraded mid-job reads a lastFailure without kind, cause or attempt: the next crash
    # is a first one, never a repeat of something unknown.
    cluster = started_cluster()
    cluster.set_pod(crashed_pod(1, 70))
    cluster.step(T0 + timedelta(seconds=60))
    for key in ("kind", "cause", "attempt", "repeats", "step"):
        cluster.body["status"]["lastFailure"].pop(key)
    cluster.step(T0 + timedelta(seconds=71))
    cluster.run_pods(2)
    cluster.set_pod(crashed_pod(2, 70))
    assert cluster.step(T0 + timedelta(seconds=120)).action is PlanAction.RESTART


DATALOADER_CRASH = (
    "RuntimeError: DataLoader worker (pid {}) is killed by signal: Segmentation fault. "
    "(at signal_handling.py:73)"
)


def test_a_dataloader_worker_named_by_another_pid_in_the_next_attempt_fails_as_deterministic() -> None:
    # Issue 42: a corrupt sample kills the loader's worker at step 49 in every attempt, each time another pid.
    cluster = started_cluster()  # maxRestarts 3
    cluster.set_pod(crashed_pod(1, 49, DATALOADER_CRASH.format(21248)))
    assert cluster.step(T0 + timedelta(seconds=60)).action is PlanAction.RESTART
    failure = cluster.status.last_failure
    assert failure is not None
    assert failure.cause == "exited with code 1: " + DATALOADER_CRASH.format("<pid>")  # what is compared
    assert failure.message.endswith(DATALOADER_CRASH.format(21248))  # what happened, as it was said
    assert cluster.step(T0 + timedelta(seconds=71)).action is PlanAction.CREATE
    cluster.run_pods(2)
    cluster.set_pod(crashed_pod(2, 49, DATALOADER_CRASH.format(21367)))
    plan = cluster.step(T0 + timedelta(seconds=120))
    assert plan.action is PlanAction.FAIL
    assert condition(cluster.status, "Failed") == ("True", "DeterministicFailure")
    assert cluster.status.last_failure is not None
    assert cluster.status.last_failure.message.endswith(DATALOADER_CRASH.format(21367))


def test_a_cause_an_older_operator_recorded_raw_is_compared_as_a_stable_one() -> None:
    cluster = started_cluster()
    cluster.set_pod(crashed_pod(1, 49, DATALOADER_CRASH.format(21248)))
    cluster.step(T0 + timedelta(seconds=60))
    cluster.body["status"]["lastFailure"]["cause"] = "exited with code 1: " + DATALOADER_CRASH.format(21248)
    cluster.step(T0 + timedelta(seconds=71))
    cluster.run_pods(2)
    cluster.set_pod(crashed_pod(2, 49, DATALOADER_CRASH.format(21367)))
    assert cluster.step(T0 + timedelta(seconds=120)).action is PlanAction.FAIL
    assert condition(cluster.status, "Failed") == ("True", "DeterministicFailure")


def test_a_configuration_error_fails_at_once() -> None:
    cluster = started_cluster()
    cluster.set_pod(pod(1, 0, exit_code=2))
    plan = cluster.step(T0 + timedelta(seconds=60))
    assert plan.action is PlanAction.FAIL
    assert cluster.status.restarts == 0
    assert condition(cluster.status, "Failed") == ("True", "ConfigError")


def test_operator_restart_mid_recovery_neither_restarts_twice_nor_loses_counts() -> None:
    cluster = started_cluster()
    cluster.set_pod(pod(1, 1, exit_code=137))
    failed_at = T0 + timedelta(seconds=60)
    # The operator writes the decision, then dies before it deletes attempt 1's PyTorchJob.
    plan = cluster.plan(failed_at)
    assert plan.action is PlanAction.RESTART
    assert plan.write_status_first
    cluster.write_status(plan)
    # A new operator process: only the stored state remains. Attempt 1 still shows the failed pod.
    for offset in (1, 2, 5):
        again = cluster.step(failed_at + timedelta(seconds=offset))
        assert again.action is PlanAction.WAIT
        assert not any(e.reason == "GangRestart" for e in again.events)
        assert again.delete == ("tiny-lm-1",) or "tiny-lm-1" not in cluster.jobs
        assert cluster.status.restarts == 1
    assert "tiny-lm-1" not in cluster.jobs
    created = cluster.step(failed_at + timedelta(seconds=10))
    assert created.action is PlanAction.CREATE
    assert (cluster.status.attempt, cluster.status.restarts) == (2, 1)
    restarts = [p for p in cluster.history if p.action is PlanAction.RESTART]
    assert restarts == []  # the one restart was the plan carried out before the "crash"


def test_operator_restart_between_creation_and_status_write_adopts_the_attempt() -> None:
    cluster = Cluster.of()
    plan = cluster.plan(T0)
    assert plan.action is PlanAction.CREATE
    assert not plan.write_status_first
    cluster.effects(plan)  # created, then the operator died before recording it
    again = cluster.step(T0 + timedelta(seconds=3))
    assert again.action is PlanAction.NOTHING
    assert again.create is None
    assert (cluster.status.attempt, cluster.status.attempt_created) == (1, 1)
    assert list(cluster.jobs) == ["tiny-lm-1"]


def test_the_next_attempt_waits_for_the_old_pytorchjob_to_be_gone_within_a_bound() -> None:
    cluster = started_cluster()
    cluster.set_pod(pod(1, 1, exit_code=137))
    failed_at = T0 + timedelta(seconds=60)
    plan = cluster.plan(failed_at)
    cluster.write_status(plan)
    # Foreground deletion in progress: the old PyTorchJob is still listed, terminating.
    cluster.jobs["tiny-lm-1"]["metadata"]["deletionTimestamp"] = "2030-01-01T00:01:00Z"
    waiting = cluster.step(failed_at + timedelta(seconds=15))
    assert waiting.action is PlanAction.WAIT
    assert waiting.delete == ()  # already being deleted
    assert waiting.requeue_seconds <= 2
    late = cluster.step(failed_at + timedelta(seconds=10 + SETTINGS.stale_attempt_grace_seconds + 1))
    assert late.action is PlanAction.CREATE  # bounded: a stuck deletion does not stall the job


def test_next_attempt_in_the_future_means_wait_until_then() -> None:
    cluster = started_cluster()
    cluster.set_pod(pod(1, 0, exit_code=137))
    cluster.step(T0 + timedelta(seconds=60))
    for offset, left in ((61, 9), (65, 5), (69.9, 0.1)):
        plan = cluster.step(T0 + timedelta(seconds=offset))
        assert plan.action is PlanAction.WAIT
        assert abs(plan.requeue_seconds - max(left, MIN_REQUEUE_SECONDS)) < 1e-6
        assert plan.create is None
    assert cluster.step(T0 + timedelta(seconds=70)).action is PlanAction.CREATE


def test_spec_change_of_immutable_fields_is_refused_and_recovery_changes_apply() -> None:
    cluster = started_cluster()
    spec = cluster.body["spec"]
    spec["template"]["spec"]["containers"][0]["image"] = "registry.example/tiny-lm:2"
    spec["recovery"] = {"maxRestarts": 7, "backoffSeconds": [2]}
    cluster.body["metadata"]["generation"] = 2
    plan = cluster.step(T0 + timedelta(seconds=30))
    status = cluster.status
    assert condition(status, "SpecChangeRefused") == ("True", "ImmutableFieldChanged")
    refused = status.condition("SpecChangeRefused")
    assert refused is not None
    assert "spec.template.spec.containers" in refused.message
    assert "recovery" not in refused.message
    assert refused.observed_generation == 2
    assert condition(status, "Ready") == ("False", "SpecChangeRefused")
    assert reasons(plan) == ["SpecChangeRefused"]
    assert cluster.step(T0 + timedelta(seconds=40)).events == ()  # said once, not every step
    # The accepted recovery change is used by the next decision; the next attempt keeps the original
    # image.
    cluster.set_pod(pod(1, 1, exit_code=137))
    plan = cluster.step(T0 + timedelta(seconds=60))
    assert plan.decision is not None
    assert plan.decision.delay_seconds == 2
    assert "of 7" in plan.events[-1].message
    plan = cluster.step(T0 + timedelta(seconds=62))
    assert plan.create is not None
    replicas = plan.create["spec"]["pytorchReplicaSpecs"]
    assert replicas["Worker"]["template"]["spec"]["containers"][0]["image"] == "registry.example/tiny-lm:1"
    # Reverting the change clears the condition.
    spec["template"]["spec"]["containers"][0]["image"] = "registry.example/tiny-lm:1"
    cluster.step(T0 + timedelta(seconds=70))
    assert condition(cluster.status, "SpecChangeRefused")[0] == "False"


def test_a_change_of_replicas_is_accepted_and_takes_effect_at_the_next_gang_restart() -> None:
    cluster = started_cluster()
    cluster.body["spec"]["replicas"] = 4
    cluster.body["metadata"]["generation"] = 2
    plan = cluster.step(T0 + timedelta(seconds=30))
    assert condition(cluster.status, "SpecChangeRefused") == ("False", "SpecMatchesRunningJob")
    assert plan.create is None
    assert plan.delete == ()  # the running gang is not disturbed
    assert reasons(plan) == []
    # The running attempt is still observed as the 2-pod gang it is: two running pods are all of it.
    assert cluster.status.pinned is not None
    assert cluster.status.pinned["replicas"] == 2
    assert cluster.step(T0 + timedelta(seconds=40)).action is PlanAction.NOTHING
    assert condition(cluster.status, "Running") == ("True", "GangRunning")
    # At the next gang restart the new world size is rendered, announced and pinned.
    cluster.set_pod(pod(1, 1, exit_code=137))
    assert cluster.step(T0 + timedelta(seconds=60)).action is PlanAction.RESTART
    plan = cluster.step(T0 + timedelta(seconds=200))
    assert plan.create is not None
    assert plan.create["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4
    assert "WorldSizeChanged" in reasons(plan)
    changed = next(e for e in plan.events if e.reason == "WorldSizeChanged")
    assert "spec.replicas 2 -> 4" in changed.message
    assert cluster.status.pinned["replicas"] == 4
    cluster.run_pods(2, replicas=4)
    assert cluster.step(T0 + timedelta(seconds=210)).action is PlanAction.NOTHING
    assert condition(cluster.status, "Running") == ("True", "GangRunning")


def test_a_pin_read_back_from_the_api_server_is_no_spec_change() -> None:
    # The pin is stored in the status by a JSON merge patch, which drops null members at any depth; a
    # real API server hands it back without them (kmock kept them, which hid a SpecChangeRefused on
    # every job). The comparison must not see a change in that.
    manifest = gtj_manifest()
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [
        {"name": "A", "value": "1"},
        {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    spec = load(manifest).spec
    wire = spec.model_dump(by_alias=True, mode="json")
    stored = without_nulls({key: wire[key] for key in ("replicas", "template", "checkpoint")})
    assert json.dumps(stored).count("null") == 0
    assert spec_change(stored, spec)[1] == []
    assert spec_change(pin(spec), spec)[1] == []
    changed = copy.deepcopy(stored)
    changed["template"]["spec"]["containers"][0]["env"][0]["value"] = "2"
    assert spec_change(changed, spec)[1]


def test_missing_backend_crds_are_a_condition_not_a_crash_nor_a_hot_loop() -> None:
    cluster = Cluster.of()
    cluster.crd = False
    plan = cluster.step(T0)
    assert plan.action is PlanAction.BLOCKED
    assert plan.requeue_seconds == SETTINGS.crd_retry_seconds
    assert plan.create is None
    # spec.backend Auto, and neither CRD: the condition and its one Event name both, and what installs each.
    assert condition(cluster.status, "BackendCRDMissing") == ("True", "NoBackendCRD")
    assert condition(cluster.status, "Ready") == ("False", "BackendCRDMissing")
    assert reasons(plan) == ["NoBackendCRD"]
    message = plan.events[0].message
    assert "kubeflow.org/v1 pytorchjobs" in message
    assert "trainer.kubeflow.org/v1alpha1 trainjobs" in message
    assert cluster.step(T0 + timedelta(seconds=60)).events == ()
    cluster.crd = True
    plan = cluster.step(T0 + timedelta(seconds=120))
    assert plan.action is PlanAction.CREATE
    assert condition(cluster.status, "BackendCRDMissing") == ("False", "BackendCRDFound")


def test_an_invalid_spec_is_refused_with_the_field_named_and_nothing_created() -> None:
    manifest = gtj_manifest()
    manifest["spec"]["health"] = {"hangTimeoutSeconds": 5, "probePeriodSeconds": 10}
    manifest["spec"]["recovery"] = {"backoffSeconds": [30, 10]}
    cluster = Cluster.of(manifest)
    plan = cluster.step(T0)
    assert plan.action is PlanAction.BLOCKED
    assert plan.create is None
    assert plan.delete == ()
    assert reasons(plan) == ["SpecInvalid"]
    invalid = cluster.status.condition("SpecInvalid")
    assert invalid is not None
    assert invalid.status == "True"
    assert "spec.health" in invalid.message
    assert "spec.recovery.backoffSeconds" in invalid.message
    assert cluster.status.attempt is None
    # Fixed: the job starts.
    cluster.body["spec"] = gtj_manifest()["spec"]
    assert cluster.step(T0 + timedelta(seconds=5)).action is PlanAction.CREATE


def test_messages_fit_the_crds_limits() -> None:
    manifest = gtj_manifest()
    manifest["spec"]["template"]["spec"]["containers"] = [{"name": f"c{i}" * 40} for i in range(40)]
    cluster = Cluster.of(manifest)
    cluster.step(T0)  # write_status validates against the CRD's status schema (1024-character messages)
    invalid = cluster.status.condition("SpecInvalid")
    assert invalid is not None
    assert invalid.status == "True"
    assert len(invalid.message) == 1024
    assert cluster.step(T0 + timedelta(seconds=60)).events == ()  # a clipped message is still "the same"


def test_progress_from_the_sidecars_is_aggregated_and_rollbacks_and_recovery_are_reported() -> None:
    cluster = started_cluster()
    checkpoint = {"step": 2000, "path": "/ckpt/step-2000", "sha256": "ab" * 32, "time": 1893456000.0}
    sidecars = {
        "tiny-lm-1-worker-0": report(
            step=2100, rollbacks=1, skipped_steps=3, samples_seen=1000, samples_dropped=1
        ),
        "tiny-lm-1-worker-1": report(
            step=2100,
            rollbacks=1,
            skipped_steps=3,
            samples_seen=1000,
            samples_dropped=3,
            last_clean_checkpoint=checkpoint,
        ),
    }
    plan = cluster.step(T0 + timedelta(seconds=30), sidecars)
    status = cluster.status
    assert (status.step, status.rollbacks, status.skipped_steps) == (2100, 1, 3)
    assert (status.samples_seen, status.samples_dropped) == (2000, 4)
    assert status.drop_rate == 0.002
    assert status.last_clean_checkpoint is not None
    assert status.last_clean_checkpoint.step == 2000
    assert status.last_clean_checkpoint.time == "2030-01-01T00:00:00Z"
    assert reasons(plan) == ["RollbackSeen", "DropRateHigh"]  # 0.2 % > the default 0.1 %
    assert condition(status, "DropRateHigh") == ("True", "AboveMaxDropRate")
    again = cluster.step(T0 + timedelta(seconds=40), sidecars)
    assert again.events == ()

    # After a restart, the first step of the new attempt ends the recovery and is timed.
    cluster.set_pod(pod(1, 1, exit_code=137))
    cluster.step(T0 + timedelta(seconds=60))
    cluster.step(T0 + timedelta(seconds=70))
    cluster.run_pods(2)
    not_yet = {"tiny-lm-2-worker-0": report(last_step_time=None, phase="starting")}
    assert cluster.step(T0 + timedelta(seconds=80), not_yet).recovered_seconds is None
    stepping = {"tiny-lm-2-worker-0": report(step=2010, started_at=100.0, last_step_time=150.0)}
    plan = cluster.step(T0 + timedelta(seconds=100), stepping)
    assert plan.recovered_seconds == 40
    assert "Recovered" in reasons(plan)
    assert cluster.status.recovering_since is None
    assert cluster.status.phase == "Running"


def test_only_the_current_attempts_running_pods_are_polled() -> None:
    cluster = started_cluster()
    cluster.pods.append(pod(0 + 1, 1, job="another-job"))
    cluster.set_pod(pod(1, 1, exit_code=137))
    assert pods_to_poll(cluster.body, cluster.pods) == [("tiny-lm-1-worker-0", "10.0.0.1")]
    assert pod_rank(pod(1, 3)) == 3
    assert pod_rank(pod(1, 0)) == 0


def test_a_pods_rank_is_read_in_the_layout_its_pytorchjob_was_rendered_in() -> None:
    # Workers only (this operator's PyTorchJobs): Worker i is rank i; a Master there is no rank of ours.
    assert [pod_rank(pod(1, rank)) for rank in range(3)] == [0, 1, 2]
    stray = pod(1, 0)
    stray["metadata"]["labels"][REPLICA_TYPE_LABEL] = "master"
    assert pod_rank(stray) is None
    # An attempt an earlier operator rendered (Master 0 is rank 0, Worker i is rank i + 1), still running
    # across an upgrade: its pods have no layout label.
    for kind, index, rank in (("master", 0, 0), ("worker", 0, 1), ("worker", 2, 3)):
        legacy = pod(1, 0)
        legacy["metadata"]["name"] = f"tiny-lm-1-{kind}-{index}"
        legacy["metadata"]["labels"] |= {REPLICA_TYPE_LABEL: kind, REPLICA_INDEX_LABEL: str(index)}
        del legacy["metadata"]["labels"][RANK_LAYOUT_LABEL]
        assert pod_rank(legacy) == rank, (kind, index)
        legacy["metadata"]["labels"] = {}
        assert pod_rank(legacy) == rank, ("from the name", kind, index)
    unlabeled = pod(1, 2)
    unlabeled["metadata"]["labels"] = {REPLICA_INDEX_LABEL: "-1"}
    assert pod_rank(unlabeled) == 3  # no replica type: from the name, an earlier operator's Worker 2


def test_last_transition_time_moves_only_when_the_status_changes() -> None:
    cluster = started_cluster()
    cluster.step(T0 + timedelta(seconds=20), {"tiny-lm-1-worker-0": report()})
    running = cluster.status.condition("Running")
    assert running is not None
    assert running.status == "True"
    first = running.last_transition_time
    cluster.step(T0 + timedelta(seconds=50), {"tiny-lm-1-worker-0": report(step=500)})
    running = cluster.status.condition("Running")
    assert running is not None
    assert running.last_transition_time == first
    cluster.set_pod(pod(1, 0, exit_code=137))
    cluster.step(T0 + timedelta(seconds=80))
    running = cluster.status.condition("Running")
    assert running is not None
    assert running.status == "False"
    assert running.last_transition_time == "2030-01-01T00:01:20Z"


def test_merge_patch_round_trip() -> None:
    old = {"a": 1, "b": {"c": 2, "d": 3}, "e": [1, 2], "f": "x"}
    new = {"a": 1, "b": {"c": 5}, "e": [1], "g": 7}
    assert apply_merge_patch(old, merge_patch(old, new)) == new
    assert merge_patch(new, new) == {}


# ------------------------------------------------------------------------------------ goodput ---
def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def rank0(attempt: int, step: int, resumed: int = 0, **status: Any) -> dict[str, SidecarReport]:
    """Rank 0's sidecar of ``attempt`` reporting ``step``, resumed from checkpoint step ``resumed``."""
    return {f"tiny-lm-{attempt}-worker-0": report(step=step, resumed_step=resumed, **status)}


def test_goodput_loses_the_work_after_the_checkpoint_a_restart_resumed_from() -> None:
    # Attempt 1 is created at t=0 and runs at 1 step/s: seen at step 10 (t=10) and step 110 (t=110).
    cluster = Cluster.of()
    cluster.step(at(0))
    assert cluster.status.job_started_at == "2030-01-01T00:00:00.000000Z"
    assert cluster.status.goodput == 0.0  # nothing kept yet
    cluster.run_pods(1)
    cluster.step(at(10), rank0(1, 10))
    cluster.step(at(110), rank0(1, 110))
    assert cluster.status.goodput == 1.0  # extrapolated back to its resume step 0: all 110 s kept
    # Rank 1 crashes at t=110; the gang restarts after the 10 s backoff.
    cluster.set_pod(pod(1, 1, exit_code=137))
    assert cluster.step(at(110), rank0(1, 110)).action is PlanAction.RESTART
    assert cluster.step(at(115)).action is PlanAction.WAIT
    assert cluster.status.goodput == round(110 / 115, 4)  # backoff is wall time, not kept time
    assert cluster.step(at(120)).action is PlanAction.CREATE
    # Attempt 2 resumed from the checkpoint at step 50: steps 50..110 of attempt 1 are redone, lost.
    cluster.run_pods(2)
    cluster.step(at(140), rank0(2, 60, resumed=50))
    cluster.step(at(240), rank0(2, 160, resumed=50))
    # Kept: steps 0..50 of attempt 1 (50 s) and 50..160 of attempt 2 (110 s, from t=130) over 240 s.
    assert cluster.status.goodput == round(160 / 240, 4)
    history = cluster.status.step_history
    assert history is not None
    assert [(r.attempt, r.resumed_step, r.first_step, r.last_step) for r in history] == [
        (1, 0, 10, 110),
        (2, 50, 60, 160),
    ]
    assert history[1].started_at == "2030-01-01T00:02:00.000000Z"
    assert history[1].last_step_at == "2030-01-01T00:04:00.000000Z"
    # Success freezes it: the job's wall time ends there.
    cluster.current_job()["status"] = {"conditions": [{"type": "Succeeded", "status": "True"}]}
    assert cluster.step(at(250)).action is PlanAction.SUCCEED
    assert cluster.status.goodput == round(160 / 250, 4)
    cluster.step(at(4000))
    assert cluster.status.goodput == round(160 / 250, 4)


def test_the_status_gives_the_rate_the_eta_to_max_steps_and_the_time_lost_to_recoveries() -> None:
    # The goodput scenario above, with the loop's declared end (max_steps 1000) in the workers' status.
    cluster = Cluster.of()
    cluster.step(at(0))
    cluster.run_pods(1)
    cluster.step(at(10), rank0(1, 10, max_steps=1000))
    cluster.step(at(110), rank0(1, 110, max_steps=1000))
    st = cluster.status
    assert (st.max_steps, st.steps_per_second, st.eta_seconds, st.lost_seconds) == (1000, 1.0, 890, 0.0)
    assert (st.eta, st.lost) == ("14m50s", "0s")  # what `kubectl get gtj` prints
    cluster.set_pod(pod(1, 1, exit_code=137))
    assert cluster.step(at(110), rank0(1, 110, max_steps=1000)).action is PlanAction.RESTART
    cluster.step(at(115))
    st = cluster.status
    # Restarting: no rate, no ETA (nothing steps); what is lost so far is the backoff.
    assert (st.steps_per_second, st.eta_seconds, st.lost_seconds) == (None, None, 5.0)
    assert (st.eta, st.lost) == (None, "5s")
    assert "stepsPerSecond" not in cluster.body["status"]
    cluster.step(at(120))
    cluster.run_pods(2)
    cluster.step(at(140), rank0(2, 60, resumed=50, max_steps=1000))
    cluster.step(at(240), rank0(2, 160, resumed=50, max_steps=1000))
    st = cluster.status
    # 1 step/s again: 840 steps to go. Lost: 240 s of wall time, 160 s of it on kept steps (goodput's).
    assert (st.steps_per_second, st.eta_seconds, st.lost_seconds) == (1.0, 840, 80.0)
    assert (st.eta, st.lost) == ("14m00s", "1m20s")
    assert st.goodput == round(160 / 240, 4)


def test_without_a_declared_end_there_is_a_rate_but_no_eta() -> None:
    cluster = Cluster.of()
    cluster.step(at(0))
    cluster.run_pods(1)
    cluster.step(at(10), rank0(1, 10))
    cluster.step(at(30), rank0(1, 50))
    assert (cluster.status.steps_per_second, cluster.status.eta_seconds) == (2.0, None)


def test_goodput_counts_steps_made_after_the_last_look_that_the_next_attempt_resumed_from() -> None:
    cluster = Cluster.of()
    cluster.step(at(0))
    cluster.run_pods(1)
    cluster.step(at(10), rank0(1, 10))
    cluster.step(at(100), rank0(1, 100))
    # A checkpoint at step 104 is written after the last look, then rank 0 crashes at t=105.
    cluster.set_pod(pod(1, 0, exit_code=1))
    cluster.step(at(105))
    cluster.step(at(115))
    cluster.run_pods(2)
    cluster.step(at(130), rank0(2, 110, resumed=104))
    cluster.step(at(170), rank0(2, 150, resumed=104))
    # Attempt 1 reached 104 at ~t=104 (its own rate), attempt 2 went 104..150 in 46 s: 150 s of 170.
    assert cluster.status.goodput == round(150 / 170, 4)


def test_goodput_after_a_hang_that_followed_a_checkpoint_matches_the_hand_computation() -> None:
    # Attempt 1 is created at t=0 and steps at 1 step/s; the operator looks every 10 s. Its status is
    # last seen at step 80 (t=80): it wrote the clean checkpoint at 90 (t=90) and hung at step 92
    # before its status said more. The sidecar declares the hang at t=130.
    cluster = Cluster.of()
    cluster.step(at(0))
    cluster.run_pods(1)
    for t in range(10, 81, 10):
        cluster.step(at(t), rank0(1, t))
    for t in range(90, 121, 10):
        cluster.step(at(t), rank0(1, 80))
    hung = report(alive=False, reason="no step for 38 s (hang timeout 30 s), last step 80", step=80)
    assert cluster.step(at(130), {"tiny-lm-1-worker-0": hung}).action is PlanAction.RESTART
    assert cluster.step(at(140)).action is PlanAction.CREATE  # after the 10 s backoff
    # Attempt 2 resumed from 90; seen at step 100 (t=150) and 150 (t=250): 2 s a step after a quick
    # start, so at that rate step 90 would be at t=130 -- before attempt 2 was created.
    cluster.run_pods(2)
    plan = cluster.step(at(150), rank0(2, 100, resumed=90))
    recovered = [e.message for e in plan.events if e.reason == "Recovered"]
    assert recovered == [
        "attempt 2 is training again at step 100, resumed from step 90 (attempt 1 was last seen at "
        "step 80: 0 step(s) redone), 20 s after the failure"
    ]
    cluster.step(at(250), rank0(2, 150, resumed=90))
    # By hand: steps 0..90 took 90 s in attempt 1 (its rate, carried on from 80 to the checkpoint
    # attempt 2 resumed from); steps 90..150 took 110 s in attempt 2, from its creation at t=140 at the
    # earliest. Kept 200 s of 250 s.
    assert cluster.status.goodput == 0.8


def test_goodput_discards_steps_undone_by_a_rollback() -> None:
    cluster = Cluster.of()
    cluster.step(at(0))
    cluster.run_pods(1)
    cluster.step(at(10), rank0(1, 10))
    cluster.step(at(100), rank0(1, 100))
    cluster.step(at(110), rank0(1, 80, rollbacks=1))  # rolled back to the snapshot at step 80
    cluster.step(at(130), rank0(1, 100, rollbacks=1))
    history = cluster.status.step_history
    assert history is not None
    assert [(r.attempt, r.resumed_step, r.first_step, r.last_step) for r in history] == [
        (1, 0, 10, 100),
        (1, None, 80, 100),
    ]
    # Kept: steps 0..80 (80 s) and 80..100 again (20 s) over 130 s.
    assert cluster.status.goodput == round(100 / 130, 4)


def test_the_step_history_in_the_status_is_bounded() -> None:
    cluster = Cluster.of()
    cluster.step(at(0))
    cluster.run_pods(1)
    # Thirty rollbacks, each back by 5 steps after 10 new ones: 1 step/s, each look 1 s apart.
    step, clock = 0, 0.0
    for _ in range(30):
        for _ in range(10):
            step, clock = step + 1, clock + 1
            cluster.step(at(clock), rank0(1, step))
        step, clock = step - 5, clock + 1
        cluster.step(at(clock), rank0(1, step))
    status = cluster.status
    assert status.step_history is not None
    assert len(status.step_history) == MAX_RECORDS
    assert status.step_history_folded is not None
    # Every look took 1 s; 5 of every 11 looks' worth of steps were undone: the final 150 steps took
    # 150 s of kept time (1 s a step), out of 330 s.
    assert status.goodput == pytest.approx(150 / 330, abs=1e-3)
    assert len(json.dumps(status.to_wire())) < 8000


def linear_attempts(count: int) -> tuple[list[StepRecord], FoldedHistory | None]:
    """``count`` attempts at 1 step/s, 100 s apart; each resumes 10 steps before where the last was seen."""
    history: list[StepRecord] = []
    folded: FoldedHistory | None = None
    resumed = 0
    for attempt in range(1, count + 1):
        start = 100.0 * (attempt - 1)
        for seconds, step in ((start + 20, resumed + 10), (start + 70, resumed + 60)):
            history, folded = record_progress(
                history,
                folded,
                attempt=attempt,
                started_at=iso_precise(at(start)),
                resumed_step=resumed,
                step=step,
                now=at(seconds),
            )
        resumed += 50
    return history, folded


def test_folding_old_records_keeps_the_kept_time_of_a_steady_job() -> None:
    history, folded = linear_attempts(30)
    assert len(history) == MAX_RECORDS
    assert folded is not None
    assert (folded.from_step, folded.to_step) == (0, 9 * 50 + 60)  # attempts 1..10 folded
    # Each attempt kept 50 s (the next one resumed 10 steps short of its last), the last one 60 s.
    assert kept_seconds(history, folded) == pytest.approx(29 * 50 + 60)
    assert job_goodput(history, folded, iso_precise(at(0)), at(29 * 100 + 70)) == round(1510 / 2970, 4)
    assert job_goodput([], None, None, at(10)) is None


# -------------------------------------------------------------------------------------- fuzz ---
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
SPEC_KEYS = ["replicas", "template", "checkpoint", "guard", "health", "recovery", "dataQuality"]


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = gtj_manifest()
    for key in draw(st.lists(st.sampled_from(SPEC_KEYS), max_size=3, unique=True)):
        body["spec"][key] = draw(JSON)
    if draw(st.booleans()):
        body["status"] = draw(
            st.dictionaries(
                st.sampled_from(
                    [
                        "attempt",
                        "phase",
                        "conditions",
                        "pinned",
                        "nextAttemptAt",
                        "remediation",
                        "restarts",
                        "stepHistory",
                        "stepHistoryFolded",
                        "jobStartedAt",
                        "goodput",
                    ]
                ),
                JSON,
                max_size=4,
            )
        )
    return body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies(), st.lists(JSON, max_size=2), JSON, JSON, st.booleans())
def test_any_object_content_gives_a_plan_never_an_exception_nor_a_hot_loop(
    body: dict[str, Any], junk_pods: list[Any], pod_status: Any, sidecar_document: Any, crd: bool
) -> None:
    """Whatever the job, its pods and its sidecars contain, a step gives a plan (never raises), writes
    a status the CRD accepts, renders only valid PyTorchJobs, and never asks to come back at once."""
    odd = pod(1, 1)
    odd["status"] = pod_status
    body["metadata"]["uid"] = UID
    pods = [p for p in junk_pods if isinstance(p, dict)] + [pod(1, 0), odd]
    jobs = [
        {
            "metadata": {
                "name": "tiny-lm-1",
                "labels": {JOB_LABEL: "tiny-lm"},
                "ownerReferences": [{"uid": UID}],
            }
        }
    ]
    sidecars = {"tiny-lm-1-worker-0": SidecarReport.from_document(sidecar_document)}
    world = World(body=body, jobs=jobs if crd else None, pods=pods, sidecars=sidecars, now=T0)
    plan = reconcile(world, SETTINGS)
    assert plan.requeue_seconds >= MIN_REQUEUE_SECONDS
    assert isinstance(plan.patch, dict)
    json.dumps(plan.patch)  # what is written is JSON
    assert [e.message for e in status_validator().iter_errors(plan.status.to_wire())] == []
    if plan.create is not None:
        assert schema_errors(plan.create) == []


# Mostly within the status contract (so that statuses get through), sometimes beyond it.
COUNTS = st.integers(0, 2**53) | st.integers(-(2**70), 2**70)
TIMES = st.floats(0, 1e12) | st.floats(-1e30, 1e30)
STATUS_FIELDS = st.fixed_dictionaries(
    {"started_at": TIMES},
    optional={
        "phase": st.sampled_from(["starting", "running", "rolling-back", "diverged", "finished", "failed"]),
        "step": COUNTS,
        "resumed_step": COUNTS,
        "last_step_time": TIMES | st.none(),
        "rollbacks": COUNTS,
        "skipped_steps": COUNTS,
        "samples_seen": COUNTS,
        "samples_dropped": COUNTS,
        "message": st.text(max_size=5000),
        "last_clean_checkpoint": st.fixed_dictionaries(
            {"step": COUNTS, "path": st.text(max_size=9) | st.text(min_size=1025, max_size=1100)},
            optional={"time": TIMES, "sha256": st.just("ab" * 32)},
        ),
    },
)
MESSAGES = st.text(max_size=300) | JSON.map(json.dumps) | STATUS_FIELDS.map(json.dumps)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from([None, 0, 1, 2, 134, 137, 200]), MESSAGES), max_size=4
    ),
    st.none() | STATUS_FIELDS,
)
def test_any_termination_message_or_sidecar_status_gives_a_plan_never_an_exception(
    ends: list[tuple[int, int | None, str]], live: dict[str, Any] | None
) -> None:
    """Whatever the workers leave as their termination messages (text, JSON, statuses with absurd
    numbers) and whatever a sidecar serves, a step gives a plan and writes a status the CRD accepts."""
    cluster = started_cluster()
    for rank, code, message in ends:
        ended = pod(1, rank, exit_code=code) if code is not None else pod(1, rank)
        if code is not None:
            ended["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = message
        cluster.pods.append(ended)  # beside the running pod of the same rank: two pods, one rank
    sidecars = {"tiny-lm-1-worker-0": SidecarReport.from_document(sidecar_body(live))}
    plan = cluster.plan(T0 + timedelta(seconds=30), sidecars)
    assert plan.requeue_seconds >= MIN_REQUEUE_SECONDS
    json.dumps(plan.patch)
    assert [e.message for e in status_validator().iter_errors(plan.status.to_wire())] == []
    assert all(len(e.message) < 10_000 for e in plan.events)


def test_the_pace_gauges_mirror_the_status_in_base_units() -> None:
    metrics = OperatorMetrics()
    metrics.observe_status(
        "job", "ns", JobStatus(steps_per_second=2.5, eta_seconds=840, lost_seconds=80.0, goodput=0.5)
    )
    sample = metrics.registry.get_sample_value
    labels = {"job": "job", "namespace": "ns"}
    assert sample("trainguard_job_steps_per_second", labels) == 2.5
    assert sample("trainguard_job_eta_seconds", labels) == 840
    assert sample("trainguard_job_lost_seconds", labels) == 80.0
    metrics.forget("job", "ns")
    assert sample("trainguard_job_eta_seconds", labels) is None


# ---------------------------------------------------------------------------------- stragglers ---
def straggler_cluster(action: str) -> Cluster:
    """A job of three ranks whose attempt 1 runs, rank 2 on node node-c, with ``health.straggler``."""
    manifest = gtj_manifest(
        replicas=3,
        recovery={"backoffSeconds": [10, 30, 90], "maxRestarts": 3},
        health={"straggler": {"action": action, "threshold": 1.5}},
    )
    cluster = Cluster.of(manifest)
    assert cluster.step(T0).action is PlanAction.CREATE
    cluster.run_pods(1, replicas=3)
    slow = pod(1, 2)
    slow["spec"] = {"nodeName": "node-c"}
    cluster.set_pod(slow)
    return cluster


def paced(rank2: float) -> dict[str, SidecarReport]:
    """The three ranks' sidecars: ranks 0 and 1 compute 0.1 s a step, rank 2 ``rank2`` s (best 0.1)."""
    names = ["tiny-lm-1-worker-0", "tiny-lm-1-worker-1", "tiny-lm-1-worker-2"]
    computes = [0.1, 0.1, rank2]
    return {
        name: report(rank=rank, world_size=3, compute_seconds=compute, best_compute_seconds=0.1)
        for rank, (name, compute) in enumerate(zip(names, computes, strict=True))
    }


def test_a_straggler_is_named_in_the_status_an_event_and_the_metric_and_only_reported() -> None:
    cluster = straggler_cluster("report")
    plan = cluster.step(T0 + timedelta(seconds=10), paced(0.2))
    assert plan.action is PlanAction.NOTHING
    found = cluster.status.straggler
    assert found is not None
    assert (found.rank, found.pod, found.node, found.score) == (2, "tiny-lm-1-worker-2", "node-c", 2.0)
    assert found.own_score == 2.0
    assert "rank 2 (pod tiny-lm-1-worker-2 on node node-c) is a straggler" in found.message
    assert cluster.status.straggler_scores == [0.667, 0.667, 2.0]  # 0.1 over the median of 0.1 and 0.2
    assert reasons(plan) == ["StragglerDetected"]
    assert "node-c" in plan.events[0].message
    # Named once: the next look says nothing new; a rank back at the gang's pace clears it.
    assert reasons(cluster.step(T0 + timedelta(seconds=20), paced(0.2))) == []
    cleared = cluster.step(T0 + timedelta(seconds=30), paced(0.1))
    assert reasons(cleared) == ["StragglerCleared"]
    assert cluster.status.straggler is None
    metrics = OperatorMetrics()
    metrics.observe_status("tiny-lm", "research", cluster.status)
    sample = metrics.registry.get_sample_value(
        "trainguard_worker_straggler_score", {"job": "tiny-lm", "namespace": "research", "rank": "2"}
    )
    assert sample == 1.0


def test_a_straggler_restart_keeps_the_next_attempt_off_its_node_and_lets_the_pods_checkpoint() -> None:
    cluster = straggler_cluster("restart")
    plan = cluster.step(T0 + timedelta(seconds=10), paced(0.3))
    assert plan.action is PlanAction.RESTART
    assert plan.stop_pods_within_seconds is None  # a whole gang: the pods' own grace, to checkpoint
    assert reasons(plan) == ["StragglerDetected", "Straggler", "GangRestart"]
    failure = cluster.status.last_failure
    assert failure is not None
    assert (failure.reason, failure.rank) == ("Straggler", 2)
    assert cluster.status.avoid_node == "node-c"
    created = cluster.step(T0 + timedelta(seconds=30))
    assert created.action is PlanAction.CREATE
    assert created.create is not None
    for replica in created.create["spec"]["pytorchReplicaSpecs"].values():
        terms = replica["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"]
        assert terms == [
            {
                "matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-c"]}
                ]
            }
        ]
