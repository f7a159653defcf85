"""A job's identity: its namespace and name, as the epoch claims and the local runner's marks record it.

Both are Kubernetes names (a DNS-1123 label and subdomain), so neither holds a ``/``. The job's UID is not
part of it on purpose: a job deleted and re-applied under its name is the same job and resumes from its
checkpoints (the README promises that of a re-applied job).
"""

from __future__ import annotations

__all__ = ["job_identity", "same_job"]


def job_identity(namespace: str, name: str) -> str:
    """What a claim records as its job: ``<namespace>/<name>`` ("" for a writer naming no job; the name
    alone when no namespace is known). Neither a namespace nor a Kubernetes name holds a ``/``."""
    if not name:
        return ""
    return f"{namespace}/{name}" if namespace else name


def same_job(holder: str, claimant: str) -> bool:
    """Whether the job ``claimant`` may claim after ``holder`` (both as ``job_identity`` writes them).

    Namespace and name must both match. A holder naming the job alone (a claim written before namespaces
    were recorded) is matched by its name, so an upgraded job resumes its own directory; a claimant that
    names no namespace cannot prove it is the holder's job and is refused by a holder that names one.
    """
    if not holder or not claimant:  # a writer naming no job (a guardian run by hand)
        return True
    holder_ns, _, holder_name = holder.rpartition("/")
    claimant_ns, _, claimant_name = claimant.rpartition("/")
    if holder_name != claimant_name:
        return False
    return not holder_ns or holder_ns == claimant_ns
