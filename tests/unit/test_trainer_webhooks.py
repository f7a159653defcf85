"""tests/support/trainer.py's webhook configurations: the module's, patched, pointed at a host process."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml

from tests.support.trainer import _json_patch, webhook_configurations

WEBHOOKS = """
---
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata:
  name: mutating-webhook-configuration
webhooks:
- name: mjobset.kb.io
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /mutate-jobset}
- name: mpod.kb.io
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /mutate--v1-pod}
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: validating-webhook-configuration
webhooks:
- name: vjobset.kb.io
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /validate-jobset}
"""

# As JobSet's kustomize patch: the pod webhook replaced by one with an objectSelector.
MUTATING_PATCH = """
- op: replace
  path: /webhooks/1
  value:
    name: mpod.kb.io
    clientConfig:
      service: {name: webhook-service, namespace: system, path: /mutate--v1-pod}
    objectSelector:
      matchExpressions: [{key: jobset.sigs.k8s.io/jobset-name, operator: Exists}]
"""


def test_configurations_call_the_host_process_with_the_ca_and_keep_the_patches(tmp_path: Path) -> None:
    (tmp_path / "webhooks.yaml").write_text(WEBHOOKS)
    (tmp_path / "mutating.yaml").write_text(MUTATING_PATCH)
    mutating, validating = webhook_configurations(
        tmp_path, "test-jobset", 9443, b"CA PEM", {"MutatingWebhookConfiguration": "mutating.yaml"}
    )
    assert (mutating["metadata"], validating["metadata"]) == ({"name": "test-jobset"},) * 2
    urls = [w["clientConfig"]["url"] for d in (mutating, validating) for w in d["webhooks"]]
    assert urls == [
        "https://127.0.0.1:9443/mutate-jobset",
        "https://127.0.0.1:9443/mutate--v1-pod",
        "https://127.0.0.1:9443/validate-jobset",
    ]
    bundles = {w["clientConfig"]["caBundle"] for d in (mutating, validating) for w in d["webhooks"]}
    assert bundles == {base64.b64encode(b"CA PEM").decode()}
    selector = mutating["webhooks"][1]["objectSelector"]["matchExpressions"][0]
    assert selector["key"] == "jobset.sigs.k8s.io/jobset-name"
    assert "objectSelector" not in mutating["webhooks"][0]
    assert "objectSelector" not in validating["webhooks"][0]


def test_json_patch_adds_and_replaces_on_a_copy_and_refuses_other_operations() -> None:
    document = {"webhooks": [{"name": "a"}, {"name": "b"}], "metadata": {"name": "x"}}
    patched = _json_patch(
        document,
        [
            {"op": "add", "path": "/webhooks/0/objectSelector", "value": {"k": "v"}},
            {"op": "replace", "path": "/metadata/name", "value": "y"},
        ],
    )
    assert patched == {"webhooks": [{"name": "a", "objectSelector": {"k": "v"}}, {"name": "b"}],
                       "metadata": {"name": "y"}}  # fmt: skip
    assert document["metadata"] == {"name": "x"}
    with pytest.raises(ValueError, match="remove"):
        _json_patch(document, yaml.safe_load("[{op: remove, path: /metadata}]"))
