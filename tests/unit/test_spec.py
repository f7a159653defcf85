"""The GuardedTrainingJob spec model and the CRD generated from it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainguard import crd, spec

VALID: dict[str, Any] = {
    "apiVersion": "trainguard.dev/v1alpha1",
    "kind": "GuardedTrainingJob",
    "metadata": {"name": "demo", "namespace": "ml"},
    "spec": {
        "replicas": 2,
        "template": {
            "spec": {"containers": [{"name": "pytorch", "image": "x", "command": ["python", "t.py"]}]}
        },
        "checkpoint": {"claimName": "shared-ckpt"},
    },
}


def with_change(path: str, value: Any) -> dict[str, Any]:
    document = copy.deepcopy(VALID)
    node = document
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return document


def test_defaults_are_the_documented_ones() -> None:
    job = spec.parse_job(VALID, "job.yaml")
    s = job.spec
    assert s.checkpoint.mount_path == "/ckpt"
    assert (s.checkpoint.keep_clean, s.checkpoint.every_steps, s.checkpoint.snapshot_every_steps) == (
        3,
        2000,
        100,
    )
    assert (s.health.hang_timeout_seconds, s.health.startup_grace_seconds, s.health.probe_period_seconds) == (
        300,
        600,
        10,
    )
    assert s.recovery.max_restarts == 5
    assert s.recovery.backoff_seconds == [10, 30, 90]
    assert s.recovery.on_divergence.lr_scale == 0.5
    assert s.data_quality.max_drop_rate == 0.001
    settings = s.guardian_settings()
    assert settings.checkpoint.every_steps == 2000
    assert settings.remediation.max_grad_norm == 0.5


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        ("spec.health", {"hangTimeoutSeconds": 10, "probePeriodSeconds": 10}, "spec.health"),
        ("spec.recovery", {"backoffSeconds": []}, "spec.recovery.backoffSeconds"),
        ("spec.recovery", {"backoffSeconds": [30, 10]}, "spec.recovery.backoffSeconds"),
        ("spec.recovery", {"backoffSeconds": [0, 10]}, "spec.recovery.backoffSeconds"),
        ("spec.guard", {"lossSpikeFactor": 1.0}, "spec.guard.lossSpikeFactor"),
        ("spec.guard", {"lossSpikeWindow": -5}, "spec.guard.lossSpikeWindow"),
        (
            "spec.checkpoint",
            {"claimName": "c", "everySteps": 10, "snapshotEverySteps": 20},
            "spec.checkpoint",
        ),
        ("spec.template", {"spec": {"containers": [{"name": "trainer"}]}}, "spec.template.spec.containers"),
        ("spec.replicas", 0, "spec.replicas"),
        ("spec.gaurd", {}, "spec.gaurd"),
        ("kind", "PyTorchJob", "kind"),
        ("metadata.name", "Not_A_Name", "metadata.name"),
    ],
)
def test_invalid_specs_are_refused_naming_the_field(path: str, value: Any, named: str) -> None:
    with pytest.raises(spec.SpecError) as caught:
        spec.parse_job(with_change(path, value), "job.yaml")
    message = str(caught.value)
    assert message.startswith("job.yaml: ")
    assert named in message


def test_load_job_reads_the_first_gtj_document(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump_all([{"kind": "ConfigMap", "apiVersion": "v1"}, VALID]))
    assert spec.load_job(path).metadata.name == "demo"
    path.write_text("spec: [unclosed")
    with pytest.raises(spec.SpecError, match="not valid YAML"):
        spec.load_job(path)
    with pytest.raises(spec.SpecError, match="cannot be read"):
        spec.load_job(tmp_path / "missing.yaml")


def test_checked_in_crd_matches_the_model() -> None:
    assert crd.CRD_PATH.read_text() == crd.render(), "stale CRD: run python -m trainguard.crd"


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = []
    if isinstance(node, dict):
        found.append((path, node))
        for key in ("properties",):
            for name, child in node.get(key, {}).items():
                found.extend(_walk(child, f"{path}.{name}"))
        if "items" in node:
            found.extend(_walk(node["items"], f"{path}[]"))
        if isinstance(node.get("additionalProperties"), dict):
            found.extend(_walk(node["additionalProperties"], f"{path}{{}}"))
    return found


def test_crd_schema_is_structural() -> None:
    document = crd.build_crd()
    version = document["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "State",
        "Step",
        "Restarts",
        "Rollbacks",
        "Age",
    ]
    schema = version["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        for forbidden in ("$ref", "anyOf", "oneOf", "allOf", "title", "$defs"):
            assert forbidden not in node, f"{path} has {forbidden}"
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        if "properties" in node:
            assert node["type"] == "object", path
        if node.get("type") == "array":
            assert "items" in node, path
            assert "maxItems" in node, path
        if isinstance(node.get("exclusiveMinimum"), bool):
            assert "minimum" in node, path


def test_every_cross_field_rule_has_a_cel_twin() -> None:
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = {
        path: [r["rule"] for r in node["x-kubernetes-validations"]]
        for path, node in _walk(schema)
        if "x-kubernetes-validations" in node
    }
    assert rules == {
        ".spec.template.spec": ["self.containers.exists(c, c.name == 'pytorch')"],
        ".spec.checkpoint": ["self.snapshotEverySteps <= self.everySteps"],
        ".spec.guard": ["self.spikeMinHistory <= self.lossSpikeWindow"],
        ".spec.health": ["self.hangTimeoutSeconds > self.probePeriodSeconds"],
        ".spec.recovery.backoffSeconds": ["self.isSorted()"],
    }


def test_crd_defaults_match_the_model() -> None:
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    props = schema["properties"]["spec"]["properties"]
    assert props["recovery"]["properties"]["backoffSeconds"]["default"] == [10, 30, 90]
    assert props["health"]["properties"]["hangTimeoutSeconds"]["default"] == 300
    assert props["guard"]["default"] == spec.GuardSpec().model_dump(by_alias=True)
    assert props["health"]["default"] == spec.HealthSpec().model_dump(by_alias=True)
    recovery_default = props["recovery"]["default"]
    assert recovery_default == spec.RecoverySpec().model_dump(by_alias=True)
    assert props["checkpoint"]["properties"]["keepClean"]["default"] == 3


def test_crd_check_mode_reports_a_stale_copy(tmp_path: Path) -> None:
    stale = tmp_path / "crd.yaml"
    stale.write_text("old\n")
    assert crd.main(["--check", "--output", str(stale)]) == 1
    assert crd.main(["--output", str(stale)]) == 0
    assert crd.main(["--check", "--output", str(stale)]) == 0
    assert stale.read_text() == crd.render()
