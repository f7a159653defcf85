"""The container images of the test node, as ``scripts/images.sh`` built them (it is run for this only to
ask where its manifest is: nothing is built here)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.support.paths import REPO_ROOT

IMAGES_SCRIPT = REPO_ROOT / "scripts" / "images.sh"


def manifest_path() -> Path:
    """Where ``scripts/images.sh`` writes (or wrote) the manifest of this checkout's images."""
    out = subprocess.run(
        ["bash", str(IMAGES_SCRIPT), "--manifest"], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip())


def references() -> dict[str, str]:
    """The images by name (``base``, ``pause``, ``trainguard``, ``tiny-lm``, ``coredns``,
    ``pytorch-init``): their references; empty if they are not built."""
    path = manifest_path()
    if not path.exists():
        return {}
    manifest: dict[str, dict[str, str]] = json.loads(path.read_text())
    return {name: entry["ref"] for name, entry in manifest.items()}
