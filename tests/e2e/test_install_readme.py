"""The README's "Install on a cluster" section, run as written against the test cluster.

The commands are read from the README (every ``bash`` block of that section, in order; nothing here keeps
a copy of them) and run by bash one logical line at a time, in the repository, with what a user has:
``KUBECONFIG`` (the test cluster's admin), ``helm`` and ``kubectl`` on the PATH, and ``REGISTRY``, the one
variable the section sets, pointed at a registry on this machine (Debian's docker-registry, on a free
port of 127.0.0.1) instead of the placeholder. So the images really are pushed (``scripts/images.sh
push``, skopeo), the chart's operator and the example's workers really are pulled from that registry by
the node's containerd, and the job really trains. The watch (``kubectl get gtj -w``) runs until it shows
the job stepping; the other commands run to their end and must succeed.

What the test does as the cluster's administrator around the section, because a real cluster would
have it: a PersistentVolume for the example's claim (the test cluster has no storage class), and the
CRD adopted into the release if an earlier test installed it (as the chart's README says).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import controlplane, tools
from tests.support.cluster import OPERATOR_NAMESPACE, OPERATOR_RELEASE, Cluster, wait_for
from tests.support.controlplane import Process
from tests.support.jobs import JOB, persistent_volume
from tests.support.manifests import get_gtj_header
from tests.support.paths import REPO_ROOT
from tests.support.ports import free_port

README = REPO_ROOT / "README.md"
SECTION = "## Install on a cluster"
NAMESPACE = "ml"  # where the section runs its job
#: The variables the section sets with ``export``, which the test sets itself.
DOCUMENTED_VARIABLES = {"REGISTRY"}
#: The watch has shown enough once the job is past this step.
WATCHED_STEP = 20


def section_blocks() -> list[list[str]]:
    """The section's ``bash`` blocks, each as its logical command lines (continuations joined, comments
    and blank lines dropped)."""
    text = README.read_text()
    start = text.index(f"\n{SECTION}\n")
    end = text.index("\n## ", start + 1)
    blocks = re.findall(r"^```bash\n(.*?)^```", text[start:end], flags=re.MULTILINE | re.DOTALL)
    result = []
    for block in blocks:
        joined = block.replace("\\\n", " ")
        lines = [" ".join(line.split()) for line in joined.splitlines()]
        result.append([line for line in lines if line and not line.startswith("#")])
    return result


@dataclass
class Registry:
    """A container registry on this machine: its process and its ``host:port``."""

    process: Process
    host: str


@pytest.fixture(scope="module")
def registry(e2e_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """Debian's docker-registry (``scripts/control-plane.sh`` takes its binary out of the package) on a
    free port of 127.0.0.1, storing in a temp dir, trusted by the node over plain HTTP."""
    binary = e2e_cluster.plane.bin_dir / "registry"
    if not os.access(binary, os.X_OK):
        pytest.fail(f"{binary} is missing: run bash scripts/control-plane.sh", pytrace=False)
    state = tmp_path_factory.mktemp("registry")
    host = f"127.0.0.1:{free_port()}"
    config = state / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {state / 'data'}\n"
        f"http:\n  addr: {host}\n"
    )
    process = Process("registry", [str(binary), "serve", str(config)], state / "registry.log")
    process.start(die_with_parent=True)

    def serving() -> bool:
        if not process.alive():
            raise AssertionError(f"the registry exited:\n{process.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://{host}/v2/", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    try:
        wait_for("the registry to serve", serving, timeout=30)
        e2e_cluster.node.trust_registry(host)
        yield Registry(process, host)
    finally:
        process.stop()


def user_environment(cluster: Cluster, registry: Registry, scratch: Path) -> dict[str, str]:
    """What the section expects of the user's shell: the cluster's kubeconfig, helm and kubectl on the
    PATH, REGISTRY set; and skopeo told that the test's registry speaks plain HTTP, in the user's
    containers registries.conf (``~/.config/containers``, as a user whose registry is plain HTTP has it):
    a scratch HOME holds it (Debian's skopeo 1.9 ignores CONTAINERS_REGISTRIES_CONF). The build cache
    stays the machine's (``TRAINGUARD_CACHE``), which the new HOME would otherwise move."""
    home = scratch / "home"
    registries_conf = home / ".config" / "containers" / "registries.conf"
    registries_conf.parent.mkdir(parents=True)
    registries_conf.write_text(f'[[registry]]\nlocation = "{registry.host}"\ninsecure = true\n')
    kubectl = controlplane.find_kubectl(cluster.plane.bin_dir)
    cache = os.environ.get("TRAINGUARD_CACHE") or str(Path.home() / ".cache" / "trainguard")
    return {
        **tools.helm_environ(),
        "KUBECONFIG": str(cluster.plane.kubeconfig),
        "PATH": os.pathsep.join([str(tools.bin_dir()), str(kubectl.parent), os.environ["PATH"]]),
        "REGISTRY": f"{registry.host}/ml",
        "HOME": str(home),
        "TRAINGUARD_CACHE": cache,
    }


def run(command: str, environment: dict[str, str], timeout: float = 600) -> str:
    """One command line of the section, run by bash in the repository; its stdout (it must succeed)."""
    result = subprocess.run(
        ["bash", "-c", f"set -euo pipefail\n{command}"],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, (
        f"`{command}` exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    )
    return result.stdout


def watch(command: str, environment: dict[str, str], timeout: float) -> list[str]:
    """Run the section's watch until a row shows the job past WATCHED_STEP; the lines it printed."""
    process = subprocess.Popen(
        ["bash", "-c", command], cwd=REPO_ROOT, env=environment, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        for line in process.stdout:
            lines.append(line.rstrip())
            words = line.split()
            if (
                words[:1] == [JOB]
                and len(words) >= 3
                and words[2].isdigit()
                and int(words[2]) >= WATCHED_STEP
            ):
                return lines
            assert time.monotonic() < deadline, "\n".join(lines)
        raise AssertionError(f"`{command}` ended:\n" + "\n".join(lines))
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.timeout(1200)
def test_the_readme_install_section_runs_as_written(
    e2e_cluster: Cluster, registry: Registry, tmp_path: Path
) -> None:
    cluster = e2e_cluster
    blocks = section_blocks()
    assert len(blocks) == 5, blocks  # build and push, install, run, watch, remove
    push, install, apply, observe, remove = blocks
    environment = user_environment(cluster, registry, tmp_path)
    reference = environment["REGISTRY"]

    # 1. Build and push: the section sets REGISTRY (to the placeholder); the test's value stands in.
    exports = [line for line in push if line.startswith("export ")]
    assert {word.split("=")[0] for line in exports for word in line.split()[1:]} == DOCUMENTED_VARIABLES
    pushed = "".join(run(line, environment, timeout=900) for line in push if line not in exports)
    assert pushed.split() == [f"{reference}/trainguard:0.1.0", f"{reference}/tiny-lm:0.1.0"]

    # 2. Install the chart (the CRD adopted first, should an earlier release have kept it).
    cluster.adopt_crd(OPERATOR_RELEASE, OPERATOR_NAMESPACE)
    for line in install:
        run(line, environment)
    (operator_pod,) = cluster.items("pods", OPERATOR_NAMESPACE, "app.kubernetes.io/component=operator")
    assert operator_pod["spec"]["containers"][0]["image"] == f"{reference}/trainguard:0.1.0"

    # 3. The example job, with a volume for its claim.
    volume = tmp_path / "checkpoints"
    volume.mkdir()
    volume.chmod(0o777)
    cluster.kubectl(
        "apply", "-f", "-", stdin=json.dumps(persistent_volume(f"{NAMESPACE}-ckpt", NAMESPACE, volume))
    )
    try:
        for line in apply:
            run(line, environment)

        # 4. Watch it train; its Events and the operator's metrics tell the same.
        (watch_line,) = [line for line in observe if " -w" in line]
        rows = watch(watch_line, environment, timeout=600)
        assert rows[0].split() == get_gtj_header(), rows
        outputs = [run(line, environment) for line in observe if line != watch_line]
        assert any("AttemptCreated" in out for out in outputs), outputs
        steps = [
            float(line.rpartition(" ")[2])
            for out in outputs
            for line in out.splitlines()
            if line.startswith(f'trainguard_job_step{{job="{JOB}",namespace="{NAMESPACE}"}}')
        ]
        assert steps, outputs
        assert steps[0] >= 1, outputs
        # The node's containerd pulled the workers' image from the registry.
        pods = cluster.items("pods", NAMESPACE, f"trainguard.dev/job={JOB}")
        assert {p["spec"]["containers"][0]["image"] for p in pods} == {f"{reference}/tiny-lm:0.1.0"}
        pulled = [
            e["message"]
            for e in cluster.items("events", NAMESPACE)
            if e["reason"] == "Pulled" and f"{reference}/tiny-lm:0.1.0" in e["message"]
        ]
        assert pulled, cluster.kubectl("get", "events", "-n", NAMESPACE)

        # 5. Remove it: the namespace, the release and its pods go.
        for line in remove:
            run(line, environment)
        assert cluster.plane.kubectl("get", "namespace", NAMESPACE, check=False).returncode != 0
        wait_for(
            "the operator's pods to go",
            lambda: not cluster.items("pods", OPERATOR_NAMESPACE, "app.kubernetes.io/component=operator"),
            timeout=120,
        )
    finally:
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=true", "--timeout=120s", check=False)
        cluster.kubectl("delete", "pv", f"{NAMESPACE}-ckpt", "--wait=false", check=False)
        subprocess.run(
            [str(tools.bin_dir() / "helm"), f"--kubeconfig={cluster.plane.kubeconfig}", "uninstall",
             OPERATOR_RELEASE, f"--namespace={OPERATOR_NAMESPACE}", "--wait", "--ignore-not-found"],
            env=tools.helm_environ(), capture_output=True, timeout=180,
        )  # fmt: skip
