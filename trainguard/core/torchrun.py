"""Running a job's command under torchrun, so that a pod (or a local "pod") runs several worker processes.

With ``nprocPerNode`` above 1 each pod runs ``nprocPerNode`` processes of the user's command, started
by torchrun (``python -m torch.distributed.run``), which gives each its RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE and GROUP_RANK as it always does. The operator passes the node's numbers as the
Kubeflow training operator's variables (``$(PET_NNODES)``...), ``trainguard run`` as plain values. A
command that already starts torchrun is the user's own launch and is kept as it is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
_TORCHRUN_MODULE = "torch.distributed.run"


class NotPython(ValueError):
    """The command does not start Python, so it cannot be run under torchrun."""


@dataclass(frozen=True)
class NodeLaunch:
    """torchrun's node arguments, as values or as variables the container expands."""

    nnodes: str
    nproc_per_node: str
    node_rank: str
    master_addr: str
    master_port: str

    def arguments(self) -> list[str]:
        """torchrun's options for this node; torchrun never restarts a worker itself (``--max-restarts
        0``): a lone restarted rank cannot rejoin its gang, the orchestrator restarts the whole gang."""
        return [
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--node-rank={self.node_rank}",
            f"--master-addr={self.master_addr}",
            f"--master-port={self.master_port}",
            "--max-restarts=0",
        ]


def is_python(program: str) -> bool:
    """Whether ``program`` (a path or a name) names a Python interpreter: python, python3, python3.12."""
    return bool(_PYTHON.match(PurePosixPath(program).name))


def launches_torchrun(command: Sequence[str]) -> bool:
    """Whether ``command`` already starts torchrun (the user's own launch)."""
    if not command:
        return False
    program = PurePosixPath(command[0]).name
    if program == "torchrun":
        return True
    return is_python(program) and list(command[1:3]) == ["-m", _TORCHRUN_MODULE]


def under_torchrun(command: Sequence[str], node: NodeLaunch) -> list[str]:
    """``command`` (a Python interpreter, then a script or ``-m module``, then its arguments) as torchrun
    runs it on one node; a command that already starts torchrun unchanged. Raises NotPython otherwise."""
    if launches_torchrun(command):
        return list(command)
    if not command or not is_python(command[0]) or len(command) < 2:
        raise NotPython(
            "with nprocPerNode above 1 the command must start Python with a script or -m module (trainguard "
            "runs it under torchrun), or start torchrun itself"
        )
    python, rest = command[0], list(command[1:])
    if rest[0] not in ("-m",) and rest[0].startswith("-"):
        raise NotPython(f"with nprocPerNode above 1, Python options such as {rest[0]!r} cannot be passed on")
    return [python, "-m", _TORCHRUN_MODULE, *node.arguments(), *rest]
