"""The environment contract: what a runner writes is what the guardian and the sidecar read, and every
``TRAINGUARD_*`` name has one home."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from tests.support.paths import REPO_ROOT
from trainer_sidecar.contract import env
from trainer_sidecar.contract.settings import GuardianSettings, Remediation, RemediationOrder
from trainer_sidecar.guardian.config import GuardianConfig
from trainer_sidecar.sidecar.server import load_settings

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=40).filter(
    lambda s: s[0].isalpha() and s[-1] != "-"
)


@given(
    job=names,
    namespace=names,
    attempt=st.integers(min_value=1, max_value=10_000),
    lr_scale=st.floats(min_value=0.01, max_value=1.0),
    remediate=st.booleans(),
)
def test_the_guardian_reads_back_what_a_runner_writes(
    job: str, namespace: str, attempt: int, lr_scale: float, remediate: bool
) -> None:
    settings = GuardianSettings(status_interval_seconds=2.0)
    order = RemediationOrder.introduced_by(attempt, Remediation(lr_scale=lr_scale)) if remediate else None
    written = env.WorkerEnvironment(
        settings=settings,
        checkpoint_dir="/ckpt",
        status_file="/run/status.json",
        termination_message_path="/dev/termination-log",
        job_name=job,
        namespace=namespace,
        attempt=attempt,
        remediation=order,
    )
    read = GuardianConfig.from_env(written.variables())
    assert read.settings == settings
    assert (read.checkpoint_dir, read.status_file) == (Path("/ckpt"), Path("/run/status.json"))
    assert read.termination_message_path == Path("/dev/termination-log")
    assert (read.job, read.namespace, read.attempt) == (job, namespace, attempt)
    assert read.remediation == order


@given(
    hang=st.integers(min_value=2, max_value=86_400),
    grace=st.integers(min_value=0, max_value=86_400),
    port=st.integers(min_value=0, max_value=65_535),
    local_ranks=st.integers(min_value=1, max_value=8),
    job=names,
)
def test_the_sidecar_reads_back_what_a_runner_writes(
    hang: int, grace: int, port: int, local_ranks: int, job: str
) -> None:
    written = env.SidecarEnvironment(
        status_file="/run/status.json",
        host="127.0.0.1",
        port=port,
        hang_timeout_seconds=hang,
        startup_grace_seconds=grace,
        job_name=job,
        namespace="research",
        local_ranks=local_ranks,
    )
    read = load_settings({}, written.variables())
    assert (read.status_file, read.host, read.port) == (Path("/run/status.json"), "127.0.0.1", port)
    assert (read.hang_timeout_seconds, read.startup_grace_seconds) == (hang, grace)
    assert (read.job, read.namespace, read.local_ranks) == (job, "research", local_ranks)


def test_a_sidecar_without_a_host_listens_where_it_always_did() -> None:
    written = env.SidecarEnvironment("/s.json", None, 9400, 300, 600, "j", "ns", 1)
    assert env.SIDECAR_HOST_ENV not in written.variables()
    assert (
        load_settings({}, written.variables()).host
        == load_settings({}, {"TRAINGUARD_STATUS_FILE": "/s"}).host
    )


#: The operator's own configuration (its Deployment's variables), not something processes hand each other.
OPERATOR_PREFIX = "TRAINGUARD_OPERATOR_"
#: Where a name may be spelled out: the contract's homes for names.
PRODUCT = ("trainer_sidecar", "trainguard", "operator")
NAME_HOMES = {"trainer_sidecar/contract/env.py", "trainer_sidecar/contract/settings.py"}


def test_every_trainguard_variable_is_named_in_the_contract_only() -> None:
    """Product code refers to the contract's constants; a literal elsewhere is a second definition."""
    files = subprocess.run(
        [
            "git",
            "ls-files",
            "--cached",
            "--others",
            "--exclude-standard",
            "trainer_sidecar",
            "trainguard",
            "operator",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    literal = re.compile(r"""["'](TRAINGUARD_[A-Z0-9_]*)["']""")
    found = {
        (name, match)
        for name in files
        if name.endswith(".py") and name not in NAME_HOMES and (REPO_ROOT / name).exists()
        for match in literal.findall((REPO_ROOT / name).read_text())
        if not match.startswith(OPERATOR_PREFIX)
    }
    assert found == set()


def test_the_contract_names_each_variable_once() -> None:
    values = [value for key, value in vars(env).items() if key.endswith("_ENV")]
    assert len(values) == len(set(values))
    assert all(value.startswith(env.PREFIX) for value in values)
