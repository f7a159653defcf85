"""trainguard's in-process guardian library and the sidecar that watches it.

A training script needs only ``Guardian``; see its docstring for the five-line adoption.
"""

from trainer_sidecar.checkpoint import CheckpointError, CheckpointStore
from trainer_sidecar.data import GuardedLoader
from trainer_sidecar.exitcodes import ExitCode
from trainer_sidecar.guardian import ConfigError, Diverged, Guardian, StepOutcome
from trainer_sidecar.settings import CheckpointPolicy, GuardianSettings, GuardThresholds, Remediation
from trainer_sidecar.status import Phase, WorkerStatus

__all__ = [
    "CheckpointError",
    "CheckpointPolicy",
    "CheckpointStore",
    "ConfigError",
    "Diverged",
    "ExitCode",
    "GuardThresholds",
    "GuardedLoader",
    "Guardian",
    "GuardianSettings",
    "Phase",
    "Remediation",
    "StepOutcome",
    "WorkerStatus",
]
