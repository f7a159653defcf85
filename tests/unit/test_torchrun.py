"""A job's command under torchrun: Python scripts and modules wrapped, torchrun kept, the rest refused."""

from __future__ import annotations

import pytest

from trainguard.core.torchrun import NodeLaunch, NotPython, launches_torchrun, under_torchrun

NODE = NodeLaunch("2", "4", "1", "10.0.0.7", "29500")
ARGS = [
    "--nnodes=2", "--nproc-per-node=4", "--node-rank=1", "--master-addr=10.0.0.7", "--master-port=29500",
    "--max-restarts=0",
]  # fmt: skip
TORCHRUN = ["-m", "torch.distributed.run", *ARGS]


@pytest.mark.parametrize(
    ("command", "wrapped"),
    [
        (["python", "train.py", "--lr", "3e-4"], ["python", *TORCHRUN, "train.py", "--lr", "3e-4"]),
        (["/usr/bin/python3.11", "-m", "pkg.train"], ["/usr/bin/python3.11", *TORCHRUN, "-m", "pkg.train"]),
    ],
)
def test_a_python_script_or_module_runs_under_torchrun(command: list[str], wrapped: list[str]) -> None:
    assert under_torchrun(command, NODE) == wrapped


@pytest.mark.parametrize(
    "command",
    [["torchrun", "--nproc-per-node=8", "train.py"], ["python3", "-m", "torch.distributed.run", "x.py"]],
)
def test_a_launch_of_the_users_own_is_kept(command: list[str]) -> None:
    assert launches_torchrun(command)
    assert under_torchrun(command, NODE) == command


@pytest.mark.parametrize(
    "command", [["bash", "-c", "python train.py"], ["python"], ["python", "-u", "train.py"], []]
)
def test_anything_else_is_refused_saying_why(command: list[str]) -> None:
    with pytest.raises(NotPython, match="nprocPerNode"):
        under_torchrun(command, NODE)
