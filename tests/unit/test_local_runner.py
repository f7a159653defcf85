"""LocalRunner before anything starts: the worker's environment and the checks made at construction."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import REPO_ROOT
from trainguard.core.policy import Action, Decision, FailureKind
from trainguard.core.spec import GuardedTrainingJob, parse_job
from trainguard.local import runner as runner_module
from trainguard.local.launch import RunRefused
from trainguard.local.runner import LocalRunner
from trainguard.local.supervisor import exit_code_of

MANIFEST: dict[str, Any] = {
    "apiVersion": "trainguard.dev/v1alpha1",
    "kind": "GuardedTrainingJob",
    "metadata": {"name": "demo", "namespace": "ml"},
    "spec": {
        "replicas": 2,
        "template": {"spec": {"containers": [{"name": "pytorch", "command": ["python", "train.py"]}]}},
        "checkpoint": {"claimName": "ckpt"},
    },
}


def job(**container: Any) -> GuardedTrainingJob:
    document = copy.deepcopy(MANIFEST)
    document["spec"]["template"]["spec"]["containers"][0].update(container)
    return parse_job(document, "job.yaml")


def test_paths_handed_to_the_worker_are_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the worker may run elsewhere (workingDir): relative paths would break
    runner = LocalRunner(job(), checkpoint_root=Path("volumes"), run_dir=Path("runs"))
    env = runner.worker_env(0, 29500, runner.run_root / "x" / "rank-0" / "status.json")
    assert env["TRAINGUARD_CHECKPOINT_DIR"] == str(tmp_path / "volumes" / "ckpt")
    assert env["TRAINGUARD_STATUS_FILE"] == str(tmp_path / "runs" / "x" / "rank-0" / "status.json")
    assert env["TRAINGUARD_TERMINATION_MESSAGE_PATH"] == str(
        tmp_path / "runs" / "x" / "rank-0" / "termination-log"
    )


def test_omp_threads_is_shared_out_unless_the_user_set_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    runner = LocalRunner(job(), checkpoint_root=tmp_path, run_dir=tmp_path)
    assert runner.worker_env(0, 1, tmp_path / "s.json")["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    mine = LocalRunner(
        job(env=[{"name": "OMP_NUM_THREADS", "value": "7"}]), checkpoint_root=tmp_path, run_dir=tmp_path
    )
    assert mine.worker_env(0, 1, tmp_path / "s.json")["OMP_NUM_THREADS"] == "7"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert runner.worker_env(0, 1, tmp_path / "s.json")["OMP_NUM_THREADS"] == "5"


def test_the_working_dir_resolves_the_command(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    program = tmp_path / "bin" / "train"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    runner = LocalRunner(
        job(command=["bin/train", "--x"], workingDir=str(tmp_path)),
        checkpoint_root=tmp_path,
        run_dir=tmp_path,
    )
    assert runner.command == [str(program), "--x"]
    assert runner.working_dir == tmp_path


def test_a_bad_command_is_refused_before_any_folder_exists(tmp_path: Path) -> None:
    with pytest.raises(RunRefused, match=r"containers\[pytorch\]\.command\[0\]: 'no-such-program-x'"):
        LocalRunner(
            job(command=["no-such-program-x"]), checkpoint_root=tmp_path / "v", run_dir=tmp_path / "r"
        )
    with pytest.raises(RunRefused, match=r"containers\[pytorch\]\.args\[0\]: "):
        LocalRunner(
            job(command=None, args=[str(tmp_path)]), checkpoint_root=tmp_path / "v", run_dir=tmp_path / "r"
        )
    assert sorted(tmp_path.iterdir()) == []


def test_a_claim_name_that_is_a_path_is_refused_even_past_validation(tmp_path: Path) -> None:
    valid = job()
    sneaky_checkpoint = valid.spec.checkpoint.model_construct(
        **{**dict(valid.spec.checkpoint), "claim_name": "../x"}
    )
    sneaky = valid.model_copy(
        update={"spec": valid.spec.model_copy(update={"checkpoint": sneaky_checkpoint})}
    )
    with pytest.raises(
        RunRefused, match=r"^spec\.checkpoint\.claimName: '\.\./x' is not a plain folder name"
    ):
        LocalRunner(sneaky, checkpoint_root=tmp_path, run_dir=tmp_path)


def named(name: str, namespace: str) -> GuardedTrainingJob:
    document = copy.deepcopy(MANIFEST)
    document["metadata"] = {"name": name, "namespace": namespace}
    return parse_job(document, "job.yaml")


def test_the_run_marker_names_the_locked_directory_and_the_job_not_a_path(tmp_path: Path) -> None:
    # Issue 19: the marker was a hash of the checkpoint root's path, so a run at a re-pointed symlink
    # took the first run's workers for its own leftovers and SIGKILLed them.
    for real in ("real-1", "real-2"):
        (tmp_path / real).mkdir()
    root = tmp_path / "root"
    root.symlink_to(tmp_path / "real-1")
    first = LocalRunner(job(), checkpoint_root=root, run_dir=tmp_path / "runs-1")
    assert first.run_marker == ""  # nothing is marked before the lock is held
    first.prepare()
    repointed = root.with_name("root.new")
    repointed.symlink_to(tmp_path / "real-2")
    os.replace(repointed, root)
    second = LocalRunner(job(), checkpoint_root=root, run_dir=tmp_path / "runs-2")
    second.prepare()  # not refused: another directory, so another lock
    assert second.checkpoint_dir == first.checkpoint_dir  # the same string ...
    assert second.run_marker != first.run_marker  # ... is not the same directory
    lock = json.loads((tmp_path / "real-2" / "ckpt" / ".trainguard-run.lock").read_text())
    info = os.stat(tmp_path / "real-2" / "ckpt")
    assert lock["directory"]["device"] == info.st_dev
    assert lock["directory"]["inode"] == info.st_ino
    assert lock["job"] == "ml/demo"
    second.lock.release()

    again = LocalRunner(job(), checkpoint_root=tmp_path / "real-2", run_dir=tmp_path / "runs-3")
    again.prepare()  # the same job at the same directory, by another path: the same marker
    assert again.run_marker == second.run_marker
    again.lock.release()
    other = LocalRunner(
        named("demo", "other-ns"), checkpoint_root=tmp_path / "real-2", run_dir=tmp_path / "runs-4"
    )
    other.prepare()
    assert other.run_marker not in ("", second.run_marker)  # another job's processes are not its own
    other.lock.release()
    first.lock.release()


def test_workers_are_given_the_locked_directory_and_not_where_a_re_pointed_path_leads(tmp_path: Path) -> None:
    for real in ("real-1", "real-2"):
        (tmp_path / real).mkdir()
    root = tmp_path / "root"
    root.symlink_to(tmp_path / "real-1")
    runner = LocalRunner(job(), checkpoint_root=root, run_dir=tmp_path / "runs")
    runner.prepare()
    assert runner._checked_checkpoint_dir() == (tmp_path / "real-1" / "ckpt").resolve()
    repointed = root.with_name("root.new")
    repointed.symlink_to(tmp_path / "real-2")
    os.replace(repointed, root)
    (tmp_path / "real-2" / "ckpt").mkdir()
    with pytest.raises(RunRefused, match="now leads to another directory"):
        runner._checked_checkpoint_dir()
    runner.lock.release()


@pytest.mark.parametrize(
    ("failure", "code"),
    [
        (FailureKind.CONFIG, 2),  # a refused claim, a bad setting: the job cannot run (README: exit 2)
        (FailureKind.FENCED, 2),
        (FailureKind.CRASH, 1),  # restarts exhausted: the policy gave up
        (FailureKind.HANG, 1),
        (FailureKind.DIVERGED, 1),
    ],
)
def test_a_permanent_failure_exits_2_and_a_policy_that_gives_up_1(failure: FailureKind, code: int) -> None:
    assert exit_code_of(Decision(Action.FAIL, "why", failure=failure)) == code


def test_a_run_result_writes_every_key_the_readme_documents_and_the_report_reads_it_back() -> None:
    from trainguard.core.summary import RunRecord
    from trainguard.local.report import SummaryView
    from trainguard.local.supervisor import FinalCheckpoint, RunResult

    figures = RunRecord(started=0.0).figures(10.0, 2.0)
    result = RunResult(
        name="tiny-lm",
        namespace="research",
        result="succeeded",
        reason="every rank exited 0",
        attempts=1,
        figures=figures,
        final_checkpoint=FinalCheckpoint(step=0, path="/ckpt/step-0", sha256="ab" * 32),
        timeline=[{"t": 0.5, "kind": "start", "attempt": 1, "step": None, "message": "started"}],
        series=[],
    )
    document = result.as_dict()
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("The summary JSON holds:") : readme.index("## Fault injection")]
    documented = {name for name in re.findall(r"`([a-z_]+)`", section) if not name.endswith("_seconds")}
    documented -= {"last_step", "resumed_step", "redone_steps"}  # the keys of each restart entry
    assert documented <= set(document), documented - set(document)
    assert document["job"] == {"name": "tiny-lm", "namespace": "research"}
    assert document["final_checkpoint"] == {"step": 0, "path": "/ckpt/step-0", "sha256": "ab" * 32}
    view = SummaryView.model_validate(json.loads(json.dumps(document)))
    assert (view.job.name, view.result, view.final_step) == ("tiny-lm", "succeeded", figures.final_step)
    # Nothing reported: the figures are null, not 0, and the report still reads and draws them.
    assert (document["final_step"], document["samples_seen"], document["goodput"]) == (None, None, None)
    assert list(document)[:6] == ["job", "result", "reason", "attempts", "final_step", "restarts"]
    from trainguard.local.report import render_png

    assert render_png(view).startswith(b"\x89PNG")


class FakeProcess:
    """A child as ``_stop_workers`` handles it: ``hung`` ignores SIGTERM; the signals it got, in order."""

    def __init__(self, name: str, journal: list[tuple[str, str]], *, hung: bool) -> None:
        self.name, self.journal, self.hung = name, journal, hung
        self.pid = -1
        self.stdout = None
        self.returncode: int | None = None

    def signal(self, sig: signal.Signals) -> None:
        self.journal.append((self.name, sig.name))
        if self.returncode is None and (sig is signal.SIGKILL or not self.hung):
            self.returncode = -sig

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            assert timeout is not None, f"{self.name} would never end"
            self.journal.append((self.name, "grace over"))
            raise subprocess.TimeoutExpired(self.name, timeout)
        return self.returncode


def test_a_stop_tells_the_sidecars_with_the_workers_not_after_a_hung_workers_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = LocalRunner(job(), checkpoint_root=tmp_path / "volumes", run_dir=tmp_path / "run")
    journal: list[tuple[str, str]] = []
    worker = FakeProcess("worker", journal, hung=True)
    sidecar = FakeProcess("sidecar", journal, hung=False)
    runner._workers, runner._sidecars = [worker], [sidecar]  # type: ignore[list-item]
    monkeypatch.setattr(runner_module, "signal_group", lambda proc, sig: proc.signal(sig))
    runner._stop_workers(0.01)
    assert journal[:3] == [("worker", "SIGTERM"), ("sidecar", "SIGTERM"), ("worker", "grace over")]
    assert worker.poll() == -signal.SIGKILL
    assert sidecar.poll() == -signal.SIGTERM
    assert runner._workers == []
    assert runner._sidecars == []


def test_the_runner_looks_again_as_soon_as_a_worker_ends_not_at_its_next_look(tmp_path: Path) -> None:
    runner = LocalRunner(job(), checkpoint_root=tmp_path / "volumes", run_dir=tmp_path / "run")
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    try:
        runner._workers = [worker]
        began = time.monotonic()
        runner._idle(120.0)
        assert worker.poll() == 0  # woken by its end
        assert time.monotonic() - began < 60.0
    finally:
        worker.kill()
        worker.wait()
