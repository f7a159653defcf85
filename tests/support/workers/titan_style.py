"""The FSDP2 model of ``fsdp_train.py`` trained by a plain loop (no guardian) and saved the way
torchtitan saves: ``torch.distributed.checkpoint`` from every rank, the model's entries at the top level,
the optimizer flattened by torch's state-dict API, a ``train_state`` with the step and a pickled loss
history, and a scheduler's state beside them.

Run as one rank of a gloo gang (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) from the repository root
(``python -m tests.support.workers.titan_style --steps N --out DIR``). Prints one JSON line: the SHA-256
of the full model and optimizer state (as ``fsdp_train.py`` computes it) and the probe loss at the end.
"""

from __future__ import annotations

import argparse
import io
import json

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tests.support.workers.fsdp_train import (
    build,
    digest,
    exit_skipping_teardown,
    full,
    lm_loss,
    make_dataset,
    probe_loss,
    state_tensors,
)


def main() -> int:
    """Train, save, report (see the module's docstring)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build("fsdp", world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    samples = make_dataset(512, 0)
    for step in range(args.steps):
        batch = torch.stack([samples[(step * world_size + rank) * 4 + i][0] for i in range(4)])
        torch.autograd.backward(lm_loss(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    losses = io.BytesIO()
    torch.save([3.9, 3.8], losses)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    states = {
        **get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=flat),
        "train_state": {"step": torch.tensor(args.steps, dtype=torch.int32), "global_avg_losses": losses},
        "lr_scheduler": {"last_epoch": args.steps},
    }
    dcp_save(states, checkpoint_id=args.out)
    report = {
        "rank": rank,
        "probe_end": probe_loss(model),
        "digest": digest([full(t) for t in state_tensors(model, optimizer)]),
    }
    print(json.dumps(report), flush=True)
    exit_skipping_teardown()


if __name__ == "__main__":
    raise SystemExit(main())
