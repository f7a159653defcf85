"""``trainguard run`` leaves nothing behind: signals, a killed runner, a start cut short, bad commands,
two runs of one job, run folders, the working directory, dead sidecars, and why a worker exited.

The runner runs as a real subprocess; the workers are ``tests/support/workers/lifecycle.py`` (no torch,
so they start in a moment) unless a test needs the real guardian. A process counts as left behind when
it is alive and names the test's tmp_path in its arguments or environment (see
``procs.processes_mentioning``), which finds orphans too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import procs
from trainer_sidecar.contract.env import STATUS_FILE_ENV

pytestmark = pytest.mark.slow

FIELD = "spec.template.spec.containers[pytorch]"


def lifecycle_job(
    tmp_path: Path,
    *,
    replicas: int = 2,
    steps: int = 100_000,
    step_sleep: float = 0.1,
    extra: tuple[str, ...] = (),
    command: list[str] | None = None,
    container: dict[str, Any] | None = None,
    recovery: dict[str, Any] | None = None,
    name: str = "life",
    nproc_per_node: int = 1,
) -> Path:
    """A job of lifecycle.py workers recording themselves in tmp_path/pids."""
    worker_command = command or [
        "python", str(procs.LIFECYCLE_WORKER), "--pid-dir", str(tmp_path / "pids"),
        "--steps", str(steps), "--step-sleep", str(step_sleep), *extra,
    ]  # fmt: skip
    document = {
        "apiVersion": "trainguard.dev/v1alpha1",
        "kind": "GuardedTrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "nprocPerNode": nproc_per_node,
            "template": {
                "spec": {"containers": [{"name": "pytorch", "command": worker_command, **(container or {})}]}
            },
            "checkpoint": {"claimName": "ckpt"},
            "health": {"hangTimeoutSeconds": 5, "startupGraceSeconds": 60, "probePeriodSeconds": 1},
            "recovery": recovery or {"maxRestarts": 0, "backoffSeconds": [1]},
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def start_runner(tmp_path: Path, job_file: Path, *extra: str) -> subprocess.Popen[str]:
    """``trainguard run`` with tmp_path/run as its run root, output captured."""
    return subprocess.Popen(
        [sys.executable, "-m", "trainguard.cli", "run", str(job_file), "--run-dir", str(tmp_path / "run"),
         "--plain", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def run_to_end(tmp_path: Path, job_file: Path, timeout: float = 180) -> tuple[int, str]:
    """Run a job to its end; (exit code, output)."""
    proc = start_runner(tmp_path, job_file)
    output, _ = proc.communicate(timeout=timeout)
    return proc.returncode, output


def wait_for(condition: Callable[[], Any], timeout: float = 120, what: str = "condition") -> Any:
    """Poll ``condition`` until it is truthy (its value) or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def records(tmp_path: Path, role: str = "worker") -> list[dict[str, Any]]:
    """What the lifecycle workers (or their holders) recorded about themselves."""
    return [json.loads(f.read_text()) for f in sorted((tmp_path / "pids").glob(f"{role}-*.json"))]


def left_behind(tmp_path: Path, timeout: float = 15) -> list[int]:
    """The processes of tmp_path's runs still alive after up to ``timeout`` seconds (killed ones need a
    moment to be reaped)."""
    deadline = time.monotonic() + timeout
    while (alive := procs.processes_mentioning(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def summary_of(tmp_path: Path) -> dict[str, Any]:
    """The summary of the latest run."""
    return dict(json.loads((tmp_path / "run" / "latest" / "summary.json").read_text()))


def watchdogs(tmp_path: Path) -> list[int]:
    """The live watchdogs of runs under tmp_path (their command line names the checkpoint directory)."""
    found = []
    for pid in procs.processes_mentioning(str(tmp_path)):
        with contextlib.suppress(OSError):
            if b"trainguard.local.watchdog" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def test_sighup_stops_the_gang_and_writes_the_summary(tmp_path: Path) -> None:
    runner = start_runner(tmp_path, lifecycle_job(tmp_path))
    wait_for(lambda: len(records(tmp_path)) == 2, what="both workers")
    runner.send_signal(signal.SIGHUP)
    output, _ = runner.communicate(timeout=60)
    assert runner.returncode == 129, output
    assert "stopped by SIGHUP" in output
    assert summary_of(tmp_path)["result"] == "interrupted"
    assert left_behind(tmp_path, timeout=0) == []


def test_a_killed_runner_takes_its_gang_with_it(tmp_path: Path) -> None:
    runner = start_runner(tmp_path, lifecycle_job(tmp_path))
    workers = wait_for(lambda: len(records(tmp_path)) == 2 and records(tmp_path), what="both workers")
    runner.kill()
    runner.wait(timeout=30)
    assert left_behind(tmp_path) == []
    # A killed process can be seen a moment longer while it exits (its environment already gone).
    wait_for(lambda: not any(procs.is_running(w["pid"]) for w in workers), 15, "the workers to be gone")


def test_a_stop_while_the_gang_starts_leaves_nothing_running(tmp_path: Path) -> None:
    for attempt in range(3):
        folder = tmp_path / f"try-{attempt}"
        folder.mkdir()
        runner = start_runner(folder, lifecycle_job(folder))
        # The first child is a sidecar that has not said where it listens yet: the gang is starting.
        wait_for(lambda: procs.children_of(runner.pid), timeout=60, what="the first child")  # noqa: B023
        runner.send_signal(signal.SIGINT)
        output, _ = runner.communicate(timeout=60)
        assert runner.returncode == 130, output
        assert "Traceback" not in output
        assert left_behind(folder, timeout=0) == [], output


def test_the_next_attempts_sidecars_start_within_the_backoff_and_a_stop_there_leaves_nothing(
    tmp_path: Path,
) -> None:
    # Every worker exits 1 at once: a crash, restarted after a 90 s backoff. Within it, once the old gang
    # is gone, attempt 2's sidecars start (its workers start when the backoff ends beside sidecars that
    # listen already); a run stopped there stops them too.
    job_file = lifecycle_job(
        tmp_path,
        command=["python", "-c", "raise SystemExit(1)"],
        recovery={"maxRestarts": 1, "backoffSeconds": [90]},
    )
    runner = start_runner(tmp_path, job_file)
    run_folder = tmp_path / "run" / "latest"

    def sidecars() -> list[int]:
        found = []
        for pid in procs.children_of(runner.pid):
            with contextlib.suppress(OSError):  # gone since it was listed
                if b"trainer_sidecar.sidecar" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
        return found

    # Both of attempt 2's sidecar processes, not only their logs: a log is opened before its process
    # exists, and a child shows the runner's command line until it has exec'd.
    wait_for(
        lambda: len(list(run_folder.glob("attempt-2/rank-*/sidecar.log"))) == 2 and len(sidecars()) == 2,
        timeout=45,  # half the backoff
        what="attempt 2's sidecars during the backoff",
    )
    assert not list(run_folder.glob("logs/attempt-2-*.log")), "attempt 2's workers started in the backoff"
    runner.send_signal(signal.SIGINT)
    output, _ = runner.communicate(timeout=60)
    assert runner.returncode == 130, output
    assert "Traceback" not in output
    assert left_behind(tmp_path, timeout=0) == [], output


@pytest.mark.parametrize(
    ("program", "complaint"),
    [
        ("no-such-program-anywhere", "was not found on the worker's PATH"),
        ("{tmp}", "is a directory"),
        ("{tmp}/not-executable.sh", "is not executable"),
        ("./missing.sh", "does not exist"),
    ],
)
def test_a_command_that_cannot_run_is_refused_before_anything_starts(
    tmp_path: Path, program: str, complaint: str
) -> None:
    (tmp_path / "not-executable.sh").write_text("#!/bin/sh\n")
    program = program.format(tmp=tmp_path)
    code, output = run_to_end(tmp_path, lifecycle_job(tmp_path, command=[program, "--flag"]), timeout=60)
    assert code == 2, output
    assert f"{FIELD}.command[0]" in output
    assert program in output
    assert complaint in output
    assert "Traceback" not in output
    assert not (tmp_path / "run").exists()  # no run folder, no checkpoint directory, no lock
    assert left_behind(tmp_path, timeout=0) == []


def test_a_working_dir_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    job_file = lifecycle_job(tmp_path, container={"workingDir": str(tmp_path / "nowhere")})
    code, output = run_to_end(tmp_path, job_file, timeout=60)
    assert code == 2, output
    assert f"{FIELD}.workingDir" in output
    assert "nowhere" in output


def test_the_working_dir_is_honoured_and_omp_threads_shared_out(tmp_path: Path) -> None:
    workers_dir = procs.LIFECYCLE_WORKER.parent
    command = ["python", procs.LIFECYCLE_WORKER.name, "--pid-dir", str(tmp_path / "pids"), "--steps", "3"]
    job_file = lifecycle_job(tmp_path, command=command, container={"workingDir": str(workers_dir)})
    code, output = run_to_end(tmp_path, job_file)
    assert code == 0, output
    cores = len(os.sched_getaffinity(0))
    assert [(w["cwd"], w["omp"]) for w in records(tmp_path)] == [
        (str(workers_dir), str(max(1, cores // 2)))
    ] * 2


def test_a_second_run_of_a_job_is_refused_while_any_process_of_the_first_lives(tmp_path: Path) -> None:
    job_file = lifecycle_job(tmp_path, extra=("--fork-holder",))
    first = start_runner(tmp_path, job_file)
    wait_for(lambda: len(records(tmp_path)) == 2 and len(records(tmp_path, "holder")) == 2, what="the gang")

    code, output = run_to_end(tmp_path, job_file, timeout=60)
    assert code == 2, output
    assert "is in use by another trainguard run" in output
    assert f"pid {first.pid}" in output

    # The runner and its watchdog die with no chance to clean up: its workers die with it, but a process
    # the gang forked (like a data loader worker) still holds the inherited lock, so the job stays locked.
    (watchdog,) = watchdogs(tmp_path)
    os.kill(watchdog, signal.SIGKILL)
    wait_for(lambda: not procs.is_running(watchdog), 15, "the watchdog to die")
    first.kill()
    first.wait(timeout=30)
    wait_for(
        lambda: not any(procs.is_running(w["pid"]) for w in records(tmp_path)), what="the workers to die"
    )
    assert all(procs.is_running(h["pid"]) for h in records(tmp_path, "holder"))
    code, output = run_to_end(tmp_path, job_file, timeout=60)
    assert code == 2, output
    assert f"pid {first.pid} has exited, but processes of its gang still hold the lock" in output

    (tmp_path / "pids" / "release").touch()
    wait_for(lambda: not any(procs.is_running(h["pid"]) for h in records(tmp_path, "holder")), what="holders")
    code, output = run_to_end(tmp_path, lifecycle_job(tmp_path, steps=3))
    assert code == 0, output


def launcher_job(tmp_path: Path, launcher: str) -> tuple[Path, int, tuple[str, ...]]:
    """A job whose workers a launcher starts: (job file, processes of the gang, their record roles)."""
    if launcher == "forked":  # a worker forks a child that keeps the lock, as a data loader worker does
        return lifecycle_job(tmp_path, extra=("--fork-holder",)), 4, ("worker", "holder")
    if launcher == "detached":  # a worker forks a child into a session of its own, as torchrun does
        return lifecycle_job(tmp_path, extra=("--fork-detached",)), 4, ("worker", "detached")
    if launcher == "runner's torchrun":  # nprocPerNode 2: the runner starts torchrun, torchrun 2 workers
        return lifecycle_job(tmp_path, replicas=1, nproc_per_node=2), 2, ("worker",)
    command = [  # the user's command runs torchrun itself
        "python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(procs.LIFECYCLE_WORKER), "--pid-dir", str(tmp_path / "pids"), "--steps", "100000",
    ]  # fmt: skip
    return lifecycle_job(tmp_path, replicas=1, command=command), 2, ("worker",)


@pytest.mark.parametrize("launcher", ["forked", "detached", "runner's torchrun", "user's torchrun"])
def test_a_killed_runner_takes_the_workers_a_launcher_started_with_it(tmp_path: Path, launcher: str) -> None:
    # Issue 19: with nprocPerNode 2, a runner killed with SIGKILL took torchrun with it (the parent-death
    # signal), but torchrun's workers, in sessions of their own, trained on unsupervised.
    job_file, count, roles = launcher_job(tmp_path, launcher)
    runner = start_runner(tmp_path, job_file)
    pids = wait_for(
        lambda: len(gang := [r["pid"] for role in roles for r in records(tmp_path, role)]) == count and gang,
        what=f"{count} processes of the gang",
    )
    assert len(watchdogs(tmp_path)) == 1
    runner.kill()
    killed = time.monotonic()
    runner.wait(timeout=30)
    wait_for(lambda: not any(procs.is_running(pid) for pid in pids), 5, "every worker to be gone")
    gone_after = time.monotonic() - killed
    assert left_behind(tmp_path, timeout=5) == []  # the watchdog too, once done
    print(f"{launcher}: every worker gone {gone_after:.2f} s after the runner's SIGKILL")


def test_a_later_run_kills_the_workers_a_killed_runner_left_when_its_watchdog_died_too(
    tmp_path: Path,
) -> None:
    job_file = lifecycle_job(tmp_path, extra=("--fork-detached",))
    first = start_runner(tmp_path, job_file)
    wait_for(lambda: len(records(tmp_path)) == 2 and len(records(tmp_path, "detached")) == 2, what="the gang")
    (watchdog,) = watchdogs(tmp_path)
    os.kill(watchdog, signal.SIGKILL)  # the OOM killer, or a kill -9 of everything named trainguard
    wait_for(lambda: not procs.is_running(watchdog), 15, "the watchdog to die")
    first.kill()
    first.wait(timeout=30)
    detached = [d["pid"] for d in records(tmp_path, "detached")]
    wait_for(lambda: not any(procs.is_running(w["pid"]) for w in records(tmp_path)), what="the workers")
    # Like torchrun's workers: out of the runner's reach, and holding no lock, so nothing stops a new run.
    time.sleep(1)
    assert all(procs.is_running(pid) for pid in detached)

    second = start_runner(tmp_path, lifecycle_job(tmp_path, steps=3))
    wait_for(lambda: not any(procs.is_running(pid) for pid in detached), 30, "the leftovers to be killed")
    output, _ = second.communicate(timeout=120)
    assert second.returncode == 0, output
    assert "killed 2 process(es) an earlier run of this job left" in output


def test_a_run_at_a_re_pointed_checkpoint_root_leaves_the_first_runs_workers_alone(tmp_path: Path) -> None:
    # Issue 19: leftovers were found by a hash of the checkpoint root's path, so a second run whose root
    # is spelled alike (a re-pointed symlink, a remounted path) SIGKILLed the first run's live workers.
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    for folder in (first_dir, second_dir, tmp_path / "real-1", tmp_path / "real-2"):
        folder.mkdir()
    root = tmp_path / "root"
    root.symlink_to(tmp_path / "real-1")
    first = start_runner(
        first_dir, lifecycle_job(first_dir, extra=("--fork-detached",)), "--checkpoint-root", str(root)
    )
    wait_for(
        lambda: len(records(first_dir)) == 2 and len(records(first_dir, "detached")) == 2, what="the gang"
    )
    repointed = tmp_path / "root.new"
    repointed.symlink_to(tmp_path / "real-2")
    os.replace(repointed, root)

    second = start_runner(second_dir, lifecycle_job(second_dir, steps=3), "--checkpoint-root", str(root))
    output, _ = second.communicate(timeout=120)
    assert second.returncode == 0, output
    assert "an earlier run of this job left" not in output
    victims = [r["pid"] for r in records(first_dir) + records(first_dir, "detached")]
    assert all(procs.is_running(pid) for pid in victims)
    assert first.poll() is None
    first.send_signal(signal.SIGINT)
    output, _ = first.communicate(timeout=60)
    assert first.returncode == 130, output
    assert (tmp_path / "real-1" / "ckpt" / ".trainguard-run.lock").exists()
    assert (tmp_path / "real-2" / "ckpt" / ".trainguard-run.lock").exists()
    (first_dir / "pids" / "release").touch()


def test_each_run_writes_a_folder_of_its_own(tmp_path: Path) -> None:
    job_file = lifecycle_job(tmp_path, steps=5)
    assert run_to_end(tmp_path, job_file)[0] == 0
    first = (tmp_path / "run" / "latest").resolve()
    first_files = {p: p.read_bytes() for p in first.rglob("*") if p.is_file()}
    assert run_to_end(tmp_path, job_file)[0] == 0
    second = (tmp_path / "run" / "latest").resolve()
    assert second != first
    assert second.parent == first.parent == tmp_path / "run"
    assert {p: p.read_bytes() for p in first.rglob("*") if p.is_file()} == first_files
    for folder in (first, second):
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["attempts"] == 1
        assert summary["kept_seconds"] <= summary["wall_seconds"]
        assert len(list(folder.glob("logs/*.log"))) == 2


def test_a_claim_that_leads_outside_the_checkpoint_root_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    volumes = tmp_path / "run" / "volumes"
    volumes.mkdir(parents=True)
    (volumes / "ckpt").symlink_to(outside)
    code, output = run_to_end(tmp_path, lifecycle_job(tmp_path), timeout=60)
    assert code == 2, output
    assert "spec.checkpoint.claimName" in output
    assert "leads outside" in output
    assert list(outside.iterdir()) == []


def sidecar_of(tmp_path: Path, rank: int) -> int | None:
    """The pid of rank ``rank``'s sidecar of tmp_path's run, if one runs."""
    for pid in procs.processes_mentioning(str(tmp_path)):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        # The runner hands a sidecar its status file as the operator does: in its environment.
        status_file = f"{STATUS_FILE_ENV}=".encode()
        rank_dir = f"rank-{rank}".encode()
        if b"trainer_sidecar.sidecar" in argv and any(
            item.startswith(status_file) and rank_dir in item for item in environ
        ):
            return pid
    return None


def test_a_dead_sidecar_is_restarted_and_a_healthy_gang_goes_on(tmp_path: Path) -> None:
    runner = start_runner(tmp_path, lifecycle_job(tmp_path, steps=80))
    victim = wait_for(lambda: len(records(tmp_path)) == 2 and sidecar_of(tmp_path, 1), what="sidecar")
    os.kill(victim, signal.SIGKILL)
    output, _ = runner.communicate(timeout=120)
    assert runner.returncode == 0, output
    summary = summary_of(tmp_path)
    assert summary["restarts"] == []
    [restarted] = [e for e in summary["timeline"] if e["kind"] == "sidecar"]
    assert "rank 1: sidecar exited (code -9); restarted" in restarted["message"]


def test_a_sidecar_that_keeps_dying_fails_liveness_after_the_threshold(tmp_path: Path) -> None:
    runner = start_runner(tmp_path, lifecycle_job(tmp_path))
    wait_for(lambda: len(records(tmp_path)) == 2, what="both workers")
    while runner.poll() is None:  # a crash-looping sidecar: killed whenever it is up
        victim = sidecar_of(tmp_path, 1)
        if victim is not None:
            os.kill(victim, signal.SIGKILL)
        time.sleep(0.05)
    output, _ = runner.communicate(timeout=60)
    assert runner.returncode == 1, output
    reason = summary_of(tmp_path)["reason"]
    assert re.search(
        r"rank 1 hung at step \d+: liveness probe failed 3 times in a row: no answer \(the sidecar is down\)",
        reason,
    ), reason


def test_a_hung_worker_whose_sidecar_was_killed_is_still_detected(tmp_path: Path) -> None:
    document = {
        "apiVersion": "trainguard.dev/v1alpha1",
        "kind": "GuardedTrainingJob",
        "metadata": {"name": "hung"},
        "spec": {
            "replicas": 2,
            "template": {"spec": {"containers": [{
                "name": "pytorch",
                "command": ["python", str(procs.WORKER), "--steps", "30", "--step-sleep", "0.05"],
                "env": [{"name": "TRAINGUARD_FAULTS", "value": "hang@15:1"}],
            }]}},
            "checkpoint": {"claimName": "ckpt", "everySteps": 5, "snapshotEverySteps": 5},
            "health": {"hangTimeoutSeconds": 3, "startupGraceSeconds": 60, "probePeriodSeconds": 1},
            "recovery": {"maxRestarts": 2, "backoffSeconds": [1]},
        },
    }  # fmt: skip
    job_file = tmp_path / "hung.yaml"
    job_file.write_text(yaml.safe_dump(document))
    runner = start_runner(tmp_path, job_file)
    log = tmp_path / "run" / "latest" / "logs" / "attempt-1-rank-1.log"
    wait_for(lambda: log.exists() and b"fault injection: hang" in log.read_bytes(), 180, "rank 1 to hang")
    victim = wait_for(lambda: sidecar_of(tmp_path, 1), what="rank 1's sidecar")
    os.kill(victim, signal.SIGKILL)
    output, _ = runner.communicate(timeout=240)
    assert runner.returncode == 0, output
    summary = summary_of(tmp_path)
    [restart] = summary["restarts"]
    # Rank 0 waits for rank 1 in the collective, so it may be reported hung at the same probe.
    who, _, _ = restart["reason"].partition(" hung at step ")
    assert who in ("rank 1", "ranks 0, 1"), restart["reason"]
    assert summary["final_step"] == 30


def test_a_workers_own_reason_reaches_the_user(tmp_path: Path) -> None:
    reason = "spec.x.y: must be positive, got -1"
    code, output = run_to_end(tmp_path, lifecycle_job(tmp_path, replicas=1, extra=("--fail", reason)))
    assert code == 2, output  # a permanent failure: the job cannot run as it is (README: exit codes)
    assert f"configuration error (permanent): {reason}" in output
    assert "an unrelated last line" not in output  # the termination message is preferred to the log


def test_pythons_own_error_reaches_the_user_from_the_log(tmp_path: Path) -> None:
    workers_dir = procs.LIFECYCLE_WORKER.parent
    job_file = lifecycle_job(
        tmp_path,
        replicas=1,
        command=["python", "no_such_script.py"],
        container={"workingDir": str(workers_dir)},
    )
    code, output = run_to_end(tmp_path, job_file)
    assert code == 2, output  # Python's own exit code 2 for a missing script: a configuration error
    assert "can't open file" in output
    assert "no_such_script.py" in output


def test_a_guardian_configuration_error_names_the_variable(tmp_path: Path) -> None:
    command = ["python", str(procs.WORKER), "--steps", "5"]
    job_file = lifecycle_job(
        tmp_path,
        replicas=1,
        command=command,
        container={"env": [{"name": "TRAINGUARD_FAULTS", "value": "nan_loss@oops"}]},
    )
    code, output = run_to_end(tmp_path, job_file)
    assert code == 2, output
    assert "job failed: " in output
    failure = summary_of(tmp_path)["reason"]
    assert "configuration error (permanent): " in failure
    assert "TRAINGUARD_FAULTS" in failure


def test_the_lock_file_is_refused_when_it_is_not_a_regular_file(tmp_path: Path) -> None:
    checkpoint_dir = tmp_path / "run" / "volumes" / "ckpt"
    checkpoint_dir.mkdir(parents=True)
    os.mkfifo(checkpoint_dir / ".trainguard-run.lock")
    code, output = run_to_end(tmp_path, lifecycle_job(tmp_path), timeout=60)
    assert code == 2, output
    assert "is not a regular file" in output
    assert stat.S_ISFIFO(os.lstat(checkpoint_dir / ".trainguard-run.lock").st_mode)
