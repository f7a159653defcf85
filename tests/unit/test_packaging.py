"""The wheel holds every package of the sources: pyproject.toml lists its packages one by one (the
operator's folder is renamed on the way), so a new subpackage that is not listed would be left out of
the wheel, and of every image built from it, while the tests that import from the clone still pass."""

from __future__ import annotations

import tomllib

from tests.support.paths import REPO_ROOT


def test_every_package_of_the_sources_is_in_the_wheel() -> None:
    setuptools = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    folders = {name: REPO_ROOT / folder for name, folder in setuptools.get("package-dir", {}).items()}
    roots = {name.split(".")[0] for name in listed}
    found = set()
    for root in roots:
        folder = folders.get(root, REPO_ROOT / root)
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder).parts
            found.add(".".join((root, *relative)))
    assert found, roots
    assert found <= listed, f"packages missing from [tool.setuptools] packages: {sorted(found - listed)}"
