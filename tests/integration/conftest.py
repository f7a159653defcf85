"""Fixtures of the integration tier: the kmock cluster with the CRDs, the ranks' sidecars, the operator's
settings."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import kmock
import pytest
import pytest_asyncio

from tests.support.kubeflow import pytorchjob_crd
from tests.support.operator_harness import Sidecars, configure_operator, install_crd, prepare_cluster


@pytest_asyncio.fixture
async def bare_cluster(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> kmock.KubernetesEmulator:
    """kmock with the GuardedTrainingJob CRD (no PyTorchJob CRD), pods and events, and a kubeconfig."""
    return await prepare_cluster(kmock, tmp_path, monkeypatch)


@pytest_asyncio.fixture
async def cluster(bare_cluster: kmock.KubernetesEmulator) -> kmock.KubernetesEmulator:
    """``bare_cluster`` with the Kubeflow PyTorchJob CRD installed."""
    await install_crd(bare_cluster, pytorchjob_crd())
    return bare_cluster


@pytest.fixture
def sidecars(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Sidecars]:
    """Two ranks' sidecars; an indirect parameter sets their hang timeout (default 30 s)."""
    found = Sidecars(tmp_path / "sidecars", 2, hang_timeout_seconds=float(getattr(request, "param", 30)))
    yield found
    found.stop()


@pytest.fixture
def operator_env(monkeypatch: pytest.MonkeyPatch, sidecars: Sidecars) -> int:
    """The operator's settings for the tests; returns the metrics port."""
    return configure_operator(monkeypatch, sidecars.port)
