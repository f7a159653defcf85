"""A sidecar's health rules driven by hand, for tests of ``trainer_sidecar.sidecar.health``."""

from __future__ import annotations

from dataclasses import dataclass

from trainer_sidecar.contract.status import WorkerStatus
from trainer_sidecar.sidecar.health import Clocks, Health, HealthPolicy, Tracking, assess_health

WALL0 = 1_700_000_000.0
HANG = 30.0
GRACE = 120.0
POLICY = HealthPolicy(hang_timeout_seconds=HANG, startup_grace_seconds=GRACE)


@dataclass
class Sidecar:
    """A sidecar's health state driven by hand (started at monotonic 0, wall ``WALL0``); its two clocks
    move together unless a test sets them apart."""

    policy: HealthPolicy = POLICY
    monotonic: float = 0.0
    wall: float = WALL0

    def __post_init__(self) -> None:
        self.tracking = Tracking.begin(self.monotonic)

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass on both clocks."""
        self.monotonic += seconds
        self.wall += seconds

    def read(self, status: WorkerStatus | None, read_error: str = "unreadable") -> Health:
        """The verdict on ``status`` now (``read_error`` when there is none), carrying the tracking on."""
        clocks = Clocks(monotonic=self.monotonic, wall=self.wall)
        health, self.tracking = assess_health(self.tracking, status, read_error, clocks, self.policy)
        return health
