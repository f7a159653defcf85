"""The generated CRD against a real kube-apiserver: admission, defaulting, printer columns, status.

These run against the ``control_plane`` fixture (a real etcd + kube-apiserver built from the Go module
proxy by ``scripts/control-plane.sh``), not an emulator: the API server itself compiles the CEL rules
(within its cost budget), checks the schema is structural, fills in defaults and enforces every rule.
The property-style test pins the promise in ``trainguard/core/spec.py``: the pydantic model and the CRD
accept and refuse the same objects.
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import yaml

from tests.support.controlplane import ControlPlane
from tests.support.kubeflow import pytorchjob_crd, pytorchjob_example
from tests.support.manifests import get_gtj_header
from tests.support.paths import REPO_ROOT
from trainguard.core import spec
from trainguard.core.crd import build_crd

CRD_FILE = REPO_ROOT / "crds" / "guardedtrainingjobs.trainguard.dev.yaml"
EXAMPLE_JOB = REPO_ROOT / "examples" / "local" / "job.yaml"
NAMESPACE = "default"


# A minimal valid job; each case below changes one thing.
BASE: dict[str, Any] = {
    "apiVersion": spec.API_VERSION,
    "kind": spec.KIND,
    "metadata": {"name": "base"},
    "spec": {
        "template": {
            "spec": {"containers": [{"name": "pytorch", "image": "x", "command": ["python", "t.py"]}]}
        },
        "checkpoint": {"claimName": "ckpt"},
    },
}


def job(name: str, **sections: Any) -> dict[str, Any]:
    """BASE named ``name`` with the given spec sections replaced (a value of None deletes one)."""
    document = copy.deepcopy(BASE)
    document["metadata"]["name"] = name
    for key, value in sections.items():
        if value is None:
            document["spec"].pop(key, None)
        else:
            document["spec"][key] = value
    return document


def containers(*names: str) -> dict[str, Any]:
    """A pod template whose containers have these names."""
    return {"spec": {"containers": [{"name": n, "image": "x"} for n in names]}}


class Api:
    """The kubernetes client's APIs for one control plane, plus the calls these tests repeat."""

    def __init__(self, plane: ControlPlane) -> None:
        from kubernetes import client

        self.plane = plane
        self.client = plane.api_client()
        self.custom = client.CustomObjectsApi(self.client)
        self.extensions = client.ApiextensionsV1Api(self.client)

    def create_job(self, document: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """Create a GTJ as ``kubectl apply`` would: strict field validation (unknown fields refused)."""
        kwargs: dict[str, Any] = {"field_validation": "Strict"}
        if dry_run:
            kwargs["dry_run"] = "All"
        created = self.custom.create_namespaced_custom_object(
            spec.GROUP, spec.VERSION, NAMESPACE, spec.PLURAL, document, **kwargs
        )
        return cast(dict[str, Any], created)

    def get_job(self, name: str) -> dict[str, Any]:
        """The stored object."""
        stored = self.custom.get_namespaced_custom_object(
            spec.GROUP, spec.VERSION, NAMESPACE, spec.PLURAL, name
        )
        return cast(dict[str, Any], stored)

    def rejection(self, document: dict[str, Any]) -> dict[str, Any]:
        """Dry-run create ``document``; return the API server's Status for a refusal (fail if accepted)."""
        from kubernetes.client.exceptions import ApiException

        with pytest.raises(ApiException) as refused:
            self.create_job(document, dry_run=True)
        status = cast(dict[str, Any], json.loads(refused.value.body or "{}"))
        assert refused.value.status == 422, status
        return status

    def wait_established(self, name: str, timeout: float = 30) -> dict[str, Any]:
        """Wait for a CRD's Established condition; return the CRD (as a dict)."""
        deadline = time.monotonic() + timeout
        while True:
            crd = self.client.sanitize_for_serialization(
                self.extensions.read_custom_resource_definition(name)
            )
            conditions = {c["type"]: c for c in crd.get("status", {}).get("conditions") or []}
            if conditions.get("Established", {}).get("status") == "True":
                return dict(crd)
            assert time.monotonic() < deadline, f"{name} not Established: {conditions}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def plain_api(control_plane: ControlPlane) -> Iterator[Api]:
    """Clients for the control plane, before our CRD is applied."""
    apis = Api(control_plane)
    yield apis
    apis.client.close()


@pytest.fixture(scope="module")
def api(plain_api: Api) -> Api:
    """The control plane with our CRD applied (server-side, as ``kubectl apply --server-side``)."""
    control_plane = plain_api.plane
    control_plane.kubectl("apply", "--server-side", f"--filename={CRD_FILE}")
    plain_api.wait_established(f"{spec.PLURAL}.{spec.GROUP}")
    # Established means served; a first request can still race the discovery refresh, so wait for it.
    deadline = time.monotonic() + 30
    while control_plane.kubectl("get", "gtj", check=False).returncode != 0:
        assert time.monotonic() < deadline, "the gtj short name never resolved"
        time.sleep(0.5)
    return plain_api


def test_the_control_plane_is_the_pinned_real_one(control_plane: ControlPlane) -> None:
    """The fixture runs the kube-apiserver built by scripts/control-plane.sh, ready, over TLS."""
    script = (REPO_ROOT / "scripts" / "control-plane.sh").read_text()
    pinned = re.search(r"^KUBERNETES_VERSION=(v[0-9.]+)$", script, re.MULTILINE)
    assert pinned is not None
    assert control_plane.get("/readyz") == (200, "ok")
    code, body = control_plane.get("/version")
    assert code == 200
    assert json.loads(body)["gitVersion"] == pinned.group(1)
    assert control_plane.server.startswith("https://127.0.0.1:")
    assert control_plane.etcd_url.startswith("https://127.0.0.1:")


def test_crd_is_accepted_structural_and_established(api: Api) -> None:
    """The API server accepts the CRD: a structural schema, CEL rules that compile within the cost budget
    (an over-budget or non-compiling rule is refused at create), names and short name accepted."""
    crd = api.wait_established(f"{spec.PLURAL}.{spec.GROUP}")
    conditions = {c["type"]: c for c in crd["status"]["conditions"]}
    assert conditions["NamesAccepted"]["status"] == "True"
    assert "NonStructuralSchema" not in conditions, conditions["NonStructuralSchema"]
    assert crd["status"]["acceptedNames"]["shortNames"] == spec.SHORT_NAMES
    assert crd["status"]["storedVersions"] == [spec.VERSION]
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    # Every rule the model declares is there, as the API server stored it (none dropped, none added).
    declared = json.dumps(build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).count('"rule"')
    assert declared >= 4
    assert json.dumps(schema).count('"rule"') == declared


def _sections(job_spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in job_spec.items() if k != "template"}


def test_example_job_is_created_with_the_api_servers_defaults(api: Api) -> None:
    """examples/local/job.yaml is accepted; the stored object carries the defaults the API server filled
    in, and they are exactly pydantic's defaults (every section but the pass-through pod template)."""
    document = yaml.safe_load(EXAMPLE_JOB.read_text())
    api.create_job(document)
    stored = api.get_job(document["metadata"]["name"])["spec"]
    assert stored["guard"]["maxConsecutiveBadSteps"] == 3  # the user gave no guard section
    assert stored["recovery"]["backoffSeconds"] == [1, 2, 4]  # given: kept
    assert stored["recovery"]["onDivergence"] == {"lrScale": 0.5, "maxGradNorm": 0.5}
    assert stored["checkpoint"]["keepClean"] == 3
    assert stored["checkpoint"]["mountPath"] == "/ckpt"
    assert stored["dataQuality"] == {"maxDropRate": 0.001}
    model = spec.parse_job(document, str(EXAMPLE_JOB)).spec.model_dump(
        by_alias=True, mode="json", exclude_none=True
    )
    assert _sections(stored) == _sections(model)

    minimal = job("defaults-only")
    api.create_job(minimal)
    stored = api.get_job("defaults-only")["spec"]
    assert stored["recovery"]["backoffSeconds"] == [10, 30, 90]  # none given: the default
    assert stored["health"] == {
        "hangTimeoutSeconds": 300,
        "hangTimeoutFloorSeconds": 10,
        "startupGraceSeconds": 600,
        "probePeriodSeconds": 10,
        "straggler": {"action": "report", "threshold": 1.5, "windowSteps": 8},
    }
    model = spec.parse_job(minimal, "minimal").spec.model_dump(by_alias=True, mode="json", exclude_none=True)
    assert _sections(stored) == _sections(model)


# Each cross-field rule: the spec section that breaks it, the field the API server must name, and the
# rule's message.
CROSS_FIELD_RULES = [
    pytest.param(
        {"health": {"hangTimeoutSeconds": 10, "probePeriodSeconds": 10}},
        "spec.health.hangTimeoutSeconds",
        "hangTimeoutSeconds must be longer than probePeriodSeconds",
        id="hang-timeout-not-above-probe-period",
    ),
    pytest.param(
        {"recovery": {"backoffSeconds": [30, 10, 90]}},
        "spec.recovery.backoffSeconds",
        "backoffSeconds must be non-decreasing",
        id="backoff-not-sorted",
    ),
    pytest.param(
        {"guard": {"lossSpikeWindow": 5, "spikeMinHistory": 6}},
        "spec.guard.spikeMinHistory",
        "spikeMinHistory must not exceed lossSpikeWindow",
        id="min-history-above-window",
    ),
    pytest.param(
        {"template": containers("trainer", "sidecar")},
        "spec.template.spec.containers",
        "the worker template needs a container named pytorch",
        id="no-pytorch-container",
    ),
]


@pytest.mark.parametrize(("sections", "field", "message"), CROSS_FIELD_RULES)
def test_cross_field_rules_are_enforced_by_admission(
    api: Api, sections: dict[str, Any], field: str, message: str
) -> None:
    """Each CEL rule refuses its case, naming the field (``fieldPath``) and giving the rule's message."""
    status = api.rejection(job("cross-field", **sections))
    causes = status["details"]["causes"]
    assert [c["field"] for c in causes] == [field], status
    assert message in causes[0]["message"], status
    assert field in status["message"], status["message"]
    assert message in status["message"], status["message"]
    with pytest.raises(spec.SpecError, match=message):
        spec.parse_job(job("cross-field", **sections), "case")


# Specs valid and invalid (cross-field rules on both sides of each bound, plain schema violations, a
# missing section, an unknown field): the API server's verdict must equal the pydantic model's.
VERDICT_CASES: dict[str, dict[str, Any]] = {
    "minimal": job("v-minimal"),
    "example": {**yaml.safe_load(EXAMPLE_JOB.read_text()), "metadata": {"name": "v-example"}},
    "hang-just-above-probe": job("v-hang", health={"hangTimeoutSeconds": 11, "probePeriodSeconds": 10}),
    "hang-equal-probe": job("v-hang-eq", health={"hangTimeoutSeconds": 10, "probePeriodSeconds": 10}),
    "hang-below-default-probe": job("v-hang-def", health={"hangTimeoutSeconds": 5}),
    "backoff-flat": job("v-backoff-flat", recovery={"backoffSeconds": [5, 5, 5]}),
    "backoff-unsorted": job("v-backoff-unsorted", recovery={"backoffSeconds": [30, 10]}),
    "backoff-zero": job("v-backoff-zero", recovery={"backoffSeconds": [0, 10]}),
    "backoff-empty": job("v-backoff-empty", recovery={"backoffSeconds": []}),
    "snapshot-equal-checkpoint": job(
        "v-snap-eq", checkpoint={"claimName": "c", "everySteps": 50, "snapshotEverySteps": 50}
    ),
    "snapshot-above-checkpoint": job(
        "v-snap", checkpoint={"claimName": "c", "everySteps": 50, "snapshotEverySteps": 51}
    ),
    "checkpoint-below-default-snapshot": job("v-ckpt-often", checkpoint={"claimName": "c", "everySteps": 10}),
    "snapshot-above-default-checkpoint": job(
        "v-snap-def", checkpoint={"claimName": "c", "snapshotEverySteps": 3000}
    ),
    "history-equal-window": job("v-hist-eq", guard={"lossSpikeWindow": 20, "spikeMinHistory": 20}),
    "history-above-window": job("v-hist", guard={"lossSpikeWindow": 20, "spikeMinHistory": 21}),
    "pytorch-and-sidecar": job("v-sidecar", template=containers("log-shipper", "pytorch")),
    "no-pytorch": job("v-no-pytorch", template=containers("trainer")),
    "no-containers": job("v-no-containers", template={"spec": {"containers": []}}),
    "replicas-zero": job("v-replicas-0", replicas=0),
    "replicas-negative": job("v-replicas-neg", replicas=-1),
    "loss-spike-factor-one": job("v-spike-1", guard={"lossSpikeFactor": 1.0}),
    "loss-spike-factor-above-one": job("v-spike-101", guard={"lossSpikeFactor": 1.01}),
    "drop-rate-above-one": job("v-drop", dataQuality={"maxDropRate": 1.5}),
    "relative-mount-path": job("v-mount", checkpoint={"claimName": "c", "mountPath": "ckpt"}),
    "no-checkpoint": job("v-no-ckpt", checkpoint=None),
    "no-template": job("v-no-template", template=None),
    "unknown-field": job("v-unknown", guard={"maxConsecutiveBadStep": 3}),
    "lr-scale-above-one": job("v-lr", recovery={"onDivergence": {"lrScale": 1.5}}),
    "replicas-true": job("v-replicas-true", replicas=True),
    "replicas-string": job("v-replicas-string", replicas="2"),
    "hang-a-week": job("v-hang-week", health={"hangTimeoutSeconds": 604_800}),
    "hang-beyond-a-week": job("v-hang-long", health={"hangTimeoutSeconds": 604_801}),
    "hang-10-to-the-20": job("v-hang-huge", health={"hangTimeoutSeconds": 10**20}),
    "backoff-a-day": job("v-backoff-day", recovery={"backoffSeconds": [1, 86_400]}),
    "backoff-beyond-a-day": job("v-backoff-long", recovery={"backoffSeconds": [1, 86_401]}),
    "grad-norm-huge": job("v-grad-huge", guard={"maxGradNorm": 1e7}),
    "claim-traversal": job("v-claim-dots", checkpoint={"claimName": "../../../../tmp/x"}),
    "claim-subdomain": job("v-claim-sub", checkpoint={"claimName": "team.ckpt-1"}),
    "claim-upper": job("v-claim-upper", checkpoint={"claimName": "Ckpt"}),
    "argument-too-long": job(
        "v-arg-long", template={"spec": {"containers": [{"name": "pytorch", "args": ["a" * 4097]}]}}
    ),
    "working-dir": job(
        "v-workdir", template={"spec": {"containers": [{"name": "pytorch", "workingDir": "/w"}]}}
    ),
}


def _pydantic_accepts(document: dict[str, Any]) -> bool:
    try:
        spec.parse_job(copy.deepcopy(document), "case")
    except spec.SpecError:
        return False
    return True


def _api_accepts(api: Api, document: dict[str, Any]) -> tuple[bool, str]:
    from kubernetes.client.exceptions import ApiException

    refused: ApiException | None = None
    try:
        api.create_job(copy.deepcopy(document), dry_run=True)
    except ApiException as exc:
        refused = exc
    if refused is None:
        return True, "accepted"
    assert refused.status in (400, 422), refused.body  # refused by validation, not some other error
    return False, str(json.loads(refused.body or "{}").get("message"))


def test_api_server_and_pydantic_model_give_the_same_verdicts(api: Api) -> None:
    """For every case the real API server (server-side dry run, strict field validation, as kubectl
    apply does) accepts exactly when trainguard.core.spec.parse_job does; both verdicts occur."""
    verdicts: dict[str, tuple[bool, bool, str]] = {}
    for name, document in VERDICT_CASES.items():
        accepted, answer = _api_accepts(api, document)
        verdicts[name] = (accepted, _pydantic_accepts(document), answer)
    disagreements = {k: v for k, v in verdicts.items() if v[0] != v[1]}
    assert not disagreements, f"API server vs pydantic (api, pydantic, api's answer): {disagreements}"
    assert {v[0] for v in verdicts.values()} == {True, False}
    assert len(verdicts) >= 15


def _patch_status(api: Api, name: str, status: dict[str, Any]) -> dict[str, Any]:
    patched = api.custom.patch_namespaced_custom_object_status(
        spec.GROUP, spec.VERSION, NAMESPACE, spec.PLURAL, name, {"status": status}
    )
    return cast(dict[str, Any], patched)


@pytest.fixture(scope="module")
def running_job(api: Api) -> str:
    """A GTJ whose status says Running at step 120 after 1 restart and 2 rollbacks."""
    api.create_job(job("columns"))
    _patch_status(api, "columns", {"phase": "Running", "step": 120, "restarts": 1, "rollbacks": 2})
    return "columns"


def _patch_spec(api: Api, name: str, body: dict[str, Any]) -> dict[str, Any]:
    patched = api.custom.patch_namespaced_custom_object(
        spec.GROUP, spec.VERSION, NAMESPACE, spec.PLURAL, name, body
    )
    return cast(dict[str, Any], patched)


def test_status_is_a_subresource(api: Api) -> None:
    """Status changes only through /status, and a status write leaves spec (and generation) alone; a
    spec patch carrying a status changes the spec but not the status."""
    created = api.create_job(job("status-subresource"))
    assert "status" not in created
    generation = created["metadata"]["generation"]
    status = {"phase": "Running", "step": 120, "restarts": 1, "rollbacks": 2}
    assert _patch_status(api, "status-subresource", status)["status"] == status
    stored = api.get_job("status-subresource")
    assert stored["status"] == status
    assert stored["metadata"]["generation"] == generation

    # A /status write that carries a spec change: the spec part is ignored.
    body = {"spec": {"replicas": 7}, "status": {"step": 140}}
    patched = cast(
        dict[str, Any],
        api.custom.patch_namespaced_custom_object_status(
            spec.GROUP, spec.VERSION, NAMESPACE, spec.PLURAL, "status-subresource", body
        ),
    )
    assert patched["status"]["step"] == 140
    assert patched["spec"]["replicas"] == 1
    assert patched["metadata"]["generation"] == generation

    # A write to the main resource that carries a status change: the status part is ignored.
    patched = _patch_spec(api, "status-subresource", {"spec": {"replicas": 3}, "status": {"phase": "Failed"}})
    assert patched["spec"]["replicas"] == 3
    assert patched["status"] == {**status, "step": 140}
    assert patched["metadata"]["generation"] == generation + 1


def test_kubectl_get_gtj_shows_the_printer_columns(api: Api, running_job: str) -> None:
    """``kubectl get gtj`` (the short name) prints the CRD's printer columns."""
    out = api.plane.kubectl("get", "gtj", running_job).stdout.splitlines()
    assert out[0].split() == get_gtj_header(), out
    assert out[1].split()[:5] == [running_job, "Running", "120", "1", "2"], out
    listed = api.plane.kubectl("get", "guardedtrainingjobs", "--output=name").stdout.split()
    assert f"guardedtrainingjob.trainguard.dev/{running_job}" in listed
    # The category works too: `kubectl get trainguard` lists our kinds.
    assert running_job in api.plane.kubectl("get", "trainguard").stdout


def test_kubectl_apply_refuses_an_invalid_job_naming_the_field(api: Api) -> None:
    """What a user sees: ``kubectl apply`` of a bad job fails with the field and the rule's message."""
    document = job("bad-apply", health={"hangTimeoutSeconds": 5, "probePeriodSeconds": 10})
    result = api.plane.kubectl("apply", "--filename=-", stdin=yaml.safe_dump(document), check=False)
    assert result.returncode != 0
    assert "spec.health.hangTimeoutSeconds" in result.stderr, result.stderr
    assert "hangTimeoutSeconds must be longer than probePeriodSeconds" in result.stderr, result.stderr


def test_the_control_plane_hosts_the_kubeflow_pytorchjob_crd(plain_api: Api) -> None:
    """The Kubeflow training operator's PyTorchJob CRD is established, and its example job
    passes a server-side dry-run create (its namespace is created first)."""
    plain_api.plane.kubectl("apply", "--server-side", f"--filename={pytorchjob_crd()}")
    crd = plain_api.wait_established("pytorchjobs.kubeflow.org")
    assert "pytorchjob" in crd["status"]["acceptedNames"]["singular"]
    example = yaml.safe_load(pytorchjob_example().read_text())
    namespace = example["metadata"].get("namespace", NAMESPACE)
    plain_api.plane.kubectl("create", "namespace", namespace, check=False)
    wait_until(
        lambda: plain_api.plane.kubectl("get", "pytorchjobs", "-n", namespace, check=False).returncode == 0
    )
    out = plain_api.plane.kubectl(
        "create", "--dry-run=server", f"--filename={pytorchjob_example()}", "--output=json"
    )
    created = json.loads(out.stdout)
    assert created["kind"] == "PyTorchJob"
    assert set(created["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    assert (
        plain_api.plane.kubectl("get", "pytorchjobs", f"--namespace={namespace}", "--output=name").stdout
        == ""
    )


def wait_until(condition: Callable[[], bool], timeout: float = 30) -> None:
    """Poll ``condition`` every 0.5 s until it holds (fail after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.5)
