"""``trainguard run`` end to end: real worker processes, real sidecars, the real policy."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.support import procs
from tests.support.local_jobs import WORKER, job, run
from trainer_sidecar.checkpoint import CheckpointStore
from trainguard.local.sidecars import LIVENESS_FAILURE_THRESHOLD

pytestmark = pytest.mark.slow


def final_weights_finite(tmp_path: Path) -> bool:
    store = CheckpointStore(tmp_path / "run" / "volumes" / "ckpt")
    step = store.newest_valid()
    assert step is not None
    state = store.load(step)
    return all(bool(torch.isfinite(t).all()) for t in state["model"].values())


def test_nan_burst_rolls_back_and_the_job_succeeds_with_finite_weights(tmp_path: Path) -> None:
    code, summary, output = run(tmp_path, job(tmp_path, faults="nan_loss@12x3"))
    assert code == 0, output
    assert summary["result"] == "succeeded"
    assert summary["rollbacks"] == 1
    assert summary["skipped_steps"] >= 3
    assert summary["restarts"] == []
    assert summary["final_step"] == 40
    assert summary["final_checkpoint"]["step"] == 40
    assert final_weights_finite(tmp_path)
    assert "rollback" in [event["kind"] for event in summary["timeline"]]


def test_a_hang_on_one_rank_is_detected_and_the_gang_resumes_past_it(tmp_path: Path) -> None:
    hang_timeout, probe_period = 3, 1
    code, summary, output = run(tmp_path, job(tmp_path, faults="hang@15:1", hang_timeout=hang_timeout))
    assert code == 0, output
    assert len(summary["restarts"]) == 1
    restart = summary["restarts"][0]
    assert "hung" in restart["reason"]
    # The hang began at the last step; the sidecar judges it not alive after the timeout, and the runner
    # acts on that verdict, at the latest after LIVENESS_FAILURE_THRESHOLD failed probes in a row as the
    # kubelet does (plus a little scheduling slack on a loaded 2-core machine).
    assert restart["detect_seconds"] <= hang_timeout + LIVENESS_FAILURE_THRESHOLD * probe_period + 1.5
    assert restart["time_to_recover_seconds"] is not None
    # One source: the reason names the step the entry records (the furthest any rank's status said;
    # statuses are written at most twice a second, so it may be below 15), the sidecar's own words
    # agree, and the redone steps are counted from it.
    last, resumed = restart["last_step"], restart["resumed_step"]
    assert last is not None, restart
    assert 0 < last <= 15, restart
    assert f"rank 1 hung at step {last} in its own work" in restart["reason"], restart
    assert f"last step {last}" in restart["reason"], restart
    assert resumed is not None
    assert restart["redone_steps"] == max(0, last - resumed)
    failure = next(event for event in summary["timeline"] if event["kind"] == "failure")
    assert failure["step"] == last
    assert summary["final_step"] == 40
    assert summary["attempts"] == 2


def test_a_hang_is_acted_on_at_the_sidecars_verdict_not_after_the_kubelets_probe_failures(
    tmp_path: Path,
) -> None:
    # Probes 6 s apart: the kubelet's way (3 failed probes in a row) could not have caught the hang
    # before 12 s after the first failure. The runner reads /status in between, as the operator does, and
    # acts on the sidecar's own verdict.
    hang_timeout, probe_period = 7, 6
    document = job(tmp_path, faults="hang@15:1", hang_timeout=hang_timeout,
                   health={"probePeriodSeconds": probe_period})  # fmt: skip
    code, summary, output = run(tmp_path, document)
    assert code == 0, output
    (restart,) = summary["restarts"]
    assert re.search(r"rank 1 hung at step \d+ in its own work .*: no step for", restart["reason"]), restart
    assert "liveness probe failed" not in restart["reason"], restart
    assert restart["detect_seconds"] < hang_timeout + probe_period, restart
    assert summary["final_step"] == 40


def test_a_hang_names_the_rank_stuck_in_its_own_work_not_the_rank_that_waited_for_it(tmp_path: Path) -> None:
    """Rank 1 hangs before its backward pass (the fault stands for a hang in its forward pass); rank 0
    goes on into its own backward (DDP's gradient all-reduce) and waits there. Both stop stepping and
    both sidecars fail liveness; the failure names rank 1 as hung in its own work, rank 0 as waiting."""
    code, summary, output = run(
        tmp_path,
        job(tmp_path, steps=30, faults="hang@12:1", recovery={"maxRestarts": 0, "backoffSeconds": [1]}),
    )
    assert code == 1, output
    reason = summary["reason"]
    assert re.search(r"rank 1 hung at step \d+ in its own work \(the loop", reason), reason
    assert "rank 0 waited for it" in reason, reason
    assert "rank 0 hung" not in reason, reason
    assert "ranks 0, 1 hung" not in reason, reason


def test_a_hang_beside_the_loops_own_collective_names_the_rank_in_its_own_work(tmp_path: Path) -> None:
    """Issue 42: the loop all-reduces its sample count before each forward pass; rank 1 stops in its own
    loop code before it, and rank 0 waits for it in that all-reduce, not in any collective of the
    guardian's. The guardian sees the loop's collective wait: rank 1 is named, rank 0 as waiting."""
    extra = ("--count-samples", "--stall-at", "12", "--stall-rank", "1")
    recovery = {"maxRestarts": 0, "backoffSeconds": [1]}
    code, summary, output = run(tmp_path, job(tmp_path, steps=30, recovery=recovery, extra_args=extra))
    assert code == 1, output
    reason = summary["reason"]
    assert re.search(r"last: rank 1 hung at step \d+ in its own work \(the loop", reason), reason
    assert "rank 0 waited for it in a collective of the loop's (torch.distributed)" in reason, reason
    assert "rank 0 hung" not in reason, reason


def test_a_hang_is_caught_at_the_learned_timeout_far_below_hang_timeout_seconds(tmp_path: Path) -> None:
    """hangTimeoutSeconds at its default (300 s), steps of 0.1 s with a checkpoint every 5: once the warm-up
    has passed (20 published gaps, about 10 s), a hung rank is caught at the learned timeout (the 5 s
    floor, as 4 x the ~0.5 s published gaps is below it) plus the probes, not after five minutes."""
    floor, probe_period = 5, 1
    path = job(
        tmp_path, steps=190, faults="hang@150:1", hang_timeout=300, step_sleep=0.1,
        health={"hangTimeoutFloorSeconds": floor},
    )  # fmt: skip
    code, summary, output = run(tmp_path, path, timeout=400)
    assert code == 0, output
    assert len(summary["restarts"]) == 1, summary["restarts"]
    restart = summary["restarts"][0]
    assert "hung" in restart["reason"]
    assert "learned from its pace, at most 300 s" in restart["reason"], restart["reason"]
    # No false alarm before the fault (one restart only), and the hang caught in seconds: the learned
    # timeout (the floor, or 4 x the longest published gap on a loaded machine: a few seconds more),
    # LIVENESS_FAILURE_THRESHOLD probes, and scheduling slack, all far below the 300 s ceiling.
    assert restart["detect_seconds"] <= 3 * floor + LIVENESS_FAILURE_THRESHOLD * probe_period + 1.5, restart
    assert summary["final_step"] == 190


def test_an_evaluation_in_eval_mode_is_no_hang_at_the_learned_timeout(tmp_path: Path) -> None:
    """Rank 0 evaluates as real loops do (model.eval() ... model.train(), no guardian.busy) for twice the
    learned timeout's floor, once the timeout is learned; rank 1 waits for it in its next collective. The
    guardian sees the model in eval mode between steps and publishes an evaluation, which its peer waits
    for: no restart (without it, rank 0 is taken for hung at the floor)."""
    floor = 6
    path = job(
        tmp_path, steps=170, hang_timeout=300, step_sleep=0.1, health={"hangTimeoutFloorSeconds": floor},
        extra_args=("--busy-at", "150", "--busy-seconds", str(2 * floor), "--busy-eval-mode"),
    )  # fmt: skip
    code, summary, output = run(tmp_path, path, timeout=400)
    assert code == 0, output
    assert summary["restarts"] == [], summary["restarts"]
    assert summary["final_step"] == 170


def test_a_hung_gang_is_stopped_at_once_not_after_the_stop_grace(tmp_path: Path) -> None:
    """Once rank 1 hangs, rank 0 waits in the step's collective and cannot reach a boundary to checkpoint:
    the runner stops both within a moment, not after its stop grace (10 s), which is for a stop where
    every rank can save."""
    code, summary, output = run(tmp_path, job(tmp_path, faults="hang@15:1"))
    assert code == 0, output
    failure = next(e for e in summary["timeline"] if e["kind"] == "failure")
    restart = next(e for e in summary["timeline"] if e["kind"] == "restart")
    # Stopping takes the broken gang's grace (1 s) and the sidecars' exit, far under the 10 s grace.
    assert restart["t"] - failure["t"] < 5, summary["timeline"]
    assert summary["final_step"] == 40


def test_a_crash_restarts_the_gang_after_the_configured_backoff(tmp_path: Path) -> None:
    started = time.monotonic()
    code, summary, output = run(
        tmp_path, job(tmp_path, faults="crash@12:0", recovery={"maxRestarts": 2, "backoffSeconds": [2]})
    )
    assert code == 0, output
    assert time.monotonic() - started >= 2
    [restart] = summary["restarts"]
    # Rank 1 exits 1 when its peer vanishes; seen in the same look, rank 0 is still named, as the first.
    assert re.match(r"rank 0 crashed( first)? at step \d+: killed by signal 9", restart["reason"]), restart
    assert restart["backoff_seconds"] == 2
    assert restart["time_to_recover_seconds"] >= 2
    starts = [e for e in summary["timeline"] if e["kind"] == "start"]
    failure = next(e for e in summary["timeline"] if e["kind"] == "failure")
    assert starts[1]["t"] - failure["t"] >= 2
    assert summary["final_step"] == 40


def test_divergence_beyond_the_limits_fails_with_the_reason(tmp_path: Path) -> None:
    code, summary, output = run(
        tmp_path,
        job(
            tmp_path,
            faults="nan_loss@10x40",
            guard={"maxRollbacks": 1, "maxConsecutiveBadSteps": 2},
            recovery={"maxRestarts": 1, "backoffSeconds": [1]},
        ),
    )
    assert code == 1, output
    assert summary["result"] == "failed"
    assert "restarts exhausted (1 of 1)" in summary["reason"]
    assert "diverged" in summary["reason"]
    assert "diverged" in summary["restarts"][0]["reason"]
    assert "job failed" in output
    start_lines = [e["message"] for e in summary["timeline"] if e["kind"] == "start"]
    assert "remediation" in start_lines[1]  # the restart after divergence carries it


def test_exhausted_restarts_fail_the_job(tmp_path: Path) -> None:
    code, summary, output = run(
        tmp_path,
        job(tmp_path, faults="crash@5,crash@8,crash@11", recovery={"maxRestarts": 2, "backoffSeconds": [1]}),
    )
    assert code == 1, output
    assert "restarts exhausted (2 of 2)" in summary["reason"]
    assert len(summary["restarts"]) == 2


def test_a_crash_that_repeats_at_the_same_step_fails_after_two_attempts_as_deterministic(
    tmp_path: Path,
) -> None:
    # Both ranks raise the same error at step 12, in every attempt: the second attempt resumes from the
    # checkpoint of step 10 and fails where the first did. Not maxRestarts + 1 = 6 attempts.
    code, summary, output = run(
        tmp_path,
        job(tmp_path, extra_args=("--raise-at", "12"), recovery={"maxRestarts": 5, "backoffSeconds": [1]}),
    )
    assert code == 1, output
    assert summary["result"] == "failed"
    assert summary["attempts"] == 2
    reason = summary["reason"]
    assert reason.startswith(
        "deterministic failure: attempts 1 and 2 failed alike at step 12 (exited with code 1: "
    )
    assert (
        "ValueError: mat1 and mat2 shapes cannot be multiplied (8x16 and 32x1) (at tiny_train.py:" in reason
    )
    [restart] = summary["restarts"]
    assert restart["last_step"] == 12
    assert restart["resumed_step"] == 10
    assert "deterministic failure" in output


def test_a_job_of_the_same_name_in_another_namespace_is_refused_the_checkpoints_and_exits_2(
    tmp_path: Path,
) -> None:
    # Issue 19: "test-job" of namespace team-b, pointed at team-a's checkpoint directory, resumed its
    # weights, fenced it out and pruned its checkpoints; and a refused claim made the runner exit 1.
    shared = tmp_path / "shared"
    first, second = tmp_path / "a", tmp_path / "b"
    code, _, output = run(
        first, job(first, steps=12, replicas=1, namespace="team-a"), "--checkpoint-root", str(shared)
    )
    assert code == 0, output
    checkpoints = shared / "ckpt"
    before = {p: p.read_bytes() for p in checkpoints.rglob("*") if p.is_file() and "step-" in p.parent.name}
    assert before, "the first job wrote no checkpoint"

    code, summary, output = run(
        second, job(second, steps=12, replicas=1, namespace="team-b"), "--checkpoint-root", str(shared)
    )
    assert code == 2, output
    assert summary["result"] == "failed"
    assert "belongs to job team-a/test-job" in summary["reason"]
    assert "not to job team-b/test-job" in summary["reason"]
    assert "job failed: " in output
    after = {p: p.read_bytes() for p in checkpoints.rglob("*") if p.is_file() and "step-" in p.parent.name}
    assert after == before  # nothing resumed, written or pruned
    assert sorted(p.name for p in (checkpoints / "epochs").iterdir()) == ["epoch-000001.json"]

    code, summary, output = run(
        first, job(first, steps=14, replicas=1, namespace="team-a"), "--checkpoint-root", str(shared)
    )
    assert code == 0, output  # the job itself resumes its directory
    assert summary["final_step"] == 14


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"health": {"hangTimeoutSeconds": 5, "probePeriodSeconds": 10}}, "spec.health"),
        ({"recovery": {"backoffSeconds": [5, 1]}}, "spec.recovery.backoffSeconds"),
        ({"replicas": -1}, "spec.replicas"),
    ],
)
def test_an_invalid_job_is_refused_with_the_field_path_and_nothing_starts(
    tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    path = job(tmp_path)
    document = yaml.safe_load(path.read_text())
    document["spec"].update(change)
    path.write_text(yaml.safe_dump(document))
    code, _, output = run(tmp_path, path, timeout=60)
    assert code == 2
    assert named in output
    assert str(path) in output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("stop", "exit_code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signal_stops_the_gang_and_leaves_the_checkpoints_intact(
    tmp_path: Path, stop: signal.Signals, exit_code: int
) -> None:
    job_file = job(tmp_path, steps=400, step_sleep=0.05)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard.cli", "run", str(job_file), "--run-dir", str(tmp_path / "run"),
         "--plain"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    store_dir = tmp_path / "run" / "volumes" / "ckpt"
    deadline = time.monotonic() + 120
    # A complete checkpoint first (both ranks' manifests), so that there is something to keep intact.
    while time.monotonic() < deadline and not [
        step
        for step in store_dir.glob("step-*")
        if (step / "rank-0.json").exists() and (step / "rank-1.json").exists()
    ]:
        time.sleep(0.2)
    proc.send_signal(stop)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == exit_code, output
    assert f"stopped by {stop.name}" in output
    latest = tmp_path / "run" / "latest"
    summary = json.loads((latest / "summary.json").read_text())
    assert summary["result"] == "interrupted"
    pids = [json.loads(f.read_text())["pid"] for f in latest.glob("attempt-*/rank-*/status.json")]
    assert len(pids) == 2
    assert not [pid for pid in pids if procs.is_running(pid)]  # no worker outlived the runner
    assert procs.processes_mentioning(str(tmp_path)) == []  # nor a sidecar
    store = CheckpointStore(store_dir)
    newest = store.newest_valid()
    assert newest is not None
    assert all(store.verify(step).valid for step in store.steps() if store.is_complete(step))
    # The workers wrote a checkpoint as they stopped, and their final statuses say so: the summary's
    # final step is that checkpoint's, not the last step the runner saw before the signal.
    finals = [json.loads(f.read_text()) for f in latest.glob("attempt-1/rank-*/termination-log")]
    assert [status["phase"] for status in finals] == ["stopped", "stopped"], finals
    assert max(status["last_clean_checkpoint"]["step"] for status in finals) == newest
    assert {status["step"] for status in finals} == {newest}
    assert summary["final_step"] == newest == summary["final_checkpoint"]["step"]


def test_report_draws_the_timeline_as_a_png(tmp_path: Path) -> None:
    code, _, output = run(tmp_path, job(tmp_path, steps=20, faults="nan_loss@8x3"))
    assert code == 0, output
    png = tmp_path / "timeline.png"
    report = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "report", str(tmp_path / "summary.json"), "-o", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert png.stat().st_size > 10_000
    bad = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "report", str(tmp_path / "missing.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "missing.json" in bad.stderr


def test_two_pods_of_two_processes_run_under_torchrun_and_one_hung_process_restarts_the_gang(
    tmp_path: Path,
) -> None:
    # Global rank 3 is the second process of the second "pod": its sidecar watches both of that pod's
    # processes, and the pod fails liveness when one of them hangs.
    code, summary, output = run(
        tmp_path, job(tmp_path, steps=30, replicas=2, nproc_per_node=2, faults="hang@15:3", hang_timeout=4)
    )
    assert code == 0, output
    [restart] = summary["restarts"]
    assert "hung" in restart["reason"], restart  # the other processes wait for it in their collectives
    assert "local rank 1: no step for" in restart["reason"]
    assert summary["final_step"] == 30
    store = CheckpointStore(tmp_path / "run" / "volumes" / "ckpt")
    newest = store.resolve(30)
    assert newest is not None
    manifests = sorted(p.name for p in (store.root / newest.dir_name).glob("rank-*.json"))
    assert manifests == [f"rank-{r}.json" for r in range(4)]  # four ranks wrote their part
    # torchrun starts its workers in sessions of their own: the hung one used to outlive the run.
    deadline = time.monotonic() + 10
    while (left := procs.processes_mentioning(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == []


def test_a_command_that_runs_torchrun_itself_is_not_declared_hung_and_finishes(tmp_path: Path) -> None:
    # nprocPerNode stays 1 (the README allows it): the command launches torchrun with two processes,
    # which write status-0.json and status-1.json beside the status.json the sidecar was told of. The
    # run lasts well beyond the startup grace: a sidecar that waited for status.json alone failed the
    # pod's liveness then, and the runner restarted the gang until its restarts ran out. The grace is
    # the first status's too: torchrun and its two workers importing torch take past 20 s on a loaded
    # 2-core machine, so it is 45 s (the default is 600), and the steps outlast it.
    grace, steps, step_sleep = 45, 200, 0.25
    path = job(tmp_path, steps=steps, replicas=1, hang_timeout=5, step_sleep=step_sleep)
    document = yaml.safe_load(path.read_text())
    spec = document["spec"]
    container = spec["template"]["spec"]["containers"][0]
    container["command"] = [
        "python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        WORKER, "--steps", str(steps), "--step-sleep", str(step_sleep),
    ]  # fmt: skip
    spec["health"]["startupGraceSeconds"] = grace
    spec["recovery"] = {"maxRestarts": 1, "backoffSeconds": [1]}
    path.write_text(yaml.safe_dump(document))
    started = time.monotonic()
    code, summary, output = run(tmp_path, path)
    assert code == 0, output
    assert time.monotonic() - started > grace + LIVENESS_FAILURE_THRESHOLD  # long enough to have failed
    assert summary["result"] == "succeeded", summary["reason"]
    assert summary["restarts"] == []
    assert summary["attempts"] == 1
    assert summary["final_step"] == steps
    rank_dir = tmp_path / "run" / "latest" / "attempt-1" / "rank-0"
    assert sorted(p.name for p in rank_dir.glob("status*.json")) == ["status-0.json", "status-1.json"]
    store = CheckpointStore(tmp_path / "run" / "volumes" / "ckpt")
    newest = store.resolve(steps)
    assert newest is not None
    manifests = sorted(p.name for p in (store.root / newest.dir_name).glob("rank-*.json"))
    assert manifests == ["rank-0.json", "rank-1.json"]  # both processes of the one pod wrote their part


def test_a_dataloader_worker_that_segfaults_at_the_same_batch_every_attempt_is_deterministic(
    tmp_path: Path,
) -> None:
    # A corrupt sample kills the DataLoader worker that loads it by SIGSEGV, in every attempt: the loop
    # fails with "DataLoader worker (pid N) is killed by signal: Segmentation fault.", each time with
    # another pid. The verdict comes at attempt 2, not after maxRestarts + 1 = 4 attempts.
    code, summary, output = run(
        tmp_path,
        job(
            tmp_path,
            replicas=1,
            step_sleep=0.0,
            extra_args=("--num-workers", "1", "--segfault-at-batch", "12"),
            recovery={"maxRestarts": 3, "backoffSeconds": [1]},
        ),
    )
    assert code == 1, output
    assert summary["attempts"] == 2, output
    reason = summary["reason"]
    assert reason.startswith("deterministic failure: attempts 1 and 2 failed alike at step 12 ("), reason
    # PyTorch names the dead worker from its SIGCHLD handler ("is killed by signal: Segmentation fault.")
    # or, when the loop sees it first, while waiting for its batch ("exited unexpectedly").
    dead = r"DataLoader worker \(pid(\(s\))? {}\) (is killed|exited)"
    assert re.search(r"\(exited with code 1: RuntimeError: " + dead.format("<pid>"), reason), reason
    # The verdict's last failure is in the worker's own words, its pid as it was.
    assert re.search(r"last: rank 0 crashed at step 12: .*" + dead.format(r"\d+"), reason), reason
    [restart] = summary["restarts"]
    assert re.search(r"DataLoader worker \(pid(\(s\))? \d+\)", restart["reason"]), restart
    assert restart["resumed_step"] == 10
