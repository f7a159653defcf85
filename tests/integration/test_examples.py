"""The numbered examples, run as a user runs them: the adoption's size, that it trains like the loop it
adopts, that a crash resumes it exactly, and under torchrun."""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import REPO_ROOT
from tests.support.ports import free_port
from trainer_sidecar.checkpoint import CheckpointStore

pytestmark = pytest.mark.slow

NANOGPT = REPO_ROOT / "examples" / "02_nanogpt_style"
SMALL = ["--max-iters", "12", "--eval-interval", "6", "--eval-iters", "2", "--accumulation-steps", "2"]


def code_lines(path: Path) -> list[str]:
    """The file's lines after its module docstring, without blank lines."""
    text = path.read_text()
    body = text[text.index('"""', 3) + 3 :]
    return [line for line in body.splitlines() if line.strip()]


def test_the_nanogpt_shaped_loop_adopts_the_guardian_in_at_most_thirteen_changed_lines() -> None:
    # 13: import, Guardian, busy, the guardian's steps() for the loop's own counter (the while line,
    # iter_num += 1 gone) and the summary reading step_count, backward, and the optimizer step (3).
    diff = difflib.unified_diff(
        code_lines(NANOGPT / "nanogpt_plain.py"), code_lines(NANOGPT / "nanogpt.py"), n=0
    )
    changed = [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert 0 < len(changed) <= 13, "\n".join(changed)


@pytest.fixture(scope="module")
def token_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("nanogpt-data")
    subprocess.run(
        [sys.executable, str(NANOGPT / "prepare.py"), "--out", str(data), "--budget-bytes", "300000"],
        check=True,
        capture_output=True,
    )
    return data


def run_script(
    script: Path, args: list[str], env: dict[str, str] | None = None, launcher: list[str] | None = None
) -> tuple[int, dict[str, Any] | None, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "RANK", "WORLD_SIZE"))}
    done = subprocess.run(
        [*(launcher or [sys.executable]), str(script), *args],
        env={**clean, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, (json.loads(lines[-1]) if lines else None), done.stderr


def guardian_env(checkpoints: Path, faults: str = "") -> dict[str, str]:
    settings = {"checkpoint": {"everySteps": 4, "snapshotEverySteps": 4}}
    return {
        "TRAINGUARD_CHECKPOINT_DIR": str(checkpoints),
        "TRAINGUARD_SETTINGS": json.dumps(settings),
        "TRAINGUARD_FAULTS": faults,
    }


def test_the_guarded_loop_trains_like_the_plain_one(token_files: Path, tmp_path: Path) -> None:
    data = ["--data-dir", str(token_files), "--out-dir", str(tmp_path / "out")]
    plain = run_script(NANOGPT / "nanogpt_plain.py", [*SMALL, *data])
    guarded = run_script(NANOGPT / "nanogpt.py", [*SMALL, *data], guardian_env(tmp_path / "ckpt"))
    assert plain[0] == 0, plain[2][-3000:]
    assert guarded[0] == 0, guarded[2][-3000:]
    assert plain[1] is not None
    assert guarded[1] is not None
    assert guarded[1]["last_losses"] == pytest.approx(plain[1]["last_losses"], rel=1e-4)


def test_a_crash_resumes_the_nanogpt_shaped_loop_exactly(token_files: Path, tmp_path: Path) -> None:
    data = ["--data-dir", str(token_files), "--out-dir", str(tmp_path / "out")]
    whole = run_script(NANOGPT / "nanogpt.py", [*SMALL, *data], guardian_env(tmp_path / "whole"))
    crashed = run_script(
        NANOGPT / "nanogpt.py", [*SMALL, *data], guardian_env(tmp_path / "resumed", "crash@10")
    )
    assert crashed[0] == -9  # SIGKILL at step 10: the last checkpoint is step 8
    resumed = run_script(
        NANOGPT / "nanogpt.py", [*SMALL, *data], guardian_env(tmp_path / "resumed", "crash@10")
    )
    # Step 8's checkpoint may not be durable yet at the SIGKILL two steps later (background writes): a
    # resume from step 4's is just as exact.
    assert re.search(r"resumed from the clean checkpoint at step [48] ", resumed[2]), resumed[2][-3000:]
    assert whole[1] is not None
    assert resumed[1] is not None
    # Steps 8 to 11 again, with the same batches (the prefetched one too) and the same dropout.
    assert resumed[1]["last_losses"][-4:] == whole[1]["last_losses"][-4:]


def test_the_nanogpt_shaped_loop_under_torchrun(token_files: Path, tmp_path: Path) -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launcher += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    data = ["--data-dir", str(token_files), "--out-dir", str(tmp_path / "out")]
    code, summary, err = run_script(
        NANOGPT / "nanogpt.py", [*SMALL, *data], guardian_env(tmp_path / "ckpt", "nan_loss@5x3:1"), launcher
    )
    assert code == 0, err[-3000:]
    assert summary is not None
    assert "rolled back" in err  # rank 1's NaN burst rolled both ranks back together
    # The loop's step number is the guardian's: it went back with the weights, and the run kept all 12
    # steps asked for, the last one checkpointed. (The loop's own counter used to say 12 here, with
    # fewer steps kept in the model and the newest checkpoint at step 8.)
    assert summary["iter_num"] == 12
    assert CheckpointStore(tmp_path / "ckpt", world_size=2).newest_valid() == 12


def test_the_plain_loop_resumes_where_it_stopped(tmp_path: Path) -> None:
    script = REPO_ROOT / "examples" / "01_plain_loop" / "plain_loop.py"
    first = run_script(script, ["--steps", "40", "--checkpoint-dir", str(tmp_path)])
    second = run_script(script, ["--steps", "60", "--checkpoint-dir", str(tmp_path)])
    assert first[1] is not None
    assert second[1] is not None
    assert (first[1]["step"], second[1]["step"]) == (40, 60)
    assert "resumed from the clean checkpoint at step 40" in second[2]


def test_a_streaming_ddp_loop_resumes_its_stateful_dataloader_exactly(tmp_path: Path) -> None:
    script = REPO_ROOT / "examples" / "03_torchrun_ddp" / "streaming_ddp.py"

    def torchrun() -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                "127.0.0.1", "--master-port", str(free_port())]  # fmt: skip

    whole = run_script(script, ["--steps", "24"], guardian_env(tmp_path / "whole"), torchrun())
    crashed = run_script(
        script, ["--steps", "24"], guardian_env(tmp_path / "resumed", "crash@14:1"), torchrun()
    )
    assert crashed[0] != 0  # rank 1 killed at step 14: torchrun ends the other (the last checkpoint: 12)
    resumed = run_script(
        script, ["--steps", "24"], guardian_env(tmp_path / "resumed", "crash@14:1"), torchrun()
    )
    assert whole[0] == 0, whole[2][-3000:]
    assert resumed[0] == 0, resumed[2][-3000:]
    # The step-12 checkpoint is written in the background: when rank 1 is killed two steps later it may
    # not be durable yet on a loaded machine, and the resume starts from step 8's. Either is exact.
    assert re.search(r"resumed from the clean checkpoint at step (8|12) ", resumed[2]), resumed[2][-3000:]
    assert whole[1] is not None
    assert resumed[1] is not None
    assert resumed[1]["step"] == whole[1]["step"] == 24
    # The loader's position came back with the weights: the same batches, so the same losses.
    assert resumed[1]["last_losses"] == whole[1]["last_losses"]


WORD_LM = REPO_ROOT / "examples" / "05_word_language_model"
# 4 epochs of 10 BPTT windows (40 steps); the validation loss rises after epoch 3, so the learning rate
# is annealed there.
WORD_LM_ARGS = ["--epochs", "4", "--sentences", "150", "--log-interval", "100"]


def word_lm_env(checkpoints: Path, faults: str = "") -> dict[str, str]:
    # A checkpoint every 3 steps: mid-epoch (15: epoch 2's sixth window) and at an epoch's end (30).
    settings = {"checkpoint": {"everySteps": 3, "snapshotEverySteps": 3}}
    return {
        "TRAINGUARD_CHECKPOINT_DIR": str(checkpoints),
        "TRAINGUARD_SETTINGS": json.dumps(settings),
        "TRAINGUARD_FAULTS": faults,
    }


def test_the_guarded_word_language_model_trains_like_the_plain_one(tmp_path: Path) -> None:
    plain = run_script(WORD_LM / "main_plain.py", [*WORD_LM_ARGS, "--save", str(tmp_path / "p.pt")])
    guarded = run_script(
        WORD_LM / "main.py", [*WORD_LM_ARGS, "--save", str(tmp_path / "g.pt")], word_lm_env(tmp_path / "c")
    )
    assert plain[0] == 0, plain[2][-3000:]
    assert guarded[0] == 0, guarded[2][-3000:]
    assert plain[1] is not None
    assert guarded[1] is not None
    # torch.optim.SGD steps as the manual p.data.add_(p.grad, alpha=-lr) does, and the guardian clips
    # nothing unless asked (the loop clips itself): the same weights, bit for bit, the annealing included.
    assert guarded[1] == plain[1]
    assert plain[1]["val_losses"][2] > plain[1]["val_losses"][1]  # the learning rate was annealed


def test_a_crash_resumes_the_word_language_model_exactly(tmp_path: Path) -> None:
    def run(name: str, faults: str = "") -> tuple[int, dict[str, Any] | None, str]:
        args = [*WORD_LM_ARGS, "--save", str(tmp_path / f"{name}.pt")]
        return run_script(WORD_LM / "main.py", args, word_lm_env(tmp_path / name, faults))

    whole = run("whole")
    crashes = "crash@17,crash@32"
    first = run("resumed", crashes)
    assert first[0] == -9  # SIGKILL at step 17: the last checkpoint is step 15, in epoch 2
    second = run("resumed", crashes)
    assert second[0] == -9, second[2][-3000:]  # SIGKILL at step 32: the last checkpoint, 30, ends epoch 3
    # Checkpoints are written in the background: the newest durable one at a SIGKILL may be the one
    # before (step 12, not 15; 27, not 30) on a loaded machine. Either way the resume is exact.
    assert re.search(r"resumed from the clean checkpoint at step 1[25] ", second[2]), second[2][-3000:]
    third = run("resumed", crashes)
    assert third[0] == 0, third[2][-3000:]
    assert re.search(r"resumed from the clean checkpoint at step (27|30) ", third[2]), third[2][-3000:]
    assert whole[1] is not None
    assert third[1] is not None
    # Mid-epoch, the LSTM's hidden state came back with the weights; at epoch 3's end, the resumed run
    # evaluated again and annealed (the best loss came back) as the whole run did: the same final weights.
    # Neither a warning about weights changed in place (the best model's reload after the last step).
    assert "settle" not in whole[2] + third[2]
    assert third[1]["weights"] == whole[1]["weights"]
    assert third[1]["val_losses"] == whole[1]["val_losses"][2:]  # epochs 3 (its end again) and 4
    assert third[1]["test_loss"] == whole[1]["test_loss"]
    assert third[1]["last_losses"] == whole[1]["last_losses"]


IMAGENET = REPO_ROOT / "examples" / "06_imagenet_style"
WORKERS = REPO_ROOT / "tests" / "support" / "workers"
# 4 epochs of 16 batches (128 images, 8 a batch): 64 steps, the learning rate decayed after epoch 2.
EPOCH_STEPS = 16


def imagenet_env(checkpoints: Path, faults: str = "", **guard: Any) -> dict[str, str]:
    settings: dict[str, Any] = {
        "checkpoint": {"everySteps": EPOCH_STEPS, "snapshotEverySteps": 4},
        # A rollback changes nothing but the state, so that a run without one can match it.
        "remediation": {"lrScale": 1.0, "maxGradNorm": None},
        "guard": guard,
    }
    return {
        "TRAINGUARD_CHECKPOINT_DIR": str(checkpoints),
        "TRAINGUARD_SETTINGS": json.dumps(settings),
        "TRAINGUARD_FAULTS": faults,
    }


def run_imagenet(
    tmp_path: Path, name: str, env: dict[str, str], script: str = "imagenet.py"
) -> tuple[int, dict[str, Any] | None, str]:
    return run_script(IMAGENET / script, ["--out-dir", str(tmp_path / f"{name}-out")], env)


def numbers(summary: dict[str, Any] | None) -> dict[str, Any]:
    """What must agree with the uninterrupted run: the weights (buffers too), lr, scheduler, best_acc1."""
    assert summary is not None
    return {key: summary[key] for key in ("weights", "lr", "scheduler", "best_acc1")}


@pytest.fixture(scope="module")
def imagenet_whole(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    directory = tmp_path_factory.mktemp("imagenet-whole")
    code, summary, err = run_imagenet(directory, "whole", imagenet_env(directory / "ckpt"))
    assert code == 0, err[-3000:]
    assert summary is not None
    return directory, summary


def test_the_guarded_imagenet_loop_trains_like_the_plain_one(
    imagenet_whole: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    plain = run_imagenet(tmp_path, "plain", {}, "imagenet_plain.py")
    assert plain[0] == 0, plain[2][-3000:]
    # The guardian's defaults clip nothing and the loop's own iteration is untouched: bit for bit.
    assert imagenet_whole[1] == plain[1]
    assert plain[1] is not None
    accuracies = plain[1]["accuracies"]
    assert max(accuracies) == plain[1]["best_acc1"] > accuracies[-1]  # the best is not the last epoch's


def test_a_rollback_across_an_epoch_end_ends_like_a_run_that_skips_the_same_batches(tmp_path: Path) -> None:
    # NaN losses at steps 14 and 15 (epoch 0's last two batches) and 16 (epoch 1's first): the third in
    # a row rolls back to the snapshot at step 12, before epoch 0's end (validate, scheduler.step(), the
    # best score), which runs again from there.
    rolled = run_imagenet(tmp_path, "rolled", imagenet_env(tmp_path / "rolled", "nan_loss@14x3"))
    assert rolled[0] == 0, rolled[2][-3000:]
    assert "rolled back from step 17 to step 12" in rolled[2], rolled[2][-3000:]
    # The uninterrupted run skips the batches the rollback did (its dead letters), by index.
    dead = (tmp_path / "rolled" / "dead-letter.jsonl").read_text()
    skipped = {(entry["epoch"], entry["batch"]) for entry in map(json.loads, dead.splitlines())}
    assert skipped == {(0, 12), (0, 13), (0, 14), (0, 15), (1, 0)}
    (tmp_path / "skipping").mkdir()
    (tmp_path / "skipping" / "dead-letter.jsonl").write_text(dead)
    skipping = run_imagenet(tmp_path, "skipping", imagenet_env(tmp_path / "skipping"))
    assert skipping[0] == 0, skipping[2][-3000:]
    assert "rolled back" not in skipping[2]
    assert numbers(rolled[1]) == numbers(skipping[1])
    assert rolled[1] is not None
    assert rolled[1]["scheduler"]["last_epoch"] == 4  # not one decay off


def test_a_crash_mid_epoch_resumes_the_imagenet_loop_exactly(
    imagenet_whole: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    env = imagenet_env(tmp_path / "ckpt", "crash@40")
    first = run_imagenet(tmp_path, "crashed", env)
    assert first[0] == -9  # SIGKILL at step 40, mid-epoch 2: the last checkpoint is step 32's
    second = run_imagenet(tmp_path, "crashed", env)
    assert second[0] == 0, second[2][-3000:]
    assert "resumed from the clean checkpoint at step 32 " in second[2], second[2][-3000:]
    assert numbers(second[1]) == numbers(imagenet_whole[1])


def test_a_crash_after_an_epoch_end_resumes_from_that_epochs_checkpoint(
    imagenet_whole: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    # SIGKILL at epoch 1's first step, right after epoch 0's validate() and save: the checkpoint of
    # epoch 0's last step (16) was made durable before validate() began, so it is the one resumed
    # (a write still in flight used to be lost, resuming from the one before); epoch 0's end runs again
    # from the state before it.
    env = imagenet_env(tmp_path / "ckpt", "crash@16")
    assert run_imagenet(tmp_path, "crashed", env)[0] == -9
    resumed = run_imagenet(tmp_path, "crashed", env)
    assert resumed[0] == 0, resumed[2][-3000:]
    assert "resumed from the clean checkpoint at step 16 " in resumed[2], resumed[2][-3000:]
    assert numbers(resumed[1]) == numbers(imagenet_whole[1])
    assert resumed[1] is not None
    assert resumed[1]["accuracies"] == imagenet_whole[1]["accuracies"]  # epoch 0's end again, then 1-3


def test_a_crash_inside_validate_resumes_from_the_checkpoint_of_the_epochs_last_step(
    imagenet_whole: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    # SIGKILL inside epoch 0's validate(), the loop's own evaluation, right after the epoch's data ran
    # out: the checkpoint of its last step (16), started in the background at that step, was waited for
    # before the data's end returned, so the restart resumes from it rather than from nothing.
    marker = tmp_path / "crashed-once"
    crashing = [sys.executable, str(WORKERS / "crash_in_validate.py"), str(marker)]
    env = imagenet_env(tmp_path / "ckpt")
    first = run_script(IMAGENET / "imagenet.py", ["--out-dir", str(tmp_path / "out")], env, crashing)
    assert first[0] == -9, first[2][-3000:]
    assert marker.exists()
    resumed = run_script(IMAGENET / "imagenet.py", ["--out-dir", str(tmp_path / "out")], env, crashing)
    assert resumed[0] == 0, resumed[2][-3000:]
    assert f"resumed from the clean checkpoint at step {EPOCH_STEPS} " in resumed[2], resumed[2][-3000:]
    assert numbers(resumed[1]) == numbers(imagenet_whole[1])
    assert resumed[1] is not None
    assert resumed[1]["accuracies"] == imagenet_whole[1]["accuracies"]


def test_a_finished_imagenet_job_rerun_trains_nothing(
    imagenet_whole: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    directory, whole = imagenet_whole
    again = run_imagenet(tmp_path, "again", imagenet_env(directory / "ckpt"))
    assert again[0] == 0, again[2][-3000:]
    assert again[1] is not None
    # No batch trained: at most the last epoch's end ran again, from the state before it (its checkpoint
    # is its last step's), with the same accuracy.
    assert again[1]["accuracies"] in ([], whole["accuracies"][-1:])
    assert numbers(again[1]) == numbers(whole)


def test_a_rollback_across_an_epoch_end_under_torchrun_ends_like_a_run_that_skips_the_same_batches(
    tmp_path: Path,
) -> None:
    # Two ranks of 8 batches an epoch each; rank 1's NaN losses at steps 6-8 (epoch 0's last two batches,
    # epoch 1's first) roll both ranks back to the snapshot at step 4, before epoch 0's end.
    def torchrun() -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                "127.0.0.1", "--master-port", str(free_port())]  # fmt: skip

    def run(name: str, faults: str = "") -> tuple[int, dict[str, Any] | None, str]:
        args = ["--out-dir", str(tmp_path / f"{name}-out")]
        return run_script(IMAGENET / "imagenet.py", args, imagenet_env(tmp_path / name, faults), torchrun())

    rolled = run("rolled", "nan_loss@6x3:1")
    assert rolled[0] == 0, rolled[2][-3000:]
    assert "rolled back from step 9 to step 4" in rolled[2], rolled[2][-3000:]
    dead = (tmp_path / "rolled" / "dead-letter.jsonl").read_text()
    (tmp_path / "skipping").mkdir()
    (tmp_path / "skipping" / "dead-letter.jsonl").write_text(dead)
    skipping = run("skipping")
    assert skipping[0] == 0, skipping[2][-3000:]
    assert numbers(rolled[1]) == numbers(skipping[1])
    assert rolled[1] is not None
    assert rolled[1]["scheduler"]["last_epoch"] == 4


def test_the_imagenet_loops_own_resume_continues_under_the_guardian(
    imagenet_whole: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    # The loop's own --resume (its checkpoint.pth.tar after 2 of the 4 epochs, written without the
    # guardian) gives guardian.epochs its start while the guardian has no checkpoint of its own.
    out = tmp_path / "own"
    first = run_script(IMAGENET / "imagenet_plain.py", ["--epochs", "2", "--out-dir", str(out)])
    assert first[0] == 0, first[2][-3000:]
    args = ["--resume", str(out / "checkpoint.pth.tar"), "--out-dir", str(out)]
    resumed = run_script(IMAGENET / "imagenet.py", args, imagenet_env(tmp_path / "ckpt"))
    assert resumed[0] == 0, resumed[2][-3000:]
    assert resumed[1] is not None
    assert numbers(resumed[1]) == numbers(imagenet_whole[1])
    assert resumed[1]["accuracies"] == imagenet_whole[1]["accuracies"][2:]  # epochs 2 and 3 only
