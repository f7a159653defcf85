"""Generates the GuardedTrainingJob CustomResourceDefinition from the pydantic models.

``python -m trainguard.core.crd`` writes ``crds/guardedtrainingjobs.trainguard.dev.yaml``; a test fails
when the checked-in file differs from what this module generates. The conversion turns pydantic's
JSON Schema into a Kubernetes structural schema: references inlined, ``Optional`` as ``nullable``,
numeric exclusive bounds in the OpenAPI 3.0 form, titles dropped, and objects that accept unknown
fields marked ``x-kubernetes-preserve-unknown-fields``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic.alias_generators import to_camel

from trainer_sidecar.contract import fields
from trainguard.core import spec

_ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = _ROOT / "crds" / f"{spec.PLURAL}.{spec.GROUP}.yaml"
#: The Helm chart renders the CRD from its own files/ copy (a chart cannot reach outside itself).
CHART_CRD_PATH = _ROOT / "charts" / "trainguard" / "files" / CRD_PATH.name

#: The columns of the job's own numbers; each reported field's column (``ReportedField.column``) is
#: placed among them by ``printer_columns``.
OWN_COLUMNS = [
    {"name": "State", "type": "string", "jsonPath": ".status.phase", "description": "Job phase."},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "description": "Gang restarts."},
    {
        "name": "Steps/s",
        "type": "number",
        "jsonPath": ".status.stepsPerSecond",
        "description": "Steps per second of the current attempt.",
    },
    {
        "name": "ETA",
        "type": "string",
        "jsonPath": ".status.eta",
        "description": "Time to the declared max steps at the current rate.",
    },
    {
        "name": "Lost",
        "type": "string",
        "jsonPath": ".status.lost",
        "description": "Time not spent on kept steps (recoveries, rollbacks, start).",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_SCHEMA_TYPES = {int: "integer", float: "number", str: "string"}


def printer_columns() -> list[dict[str, Any]]:
    """The ``kubectl get`` columns: the job's own, with each reported field's after the column it names
    (before Age when it names none)."""
    columns = [dict(c) for c in OWN_COLUMNS]
    for reported in fields.surfaced("column"):
        if reported.column is None or reported.status is None:
            continue
        column = {
            "name": reported.column.name,
            "type": _SCHEMA_TYPES[reported.type],
            "jsonPath": f".status.{to_camel(reported.status)}",
            "description": reported.column.description,
        }
        names = [c["name"] for c in columns]
        after = reported.column.after
        columns.insert(names.index(after) + 1 if after in names else len(columns) - 1, column)
    return columns


#: The columns as the registry listed them when this module loaded (``printer_columns`` reads it now).
PRINTER_COLUMNS = printer_columns()


def status_schema() -> dict[str, Any]:
    """The status's structural schema: the status model's, with every reported field's status value
    (``ReportedField.status``) as a property, described by its field where the model does not say."""
    schema = openapi_schema(spec.GuardedTrainingJobStatus)
    properties = schema["properties"]
    for reported in fields.surfaced("status"):
        if reported.status is None:
            continue
        prop = properties.setdefault(
            to_camel(reported.status), structural({"type": _SCHEMA_TYPES[reported.type], "nullable": True})
        )
        prop.setdefault("description", reported.description)
    return schema


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            target = defs[node["$ref"].rsplit("/", 1)[-1]]
            merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
            return _resolve(merged, defs)
        return {k: _resolve(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_resolve(v, defs) for v in node]
    return node


def structural(node: Any) -> Any:
    """Convert one (already inlined) JSON Schema node into a structural OpenAPI v3 schema node."""
    if not isinstance(node, dict):
        return node
    node = dict(node)
    node.pop("title", None)
    if node.get("x-kubernetes-int-or-string"):
        # An int or a string: the API server knows no anyOf of types, only this marker; the values
        # themselves are checked by the node's CEL rule.
        node.pop("anyOf", None)
        node.pop("type", None)
        return node
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        non_null = [s for s in any_of if s.get("type") != "null"]
        if len(non_null) != 1:
            raise ValueError(f"cannot express anyOf {any_of} structurally")
        merged = {**non_null[0], **node, "nullable": True}
        if merged.get("default", 0) is None:
            merged.pop("default")
        return structural(merged)
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), (int, float)) and not isinstance(node.get(bound), bool):
            node[plain] = node.pop(bound)
            node[bound] = True
    extra = node.pop("additionalProperties", None)
    if node.get("type") == "object" and extra is True:
        node["x-kubernetes-preserve-unknown-fields"] = True
    elif isinstance(extra, dict):
        node["additionalProperties"] = structural(extra)
    if "properties" in node:
        properties = {name: structural(child) for name, child in node["properties"].items()}
        required = set(node.get("required", []))
        for name, child in properties.items():
            # Sections whose every field has a default are defaulted as a whole, so the API server
            # fills in the nested defaults even when the user leaves the section out.
            optional_section = (
                name not in required and child.get("type") == "object" and "properties" in child
            )
            if optional_section and "default" not in child and not child.get("required"):
                # The API server checks a default against the section's CEL rules without filling in
                # the nested defaults first, so the section default must spell its fields out.
                child["default"] = {
                    key: copy.deepcopy(prop["default"])  # copies: no YAML anchors in the output
                    for key, prop in child["properties"].items()
                    if "default" in prop
                }
        node["properties"] = properties
    if "items" in node:
        node["items"] = structural(node["items"])
    if node.get("type") == "array" and "maxItems" not in node:
        node["maxItems"] = 256  # bounded lists keep CEL cost estimates within the API server's budget
    if (
        node.get("type") == "string"
        and "maxLength" not in node
        and "pattern" not in node
        and "enum" not in node
    ):
        node["maxLength"] = 1024
    return node


def openapi_schema(model: type[Any]) -> dict[str, Any]:
    """The structural schema of a pydantic model, by alias."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(_resolve(raw, raw.get("$defs", {})))  # type: ignore[no-any-return]


def build_crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition object."""
    root = {
        "type": "object",
        "description": "A PyTorch job that survives NaNs, loss explosions, hung ranks and crashed pods.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": openapi_schema(spec.GuardedTrainingJobSpec),
            "status": status_schema(),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{spec.PLURAL}.{spec.GROUP}",
            "labels": {"app.kubernetes.io/name": "trainguard", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": spec.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": spec.KIND,
                "listKind": f"{spec.KIND}List",
                "plural": spec.PLURAL,
                "singular": spec.SINGULAR,
                "shortNames": spec.SHORT_NAMES,
                "categories": ["trainguard"],
            },
            "versions": [
                {
                    "name": spec.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": printer_columns(),
                }
            ],
        },
    }


def render() -> str:
    """The CRD as the YAML text that is checked in."""
    header = "# Generated by `python -m trainguard.core.crd` from trainguard/core/spec.py. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    """Write the CRD and the chart's copy (or, with --check, exit 1 when either is stale)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--output", type=Path, action="append", help="write here instead (repeatable)")
    args = parser.parse_args(argv)
    text = render()
    outputs: list[Path] = args.output or [CRD_PATH, CHART_CRD_PATH]
    if args.check:
        stale = [p for p in outputs if not p.exists() or p.read_text() != text]
        for path in stale:
            print(f"{path} is stale: run python -m trainguard.core.crd", file=sys.stderr)
        return 1 if stale else 0
    for path in outputs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
