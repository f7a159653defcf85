"""A training loop in the shape of the popular minimal GPT scripts, guarded by trainguard (nanogpt_plain.py
is the same loop without it: ``diff nanogpt_plain.py nanogpt.py`` shows the changed lines).

Its own shape, kept on purpose: random windows drawn from a memmapped token file by a batch function
(prefetched one step ahead), a learning rate it writes into every param group each iteration (warmup and
cosine), nested gradient accumulation with DDP's ``require_backward_grad_sync`` toggle and the loss
divided by the micro-batches, a GradScaler (enabled for fp16 on a GPU), its own evaluation on the master
and its own ``torch.save`` of the best model. Run ``python examples/02_nanogpt_style/prepare.py`` first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import numpy as np
import torch
from gpt import GPT
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_sidecar import Guardian

parser = argparse.ArgumentParser()
parser.add_argument("--data-dir", default=str(Path(__file__).parent / "data"))
parser.add_argument("--out-dir", default="runs/02_nanogpt_style")
parser.add_argument("--max-iters", type=int, default=200)
parser.add_argument("--eval-interval", type=int, default=50)
parser.add_argument("--eval-iters", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--block-size", type=int, default=64)
parser.add_argument("--accumulation-steps", type=int, default=4)
parser.add_argument("--learning-rate", type=float, default=3e-3)
parser.add_argument("--min-lr", type=float, default=3e-4)
parser.add_argument("--warmup-iters", type=int, default=20)
parser.add_argument("--grad-clip", type=float, default=1.0)
parser.add_argument("--seed", type=int, default=1337)
args = parser.parse_args()

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group("gloo")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
else:
    rank, world_size = 0, 1
master_process = rank == 0
torch.manual_seed(args.seed + rank)
torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
device = "cuda" if torch.cuda.is_available() else "cpu"


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = np.memmap(os.path.join(args.data_dir, f"{split}.bin"), dtype=np.uint8, mode="r")
    ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + args.block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + args.block_size].astype(np.int64)) for i in ix])
    return x.to(device), y.to(device)


model: torch.nn.Module = GPT(block_size=args.block_size).to(device)
scaler = torch.amp.GradScaler(device, enabled=device == "cuda")
optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95))
raw_model = model
if ddp:
    model = DDP(model)
guardian = Guardian(model, optimizer, scaler=scaler)


@guardian.busy("eval")
@torch.no_grad()
def estimate_loss() -> dict[str, float]:
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            x, y = get_batch(split)
            _, loss = raw_model(x, y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it: int) -> float:
    peak, floor = float(args.learning_rate), float(args.min_lr)
    if it < args.warmup_iters:
        return peak * (it + 1) / (int(args.warmup_iters) + 1)
    ratio = min(1.0, (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters))
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - floor)


os.makedirs(args.out_dir, exist_ok=True)
best_val_loss = math.inf
losses_seen = []
iter_num = 0
X, Y = get_batch("train")
for iter_num in guardian.steps(args.max_iters):
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % args.eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
        if losses["val"] < best_val_loss:
            best_val_loss = losses["val"]
            torch.save({"model": raw_model.state_dict(), "iter_num": iter_num}, f"{args.out_dir}/best.pt")
    for micro_step in range(args.accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == args.accumulation_steps - 1
        _, loss = model(X, Y)
        loss = loss / args.accumulation_steps
        X, Y = get_batch("train")
        guardian.backward(loss)
    if args.grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    guardian.step()
    optimizer.zero_grad(set_to_none=True)
    losses_seen.append(loss.item() * args.accumulation_steps)

if master_process:
    print(json.dumps({"iter_num": guardian.step_count, "last_losses": losses_seen[-5:]}), flush=True)
if ddp:
    destroy_process_group()
