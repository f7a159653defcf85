"""End to end on Kubeflow Trainer v2: a TrainJob on Trainer's shipped runtime trains on the real node.

Everything is real: the test cluster of ``tests/support/cluster.py`` (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, a node with containerd, the kubelet, kube-proxy and CoreDNS),
and on it JobSet v0.12.0's controller and Trainer v2.3.0's controller manager (``tests/support/
trainer.py``), built from the Go module proxy, with their CRDs, webhooks and Trainer's own
``torch-distributed`` ClusterTrainingRuntime from their modules. The TrainJob is what a Trainer user
writes: the runtime's name, an image (the example's ``tiny-lm``, which the PyTorchJob tests run too:
the project's locked CPU torch, user 1000), a command, two nodes. Its two pods find each other through
the JobSet's headless Service, as torchrun's static rendezvous at ``PET_MASTER_ADDR`` needs, and
all-reduce over gloo.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import trainer
from tests.support.cluster import Cluster, ClusterError, wait_for
from tests.support.trainer import Trainer

# Each rank adds rank + 1; the sum over two ranks is 3 on both. The ranks print it, so the test reads
# what torch computed across the pods, not only that they exited 0.
ALL_REDUCE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: all_reduce {total.item():.0f}", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture
def namespace(e2e_cluster: Cluster, kubeflow_trainer: Trainer) -> Iterator[str]:
    """A fresh namespace on the cluster with Trainer running; deleted afterwards."""
    name = f"trainjob-{uuid.uuid4().hex[:6]}"
    e2e_cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        e2e_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def trainjob(name: str, image: str) -> dict[str, Any]:
    """A TrainJob of two nodes on the shipped torch-distributed runtime, running ALL_REDUCE by torchrun
    (its module: the image's venv has no console scripts), which reads the PET_* variables Trainer sets."""
    command = ["python", "-m", "torch.distributed.run", "--no-python", "python", "-c", ALL_REDUCE]
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name},
        "spec": {
            "runtimeRef": {"name": trainer.TORCH_RUNTIME_NAME},
            "trainer": {"image": image, "command": command, "numNodes": 2, "numProcPerNode": 1},
        },
    }


def _conditions(document: dict[str, Any] | None) -> dict[str, str]:
    conditions = (document or {}).get("status", {}).get("conditions") or []
    return {c["type"]: c["status"] for c in conditions}


@pytest.mark.timeout(600)
def test_a_trainjob_on_the_shipped_torch_runtime_runs_to_complete_on_the_node(
    e2e_cluster: Cluster, kubeflow_trainer: Trainer, namespace: str
) -> None:
    """Two pods of the TrainJob all-reduce across the node's pod network and exit 0; the JobSet
    completes and Trainer marks the TrainJob Complete."""
    name = "tiny"
    started = time.monotonic()
    document = trainjob(name, e2e_cluster.node.images["tiny-lm"])
    e2e_cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(document))

    def finished() -> dict[str, str] | None:
        conditions = _conditions(e2e_cluster.get("trainjob", name, namespace))
        return (
            conditions if {"Complete", "Failed"} & {k for k, v in conditions.items() if v == "True"} else None
        )

    try:
        conditions = wait_for("the TrainJob to finish", finished, timeout=480, interval=1.0)
    except ClusterError as exc:
        raise AssertionError(f"{exc}\n{diagnostics(e2e_cluster, kubeflow_trainer, namespace)}") from exc
    assert conditions.get("Complete") == "True", diagnostics(e2e_cluster, kubeflow_trainer, namespace)
    assert conditions.get("Failed") != "True"
    print(f"\nTrainJob {name}: Complete in {time.monotonic() - started:.1f} s")
    jobset = e2e_cluster.get("jobset", name, namespace)
    assert _conditions(jobset).get("Completed") == "True"
    logs = e2e_cluster.pod_logs(namespace)
    for rank in (0, 1):
        assert f"rank {rank} of 2: all_reduce 3" in logs, logs


def diagnostics(cluster: Cluster, running: Trainer, namespace: str) -> str:
    """The namespace's Trainer objects, pods, events and logs, and both controllers' log tails."""
    return "\n".join(
        [
            cluster.kubectl("get", "trainjobs,jobsets,jobs,pods", "-n", namespace, "-o", "wide", check=False),
            cluster.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False),
            cluster.pod_logs(namespace),
            running.log_tails(),
        ]
    )
