"""Exit codes a guarded worker ends with, and what an orchestrator should make of them.

Kubeflow's ExitCode restart policy treats codes 1-127 as permanent and 128-255 as retryable; the
codes below follow that split. 128+N is what a shell reports for death by signal N (up to 192 for
real-time signals), so the guardian's own retryable code sits above that range.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Documented exit codes of a worker that runs the guardian."""

    SUCCEEDED = 0
    #: Bad settings, an unusable checkpoint directory, a checkpoint of another model: retrying cannot help.
    CONFIG_ERROR = 2
    #: A newer writer claimed the checkpoint directory (another job, or a newer attempt of this one):
    #: this worker may no longer save there, and retrying it cannot help (permanent).
    FENCED = 3
    #: Too many rollbacks within the window: restart the gang with remediation (retryable).
    DIVERGED = 200


def describe_exit(code: int) -> str:
    """A short human reason for a worker's exit code (negative: killed by that signal number)."""
    if code == ExitCode.SUCCEEDED:
        return "succeeded"
    if code == ExitCode.CONFIG_ERROR:
        return "configuration error (permanent)"
    if code == ExitCode.FENCED:
        return "fenced: a newer writer claimed the checkpoint directory (permanent)"
    if code == ExitCode.DIVERGED:
        return "diverged: too many rollbacks"
    if code < 0:
        return f"killed by signal {-code}"
    if 128 < code <= 192:
        return f"killed by signal {code - 128}"
    return f"exited with code {code}"


def with_detail(description: str, detail: str) -> str:
    """``description: detail``, without a leading "what: " of ``detail`` that ``description`` already
    says ("configuration error (permanent)" and "configuration error: X" make
    "configuration error (permanent): X")."""
    what, colon, rest = detail.partition(": ")
    return f"{description}: {rest if colon and rest and what in description else detail}"
