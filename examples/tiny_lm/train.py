"""Train a tiny byte-level transformer language model on the Python standard library, guarded by trainguard.

Single process::

    python examples/tiny_lm/train.py --max-steps 400

Several processes on one machine (gloo, DistributedDataParallel)::

    torchrun --nproc-per-node 2 examples/tiny_lm/train.py

The five lines marked ``# trainguard`` are the adoption: they replace the DataLoader, the epoch loop
and backward/step/zero_grad of a plain PyTorch loop (the progress log and the summary merely read the
Guardian's counters). Rerunning with the same ``--checkpoint-dir`` resumes from the newest clean
checkpoint at the exact next batch. On rank 0 the last line on stdout is one JSON object summarising
the run. Exit codes: 0 done, 2 configuration error, 200 diverged (the Guardian's own SystemExits).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from data import ByteWindows, load_corpus
from model import ModelConfig, TinyLM, count_parameters, lm_loss
from torch.nn.parallel import DistributedDataParallel

from trainer_sidecar import Guardian  # trainguard

log = logging.getLogger("tiny_lm")

CHECKPOINT_DIR_ENV = "TRAINGUARD_CHECKPOINT_DIR"
DEFAULT_CHECKPOINT_DIR = "./runs/tiny_lm/ckpt"
# What torch's env:// rendezvous needs. torchrun sets LOCAL_RANK too, the Kubeflow training operator does
# not (one process per pod), so it is not required.
DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; every default is chosen so one process on two threads finishes in about a minute."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=os.environ.get(CHECKPOINT_DIR_ENV) or DEFAULT_CHECKPOINT_DIR,
        help=f"where clean checkpoints go (default: ${CHECKPOINT_DIR_ENV} or {DEFAULT_CHECKPOINT_DIR})",
    )
    parser.add_argument("--max-steps", type=int, default=400, help="training steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=32, help="windows per step and rank")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay of weight matrices")
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: max-steps/10, at most 50")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model, the data order and every RNG")
    parser.add_argument("--log-every", type=int, default=50, help="log a progress line every N steps")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: cores/ranks)")
    parser.add_argument("--context", type=int, default=64, help="bytes per training window")
    parser.add_argument("--d-model", type=int, default=128, help="model width")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--budget-bytes", type=int, default=3_000_000, help="stdlib source bytes to read")
    parser.add_argument("--eval-batches", type=int, default=8, help="held-out batches per validation")
    args = parser.parse_args(argv)
    for name in ("max_steps", "batch_size", "log_every", "eval_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def init_distributed() -> tuple[int, int]:
    """Join the process group when launched by torchrun, a PyTorchJob, or ``trainguard run``; (rank, world).

    A launch that asks for more than one rank but lacks the rendezvous variables is an error, not a
    silent single-process run (every pod would train alone and overwrite the others' checkpoints).
    """
    if all(name in os.environ for name in DISTRIBUTED_ENV):
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        missing = [name for name in DISTRIBUTED_ENV if name not in os.environ]
        raise SystemExit(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} not set")
    return 0, 1


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def default_threads() -> int:
    """The machine's cores shared evenly among the ranks on this machine."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


def warmup_cosine(warmup_steps: int, total_steps: int, floor: float = 0.1) -> Callable[[int], float]:
    """LR factor: linear warmup to 1 over ``warmup_steps``, then cosine to ``floor`` at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW that decays weight matrices and embeddings but not biases or LayerNorm gains."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def make_validate(model: TinyLM, heldout: ByteWindows, batches: int, batch_size: int) -> Callable[[], float]:
    """A callable returning the mean loss on fixed held-out windows (spread over the held-out text)."""
    count = min(len(heldout), batches * batch_size)
    indices = [round(i * (len(heldout) - 1) / max(1, count - 1)) for i in range(count)]
    inputs, targets = heldout.batch(indices)

    def validate() -> float:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                losses = [
                    lm_loss(model(x), y)
                    for x, y in zip(
                        torch.split(inputs, batch_size), torch.split(targets, batch_size), strict=True
                    )
                ]
        finally:
            model.train(was_training)
        return float(torch.stack(losses).mean())

    return validate


def total_across_ranks(value: int) -> int:
    """``value`` summed over every rank (just ``value`` without a process group)."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor)
    return int(tensor.item())


def train(args: argparse.Namespace, rank: int, world_size: int) -> dict[str, float | int]:
    """Build data, model and optimizer, train under the Guardian, and return the run's summary."""
    seed_everything(args.seed)
    corpus = load_corpus(args.budget_bytes)
    train_set = ByteWindows(corpus.train, args.context)
    heldout_set = ByteWindows(corpus.heldout, args.context)
    if rank == 0:
        log.info(
            "corpus: %d train bytes from %d files, %d held-out bytes from %d files under %s",
            len(corpus.train),
            len(corpus.train_files),
            len(corpus.heldout),
            len(corpus.heldout_files),
            corpus.source,
        )

    config = ModelConfig(context=args.context, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    net = TinyLM(config)
    model: torch.nn.Module = DistributedDataParallel(net) if world_size > 1 else net
    opt = make_optimizer(net, args.lr, args.weight_decay)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, min(50, args.max_steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup, args.max_steps))
    validate = make_validate(net, heldout_set, args.eval_batches, args.batch_size)
    ckpt = args.checkpoint_dir
    if rank == 0:
        log.info("model: %d parameters, %s; %d ranks", count_parameters(net), config, world_size)

    guardian = Guardian(model, opt, scheduler=sched, checkpoint_dir=ckpt, validate=validate)  # trainguard
    loader = guardian.loader(train_set, batch_size=args.batch_size, seed=args.seed)  # trainguard
    if rank == 0 and guardian.step_count == 0:
        # After a resume the guardian has just evaluated (and logged) the held-out loss itself; a second
        # pass would only delay the first step of a recovery.
        log.info("step %d held-out loss %.4f (ln 256 = %.4f)", guardian.step_count, validate(), math.log(256))

    last_time, last_iterations = time.perf_counter(), guardian.iterations
    for inputs, targets in guardian.run(loader, max_steps=args.max_steps):  # trainguard
        loss = lm_loss(model(inputs), targets)
        outcome = guardian.step(loss)  # trainguard
        if rank == 0 and outcome.applied and guardian.step_count % args.log_every == 0:
            now = time.perf_counter()
            rate = (guardian.iterations - last_iterations) / max(now - last_time, 1e-9)
            last_time, last_iterations = now, guardian.iterations
            log.info(
                "step %d loss %.4f steps/s %.2f skipped %d rollbacks %d",
                guardian.step_count,
                outcome.loss,
                rate,
                guardian.skipped_steps,
                guardian.rollbacks,
            )

    recent = list(guardian.losses)[-10:]
    train_loss = sum(recent) / len(recent) if recent else math.nan
    dropped = total_across_ranks(loader.counters.dropped)
    return {
        "final_step": guardian.step_count,
        "train_loss": round(train_loss, 4),
        "heldout_loss": round(validate(), 4) if rank == 0 else math.nan,
        "skipped_steps": guardian.skipped_steps,
        "rollbacks": guardian.rollbacks,
        "samples_dropped": dropped,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run training; rank 0 prints the summary as the last line on stdout. Returns the exit code (0).

    The Guardian's own exits (ConfigError: 2, Diverged: 200) propagate as SystemExit.
    """
    args = parse_args(argv)
    rank, world_size = init_distributed()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    torch.set_num_threads(args.threads or default_threads())
    try:
        started = time.perf_counter()
        summary = train(args, rank, world_size)
        if rank == 0:
            log.info("done in %.1f s", time.perf_counter() - started)
            print(json.dumps(summary), flush=True)
        if dist.is_initialized():
            dist.barrier()  # leave together: tearing gloo down under a busy peer can abort it
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
