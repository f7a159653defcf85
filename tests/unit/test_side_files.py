"""The files the guardian keeps beside its checkpoints live in an untrusted directory too.

The dead-letter list, the fault ledgers and the forensic bundles are written on the same shared volume as
the checkpoints, so a planted link, FIFO or device must never make the guardian write, read without bound
or delete outside the checkpoint directory. (The checkpoint files themselves are attacked in
``test_checkpoint_store.py``.)
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from trainer_sidecar.guardian.data import DEAD_LETTER_NAME, DeadLetters
from trainer_sidecar.guardian.faults import FaultInjector, parse_faults
from trainer_sidecar.guardian.forensics import FORENSICS_DIR, FORENSICS_KEEP, Anomaly, write_bundle


def anomaly(step: int) -> Anomaly:
    return Anomaly(
        step=step,
        iteration=step,
        rank=0,
        reason="nan loss",
        loss=float("nan"),
        grad_norm=1.0,
        explosion_pattern=None,
        nan_location=None,
        batches=[],
        losses=[1.0],
        grad_norms=[1.0],
    )


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "victim").write_text("precious\n")
    return folder


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    return folder


def test_a_dead_letter_file_planted_as_a_link_is_never_written_through(root: Path, outside: Path) -> None:
    (root / DEAD_LETTER_NAME).symlink_to(outside / "victim")
    letters = DeadLetters(root / DEAD_LETTER_NAME)
    letters.load()  # the link is not read as a list of batches either
    assert letters.skip == set()
    letters.add(0, 3, write=True, kind="nan")
    assert (outside / "victim").read_text() == "precious\n"
    assert (0, 3) in letters.skip  # still skipped in this process


def test_a_dead_letter_file_that_is_a_fifo_does_not_hang_the_start(root: Path) -> None:
    os.mkfifo(root / DEAD_LETTER_NAME)
    letters = DeadLetters(root / DEAD_LETTER_NAME)
    done = threading.Event()

    def load() -> None:
        letters.load()
        done.set()

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    assert done.wait(10), "reading a FIFO dead-letter file blocked"


def test_dead_letters_round_trip_through_a_regular_file(root: Path) -> None:
    writer = DeadLetters(root / DEAD_LETTER_NAME)
    writer.add(1, 7, write=True, kind="nan")
    writer.add(2, 0, write=True, kind="rolled-back window")
    reader = DeadLetters(root / DEAD_LETTER_NAME)
    reader.load()
    assert reader.skip == {(1, 7), (2, 0)}


def test_a_fault_ledger_planted_as_a_link_or_at_its_temp_name_is_never_written_through(
    root: Path, outside: Path
) -> None:
    (root / "faults-fired-rank0.json").symlink_to(outside / "victim")
    # the temp name used to be derived from the PID alone, so it could be planted in advance
    (root / f".faults-fired-rank0.json.{os.getpid()}.tmp").symlink_to(outside / "other")
    injector = FaultInjector(parse_faults("nan_loss@2"), rank=0, ledger_dir=root)
    from trainer_sidecar.guardian.faults import FaultKind

    assert injector.fires(FaultKind.NAN_LOSS, 2)
    assert (outside / "victim").read_text() == "precious\n"
    assert not (outside / "other").exists()


def test_a_forensics_folder_planted_as_a_link_is_neither_written_nor_pruned(
    root: Path, outside: Path
) -> None:
    for step in range(FORENSICS_KEEP + 3):
        (outside / f"step-{step:010d}-iter-{step:010d}-rank0.json").write_text("theirs")
    (root / FORENSICS_DIR).symlink_to(outside, target_is_directory=True)
    before = sorted(p.name for p in outside.iterdir())
    write_bundle(root, anomaly(99))
    assert sorted(p.name for p in outside.iterdir()) == before


def test_forensic_bundles_are_kept_to_the_newest(root: Path) -> None:
    for step in range(FORENSICS_KEEP + 3):
        write_bundle(root, anomaly(step))
    kept = sorted(p.name for p in (root / FORENSICS_DIR).iterdir())
    assert len(kept) == FORENSICS_KEEP
    assert kept[0].startswith("step-0000000003-")
