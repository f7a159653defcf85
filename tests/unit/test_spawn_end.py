"""A worker under ``torch.multiprocessing.spawn`` that crashes (issue 39, item 5): spawn's wrapper catches
the exception and ends the process with ``sys.exit(1)``, so the interpreter records no unhandled
exception; the guardian still reports the crash, with the exception that escaped its step (a peer's
death breaking DDP's all-reduce in the backward pass, here one backward that raises), never ``finished``
and never as a loop that merely ended without ``finish``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.support.ports import free_port
from trainer_sidecar.checkpoint import CheckpointStore
from trainer_sidecar.contract.status import Phase, read_status
from trainguard.core.policy import lost_a_peer
from trainguard.local.launch import wait_for_group

WORKER = textwrap.dedent(
    """
    import sys
    import torch
    import torch.multiprocessing as mp

    from trainer_sidecar import Guardian


    class PeerGone(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:29500")


    def worker(index, directory):
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        guardian = Guardian(
            model, optimizer, checkpoint_dir=f"{directory}/ckpt", status_file=f"{directory}/status.json"
        )
        for step in range(5):
            loss = model(torch.ones(1, 2)).sum()
            guardian.step(PeerGone.apply(loss) if step == 3 else loss)


    if __name__ == "__main__":
        mp.spawn(worker, args=(sys.argv[1],), nprocs=1)
    """
)


def test_a_crash_under_mp_spawn_is_reported_as_a_crash_with_its_exception(tmp_path: Path) -> None:
    script = tmp_path / "spawned.py"
    script.write_text(WORKER)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode != 0, done.stderr[-3000:]
    assert "ProcessExitedException" in done.stderr or "ProcessRaisedException" in done.stderr
    status, error = read_status(tmp_path / "status.json")
    assert status is not None, error
    assert status.phase is Phase.FAILED, status
    assert "Connection closed by peer" in status.message
    assert "without guardian.finish()" not in done.stderr


STOPPED = textwrap.dedent(
    """
    import json, sys, time
    import torch
    import torch.multiprocessing as mp

    from trainer_sidecar import Guardian, GuardianSettings


    def worker(index, directory):
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        settings = GuardianSettings.model_validate({"checkpoint": {"everySteps": 100000}})
        guardian = Guardian(model, optimizer, checkpoint_dir=f"{directory}/ckpt", settings=settings)
        while True:
            guardian.step(model(torch.ones(1, 2)).sum())
            if guardian.step_count == 5:
                print("stepping", flush=True)
            time.sleep(0.01)


    if __name__ == "__main__":
        mp.spawn(worker, args=(sys.argv[1],), nprocs=1)
    """
)


def test_a_stopped_spawn_gang_writes_its_stop_checkpoint_when_its_group_is_waited_for(tmp_path: Path) -> None:
    # SIGTERM to the worker's process group (what trainguard run sends): spawn's parent dies of it at
    # once; its worker stops at the next step boundary with a checkpoint, if it is given the time.
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED)
    leader = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, start_new_session=True
    )
    assert leader.stdout is not None
    assert leader.stdout.readline().strip() == b"stepping"
    os.killpg(leader.pid, signal.SIGTERM)
    leader.wait(timeout=60)
    assert wait_for_group(leader, time.monotonic() + 60)
    newest = CheckpointStore(tmp_path / "ckpt", world_size=1).newest_valid()
    assert newest is not None
    assert newest >= 5


PEERS = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch, torch.distributed as dist
    import torch.multiprocessing as mp

    from trainer_sidecar import Guardian


    def worker(rank, directory, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
        dist.init_process_group("gloo", rank=rank, world_size=2)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        guardian = Guardian(model, optimizer, status_file=f"{directory}/status-{rank}.json")
        for step in range(50):
            if rank == 1 and step == 10:
                os.kill(os.getpid(), signal.SIGKILL)
            guardian.step(model(torch.ones(1, 2)).sum())
            time.sleep(0.01)


    if __name__ == "__main__":
        mp.spawn(worker, args=(sys.argv[1], sys.argv[2]), nprocs=2)
    """
)


def test_a_peers_death_under_mp_spawn_is_reported_as_a_lost_peer(tmp_path: Path) -> None:
    # Rank 1 is SIGKILLed at step 10; rank 0's DDP all-reduce fails, and spawn's wrapper ends it with
    # sys.exit(1). Its status says it failed for losing a peer, which the recovery policy names as the
    # peer's failure (it used to say "the loop ended at step 10 without guardian.finish()": its own).
    script = tmp_path / "peers.py"
    script.write_text(PEERS)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode != 0
    status, error = read_status(tmp_path / "status-0.json")
    assert status is not None, error
    assert status.phase is Phase.FAILED, status
    assert lost_a_peer(status.message), status.message
    assert "without guardian.finish()" not in done.stderr
