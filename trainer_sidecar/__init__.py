"""trainguard's in-process guardian library and the sidecar that watches it.

A training script needs only ``Guardian``; see its docstring for the five-line adoption. Names are
imported lazily, so the sidecar (which never trains) starts without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer_sidecar.checkpoint import CheckpointError, CheckpointStore
    from trainer_sidecar.contract.exitcodes import ExitCode
    from trainer_sidecar.contract.settings import (
        CheckpointPolicy,
        GuardianSettings,
        GuardThresholds,
        Remediation,
    )
    from trainer_sidecar.contract.status import Phase, WorkerStatus
    from trainer_sidecar.guardian.data import GuardedLoader
    from trainer_sidecar.guardian.feed import Variables
    from trainer_sidecar.guardian.guardian import ConfigError, Diverged, Guardian, StepOutcome

_EXPORTS = {
    "CheckpointError": "checkpoint",
    "CheckpointStore": "checkpoint",
    "GuardedLoader": "guardian.data",
    "ExitCode": "contract.exitcodes",
    "ConfigError": "guardian.guardian",
    "Diverged": "guardian.guardian",
    "Guardian": "guardian.guardian",
    "StepOutcome": "guardian.guardian",
    "CheckpointPolicy": "contract.settings",
    "GuardianSettings": "contract.settings",
    "GuardThresholds": "contract.settings",
    "Remediation": "contract.settings",
    "Phase": "contract.status",
    "WorkerStatus": "contract.status",
    "Variables": "guardian.feed",
}

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
    "Variables",
    "WorkerStatus",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer_sidecar' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainer_sidecar.{module}"), name)
