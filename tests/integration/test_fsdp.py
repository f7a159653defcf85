"""A small transformer sharded with FSDP2 (and HSDP) over real gloo ranks, under the guardian: the global
gradient norm, skips and rollbacks taken by every rank alike, sharded checkpoints, and resuming them
bit-identically at the same world size and at another one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.checkpoints import claim_global_shape, sharded_names, split_file
from tests.support.paths import REPO_ROOT
from tests.support.ports import free_port
from tests.support.procs import FSDP_WORKER, finish, run_gang, successful_reports, worker_env
from tests.support.workers.fsdp_train import make_dataset
from trainer_sidecar.checkpoint import CheckpointStore, step_dir_name
from trainer_sidecar.guardian.data import GuardedLoader

pytestmark = pytest.mark.slow

EXAMPLE_JOB = REPO_ROOT / "examples" / "04_fsdp" / "job.yaml"
SETTINGS = {"checkpoint": {"everySteps": 4, "snapshotEverySteps": 2}, "guard": {"spikeMinHistory": 50}}


def gang(ckpt: Path, world_size: int, args: list[str], faults: str = "") -> list[dict[str, Any]]:
    results = run_gang(ckpt, world_size, args, faults=faults, settings=SETTINGS, worker=FSDP_WORKER)
    return successful_reports(results)


def test_fsdp_nan_loss_on_one_rank_makes_every_rank_skip_and_the_norm_is_the_global_one(
    tmp_path: Path,
) -> None:
    reports = gang(tmp_path, 2, ["--steps", "10", "--norm-check-step", "3"], faults="nan_loss@6:1")
    for report in reports:
        assert report["skipped_steps"] == 1
        assert report["step"] == 10
        # torch's own norm of the DTensor gradients (its collective) against the guardian's one sum
        assert report["guardian_norm"] == pytest.approx(report["reference_norm"], rel=1e-6)
    assert len({report["digest"] for report in reports}) == 1


def test_hsdp_an_infinite_gradient_in_one_shard_makes_every_rank_skip(tmp_path: Path) -> None:
    # Rank 3 alone holds the poisoned shard; its replica (rank 1) and the other shard group see a finite
    # local norm: only the step's one collective tells them.
    args = ["--shard", "hsdp", "--steps", "6", "--norm-check-step", "2"]
    reports = gang(tmp_path, 4, args, faults="inf_grad@4:3")
    for report in reports:
        assert report["skipped_steps"] == 1
        assert report["step"] == 6
        # a shard held by two replicas counts once in the global norm
        assert report["guardian_norm"] == pytest.approx(report["reference_norm"], rel=1e-6)


def test_fsdp_rollback_restores_every_shard_on_every_rank(tmp_path: Path) -> None:
    reports = gang(tmp_path, 2, ["--steps", "10"], faults="nan_loss@5x3:0")
    for report in reports:
        assert report["rollbacks"] == 1
        assert report["rollbacks_checked"] == [True]  # each rank's shards, byte for byte, as snapshotted


def test_fsdp_sigkill_of_the_gang_then_resume_is_bit_identical_to_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    args = ["--steps", "14"]
    reference = gang(tmp_path / "reference", 2, args)
    killed = run_gang(tmp_path / "killed", 2, args, faults="crash@11", settings=SETTINGS, worker=FSDP_WORKER)
    assert [code for code, _, _ in killed] == [-signal.SIGKILL] * 2
    resumed = gang(tmp_path / "killed", 2, args, faults="crash@11")  # a fault fires once per job
    for before, after in zip(reference, resumed, strict=True):
        assert after["resumed_step"] == 8
        assert after["step"] == 14
        assert after["digest"] == before["digest"]
        assert after["probe_end"] == before["probe_end"]
    # the resumed gang trained on exactly the samples the uninterrupted one did after step 8
    assert sorted(s for r in resumed for s in r["samples"]) == sorted(
        s for r in reference for s in r["samples"][8 * 4 :]
    )


def test_a_sharded_checkpoint_resumes_unsharded_on_one_rank_at_the_same_state_and_sample(
    tmp_path: Path,
) -> None:
    first = gang(tmp_path, 2, ["--steps", "8"])
    assert {report["position"]["sample"] for report in first} == {8 * 4 * 2}
    # Nothing left to train: the state loaded from the two ranks' shards is the gathered state, exactly.
    (same,) = gang(tmp_path, 1, ["--steps", "8", "--shard", "none"])
    assert same["resumed_step"] == 8
    assert same["digest"] == first[0]["digest"]
    assert same["probe_start"] == pytest.approx(first[0]["probe_end"], rel=1e-6)
    (more,) = gang(tmp_path, 1, ["--steps", "10", "--shard", "none"])
    assert more["resumed_step"] == 8
    # The next samples are the next positions of the epoch's order: 64.. for one rank of batch 4.
    one_rank = GuardedLoader(make_dataset(512, 0), batch_size=4, seed=0, rank=0, world_size=1)
    assert more["samples"] == one_rank.batch_indices(0, 16) + one_rank.batch_indices(0, 17)
    assert not set(more["samples"]) & {s for report in first for s in report["samples"]}


def test_a_sharded_checkpoint_of_two_ranks_resumes_on_four(tmp_path: Path) -> None:
    first = gang(tmp_path, 2, ["--steps", "8"])
    wider = gang(tmp_path, 4, ["--steps", "8"])
    for report in wider:
        assert report["resumed_step"] == 8
        assert report["digest"] == first[0]["digest"]  # every shard re-cut from the two old ones
        assert report["probe_start"] == pytest.approx(first[0]["probe_end"], rel=1e-6)
        assert report["position"]["sample"] == 64


def test_a_sharded_checkpoint_of_four_ranks_resumes_on_two_at_the_next_samples(tmp_path: Path) -> None:
    first = gang(tmp_path, 4, ["--steps", "6"])  # a node of two ranks was lost
    narrower = gang(tmp_path, 2, ["--steps", "8"])
    seen_before = {s for report in first for s in report["samples"]}
    for report in narrower:
        assert report["resumed_step"] == 6
        assert report["probe_start"] == pytest.approx(first[0]["probe_end"], rel=1e-6)
        assert report["position"]["sample"] == 6 * 4 * 4 + 2 * 4 * 2  # two more steps of two ranks
        # 6 steps of 4 ranks of 4 samples: position 96, which is batch 12 of each of two ranks
        loader = GuardedLoader(make_dataset(512, 0), batch_size=4, seed=0, rank=report["rank"], world_size=2)
        assert report["samples"] == loader.batch_indices(0, 12) + loader.batch_indices(0, 13)
        assert not set(report["samples"]) & seen_before


def test_an_hsdp_checkpoint_resumes_as_fsdp_on_half_the_ranks_in_the_same_state(tmp_path: Path) -> None:
    # Two replicas of two shards each wrote one copy of the model; two FSDP ranks re-cut it.
    first = gang(tmp_path, 4, ["--steps", "6", "--shard", "hsdp"])
    assert len({report["digest"] for report in first}) == 1
    resumed = gang(tmp_path, 2, ["--steps", "6", "--shard", "fsdp"])
    for report in resumed:
        assert report["resumed_step"] == 6
        assert report["digest"] == first[0]["digest"]
        assert report["probe_start"] == pytest.approx(first[0]["probe_end"], rel=1e-6)
        assert report["position"]["sample"] == 6 * 4 * 4


def test_a_torchtitan_style_dcp_checkpoint_of_two_fsdp_ranks_imports_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    # Saved by every rank with DCP, as torchtitan saves (no guardian involved), then imported offline.
    port, out = free_port(), str(tmp_path / "dcp")
    command = [sys.executable, "-m", "tests.support.workers.titan_style", "--steps", "5", "--out", out]
    titan = [
        subprocess.Popen(
            command,
            env=worker_env(tmp_path / "unused", rank=rank, world_size=2, port=port),
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    saved = successful_reports([finish(proc, timeout=300) for proc in titan])
    imported = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "checkpoint", "import-dcp", str(tmp_path / "dcp"),
         str(tmp_path / "ckpt"), "--i-trust-this-pickle"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    assert "as checkpoint 5 of" in imported.stdout  # the step from its train_state
    for report in gang(tmp_path / "ckpt", 2, ["--steps", "5"]):
        assert report["resumed_step"] == 5
        assert report["digest"] == saved[0]["digest"]  # every shard and its optimizer state, exactly
        assert report["probe_start"] == pytest.approx(saved[0]["probe_end"], rel=1e-6)


def test_the_fsdp_example_job_runs_under_trainguard_run_through_a_nan_burst_and_a_crash(
    tmp_path: Path,
) -> None:
    summary_file = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "run", str(EXAMPLE_JOB), "--run-dir", str(tmp_path / "run"),
         "--summary", str(summary_file), "--plain"],
        capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    summary = json.loads(summary_file.read_text())
    assert summary["result"] == "succeeded"
    assert summary["final_step"] == 60
    assert summary["rollbacks"] == 1
    assert len(summary["restarts"]) == 1  # the crash of rank 1: the gang resumed its sharded checkpoint
    # Named as the cause, whatever rank 0's all-gather raised when its peer went.
    assert summary["restarts"][0]["reason"].startswith("rank 1 crashed"), summary["restarts"]
    store = CheckpointStore(tmp_path / "run" / "volumes" / "fsdp-lm-ckpt")
    newest = store.newest_valid()
    assert newest == 60
    state = store.load(newest)  # two ranks' shards, read whole
    assert state["model"]["head.weight"].shape == (64, 64)
    assert all(bool(torch.isfinite(t).all()) for t in state["model"].values())


def test_a_ddp_checkpoint_of_two_ranks_resumes_on_one_at_the_next_sample(tmp_path: Path) -> None:
    first = gang(tmp_path, 2, ["--steps", "6", "--shard", "ddp"])
    (more,) = gang(tmp_path, 1, ["--steps", "8", "--shard", "none"])
    assert more["resumed_step"] == 6
    assert more["probe_start"] == pytest.approx(first[0]["probe_end"], rel=1e-6)
    one_rank = GuardedLoader(make_dataset(512, 0), batch_size=4, seed=0, rank=0, world_size=1)
    # 6 steps of 2 ranks of 4 samples: the next sample is position 48, batch 12 of one rank
    assert more["samples"] == one_rank.batch_indices(0, 12) + one_rank.batch_indices(0, 13)


@pytest.mark.parametrize("damage", ["16 TiB", "uncovered"])
def test_a_sharded_checkpoint_with_a_damaged_shard_table_falls_back_to_the_older_one(
    tmp_path: Path, damage: str
) -> None:
    # A shard table (manifests resealed to match) that gives a tensor a global shape far beyond its
    # bytes, or one its shards do not cover: the newest checkpoint is damaged, not another model.
    gang(tmp_path, 2, ["--steps", "8"])  # checkpoints of steps 4 and 8
    newest = tmp_path / step_dir_name(8, 1)
    name = next(n for n in sharded_names(newest) if n.startswith("model/"))
    header, _ = split_file((newest / "rank-0.safetensors").read_bytes())
    shape = json.loads(header["__metadata__"]["shards"])[name]["shape"]
    shape[0] = 1 << 40 if damage == "16 TiB" else shape[0] + 1
    claim_global_shape(newest, 2, name, shape)
    code, report, err = finish(
        subprocess.Popen(
            [sys.executable, str(FSDP_WORKER), "--steps", "8", "--shard", "none"],
            env=worker_env(tmp_path, settings=SETTINGS),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    )
    assert code == 0, err[-3000:]
    assert report is not None, err[-3000:]
    assert report["resumed_step"] == 4, err[-3000:]
    assert f"checkpoint {newest.name} cannot be restored" in err
    assert newest.is_dir()  # the damaged checkpoint is kept for a human to look at
