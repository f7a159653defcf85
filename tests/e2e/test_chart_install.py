"""The chart and the operator's pods against a real kube-apiserver: install, admission, uninstall."""

from __future__ import annotations

import copy
import json
from typing import Any

from trainguard_operator.render import Owner, render_pytorchjob
from trainguard_operator.settings import OperatorSettings

from tests.support import controlplane
from tests.support.paths import CHART, REPO_ROOT
from tests.support.tools import helm
from trainguard.core.spec import load_job

NAMESPACE = "trainguard-system"
WORKLOADS = "research"


def kube(plane: controlplane.ControlPlane, *args: str, stdin: str | None = None, check: bool = True) -> Any:
    """kubectl against the control plane; parsed JSON when it printed any."""
    result = plane.kubectl(*args, stdin=stdin, check=check)
    return json.loads(result.stdout) if result.stdout.strip().startswith("{") else result


def restricted_namespace(plane: controlplane.ControlPlane, name: str) -> None:
    """A namespace whose pods the real PodSecurity admission holds to the "restricted" profile."""
    kube(plane, "create", "namespace", name)
    kube(plane, "label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted")
    # No controller-manager runs here, so nothing creates the default service account pods refer to.
    kube(plane, "create", "serviceaccount", "default", "--namespace", name, check=False)


def dry_run_pod(plane: controlplane.ControlPlane, namespace: str, name: str, template: dict[str, Any]) -> Any:
    """Ask the API server to admit a pod made from ``template`` (nothing is stored)."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}}
    pod["spec"] = template["spec"]
    return plane.kubectl(
        "create", "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(pod), check=False
    )


def test_helm_install_and_uninstall_against_a_real_api_server(
    control_plane: controlplane.ControlPlane,
) -> None:
    restricted_namespace(control_plane, NAMESPACE)
    kubeconfig = f"--kubeconfig={control_plane.kubeconfig}"
    crd_name = "crd/guardedtrainingjobs.trainguard.dev"
    if kube(control_plane, "get", crd_name, check=False).returncode == 0:
        # Applied by hand earlier (by another test here; by a user's kubectl apply -f crds/ elsewhere):
        # adopt it into the release as the chart's README says, or helm refuses to install.
        kube(control_plane, "label", "--overwrite", crd_name, "app.kubernetes.io/managed-by=Helm")
        kube(control_plane, "annotate", "--overwrite", crd_name,
             "meta.helm.sh/release-name=tg", f"meta.helm.sh/release-namespace={NAMESPACE}")  # fmt: skip
    helm("install", "tg", str(CHART), "--namespace", NAMESPACE, kubeconfig, "--wait=false")
    crd = kube(control_plane, "get", "crd", "guardedtrainingjobs.trainguard.dev", "-o", "json")
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    deployment = kube(control_plane, "get", "deployment", "-n", NAMESPACE, "-l",
                      "app.kubernetes.io/instance=tg", "-o", "json")["items"]  # fmt: skip
    assert len(deployment) == 1
    for kind in ("serviceaccount", "service", "clusterrole", "clusterrolebinding"):
        found = kube(control_plane, "get", kind, "-A", "-l", "app.kubernetes.io/instance=tg", "-o", "json")
        assert found["items"], kind

    # The Deployment's pods would pass the real PodSecurity admission of a restricted namespace.
    admitted = dry_run_pod(control_plane, NAMESPACE, "operator-probe", deployment[0]["spec"]["template"])
    assert admitted.returncode == 0, admitted.stderr
    assert "violate" not in admitted.stderr

    helm("uninstall", "tg", "--namespace", NAMESPACE, kubeconfig)
    left = kube(control_plane, "get", "deployment,service,serviceaccount", "-n", NAMESPACE, "-l",
                "app.kubernetes.io/instance=tg", "-o", "json")  # fmt: skip
    assert left["items"] == []
    # crds.keep (the default) keeps the CRD, and with it every job, across an uninstall.
    kube(control_plane, "get", "crd", "guardedtrainingjobs.trainguard.dev")


def test_the_operators_worker_pods_pass_restricted_pod_security(
    control_plane: controlplane.ControlPlane,
) -> None:
    restricted_namespace(control_plane, WORKLOADS)
    job = load_job(REPO_ROOT / "examples" / "k8s" / "job.yaml")
    manifest = render_pytorchjob(
        job, Owner(name=job.metadata.name, namespace=WORKLOADS, uid="00000000-0000-0000-0000-000000000001"),
        1, None, OperatorSettings(sidecar_image="registry.example/trainguard:test"),
    )  # fmt: skip
    for replica, spec in manifest["spec"]["pytorchReplicaSpecs"].items():
        template = spec["template"]
        admitted = dry_run_pod(control_plane, WORKLOADS, f"worker-{replica.lower()}", template)
        assert admitted.returncode == 0, admitted.stderr
        pod = json.loads(admitted.stdout)
        sidecar = pod["spec"]["initContainers"][0]
        assert sidecar["restartPolicy"] == "Always"  # a native sidecar, kept by this API server

    # A pod that breaks the profile is refused by the same admission: the check above can fail.
    bad = copy.deepcopy(manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"])
    bad["spec"]["initContainers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    refused = dry_run_pod(control_plane, WORKLOADS, "worker-bad", bad)
    assert refused.returncode != 0
    assert "allowPrivilegeEscalation" in refused.stderr
