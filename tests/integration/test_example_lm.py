"""The tiny language-model example, run for real: it learns, survives a NaN burst, resumes and replays.

The end-to-end tests run ``examples/tiny_lm/train.py`` as a subprocess exactly as a user would, with
short checkpoint and snapshot intervals from ``TRAINGUARD_SETTINGS``; the fast tests load the
example's data and model modules directly.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.support.paths import REPO_ROOT
from trainer_sidecar.checkpoint import CheckpointStore

REPO_ROOT = REPO_ROOT
EXAMPLE = REPO_ROOT / "examples" / "tiny_lm"
TRAIN = EXAMPLE / "train.py"
LN_256 = math.log(256)
SETTINGS = json.dumps({"checkpoint": {"everySteps": 10, "snapshotEverySteps": 5}})
# Small and quick: one thread so the test does not fight other processes for the cores.
FAST_ARGS = ["--batch-size", "16", "--threads", "1", "--eval-batches", "2", "--log-every", "10"]
# Variables that would change what the example does if inherited from the test's own environment.
_INHERITED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _load(name: str) -> ModuleType:
    """Import ``examples/tiny_lm/<name>.py`` under a private module name."""
    spec = importlib.util.spec_from_file_location(f"tiny_lm_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


def run_train(
    checkpoint_dir: Path, max_steps: int, *, faults: str = "", expect_exit: int = 0
) -> tuple[dict[str, Any], str]:
    """Run the example to ``max_steps`` and check its exit code; returns (final JSON summary, stderr).

    The summary is empty when the run was expected to fail.
    """
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("TRAINGUARD_") and key not in _INHERITED
    }
    env["TRAINGUARD_SETTINGS"] = SETTINGS
    if faults:
        env["TRAINGUARD_FAULTS"] = faults
    command = [
        sys.executable,
        str(TRAIN),
        "--checkpoint-dir",
        str(checkpoint_dir),
        "--max-steps",
        str(max_steps),
        *FAST_ARGS,
    ]
    proc = subprocess.run(
        command, cwd=checkpoint_dir.parent, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == expect_exit, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    if expect_exit != 0:
        return {}, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no summary on stdout\n{proc.stderr[-4000:]}"
    summary: dict[str, Any] = json.loads(lines[-1])
    assert set(summary) == {
        "final_step",
        "train_loss",
        "heldout_loss",
        "skipped_steps",
        "rollbacks",
        "samples_dropped",
    }
    return summary, proc.stderr


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One fault-free 40-step run, shared: (its summary, its checkpoint directory)."""
    ckpt = tmp_path_factory.mktemp("plain") / "ckpt"
    summary, _ = run_train(ckpt, 40)
    return summary, ckpt


def checkpoint_steps(checkpoint_dir: Path) -> list[int]:
    """Steps of the checkpoint directories present (of any epoch)."""
    return CheckpointStore(checkpoint_dir).steps()


# ------------------------------------------------------------------------------------------ fast ---
def test_windows_are_shifted_by_one_and_files_split_disjointly() -> None:
    data = _load("data")
    corpus = data.load_corpus(400_000)
    assert corpus == data.load_corpus(400_000)  # deterministic
    assert corpus.train_files
    assert corpus.heldout_files
    assert not set(corpus.train_files) & set(corpus.heldout_files)
    separators = len(data.FILE_SEPARATOR) * (len(corpus.train_files) + len(corpus.heldout_files))
    assert len(corpus.train) + len(corpus.heldout) <= 400_000 + separators  # the budget holds

    windows = data.ByteWindows(corpus.train, 32)
    assert len(windows) == (len(corpus.train) - 1) // 32
    inputs, targets = windows[3]
    assert inputs.dtype == torch.long
    assert inputs.shape == targets.shape == (32,)
    raw = torch.tensor(list(corpus.train[3 * 32 : 3 * 32 + 33]))
    assert torch.equal(inputs, raw[:-1])
    assert torch.equal(targets, raw[1:])
    with pytest.raises(IndexError):
        windows[len(windows)]


def test_model_is_causal_and_starts_near_uniform() -> None:
    model_module = _load("model")
    torch.manual_seed(0)
    model = model_module.TinyLM(model_module.ModelConfig(context=16, d_model=32, n_layers=2, n_heads=4))
    tokens = torch.randint(0, 256, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
        loss = float(model_module.lm_loss(before, torch.randint(0, 256, (2, 16))))
    assert torch.allclose(before[:, :10], after[:, :10])  # the future does not leak into the past
    assert not torch.allclose(before[:, 10:], after[:, 10:])
    assert abs(loss - LN_256) < 0.2


# ------------------------------------------------------------------------------------ end to end ---
@pytest.mark.slow
def test_short_run_learns_and_checkpoints(plain_run: tuple[dict[str, Any], Path]) -> None:
    summary, ckpt = plain_run
    assert summary["final_step"] == 40
    assert math.isfinite(summary["heldout_loss"])
    assert math.isfinite(summary["train_loss"])
    assert summary["heldout_loss"] < LN_256 - 1.0, summary
    assert summary["skipped_steps"] == 0
    assert summary["rollbacks"] == 0
    assert summary["samples_dropped"] == 0
    steps = checkpoint_steps(ckpt)
    assert steps[-1:] == [40], steps


@pytest.mark.slow
def test_nan_burst_is_rolled_back_and_the_run_completes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    summary, stderr = run_train(ckpt, 40, faults="nan_loss@10x3")
    assert summary["final_step"] == 40
    assert summary["rollbacks"] >= 1, summary
    assert summary["skipped_steps"] >= 3, summary
    assert math.isfinite(summary["train_loss"])
    assert math.isfinite(summary["heldout_loss"])
    assert summary["heldout_loss"] < LN_256 - 1.0, summary
    assert "rolled back" in stderr
    assert (ckpt / "dead-letter.jsonl").exists()


@pytest.mark.slow
def test_rerun_with_more_steps_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first, _ = run_train(ckpt, 20)
    assert first["final_step"] == 20
    second, stderr = run_train(ckpt, 40)
    assert "resumed from the clean checkpoint at step 20" in stderr, stderr[-4000:]
    # The held-out loss is evaluated once on the way back (by the guardian's resume), not twice.
    assert stderr.count("held-out loss") == 1, stderr[-4000:]
    assert second["final_step"] == 40
    assert math.isfinite(second["heldout_loss"])
    assert second["heldout_loss"] < first["heldout_loss"], (first, second)
    assert checkpoint_steps(ckpt)[-1] == 40


@pytest.mark.slow
def test_crash_and_restart_reproduces_the_uninterrupted_run(
    tmp_path: Path, plain_run: tuple[dict[str, Any], Path]
) -> None:
    ckpt = tmp_path / "ckpt"
    _, stderr = run_train(ckpt, 40, faults="crash@25", expect_exit=-signal.SIGKILL)
    assert "crash at step 25" in stderr
    summary, stderr = run_train(ckpt, 40, faults="crash@25")  # the same command again, as a restart would
    assert "resumed from the clean checkpoint at step 20" in stderr, stderr[-4000:]
    # The exact data position, RNG and optimizer state came back: the result is bit-for-bit the same.
    assert summary == plain_run[0]


def test_a_multi_rank_launch_without_rendezvous_variables_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # A PyTorchJob pod has RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT but no LOCAL_RANK; a launch with
    # WORLD_SIZE > 1 and no master must fail rather than train alone.
    monkeypatch.syspath_prepend(str(EXAMPLE))  # train.py imports its siblings as a script does
    train = _load("train")
    for name in _INHERITED:
        monkeypatch.delenv(name, raising=False)
    assert train.init_distributed() == (0, 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit, match="MASTER_ADDR, MASTER_PORT not set"):
        train.init_distributed()
    assert "LOCAL_RANK" not in train.DISTRIBUTED_ENV
