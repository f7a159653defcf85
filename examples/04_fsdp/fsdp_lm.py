"""A small transformer language model sharded with FSDP2 (``fully_shard``) under the guardian.

    trainguard run examples/04_fsdp/job.yaml          # 2 workers, a NaN burst and a crash on the way
    torchrun --nproc-per-node 2 examples/04_fsdp/fsdp_lm.py --steps 60

The guardian call is the same as for one process or DDP (the lines marked ``# trainguard``): each rank
keeps only its shards of the weights, the gradients and the AdamW moments; the guardian takes the global
gradient norm over the shards in the step's one collective, skips a NaN on any rank's shard on every
rank, keeps snapshots of each rank's own shards, and writes sharded checkpoints (each rank its shards, no
gather) that resume at this world size or another. Rank 0 prints one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from trainer_sidecar import Guardian  # trainguard

VOCAB, WIDTH, SEQ = 64, 64, 16


class TinyLM(nn.Module):
    """Embedding, pre-norm transformer blocks, a head."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for block in self.blocks:
            hidden = block(hidden, src_mask=mask, is_causal=True)
        logits: torch.Tensor = self.head(hidden)
        return logits


def corpus(samples: int) -> list[torch.Tensor]:
    """Sequences of a simple rule (each token the previous plus a step, modulo the vocabulary)."""
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, VOCAB, (samples,), generator=generator)
    strides = torch.randint(1, 4, (samples,), generator=generator)
    return [(starts[i] + strides[i] * torch.arange(SEQ + 1)) % VOCAB for i in range(samples)]


def main() -> None:
    """Train to ``--steps``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLM(args.layers)
    if distributed:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guardian = Guardian(model, optimizer)  # trainguard
    loader = guardian.loader(corpus(4096), batch_size=args.batch_size, seed=0)  # trainguard
    losses: list[float] = []
    for tokens in guardian.run(loader, max_steps=args.steps):  # trainguard
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        outcome = guardian.step(loss)  # trainguard
        if outcome.applied:
            losses.append(float(outcome.loss))
    if guardian.rank == 0:
        print(
            json.dumps(
                {"step": guardian.step_count, "resumed_step": guardian.resumed_step, "losses": losses[-5:]}
            )
        )
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
