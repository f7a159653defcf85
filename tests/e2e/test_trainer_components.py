"""Kubeflow Trainer v2 against the real control plane: the JobSet controller and Trainer's manager.

``tests/support/trainer.py`` runs JobSet v0.12.0's controller and Trainer v2.3.0's controller manager,
built from the Go module proxy by ``scripts/trainer.sh``, as host processes against the session's API
server, with the CRDs and the torch-distributed runtime of their modules and their admission webhooks
registered by URL. No kubelet is needed here: these tests pin what the two controllers and their
webhooks do with the objects themselves: a TrainJob on ``torch-distributed`` becomes a JobSet (Trainer),
defaulted by JobSet's webhook, and that JobSet becomes its indexed Job (JobSet's controller).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from tests.support import trainer
from tests.support.cluster import wait_for
from tests.support.controlplane import ControlPlane
from tests.support.trainer import Trainer

TIMEOUT = 60.0


def read(plane: ControlPlane, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    """One object as JSON, or None while it does not exist."""
    result = plane.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    if result.returncode != 0:
        assert "NotFound" in result.stderr, result.stderr
        return None
    document: dict[str, Any] = json.loads(result.stdout)
    return document


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


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def test_a_trainjob_becomes_a_defaulted_jobset_and_its_indexed_job(
    control_plane: ControlPlane, kubeflow_trainer: Trainer
) -> None:
    """A TrainJob of 2 nodes on torch-distributed becomes a JobSet of the same name, owned by it, whose
    node container has torchrun's environment (PET_*), and which JobSet's defaulting webhook completed
    (success policy, startup order, DNS hostnames: its controller relies on them); the JobSet becomes
    one indexed Job of 2 completions."""
    plane = control_plane
    namespace = f"trainjob-{uuid.uuid4().hex[:6]}"
    plane.kubectl("create", "namespace", namespace)
    name = "tiny"
    job = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "runtimeRef": {"name": trainer.TORCH_RUNTIME_NAME},
            "trainer": {"image": "x", "command": ["true"], "numNodes": 2, "numProcPerNode": 1},
        },
    }
    try:
        plane.kubectl("create", "-f", "-", stdin=json.dumps(job))
        created = read(plane, "trainjob", name, namespace)
        assert created is not None
        jobset = wait_for("the JobSet", lambda: read(plane, "jobset", name, namespace), TIMEOUT)
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
        indexed = wait_for(
            "the JobSet's Job", lambda: read(plane, "job", f"{name}-node-0", namespace), TIMEOUT
        )
        assert indexed["spec"]["completionMode"] == "Indexed"
        assert (indexed["spec"]["completions"], indexed["spec"]["parallelism"]) == (2, 2)
    finally:
        plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
