"""Where things are in the repository."""

from __future__ import annotations

from pathlib import Path

#: The repository's root folder.
REPO_ROOT = Path(__file__).resolve().parents[2]
#: The GuardedTrainingJob CRD generated from the spec model.
GTJ_CRD = REPO_ROOT / "crds" / "guardedtrainingjobs.trainguard.dev.yaml"
#: The Helm chart.
CHART = REPO_ROOT / "charts" / "trainguard"
