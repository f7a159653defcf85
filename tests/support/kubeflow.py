"""Kubeflow's PyTorchJob CRD and example job, as ``scripts/control-plane.sh`` fetched them.

They come from the Go module proxy's copy of the training operator's own module, at the version the test
cluster runs (``bash scripts/setup.sh``, and ``.ci/run``, fetch them; ``bash scripts/control-plane.sh
kubeflow`` fetches only them, in seconds), and are cached under ``~/.cache/trainguard/kubeflow/``.
"""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path

from tests.support.paths import REPO_ROOT

CONTROL_PLANE_SCRIPT = REPO_ROOT / "scripts" / "control-plane.sh"
#: The training operator's CRD of ``PyTorchJob`` (``kubeflow.org/v1``).
PYTORCHJOB_CRD_FILE = "kubeflow.org_pytorchjobs.yaml"
#: Kubeflow's simple PyTorchJob example (one Master, one Worker).
PYTORCHJOB_EXAMPLE_FILE = "pytorchjob-simple.yaml"


@cache
def manifests_dir() -> Path:
    """Where the manifests are (``$TRAINGUARD_KUBEFLOW_DIR`` if set); nothing is fetched here."""
    configured = os.environ.get("TRAINGUARD_KUBEFLOW_DIR")
    if configured:
        return Path(configured)
    out = subprocess.run(
        ["bash", str(CONTROL_PLANE_SCRIPT), "--kubeflow-dir"], capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip())


def _manifest(name: str) -> Path:
    path = manifests_dir() / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: run `bash scripts/setup.sh` (the README's test set-up), or "
            "`bash scripts/control-plane.sh kubeflow` for Kubeflow's manifests alone"
        )
    return path


def pytorchjob_crd() -> Path:
    """The PyTorchJob CRD file; ``FileNotFoundError`` saying how to fetch it when it is missing."""
    return _manifest(PYTORCHJOB_CRD_FILE)


def pytorchjob_example() -> Path:
    """Kubeflow's simple PyTorchJob example file; ``FileNotFoundError`` when it is missing."""
    return _manifest(PYTORCHJOB_EXAMPLE_FILE)
