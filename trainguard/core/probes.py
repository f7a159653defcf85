"""The liveness probe numbers both runners use: rendered for the kubelet, applied by ``trainguard run``."""

from __future__ import annotations


def probe_timing(period_seconds: int) -> dict[str, int]:
    """Liveness probe numbers for a probe period.

    * ``failureThreshold`` 3: the sidecar's ``/healthz`` already waits the hang timeout (and the startup
      grace before the first step) before it fails, so the kubelet only needs to ride out a transient
      miss (a sidecar starved of CPU for a moment); three periods of failure is the Kubernetes default
      and adds at most ~3 periods to detection.
    * ``timeoutSeconds`` min(5, period): the answer is a file read, but the pod's cores may be saturated
      by training and data loading; 1 s (the default) would produce false failures.
    """
    return {"liveness_failure_threshold": 3, "timeout_seconds": max(1, min(5, period_seconds))}
