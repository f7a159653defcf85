"""What checkpoints and rollbacks cost: the training loop's stall, the write throughput, the restore.

One model-and-AdamW state (~400 MB by default) is saved, written and restored side by side, the order
of the disk measurements rotated every repetition, medians reported:

* ``async_stall_over_sync_save``: how long ``CheckpointStore.save_async`` blocks the loop (the copy
  into warm host buffers) over a synchronous ``torch.save`` + fsync of the same state. Goal <= 0.05.
* ``overlapped_stall_over_sync_save``: the same, with the parameters and optimizer moments copied in
  the background while the loop goes on (``save_async(stable=...)``, as the guardian does: they change
  only in the next optimizer step): the stall is ``save_async``'s return plus the wait in ``settle``
  before that step, after a stand-in for the next forward and backward passes (matrix products on the
  main thread for ``--compute-ms``, which compete with the copy for the cores on a CPU). Goal <= 0.02.
  Measured on the CPU only: on a GPU the copy runs on a side stream into pinned buffers.
* ``save_over_raw_write``: throughput of a full store save (``save_async`` + ``wait``: copy, header,
  raw tensor bytes written while a second thread hashes them (SHA-256), fsync, rename, manifest) over
  a raw sequential write of as many bytes (one file, 8 MiB chunks, fsync) to the same directory, i.e.
  raw seconds / save seconds. Goal >= 0.7. Pruning the previous checkpoint runs afterwards in the
  store's janitor thread, off the path ``wait`` waits on; it is timed apart (``prune_s``).
* ``restore_over_memcpy``: ``Snapshot.restore`` of model and optimizer (in place) over one
  ``copy_`` of as many bytes between preallocated tensors. Goal <= 1.5.
* ``format3_save_over_format2`` and ``format3_load_over_format2``: the data file of format 3 (a
  safetensors file) against trainguard's format 2 (``bench/checkpoint_v2.py``), side by side, timed
  as seconds (>1: format 3 is slower). A save is the layout, the write through the store's writer
  (writev of views, hashing beside it, fsync, rename); a load is ``read_state`` of the file just
  written (from the page cache). Goal: <= 1.05 each. The same ratios in process CPU seconds
  (``..._cpu_over_format2``) are steadier when other processes compete for the cores.

A sharded case (``--sharded-ranks``, default 2; 0 skips it) trains the same layers wrapped by FSDP2's
``fully_shard`` over that many gloo processes, each rank writing only its shards (no gather):
``sharded_save_over_raw_write`` is each rank's raw write of as many bytes as its data file over its
store save (the slowest rank's median), ``sharded_overlapped_stall_over_save`` its overlapped stall
over its whole save, and ``sharded_file_bytes`` the largest rank's file (about 1/N of the replicated
file).

A write to the page cache on this VM now and then stalls for half a second or more, whichever writer
it hits (raw or store alike), so the medians take 9 rounds and the JSON also gives
``save_over_raw_write_min``, fastest raw write over fastest store save: the same ratio without those
stalls.

The same save by a second store that hashes serially (``parallel_hash=False``: write, then hash) is
timed too, to show what the two-thread pipeline buys on this machine (``save_serial_hash_s``).

Files go to a fresh temporary directory (under ``--dir``, default the system temp directory) that is
deleted at the end. Run ``python -m bench.checkpoint`` (``--quick``: 40 MB). The last line is JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import queue
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench import checkpoint_v2
from tests.support.paths import REPO_ROOT
from trainer_sidecar.checkpoint import CheckpointStore, data_file_name, step_dir_name
from trainer_sidecar.checkpoint import format as checkpoint_format
from trainer_sidecar.checkpoint import writer as checkpoint_writer
from trainer_sidecar.guardian.snapshot import Snapshot, stable_storage
from trainer_sidecar.tensors.tensorstate import flatten

_CHUNK = 8 << 20  # the raw write's chunk (the store writes and hashes large tensors in 8 MiB pieces)
_LAYERS = 8


def build_state(megabytes: float, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A stack of linear layers with AdamW state; parameters plus two moments total ~``megabytes``."""
    torch.manual_seed(seed)
    # Each fp32 parameter costs 12 bytes once AdamW holds exp_avg and exp_avg_sq beside it.
    width = max(8, round(math.sqrt(megabytes * 1e6 / (12 * _LAYERS))))
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(_LAYERS)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer.step()  # creates the moments
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What the guardian checkpoints on rank 0 (the model and optimizer dominate its size)."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 0}


def tensor_bytes(state: Any) -> int:
    """Bytes held by the tensors of a nested state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    return 0


def sync_save(state: dict[str, Any], path: Path) -> float:
    """Seconds for a plain ``torch.save`` of ``state`` to ``path`` and an fsync (the file is removed)."""
    start = time.perf_counter()
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def raw_write(payload: memoryview, path: Path) -> tuple[float, float]:
    """(write, delete) seconds: ``payload`` written in large chunks to a new file and fsynced; its removal."""
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as handle:
        for offset in range(0, payload.nbytes, _CHUNK):
            handle.write(payload[offset : offset + _CHUNK])
        os.fsync(handle.fileno())
    elapsed = time.perf_counter() - start
    start = time.perf_counter()
    path.unlink()
    return elapsed, time.perf_counter() - start


def sha256_seconds(payload: memoryview) -> float:
    """Seconds to SHA-256 ``payload`` in memory, in the chunks a file write would hand over."""
    start = time.perf_counter()
    digest = hashlib.sha256()
    for offset in range(0, payload.nbytes, _CHUNK):
        digest.update(payload[offset : offset + _CHUNK])
    digest.hexdigest()
    return time.perf_counter() - start


def store_save(store: CheckpointStore, step: int, state: dict[str, Any]) -> tuple[float, float, float]:
    """(stall, total, prune) seconds of one checkpoint: until ``save_async`` returns, until it is
    durable, and then until the janitor has pruned the previous one (not part of the save's time).
    A rank of several may finish before the others have published: only a store of one rank checks
    that the checkpoint was recorded as clean."""
    start = time.perf_counter()
    store.save_async(step, state, {"loss": 1.0, "clean": True})
    stall = time.perf_counter() - start
    if store.wait() is None and store.world_size == 1:
        raise RuntimeError(f"the checkpoint at step {step} was not recorded as clean")
    total = time.perf_counter() - start
    store.wait_for_pruning()  # so that the deletion does not overlap the next measurement
    return stall, total, time.perf_counter() - start - total


def overlapped_save(
    store: CheckpointStore, step: int, state: dict[str, Any], stable: set[int], compute: Callable[[], None]
) -> tuple[float, float]:
    """(stall, total) seconds of one checkpoint whose stable tensors are copied in the background: the
    loop's wait in ``save_async`` plus its wait in ``settle`` after ``compute`` (the next forward and
    backward passes), and the time until it is durable."""
    start = time.perf_counter()
    store.save_async(step, state, {"loss": 1.0, "clean": True}, stable=stable)
    stall = time.perf_counter() - start
    compute()
    settle_start = time.perf_counter()
    store.settle()
    stall += time.perf_counter() - settle_start
    if store.wait() is None and store.world_size == 1:
        raise RuntimeError(f"the checkpoint at step {step} was not recorded as clean")
    total = time.perf_counter() - start
    store.wait_for_pruning()
    return stall, total


def _sharded_rank(
    rank: int, world_size: int, port: int, args: argparse.Namespace, root: Path, out: Any
) -> None:
    """One rank of the sharded case (see the module's docstring): puts its medians on ``out``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    model, _ = build_state(args.megabytes, args.seed)
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, layers[0].in_features)).sum().backward()
    optimizer.step()  # creates the (sharded) moments
    optimizer.zero_grad(set_to_none=True)
    store = CheckpointStore(root / "sharded", rank=rank, world_size=world_size, keep_clean=1)
    stable = stable_storage(model, optimizer.state_dict())
    operand = torch.rand(256, 256)

    def compute() -> None:
        deadline = time.perf_counter() + args.compute_ms / 1000
        while time.perf_counter() < deadline:
            operand @ operand

    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    store_save(store, 1, state)
    file_bytes = (root / "sharded" / step_dir_name(1) / data_file_name(rank)).stat().st_size
    payload = torch.randint(0, 256, (file_bytes,), dtype=torch.uint8).numpy().data.cast("B")
    times: dict[str, list[float]] = {"save": [], "raw": [], "overlap_stall": [], "overlap_save": []}
    for rep in range(args.repetitions):
        dist.barrier()
        times["save"].append(store_save(store, 2 * rep + 2, state)[1])
        dist.barrier()
        times["raw"].append(raw_write(payload, root / f"sharded-raw-{rank}-{rep}.bin")[0])
        dist.barrier()
        stall, total = overlapped_save(store, 2 * rep + 3, state, stable, compute)
        times["overlap_stall"].append(stall)
        times["overlap_save"].append(total)
    store.close()
    dist.destroy_process_group()
    out.put({"rank": rank, "file_bytes": file_bytes, **{k: statistics.median(v) for k, v in times.items()}})


def sharded_case(args: argparse.Namespace, root: Path) -> dict[str, float | int]:
    """Run the sharded case over ``args.sharded_ranks`` processes; the slowest rank's ratios."""
    import multiprocessing

    from tests.support.ports import free_port

    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_sharded_rank, args=(rank, args.sharded_ranks, port, args, root, out))
        for rank in range(args.sharded_ranks)
    ]
    for proc in procs:
        proc.start()
    ranks: list[dict[str, Any]] = []
    while len(ranks) < len(procs):
        try:
            ranks.append(out.get(timeout=2))
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                for proc in procs:
                    proc.kill()
                raise RuntimeError(f"a rank of the sharded case failed (exit codes {failed})") from None
    for proc in procs:
        proc.join()
    slowest = max(ranks, key=lambda r: r["save"])
    for r in sorted(ranks, key=lambda r: r["rank"]):
        print(
            f"  sharded rank {r['rank']}: {r['file_bytes'] / 1e6:.1f} MB file, save {r['save']:.4f} s, raw "
            f"{r['raw']:.4f} s, overlapped stall {r['overlap_stall']:.4f} s"
        )
    return {
        "sharded_ranks": args.sharded_ranks,
        "sharded_file_bytes": max(r["file_bytes"] for r in ranks),
        "sharded_save_over_raw_write": round(min(r["raw"] / r["save"] for r in ranks), 4),
        "sharded_overlapped_stall_over_save": round(slowest["overlap_stall"] / slowest["save"], 4),
        "sharded_save_s": round(slowest["save"], 6),
    }


def format_save(folder: Path, name: str, state: dict[str, Any], codec: Any) -> tuple[float, float]:
    """(wall, CPU) seconds to lay out ``state`` with ``codec`` (a format module) and write it through the
    store's writer (hash beside the write, fsync, rename, directory fsync) as ``folder/name``."""
    skeleton, tensors = flatten(state)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        start, cpu = time.perf_counter(), time.process_time()
        checkpoint_writer.write_file(fd, name, codec.serialize(skeleton, tensors), parallel_hash=True)
        return time.perf_counter() - start, time.process_time() - cpu
    finally:
        os.close(fd)


def format_load(path: Path, codec: Any) -> tuple[float, float]:
    """(wall, CPU) seconds of ``codec.read_state(path)``."""
    start, cpu = time.perf_counter(), time.process_time()
    codec.read_state(path)
    return time.perf_counter() - start, time.process_time() - cpu


def timed(action: Callable[[], object]) -> float:
    """Seconds taken by ``action()``."""
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--megabytes", type=float, default=None, help="state size (default 400; --quick: 40)")
    parser.add_argument("--repetitions", type=int, default=None, help="timed rounds (default 9; --quick: 3)")
    parser.add_argument("--quick", action="store_true", help="a 40 MB state and 3 rounds (smoke test)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="parent of the temporary directory (default: system temp)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: 2, or OMP_NUM_THREADS)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharded-ranks", type=int, default=2, help="ranks of the FSDP2 case (0: skip it)")
    parser.add_argument(
        "--compute-ms",
        type=float,
        default=300.0,
        help="the stand-in forward and backward pass the overlapped copy runs beside (default 300)",
    )
    args = parser.parse_args(argv)
    if args.megabytes is None:
        args.megabytes = 40.0 if args.quick else 400.0
    if args.repetitions is None:
        args.repetitions = 3 if args.quick else 9
    if args.repetitions < 1 or args.megabytes <= 0:
        parser.error("--repetitions and --megabytes must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, float | int]:
    """Run the benchmark, print human-readable lines and finally one JSON line; return that JSON."""
    args = parse_args(argv)
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or 2
    torch.set_num_threads(threads)

    model, optimizer = build_state(args.megabytes, args.seed)
    state = training_state(model, optimizer)
    nbytes = tensor_bytes(state)
    print(
        f"state: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M fp32 parameters with AdamW moments, "
        f"{nbytes / 1e6:.1f} MB of tensors; {threads} threads"
    )

    parent = args.dir if args.dir is not None else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="trainguard-bench-", dir=parent))
    same_disk = os.stat(root).st_dev == os.stat(REPO_ROOT).st_dev
    print(f"directory: {root} ({'same' if same_disk else 'NOT the same'} file system as {REPO_ROOT})")
    load_before = os.getloadavg()[0]
    stores: list[CheckpointStore] = []
    try:
        store = CheckpointStore(root / "ckpt", keep_clean=1, parallel_hash=True)
        stores.append(store)
        serial = CheckpointStore(root / "ckpt-serial", keep_clean=1, parallel_hash=False)
        stores.append(serial)
        overlapping = CheckpointStore(root / "ckpt-overlap", keep_clean=1, parallel_hash=True)
        stores.append(overlapping)
        stable = stable_storage(model, optimizer.state_dict())
        operand = torch.rand(256, 256)

        def compute() -> None:  # a stand-in for a forward and backward pass of --compute-ms
            deadline = time.perf_counter() + args.compute_ms / 1000
            while time.perf_counter() < deadline:
                operand @ operand

        # Warm-up: allocates the store's host buffers, learns the checkpoint file's size.
        store_save(store, 1, state)
        store_save(serial, 1, state)
        overlapped_save(overlapping, 1, state, stable, compute)
        file_bytes = (root / "ckpt" / step_dir_name(1) / data_file_name(0)).stat().st_size
        formats = root / "formats"
        formats.mkdir()
        source = torch.randint(0, 256, (file_bytes,), dtype=torch.uint8, generator=torch.Generator())
        payload = source.numpy().data.cast("B")

        snapshot = Snapshot()
        snapshot.capture(0, model, optimizer, {}, {})
        copy_src = torch.rand(nbytes // 4)
        copy_dst = torch.zeros_like(copy_src)
        snapshot.restore(model, optimizer)  # warm the in-place path
        copy_dst.copy_(copy_src)

        names = (
            "sync", "stall", "save", "serial", "prune", "raw", "restore", "copy", "sha256", "unlink",
            "overlap_stall", "overlap_save",
        )  # fmt: skip
        names_formats = [
            f"v{v}_{what}{cpu}" for v in (2, 3) for what in ("save", "load") for cpu in ("", "_cpu")
        ]
        times: dict[str, list[float]] = {name: [] for name in (*names, *names_formats)}
        for rep in range(args.repetitions):
            step = 2 + rep  # never an existing step: the store would keep, not rewrite, a valid one

            def run_sync(rep: int = rep) -> None:
                times["sync"].append(sync_save(state, root / f"sync-{rep}.pt"))

            def run_store(step: int = step) -> None:
                stall, total, prune = store_save(store, step, state)
                times["stall"].append(stall)
                times["save"].append(total)
                times["prune"].append(prune)

            def run_serial(step: int = step) -> None:
                times["serial"].append(store_save(serial, step, state)[1])

            def run_overlapped(step: int = step) -> None:
                stall, total = overlapped_save(overlapping, step, state, stable, compute)
                times["overlap_stall"].append(stall)
                times["overlap_save"].append(total)

            def run_raw(rep: int = rep) -> None:
                write, delete = raw_write(payload, root / f"raw-{rep}.bin")
                times["raw"].append(write)
                times["unlink"].append(delete)

            def run_formats(rep: int = rep) -> None:
                codecs: list[tuple[str, Any]] = [("v2", checkpoint_v2), ("v3", checkpoint_format)]
                ordered = codecs if rep % 2 else codecs[::-1]
                for label, codec in ordered:
                    wall, cpu = format_save(formats, label, state, codec)
                    times[f"{label}_save"].append(wall)
                    times[f"{label}_save_cpu"].append(cpu)
                for label, codec in ordered:
                    wall, cpu = format_load(formats / label, codec)
                    times[f"{label}_load"].append(wall)
                    times[f"{label}_load_cpu"].append(cpu)

            disk = [run_sync, run_store, run_raw, run_serial, run_formats, run_overlapped]
            shift = rep % len(disk)
            for action in [*disk[shift:], *disk[:shift]]:
                action()
            times["restore"].append(timed(lambda: snapshot.restore(model, optimizer)))
            times["copy"].append(timed(lambda: copy_dst.copy_(copy_src)))
            times["sha256"].append(sha256_seconds(payload))
    finally:
        for created in stores:
            created.close()
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()[0]

    med = {name: statistics.median(values) for name, values in times.items()}
    print(f"{args.repetitions} rounds after one warm-up save; medians (min-max):")
    cores = os.cpu_count() or 1
    print(f"  machine load average (1 min): {load_before:.2f} before, {load_after:.2f} after; {cores} cores")
    if max(load_before, load_after) > cores:
        print(
            "  WARNING: the machine is oversubscribed: per-tensor (foreach) copies with several threads "
            "slow down far more than one large copy, so the stall and restore ratios read high"
        )
    labels = {
        "sync": "torch.save + fsync (synchronous)",
        "stall": "save_async stall (host copy)",
        "overlap_stall": "overlapped: save_async + settle wait",
        "overlap_save": "overlapped: save_async + wait",
        "save": "store save, save_async + wait",
        "serial": "the same, hashing after the write",
        "prune": "janitor: prune the previous one",
        "raw": "raw sequential write + fsync",
        "restore": "Snapshot.restore (in place)",
        "copy": "one copy_ of the same bytes",
        "sha256": "SHA-256 of the file's bytes (memory)",
        "unlink": "delete one file of that size",
        "v2_save": "format 2 file: layout, write, hash",
        "v3_save": "format 3 (safetensors): the same",
        "v2_load": "format 2 file: read_state",
        "v3_load": "format 3 (safetensors): read_state",
    }
    for name, label in labels.items():
        values = times[name]
        size = (
            file_bytes
            if name in ("sync", "save", "serial", "raw", "sha256", "v2_save", "v3_save")
            else nbytes
        )
        rate = f"  {size / med[name] / 1e9:6.2f} GB/s" if name not in ("unlink", "prune") else ""
        print(
            f"  {label:37s} {med[name] * 1e3:8.1f} ms"
            f"  ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}){rate}"
        )
    stall_ratio = med["stall"] / med["sync"]
    write_ratio = med["raw"] / med["save"]
    write_ratio_min = min(times["raw"]) / min(times["save"])
    restore_ratio = med["restore"] / med["copy"]
    format_save_ratio = med["v3_save"] / med["v2_save"]
    format_load_ratio = med["v3_load"] / med["v2_load"]
    format_save_cpu_ratio = med["v3_save_cpu"] / med["v2_save_cpu"]
    format_load_cpu_ratio = med["v3_load_cpu"] / med["v2_load_cpu"]
    print(
        "  the store's save: host copy, then in the background a JSON header and the raw tensor bytes"
        " written while another thread hashes them, fsync, rename, manifest; pruning runs after, apart"
    )
    print(
        f"  serial / parallel hashing {med['serial'] / med['save']:.2f}x  (>1: the two-thread pipeline"
        " is faster here)"
    )
    print(
        f"  async stall / sync save   {stall_ratio:.4f}  (goal <= 0.05; stall / memcpy of the same bytes "
        f"{med['stall'] / med['copy']:.2f})"
    )
    print(
        f"  raw write / store save    {write_ratio:.4f}  (goal >= 0.7: store throughput vs raw;"
        f" fastest vs fastest {write_ratio_min:.4f})"
    )
    print(f"  restore / memcpy          {restore_ratio:.4f}  (goal <= 1.5)")
    print(
        f"  format 3 / format 2       save {format_save_ratio:.4f}, load {format_load_ratio:.4f}  (seconds;"
        f" goal <= 1.05; fastest vs fastest: save {min(times['v3_save']) / min(times['v2_save']):.4f},"
        f" load {min(times['v3_load']) / min(times['v2_load']):.4f})"
    )
    print(
        f"  format 3 / format 2 (CPU) save {format_save_cpu_ratio:.4f}, load {format_load_cpu_ratio:.4f}"
        "  (process CPU seconds, both threads: steadier than wall time on a busy machine)"
    )

    result: dict[str, float | int] = {
        "async_stall_over_sync_save": round(stall_ratio, 4),
        "overlapped_stall_over_sync_save": round(med["overlap_stall"] / med["sync"], 4),
        "overlapped_stall_s": round(med["overlap_stall"], 6),
        "compute_ms": args.compute_ms,
        "save_over_raw_write": round(write_ratio, 4),
        "save_over_raw_write_min": round(write_ratio_min, 4),
        "restore_over_memcpy": round(restore_ratio, 4),
        "format3_save_over_format2": round(format_save_ratio, 4),
        "format3_load_over_format2": round(format_load_ratio, 4),
        "format3_save_over_format2_min": round(min(times["v3_save"]) / min(times["v2_save"]), 4),
        "format3_load_over_format2_min": round(min(times["v3_load"]) / min(times["v2_load"]), 4),
        "format3_save_cpu_over_format2": round(format_save_cpu_ratio, 4),
        "format3_load_cpu_over_format2": round(format_load_cpu_ratio, 4),
        "async_stall_s": round(med["stall"], 6),
        "sync_save_s": round(med["sync"], 6),
        "save_s": round(med["save"], 6),
        "save_serial_hash_s": round(med["serial"], 6),
        "prune_s": round(med["prune"], 6),
        "raw_write_s": round(med["raw"], 6),
        "restore_s": round(med["restore"], 6),
        "memcpy_s": round(med["copy"], 6),
        "sha256_s": round(med["sha256"], 6),
        "unlink_s": round(med["unlink"], 6),
        "bytes": nbytes,
        "file_bytes": file_bytes,
        "repetitions": args.repetitions,
        "load_average": round(max(load_before, load_after), 2),
    }
    if args.sharded_ranks > 0:
        sharded_root = Path(tempfile.mkdtemp(prefix="trainguard-bench-sharded-", dir=parent))
        try:
            result.update(sharded_case(args, sharded_root))
        finally:
            shutil.rmtree(sharded_root, ignore_errors=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
