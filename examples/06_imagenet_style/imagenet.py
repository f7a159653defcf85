"""An image classifier trained in the shape of PyTorch's ImageNet example (pytorch/examples,
imagenet/main.py), guarded by trainguard (imagenet_plain.py is the same loop without it: ``diff
imagenet_plain.py imagenet.py`` shows the changed lines).

Its own shape, kept on purpose: ``main_worker`` with a global ``best_acc1``, DDP under torchrun (gloo,
on the CPU), a DistributedSampler with ``set_epoch`` every epoch, SGD with momentum and weight decay, a
StepLR stepped after each epoch, ``train()`` then ``validate()`` every epoch, ``save_checkpoint`` of the
loop's own (and ``model_best.pth.tar``) and ``--resume`` from it. Two changes from the original, so that it
runs in seconds on a CPU: a tiny convolutional network instead of a ResNet, and a small synthetic dataset
of 3x16x16 images (the labels a fixed function of their colour, so it learns) instead of ImageNet's
folders. The DistributedSampler is also used on one process (the original shuffles with a RandomSampler
there: its order is not a function of the epoch, so an epoch resumed mid-way would not be the same).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainer_sidecar import Guardian, Variables

parser = argparse.ArgumentParser(description="PyTorch ImageNet-shaped training")
parser.add_argument("--epochs", default=4, type=int, help="number of total epochs to run")
parser.add_argument("--start-epoch", default=0, type=int, help="manual epoch number (useful on restarts)")
parser.add_argument("-b", "--batch-size", default=8, type=int, help="mini-batch size per process")
parser.add_argument("--lr", default=0.1, type=float, help="initial learning rate")
parser.add_argument("--momentum", default=0.9, type=float, help="momentum")
parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
parser.add_argument("--step-size", default=2, type=int, help="epochs between decays of the learning rate")
parser.add_argument("-p", "--print-freq", default=100, type=int, help="print frequency")
parser.add_argument("--resume", default="", type=str, help="path to the latest checkpoint")
parser.add_argument("--seed", default=0, type=int, help="seed for initializing training")
parser.add_argument("--train-samples", default=128, type=int, help="synthetic training images")
parser.add_argument("--val-samples", default=64, type=int, help="synthetic validation images")
parser.add_argument("--out-dir", default="runs/06_imagenet_style", help="where checkpoints are saved")

best_acc1: Any = 0


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """Noisy images of 3x16x16 in one colour each, whose class (of 4) is a fixed function of the colour."""

    def __init__(self, samples: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        colours = torch.randn(samples, 3, generator=generator)
        self.images = colours[:, :, None, None] + 0.5 * torch.randn(samples, 3, 16, 16, generator=generator)
        weights = torch.randn(3, 4, generator=torch.Generator().manual_seed(1234))
        self.targets = (colours @ weights).argmax(1)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.targets[index])


def tiny_convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    )


def main() -> None:
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.rank = int(os.environ.get("RANK", "0"))
    args.distributed = args.world_size > 1
    main_worker(args)


def main_worker(args: argparse.Namespace) -> None:
    global best_acc1
    if args.distributed:
        dist.init_process_group(backend="gloo", init_method="env://")
    model: nn.Module = tiny_convnet()
    if args.distributed:
        model = nn.parallel.DistributedDataParallel(model)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(
        model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    # Sets the learning rate to the initial LR decayed by 10 every step_size epochs.
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.step_size, gamma=0.1)
    # optionally resume from a checkpoint
    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume, weights_only=False)
        args.start_epoch = checkpoint["epoch"]
        best_acc1 = checkpoint["best_acc1"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        print(f"=> loaded checkpoint '{args.resume}' (epoch {checkpoint['epoch']})", flush=True)
    train_dataset = SyntheticImages(args.train_samples, seed=1)
    val_dataset = SyntheticImages(args.val_samples, seed=2)
    train_sampler: DistributedSampler[Any] = DistributedSampler(
        train_dataset, num_replicas=args.world_size, rank=args.rank, seed=args.seed
    )
    val_sampler: DistributedSampler[Any] = DistributedSampler(
        val_dataset, num_replicas=args.world_size, rank=args.rank, shuffle=False, drop_last=True
    )
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    val_loader = DataLoader(val_dataset, batch_size=args.batch_size, sampler=val_sampler)
    accuracies = []
    guardian = args.guardian = Guardian(model, optimizer)  # train() reaches it through args
    guardian.track(scheduler=scheduler, best_acc1=Variables(globals(), "best_acc1"))
    for epoch in guardian.epochs(args.epochs, start=args.start_epoch):
        train_sampler.set_epoch(epoch)
        # train for one epoch
        train(train_loader, model, criterion, optimizer, epoch, args)
        # evaluate on validation set
        acc1 = validate(val_loader, model, criterion, args)
        accuracies.append(float(acc1))
        scheduler.step()
        # remember best acc@1 and save checkpoint
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        if args.rank == 0:
            save_checkpoint(
                {
                    "epoch": epoch + 1,
                    "state_dict": model.state_dict(),
                    "best_acc1": best_acc1,
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                },
                is_best,
                args.out_dir,
            )
    if args.rank == 0:
        print(json.dumps(summary(model, optimizer, scheduler, accuracies)), flush=True)
    if args.distributed:
        dist.destroy_process_group()


def train(
    train_loader: DataLoader[Any],
    model: nn.Module,
    criterion: nn.Module,
    optimizer: torch.optim.Optimizer,
    epoch: int,
    args: argparse.Namespace,
) -> None:
    losses = AverageMeter("Loss")
    top1 = AverageMeter("Acc@1")
    # switch to train mode
    model.train()
    for i, (images, target) in enumerate(args.guardian.batches(train_loader)):
        # compute output
        output = model(images)
        loss = criterion(output, target)
        # measure accuracy and record loss
        losses.update(loss.item(), images.size(0))
        top1.update(accuracy(output, target), images.size(0))
        # compute gradient and do SGD step
        optimizer.zero_grad()
        args.guardian.step(loss)
        if i % args.print_freq == 0:
            print(f"Epoch: [{epoch}][{i}] {losses} {top1}", flush=True)


def validate(
    val_loader: DataLoader[Any], model: nn.Module, criterion: nn.Module, args: argparse.Namespace
) -> Any:
    top1 = AverageMeter("Acc@1")
    # switch to evaluate mode
    model.eval()
    with torch.no_grad():
        for images, target in val_loader:
            output = model(images)
            top1.update(accuracy(output, target), images.size(0))
    if args.distributed:
        top1.all_reduce()
    print(f" * Acc@1 {top1.avg:.3f}", flush=True)
    return top1.avg


def save_checkpoint(state: dict[str, Any], is_best: bool, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    filename = os.path.join(out_dir, "checkpoint.pth.tar")
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, os.path.join(out_dir, "model_best.pth.tar"))


class AverageMeter:
    """Computes and stores the average and current value."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sum = 0.0
        self.count = 0
        self.avg = 0.0

    def update(self, val: float, n: int = 1) -> None:
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def all_reduce(self) -> None:
        total = torch.tensor([self.sum, self.count], dtype=torch.float64)
        dist.all_reduce(total, dist.ReduceOp.SUM, async_op=False)
        self.sum, self.count = float(total[0]), int(total[1])
        self.avg = self.sum / self.count

    def __str__(self) -> str:
        return f"{self.name} {self.avg:.4f}"


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    """The top-1 accuracy of ``output`` for ``target``, in percent."""
    return float((output.argmax(1) == target).float().mean()) * 100.0


def summary(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, accuracies: list[float]
) -> dict[str, Any]:
    tensors = model.state_dict().values()
    weights = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in tensors)).hexdigest()
    return {
        "weights": weights,
        "lr": optimizer.param_groups[0]["lr"],
        "scheduler": {"last_epoch": scheduler.last_epoch, "last_lr": scheduler.get_last_lr()},
        "best_acc1": float(best_acc1),
        "accuracies": accuracies,
    }


if __name__ == "__main__":
    main()
