"""docs/architecture.md stays true: it places every module of the product, under its own package."""

from __future__ import annotations

import re

from tests.support.paths import REPO_ROOT

DOC = REPO_ROOT / "docs" / "architecture.md"
#: The doc's paragraph heading for each package folder (the operator folder imports as trainguard_operator).
PACKAGES = {
    "trainer_sidecar/contract": "**contract/**",
    "trainer_sidecar/tensors": "**tensors/**",
    "trainer_sidecar/checkpoint": "**checkpoint/**",
    "trainer_sidecar/guardian": "**guardian/**",
    "trainer_sidecar/sidecar": "**sidecar/**",
    "trainer_sidecar/launcher": "**launcher/**",
    "trainguard/core": "**trainguard/core/**",
    "trainguard/local": "**trainguard/local/**",
    "operator": "**operator/**",
    "operator/backends": "**operator/backends/**",
}


def paragraph(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n\n", start)
    return text[start : end if end != -1 else len(text)]


def test_every_module_is_placed_in_its_packages_paragraph() -> None:
    text = DOC.read_text()
    missing = []
    for folder, heading in PACKAGES.items():
        named = set(re.findall(r"`(\w+)`", paragraph(text, heading)))
        for module in sorted((REPO_ROOT / folder).glob("*.py")):
            if module.stem not in ("__init__", "__main__") and module.stem not in named:
                missing.append(f"{folder}/{module.name}")
    assert missing == [], f"docs/architecture.md does not place: {missing}"


def test_every_package_folder_has_a_paragraph() -> None:
    folders = {
        str(path.parent.relative_to(REPO_ROOT))
        for root in ("trainer_sidecar", "trainguard", "operator")
        for path in (REPO_ROOT / root).glob("**/__init__.py")
        if path.parent.name not in ("trainer_sidecar", "trainguard")
    }
    assert folders == set(PACKAGES)
