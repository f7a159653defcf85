"""The GuardedTrainingJob spec model and the CRD generated from it."""

from __future__ import annotations

import copy
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard.core import crd, spec

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


def test_checkpoints_more_often_than_the_default_snapshots_are_accepted() -> None:
    document = with_change("spec.checkpoint", {"claimName": "c", "everySteps": 10})
    assert spec.parse_job(document, "job.yaml").spec.checkpoint.every_steps == 10


def test_every_steps_auto_reaches_the_guardian_with_its_bounds() -> None:
    document = with_change(
        "spec.checkpoint", {"claimName": "c", "everySteps": "auto", "assumedMtbfSeconds": 3600}
    )
    policy = spec.parse_job(document, "job.yaml").spec.guardian_settings().checkpoint
    assert policy.auto
    assert policy.every_steps == "auto"
    assert (policy.assumed_mtbf_seconds, policy.auto_min_steps, policy.auto_max_steps) == (3600, 10, 100_000)


def test_a_bad_every_steps_says_what_is_allowed() -> None:
    with pytest.raises(spec.SpecError) as caught:
        spec.parse_job(with_change("spec.checkpoint", {"claimName": "c", "everySteps": "often"}), "job.yaml")
    expected = 'spec.checkpoint.everySteps: Value error, must be a positive integer (at most 10^9) or "auto"'
    assert expected in str(caught.value)


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
        ("spec.recovery", {"deterministicFailureLimit": 1}, "spec.recovery.deterministicFailureLimit"),
        ("spec.recovery", {"deterministicFailureLimit": 101}, "spec.recovery.deterministicFailureLimit"),
        ("spec.guard", {"lossSpikeFactor": 1.0}, "spec.guard.lossSpikeFactor"),
        ("spec.guard", {"lossSpikeWindow": -5}, "spec.guard.lossSpikeWindow"),
        ("spec.template", {"spec": {"containers": [{"name": "trainer"}]}}, "spec.template.spec.containers"),
        ("spec.replicas", 0, "spec.replicas"),
        ("spec.gaurd", {}, "spec.gaurd"),
        ("kind", "PyTorchJob", "kind"),
        ("metadata.name", "Not_A_Name", "metadata.name"),
        # Strict types: nothing is coerced.
        ("spec.replicas", True, "spec.replicas"),
        ("spec.replicas", "2", "spec.replicas"),
        ("spec.replicas", 2.0, "spec.replicas"),
        ("spec.health", {"hangTimeoutSeconds": "600"}, "spec.health.hangTimeoutSeconds"),
        ("spec.guard", {"maxGradNorm": True}, "spec.guard.maxGradNorm"),
        ("spec.guard", {"maxGradNorm": "1.0"}, "spec.guard.maxGradNorm"),
        ("spec.recovery", {"backoffSeconds": [1, "2"]}, "spec.recovery.backoffSeconds.1"),
        ("spec.recovery", {"onDivergence": {"lrScale": "0.5"}}, "spec.recovery.onDivergence.lrScale"),
        ("spec.checkpoint", {"claimName": "c", "keepClean": False}, "spec.checkpoint.keepClean"),
        (
            "spec.template",
            {"spec": {"containers": [{"name": "pytorch", "command": ["python", 3]}]}},
            "spec.template.spec.containers.0.command.1",
        ),
        # Bounds: what the runtime can honour.
        ("spec.health", {"hangTimeoutSeconds": 10**400}, "spec.health.hangTimeoutSeconds"),
        ("spec.health", {"hangTimeoutSeconds": 604_801}, "spec.health.hangTimeoutSeconds"),
        ("spec.health", {"startupGraceSeconds": 10**12}, "spec.health.startupGraceSeconds"),
        (
            "spec.health",
            {"probePeriodSeconds": 3601, "hangTimeoutSeconds": 7200},
            "spec.health.probePeriodSeconds",
        ),
        ("spec.health", {"hangTimeoutSeconds": math.inf}, "spec.health.hangTimeoutSeconds"),
        ("spec.recovery", {"backoffSeconds": [1, 86_401]}, "spec.recovery.backoffSeconds.1"),
        ("spec.recovery", {"maxRestarts": 10_001}, "spec.recovery.maxRestarts"),
        ("spec.recovery", {"onDivergence": {"maxGradNorm": math.inf}}, "spec.recovery.onDivergence"),
        ("spec.guard", {"maxGradNorm": math.inf}, "spec.guard.maxGradNorm"),
        ("spec.guard", {"maxGradNorm": math.nan}, "spec.guard.maxGradNorm"),
        ("spec.guard", {"lossSpikeFactor": 1e308}, "spec.guard.lossSpikeFactor"),
        ("spec.guard", {"lossSpikeWindow": 10**9}, "spec.guard.lossSpikeWindow"),
        ("spec.guard", {"rollbackWindowSteps": 10**9 + 1}, "spec.guard.rollbackWindowSteps"),
        ("spec.checkpoint", {"claimName": "c", "everySteps": 10**18}, "spec.checkpoint.everySteps"),
        ("spec.checkpoint", {"claimName": "c", "keepClean": 1001}, "spec.checkpoint.keepClean"),
        ("spec.checkpoint", {"claimName": "c", "everySteps": "often"}, "spec.checkpoint.everySteps"),
        ("spec.checkpoint", {"claimName": "c", "everySteps": 0}, "spec.checkpoint.everySteps"),
        ("spec.checkpoint", {"claimName": "c", "everySteps": "100"}, "spec.checkpoint.everySteps"),
        ("spec.checkpoint", {"claimName": "c", "everySteps": True}, "spec.checkpoint.everySteps"),
        ("spec.checkpoint", {"claimName": "c", "everySteps": 10.0}, "spec.checkpoint.everySteps"),
        ("spec.checkpoint", {"claimName": "c", "autoMinSteps": 5, "autoMaxSteps": 4}, "spec.checkpoint"),
        ("spec.checkpoint", {"claimName": "c", "assumedMtbfSeconds": 59}, "checkpoint.assumedMtbfSeconds"),
        ("spec.replicas", 4097, "spec.replicas"),
        # Names are Kubernetes names: nothing a path could be built from to leave its folder.
        ("spec.checkpoint", {"claimName": "../../../../tmp/x"}, "spec.checkpoint.claimName"),
        ("spec.checkpoint", {"claimName": ".."}, "spec.checkpoint.claimName"),
        ("spec.checkpoint", {"claimName": "a/b"}, "spec.checkpoint.claimName"),
        ("spec.checkpoint", {"claimName": "a..b"}, "spec.checkpoint.claimName"),
        ("spec.checkpoint", {"claimName": "Ckpt"}, "spec.checkpoint.claimName"),
        ("spec.checkpoint", {"claimName": "ckpt\n"}, "spec.checkpoint.claimName"),
        ("spec.checkpoint", {"claimName": "c" * 254}, "spec.checkpoint.claimName"),
        ("metadata.namespace", "/tmp/y", "metadata.namespace"),
        ("metadata.namespace", "..", "metadata.namespace"),
        ("metadata.namespace", "a.b", "metadata.namespace"),
        ("metadata.namespace", "", "metadata.namespace"),
        ("metadata.namespace", "n" * 64, "metadata.namespace"),
        ("metadata.name", "../x", "metadata.name"),
    ],
)
def test_invalid_specs_are_refused_naming_the_field(path: str, value: Any, named: str) -> None:
    with pytest.raises(spec.SpecError) as caught:
        spec.parse_job(with_change(path, value), "job.yaml")
    message = str(caught.value)
    assert message.startswith("job.yaml: ")
    assert named in message


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("spec.checkpoint", {"claimName": "team-a.ckpt-1"}),
        ("spec.checkpoint", {"claimName": "c", "everySteps": "auto"}),
        ("spec.checkpoint", {"claimName": "c", "everySteps": 10**9, "autoMinSteps": 7, "autoMaxSteps": 7}),
        ("metadata.namespace", "ml-team-1"),
        ("spec.guard", {"maxGradNorm": 2}),  # an int where a float is expected
        ("spec.health", {"hangTimeoutSeconds": 604_800, "startupGraceSeconds": 604_800}),
        ("spec.recovery", {"backoffSeconds": [1, 86_400], "maxRestarts": 10_000}),
        ("spec.recovery", {"deterministicFailureLimit": 0}),
        ("spec.recovery", {"deterministicFailureLimit": 2}),
        ("spec.recovery", {"deterministicFailureLimit": 100}),
        ("spec.template", {"spec": {"containers": [{"name": "pytorch", "workingDir": "/w"}]}}),
    ],
)
def test_valid_values_at_the_bounds_are_accepted(path: str, value: Any) -> None:
    spec.parse_job(with_change(path, value), "job.yaml")


def test_load_job_reads_the_first_gtj_document(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump_all([{"kind": "ConfigMap", "apiVersion": "v1"}, VALID]))
    assert spec.load_job(path).metadata.name == "demo"
    path.write_text("spec: [unclosed")
    with pytest.raises(spec.SpecError, match="not valid YAML"):
        spec.load_job(path)
    with pytest.raises(spec.SpecError, match="cannot be read"):
        spec.load_job(tmp_path / "missing.yaml")


def _fifo(folder: Path) -> Path:
    os.mkfifo(folder / "fifo")
    return folder / "fifo"


def _alias_bomb(levels: int) -> str:
    lines = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9)}]" for n in range(1, levels)]
    return "\n".join(lines) + f"\nspec: {{template: {{spec: {{volumes: *l{levels - 1}}}}}}}\n"


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda p: Path("/dev/zero"), "/dev/zero is a character device, not a regular file"),
        (lambda p: p, "is a directory, not a regular file"),
        (_fifo, "is a FIFO, not a regular file"),
        (lambda p: (p / "big.yaml", (p / "big.yaml").write_bytes(b"#" * (5 << 20)))[0], "more than"),
        (lambda p: (p / "bin.yaml", (p / "bin.yaml").write_bytes(b"kind: \xff\xfe"))[0], "not UTF-8"),
        (
            lambda p: (
                p / "bomb.yaml",
                (p / "bomb.yaml").write_text("kind: GuardedTrainingJob\n" + _alias_bomb(9)),
            )[0],
            "aliases are expanded",
        ),
    ],
    ids=["device", "directory", "fifo", "too-large", "binary", "alias-bomb"],
)
def test_a_job_file_that_is_not_a_small_text_file_is_refused_at_once(
    tmp_path: Path, make: Callable[[Path], Path], named: str
) -> None:
    # /dev/zero used to be read for ever; a FIFO waited for a writer; an alias bomb cost seconds and GBs.
    with pytest.raises(spec.SpecError, match=re.escape(named)):
        spec.load_job(make(tmp_path))


def test_checked_in_crd_matches_the_model() -> None:
    assert crd.CRD_PATH.read_text() == crd.render(), "stale CRD: run python -m trainguard.core.crd"


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
        "Steps/s",
        "ETA",
        "Lost",
        "Age",
    ]
    schema = version["schema"]["openAPIV3Schema"]
    status = schema["properties"]["status"]["properties"]
    for column in version["additionalPrinterColumns"]:
        where, _, field = column["jsonPath"].lstrip(".").partition(".")
        if where == "status":  # a column shows a field the status model has, of the column's type
            assert field in status, column
            assert status[field]["type"] == column["type"], column
    for path, node in _walk(schema):
        for forbidden in ("$ref", "anyOf", "oneOf", "allOf", "title", "$defs"):
            assert forbidden not in node, f"{path} has {forbidden}"
        untyped = node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-int-or-string")
        assert "type" in node or untyped, f"{path} has no type"
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
        ".spec.guard": ["!has(self.spikeMinHistory) || self.spikeMinHistory <= self.lossSpikeWindow"],
        ".spec.health": ["self.hangTimeoutSeconds > self.probePeriodSeconds"],
        ".spec.recovery.backoffSeconds": ["self.isSorted()"],
        ".spec.recovery.deterministicFailureLimit": ["self == 0 || self >= 2"],
        ".spec.checkpoint": ["self.autoMinSteps <= self.autoMaxSteps"],
        ".spec.checkpoint.everySteps": [EVERY_STEPS_RULE],
    }


def test_crd_defaults_match_the_model() -> None:
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    props = schema["properties"]["spec"]["properties"]
    assert props["recovery"]["properties"]["backoffSeconds"]["default"] == [10, 30, 90]
    assert props["health"]["properties"]["hangTimeoutSeconds"]["default"] == 300
    assert props["guard"]["default"] == spec.GuardSpec().model_dump(by_alias=True, exclude_none=True)
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


# ------------------------------------------------------------------ the API server's verdict, emulated ---
# The e2e tier compares the pydantic model with a real kube-apiserver on a fixed list of cases; this
# property test compares it on many generated ones with the API server's steps done here: defaults filled
# in from the CRD, the structural schema checked (OpenAPI 3.0 bounds are JSON Schema draft 4's; a pattern's
# "$" matches only at the end, as in Go), unknown fields refused (kubectl's strict
# field validation), then each CEL rule through a Python twin. A rule without a twin fails the test.

EVERY_STEPS_RULE = "type(self) == string ? self == 'auto' : (self >= 1 && self <= 1000000000)"
CEL_TWINS: dict[str, Callable[[Any], bool]] = {
    "self.containers.exists(c, c.name == 'pytorch')": lambda n: any(
        c.get("name") == "pytorch" for c in n["containers"]
    ),
    "!has(self.spikeMinHistory) || self.spikeMinHistory <= self.lossSpikeWindow": lambda n: bool(
        n.get("spikeMinHistory") is None or n["spikeMinHistory"] <= n["lossSpikeWindow"]
    ),
    "self.hangTimeoutSeconds > self.probePeriodSeconds": lambda n: bool(
        n["hangTimeoutSeconds"] > n["probePeriodSeconds"]
    ),
    "self.isSorted()": lambda n: list(n) == sorted(n),
    "self == 0 || self >= 2": lambda n: bool(n == 0 or n >= 2),
    "self.autoMinSteps <= self.autoMaxSteps": lambda n: bool(n["autoMinSteps"] <= n["autoMaxSteps"]),
    EVERY_STEPS_RULE: lambda n: (
        n == "auto"
        if isinstance(n, str)
        else isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 10**9  # an int-or-string's int
    ),
}


def _go_pattern(
    validator: Any, pattern: str, instance: Any, schema: dict[str, Any]
) -> Iterator[jsonschema.ValidationError]:
    # A search, as in Go, where "$" (without multi-line mode) matches only at the very end.
    go_end = re.sub(r"\$$", r"\\Z", pattern)
    if isinstance(instance, str) and re.search(go_end, instance) is None:
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_ApiServerSchema = jsonschema.validators.extend(jsonschema.Draft4Validator, {"pattern": _go_pattern})


def _openapi_to_jsonschema(node: Any) -> Any:
    if isinstance(node, list):
        return [_openapi_to_jsonschema(v) for v in node]
    if not isinstance(node, dict):
        return node
    converted = {k: _openapi_to_jsonschema(v) for k, v in node.items()}
    if converted.pop("nullable", False) and "type" in converted:
        converted["type"] = [converted["type"], "null"]
    return converted


def _defaulted(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        for name, child in schema["properties"].items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = _defaulted(child, value[name])
    elif isinstance(value, list) and "items" in schema:
        return [_defaulted(schema["items"], v) for v in value]
    return value


def _unknown_fields(schema: dict[str, Any], value: Any) -> bool:
    if isinstance(value, dict) and "properties" in schema:
        if not schema.get("x-kubernetes-preserve-unknown-fields") and set(value) - set(schema["properties"]):
            return True
        return any(
            _unknown_fields(schema["properties"][k], v) for k, v in value.items() if k in schema["properties"]
        )
    if isinstance(value, list) and "items" in schema:
        return any(_unknown_fields(schema["items"], v) for v in value)
    return False


def _cel_holds(schema: dict[str, Any], value: Any) -> bool:
    for rule in schema.get("x-kubernetes-validations", []):
        if not CEL_TWINS[rule["rule"]](value):
            return False
    if isinstance(value, dict):
        children = schema.get("properties", {})
        return all(_cel_holds(children[k], v) for k, v in value.items() if k in children)
    if isinstance(value, list) and "items" in schema:
        return all(_cel_holds(schema["items"], v) for v in value)
    return True


SPEC_SCHEMA = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def api_server_accepts(job_spec: dict[str, Any]) -> bool:
    """The API server's verdict on a GuardedTrainingJob spec (see above)."""
    value = _defaulted(SPEC_SCHEMA, copy.deepcopy(job_spec))
    if not _ApiServerSchema(_openapi_to_jsonschema(SPEC_SCHEMA)).is_valid(value):
        return False
    return not _unknown_fields(SPEC_SCHEMA, value) and _cel_holds(SPEC_SCHEMA, value)


def pydantic_accepts(job_spec: dict[str, Any]) -> bool:
    try:
        spec.parse_job({**VALID, "spec": copy.deepcopy(job_spec)}, "case")
    except spec.SpecError:
        return False
    return True


def _candidates(node: dict[str, Any]) -> list[Any]:
    """Values on and around a leaf's bounds, and values of the wrong type."""
    wrong = [True, "7", None, [1]]
    if node.get("enum"):
        return [*node["enum"], str(node["enum"][0]).lower(), "", *wrong]
    if node.get("x-kubernetes-int-or-string"):
        return [0, 1, 10**9, 10**9 + 1, "auto", "Auto", "", 2.5, *wrong]
    if node.get("type") == "integer":
        low, high = node.get("minimum", 0), node.get("maximum", 10**6)
        return [low - 1, low, low + 1, high - 1, high, high + 1, 10**30, 2.5, *wrong]
    if node.get("type") == "number":
        low, high = node.get("minimum", 0), node.get("maximum", 1e6)
        return [low, low + 1e-9, int(low) + 1, (low + high) / 2, high, high * 1.000001, 1e300, *wrong]
    if node.get("type") == "array":
        item = node["items"]
        low, high = item.get("minimum", 1), item.get("maximum", 100)
        return [[], [low], [low - 1], [low, high], [high, low], [low, high + 1], [low] * 21, ["1"], True]
    if node.get("type") == "string":
        return ["ckpt", "a.b-c", "/abs", "rel", "../x", "A", "a..b", "x\n", "c" * 254, 7, None]
    return wrong


def _section(node: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    optional = {
        name: _section(child) if "properties" in child else st.sampled_from(_candidates(child))
        for name, child in node["properties"].items()
    }
    return st.fixed_dictionaries({}, optional=optional)


_TEMPLATES = [
    VALID["spec"]["template"],
    {"spec": {"containers": [{"name": "sidecar"}, {"name": "pytorch", "workingDir": "/w"}]}},
    {"spec": {"containers": [{"name": "trainer"}]}},
    {"spec": {"containers": [{"name": "pytorch", "command": ["python", 3]}]}},
    {"spec": {"containers": [{"name": "pytorch", "args": ["a" * 4097]}]}},
    {"spec": {"containers": []}},
]
_SECTIONS = {
    # A leaf of the spec itself (backend) takes its candidates; a section, its fields'.
    name: (_section(node) if "properties" in node else st.sampled_from(_candidates(node)))
    | st.sampled_from([None, 3])
    for name, node in SPEC_SCHEMA["properties"].items()
    if name not in ("template", "checkpoint", "replicas", "nprocPerNode")
}
SPECS = st.fixed_dictionaries(
    {
        "template": st.sampled_from(_TEMPLATES),
        "checkpoint": _section(SPEC_SCHEMA["properties"]["checkpoint"]).map(
            lambda c: {"claimName": "c", **c}
        ),
    },
    optional={
        "replicas": st.sampled_from(_candidates(SPEC_SCHEMA["properties"]["replicas"])),
        "nprocPerNode": st.sampled_from(_candidates(SPEC_SCHEMA["properties"]["nprocPerNode"])),
        **_SECTIONS,
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SPECS)
def test_the_api_server_and_the_model_refuse_the_same_specs(job_spec: dict[str, Any]) -> None:
    assert api_server_accepts(job_spec) == pydantic_accepts(job_spec)


def test_the_emulated_api_server_takes_both_verdicts() -> None:
    accepted = VALID["spec"]
    assert api_server_accepts(accepted)
    assert pydantic_accepts(accepted)
    for refused in (
        {**accepted, "replicas": True},
        {**accepted, "health": {"hangTimeoutSeconds": 10, "probePeriodSeconds": 10}},
        {**accepted, "checkpoint": {"claimName": "../x"}},
        {**accepted, "recovery": {"backoffSeconds": [3, 2]}},
        {**accepted, "recovery": {"deterministicFailureLimit": 1}},
        {**accepted, "guard": {"maxGradNorm": 1e7}},
    ):
        assert not api_server_accepts(refused), refused
        assert not pydantic_accepts(refused), refused
