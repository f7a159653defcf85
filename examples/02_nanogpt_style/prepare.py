"""Write ``train.bin`` and ``val.bin`` (bytes of the Python standard library's source: every machine has
it) beside this script, the token files the training scripts memory-map."""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import numpy as np


def main() -> None:
    """Read the stdlib's top-level ``*.py`` files (sorted) up to a budget; hold out every 10th file."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    parser.add_argument("--budget-bytes", type=int, default=2_000_000)
    args = parser.parse_args()
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    total = 0
    for index, path in enumerate(files):
        if total >= args.budget_bytes:
            break
        text = path.read_bytes()
        parts["val" if index % 10 == 9 else "train"].append(text)
        total += len(text)
    args.out.mkdir(parents=True, exist_ok=True)
    for split, texts in parts.items():
        np.frombuffer(b"\n\n".join(texts), dtype=np.uint8).tofile(args.out / f"{split}.bin")
        print(f"{split}: {sum(map(len, texts))} bytes in {args.out / f'{split}.bin'}")


if __name__ == "__main__":
    main()
