"""A job's worker and sidecar environments, built one way for both runners.

The operator's renderer and ``trainguard run`` differ only in the paths (a pod's mounts, or this
machine's folders), the sidecar's address, and the runner's own process markers; everything a guardian
or a sidecar is told about the job itself comes from here (names and payloads: ``trainer_sidecar.contract``).
"""

from __future__ import annotations

from trainer_sidecar.contract.env import SidecarEnvironment, WorkerEnvironment
from trainer_sidecar.contract.settings import RemediationOrder
from trainguard.core.spec import GuardedTrainingJob


def worker_environment(
    job: GuardedTrainingJob,
    *,
    attempt: int,
    remediation: RemediationOrder | None,
    checkpoint_dir: str,
    status_file: str,
    termination_message_path: str,
    restarts: int = 0,
    run_seconds: float = 0.0,
) -> WorkerEnvironment:
    """What attempt ``attempt`` of ``job`` tells each worker's guardian, with the runner's paths and the
    job's failure history (``restarts`` gang restarts in ``run_seconds`` since it first started)."""
    return WorkerEnvironment(
        settings=job.spec.guardian_settings(),
        checkpoint_dir=checkpoint_dir,
        status_file=status_file,
        termination_message_path=termination_message_path,
        job_name=job.metadata.name,
        namespace=job.metadata.namespace,
        attempt=attempt,
        remediation=remediation,
        restarts=restarts,
        run_seconds=run_seconds,
    )


def sidecar_environment(
    job: GuardedTrainingJob, *, status_file: str, host: str | None, port: int
) -> SidecarEnvironment:
    """What each sidecar of ``job`` is told: the job's health timing, with the runner's file and address."""
    health = job.spec.health
    return SidecarEnvironment(
        status_file=status_file,
        host=host,
        port=port,
        hang_timeout_seconds=health.hang_timeout_seconds,
        startup_grace_seconds=health.startup_grace_seconds,
        job_name=job.metadata.name,
        namespace=job.metadata.namespace,
        local_ranks=job.spec.nproc_per_node,
        hang_timeout_floor_seconds=health.hang_timeout_floor_seconds,
    )
