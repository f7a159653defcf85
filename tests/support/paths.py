"""Where things are: the repository and the shared reference data beside it."""

from __future__ import annotations

from pathlib import Path

#: The repository's root folder.
REPO_ROOT = Path(__file__).resolve().parents[2]
#: The shared folder beside the repository (reference data such as Kubeflow's CRDs); CI has it too.
SHARED = REPO_ROOT.parent / "shared"
#: The GuardedTrainingJob CRD generated from the spec model.
GTJ_CRD = REPO_ROOT / "crds" / "guardedtrainingjobs.trainguard.dev.yaml"
#: The Helm chart.
CHART = REPO_ROOT / "charts" / "trainguard"
