"""The Helm chart (charts/trainguard), checked with the real helm binary and Kubernetes' own schemas.

helm comes from ``scripts/tools.sh`` (CI runs it before the tests): these tests fail, not skip, when it
is missing. Every rendered object is validated offline against the Kubernetes OpenAPI schemas that the
``kubernetes-validate`` package ships (strict: unknown fields fail), for the oldest Kubernetes the chart
supports and the newest the package knows. The RBAC contract, the operator's exact needs, is the data in
``RBAC_CONTRACT`` below; the rendered Roles and ClusterRoles must grant exactly that, in both scopes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from tests.support.manifests import trainer_schema_errors
from tests.support.paths import CHART
from tests.support.paths import REPO_ROOT as ROOT
from tests.support.tools import helm, tool
from trainguard.core import crd

CHART_CRD_COPY = CHART / "files" / crd.CRD_PATH.name
PEERING_CRDS = CHART / "crds" / "kopfpeerings.kopf.dev.yaml"
RELEASE = "tg"
RELEASE_NAMESPACE = "trainguard-system"

#: The Kubernetes versions the rendered objects are validated against: the chart's kubeVersion floor
#: and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.29.0", "1.37.0")

#: A non-default value set: namespace scope, monitoring on, two replicas (+ dashboard).
CUSTOM_VALUES: dict[str, Any] = {
    "operator": {"scope": "namespaced", "watchNamespaces": ["team-a", "team-b"], "replicas": 2},
    "monitoring": {"force": True, "labels": {"release": "kube-prometheus-stack"}},
    "dashboard": {"enabled": True},
    "restartInPlace": {"existingSecret": "team-order-key"},
    "trainJobRuntime": {"install": True},
}


# --------------------------------------------------------------------------------------------------
# The RBAC contract: what python -m trainguard_operator does against the Kubernetes API.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Need:
    """Verbs the operator needs on one resource, and when (``all``, ``peering``, ``cluster``)."""

    group: str
    resource: str
    verbs: frozenset[str]
    why: str
    when: str = "all"
    cluster_scoped: bool = False


def _need(group: str, resource: str, verbs: str, why: str, **kw: Any) -> Need:
    return Need(group, resource, frozenset(verbs.split()), why, **kw)


RBAC_CONTRACT: tuple[Need, ...] = (
    _need(
        "trainguard.dev",
        "guardedtrainingjobs",
        "get list watch patch",
        "kopf watches GTJs and patches their annotations and finalizers",
    ),
    _need("trainguard.dev", "guardedtrainingjobs/status", "get patch update", "the operator keeps its state"),
    _need(
        "trainguard.dev",
        "guardedtrainingjobs/finalizers",
        "update",
        "blockOwnerDeletion on the PyTorchJob's owner reference (OwnerReferencesPermissionEnforcement)",
    ),
    _need(
        "kubeflow.org",
        "pytorchjobs",
        "get list watch create delete patch",
        "one PyTorchJob per attempt, deleted on a gang restart",
    ),
    _need(
        "trainer.kubeflow.org",
        "trainjobs",
        "list watch create delete",
        "or one TrainJob per attempt (Kubeflow Trainer v2), deleted on a gang restart",
    ),
    _need(
        "",
        "pods",
        "get list watch delete",
        "the workers' phases, exit codes and sidecar IPs; a broken gang's pods stopped with a short grace",
    ),
    _need("", "events", "create patch", "kopf's and the operator's events (core API)"),
    _need("events.k8s.io", "events", "create patch", "the same events (events.k8s.io)"),
    _need(
        "kopf.dev",
        "kopfpeerings",
        "get list watch patch",
        "kopf peering, namespace scope",
        when="peering-namespaced",
    ),
    _need(
        "kopf.dev",
        "clusterkopfpeerings",
        "get list watch patch",
        "kopf peering, cluster scope",
        when="peering-cluster",
        cluster_scoped=True,
    ),
    _need(
        "",
        "namespaces",
        "get list watch",
        "cluster-wide kopf follows namespaces",
        when="cluster",
        cluster_scoped=True,
    ),
    _need(
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        "get list watch",
        "kopf checks CRDs; the operator reports a missing PyTorchJob CRD",
        cluster_scoped=True,
    ),
)

#: A grant: (where, API group, resource, verb); where is "cluster" for a ClusterRoleBinding (every
#: namespace and the cluster-scoped resources) or a namespace for a RoleBinding.
Grant = tuple[str, str, str, str]


def expected_grants(*, clusterwide: bool, peering: bool, namespaces: Sequence[str]) -> set[Grant]:
    """What the chart must grant for one mode: the contract, scoped as the operator uses it."""
    active = {"all"}
    if clusterwide:
        active.add("cluster")
    if peering:
        active.add("peering-cluster" if clusterwide else "peering-namespaced")
    grants: set[Grant] = set()
    for need in RBAC_CONTRACT:
        if need.when not in active:
            continue
        places = ["cluster"] if clusterwide or need.cluster_scoped else list(namespaces)
        grants |= {(where, need.group, need.resource, v) for where in places for v in need.verbs}
    return grants


# --------------------------------------------------------------------------------------------------
# Tools and rendering
# --------------------------------------------------------------------------------------------------


def _values_args(values: Mapping[str, Any] | None, tmp: Path) -> list[str]:
    if not values:
        return []
    path = tmp / f"values-{abs(hash(json.dumps(values, sort_keys=True)))}.yaml"
    path.write_text(yaml.safe_dump(dict(values)))
    return ["--values", str(path)]


def template(
    values: Mapping[str, Any] | None = None, *extra: str, tmp: Path, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """``helm template`` of the chart in RELEASE_NAMESPACE, with values (as a file) and extra flags."""
    return helm(
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        RELEASE_NAMESPACE,
        *_values_args(values, tmp),
        *extra,
        check=check,
    )


def documents(text: str) -> list[dict[str, Any]]:
    """The objects of a multi-document YAML stream (empty documents dropped)."""
    return [d for d in yaml.safe_load_all(text) if d]


@dataclass(frozen=True)
class Rendered:
    """One rendering of the chart: its objects, and which template rendered each."""

    objects: list[dict[str, Any]]
    sources: list[str]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.of_kind(kind)
        assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
        return found[0]


def render(values: Mapping[str, Any] | None, tmp: Path, *extra: str) -> Rendered:
    text = template(values, *extra, tmp=tmp).stdout
    objects: list[dict[str, Any]] = []
    sources: list[str] = []
    for chunk in re.split(r"^---\s*$", text, flags=re.MULTILINE):
        doc = yaml.safe_load(chunk)
        if not doc:
            continue
        match = re.search(r"^# Source: trainguard/(\S+)$", chunk, flags=re.MULTILINE)
        assert match, f"no Source line in rendered document:\n{chunk[:300]}"
        objects.append(doc)
        sources.append(match.group(1))
    return Rendered(objects, sources)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chart")


@pytest.fixture(scope="module")
def default(tmp: Path) -> Rendered:
    return render(None, tmp)


@pytest.fixture(scope="module")
def custom(tmp: Path) -> Rendered:
    return render(CUSTOM_VALUES, tmp)


#: The value sets every structural test runs on: (id, values).
MODES: list[tuple[str, dict[str, Any] | None]] = [
    ("default", None),
    ("custom", CUSTOM_VALUES),
    ("cluster-2-replicas", {"operator": {"replicas": 2}, "monitoring": {"force": True}}),
    ("namespaced-release-namespace", {"operator": {"scope": "namespaced"}}),
]


@pytest.fixture(scope="module", params=[m[0] for m in MODES])
def mode(request: pytest.FixtureRequest, tmp: Path) -> tuple[dict[str, Any], Rendered]:
    values = dict(MODES)[request.param] or {}
    return values, render(values, tmp)


# --------------------------------------------------------------------------------------------------
# helm lint, schema validation of every object
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, CUSTOM_VALUES], ids=["default", "custom"])
def test_helm_lint_passes_strictly(values: dict[str, Any] | None, tmp: Path) -> None:
    result = helm("lint", "--strict", str(CHART), *_values_args(values, tmp))
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def test_the_packaged_chart_renders_the_same(tmp_path: Path) -> None:
    """`helm package` keeps every file the templates read (the CRD copy, the dashboard, crds/)."""
    helm("package", str(CHART), "--destination", str(tmp_path))
    (package,) = tmp_path.glob("trainguard-*.tgz")
    values = _values_args(CUSTOM_VALUES, tmp_path)
    flags = ["-n", RELEASE_NAMESPACE, "--include-crds", *values]
    packaged = helm("template", RELEASE, str(package), *flags).stdout
    assert packaged == helm("template", RELEASE, str(CHART), *flags).stdout


def test_tools_are_the_pinned_versions() -> None:
    version = helm("version", "--template", "{{ .Version }}").stdout.strip()
    pinned = re.search(r"^HELM_VERSION=(\S+)$", (ROOT / "scripts" / "tools.sh").read_text(), re.MULTILINE)
    assert pinned
    assert version == pinned.group(1)


def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema of the CRDs the chart ships (for its custom objects)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for doc in [*documents(PEERING_CRDS.read_text()), crd.build_crd()]:
        for version in doc["spec"]["versions"]:
            api_version = f"{doc['spec']['group']}/{version['name']}"
            out[(api_version, doc["spec"]["names"]["kind"])] = version["schema"]["openAPIV3Schema"]
    return out


#: Kinds of the Prometheus Operator: strictly decoded into its own Go API types by monitoring-check.
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def check_monitoring_objects(objects: Sequence[Mapping[str, Any]], tmp: Path) -> None:
    """Run monitoring-check (built by scripts/tools.sh) on Prometheus Operator objects: an unknown field
    or a wrong type in any of them fails."""
    paths = []
    for number, obj in enumerate(objects):
        path = tmp / f"monitoring-{number}-{obj['kind']}.json"
        path.write_text(json.dumps(obj))
        paths.append(str(path))
    result = subprocess.run([tool("monitoring-check"), *paths], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise AssertionError(f"monitoring-check refused:\n{result.stderr}")


def validate_object(obj: dict[str, Any], version: str) -> None:
    """Validate one object: Kubernetes kinds strictly against the version's schemas, the chart's own
    custom kinds against their CRD's schema."""
    custom = _crd_schemas().get((obj["apiVersion"], obj["kind"]))
    if custom is not None:
        jsonschema.validate(obj, custom)
        return
    if obj["kind"] in MONITORING_KINDS:
        return  # test_prometheus_operator_objects_decode_strictly
    if obj["kind"] == "ClusterTrainingRuntime":
        # Trainer's own CRD (v2.3.0, from its module), strictly: a field it does not know would be
        # pruned. And each replicated job's template as the batch/v1 Job JobSet makes of it, against
        # Kubernetes' own schemas (its pod strictly, as any pod).
        errors = trainer_schema_errors(obj)
        assert not errors, f"ClusterTrainingRuntime {obj['metadata']['name']} breaks Trainer's CRD: {errors}"
        for replicated in obj["spec"]["template"]["spec"]["replicatedJobs"]:
            name = f"{obj['metadata']['name']}-{replicated['name']}"
            job = {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": name},
                **replicated["template"],
            }
            validate_object(job, version)
        return
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:  # a jsonschema.ValidationError
        where = "/".join(str(p) for p in exc.absolute_path)
        raise AssertionError(
            f"{obj['kind']} {obj['metadata']['name']} is invalid for Kubernetes {version} at {where}: "
            f"{exc.message}"
        ) from exc


def test_prometheus_operator_objects_decode_strictly(
    mode: tuple[dict[str, Any], Rendered], tmp_path: Path
) -> None:
    _, rendered = mode
    monitoring = [o for o in rendered.objects if o["kind"] in MONITORING_KINDS]
    check_monitoring_objects(monitoring, tmp_path)


def test_monitoring_check_refuses_unknown_fields_and_wrong_types(custom: Rendered, tmp_path: Path) -> None:
    pod_monitor = json.loads(json.dumps(custom.one("PodMonitor")))
    pod_monitor["spec"]["podMetricsEndpoints"][0]["honorLabel"] = True  # a typo
    with pytest.raises(AssertionError, match="unknown field"):
        check_monitoring_objects([pod_monitor], tmp_path)
    rule = json.loads(json.dumps(custom.one("PrometheusRule")))
    rule["spec"]["groups"][0]["rules"][0]["labels"] = {"severity": 3}  # not a string
    with pytest.raises(AssertionError, match="cannot unmarshal number"):
        check_monitoring_objects([rule], tmp_path)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_rendered_object_is_valid_kubernetes(
    mode: tuple[dict[str, Any], Rendered], version: str
) -> None:
    _, rendered = mode
    assert rendered.objects
    for obj in rendered.objects:
        validate_object(obj, version)


def test_the_validator_rejects_what_kubernetes_rejects(default: Rendered) -> None:
    deployment = json.loads(json.dumps(default.one("Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}  # a typo
    with pytest.raises(AssertionError, match="securityContxt"):
        validate_object(deployment, KUBE_VERSIONS[-1])
    deployment = json.loads(json.dumps(default.one("Deployment")))
    deployment["spec"]["replicas"] = "one"
    with pytest.raises(AssertionError, match="replicas"):
        validate_object(deployment, KUBE_VERSIONS[-1])


def test_the_validator_rejects_what_trainers_crd_rejects(custom: Rendered) -> None:
    runtime = json.loads(json.dumps(custom.one("ClusterTrainingRuntime")))
    runtime["spec"]["mlPolicy"]["torch"]["numProcPerNod"] = 1  # a typo, which the API server would prune
    with pytest.raises(AssertionError, match="numProcPerNod"):
        validate_object(runtime, KUBE_VERSIONS[-1])


def test_names_fit_the_dns_limit(tmp: Path) -> None:
    long_release = "r" * 53  # helm's own limit for release names
    values = {"nameOverride": "n" * 63, **CUSTOM_VALUES}
    text = helm(
        "template", long_release, str(CHART), "-n", RELEASE_NAMESPACE, *_values_args(values, tmp)
    ).stdout
    for obj in documents(text):
        name = obj["metadata"]["name"]
        assert len(name) <= 63, name
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name), name
        for key, value in obj["metadata"].get("labels", {}).items():
            assert len(str(value)) <= 63, (obj["kind"], key, value)


def test_objects_carry_the_standard_labels(custom: Rendered) -> None:
    for obj in custom.objects:
        labels = obj["metadata"].get("labels", {})
        kind, name = obj["kind"], obj["metadata"]["name"]
        for key in ("name", "instance", "version", "managed-by", "component", "part-of"):
            assert f"app.kubernetes.io/{key}" in labels, (kind, name, key)
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["helm.sh/chart"] == "trainguard-0.1.0"


def test_templates_are_named_component_kind(custom: Rendered) -> None:
    for source, obj in zip(custom.sources, custom.objects, strict=True):
        component, _, kind = Path(source).stem.partition("-")
        assert kind == obj["kind"].lower(), f"{source} renders a {obj['kind']}"
        assert component in {"operator", "sidecar", "crd", "peering", "alerts", "dashboard", "runtime"}, (
            source
        )
    files = {p.name for p in (CHART / "templates").iterdir()}
    assert {f for f in files if not re.fullmatch(r"_\w+\.tpl|NOTES\.txt|[a-z]+-[a-z]+\.yaml", f)} == set()


# --------------------------------------------------------------------------------------------------
# Pod Security "restricted"
# --------------------------------------------------------------------------------------------------

#: Volume types the restricted profile allows.
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
#: Sysctls the baseline profile allows.
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}


def restricted_violations(pod: Mapping[str, Any]) -> list[str]:
    """Every rule of the Pod Security Standards' "restricted" profile (which includes "baseline")
    that a pod spec breaks, as messages; [] when it passes."""
    out: list[str] = []
    psc: Mapping[str, Any] = pod.get("securityContext") or {}
    containers: list[Mapping[str, Any]] = [
        *pod.get("initContainers", []),
        *pod.get("containers", []),
        *pod.get("ephemeralContainers", []),
    ]
    # baseline: host namespaces, HostProcess, host ports, HostPath (volumes: see restricted's list)
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"{field} is true")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("pod windowsOptions.hostProcess")
    # baseline: sysctls, SELinux, AppArmor, seccomp not Unconfined (pod level)
    for sysctl in psc.get("sysctls", []):
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"unsafe sysctl {sysctl.get('name')}")
    for where, ctx in [("pod", psc)] + [(c["name"], c.get("securityContext") or {}) for c in containers]:
        selinux = ctx.get("seLinuxOptions") or {}
        if selinux.get("user") or selinux.get("role"):
            out.append(f"{where}: seLinuxOptions user/role set")
        if selinux.get("type") not in (None, "", "container_t", "container_init_t", "container_kvm_t"):
            out.append(f"{where}: seLinuxOptions type {selinux.get('type')}")
        apparmor = (ctx.get("appArmorProfile") or {}).get("type")
        if apparmor not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"{where}: appArmorProfile {apparmor}")
        if (ctx.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{where}: seccompProfile Unconfined")
        if ctx.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser 0")
    # restricted: volume types
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {volume.get('name')}: type {sorted(kinds - RESTRICTED_VOLUMES)}")
    pod_non_root = psc.get("runAsNonRoot") is True
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    for c in containers:
        name = c["name"]
        ctx = c.get("securityContext") or {}
        # baseline: privileged, HostProcess, host ports, /proc mount
        if ctx.get("privileged"):
            out.append(f"{name}: privileged")
        if (ctx.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{name}: windowsOptions.hostProcess")
        if ctx.get("procMount") not in (None, "Default"):
            out.append(f"{name}: procMount {ctx.get('procMount')}")
        for port in c.get("ports", []):
            if port.get("hostPort"):
                out.append(f"{name}: hostPort {port['hostPort']}")
        # restricted: no privilege escalation
        if ctx.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        # restricted: non-root (container, or the pod with no container saying otherwise)
        if ctx.get("runAsNonRoot") is False or not (ctx.get("runAsNonRoot") is True or pod_non_root):
            out.append(f"{name}: runAsNonRoot is not true")
        # restricted: seccomp RuntimeDefault or Localhost (container, or inherited from the pod)
        seccomp = (ctx.get("seccompProfile") or {}).get("type")
        if not (seccomp in ("RuntimeDefault", "Localhost") or (seccomp is None and pod_seccomp)):
            out.append(f"{name}: seccompProfile is not RuntimeDefault or Localhost")
        # restricted: capabilities: drop ALL, add at most NET_BIND_SERVICE
        caps = ctx.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
    return out


def pod_specs(objects: Iterable[Mapping[str, Any]]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for obj in objects:
        kind = obj["kind"]
        if kind == "Pod":
            yield obj["metadata"]["name"], obj["spec"]
        elif kind in {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}:
            yield f"{kind}/{obj['metadata']['name']}", obj["spec"]["template"]["spec"]
        elif kind == "ClusterTrainingRuntime":
            for replicated in obj["spec"]["template"]["spec"]["replicatedJobs"]:
                yield f"{kind}/{replicated['name']}", replicated["template"]["spec"]["template"]["spec"]
        elif kind == "CronJob":
            yield f"{kind}/{obj['metadata']['name']}", obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def test_every_pod_passes_the_restricted_profile(mode: tuple[dict[str, Any], Rendered]) -> None:
    _, rendered = mode
    specs = list(pod_specs(rendered.objects))
    assert specs, "the chart renders no pod"
    for name, spec in specs:
        assert restricted_violations(spec) == [], name


def test_the_restricted_checker_catches_each_rule(default: Rendered) -> None:
    good = default.one("Deployment")["spec"]["template"]["spec"]
    assert restricted_violations(good) == []

    def broken(change: Any) -> list[str]:
        spec = json.loads(json.dumps(good))
        change(spec)
        return restricted_violations(spec)

    ctr = "containers"
    cases = {
        "hostNetwork": lambda s: s.update(hostNetwork=True),
        "privileged": lambda s: s[ctr][0]["securityContext"].update(privileged=True),
        "allowPrivilegeEscalation": lambda s: s[ctr][0]["securityContext"].pop("allowPrivilegeEscalation"),
        "runAsNonRoot": lambda s: s[ctr][0]["securityContext"].update(runAsNonRoot=False),
        "runAsUser 0": lambda s: s["securityContext"].update(runAsUser=0),
        "drop ALL": lambda s: s[ctr][0]["securityContext"]["capabilities"].update(drop=["NET_RAW"]),
        "adds capabilities": lambda s: s[ctr][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
        "Unconfined": lambda s: s["securityContext"].update(seccompProfile={"type": "Unconfined"}),
        "hostPath": lambda s: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
        "hostPort": lambda s: s[ctr][0]["ports"][0].update(hostPort=8080),
        "unsafe sysctl": lambda s: s["securityContext"].update(
            sysctls=[{"name": "kernel.msgmax", "value": "1"}]
        ),
        "procMount": lambda s: s[ctr][0]["securityContext"].update(procMount="Unmasked"),
    }
    for needle, change in cases.items():
        found = broken(change)
        assert any(needle in v for v in found), (needle, found)
    # seccomp and non-root may be set on the pod alone, or on every container alone
    only_containers = json.loads(json.dumps(good))
    only_containers["securityContext"] = {}
    assert restricted_violations(only_containers) == []
    neither = json.loads(json.dumps(only_containers))
    del neither[ctr][0]["securityContext"]["seccompProfile"]
    del neither[ctr][0]["securityContext"]["runAsNonRoot"]
    assert len(restricted_violations(neither)) == 2


def test_pods_the_operator_renders_pass_the_restricted_profile(custom: Rendered) -> None:
    """The operator, configured by the chart's environment, adds its sidecar, volumes and probes to a
    restricted user template: every replica's pod still passes the restricted profile."""
    from trainguard_operator.render import Owner, render_pytorchjob
    from trainguard_operator.settings import OperatorSettings

    from trainguard.core.spec import GuardedTrainingJob

    env = {e["name"]: e["value"] for e in _container(custom, "StatefulSet")["env"] if "value" in e}
    settings = OperatorSettings.from_env(
        {k: v for k, v in env.items() if k.startswith("TRAINGUARD_OPERATOR_")}
    )
    assert settings.sidecar_image == "ghcr.io/trainguard/trainguard:0.1.0"
    assert settings.metrics_port == 8080
    manifest = yaml.safe_load((ROOT / "examples" / "local" / "job.yaml").read_text())
    manifest["metadata"]["namespace"] = "team-a"
    pod = manifest["spec"]["template"]["spec"]
    pod["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    pod["containers"][0]["securityContext"] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    job = GuardedTrainingJob.model_validate(manifest)
    owner = Owner(name="tiny-lm-demo", namespace="team-a", uid="5e1b5c4e-0000-4000-8000-000000000001")
    rendered = render_pytorchjob(job, owner, 1, None, settings)
    replicas = rendered["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Worker"}
    for kind, replica in replicas.items():
        spec = replica["template"]["spec"]
        assert any(c["name"] == "trainguard-sidecar" for c in spec.get("initContainers", [])), kind
        assert restricted_violations(spec) == [], kind


def test_operator_container_is_hardened(default: Rendered) -> None:
    ctx = default.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["runAsNonRoot"] is True
    assert ctx["runAsUser"] > 0
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}


# --------------------------------------------------------------------------------------------------
# RBAC: exactly the contract
# --------------------------------------------------------------------------------------------------


def rendered_grants(rendered: Rendered, service_account: str) -> set[Grant]:
    """Every (where, group, resource, verb) the chart's bindings give the operator's ServiceAccount."""
    roles = {("ClusterRole", "", r["metadata"]["name"]): r for r in rendered.of_kind("ClusterRole")}
    roles |= {
        ("Role", r["metadata"]["namespace"], r["metadata"]["name"]): r for r in rendered.of_kind("Role")
    }
    grants: set[Grant] = set()
    for binding in rendered.of_kind("ClusterRoleBinding") + rendered.of_kind("RoleBinding"):
        subjects = binding["subjects"]
        assert subjects == [
            {"kind": "ServiceAccount", "name": service_account, "namespace": RELEASE_NAMESPACE}
        ], binding["metadata"]["name"]
        namespace = binding["metadata"].get("namespace", "")
        ref = binding["roleRef"]
        key = (ref["kind"], "" if ref["kind"] == "ClusterRole" else namespace, ref["name"])
        assert key in roles, f"{binding['metadata']['name']} binds a role the chart does not render: {key}"
        where = "cluster" if binding["kind"] == "ClusterRoleBinding" else namespace
        for rule in roles[key]["rules"]:
            assert "resourceNames" not in rule, rule
            assert "nonResourceURLs" not in rule, rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    grants |= {(where, group, resource, verb) for verb in rule["verbs"]}
    return grants


def test_rbac_grants_exactly_the_contract(mode: tuple[dict[str, Any], Rendered]) -> None:
    values, rendered = mode
    operator = values.get("operator", {})
    clusterwide = operator.get("scope", "cluster") == "cluster"
    namespaces = operator.get("watchNamespaces") or [RELEASE_NAMESPACE]
    expected = expected_grants(
        clusterwide=clusterwide, peering=operator.get("replicas", 1) > 1, namespaces=namespaces
    )
    service_account = rendered.one("ServiceAccount")["metadata"]["name"]
    # The operator's pods (the runtime's are the workers', run as their TrainJobs say).
    pods = [
        spec for _, spec in pod_specs(o for o in rendered.objects if o["kind"] != "ClusterTrainingRuntime")
    ]
    assert {p["serviceAccountName"] for p in pods} == {service_account}
    actual = rendered_grants(rendered, service_account)
    assert actual - expected == set(), "the chart grants more than the operator uses"
    assert expected - actual == set(), "the chart grants less than the operator needs"


def test_rbac_has_no_wildcards_and_no_secrets(mode: tuple[dict[str, Any], Rendered]) -> None:
    _, rendered = mode
    for role in rendered.of_kind("ClusterRole") + rendered.of_kind("Role"):
        assert "aggregationRule" not in role
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert all("*" not in item for item in rule[field]), (role["metadata"]["name"], rule)
            assert "secrets" not in rule["resources"]
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])


def test_every_rbac_rule_is_commented() -> None:
    text = (CHART / "templates" / "_rbac.tpl").read_text().splitlines()
    for number, line in enumerate(text):
        if line.startswith("- apiGroups:"):
            assert text[number - 1].startswith("#"), f"_rbac.tpl:{number + 1} has no comment"


def test_the_contract_matches_the_rendered_mode_switches(tmp: Path) -> None:
    """Scope and replicas pick the peering resources and the namespace rule: check all four."""
    for scope in ("cluster", "namespaced"):
        for replicas in (1, 3):
            values = {"operator": {"scope": scope, "replicas": replicas}}
            rendered = render(values, tmp)
            sa = rendered.one("ServiceAccount")["metadata"]["name"]
            expected = expected_grants(
                clusterwide=scope == "cluster", peering=replicas > 1, namespaces=[RELEASE_NAMESPACE]
            )
            assert rendered_grants(rendered, sa) == expected, (scope, replicas)


# --------------------------------------------------------------------------------------------------
# The operator's workload
# --------------------------------------------------------------------------------------------------


def _container(rendered: Rendered, kind: str) -> dict[str, Any]:
    container: dict[str, Any] = rendered.one(kind)["spec"]["template"]["spec"]["containers"][0]
    return container


def test_default_is_one_standalone_cluster_wide_replica(default: Rendered) -> None:
    assert default.of_kind("StatefulSet") == []
    deployment = default.one("Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    c = _container(default, "Deployment")
    assert c["command"] == ["python", "-m", "trainguard_operator"]
    assert c["args"] == ["--all-namespaces", "--liveness=http://0.0.0.0:8081/healthz"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["TRAINGUARD_OPERATOR_METRICS_PORT"] == "8080"
    assert env["TRAINGUARD_OPERATOR_SIDECAR_IMAGE"] == "ghcr.io/trainguard/trainguard:0.1.0"
    assert json.loads(env["TRAINGUARD_OPERATOR_SIDECAR_RESOURCES"])["requests"]["cpu"] == "50m"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": 8080, "health": 8081}
    assert c["resources"]["limits"]["memory"] == "512Mi"
    assert default.of_kind("KopfPeering") == default.of_kind("ClusterKopfPeering") == []


def test_replicas_run_a_peered_statefulset_with_distinct_priorities(custom: Rendered) -> None:
    assert custom.of_kind("Deployment") == []
    statefulset = custom.one("StatefulSet")
    assert statefulset["spec"]["replicas"] == 2
    c = _container(custom, "StatefulSet")
    assert c["args"] == [
        "--namespace=team-a",
        "--namespace=team-b",
        f"--peering={RELEASE}-trainguard",
        "--priority=$(TRAINGUARD_PEERING_PRIORITY)",
        "--liveness=http://0.0.0.0:8081/healthz",
    ]
    priority = next(e for e in c["env"] if e["name"] == "TRAINGUARD_PEERING_PRIORITY")
    assert priority["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    peerings = custom.of_kind("KopfPeering")
    assert {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in peerings} == {
        ("team-a", f"{RELEASE}-trainguard"),
        ("team-b", f"{RELEASE}-trainguard"),
    }


def test_the_operator_accepts_the_charts_command_line(mode: tuple[dict[str, Any], Rendered]) -> None:
    """python -m trainguard_operator's own parser takes the rendered args (the kubelet's $(VAR)
    expansion of the pod-index priority done by hand)."""
    from trainguard_operator.__main__ import _parser

    values, rendered = mode
    kind = "StatefulSet" if rendered.of_kind("StatefulSet") else "Deployment"
    container = _container(rendered, kind)
    assert container["command"] == ["python", "-m", "trainguard_operator"]
    args = [a.replace("$(TRAINGUARD_PEERING_PRIORITY)", "1") for a in container["args"]]
    parsed = _parser().parse_args(args)
    operator = values.get("operator", {})
    if operator.get("scope", "cluster") == "cluster":
        assert parsed.all_namespaces
        assert parsed.namespace == []
    else:
        assert not parsed.all_namespaces
        assert parsed.namespace == (operator.get("watchNamespaces") or [RELEASE_NAMESPACE])
    peering = operator.get("replicas", 1) > 1
    assert (parsed.peering is not None) == peering
    assert parsed.priority == (1 if peering else 0)
    assert parsed.liveness == "http://0.0.0.0:8081/healthz"


def test_cluster_wide_peering_uses_one_cluster_peering(tmp: Path) -> None:
    rendered = render({"operator": {"replicas": 2, "peering": {"name": "tg-peers"}}}, tmp)
    assert [p["metadata"]["name"] for p in rendered.of_kind("ClusterKopfPeering")] == ["tg-peers"]
    assert rendered.of_kind("KopfPeering") == []
    assert "--peering=tg-peers" in _container(rendered, "StatefulSet")["args"]


def test_chart_ships_kopfs_peering_crds_in_its_crds_directory(tmp: Path) -> None:
    crds = {d["metadata"]["name"]: d for d in documents(PEERING_CRDS.read_text())}
    assert crds["kopfpeerings.kopf.dev"]["spec"]["scope"] == "Namespaced"
    assert crds["clusterkopfpeerings.kopf.dev"]["spec"]["scope"] == "Cluster"
    for doc in crds.values():
        kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)
    # helm installs them before the templates; `helm template --include-crds` shows them
    text = template(CUSTOM_VALUES, "--include-crds", tmp=tmp).stdout
    names = {d["metadata"]["name"] for d in documents(text) if d["kind"] == "CustomResourceDefinition"}
    assert {"kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"} <= names


def test_the_metrics_service_selects_the_operator(default: Rendered) -> None:
    service = default.one("Service")
    pod_labels = default.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}
    ]


# --------------------------------------------------------------------------------------------------
# The CRD: one source of truth
# --------------------------------------------------------------------------------------------------


def test_the_chart_carries_the_generated_crd_unchanged() -> None:
    assert CHART_CRD_COPY.read_text() == crd.CRD_PATH.read_text() == crd.render(), (
        f"the chart's CRD copy drifted: run python -m trainguard.core.crd && "
        f"python -m trainguard.core.crd --output {CHART_CRD_COPY.relative_to(ROOT)}"
    )


def test_the_rendered_crd_is_the_generated_one(default: Rendered) -> None:
    rendered = default.one("CustomResourceDefinition")
    generated = crd.build_crd()
    assert rendered["spec"] == generated["spec"]
    assert rendered["metadata"]["name"] == generated["metadata"]["name"]
    assert generated["metadata"]["labels"].items() <= rendered["metadata"]["labels"].items()
    assert rendered["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}


def test_crd_values_keep_and_install(tmp: Path) -> None:
    dropped = render({"crds": {"keep": False}}, tmp).one("CustomResourceDefinition")
    assert "annotations" not in dropped["metadata"]
    assert render({"crds": {"install": False}}, tmp).of_kind("CustomResourceDefinition") == []


# --------------------------------------------------------------------------------------------------
# values.yaml and values.schema.json
# --------------------------------------------------------------------------------------------------


def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    return schema


def _resolve(node: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        return _resolve(schema["definitions"][node["$ref"].rsplit("/", 1)[-1]], schema)
    return node


def test_values_schema_is_a_valid_schema_and_accepts_the_defaults() -> None:
    schema = _schema()
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)
    jsonschema.validate(CUSTOM_VALUES, schema)


def test_every_values_key_is_commented() -> None:
    """Every key the schema names (not the free-form maps' entries) has a comment right above it; every
    leaf's comment gives its default."""
    schema = _schema()
    data_sections = schema["definitions"]["resources"]  # requests/limits: Kubernetes' own fields
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str, dict[str, Any] | None]] = [(-1, "", schema)]
    seen: list[str] = []
    for number, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z_][\w.-]*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        while stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][2]
        node = None
        if parent is not None and "properties" in parent and parent is not data_sections:
            node = _resolve(parent["properties"].get(key, {}), schema)
            assert key in parent["properties"], f"values.yaml:{number + 1}: {key} is not in the schema"
        path = ".".join([p for _, p, _ in stack[1:]] + [key])
        stack.append((indent, key, node))
        if node is None:
            continue  # an entry of a free-form map (resources, labels...)
        seen.append(path)
        comment: list[str] = []
        back = number - 1
        while back >= 0 and lines[back].strip().startswith("#"):
            comment.insert(0, lines[back].strip())
            back -= 1
        assert comment, f"values.yaml:{number + 1}: {path} has no comment"
        if "properties" not in node:
            assert "Default" in " ".join(comment), (
                f"values.yaml:{number + 1}: {path}'s comment has no default"
            )
    assert "alerts.batchDropRate.threshold" in seen
    assert "operator.scope" in seen


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    head, _, rest = dotted.partition(".")
    return {head: _nested(rest, value) if rest else value}


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("operatr.replicas", 2, "additional properties 'operatr' not allowed"),
        ("operator.replicaz", 2, "additional properties 'replicaz' not allowed"),
        ("operator.replicas", "two", "got string, want integer"),
        ("operator.replicas", 1.5, "got number, want integer"),
        ("operator.scope", "everywhere", "value must be one of"),
        ("alerts.batchDropRate.threshold", 1.5, "maximum: got 1.5, want 1"),
        ("alerts.batchDropRate.threshold", -0.001, "exclusiveMinimum"),
        ("alerts.batchDropRate.threshold", "0.1%", "got string, want number"),
        ("alerts.rollbackRate.threshold", -1, "minimum: got -1, want 1"),
        ("alerts.checkpointStale.maxAgeSeconds", -60, "minimum: got -60, want 60"),
        ("alerts.rollbackRate.window", "an hour", "does not match pattern"),
        ("crds.keep", "maybe", "got string, want boolean"),
        ("trainJobRuntime.install", "yes", "value must be one of"),
        ("trainJobRuntime.probePeriodSeconds", 0, "minimum: got 0, want 1"),
    ],
)
def test_the_schema_refuses_bad_values(key: str, value: Any, message: str, tmp: Path) -> None:
    result = template(_nested(key, value), tmp=tmp, check=False)
    assert result.returncode != 0, f"helm template accepted {key}={value!r}"
    assert "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr, result.stderr


def test_set_flags_meet_the_schema_too(tmp: Path) -> None:
    result = template(None, "--set", "operator.replicas=two", tmp=tmp, check=False)
    assert result.returncode != 0
    assert "at '/operator/replicas': got string, want integer" in result.stderr


# --------------------------------------------------------------------------------------------------
# Monitoring objects, dashboard, NOTES
# --------------------------------------------------------------------------------------------------


def test_monitoring_objects_only_when_the_api_exists_or_forced(default: Rendered, tmp: Path) -> None:
    assert not [o for o in default.objects if o["kind"] in MONITORING_KINDS]
    detected = render(None, tmp, "--api-versions", "monitoring.coreos.com/v1")
    assert {o["kind"] for o in detected.objects} >= MONITORING_KINDS
    forced = render({"monitoring": {"force": True}}, tmp)
    assert {o["kind"] for o in forced.objects} >= MONITORING_KINDS
    off = render(
        {
            "monitoring": {
                "force": True,
                "serviceMonitor": {"enabled": False},
                "podMonitor": {"enabled": False},
            }
        },
        tmp,
    )
    assert {o["kind"] for o in off.objects} & MONITORING_KINDS == {"PrometheusRule"}


def test_monitors_honor_the_trainguard_labels(custom: Rendered) -> None:
    pod_monitor = custom.one("PodMonitor")
    assert pod_monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert pod_monitor["spec"]["podMetricsEndpoints"] == [
        {"port": "tg-sidecar", "path": "/metrics", "interval": "30s", "honorLabels": True}
    ]
    assert pod_monitor["spec"]["selector"] == {
        "matchExpressions": [{"key": "trainguard.dev/job", "operator": "Exists"}]
    }
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    service_monitor = custom.one("ServiceMonitor")
    (endpoint,) = service_monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True
    assert endpoint["port"] == "metrics"
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= (
        custom.one("Service")["metadata"]["labels"].items()
    )


def test_operator_render_uses_the_pod_monitors_port_and_label() -> None:
    """The PodMonitor's port name and label selector are the operator's (trainguard_operator.render)."""
    from trainguard_operator import render as operator_render

    assert operator_render.SIDECAR_PORT_NAME == "tg-sidecar"
    assert operator_render.JOB_LABEL == "trainguard.dev/job"


DASHBOARD_PANELS = {
    "Steps per second",
    "Loss",
    "Gradient norm",
    "Skipped steps",
    "Rollbacks",
    "Gang restarts",
    "Dropped-sample ratio",
    "Time to recover",
    "Goodput (share of time with step progress)",
}


def test_dashboard_configmap(custom: Rendered) -> None:
    configmap = custom.one("ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(configmap["data"]["trainguard.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "trainguard.json").read_text())
    assert {p["title"] for p in dashboard["panels"]} == DASHBOARD_PANELS
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def notes(values: Mapping[str, Any] | None, tmp: Path) -> str:
    """NOTES.txt as helm renders it. `helm install --dry-run` needs a cluster, and `helm template` skips
    NOTES.txt, so a copy of the chart renders it through `tpl` (the same engine and helpers) into a
    ConfigMap."""
    chart = tmp / "notes-chart" / "trainguard"
    if not chart.exists():
        shutil.copytree(CHART, chart)
        (chart / "files" / "NOTES.txt").write_text((CHART / "templates" / "NOTES.txt").read_text())
        (chart / "templates" / "notes-configmap.yaml").write_text(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
            '  notes: {{ tpl (.Files.Get "files/NOTES.txt") . | toJson }}\n'
        )
    text = helm(
        "template",
        RELEASE,
        str(chart),
        "-n",
        RELEASE_NAMESPACE,
        "--show-only",
        "templates/notes-configmap.yaml",
        *_values_args(values, tmp),
    ).stdout
    rendered: str = yaml.safe_load(text)["data"]["notes"]
    return rendered


def test_notes_say_what_was_installed(tmp: Path) -> None:
    text = notes(CUSTOM_VALUES, tmp)
    assert "serves the namespaces team-a, team-b" in text
    assert "2 replicas, kopf peering tg-trainguard" in text
    assert "kubectl apply -n team-a -f job.yaml" in text
    assert f"{RELEASE}-trainguard-operator:8080/metrics" in text
    assert "ServiceMonitor, PodMonitor and PrometheusRule are installed" in text
    text = notes(None, tmp)
    assert "serves every namespace" in text
    assert "stays in place on helm uninstall" in text
    assert "set monitoring.force=true" in text


# --------------------------------------------------------------------------------------------------
# Kubeflow Trainer v2: trainguard's ClusterTrainingRuntime
# --------------------------------------------------------------------------------------------------


def test_the_runtime_is_installed_when_the_cluster_has_trainer_or_when_asked(
    default: Rendered, tmp: Path
) -> None:
    assert default.of_kind("ClusterTrainingRuntime") == []
    detected = render(None, tmp, "--api-versions", "trainer.kubeflow.org/v1alpha1")
    assert detected.one("ClusterTrainingRuntime")["metadata"]["name"] == "trainguard-torch-distributed"
    assert render({"trainJobRuntime": {"install": True}}, tmp).of_kind("ClusterTrainingRuntime")
    off = render(
        {"trainJobRuntime": {"install": False}}, tmp, "--api-versions", "trainer.kubeflow.org/v1alpha1"
    )
    assert off.of_kind("ClusterTrainingRuntime") == []


def _runtime_pod(rendered: Rendered) -> dict[str, Any]:
    (node,) = rendered.one("ClusterTrainingRuntime")["spec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"
    assert node["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    pod: dict[str, Any] = node["template"]["spec"]["template"]
    return pod


def test_the_runtime_is_the_pod_the_operator_renders_and_restarts_nothing(custom: Rendered) -> None:
    """The runtime holds what the operator adds to a PyTorchJob's pods (its sidecar, status volume,
    probe and launcher), from the operator's own render with the chart's settings; JobSet, Job and
    the kubelet restart nothing."""
    from trainguard_operator.inplace import order_wait_seconds
    from trainguard_operator.render import Owner, render_pytorchjob
    from trainguard_operator.settings import OperatorSettings

    from tests.support.manifests import gtj_manifest, load

    runtime = custom.one("ClusterTrainingRuntime")
    assert runtime["spec"]["template"]["spec"]["failurePolicy"] == {"maxRestarts": 0}
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert node["template"]["spec"]["backoffLimit"] == 0
    assert node["replicas"] == 1
    env = {e["name"]: e["value"] for e in _container(custom, "StatefulSet")["env"] if "value" in e}
    settings = OperatorSettings.from_env(
        {k: v for k, v in env.items() if k.startswith("TRAINGUARD_OPERATOR_")}
        | {"TRAINGUARD_OPERATOR_ORDER_KEY": "k" * 64}
    )
    assert settings.trainjob_runtime == runtime["metadata"]["name"]
    period = settings.trainjob_probe_period_seconds
    manifest = gtj_manifest(health={"hangTimeoutSeconds": 300, "probePeriodSeconds": period})
    rendered = render_pytorchjob(load(manifest), Owner("tiny-lm", "research", "uid"), 1, None, settings)
    theirs = rendered["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    ours = _runtime_pod(custom)["spec"]
    assert ours["restartPolicy"] == theirs["restartPolicy"] == "Never"
    status_volume = next(v for v in theirs["volumes"] if v["name"] == "trainguard-status")
    assert ours["volumes"] == [status_volume]
    (sidecar,) = ours["initContainers"]
    their_sidecar = next(c for c in theirs["initContainers"] if c["name"] == "trainguard-sidecar")
    for key in set(their_sidecar) - {"env"}:
        assert sidecar[key] == their_sidecar[key], key
    their_env = {e["name"]: e for e in their_sidecar["env"]}
    for item in sidecar["env"]:
        assert their_env[item["name"]] == item
    (worker,) = ours["containers"]
    their_worker = next(c for c in theirs["containers"] if c["name"] == "pytorch")
    assert worker["name"] == "node"
    assert worker["livenessProbe"] == their_worker["livenessProbe"]
    assert [m for m in their_worker["volumeMounts"] if m["name"] == "trainguard-status"] == worker[
        "volumeMounts"
    ]
    assert worker["command"] == [
        "trainguard-launch",
        "--order-wait-seconds",
        str(order_wait_seconds(period)),
        "--",
    ]
    assert (
        their_worker["command"][their_worker["command"].index("--order-wait-seconds") + 1]
        == worker["command"][2]
    )


def test_the_runtimes_probe_period_is_the_operators(tmp: Path) -> None:
    rendered = render(
        {"trainJobRuntime": {"install": True, "probePeriodSeconds": 3, "name": "tg-torch"}}, tmp
    )
    assert rendered.one("ClusterTrainingRuntime")["metadata"]["name"] == "tg-torch"
    probe = _runtime_pod(rendered)["spec"]["containers"][0]["livenessProbe"]
    assert (probe["periodSeconds"], probe["timeoutSeconds"]) == (3, 3)
    env = {e["name"]: e.get("value") for e in _container(rendered, "Deployment")["env"]}
    assert env["TRAINGUARD_OPERATOR_TRAINJOB_PROBE_PERIOD_SECONDS"] == "3"
    assert env["TRAINGUARD_OPERATOR_TRAINJOB_RUNTIME"] == "tg-torch"
