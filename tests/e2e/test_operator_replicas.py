"""The chart's replicated mode on the real cluster: ``operator.replicas: 2`` is a StatefulSet whose pods
meet in kopf's ClusterKopfPeering; the highest live ordinal works, the other stands by. Deleting the
active pod in the middle of a gang restart hands the job to the standby, which carries the recovery on
from the job's status: one restart, not two. The restart is in place (the chart's default): the active
replica has ordered the pods' launchers before it goes, and the standby takes the attempt they start
in the same pods.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import Cluster, Operator
from tests.support.jobs import JOB, JobNamespace, example, operator_refusals

# The gang restart waits this long after the crash before it creates the next attempt: the window in
# which the active operator is deleted.
BACKOFF_SECONDS = 15


@pytest.fixture(scope="module")
def operator(e2e_cluster: Cluster) -> Iterator[Operator]:
    """The chart with two replicas, installed once for this module."""
    installed = e2e_cluster.install_operator(["--set=operator.replicas=2"])
    try:
        yield installed
    finally:
        e2e_cluster.uninstall_operator()


def peers(cluster: Cluster, operator: Operator) -> dict[str, Any]:
    """The live peers of the release's ClusterKopfPeering: kopf's record of each replica (its priority)."""
    peering = cluster.get("clusterkopfpeering", operator.release, "")
    return dict((peering or {}).get("status") or {})


@pytest.mark.timeout(900)
def test_deleting_the_active_operator_in_the_middle_of_a_gang_restart_restarts_the_gang_once(
    e2e_cluster: Cluster, operator: Operator, tmp_path: Path
) -> None:
    cluster = e2e_cluster
    pods = {p["metadata"]["name"]: p for p in cluster.operator_pods()}
    assert sorted(pods) == [f"{operator.service}-0", f"{operator.service}-1"]
    assert all(p["metadata"]["ownerReferences"][0]["kind"] == "StatefulSet" for p in pods.values())
    namespace = JobNamespace.create(cluster, "e2e-replicas", tmp_path / "checkpoints")
    try:
        namespace.apply(
            example(faults="crash@35:0", recovery={"maxRestarts": 2, "backoffSeconds": [BACKOFF_SECONDS]})
        )
        restarting = namespace.wait(
            "the gang restart to begin",
            lambda: (job := namespace.job()) and job.get("status", {}).get("phase") == "Restarting" and job,
            timeout=400,
        )
        # Attempt 2 is decided and ordered in attempt 1's pods (the status names both); the backoff runs.
        assert restarting["status"]["attempt"] == 2, restarting["status"]
        assert restarting["status"]["hostAttempt"] == 1, restarting["status"]
        # The active replica is the live peer of the highest priority (its StatefulSet ordinal).
        live = peers(cluster, operator)
        assert set(live) == set(pods), live
        active = max(live, key=lambda name: live[name]["priority"])
        assert active == f"{operator.service}-1"
        cluster.kubectl("delete", "pod", active, "-n", operator.namespace, "--wait=false")

        status, diagnostics = namespace.succeeded(timeout=400, restarts=1)
        assert status["attempt"] == 2, diagnostics
        reasons = namespace.reasons()
        assert reasons.count("GangRestart") == 1, reasons
        assert reasons.count("AttemptCreated") == 1, reasons
        assert "InPlaceRestartFailed" not in reasons, reasons
        assert cluster.get("pytorchjob", f"{JOB}-2", namespace.name) is None
        history = {h["attempt"]: h for h in status["stepHistory"]}
        assert 20 <= history[2]["resumedStep"] <= 35, history
        # The deleted replica came back under its name, and both are peers again.
        cluster.wait_operator_watching()
        assert operator_refusals(cluster) == []
    finally:
        namespace.delete()
