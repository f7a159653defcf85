"""The Kubernetes API emulator of ``tests/support/kube_emulator.py``: its own behaviour."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import kmock
import pytest

from tests.support.kube_emulator import NS, VERBS, Emulator, selects
from tests.support.paths import REPO_ROOT


def test_label_selectors() -> None:
    labels = {"trainguard.dev/job": "a", "tier": "x"}
    assert selects("trainguard.dev/job=a", labels)
    assert selects("trainguard.dev/job==a,tier", labels)
    assert not selects("trainguard.dev/job=b", labels)
    assert not selects("tier!=x", labels)
    assert selects("!missing", labels)
    assert not selects("missing", labels)
    assert not selects("trainguard.dev/job=a", None)


@pytest.mark.asyncio
@pytest.mark.kmock(cls=Emulator)
async def test_the_emulator_lists_by_label_conflicts_on_stale_writes_and_stays_fast(
    kmock: kmock.KubernetesEmulator,
) -> None:
    kmock.resources["v1/configmaps"] = kmock.ResourceInfo(kind="ConfigMap", namespaced=True, verbs=VERBS)
    path = f"/api/v1/namespaces/{NS}/configmaps"
    for name, job in (("one", "a"), ("two", "b")):
        body = {"metadata": {"name": name, "labels": {"job": job}}, "data": {}}
        async with kmock.post(path, json=body) as response:
            assert response.status == 200
    async with kmock.get(path, params={"labelSelector": "job=b"}) as response:
        found = await response.json()
    assert [item["metadata"]["name"] for item in found["items"]] == ["two"]
    uid = kmock.objects["v1/configmaps", NS, "two"]["metadata"]["uid"]
    assert uid.startswith("uid-")

    stale = {"metadata": {"resourceVersion": "0"}, "data": {"k": "v"}}
    headers = {"Content-Type": "application/merge-patch+json"}
    async with kmock.patch(f"{path}/two", json=stale, headers=headers) as response:
        assert response.status == 409

    # A request is matched without replaying the history: with 200,000 requests on record (kmock's
    # own check would replay them all for each reaction, minutes), one more still takes milliseconds.
    kmock._requests.extend([kmock._requests[-1]] * 200_000)
    started = time.monotonic()
    async with kmock.get(f"{path}/one") as response:
        assert response.status == 200
    assert time.monotonic() - started < 2.0


@pytest.mark.slow
def test_the_operator_scale_bench_runs() -> None:
    """``python -m bench.operator_scale --quick`` (the operator against this emulator) ends with its JSON."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.operator_scale", "--quick"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["jobs"] == 20
    assert 0 < result["latency_p50_s"] <= result["latency_p99_s"] <= result["latency_max_s"]
    assert result["reconcile_steps"] >= 20
    assert result["steady_requests_per_s"] == 0  # idle jobs cost the API server nothing at rest
    assert result["operator_peak_rss_mb"] > 10
