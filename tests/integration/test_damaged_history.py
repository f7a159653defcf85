"""Real workers started on a checkpoint directory that a crash, a full disk or a stranger damaged: an
unreadable newest epoch claim or a damaged newest checkpoint falls back to the older history and prunes
nothing in that run; a directory some rank cannot write is a configuration error (exit 2) naming it, on
every rank, before any claim is written."""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checkpoints import flip_one_bit
from tests.support.ports import free_port
from tests.support.procs import WORKER, finish, start_worker, worker_env
from trainer_sidecar.checkpoint import step_dir_name
from trainer_sidecar.contract.exitcodes import ExitCode

pytestmark = pytest.mark.slow

SETTINGS = {"checkpoint": {"everySteps": 4, "keepClean": 2}, "statusIntervalSeconds": 0}


def first_run(ckpt: Path) -> None:
    """20 steps under epoch 1: checkpoints of steps 16 and 20 are kept (keepClean 2)."""
    code, report, err = finish(start_worker(["--steps", "20"], worker_env(ckpt, settings=SETTINGS)))
    assert code == 0, err[-3000:]
    assert report is not None
    assert sorted(p.name for p in ckpt.glob("step-*")) == [step_dir_name(16, 1), step_dir_name(20, 1)]


def contents(ckpt: Path) -> dict[str, str]:
    """Every file under ``ckpt`` with its SHA-256 (what a start must not lose)."""
    return {
        str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@pytest.mark.parametrize("how", ["empty", "garbage", "directory"])
def test_a_torn_newest_claim_resumes_from_the_history_and_prunes_nothing(tmp_path: Path, how: str) -> None:
    ckpt = tmp_path / "ckpt"
    first_run(ckpt)
    claim = ckpt / "epochs" / "epoch-000002.json"  # the next start's claimer died while writing it
    if how == "empty":
        claim.write_bytes(b"")
    elif how == "garbage":
        claim.write_bytes(os.urandom(200))
    else:
        claim.mkdir()
    code, report, err = finish(start_worker(["--steps", "28"], worker_env(ckpt, settings=SETTINGS)))
    assert code == 0, err[-3000:]
    assert report is not None, err[-3000:]
    assert report["resumed_step"] == 20, err[-3000:]
    assert "unreadable epoch claims passed over (epoch-000002.json" in err
    assert "starting from scratch" not in err
    names = sorted(p.name for p in ckpt.glob("step-*"))
    # Epoch 3 wrote 24 and 28; with keepClean 2 it would have pruned 16 and 20: it found damage, so not.
    assert names == [step_dir_name(16, 1), step_dir_name(20, 1), step_dir_name(24, 3), step_dir_name(28, 3)]


def test_a_damaged_newest_checkpoint_resumes_the_older_one_and_prunes_nothing(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first_run(ckpt)
    flip_one_bit(ckpt / step_dir_name(20, 1) / "rank-0.safetensors")
    code, report, err = finish(start_worker(["--steps", "28"], worker_env(ckpt, settings=SETTINGS)))
    assert code == 0, err[-3000:]
    assert report is not None, err[-3000:]
    assert report["resumed_step"] == 16, err[-3000:]
    assert "not pruned in this run" in err
    names = sorted(p.name for p in ckpt.glob("step-*"))
    assert names == [
        step_dir_name(16, 1),
        step_dir_name(20, 1),
        step_dir_name(20, 2),
        step_dir_name(24, 2),
        step_dir_name(28, 2),
    ]


def in_namespace(script: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """Run ``script`` (sh; ``argv`` as $1...) in a user and mount namespace of its own, where it may mount."""
    return subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-ec", script, "sh", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


READ_ONLY = 'mount --bind "$1" "$1"; mount -o remount,bind,ro "$1"; shift; exec "$@"'


def test_a_directory_one_rank_cannot_write_is_a_config_error_on_every_rank_before_any_claim(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    first_run(ckpt)
    before = contents(ckpt)
    port = free_port()
    args = [sys.executable, str(WORKER), "--steps", "28"]
    rank0 = start_worker(args[2:], worker_env(ckpt, settings=SETTINGS, rank=0, world_size=2, port=port))
    # Rank 1's mount of the volume is read-only (a pod whose volume is mounted readOnly).
    rank1_env = worker_env(ckpt, settings=SETTINGS, rank=1, world_size=2, port=port)
    rank1 = in_namespace(READ_ONLY, [str(ckpt), *args], rank1_env)
    results = [finish(rank0), finish(rank1)]
    for code, _, err in results:
        assert code == ExitCode.CONFIG_ERROR, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    assert f"checkpoint directory {ckpt} is not writable" in results[1][2]
    assert "Read-only file system" in results[1][2]
    assert str(ckpt) in results[0][2]
    assert contents(ckpt) == before  # no claim written, nothing pruned or moved


FULL = """
mount -t tmpfs -o size=4m tmpfs "$1"
cp -a "$2"/. "$1"/
dd if=/dev/zero of="$1"/filler bs=4096 2>/dev/null || true
status=0
"$3" "$4" --steps 28 || status=$?
rm "$1"/filler
cd "$1" && find . -type f | sort | xargs sha256sum > "$5"
exit $status
"""


def test_a_full_checkpoint_volume_is_a_config_error_naming_it_and_nothing_is_lost(tmp_path: Path) -> None:
    saved = tmp_path / "saved"
    first_run(saved)
    ckpt, listing = tmp_path / "ckpt", tmp_path / "after.txt"
    ckpt.mkdir()
    argv = [str(ckpt), str(saved), sys.executable, str(WORKER), str(listing)]
    code, _, err = finish(in_namespace(FULL, argv, worker_env(ckpt, settings=SETTINGS)))
    assert code == ExitCode.CONFIG_ERROR, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert f"checkpoint directory {ckpt} is not writable" in err
    assert "No space left on device" in err
    after = {line.split()[1].removeprefix("./"): line.split()[0] for line in listing.read_text().splitlines()}
    assert after == contents(saved), shlex.join(sorted(after))
