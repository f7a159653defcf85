"""The rest of the test cluster against the real control plane: controller manager, scheduler, operator.

``controlplane.start_cluster`` adds kube-controller-manager, kube-scheduler and the Kubeflow training
operator (v1.9.3, PyTorchJob only) to the session's ``control_plane`` (etcd + kube-apiserver). There is
no kubelet: these tests pin what those components themselves do, each in its own namespace: the
service-account controller fills a new namespace, the garbage collector follows owner references, the
persistent-volume binder binds a claim, the scheduler binds a pod to a Ready node (one created through
the API, as a kubelet would register it), and the training operator turns a PyTorchJob into its pods
and headless Services.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from tests.support import controlplane
from tests.support.controlplane import ControlPlane

T = TypeVar("T")
TIMEOUT = 60.0


class Api:
    """The kubernetes client's APIs for one control plane, typed loosely: the tests pass plain dicts."""

    def __init__(self, plane: ControlPlane) -> None:
        from kubernetes import client

        self.plane = plane
        self.client: Any = plane.api_client()
        self.core: Any = client.CoreV1Api(self.client)
        self.custom: Any = client.CustomObjectsApi(self.client)

    def to_dict(self, obj: Any) -> dict[str, Any]:
        """A client model as the API's JSON (camelCase keys)."""
        return dict(self.client.sanitize_for_serialization(obj))

    def read(self, reader: Callable[..., Any], *args: Any) -> dict[str, Any] | None:
        """``reader(*args)`` as a dict, or None if it is not found."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self.to_dict(reader(*args))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = TIMEOUT) -> T:
    """Poll ``probe`` every 0.5 s until it returns something truthy; return that (fail after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.5)


def unique(prefix: str) -> str:
    """A DNS-1123 name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> ControlPlane:
    """The session's control plane with the controller manager, scheduler and training operator added.

    ``start_cluster`` is idempotent: another module's fixture may have started them already (then this
    is a no-op). They stay up for the rest of the session; the ``control_plane`` fixture's
    ``plane.stop()`` stops them before the API server.
    """
    missing = controlplane.missing_binaries(control_plane.bin_dir, components=True)
    if missing:
        message = (
            f"{', '.join(missing)} not built in {control_plane.bin_dir}: run bash scripts/control-plane.sh"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    controlplane.start_cluster(control_plane)
    return control_plane


@pytest.fixture(scope="module")
def api(cluster: ControlPlane) -> Iterator[Api]:
    """Clients for the cluster."""
    apis = Api(cluster)
    yield apis
    apis.client.close()


def default_service_account(api: Api, namespace: str) -> dict[str, Any] | None:
    """The namespace's ``default`` ServiceAccount, once the service-account controller has made it."""
    return api.read(api.core.read_namespaced_service_account, "default", namespace)


@contextlib.contextmanager
def new_namespace(api: Api, prefix: str) -> Iterator[str]:
    """A fresh namespace, ready for pods (its ``default`` ServiceAccount exists); deleted afterwards
    (without waiting: the namespace controller empties it in the background)."""
    name = unique(prefix)
    api.core.create_namespace({"metadata": {"name": name}})
    try:
        wait_for(f"ServiceAccount {name}/default", lambda: default_service_account(api, name))
        yield name
    finally:
        api.core.delete_namespace(name)


def test_components_are_running_and_healthy(cluster: ControlPlane) -> None:
    """start_cluster ran the three components, once each, and a second call starts nothing new."""
    names = [process.name for process in cluster.components]
    assert names == ["kube-controller-manager", "kube-scheduler", "training-operator"]
    pids = [process.pid for process in cluster.components]
    controlplane.start_cluster(cluster)
    assert [process.pid for process in cluster.components] == pids
    assert all(process.alive() for process in cluster.components)
    for name in names:
        assert cluster.startup_seconds[name] > 0


def test_service_account_controller_fills_a_new_namespace(api: Api) -> None:
    """A new namespace gets its ``default`` ServiceAccount (serviceaccount controller) and the
    ``kube-root-ca.crt`` ConfigMap (root-ca-certificate publisher) without anyone asking."""
    name = unique("sa")
    api.core.create_namespace({"metadata": {"name": name}})
    try:
        account = wait_for("the default ServiceAccount", lambda: default_service_account(api, name))
        assert account["metadata"]["namespace"] == name
        root_ca = wait_for(
            "kube-root-ca.crt",
            lambda: api.read(api.core.read_namespaced_config_map, "kube-root-ca.crt", name),
        )
        ca = (api.plane.pki / "ca.crt").read_text()
        assert root_ca["data"]["ca.crt"].strip() == ca.strip()
    finally:
        api.core.delete_namespace(name)


def test_garbage_collector_deletes_a_dependent_of_a_deleted_owner(api: Api) -> None:
    """Deleting an owner ConfigMap makes the garbage collector delete the ConfigMap that names it in its
    ownerReferences; an unrelated ConfigMap stays."""
    with new_namespace(api, "gc") as namespace:
        owner = api.to_dict(api.core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}}))
        reference = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": "owner",
            "uid": owner["metadata"]["uid"],
        }
        api.core.create_namespaced_config_map(
            namespace, {"metadata": {"name": "dependent", "ownerReferences": [reference]}}
        )
        api.core.create_namespaced_config_map(namespace, {"metadata": {"name": "bystander"}})
        api.core.delete_namespaced_config_map("owner", namespace)
        wait_for(
            "the dependent ConfigMap to be collected",
            lambda: api.read(api.core.read_namespaced_config_map, "dependent", namespace) is None,
        )
        assert api.read(api.core.read_namespaced_config_map, "bystander", namespace) is not None


def test_persistent_volume_binder_binds_a_claim_to_a_matching_volume(api: Api) -> None:
    """A hostPath PV and a claim (both ReadWriteMany, storageClassName "", the claim selecting the PV by
    label) are bound to each other by the persistentvolume-binder controller."""
    pv_name = unique("pv")
    with new_namespace(api, "pvc") as namespace:
        api.core.create_persistent_volume(
            {
                "metadata": {"name": pv_name, "labels": {"trainguard-test": pv_name}},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadWriteMany"],
                    "storageClassName": "",
                    "persistentVolumeReclaimPolicy": "Retain",
                    # No kubelet mounts it: the path is never touched.
                    "hostPath": {"path": f"/tmp/{pv_name}"},
                },
            }
        )
        try:
            api.core.create_namespaced_persistent_volume_claim(
                namespace,
                {
                    "metadata": {"name": "ckpt"},
                    "spec": {
                        "accessModes": ["ReadWriteMany"],
                        "storageClassName": "",
                        "resources": {"requests": {"storage": "1Gi"}},
                        "selector": {"matchLabels": {"trainguard-test": pv_name}},
                    },
                },
            )

            def bound_claim() -> dict[str, Any] | None:
                claim = api.read(api.core.read_namespaced_persistent_volume_claim, "ckpt", namespace)
                return claim if claim and claim.get("status", {}).get("phase") == "Bound" else None

            claim = wait_for("the claim to be Bound", bound_claim)
            assert claim["spec"]["volumeName"] == pv_name
            assert claim["status"]["accessModes"] == ["ReadWriteMany"]
            volume = wait_for(
                "the volume to be Bound",
                lambda: (
                    (pv := api.read(api.core.read_persistent_volume, pv_name))
                    and pv.get("status", {}).get("phase") == "Bound"
                    and pv
                ),
            )
            assert volume["spec"]["claimRef"]["namespace"] == namespace
            assert volume["spec"]["claimRef"]["name"] == "ckpt"
        finally:
            # The claim first: pv-protection keeps a bound volume until its claim is gone.
            with contextlib.suppress(Exception):
                api.core.delete_namespaced_persistent_volume_claim("ckpt", namespace)
            api.core.delete_persistent_volume(pv_name)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_scheduler_binds_a_pod_to_a_ready_node(api: Api) -> None:
    """A Node registered through the API (Ready, with capacity, as a kubelet would post it) gets a pending
    pod bound to it by the scheduler.

    The API server's TaintNodesByCondition admission gives every new node the not-ready taint; the
    node-lifecycle controller lifts it (it derives that taint from the Ready condition alone, so it
    does so as soon as it sees the node, even before the status is posted). The node also carries its
    own taint, which only this test's pod tolerates, so no other pending pod of the session lands there.
    """
    node = unique("tg-node")
    taint = {"key": "trainguard.dev/test", "value": node, "effect": "NoSchedule"}
    created = api.to_dict(
        api.core.create_node(
            {
                "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}},
                "spec": {"taints": [taint]},
            }
        )
    )
    try:
        assert {t["key"] for t in created["spec"]["taints"]} == {
            taint["key"],
            "node.kubernetes.io/not-ready",
        }
        now = _now()
        resources = {"cpu": "4", "memory": "8Gi", "pods": "110"}
        status = {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "registered by the test",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
        }
        # A merge patch of the status subresource: controllers may already be updating the node (a
        # read-modify-replace would race them).
        api.core.patch_node_status(node, {"status": status}, _content_type="application/merge-patch+json")

        def untainted() -> bool:
            taints = api.to_dict(api.core.read_node(node))["spec"].get("taints") or []
            return [t["key"] for t in taints] == [taint["key"]]

        wait_for("the node-lifecycle controller to lift the not-ready taint", untainted)
        with new_namespace(api, "sched") as namespace:
            api.core.create_namespaced_pod(
                namespace,
                {
                    "metadata": {"name": "p"},
                    "spec": {
                        "containers": [{"name": "c", "image": "x", "command": ["true"]}],
                        "nodeSelector": {"kubernetes.io/hostname": node},
                        "tolerations": [{**taint, "operator": "Equal"}],
                    },
                },
            )
            try:
                pod = wait_for(
                    "the pod to be bound",
                    lambda: (
                        (p := api.to_dict(api.core.read_namespaced_pod("p", namespace)))
                        and p["spec"].get("nodeName")
                        and p
                    ),
                )
                assert pod["spec"]["nodeName"] == node
                conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}
                assert conditions.get("PodScheduled") == "True"
            finally:
                # Bound to a node without a kubelet, a gracefully deleted pod would wait forever.
                api.core.delete_namespaced_pod("p", namespace, grace_period_seconds=0)
    finally:
        api.core.delete_node(node)


def existing(api: Api, reader: Callable[..., Any], *args: Any) -> Callable[[], dict[str, Any] | None]:
    """A probe for ``wait_for``: the object ``reader(*args)`` reads, once it exists."""
    return lambda: api.read(reader, *args)


def _env(pod: dict[str, Any]) -> dict[str, str]:
    container = next(c for c in pod["spec"]["containers"] if c["name"] == "pytorch")
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def test_training_operator_turns_a_pytorchjob_into_pods_and_services(api: Api) -> None:
    """A minimal PyTorchJob (Master 1 + Worker 1) becomes pods ``<name>-master-0`` and
    ``<name>-worker-0`` with torch.distributed's environment, headless Services of the same names, and a
    worker init container that waits for the master's DNS name (nslookup)."""
    name = "tiny"
    group, version, plural = "kubeflow.org", "v1", "pytorchjobs"

    def replica() -> dict[str, Any]:
        return {
            "replicas": 1,
            "restartPolicy": "OnFailure",
            "template": {"spec": {"containers": [{"name": "pytorch", "image": "x", "command": ["true"]}]}},
        }

    job = {
        "apiVersion": f"{group}/{version}",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {"pytorchReplicaSpecs": {"Master": replica(), "Worker": replica()}},
    }
    with new_namespace(api, "ptj") as namespace:
        created = api.custom.create_namespaced_custom_object(group, version, namespace, plural, job)
        try:
            pods: dict[str, dict[str, Any]] = {}
            for role in ("master", "worker"):
                replica_name = f"{name}-{role}-0"
                pods[role] = wait_for(
                    f"pod {replica_name}",
                    existing(api, api.core.read_namespaced_pod, replica_name, namespace),
                )
                service = wait_for(
                    f"service {replica_name}",
                    existing(api, api.core.read_namespaced_service, replica_name, namespace),
                )
                assert service["spec"]["clusterIP"] == "None"  # headless: DNS names the pod itself
                assert service["spec"]["selector"]["training.kubeflow.org/replica-type"] == role
                owners = pods[role]["metadata"]["ownerReferences"]
                assert [(o["kind"], o["uid"]) for o in owners] == [("PyTorchJob", created["metadata"]["uid"])]
            master, worker = _env(pods["master"]), _env(pods["worker"])
            for env in (master, worker):
                assert env["MASTER_ADDR"] == f"{name}-master-0"
                assert env["MASTER_PORT"] == "23456"  # the operator's default port
                assert env["WORLD_SIZE"] == "2"
            assert (master["RANK"], worker["RANK"]) == ("0", "1")
            init = pods["worker"]["spec"].get("initContainers") or []
            assert [c["name"] for c in init] == ["init-pytorch"]
            assert f"nslookup {name}-master-0" in " ".join(init[0]["command"])
            assert not pods["master"]["spec"].get("initContainers")
        finally:
            api.custom.delete_namespaced_custom_object(group, version, namespace, plural, name)
