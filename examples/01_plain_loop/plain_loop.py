"""The smallest adoption: a plain PyTorch loop over a DataLoader, guarded by three lines and an import.

A regression of noisy features onto targets, a DataLoader that shuffles, an epoch loop, a scheduler. The
lines marked ``# trainguard`` are the adoption: ``guardian.run`` takes the DataLoader over (its order
becomes resumable and sharded) and yields its batches until ``max_steps``, and ``guardian.step(loss)``
replaces ``backward()``, ``optimizer.step()``, ``scheduler.step()`` and ``zero_grad()``. Rerunning with
the same ``--checkpoint-dir`` resumes at the exact next batch. The last line on stdout is a JSON summary.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainer_sidecar import Guardian  # trainguard


def main() -> None:
    """Train for ``--steps`` steps."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--checkpoint-dir", default=None, help="default: $TRAINGUARD_CHECKPOINT_DIR")
    args = parser.parse_args()
    torch.manual_seed(0)
    features = torch.randn(4096, 16)
    targets = features @ torch.randn(16, 1) + 0.1 * torch.randn(4096, 1)
    loader = DataLoader(TensorDataset(features, targets), batch_size=64, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)

    guardian = Guardian(
        model, optimizer, scheduler=scheduler, checkpoint_dir=args.checkpoint_dir
    )  # trainguard
    for x, y in guardian.run(
        loader, max_steps=args.steps
    ):  # trainguard (was: for epoch...: for x, y in loader:)
        loss = torch.nn.functional.mse_loss(model(x), y)
        guardian.step(loss)  # trainguard (was: backward, optimizer.step, scheduler.step, zero_grad)

    print(
        json.dumps({"step": guardian.step_count, "loss": guardian.last_loss, "rollbacks": guardian.rollbacks})
    )


if __name__ == "__main__":
    main()
