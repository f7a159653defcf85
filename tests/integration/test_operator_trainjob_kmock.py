"""The real operator against kmock on a cluster with Kubeflow Trainer v2 and no training operator: the
test plays Trainer, JobSet and the kubelet (it creates each TrainJob's pods as JobSet's Indexed Job
would, and writes their states), so what is checked is the operator's side of the TrainJob backend."""

from __future__ import annotations

import asyncio
import copy
import time
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio
import yaml
from trainguard_operator.backends.trainjob import COMPLETION_INDEX, JOBSET_NAME_LABEL, PATCH_MANAGER

from tests.support.kube_emulator import Emulator
from tests.support.operator_harness import (
    GTJ_PATH,
    KUBELET,
    NS,
    POD_PATH,
    Sidecars,
    alive,
    conditions,
    configure_operator,
    creations,
    event_reasons,
    eventually,
    gtj,
    install_crd,
    operator,
    patch,
    post,
    scrape,
    status,
    stored,
    value,
)

pytestmark = pytest.mark.kmock(cls=Emulator)

TJ = "trainer.kubeflow.org/v1alpha1/trainjobs"
TJ_PATH = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs"


def trainjob_crd(directory: Path) -> Path:
    """A TrainJob CRD as the API server needs it to serve the kind (names, scope, version, status
    subresource; the schema preserves every field: what Trainer's own schema says is not under test)."""
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "trainjobs.trainer.kubeflow.org"},
        "spec": {
            "group": "trainer.kubeflow.org",
            "names": {
                "kind": "TrainJob",
                "plural": "trainjobs",
                "singular": "trainjob",
                "listKind": "TrainJobList",
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1alpha1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    },
                }
            ],
        },
    }
    path = directory / "trainjobs.trainer.kubeflow.org.yaml"
    path.write_text(yaml.safe_dump(crd))
    return path


@pytest_asyncio.fixture
async def trainer_cluster(bare_cluster: kmock.KubernetesEmulator, tmp_path: Path) -> kmock.KubernetesEmulator:
    """``bare_cluster`` with the TrainJob CRD installed (and no PyTorchJob CRD)."""
    await install_crd(bare_cluster, trainjob_crd(tmp_path))
    return bare_cluster


@pytest.fixture
def trainer_env(monkeypatch: pytest.MonkeyPatch, sidecars: Sidecars) -> int:
    """The operator's settings, with trainguard's runtime probing every second (as ``gtj`` asks)."""
    return configure_operator(monkeypatch, sidecars.port, trainjob_probe_period_seconds="1")


async def start_jobset_pods(
    emulator: kmock.KubernetesEmulator, job: dict[str, Any], ips: list[str]
) -> list[str]:
    """Create a TrainJob's pods as JobSet's Indexed Job would: the runtime patch's labels, the
    completion index, the JobSet's name; Running at the given IPs."""
    name = job["metadata"]["name"]
    (entry,) = job["spec"]["runtimePatches"]
    (node,) = entry["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    template = node["template"]["spec"]["template"]
    names = []
    for rank, ip in enumerate(ips):
        pod_name = f"{name}-node-0-{rank}-abcde"
        labels = {**template["metadata"]["labels"], COMPLETION_INDEX: str(rank), JOBSET_NAME_LABEL: name}
        annotations = {**template["metadata"]["annotations"], COMPLETION_INDEX: str(rank)}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "namespace": NS,
                "labels": labels,
                "annotations": annotations,
                "finalizers": [KUBELET],
            },
            "spec": {"containers": [{"name": "node", "image": "registry.example/tiny-lm:1"}]},
            "status": {
                "phase": "Running",
                "podIP": ip,
                "containerStatuses": [
                    {
                        "name": "node",
                        "restartCount": 0,
                        "state": {"running": {"startedAt": "2030-01-01T00:00:00Z"}},
                    }
                ],
            },
        }
        await post(emulator, POD_PATH, copy.deepcopy(pod))
        names.append(pod_name)
    return names


async def terminate_node(emulator: kmock.KubernetesEmulator, pod: str, exit_code: int) -> None:
    """The kubelet reports the ``node`` container terminated (the pod fails)."""
    state = {"terminated": {"exitCode": exit_code, "reason": "Error"}}
    await patch(
        emulator,
        f"{POD_PATH}/{pod}/status",
        {
            "status": {
                "phase": "Failed",
                "containerStatuses": [{"name": "node", "restartCount": 0, "state": state}],
            }
        },
    )


def env_of(job: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", "") for e in job["spec"]["trainer"]["env"]}


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_job_on_a_trainer_cluster_runs_as_trainjobs_and_recovers_from_a_crash(
    trainer_cluster: kmock.KubernetesEmulator, sidecars: Sidecars, trainer_env: int
) -> None:
    cluster = trainer_cluster
    # A user's own TrainJob on Trainer's runtime: nothing of trainguard's, so never touched.
    theirs = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "their-job", "namespace": NS, "labels": {"team": "nlp"}},
        "spec": {"runtimeRef": {"name": "torch-distributed"}, "trainer": {"numNodes": 2}},
    }
    await post(cluster, TJ_PATH, theirs)
    async with operator():
        await post(cluster, GTJ_PATH, gtj())
        job1 = await eventually(lambda: alive(cluster, TJ, "tiny-lm-1"), what="attempt 1's TrainJob")
        owner = job1["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("GuardedTrainingJob", "tiny-lm", True)
        assert job1["spec"]["runtimeRef"]["name"] == "trainguard-torch-distributed"
        assert job1["spec"]["runtimePatches"][0]["manager"] == PATCH_MANAGER
        assert env_of(job1)["TRAINGUARD_ATTEMPT"] == "1"
        # Recorded once the TrainJob exists (a creation is written after it happened).
        await eventually(lambda: status(cluster).get("trainJob") == "tiny-lm-1", what="the status write")
        assert status(cluster)["backend"] == "TrainJob"

        sidecars.write(0, step=50)
        sidecars.write(1, step=50)
        pods = await start_jobset_pods(cluster, job1, ["127.0.0.1", "127.0.0.2"])
        await eventually(lambda: status(cluster).get("phase") == "Running", what="the gang running")
        assert status(cluster)["step"] == 50

        # Rank 1 is killed: after the 1 s backoff, TrainJob 1 goes and TrainJob 2 comes.
        failed_at = time.monotonic()
        await terminate_node(cluster, pods[1], 137)
        job2 = await eventually(lambda: alive(cluster, TJ, "tiny-lm-2"), what="attempt 2's TrainJob")
        assert time.monotonic() - failed_at >= 0.9
        assert alive(cluster, TJ, "tiny-lm-1") is None
        st = status(cluster)
        assert (st["attempt"], st["restarts"], st["lastFailure"]["reason"], st["lastFailure"]["rank"]) == (
            2,
            1,
            "Crashed",
            1,
        )
        assert env_of(job2)["TRAINGUARD_ATTEMPT"] == "2"
        await eventually(lambda: {"Crashed", "GangRestart"} <= set(event_reasons(cluster)), what="events")
        seen = await scrape(trainer_env)
        assert value(seen, "trainguard_job_restarts_total", way="new_trainjob") == 1

        # Trainer marks TrainJob 2 Complete: the job is done, and stays done.
        await patch(
            cluster,
            f"{TJ_PATH}/tiny-lm-2/status",
            {"status": {"conditions": [{"type": "Complete", "status": "True", "reason": "JobsCompleted"}]}},
        )
        await eventually(lambda: status(cluster).get("phase") == "Succeeded", what="success")
        assert conditions(cluster)["Succeeded"]["status"] == "True"
        await asyncio.sleep(1.0)
        assert creations(cluster, TJ, "tiny-lm-3") == 0
    untouched = stored(cluster, TJ, "their-job")
    assert untouched is not None
    assert not untouched.deleted
    assert [v for v in untouched.history if v is not None] == [untouched.raw]
    assert untouched.raw["spec"] == theirs["spec"]
