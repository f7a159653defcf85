"""GuardedTrainingJob -> PyTorchJob rendering: validity against the Kubeflow v1.9.0 CRD schema, every
injected piece, and names that stay valid DNS labels for any job name and attempt."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from trainguard_operator.render import (
    ATTEMPT_LABEL,
    JOB_LABEL,
    MAX_JOB_NAME,
    NCCL_FAIL_FAST,
    RANK_LAYOUT_LABEL,
    RANKS_BY_WORKER_INDEX,
    REPLICA_INDEX_LABEL,
    SIDECAR_CONTAINER,
    STATUS_DIR,
    STATUS_FILE,
    FailureHistory,
    Owner,
    RenderError,
    is_dns1035_label,
    pytorchjob_name,
    render_pod_template,
    render_pytorchjob,
    rendered_world,
    stop_grace_seconds,
)
from trainguard_operator.settings import OperatorSettings

from tests.support.manifests import USER_ENV, gtj_manifest, load, schema_errors
from tests.support.paths import REPO_ROOT
from trainer_sidecar.contract.env import (
    GANG_ENV,
    HANG_TIMEOUT_ENV,
    HANG_TIMEOUT_FLOOR_ENV,
    JOB_NAME_ENV,
    LOCAL_RANKS_ENV,
    NAMESPACE_ENV,
    RUN_ENV,
    SIDECAR_HOST_ENV,
    SIDECAR_PORT_ENV,
    STARTUP_GRACE_ENV,
    STATUS_FILE_ENV,
)
from trainer_sidecar.contract.settings import GuardianSettings, Remediation, RemediationOrder
from trainguard.core.spec import load_job
from trainguard.local.runner import LocalRunner

SETTINGS = OperatorSettings(sidecar_image="registry.example/trainguard:test")
OWNER = Owner(name="tiny-lm", namespace="research", uid="0b7d7c4e-5f0e-4a55-9d61-0123456789ab")


def containers(manifest: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(replica type, pod template) of every replica."""
    for kind, replica in manifest["spec"]["pytorchReplicaSpecs"].items():
        yield kind, replica["template"]


def env_of(container: Mapping[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


RENDEZVOUS_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "PET_NODE_RANK",
)


def named(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [item for item in items if item["name"] == name]
    return found


def no_nulls(value: Any) -> bool:
    if isinstance(value, dict):
        return all(v is not None and no_nulls(v) for v in value.values())
    if isinstance(value, list):
        return all(v is not None and no_nulls(v) for v in value)
    return True


def test_the_strict_schema_catches_what_the_api_server_would_prune() -> None:
    manifest = render_pytorchjob(load(gtj_manifest()), OWNER, 1, None, SETTINGS)
    assert schema_errors(manifest) == []
    broken = copy.deepcopy(manifest)
    broken["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["initContainers"][-1][
        "restartPolicyy"
    ] = "Always"
    assert any("restartPolicyy" in e for e in schema_errors(broken))
    broken = copy.deepcopy(manifest)
    broken["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "one"
    assert schema_errors(broken)


@pytest.mark.parametrize(("replicas", "nproc"), [(1, 1), (3, 1), (2, 4)])
def test_the_world_a_pytorchjob_was_rendered_for_reads_back_from_it(replicas: int, nproc: int) -> None:
    job = load(gtj_manifest(replicas=replicas, nprocPerNode=nproc))
    manifest = render_pytorchjob(job, OWNER, 1, None, SETTINGS)
    assert rendered_world(manifest) == {"replicas": replicas, "nprocPerNode": nproc}


@pytest.mark.parametrize(
    "spec",
    [None, "x", {}, {"pytorchReplicaSpecs": []}, {"pytorchReplicaSpecs": {"Worker": {}}},
     {"pytorchReplicaSpecs": {"Worker": {"replicas": "one"}}},
     {"pytorchReplicaSpecs": {"Worker": {"replicas": 0}}},
     {"pytorchReplicaSpecs": {"Worker": {"replicas": 2}}, "nprocPerNode": "auto"}],
)  # fmt: skip
def test_a_pytorchjob_whose_spec_does_not_say_its_world_reads_as_none(spec: object) -> None:
    assert rendered_world({"spec": spec}) is None


REMEDIATION = RemediationOrder.introduced_by(3, Remediation(lr_scale=0.25, max_grad_norm=0.2))
CASES = [
    pytest.param(
        replicas,
        remediation,
        nccl_override,
        id=f"r{replicas}-{label}-{'override' if nccl_override else 'plain'}",
    )
    for replicas in (1, 2, 4)
    for remediation, label in ((None, "fresh"), (REMEDIATION, "remedied"))
    for nccl_override in (False, True)
]


@pytest.mark.parametrize(("replicas", "remediation", "nccl_override"), CASES)
def test_rendered_pytorchjob_is_valid_and_complete(
    replicas: int, remediation: RemediationOrder | None, nccl_override: bool
) -> None:
    user_env = copy.deepcopy(USER_ENV)
    if nccl_override:
        user_env += [
            {"name": "NCCL_IB_TIMEOUT", "value": "23"},
            {"name": "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "value": "900"},
        ]
    job = load(gtj_manifest(replicas=replicas, env=user_env))
    attempt = 3 if remediation else 1
    manifest = render_pytorchjob(job, OWNER, attempt, remediation, SETTINGS)

    assert schema_errors(manifest) == []
    assert no_nulls(manifest)
    meta = manifest["metadata"]
    assert manifest["apiVersion"] == "kubeflow.org/v1"
    assert manifest["kind"] == "PyTorchJob"
    assert meta["name"] == f"tiny-lm-{attempt}"
    assert meta["namespace"] == "research"
    assert meta["labels"][JOB_LABEL] == "tiny-lm"
    assert meta["labels"][ATTEMPT_LABEL] == str(attempt)
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "trainguard.dev/v1alpha1",
            "kind": "GuardedTrainingJob",
            "name": "tiny-lm",
            "uid": OWNER.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    # Workers only: Worker i is rank i, and no init container waits for a Master (render's docstring).
    assert set(specs) == {"Worker"}
    assert specs["Worker"]["replicas"] == replicas
    assert manifest["spec"]["runPolicy"] == {"cleanPodPolicy": "None"}

    settings_json = job.spec.guardian_settings().model_dump_json(by_alias=True)
    for kind, template in containers(manifest):
        assert specs[kind]["restartPolicy"] == "Never", kind
        pod = template["spec"]
        assert pod["restartPolicy"] == "Never"
        labels = template["metadata"]["labels"]
        assert labels == {
            "team": "nlp",
            JOB_LABEL: "tiny-lm",
            ATTEMPT_LABEL: str(attempt),
            RANK_LAYOUT_LABEL: RANKS_BY_WORKER_INDEX,
        }
        assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]

        worker = named(pod["containers"], "pytorch")
        # The user's container is kept as written...
        assert worker["image"] == "registry.example/tiny-lm:1"
        assert worker["command"] == ["python", "train.py"]
        assert worker["args"] == ["--max-steps", "1000"]
        assert worker["resources"] == {"limits": {"nvidia.com/gpu": 1}}
        env = env_of(worker)
        assert len(env) == len(worker["env"]), "an env name appears twice"
        assert env["TRAINGUARD_FAULTS"] == "nan_loss@100x4"
        assert env["DATA_DIR"] == "/data"
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        # ...plus the guardian's environment...
        assert (
            GuardianSettings.model_validate_json(env["TRAINGUARD_SETTINGS"]) == job.spec.guardian_settings()
        )
        assert env["TRAINGUARD_SETTINGS"] == settings_json
        assert env["TRAINGUARD_CHECKPOINT_DIR"] == "/ckpt"
        assert env["TRAINGUARD_STATUS_FILE"] == STATUS_FILE
        assert env["TRAINGUARD_JOB_NAME"] == "tiny-lm"
        assert env["TRAINGUARD_NAMESPACE"] == "research"
        assert env["TRAINGUARD_ATTEMPT"] == str(attempt)
        if remediation is None:
            assert "TRAINGUARD_REMEDIATION" not in env
        else:
            assert json.loads(env["TRAINGUARD_REMEDIATION"]) == {
                "id": "attempt-3",
                "lrScale": 0.25,
                "maxGradNorm": 0.2,
            }
        # ...torch.distributed's rendezvous, which the training operator sets only with a Master...
        rank = {"fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.labels['{REPLICA_INDEX_LABEL}']"}}
        assert {k: env[k] for k in RENDEZVOUS_ENV} == {
            "MASTER_ADDR": f"tiny-lm-{attempt}-worker-0",
            "MASTER_PORT": "23456",
            "PET_MASTER_ADDR": f"tiny-lm-{attempt}-worker-0",
            "PET_MASTER_PORT": "23456",
            "WORLD_SIZE": str(replicas),
            "RANK": rank,
            "PET_NODE_RANK": rank,
        }
        assert named(worker["ports"], "pytorchjob-port")["containerPort"] == 23456
        # ...and the NCCL fail-fast settings, unless the user set them.
        expected_nccl = dict(NCCL_FAIL_FAST)
        if nccl_override:
            expected_nccl |= {"NCCL_IB_TIMEOUT": "23", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900"}
        assert {k: env[k] for k in NCCL_FAIL_FAST} == expected_nccl
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"

        assert {(m["name"], m["mountPath"]) for m in worker["volumeMounts"]} == {
            ("trainguard-status", STATUS_DIR),
            ("trainguard-checkpoints", "/ckpt"),
        }
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["trainguard-checkpoints"]["persistentVolumeClaim"] == {"claimName": "tiny-lm-ckpt"}
        assert "emptyDir" in volumes["trainguard-status"]

        assert env["TRAINGUARD_TERMINATION_MESSAGE_PATH"] == "/dev/termination-log"
        liveness = worker["livenessProbe"]
        assert liveness["httpGet"] == {"path": "/healthz", "port": 9400, "scheme": "HTTP"}
        assert liveness["periodSeconds"] == 10
        assert liveness["failureThreshold"] == 3
        assert liveness["timeoutSeconds"] == 5
        # A hung worker cannot checkpoint: its probe's kill is short, the pod's stop grace stays long.
        assert liveness["terminationGracePeriodSeconds"] == 1
        assert pod["terminationGracePeriodSeconds"] >= 60
        # Nothing may hold Worker 0's readiness until the gang steps (see render_pod_template).
        assert "startupProbe" not in worker
        assert "readinessProbe" not in worker

        (side,) = [c for c in pod["initContainers"] if c["name"] == SIDECAR_CONTAINER]
        assert pod["initContainers"][-1] is side
        assert side["restartPolicy"] == "Always"
        assert side["image"] == "registry.example/trainguard:test"
        assert side["imagePullPolicy"] == "IfNotPresent"
        assert side["command"] == ["trainguard-sidecar"]
        assert side["resources"] == SETTINGS.sidecar_resources
        assert side["ports"] == [{"name": "tg-sidecar", "containerPort": 9400, "protocol": "TCP"}]
        assert side["volumeMounts"] == [
            {"name": "trainguard-status", "mountPath": STATUS_DIR, "readOnly": True}
        ]
        security = side["securityContext"]
        assert security["runAsNonRoot"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["readOnlyRootFilesystem"] is True
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
        side_env = env_of(side)
        # Exactly the variables the sidecar reads its flags from, with values matching the worker's.
        assert set(side_env) == {
            STATUS_FILE_ENV,
            SIDECAR_PORT_ENV,
            HANG_TIMEOUT_ENV,
            HANG_TIMEOUT_FLOOR_ENV,
            STARTUP_GRACE_ENV,
            JOB_NAME_ENV,
            NAMESPACE_ENV,
            LOCAL_RANKS_ENV,
        }
        assert side_env[LOCAL_RANKS_ENV] == "1"
        assert side_env[STATUS_FILE_ENV] == env["TRAINGUARD_STATUS_FILE"]
        assert side_env[SIDECAR_PORT_ENV] == "9400"
        assert side_env[HANG_TIMEOUT_ENV] == "300"
        assert side_env[HANG_TIMEOUT_FLOOR_ENV] == "10"
        assert side_env[STARTUP_GRACE_ENV] == "605"


def test_the_worker_environment_matches_the_local_runner(tmp_path: Path) -> None:
    """The operator and ``trainguard run`` hand a worker the same trainguard variables and values."""
    job = load(gtj_manifest(env=USER_ENV[:2]))  # no valueFrom: the local runner has no cluster
    runner = LocalRunner(job, checkpoint_root=tmp_path, run_dir=tmp_path)
    runner.attempt = 2
    runner.restarts = 1
    runner.remediation = RemediationOrder.introduced_by(2, Remediation())
    local = {
        k: v
        for k, v in runner.worker_env(0, 29500, tmp_path / "s.json").items()
        # The runner's own ways to find a gang's processes and a killed run's; a kubelet has cgroups.
        if k.startswith("TRAINGUARD_") and k not in (GANG_ENV, RUN_ENV)
    }
    history = FailureHistory(restarts=1, run_seconds=float(local["TRAINGUARD_RUN_SECONDS"]))
    order = RemediationOrder.introduced_by(2, Remediation())
    manifest = render_pytorchjob(job, OWNER, 2, order, SETTINGS, history=history)
    worker = named(
        manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"], "pytorch"
    )
    rendered = {k: v for k, v in env_of(worker).items() if k.startswith("TRAINGUARD_")}
    assert set(rendered) == set(local)  # both hand a worker a termination-message file too
    for key in (
        "TRAINGUARD_SETTINGS",
        "TRAINGUARD_JOB_NAME",
        "TRAINGUARD_NAMESPACE",
        "TRAINGUARD_ATTEMPT",
        "TRAINGUARD_FAULTS",
        "TRAINGUARD_RESTARTS",
        "TRAINGUARD_RUN_SECONDS",
    ):
        assert rendered[key] == local[key], key
    assert json.loads(rendered["TRAINGUARD_REMEDIATION"]) == json.loads(local["TRAINGUARD_REMEDIATION"])


def test_a_first_attempt_tells_the_worker_it_has_no_failure_history_like_the_local_runner(
    tmp_path: Path,
) -> None:
    """Attempt 1 is told 0 restarts in 0 s by both runners, not left to whatever the environment holds:
    a job's own TRAINGUARD_RESTARTS (copied from a pod of an earlier run, say) would otherwise size the
    first attempt's ``everySteps: auto`` interval from a failure rate this job never had."""
    user = [
        {"name": "TRAINGUARD_RESTARTS", "value": "7"},
        {"name": "TRAINGUARD_RUN_SECONDS", "value": "3600"},
    ]
    job = load(gtj_manifest(env=user))
    runner = LocalRunner(job, checkpoint_root=tmp_path, run_dir=tmp_path)
    runner.attempt = 1  # as the run loop sets it when it starts the first attempt
    assert runner.restarts == 0
    local = runner.worker_env(0, 29500, tmp_path / "s.json")
    manifest = render_pytorchjob(job, OWNER, 1, None, SETTINGS)
    worker = named(
        manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"], "pytorch"
    )
    rendered = env_of(worker)
    for key in ("TRAINGUARD_RESTARTS", "TRAINGUARD_RUN_SECONDS"):
        assert rendered[key] == local[key] == "0", key
    assert [e["name"] for e in worker["env"]].count("TRAINGUARD_RESTARTS") == 1


def test_the_sidecar_environment_matches_the_local_runner(tmp_path: Path) -> None:
    """Both runners tell a sidecar the same job and timing; only its file and address are their own."""
    health = {"hangTimeoutSeconds": 120, "startupGraceSeconds": 30}
    job = load(gtj_manifest(env=[], health=health, nprocPerNode=2))
    runner = LocalRunner(job, checkpoint_root=tmp_path, run_dir=tmp_path)
    local = {k: v for k, v in runner.sidecar_env(tmp_path / "s.json").items() if k.startswith("TRAINGUARD_")}
    manifest = render_pytorchjob(job, OWNER, 1, None, SETTINGS)
    pod = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    rendered = env_of(named(pod["initContainers"], SIDECAR_CONTAINER))
    own = {STATUS_FILE_ENV, SIDECAR_PORT_ENV, SIDECAR_HOST_ENV}
    assert set(rendered) - own == set(local) - own
    for key in set(rendered) - own:
        assert rendered[key] == local[key], key
    assert local[HANG_TIMEOUT_ENV] == "120"
    assert local[LOCAL_RANKS_ENV] == "2"
    assert local[STATUS_FILE_ENV] == str(tmp_path / "s.json")
    assert (local[SIDECAR_HOST_ENV], local[SIDECAR_PORT_ENV]) == ("127.0.0.1", "0")


def test_trainguard_variables_replace_the_users_like_the_local_runner() -> None:
    env = [
        {"name": "TRAINGUARD_STATUS_FILE", "value": "/elsewhere.json"},
        {"name": "TRAINGUARD_ATTEMPT", "value": "9"},
    ]
    manifest = render_pytorchjob(load(gtj_manifest(env=env)), OWNER, 1, None, SETTINGS)
    worker = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    names = [e["name"] for e in worker["env"]]
    assert names.count("TRAINGUARD_STATUS_FILE") == 1
    assert env_of(worker)["TRAINGUARD_STATUS_FILE"] == STATUS_FILE
    assert env_of(worker)["TRAINGUARD_ATTEMPT"] == "1"


def test_other_containers_and_init_containers_are_kept() -> None:
    manifest = gtj_manifest()
    pod = manifest["spec"]["template"]["spec"]
    pod["containers"].append({"name": "log-shipper", "image": "fluent-bit:3"})
    pod["initContainers"] = [{"name": "fetch-data", "image": "busybox", "command": ["true"]}]
    rendered = render_pytorchjob(load(manifest), OWNER, 1, None, SETTINGS)
    assert schema_errors(rendered) == []
    spec = rendered["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert [c["name"] for c in spec["containers"]] == ["pytorch", "log-shipper"]
    assert "livenessProbe" not in spec["containers"][1]
    assert [c["name"] for c in spec["initContainers"]] == ["fetch-data", SIDECAR_CONTAINER]


def test_liveness_probe_timing_for_any_period() -> None:
    for period in (1, 3, 5, 10, 60):
        manifest = gtj_manifest(
            health={
                "hangTimeoutSeconds": period + 1,
                "startupGraceSeconds": 600,
                "probePeriodSeconds": period,
            }
        )
        template = gtj_manifest()["spec"]["template"]
        template["spec"]["containers"][0]["startupProbe"] = {"exec": {"command": ["true"]}}
        manifest["spec"]["template"] = template
        rendered = render_pytorchjob(load(manifest), OWNER, 1, None, SETTINGS)
        worker = rendered["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
        assert worker["livenessProbe"]["periodSeconds"] == period
        assert worker["livenessProbe"]["timeoutSeconds"] == min(5, period)
        assert "startupProbe" not in worker  # the user's would hold the liveness probe off


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda pod: pod["volumes"].append({"name": "trainguard-status", "emptyDir": {}}), "volumes"),
        (
            lambda pod: (
                pod["containers"][0]
                .setdefault("volumeMounts", [])
                .append({"name": "x", "mountPath": "/ckpt"})
            ),
            "volumeMounts",
        ),
        (lambda pod: pod["containers"].append({"name": SIDECAR_CONTAINER, "image": "x"}), SIDECAR_CONTAINER),
    ],
)
def test_collisions_with_reserved_names_are_refused(mutate: Any, field: str) -> None:
    manifest = gtj_manifest()
    manifest["spec"]["template"]["spec"].setdefault("volumes", [])
    mutate(manifest["spec"]["template"]["spec"])
    with pytest.raises(RenderError, match=field):
        render_pytorchjob(load(manifest), OWNER, 1, None, SETTINGS)


# -------------------------------------------------------------------------------------- names ---
JOB_NAMES = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)
ATTEMPTS = st.integers(min_value=1, max_value=10**12 - 1)


@given(JOB_NAMES, ATTEMPTS)
def test_names_are_dns_labels_for_any_job_name_and_attempt(name: str, attempt: int) -> None:
    job = pytorchjob_name(name, attempt)
    assert len(job) <= MAX_JOB_NAME
    assert is_dns1035_label(job), job
    # The training operator's pod and service names for every replica index a job can have.
    for suffix in ("-worker-0", "-worker-4095"):
        assert is_dns1035_label(job + suffix), job + suffix
    assert pytorchjob_name(name, attempt) == job  # stable: recomputed after an operator restart


@given(JOB_NAMES, ATTEMPTS, JOB_NAMES, ATTEMPTS)
def test_distinct_jobs_and_attempts_get_distinct_names(name1: str, a1: int, name2: str, a2: int) -> None:
    if (name1, a1) != (name2, a2):
        assert pytorchjob_name(name1, a1) != pytorchjob_name(name2, a2)


def test_long_and_digit_names_are_shortened_with_a_hash() -> None:
    long_a, long_b = "a" * 62 + "b", "a" * 62 + "c"
    assert pytorchjob_name(long_a, 1) != pytorchjob_name(long_b, 1)
    assert pytorchjob_name(long_a, 1).endswith("-1")
    assert pytorchjob_name("7b-model", 2).startswith("tg-7b-model-")
    assert pytorchjob_name("tiny-lm", 12) == "tiny-lm-12"
    with pytest.raises(ValueError, match="attempt"):
        pytorchjob_name("x", 0)


def test_the_kubernetes_example_is_valid_and_renders() -> None:
    example = REPO_ROOT / "examples/k8s/job.yaml"
    job = load_job(example)
    manifest = render_pytorchjob(job, Owner("tiny-lm", "default", "uid"), 1, None, SETTINGS)
    assert schema_errors(manifest) == []
    assert manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == job.spec.replicas == 2
    documents = list(yaml.safe_load_all(example.read_text()))
    (claim,) = [d for d in documents if d["kind"] == "PersistentVolumeClaim"]
    assert claim["metadata"]["name"] == job.spec.checkpoint.claim_name
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_processes_per_pod_run_under_torchrun_with_the_training_operators_numbers() -> None:
    manifest = render_pytorchjob(load(gtj_manifest(nprocPerNode=4)), OWNER, 1, None, SETTINGS)
    assert schema_errors(manifest) == []
    assert manifest["spec"]["nprocPerNode"] == "4"
    for _, template in containers(manifest):
        pod = template["spec"]
        worker = named(pod["containers"], "pytorch")
        assert worker["command"][:3] == ["python", "-m", "torch.distributed.run"]
        assert "--nproc-per-node=$(PET_NPROC_PER_NODE)" in worker["command"]
        assert "--node-rank=$(PET_NODE_RANK)" in worker["command"]
        assert worker["command"][-3:] == ["train.py", "--max-steps", "1000"]
        assert "args" not in worker
        sidecar = named(pod["initContainers"], SIDECAR_CONTAINER)
        assert env_of(sidecar)["TRAINGUARD_LOCAL_RANKS"] == "4"
        # torchrun's world: the gang's processes, the training operator's number for nprocPerNode.
        assert env_of(worker)["WORLD_SIZE"] == "8"
    single = render_pytorchjob(load(gtj_manifest()), OWNER, 1, None, SETTINGS)
    assert "nprocPerNode" not in single["spec"]


def test_the_rendezvous_replaces_the_users_variables_and_keeps_the_users_port() -> None:
    """The gang's rendezvous is trainguard's: a user's stale MASTER_ADDR or RANK would split the gang. A
    port the user named for the training operator stays the rendezvous port."""
    env = [*USER_ENV, {"name": "MASTER_ADDR", "value": "elsewhere"}, {"name": "RANK", "value": "3"}]
    job = gtj_manifest(env=env)
    job["spec"]["template"]["spec"]["containers"][0]["ports"] = [
        {"name": "metrics", "containerPort": 8000},
        {"name": "pytorchjob-port", "containerPort": 29500},
    ]
    manifest = render_pytorchjob(load(job), OWNER, 2, None, SETTINGS)
    assert schema_errors(manifest) == []
    worker = named(
        manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"], "pytorch"
    )
    found = env_of(worker)
    assert len(found) == len(worker["env"]), "an env name appears twice"
    assert (found["MASTER_ADDR"], found["MASTER_PORT"]) == ("tiny-lm-2-worker-0", "29500")
    assert found["RANK"] == {
        "fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.labels['{REPLICA_INDEX_LABEL}']"}
    }
    assert [p["containerPort"] for p in worker["ports"]] == [8000, 29500]


@pytest.mark.parametrize("port", ["23456", 0, 70000, None])
def test_a_rendezvous_port_that_is_no_port_is_refused_by_name(port: Any) -> None:
    job = gtj_manifest()
    job["spec"]["template"]["spec"]["containers"][0]["ports"] = [
        {"name": "pytorchjob-port", "containerPort": port}
    ]
    with pytest.raises(RenderError, match=r"containers\[pytorch\]\.ports\[pytorchjob-port\]\.containerPort"):
        render_pytorchjob(load(job), OWNER, 1, None, SETTINGS)


def test_processes_per_pod_need_a_python_command() -> None:
    job = gtj_manifest(nprocPerNode=2)
    job["spec"]["template"]["spec"]["containers"][0]["command"] = ["bash", "-c", "python train.py"]
    with pytest.raises(RenderError, match=r"containers\[pytorch\].command: with nprocPerNode above 1"):
        render_pytorchjob(load(job), OWNER, 1, None, SETTINGS)


def test_the_stop_grace_fits_the_longest_checkpoint_write_seen() -> None:
    assert stop_grace_seconds(None, None) == 60
    assert stop_grace_seconds(None, 40.2) == 60 + 121
    assert stop_grace_seconds(None, 1e9) == 3600
    assert stop_grace_seconds(900, 1.0) == 900  # never less than the user's own
    first = render_pytorchjob(load(gtj_manifest()), OWNER, 1, None, SETTINGS)
    later = render_pytorchjob(load(gtj_manifest()), OWNER, 2, None, SETTINGS, checkpoint_seconds=100.0)
    for manifest, grace in ((first, 60), (later, 360)):
        assert schema_errors(manifest) == []
        for _, template in containers(manifest):
            assert template["spec"]["terminationGracePeriodSeconds"] == grace


def test_the_users_working_directory_reaches_the_pod_under_its_kubernetes_name() -> None:
    manifest = gtj_manifest()
    manifest["spec"]["template"]["spec"]["containers"][0]["workingDir"] = "/workspace"
    template = render_pod_template(load(manifest), 1, None, SETTINGS)
    worker = named(template["spec"]["containers"], "pytorch")
    assert worker["workingDir"] == "/workspace"
    assert "working_dir" not in worker
