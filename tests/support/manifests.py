"""GuardedTrainingJob manifests for tests, and the schemas of Kubeflow's PyTorchJob and of Trainer v2's
TrainJob and ClusterTrainingRuntime to check renders."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from functools import cache
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import yaml

from tests.support import kubeflow, trainer
from trainguard.core.crd import PRINTER_COLUMNS
from trainguard.core.spec import GuardedTrainingJob, parse_job

USER_ENV: list[dict[str, Any]] = [
    {"name": "TRAINGUARD_FAULTS", "value": "nan_loss@100x4"},
    {"name": "DATA_DIR", "value": "/data"},
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
]


def gtj_manifest(
    name: str = "tiny-lm",
    namespace: str = "research",
    replicas: int = 2,
    env: list[dict[str, Any]] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A GuardedTrainingJob manifest as ``kubectl apply`` would send it (extra spec keys merged in)."""
    return {
        "apiVersion": "trainguard.dev/v1alpha1",
        "kind": "GuardedTrainingJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "template": {
                "metadata": {"labels": {"team": "nlp"}},
                "spec": {
                    "containers": [
                        {
                            "name": "pytorch",
                            "image": "registry.example/tiny-lm:1",
                            "command": ["python", "train.py"],
                            "args": ["--max-steps", "1000"],
                            "env": copy.deepcopy(USER_ENV if env is None else env),
                            "resources": {"limits": {"nvidia.com/gpu": 1}},
                        }
                    ],
                    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                },
            },
            "checkpoint": {"claimName": "tiny-lm-ckpt", "mountPath": "/ckpt"},
            "health": {"hangTimeoutSeconds": 300, "startupGraceSeconds": 605, "probePeriodSeconds": 10},
            **spec,
        },
    }


def load(manifest: Mapping[str, Any]) -> GuardedTrainingJob:
    """Validate a manifest as the operator does."""
    return parse_job(manifest, "test")


# ------------------------------------------------------------------------------------ the schema ---
def _strict(schema: Any) -> Any:
    """The CRD schema as a JSON schema that also refuses what the API server would prune.

    Kubernetes' structural schemas drop unknown fields silently; a rendered field the CRD does not know
    (a typo, or a field newer than the CRD) would vanish on a real cluster. So every object schema with
    ``properties`` and no ``additionalProperties`` or ``x-kubernetes-preserve-unknown-fields`` gets
    ``additionalProperties: false``. The other ``x-kubernetes-*`` keys are left for jsonschema to ignore;
    int-or-string fields already carry ``anyOf: [integer, string]``.
    """
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: _strict(value) for key, value in schema.items()}
    if (
        "properties" in result
        and "additionalProperties" not in result
        and not result.get("x-kubernetes-preserve-unknown-fields")
    ):
        result["additionalProperties"] = False
    return result


@cache
def validator() -> jsonschema.Draft7Validator:
    """The strict PyTorchJob v1 schema (see ``_strict``)."""
    crd = yaml.load(kubeflow.pytorchjob_crd().read_text(), Loader=yaml.CSafeLoader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def schema_errors(manifest: Mapping[str, Any]) -> list[str]:
    """Every way ``manifest`` breaks the strict PyTorchJob schema (``path: message``)."""
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator().iter_errors(manifest)]


@cache
def trainer_validator(kind: str) -> jsonschema.Draft7Validator:
    """The strict schema (see ``_strict``) of Trainer v2's ``kind`` (``TrainJob`` or
    ``ClusterTrainingRuntime``, ``trainer.kubeflow.org/v1alpha1``), from the CRD ``scripts/trainer.sh``
    copied out of Trainer's module; ``FileNotFoundError`` saying how to fetch it when it is missing."""
    (name,) = [n for n in trainer.TRAINER_CRDS if n.endswith(f"_{kind.lower()}s.yaml")]
    path = trainer.trainer_manifests() / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `bash scripts/trainer.sh`")
    crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def trainer_schema_errors(document: Mapping[str, Any]) -> list[str]:
    """Every way ``document`` (a TrainJob or a ClusterTrainingRuntime) breaks its kind's strict schema
    (``path: message``)."""
    errors = trainer_validator(str(document["kind"])).iter_errors(document)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


def get_gtj_header() -> list[str]:
    """The header ``kubectl get gtj`` prints: NAME, then the CRD's printer columns (upper case)."""
    return ["NAME", *(str(column["name"]).upper() for column in PRINTER_COLUMNS)]
