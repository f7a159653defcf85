"""Nothing in the repository reads outside the clone: a user who clones it has nothing beside it.

A fresh clone once failed 48 tests because tests read Kubeflow's CRD from a folder beside the
repository. The scan below finds every way a file of this repository names a path above or beside its
root: the root's parent taken in Python or shell, ``__file__`` climbed past the root, a literal path
into the folder beside the clone, or an absolute path of this workplace. Third-party files come from
the package registries instead, cached under ``~/.cache/trainguard`` (``scripts/``).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import PurePosixPath

import pytest

from tests.support.paths import REPO_ROOT

#: The folder beside the clone where the project's design documents once lay (samples below say
#: ``{beside}`` for it, so that this file names no path outside the clone either).
_BESIDE = "shared"
#: Names the repository's scripts and modules give the repository root.
_ROOT_NAMES = r"(?:REPO_ROOT|_?ROOT|root|repo_root)"
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("the root's parent (Python)", re.compile(rf"\b{_ROOT_NAMES}\s*\.\s*parents?\b")),
    ("the root's parent (shell)", re.compile(rf"\$\{{?{_ROOT_NAMES}\}}?/\.\.(?:/|\"|'|\s|$)")),
    (
        "the folder beside the clone",
        re.compile(rf"\.\./{_BESIDE}\b|\b{_BESIDE}/(?:reference|seeds|design\.md)"),
    ),
    ("an absolute path of the workplace", re.compile(r"(?<![\w.])/work/")),
)
#: ``Path(__file__)`` climbed by ``.parent`` steps or ``.parents[N]``.
_FILE_PARENTS = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?((?:\.parent\b)+|\.parents\[(\d+)\])")
#: ``$(dirname "$0")`` followed by ``/..`` steps.
_SCRIPT_PARENTS = re.compile(r"\$\(dirname \"?\$(?:0|\{BASH_SOURCE\[0\]\})\"?\)((?:/\.\.)+)")


def escapes(relative_file: str, line: str) -> list[str]:
    """Why ``line`` of the file at ``relative_file`` (relative to the root) names a path outside the root."""
    found = [reason for reason, pattern in _RULES if pattern.search(line)]
    depth = len(PurePosixPath(relative_file).parts) - 1  # folders between the root and the file
    for match in _FILE_PARENTS.finditer(line):
        # Path(__file__).parents[N] is the file's folder climbed N times; .parent k times is parents[k-1].
        climbs = int(match.group(2)) if match.group(2) is not None else match.group(1).count(".parent") - 1
        if climbs > depth:
            found.append(f"__file__ climbed {climbs} folders from a file {depth} deep")
    for match in _SCRIPT_PARENTS.finditer(line):
        climbs = match.group(1).count("..")
        if climbs > depth:
            found.append(f'$(dirname "$0") climbed {climbs} folders from a script {depth} deep')
    return found


def repository_files() -> list[str]:
    """The files of the repository (tracked, or new and not ignored), relative to the root."""
    listed = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        capture_output=True,
        check=True,
    )
    return sorted({name for name in listed.stdout.decode().split("\0") if name})


def violations() -> Iterator[str]:
    """``file:line: reason: text`` for every reference outside the repository, in text files."""
    this_file = PurePosixPath(__file__).relative_to(REPO_ROOT.as_posix()).as_posix()
    for name in repository_files():
        path = REPO_ROOT / name
        if name == this_file or not path.is_file() or path.is_symlink():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            for reason in escapes(name, line):
                yield f"{name}:{number}: {reason}: {line.strip()[:120]}"


def test_no_file_of_the_repository_refers_to_a_path_outside_it() -> None:
    """The scan of every file finds nothing (each rule is shown to fire in the test below)."""
    found = list(violations())
    assert not found, "files that reach outside the clone:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("file", "line"),
    [
        ("tests/support/paths.py", 'SHARED = REPO_ROOT.parent / "{beside}"'),
        ("bench/x.py", "KUBEFLOW = ROOT.parents[0] / 'reference'"),
        ("scripts/x.sh", 'crd="$root/../{beside}/reference/kubeflow/crd.yaml"'),
        ("scripts/x.sh", 'ls "${root}/.."'),
        ("tests/e2e/x.py", 'CRD = Path("../{beside}/reference/kubeflow.yaml")'),
        ("README.md", "see the design brief in {beside}/design.md"),
        ("bench/operator_scale.py", "#: (``/work/{beside}/...`` here)"),
        ("tests/support/paths.py", "REPO_ROOT = Path(__file__).resolve().parents[3]"),
        ("trainguard/crd.py", "_ROOT = Path(__file__).resolve().parent.parent.parent"),
        ("scripts/x.sh", 'root=$(cd "$(dirname "$0")/../.." && pwd)'),
    ],
)
def test_each_way_of_reaching_outside_is_found(file: str, line: str) -> None:
    """Each rule fires on the kind of line it is for."""
    assert escapes(file, line.replace("{beside}", _BESIDE))


@pytest.mark.parametrize(
    ("file", "line"),
    [
        ("tests/support/paths.py", "REPO_ROOT = Path(__file__).resolve().parents[2]"),
        ("trainguard/crd.py", "_ROOT = Path(__file__).resolve().parent.parent"),
        ("scripts/setup.sh", 'root=$(cd "$(dirname "$0")/.." && pwd)'),
        (".ci/run", 'cd "$(dirname "$0")/.."'),
        ("examples/k8s/README.md", "[the README](../../README.md)"),
        ("tests/unit/x.py", 'job(checkpoint={"claimName": "../../tmp/x"})'),
        ("scripts/x.sh", 'ln -sfn "../etcd-$V/etcd" "$bin_dir/etcd"'),
        ("tests/e2e/test_node.py", 'pathlib.Path("/shared/from-writer").write_text("x")'),
    ],
)
def test_paths_inside_the_repository_or_its_cache_pass(file: str, line: str) -> None:
    """The root itself, relative links within the repository, and hostile test data are not flagged."""
    assert escapes(file, line) == []
