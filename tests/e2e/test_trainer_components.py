"""Kubeflow Trainer v2 against the real control plane: the JobSet controller and Trainer's manager.

``tests/support/trainer.py`` runs JobSet v0.12.0's controller and Trainer v2.3.0's controller manager,
built from the Go module proxy by ``scripts/trainer.sh``, as host processes against the session's API
server, with the CRDs and the torch-distributed runtime of their modules and their admission webhooks
registered by URL. No kubelet is needed here: these tests pin what the two controllers and their
webhooks do with the objects themselves: a TrainJob on ``torch-distributed`` becomes a JobSet (Trainer),
defaulted by JobSet's webhook, and that JobSet becomes its indexed Job (JobSet's controller).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import trainer
from tests.support.controlplane import ControlPlane
from tests.support.trainer import Trainer

from .test_controlplane_components import Api, wait_for

GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"


@pytest.fixture(scope="module")
def api(control_plane: ControlPlane, kubeflow_trainer: Trainer) -> Iterator[Api]:
    """Clients for the control plane, once Trainer runs on it."""
    apis = Api(control_plane)
    yield apis
    apis.client.close()


def test_both_controllers_are_ready_and_their_crds_established(
    control_plane: ControlPlane, kubeflow_trainer: Trainer
) -> None:
    """Both processes run and got ready, every CRD of both modules is Established and served, their
    webhook configurations call 127.0.0.1 with the test CA, and the shipped runtime was admitted."""
    assert [p.name for p in kubeflow_trainer.processes()] == list(trainer.BINARIES)
    assert all(p.alive() for p in kubeflow_trainer.processes())
    served, detail = trainer._kinds_served(control_plane, trainer.JOBSET_KINDS + trainer.TRAINER_KINDS)()
    assert served, detail
    for kind, name in kubeflow_trainer.webhooks:
        config = control_plane.kubectl("get", kind, name, "-o", "json").stdout
        assert '"url": "https://127.0.0.1:' in config, config
    assert {name for _, name in kubeflow_trainer.webhooks} == {
        "trainguard-test-jobset",
        "trainguard-test-trainer",
    }
    runtime = control_plane.kubectl(
        "get", "clustertrainingruntime", trainer.TORCH_RUNTIME_NAME, "-o", "jsonpath={.spec.mlPolicy}"
    ).stdout
    assert '"torch"' in runtime, runtime


def read_jobset(api: Api, namespace: str, name: str) -> dict[str, Any] | None:
    """The JobSet ``namespace/name``, or None while it does not exist."""
    reader = api.custom.get_namespaced_custom_object
    return api.read(reader, "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", name)


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def test_a_trainjob_becomes_a_defaulted_jobset_and_its_indexed_job(api: Api) -> None:
    """A TrainJob of 2 nodes on torch-distributed becomes a JobSet of the same name, owned by it, whose
    node container has torchrun's environment (PET_*), and which JobSet's defaulting webhook completed
    (success policy, startup order, DNS hostnames: its controller relies on them); the JobSet becomes
    one indexed Job of 2 completions."""
    namespace = f"trainjob-{uuid.uuid4().hex[:6]}"
    api.core.create_namespace({"metadata": {"name": namespace}})
    name = "tiny"
    job = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {"name": name},
        "spec": {
            "runtimeRef": {"name": trainer.TORCH_RUNTIME_NAME},
            "trainer": {"image": "x", "command": ["true"], "numNodes": 2, "numProcPerNode": 1},
        },
    }
    try:
        created = api.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "trainjobs", job)
        jobset = wait_for("the JobSet", lambda: read_jobset(api, namespace, name))
        owners = jobset["metadata"]["ownerReferences"]
        assert [(o["kind"], o["uid"]) for o in owners] == [("TrainJob", created["metadata"]["uid"])]
        spec = jobset["spec"]
        assert spec["successPolicy"]["operator"] == "All"
        assert spec["startupPolicy"]["startupPolicyOrder"] == "AnyOrder"
        assert spec["network"]["enableDNSHostnames"] is True
        (replicated,) = spec["replicatedJobs"]
        (container,) = replicated["template"]["spec"]["template"]["spec"]["containers"]
        env = _env(container)
        assert (env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == ("2", "1")
        assert env["PET_MASTER_ADDR"] == f"{name}-node-0-0.{name}"
        from kubernetes import client

        batch: Any = client.BatchV1Api(api.client)
        indexed = wait_for(
            "the JobSet's Job",
            lambda: api.read(batch.read_namespaced_job, f"{name}-node-0", namespace),
        )
        assert indexed["spec"]["completionMode"] == "Indexed"
        assert (indexed["spec"]["completions"], indexed["spec"]["parallelism"]) == (2, 2)
    finally:
        api.core.delete_namespace(namespace)
