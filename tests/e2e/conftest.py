"""Fixtures of the end-to-end tier: the real control plane and the whole test cluster."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import cluster, controlplane, trainer


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[controlplane.ControlPlane]:
    """A real etcd + kube-apiserver on free 127.0.0.1 ports for the whole session (``controlplane``).

    The binaries come from ``bash scripts/control-plane.sh`` (which ``.ci/run`` runs), or from the
    directory in ``TRAINGUARD_CONTROL_PLANE_BIN``. Without them the tests that use this fixture are
    skipped on a developer's machine and fail under CI (``CI`` set), where a skip would hide a broken
    build step. Both processes are stopped by PID at the end of the session.
    """
    configured = os.environ.get("TRAINGUARD_CONTROL_PLANE_BIN")
    bin_dir = Path(configured) if configured else controlplane.bin_dir_from_script()
    missing = controlplane.missing_binaries(bin_dir)
    if missing:
        message = f"{', '.join(missing)} not built in {bin_dir}: run bash scripts/control-plane.sh"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    plane = controlplane.start(bin_dir, tmp_path_factory.mktemp("control-plane"))
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def e2e_cluster(
    control_plane: controlplane.ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[cluster.Cluster]:
    """The whole test cluster on the session's control plane (``cluster``): kube-controller-manager,
    kube-scheduler and the Kubeflow training operator, and a real node (containerd, the kubelet,
    kube-proxy, CoreDNS) running pods from the images of ``scripts/images.sh``.

    No trainguard operator is installed: modules that need it install the Helm chart
    (``e2e_cluster.install_operator()``) and uninstall it, so it does not reconcile the objects other
    tests write by hand. Where the node cannot run (not root, a package, binary or image missing, helm
    not built) the tests that use it are skipped on a developer's machine and fail under CI.
    """
    missing = controlplane.missing_binaries(control_plane.bin_dir, components=True)
    reason = f"{', '.join(missing)} not built: run bash scripts/control-plane.sh" if missing else None
    reason = reason or cluster.why_not_runnable(control_plane.bin_dir)
    if reason:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    running = cluster.start(control_plane, tmp_path_factory.mktemp("cluster"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def kubeflow_trainer(control_plane: controlplane.ControlPlane) -> Iterator[trainer.Trainer]:
    """Kubeflow Trainer v2 on the session's control plane (``trainer``): the JobSet controller and
    Trainer's controller manager as host processes, their CRDs and webhooks installed, and Trainer's
    shipped ``torch-distributed`` ClusterTrainingRuntime applied.

    The binaries come from ``bash scripts/trainer.sh`` (which ``.ci/run`` runs), or from the directory
    in ``TRAINGUARD_TRAINER_BIN``. Without them the tests that use this fixture are skipped on a
    developer's machine and fail under CI. Both are stopped at the end of the session, their webhook
    configurations removed first.
    """
    directory = trainer.bin_dir()
    reason = trainer.why_not_runnable(directory)
    if reason:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    running = trainer.start(control_plane, directory)
    try:
        yield running
    finally:
        running.stop()
