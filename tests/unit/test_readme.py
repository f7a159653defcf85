"""The README documents what the code does: every spec field, fault kind, exit code and metric."""

from __future__ import annotations

import difflib
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tests.support.paths import REPO_ROOT
from trainer_sidecar.contract.exitcodes import ExitCode
from trainer_sidecar.contract.status import CheckpointRef, WorkerStatus, write_status
from trainer_sidecar.guardian.faults import FaultKind
from trainer_sidecar.sidecar.server import WorkerStatusCollector
from trainguard.core.spec import GuardedTrainingJobSpec

README = (REPO_ROOT / "README.md").read_text()
SECTIONS_WITH_CHILDREN = {"template"}


def leaf_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, info in model.model_fields.items():
        alias = info.alias or name
        path = f"{prefix}{alias}"
        annotation: Any = info.annotation
        if (
            isinstance(annotation, type)
            and issubclass(annotation, BaseModel)
            and alias not in SECTIONS_WITH_CHILDREN
        ):
            paths.extend(leaf_paths(annotation, f"{path}."))
        else:
            paths.append(path)
    return paths


def test_every_spec_field_is_in_the_reference_table() -> None:
    missing = [p for p in leaf_paths(GuardedTrainingJobSpec) if f"| `{p}` |" not in README]
    assert missing == []


def test_every_fault_kind_and_exit_code_is_documented() -> None:
    assert [k.value for k in FaultKind if f"| `{k.value}` |" not in README] == []
    assert [c.value for c in ExitCode if f"| {c.value} |" not in README] == []


def test_every_exported_metric_is_documented(tmp_path: Path) -> None:
    status_file = tmp_path / "status.json"
    now = time.time()
    write_status(
        status_file,
        WorkerStatus(
            started_at=now - 10,
            last_step_time=now,
            loss=1.0,
            grad_norm=1.0,
            samples_seen=10,
            last_clean_checkpoint=CheckpointRef(step=1, path="/x", time=now),
        ),
    )
    collector = WorkerStatusCollector(
        status_file, hang_timeout_seconds=60, startup_grace_seconds=60, job="j", namespace="n"
    )
    names = {sample.name for family in collector.collect() for sample in family.samples}
    assert len(names) >= 15
    assert sorted(n for n in names if f"`{n}`" not in README) == []


def test_the_adoption_diff_in_the_readme_is_the_real_one() -> None:
    example = REPO_ROOT / "examples" / "02_nanogpt_style"
    before = (example / "nanogpt_plain.py").read_text().splitlines()
    after = (example / "nanogpt.py").read_text().splitlines()
    real = [
        line
        for line in difflib.unified_diff(before, after, lineterm="", n=0)
        if line[:1] in "+-" and line[1:].strip() and not line.startswith(("+++", "---"))
    ]
    block = README.split("```diff\n", 1)[1].split("```", 1)[0]
    shown = [line for line in block.splitlines() if line[:1] in "+-" and line[1:].strip()]
    # The README leaves out the module docstring's change; every code change is shown, as it is (blank
    # lines aside: two diff tools may place an added blank line differently).
    assert shown == [line for line in real if '"""' not in line and "is the same loop" not in line]


def test_the_epoch_loops_adoption_diff_in_the_readme_is_the_real_one() -> None:
    example = REPO_ROOT / "examples" / "06_imagenet_style"
    before = (example / "imagenet_plain.py").read_text().splitlines()
    after = (example / "imagenet.py").read_text().splitlines()
    real = [
        line
        for line in difflib.unified_diff(before, after, lineterm="", n=0)
        if line[:1] in "+-" and line[1:].strip() and not line.startswith(("+++", "---"))
    ]
    block = README.split("### A loop with epochs", 1)[1].split("```diff\n", 1)[1].split("```", 1)[0]
    shown = [line for line in block.splitlines() if line[:1] in "+-" and line[1:].strip()]
    # The module docstring's change aside (its lines name the other file), every change as it is.
    assert shown == [line for line in real if "imagenet" not in line and "is the same loop" not in line]
