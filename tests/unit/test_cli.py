"""The ``trainguard`` command's answers to files and flags it cannot use: exit 2 and a line naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer_sidecar.checkpoint.layout import EPOCH_LIMIT
from trainguard.cli import default_run_root, main
from trainguard.core.spec import GuardedTrainingJob, parse_job

EXAMPLE_JOB = Path(__file__).parents[2] / "examples" / "local" / "job.yaml"
SUMMARY = {
    "result": "succeeded",
    "series": [{"t": 1.0, "attempt": 1, "step": 5, "loss": 2.0, "grad_norm": 1.0}],
}


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ("[]", "(root): Input should be an object"),
        ('{"series": 5}', "series: Input should be a valid array"),
        ('{"series": [{"t": "soon", "attempt": 1, "step": 1}]}', "series.0.t"),
        ('{"timeline": [{"kind": "rollback"}]}', "timeline.0.t: Field required"),
        ("not json", "Invalid JSON"),
    ],
)
def test_a_summary_of_the_wrong_shape_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, named: str
) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text(content)
    assert main(["report", str(summary), "-o", str(tmp_path / "t.png")]) == 2
    error = capsys.readouterr().err
    assert str(summary) in error
    assert named in error
    assert not (tmp_path / "t.png").exists()


@pytest.mark.parametrize(
    ("output", "named"),
    [
        ("timeline.jpg", "name the file *.png"),
        ("folder.png", "exists and is not a regular file"),
        ("file/t.png", "is not a writable directory"),
    ],
)
def test_a_report_output_that_cannot_be_written_is_refused_before_drawing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], output: str, named: str
) -> None:
    (tmp_path / "folder.png").mkdir()
    (tmp_path / "file").write_text("a file, not a folder")
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps(SUMMARY))
    assert main(["report", str(summary), "-o", str(tmp_path / output)]) == 2
    assert named in capsys.readouterr().err


def test_a_report_is_drawn_whole_or_not_at_all(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps(SUMMARY))
    png = tmp_path / "t.png"
    assert main(["report", str(summary), "-o", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert {p.name for p in tmp_path.iterdir()} == {"summary.json", "t.png"}  # no temp file left beside it


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--plot", "{tmp}/t.svg"], "--plot"),
        (["--summary", "{tmp}"], "--summary"),
    ],
)
def test_run_refuses_an_output_it_could_not_write_before_it_starts_the_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    # Found only after an hour of training, a bad --summary path used to cost the summary.
    argv = [
        "run",
        *[f.format(tmp=tmp_path) for f in flags],
        "--run-dir",
        str(tmp_path / "run"),
        str(EXAMPLE_JOB),
    ]
    assert main(argv) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_jobs_whose_namespace_and_name_join_alike_get_run_folders_of_their_own() -> None:
    # Issue 19 (identity): runs/<namespace>-<name> made "a"/"b-c" and "a-b"/"c" one folder, and so one
    # default checkpoint directory and one "latest".
    def job(namespace: str, name: str) -> GuardedTrainingJob:
        document = {
            "apiVersion": "trainguard.dev/v1alpha1",
            "kind": "GuardedTrainingJob",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "template": {"spec": {"containers": [{"name": "pytorch", "command": ["python", "x.py"]}]}},
                "checkpoint": {"claimName": "ckpt"},
            },
        }
        return parse_job(document, "job.yaml")

    first, second = default_run_root(job("a", "b-c")), default_run_root(job("a-b", "c"))
    assert first == Path("runs/a/b-c")
    assert second == Path("runs/a-b/c")


@pytest.mark.parametrize("action", ["export-dcp", "import-dcp"])
@pytest.mark.parametrize("step", ["-1", str(1 << 39), str(10**30)])
def test_a_checkpoint_step_no_checkpoint_id_can_hold_is_refused_naming_the_flag(
    action: str, step: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Any int was taken: import-dcp would write a checkpoint whose id (step and epoch packed in an int64,
    # what a resume agrees on) overflows, export-dcp looked a negative step up.
    (tmp_path / "from").mkdir()
    arguments = ["checkpoint", action, str(tmp_path / "from"), str(tmp_path / "to"), "--step", step]
    assert main([*arguments, "--i-trust-this-pickle"] if action == "import-dcp" else arguments) == 2
    most = ((1 << 63) - 1) // EPOCH_LIMIT  # the largest step whose id packs with any epoch
    assert f"--step {step}: must be from 0 to {most:,}" in capsys.readouterr().err
    assert not (tmp_path / "to").exists()
    arguments[-1] = str(most)
    assert main(arguments) == 2  # the step is taken; no such checkpoint (or no trust) is the refusal
    assert "must be from 0" not in capsys.readouterr().err
