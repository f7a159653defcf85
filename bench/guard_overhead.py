"""Per-step overhead of the Guardian against a plain training step and a naive per-parameter guard.

Three copies of the same ~10M-parameter transformer language model (identical initial weights, AdamW,
the same input batch) are trained side by side, one step of each per repetition, the order rotated
every repetition so that no variant always runs first:

* plain:   forward, backward, ``optimizer.step()``, ``zero_grad()``;
* guarded: forward, ``Guardian.step(loss)`` (backward, one fused clip that returns the total norm, one
  finiteness check, one host sync, the skip/step decision, ``optimizer.step()``, ``zero_grad()``);
* naive:   the plain step with the seeds' guard before ``optimizer.step()``: per parameter,
  ``isnan(grad).any()``, ``isinf(grad).any()`` and ``grad.norm()``, each read back to Python.

The guardian runs as in production, with a status file and a checkpoint directory, and with snapshot
and checkpoint intervals beyond the run, so the timed region holds only the per-step guard; one
in-memory snapshot is timed separately and reported amortised over the default snapshot interval.

A second case trains a small model (a step of tens of milliseconds) plain and guarded side by side with
checkpoints every 25 steps and snapshots every 10, every cost of those in the timed steps
(``checkpointing_case``; ``--checkpointing-only`` runs it alone).

The straggler measurement (each rank's own compute per step, from the activity marks) is timed apart,
side by side with the same marks without it (``compute_measurement_case``), and set against the small
model's guarded step.

Run ``python -m bench.guard_overhead`` (``--quick`` for a smoke test). The last line printed is JSON.
Goals: ``guarded_over_plain <= 1.03``; with checkpoints, ``checkpointing_guarded_over_plain_total <= 1.02``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from trainer_sidecar import CheckpointPolicy, Guardian, GuardianSettings, GuardThresholds
from trainer_sidecar.contract.compute import ComputeWindow
from trainer_sidecar.contract.status import Activity
from trainer_sidecar.guardian.activity import ActivityTracker
from trainer_sidecar.guardian.snapshot import Snapshot

# The guardian reads these when an argument is missing; none may leak into the benchmark.
_GUARDIAN_ENV = (
    "TRAINGUARD_CHECKPOINT_DIR",
    "TRAINGUARD_STATUS_FILE",
    "TRAINGUARD_FAULTS",
    "TRAINGUARD_REMEDIATION",
    "TRAINGUARD_SETTINGS",
)
_NEVER = 10**9  # a snapshot or checkpoint interval no run reaches


@dataclass(frozen=True)
class ModelShape:
    """Size of the benchmark language model and of its input batch."""

    vocab: int
    embed: int
    layers: int
    heads: int
    seq: int
    batch: int


FULL = ModelShape(vocab=4096, embed=384, layers=4, heads=6, seq=128, batch=8)
#: A small model whose step takes tens of milliseconds: where a per-forward cost (the random generators'
#: state, read for checkpoints) shows.
SMALL = ModelShape(vocab=1024, embed=128, layers=2, heads=4, seq=64, batch=8)
QUICK = ModelShape(vocab=512, embed=64, layers=2, heads=2, seq=32, batch=4)


class TinyLM(nn.Module):
    """A small causal transformer language model (pre-norm encoder layers with a causal mask)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.embed)
        self.position = nn.Parameter(torch.randn(shape.seq, shape.embed) * 0.02)
        layer = nn.TransformerEncoderLayer(
            shape.embed,
            shape.heads,
            dim_feedforward=4 * shape.embed,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, shape.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(shape.embed)
        self.head = nn.Linear(shape.embed, shape.vocab, bias=False)
        # Not persistent: the causal mask holds -inf, which a checkpoint of the state would refuse.
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(shape.seq), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab)."""
        hidden = self.embed(tokens) + self.position[: tokens.shape[1]]
        hidden = self.blocks(hidden, mask=self.mask, is_causal=True)
        logits: torch.Tensor = self.head(self.norm(hidden))
        return logits


def lm_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``model`` on one batch."""
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def naive_guard(model: nn.Module) -> tuple[bool, float]:
    """The seeds' guard: per parameter, a NaN check, an Inf check and a norm, each synced to the host."""
    finite = True
    total_sq = 0.0
    for param in model.parameters():
        grad = param.grad
        if grad is None:
            continue
        if torch.isnan(grad).any().item():
            finite = False
        if torch.isinf(grad).any().item():
            finite = False
        total_sq += grad.norm().item() ** 2
    return finite, math.sqrt(total_sq)


@dataclass
class Variant:
    """One way of taking a training step, with its own model, optimizer and timings."""

    name: str
    model: nn.Module
    step: Callable[[], None]
    times: list[float] = field(default_factory=list)  # wall-clock seconds per timed step


@dataclass(frozen=True)
class Batch:
    """The one input batch every variant trains on."""

    tokens: torch.Tensor
    targets: torch.Tensor


def build_variants(
    shape: ModelShape, lr: float, seed: int, status_file: Path
) -> tuple[list[Variant], Guardian, Batch]:
    """Three identical models and optimizers wrapped in the plain, guarded and naive steps.

    The guardian publishes its status file as in production (rate-limited), and has a checkpoint
    directory (its random generators are captured after every forward pass, for an exact resume of a loop
    that draws its own batches), so those costs are measured; no checkpoint falls due within the run.
    """
    torch.manual_seed(seed)
    base = TinyLM(shape)
    generator = torch.Generator().manual_seed(seed + 1)
    data = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=generator)
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = copy.deepcopy(base)
        return model, torch.optim.AdamW(model.parameters(), lr=lr)

    plain_model, plain_opt = fresh()
    guarded_model, guarded_opt = fresh()
    naive_model, naive_opt = fresh()

    settings = GuardianSettings(
        # Spike detection stays on but cannot fire on a benign run: every step must do the same work.
        guard=GuardThresholds(loss_spike_factor=1e6, grad_norm_spike_factor=1e6),
        checkpoint=CheckpointPolicy(every_steps=_NEVER, snapshot_every_steps=_NEVER, every_seconds=None),
    )
    guardian = Guardian(
        guarded_model,
        guarded_opt,
        checkpoint_dir=status_file.parent / "checkpoints",
        status_file=status_file,
        settings=settings,
        resume=False,
    )

    def plain() -> None:
        loss = lm_loss(plain_model, tokens, targets)
        torch.autograd.backward(loss)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    def guarded() -> None:
        guardian.step(lm_loss(guarded_model, tokens, targets))

    def naive() -> None:
        loss = lm_loss(naive_model, tokens, targets)
        torch.autograd.backward(loss)
        finite, _norm = naive_guard(naive_model)
        if finite and math.isfinite(loss.item()):
            naive_opt.step()
        naive_opt.zero_grad(set_to_none=True)

    variants = [
        Variant("plain", plain_model, plain),
        Variant("guarded", guarded_model, guarded),
        Variant("naive", naive_model, naive),
    ]
    return variants, guardian, Batch(tokens, targets)


#: The checkpointing case's cadence: a checkpoint every 25 steps, a snapshot every 10.
CHECKPOINT_EVERY, SNAPSHOT_EVERY = 25, 10


def checkpointing_case(
    shape: ModelShape, lr: float, seed: int, directory: Path, warmup: int, repetitions: int
) -> dict[str, float]:
    """Plain against guarded with checkpoints and snapshots on (every ``CHECKPOINT_EVERY`` and
    ``SNAPSHOT_EVERY`` steps) on a small model, interleaved step by step; every cost of the guarded loop
    is in its timed steps (the snapshots, the checkpoints' copies and their writes in the background, the
    random generators kept for them). Returns the medians and the ratio of the total times (which
    charges the periodic snapshots and checkpoints to the steps they happen at)."""
    torch.manual_seed(seed)
    base = TinyLM(shape)
    generator = torch.Generator().manual_seed(seed + 1)
    data = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=generator)
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    plain_model, guarded_model = copy.deepcopy(base), copy.deepcopy(base)
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=lr)
    settings = GuardianSettings(
        guard=GuardThresholds(loss_spike_factor=1e6, grad_norm_spike_factor=1e6),
        checkpoint=CheckpointPolicy(every_steps=CHECKPOINT_EVERY, snapshot_every_steps=SNAPSHOT_EVERY),
    )
    guardian = Guardian(
        guarded_model,
        torch.optim.AdamW(guarded_model.parameters(), lr=lr),
        checkpoint_dir=directory / "checkpoints",
        status_file=directory / "status.json",
        settings=settings,
        resume=False,
    )

    def plain() -> None:
        torch.autograd.backward(lm_loss(plain_model, tokens, targets))
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    def guarded() -> None:
        guardian.step(lm_loss(guarded_model, tokens, targets))

    variants = [Variant("plain", plain_model, plain), Variant("guarded", guarded_model, guarded)]
    run_interleaved(variants, warmup, repetitions)
    guardian.close()
    plain_times, guarded_times = variants[0].times, variants[1].times
    result = {
        "plain_median_s": statistics.median(plain_times),
        "guarded_median_s": statistics.median(guarded_times),
        "guarded_over_plain_total": sum(guarded_times) / sum(plain_times),
        "guarded_over_plain_paired": statistics.median(
            g / p for g, p in zip(guarded_times, plain_times, strict=True)
        ),
        "checkpoints": (guardian.step_count // CHECKPOINT_EVERY),
    }
    print(
        f"  plain {result['plain_median_s'] * 1e3:.2f} ms, guarded {result['guarded_median_s'] * 1e3:.2f} ms "
        f"(medians); guarded/plain: total time x{result['guarded_over_plain_total']:.4f}, median of "
        f"per-step ratios x{result['guarded_over_plain_paired']:.4f}; {result['checkpoints']} checkpoints"
    )
    return result


#: The activities one guarded step of a gang passes through, in order (``Guardian.backward`` and
#: ``Guardian.step``): what the straggler measurement sums its own work over.
STEP_MARKS = (
    Activity.BACKWARD,
    Activity.LOOP,
    Activity.STEP,
    Activity.COLLECTIVE,
    Activity.STEP,
    Activity.LOOP,
)


class _UnmeasuredTracker:
    """``ActivityTracker`` as it was before it summed the rank's own work: the baseline."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: tuple[Activity, float] = (Activity.LOOP, time.time())

    def mark(self, activity: Activity) -> Activity:
        previous = self.current[0]
        if activity is not previous:
            self.current = (activity, time.time())
        return previous


def compute_measurement_case(steps: int, batches: int) -> dict[str, float]:
    """What the straggler measurement adds to a step, timed side by side with the same marks without it:
    a step's activity marks on ``ActivityTracker`` (summing own work) plus ``ComputeWindow.lap``, against
    the marks on a tracker that does not sum; the fastest of ``batches`` batches of ``steps`` steps each,
    in nanoseconds a step. The window's median, read once per status write (at most twice a second), is
    timed apart."""
    measured, window = ActivityTracker(), ComputeWindow()
    baseline = _UnmeasuredTracker()

    def run_measured() -> None:
        mark, lap = measured.mark, window.lap
        for _ in range(steps):
            for activity in STEP_MARKS:
                mark(activity)
            lap(measured.own)

    def run_baseline() -> None:
        mark = baseline.mark
        for _ in range(steps):
            for activity in STEP_MARKS:
                mark(activity)

    times: dict[str, list[float]] = {"measured": [], "baseline": []}
    for rep in range(batches):
        pair = [("measured", run_measured), ("baseline", run_baseline)]
        for name, run in pair if rep % 2 == 0 else pair[::-1]:
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / steps)
    start = time.perf_counter()
    for _ in range(steps):
        window.reading()
    reading_s = (time.perf_counter() - start) / steps
    result = {
        "marks_ns": min(times["baseline"]) * 1e9,
        "added_ns": (min(times["measured"]) - min(times["baseline"])) * 1e9,
        "reading_ns": reading_s * 1e9,
    }
    print(
        f"  a step's marks {result['marks_ns']:.0f} ns without the measurement; the measurement adds "
        f"{result['added_ns']:.0f} ns a step, and {result['reading_ns']:.0f} ns a status write"
    )
    return result


def run_interleaved(variants: Sequence[Variant], warmup: int, repetitions: int) -> None:
    """Warm up, then time one step of every variant per repetition, rotating which one goes first."""
    for _ in range(warmup):
        for variant in variants:
            variant.step()
    for rep in range(repetitions):
        shift = rep % len(variants)
        for variant in [*variants[shift:], *variants[:shift]]:
            start = time.perf_counter()
            variant.step()
            variant.times.append(time.perf_counter() - start)


def guard_breakdown(
    model: nn.Module, batch: Batch, max_norm: float, repetitions: int
) -> dict[str, list[float]]:
    """Time the pieces of the guard on real gradients of ``model``, one fresh backward per repetition.

    The pieces are what ``Guardian.step`` adds to a plain step (the total norm, the clipping multiply,
    the finiteness flag and the one host sync) and, for comparison, the naive per-parameter guard.
    ``model``'s gradients are cleared afterwards; its weights are not touched.
    """
    params = list(model.parameters())
    pieces: dict[str, list[float]] = {
        "total norm (foreach)": [],
        "clip multiply (foreach)": [],
        "finite flag + stack + host sync": [],
        "naive per-parameter guard": [],
    }
    timers = list(pieces.values())
    for _ in range(repetitions):
        model.zero_grad(set_to_none=True)
        loss = lm_loss(model, batch.tokens, batch.targets)
        torch.autograd.backward(loss)
        grads = [p.grad for p in params if p.grad is not None]
        marks = [time.perf_counter()]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        marks.append(time.perf_counter())
        detached = loss.detach().float()
        flag = (~torch.isfinite(detached)).float()
        torch.stack([detached, flag, norm.float()]).tolist()
        marks.append(time.perf_counter())
        naive_guard(model)
        marks.append(time.perf_counter())
        for timer, begin, end in zip(timers, marks, marks[1:], strict=False):
            timer.append(end - begin)
    model.zero_grad(set_to_none=True)
    return pieces


def time_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, repetitions: int) -> tuple[float, int]:
    """Median seconds of one warm in-memory snapshot of ``model`` and ``optimizer``, and its bytes."""
    snapshot = Snapshot()
    snapshot.capture(0, model, optimizer, {}, {})  # allocates the buffers
    times = []
    for i in range(repetitions):
        start = time.perf_counter()
        snapshot.capture(i, model, optimizer, {}, {})
        times.append(time.perf_counter() - start)
    return statistics.median(times), snapshot.nbytes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repetitions", type=int, default=30, help="timed steps per variant (default 30)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per variant (default 3)")
    parser.add_argument("--quick", action="store_true", help="tiny model and few repetitions (smoke test)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: 2, or OMP_NUM_THREADS)"
    )
    parser.add_argument(
        "--checkpointing-repetitions",
        type=int,
        default=200,
        help="timed steps of the checkpointing case (default 200: 8 checkpoints, 20 snapshots)",
    )
    parser.add_argument("--checkpointing-only", action="store_true", help="run the checkpointing case alone")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.repetitions = min(args.repetitions, 5)
        args.checkpointing_repetitions = min(args.checkpointing_repetitions, CHECKPOINT_EVERY)
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.repetitions < 1:
        parser.error("--repetitions must be at least 1")
    return args


def _ratio_lines(variants: Sequence[Variant]) -> dict[str, float]:
    """Print each variant's figures; return the alternative (less load-sensitive) guarded ratios."""
    plain = variants[0]
    plain_median = statistics.median(plain.times)
    for variant in variants:
        times = sorted(variant.times)
        median = statistics.median(times)
        q1, q3 = times[len(times) // 4], times[(3 * len(times)) // 4]
        print(
            f"  {variant.name:8s} median {median * 1e3:8.1f} ms  (IQR {q1 * 1e3:.1f}-{q3 * 1e3:.1f}, "
            f"min {times[0] * 1e3:.1f} ms)  "
            f"x{median / plain_median:.4f} plain"
        )
    alternatives: dict[str, float] = {}
    for variant in variants[1:]:
        # Paired: the same repetition, adjacent in time, so a load burst hits both sides alike.
        paired = statistics.median(t / p for t, p in zip(variant.times, plain.times, strict=True))
        # Fastest over fastest: the closest to an idle machine that a busy one offers.
        fastest = min(variant.times) / min(plain.times)
        print(
            f"  {variant.name}/plain: median of per-repetition ratios x{paired:.4f}, "
            f"fastest over fastest x{fastest:.4f}"
        )
        alternatives[f"{variant.name}_over_plain_paired"] = paired
        alternatives[f"{variant.name}_over_plain_min"] = fastest
    return alternatives


def main(argv: Sequence[str] | None = None) -> dict[str, float | int]:
    """Run the benchmark, print human-readable lines and finally one JSON line; return that JSON."""
    args = parse_args(argv)
    for name in _GUARDIAN_ENV:
        os.environ.pop(name, None)
    logging.getLogger("trainguard").setLevel(logging.ERROR)  # "no checkpoint directory" is intended
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or 2
    torch.set_num_threads(threads)
    shape = QUICK if args.quick else FULL

    scratch = tempfile.TemporaryDirectory(prefix="trainguard-bench-")
    small = QUICK if args.quick else SMALL
    print(
        f"checkpointing case: checkpoints every {CHECKPOINT_EVERY} steps, snapshots every {SNAPSHOT_EVERY}, "
        f"transformer LM (vocab {small.vocab}, embed {small.embed}, {small.layers} layers, seq {small.seq}), "
        f"{args.checkpointing_repetitions} timed steps, interleaved"
    )
    case_dir = Path(scratch.name) / "checkpointing"
    case_dir.mkdir()
    checkpointing = checkpointing_case(
        small, args.lr, args.seed, case_dir, args.warmup, args.checkpointing_repetitions
    )
    print("straggler measurement (own compute per step), timed apart:")
    measurement = compute_measurement_case(2_000 if args.quick else 100_000, 3 if args.quick else 7)
    # What it adds to the small model's guarded step, as a ratio (the goal: the guard stays <= 1.02).
    measurement["over_guarded"] = (
        checkpointing["guarded_median_s"] + measurement["added_ns"] * 1e-9
    ) / checkpointing["guarded_median_s"]
    print(f"  on the small model's guarded step: x{measurement['over_guarded']:.6f}")
    measured = {f"compute_measurement_{key}": round(value, 6) for key, value in measurement.items()}
    if args.checkpointing_only:
        only = {f"checkpointing_{key}": round(value, 6) for key, value in checkpointing.items()}
        only.update(measured)
        print(json.dumps(only))
        return only
    variants, guardian, batch = build_variants(shape, args.lr, args.seed, Path(scratch.name) / "status.json")
    params = sum(p.numel() for p in guardian.module.parameters())
    print(
        f"model: transformer LM, {params / 1e6:.2f}M parameters (vocab {shape.vocab}, embed {shape.embed}, "
        f"{shape.layers} layers, seq {shape.seq}, batch {shape.batch}); AdamW; {threads} threads"
    )
    load_before = os.getloadavg()[0]
    print(f"{args.warmup} warm-up + {args.repetitions} timed steps per variant, interleaved")
    run_interleaved(variants, args.warmup, args.repetitions)
    load_after = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    print(f"  machine load average (1 min): {load_before:.2f} before, {load_after:.2f} after; {cores} cores")
    if max(load_before, load_after) > cores:
        print(
            "  WARNING: the machine is oversubscribed: steps slow down in bursts (many small parallel "
            "regions suffer most), so medians are noisy; the paired ratio is the steadier figure"
        )

    medians = {v.name: statistics.median(v.times) for v in variants}
    plain = medians["plain"]
    alternatives = _ratio_lines(variants)
    if guardian.skipped_steps:
        print(f"  WARNING: the guardian skipped {guardian.skipped_steps} steps; the comparison is unfair")

    print("guard pieces, timed apart on real gradients (median, and as a share of the plain median):")
    # The clip piece is what a clip costs once one is set (by default the guardian clips nothing).
    clip_norm = guardian.max_grad_norm if guardian.max_grad_norm is not None else 1.0
    pieces = guard_breakdown(variants[0].model, batch, clip_norm, 2 if args.quick else 5)
    piece_medians = {name: statistics.median(times) for name, times in pieces.items()}
    for name, median in piece_medians.items():
        print(
            f"  {name:32s} {median * 1e3:8.2f} ms  (min {min(pieces[name]) * 1e3:.2f})  "
            f"{median / plain * 100:6.2f}%"
        )
    added = sum(median for name, median in piece_medians.items() if not name.startswith("naive"))
    rest = medians["guarded"] - plain - added
    print(
        f"  guarded - plain - pieces (Python bookkeeping and noise): {rest * 1e3:.2f} ms "
        f"({rest / plain * 100:.2f}%)"
    )

    snap_s, snap_bytes = time_snapshot(guardian.module, guardian.optimizer, 3 if args.quick else 5)
    guardian.close()  # done with it: left to interpreter exit, it would finish into the removed scratch
    every = CheckpointPolicy().snapshot_every_steps
    print(
        f"snapshot (timed apart): {snap_s * 1e3:.2f} ms for {snap_bytes / 1e6:.1f} MB; at the default "
        f"snapshotEverySteps={every}: {snap_s / every / plain * 100:.3f}% of a plain step"
    )

    result: dict[str, float | int] = {
        "guarded_over_plain": round(medians["guarded"] / plain, 4),
        "naive_over_plain": round(medians["naive"] / plain, 4),
        "plain_median_s": round(plain, 6),
        "params": params,
        "repetitions": args.repetitions,
        "guarded_median_s": round(medians["guarded"], 6),
        "naive_median_s": round(medians["naive"], 6),
        **{key: round(value, 4) for key, value in alternatives.items()},
        "clip_s": round(piece_medians["total norm (foreach)"] + piece_medians["clip multiply (foreach)"], 6),
        "skipped_steps": guardian.skipped_steps,
        "snapshot_s": round(snap_s, 6),
        "load_average": round(max(load_before, load_after), 2),
        **{f"checkpointing_{key}": round(value, 6) for key, value in checkpointing.items()},
        **measured,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
