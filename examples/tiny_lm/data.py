"""Real text that every machine has without a download: the Python standard library's own source.

``load_corpus`` reads a sorted selection of the standard library's top-level ``*.py`` files up to a
byte budget and splits it by file into a training and a held-out part (every ``heldout_every``-th
file is held out, so the held-out text is code the model never trained on). ``ByteWindows`` turns
a byte string into a map-style dataset of fixed, non-overlapping windows: item ``i`` is
``(input, target)``, two LongTensors of ``context`` bytes, the target shifted by one.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_BUDGET_BYTES = 3_000_000
FILE_SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class Corpus:
    """The training and held-out text, and which files they came from."""

    train: bytes
    heldout: bytes
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]
    source: Path


def stdlib_dir() -> Path:
    """The directory of this interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """The standard library's top-level ``*.py`` files, sorted by name (deterministic per Python version).

    Only the top level: it holds no ``site-packages`` (installed packages differ between machines)
    and no test data.
    """
    directory = root if root is not None else stdlib_dir()
    return sorted(path for path in directory.glob("*.py") if path.is_file())


def load_corpus(
    budget_bytes: int = DEFAULT_BUDGET_BYTES, heldout_every: int = 10, root: Path | None = None
) -> Corpus:
    """Read sorted stdlib sources up to ``budget_bytes`` and split them by file into train and held-out.

    The last file read is cut at the budget. Raises RuntimeError if either part ends up empty.
    """
    if budget_bytes < 1 or heldout_every < 2:
        raise ValueError("budget_bytes must be positive and heldout_every at least 2")
    files = stdlib_sources(root)
    train: list[bytes] = []
    heldout: list[bytes] = []
    train_names: list[str] = []
    heldout_names: list[str] = []
    remaining = budget_bytes
    for number, path in enumerate(files):
        if remaining <= 0:
            break
        text = path.read_bytes()[:remaining]
        remaining -= len(text)
        if number % heldout_every == heldout_every - 1:
            heldout.append(text)
            heldout_names.append(path.name)
        else:
            train.append(text)
            train_names.append(path.name)
    if not train or not heldout:
        raise RuntimeError(f"too few source files under {root or stdlib_dir()} for a train/held-out split")
    return Corpus(
        train=FILE_SEPARATOR.join(train),
        heldout=FILE_SEPARATOR.join(heldout),
        train_files=tuple(train_names),
        heldout_files=tuple(heldout_names),
        source=root if root is not None else stdlib_dir(),
    )


class ByteWindows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of a byte string: item ``i`` covers bytes ``[i*context, (i+1)*context]``.

    Returns ``(input, target)``: LongTensors of length ``context``, ``target`` shifted one byte
    ahead of ``input``.
    """

    def __init__(self, text: bytes, context: int) -> None:
        if context < 1:
            raise ValueError(f"context must be at least 1, got {context}")
        if len(text) < context + 1:
            raise ValueError(f"{len(text)} bytes are too few for one window of {context} + 1")
        self.bytes = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self.context = context

    def __len__(self) -> int:
        return (len(self.bytes) - 1) // self.context

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = index * self.context
        chunk = self.bytes[start : start + self.context + 1].long()
        return chunk[:-1], chunk[1:]

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Several windows stacked into ``(inputs, targets)`` of shape (len(indices), context)."""
        pairs = [self[i] for i in indices]
        return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])
