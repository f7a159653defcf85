"""Published failure statistics as failure models for ``trainguard simulate``.

Llama 3: Meta's Llama 3 405B pre-training on 16,384 H100 GPUs saw 419 unexpected interruptions in a
54-day snapshot (466 interruptions, 47 of them planned), and kept "higher than 90% effective training
time". Source: Llama Team, AI @ Meta, "The Llama 3 Herd of Models", arXiv:2407.21783 (2024), section 3.3.4
"Reliability and Operational Challenges", Table 5 "Root-cause categorization of unexpected interruptions
during a 54-day period of Llama 3 405B pre-training". The counts below are Table 5's (they add up to 419;
the issue that asked for this model listed an "IO network" and an "other: 8" row, which the table does not
have: its tail is IO expansion board, dependency, CPU and system memory, 2 each). The percentages are the
table's own as printed; they are not the counts over 419 (148 / 419 is 35.3 %, the table says 30.1 %), so
the simulator draws causes by count.

ByteDance: ByteRobust reports 97 % ETTR for a three-month training job on 9,600 GPUs (Wan et al., "Robust
LLM Training Infrastructure at ByteDance", arXiv:2509.16293, 2025).

How each cause shows itself to trainguard (``kind``) is this module's assumption, not the paper's: GPU,
software and dependency faults end the process (a crash, seen as soon as the runner looks); network, NIC,
IO and NCCL watchdog faults stop the collectives (a hang, seen after the hang timeout); host maintenance
and host hardware take the node away (a lost pod).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Shows(StrEnum):
    """How a failure reaches trainguard's policy."""

    CRASH = "crash"
    HANG = "hang"
    LOST = "lost"


@dataclass(frozen=True)
class Cause:
    """One root cause: its name, its published count and share, and how it shows itself (assumed)."""

    name: str
    category: str
    count: int
    published_percent: float
    kind: Shows


@dataclass(frozen=True)
class FailureModel:
    """Failures as a Poisson process whose rate grows with the GPU count, drawn by cause."""

    name: str
    causes: tuple[Cause, ...]
    gpus: int
    seconds: float
    source: str

    @property
    def failures(self) -> int:
        """Interruptions observed in the published run."""
        return sum(c.count for c in self.causes)

    def job_rate(self, gpus: int, scale: float = 1.0) -> float:
        """Failures per second of a job on ``gpus`` GPUs: the published per-GPU rate times the GPUs, times
        ``scale`` (a what-if on the failure rate)."""
        return scale * self.failures * gpus / (self.gpus * self.seconds)


DAY = 86_400.0

LLAMA3 = FailureModel(
    name="llama3",
    gpus=16_384,
    seconds=54 * DAY,
    source="Llama 3 Herd of Models (arXiv:2407.21783), Table 5: 419 unexpected interruptions in 54 days on "
    "16,384 H100 GPUs",
    causes=(
        Cause("Faulty GPU", "GPU", 148, 30.1, Shows.CRASH),
        Cause("GPU HBM3 memory", "GPU", 72, 17.2, Shows.CRASH),
        Cause("Software bug", "Dependency", 54, 12.9, Shows.CRASH),
        Cause("Network switch/cable", "Network", 35, 8.4, Shows.HANG),
        Cause("Host maintenance", "Unplanned maintenance", 32, 7.6, Shows.LOST),
        Cause("GPU SRAM memory", "GPU", 19, 4.5, Shows.CRASH),
        Cause("GPU system processor", "GPU", 17, 4.1, Shows.CRASH),
        Cause("NIC", "Host", 7, 1.7, Shows.HANG),
        Cause("NCCL watchdog timeouts", "Unknown", 7, 1.7, Shows.HANG),
        Cause("Silent data corruption", "GPU", 6, 1.4, Shows.CRASH),
        Cause("GPU thermal interface + sensor", "GPU", 6, 1.4, Shows.CRASH),
        Cause("SSD", "Host", 3, 0.7, Shows.LOST),
        Cause("Power supply", "Host", 3, 0.7, Shows.LOST),
        Cause("Server chassis", "Host", 2, 0.5, Shows.LOST),
        Cause("IO expansion board", "Host", 2, 0.5, Shows.HANG),
        Cause("Dependency", "Dependency", 2, 0.5, Shows.CRASH),
        Cause("CPU", "Host", 2, 0.5, Shows.LOST),
        Cause("System memory", "Host", 2, 0.5, Shows.LOST),
    ),
)

#: Failure models by the name ``--failure-model`` takes.
MODELS = {LLAMA3.name: LLAMA3}


@dataclass(frozen=True)
class Reference:
    """A published effective-training-time figure to compare with."""

    name: str
    ratio: float
    what: str


REFERENCES = (
    Reference("Llama 3", 0.90, "higher than 90 % effective training time, 16,384 GPUs, 54 days"),
    Reference("ByteRobust", 0.97, "97 % ETTR, 9,600 GPUs, three months (arXiv:2509.16293)"),
)
