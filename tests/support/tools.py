"""The tools ``scripts/tools.sh`` builds (helm, promtool, prometheus, monitoring-check), found or failed
loudly, and helm run with a private, empty home."""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT as ROOT


@cache
def bin_dir() -> Path:
    """Where ``scripts/tools.sh`` links the tools (``$TRAINGUARD_BIN`` if set); nothing is built here."""
    configured = os.environ.get("TRAINGUARD_BIN")
    if configured:
        return Path(configured)
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "tools.sh"), "--bin-dir"], capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip())


def tool(name: str) -> str:
    """The path of a tool built by scripts/tools.sh; fails loudly when it is missing."""
    path = bin_dir() / name
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"{name} is not built ({path} is missing): run `bash scripts/tools.sh` first "
            "(CI's .ci/run does; it builds helm, promtool, prometheus and monitoring-check from the Go "
            "module proxy)",
            pytrace=False,
        )
    return str(path)


def helm_environ() -> dict[str, str]:
    """This process's environment with a private, empty Helm home (no repositories, plugins or cache)."""
    home = ROOT / "build" / "helm-home"
    return {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run helm with a private, empty Helm home (no repositories, no plugins, no cache)."""
    result = subprocess.run(
        [tool("helm"), *args], capture_output=True, text=True, env=helm_environ(), timeout=120
    )
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}", pytrace=False)
    return result
