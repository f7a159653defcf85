"""The shape of the code stays one a newcomer can read: no product function over 60 lines, no test
module importing another test module (shared helpers live in ``tests/support``), and the operator's
reconcile step built from its context, never changed by calls made in the right order. There are no
exemptions: a function over the limit is split, not listed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

#: The longest a product function may be, in lines from its ``def`` to its last line.
MAX_LINES = 60
PRODUCT = ("operator", "trainguard", "trainer_sidecar")
#: The classes of the reconcile step that set their own attributes in ``__init__`` only.
STEP_CLASSES = {
    "operator/reconcile.py": ("_Draft", "_Step"),
    "operator/trackers.py": ("Trackers",),
    "operator/inplace_step.py": ("InPlace",),
}


def function_lengths(source: str) -> Iterator[tuple[str, int]]:
    """Every function in ``source`` (nested ones too), by qualified name, with its length in lines."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                yield name, (child.end_lineno or child.lineno) - child.lineno + 1
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(source), "")


def long_functions() -> dict[str, int]:
    """The product's functions over ``MAX_LINES``, as ``path:qualified name`` -> lines."""
    found = {}
    for package in PRODUCT:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            relative = path.relative_to(REPO_ROOT).as_posix()
            for name, lines in function_lengths(path.read_text()):
                if lines > MAX_LINES:
                    found[f"{relative}:{name}"] = lines
    return found


def test_no_product_function_is_over_60_lines() -> None:
    assert long_functions() == {}, f"functions over {MAX_LINES} lines: split them"


def test_the_length_of_a_function_counts_nested_and_method_definitions() -> None:
    source = "class A:\n    def f(self):\n        def g():\n            pass\n        return 1\n"
    assert dict(function_lengths(source)) == {"A.f": 4, "A.f.g": 2}


def imported_modules(source: str, module: str) -> Iterator[str]:
    """The modules ``source`` (the module named ``module``) imports, relative imports resolved, with
    ``from X import Y`` giving both ``X`` and ``X.Y`` (Y may be a module)."""
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def is_test_module(name: str) -> bool:
    """Whether the dotted ``name`` is a test module (``test_*``), which nothing may import."""
    return name.rsplit(".", 1)[-1].startswith("test_")


def modules_importing_tests(root: Path) -> dict[str, list[str]]:
    """For each module under ``root``/tests that imports a test module: those it imports."""
    found = {}
    for path in sorted((root / "tests").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        bad = sorted({m for m in imported_modules(path.read_text(), module) if is_test_module(m)})
        if bad:
            found[module] = bad
    return found


def test_no_test_module_imports_another_test_module() -> None:
    assert modules_importing_tests(REPO_ROOT) == {}, "move what they share to tests/support"


@pytest.mark.parametrize(
    "line",
    [
        "from tests.unit.test_operator_reconcile import Cluster",
        "from .test_local_run import job",
        "from . import test_local_run",
        "import tests.integration.test_local_run",
    ],
)
def test_a_test_module_importing_another_is_found(tmp_path: Path, line: str) -> None:
    folder = tmp_path / "tests" / "integration"
    folder.mkdir(parents=True)
    (folder / "test_straggler.py").write_text(f"{line}\nfrom tests.support.procs import run_gang\n")
    assert list(modules_importing_tests(tmp_path)) == ["tests.integration.test_straggler"]


def attributes_set_outside_init(source: str, classes: tuple[str, ...]) -> list[str]:
    """``Class.method: self.attr`` for every ``self.<attr>`` a method of ``classes`` (other than
    ``__init__``) assigns, augments or annotates."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef) or node.name not in classes:
            continue
        for method in node.body:
            if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef) or method.name == "__init__":
                continue
            for statement in ast.walk(method):
                targets: list[ast.expr] = []
                if isinstance(statement, ast.Assign):
                    targets = list(statement.targets)
                elif isinstance(statement, ast.AugAssign | ast.AnnAssign):
                    targets = [statement.target]
                found += (
                    f"{node.name}.{method.name}: self.{a}" for t in targets for a in _self_attributes(t)
                )
    return found


def _self_attributes(target: ast.expr) -> Iterator[str]:
    """The attributes of ``self`` an assignment to ``target`` sets (``self.a``, or in ``self.a, b = ...``);
    not ``self.a.b``, which changes the object in ``self.a``."""
    if isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from _self_attributes(element)
    elif isinstance(target, ast.Starred):
        yield from _self_attributes(target.value)
    elif (
        isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
    ):
        yield target.attr


def test_the_reconcile_step_sets_its_attributes_in_init_only() -> None:
    found = []
    for relative, classes in STEP_CLASSES.items():
        source = (REPO_ROOT / relative).read_text()
        assert all(f"class {name}" in source for name in classes), relative
        found += attributes_set_outside_init(source, classes)
    assert found == [], "the step acts on its StepContext: build a new one, do not change the step"


def test_an_attribute_set_after_init_is_found() -> None:
    source = (
        "class _Step:\n"
        "    def __init__(self):\n        self.a = 1\n"
        "    def run(self):\n        self.b = 2\n        self.c += 1\n        self.d, x = 1, 2\n"
        "        self.st.phase = 'x'\n"
    )
    assert attributes_set_outside_init(source, ("_Step",)) == [
        "_Step.run: self.b",
        "_Step.run: self.c",
        "_Step.run: self.d",
    ]
