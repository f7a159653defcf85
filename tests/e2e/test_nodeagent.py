"""The node agent (``tests/nodeagent.py``), the kubelet of the end-to-end tests, held to kubelet behaviour.

Two parts: unit tests of its pure pieces (the DNS wire format, ``$(VAR)`` expansion, probe defaults,
resource field references, the cluster-domain resolver on a fake API), and behaviour tests on the real
cluster of the ``e2e_cluster`` fixture (control plane, scheduler, controller manager, the agent with a 1 s
restart back-off), each in a namespace of its own, asserting on the pod status the API server holds, on
Events, and on what the pods' processes print to the logs the agent keeps.

Pods run ``sh -c`` or ``python -c`` (the project's Python: ``python`` resolves to the venv). The agent
makes every mount point on the host (there is no container root file system), so the pods here mount
only under ``/tmp/nodeagent-test``.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import re
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.cluster import Cluster, ClusterError, wait_for
from tests.support.nodeagent import (
    QTYPE_A,
    QTYPE_AAAA,
    RCODE_NXDOMAIN,
    ClusterResolver,
    ProbeSpec,
    _resource_value,
    build_response,
    expand,
    parse_query,
)

T = TypeVar("T")

MNT = "/tmp/nodeagent-test"  # where the pods here mount their volumes (the agent creates mount points)
TIMEOUT = 90.0  # for anything that involves scheduling and starting a pod on a busy 2-core machine

e2e = pytest.mark.e2e


# --- unit: DNS wire format -------------------------------------------------------------------------


def dns_query(name: str, qtype: int = QTYPE_A, ident: int = 0x1234, flags: int = 0x0100) -> bytes:
    """A standard query for ``name`` (RD set by default), as a stub resolver sends it."""
    header = struct.pack("!HHHHHH", ident, flags, 1, 0, 0, 0)
    qname = b"".join(bytes([len(label)]) + label.encode() for label in name.split(".")) + b"\x00"
    return header + qname + struct.pack("!HH", qtype, 1)


def parse_answers(response: bytes, question_length: int) -> list[tuple[int, int, int, int, bytes]]:
    """The answer records of a response: (name pointer, type, class, ttl, rdata)."""
    ancount = struct.unpack("!H", response[6:8])[0]
    pos, records = 12 + question_length, []
    for _ in range(ancount):
        pointer, rtype, rclass, ttl, length = struct.unpack("!HHHIH", response[pos : pos + 12])
        pos += 12
        records.append((pointer, rtype, rclass, ttl, response[pos : pos + length]))
        pos += length
    assert pos == len(response), "trailing bytes after the answers"
    return records


def test_a_query_parses_and_its_answer_carries_the_a_records() -> None:
    packet = dns_query("Web.NS.svc.cluster.local", ident=0xBEEF)
    ident, flags, name, qtype, question = parse_query(packet)
    assert (ident, flags, name, qtype) == (0xBEEF, 0x0100, "web.ns.svc.cluster.local", QTYPE_A)
    assert question == packet[12:]  # the question section, echoed in the answer

    response = build_response(ident, flags, question, 0, ["10.200.1.2", "10.200.1.3"])
    rid, rflags, qdcount, ancount, nscount, arcount = struct.unpack("!HHHHHH", response[:12])
    assert rid == 0xBEEF
    assert rflags & 0x8000, "QR: a response"
    assert rflags & 0x0400, "AA: authoritative for the cluster domain"
    assert rflags & 0x0100, "RD copied from the query"
    assert rflags & 0x0080, "RA"
    assert rflags & 0x000F == 0
    assert (qdcount, ancount, nscount, arcount) == (1, 2, 0, 0)
    assert response[12 : 12 + len(question)] == question
    answers = parse_answers(response, len(question))
    assert answers == [
        (0xC00C, QTYPE_A, 1, 5, socket.inet_aton("10.200.1.2")),
        (0xC00C, QTYPE_A, 1, 5, bytes([10, 200, 1, 3])),
    ]


def test_nxdomain_and_nodata_answers() -> None:
    packet = dns_query("nope.ns.svc.cluster.local", ident=7, flags=0)
    ident, flags, _, _, question = parse_query(packet)
    nxdomain = build_response(ident, flags, question, RCODE_NXDOMAIN, [])
    rflags, _, ancount = struct.unpack("!HHH", nxdomain[2:8])
    assert rflags & 0x000F == RCODE_NXDOMAIN
    assert not rflags & 0x0100, "RD not set in the query, so not in the answer"
    assert ancount == 0
    assert len(nxdomain) == 12 + len(question)

    _, _, _, qtype, question = parse_query(dns_query("web.ns.svc.cluster.local", QTYPE_AAAA))
    assert qtype == QTYPE_AAAA
    nodata = build_response(1, 0x0100, question, 0, [])
    assert struct.unpack("!H", nodata[2:4])[0] & 0x000F == 0
    assert parse_answers(nodata, len(question)) == []


@pytest.mark.parametrize(
    ("packet", "error"),
    [
        (b"", "short header"),
        (b"\x00" * 11, "short header"),
        (struct.pack("!HHHHHH", 1, 0, 0, 0, 0, 0) + b"\x00\x00\x01\x00\x01", "one question"),
        (struct.pack("!HHHHHH", 1, 0, 2, 0, 0, 0) + b"\x00\x00\x01\x00\x01", "one question"),
        (struct.pack("!HHHHHH", 1, 0, 1, 0, 0, 0), "truncated name"),
        (struct.pack("!HHHHHH", 1, 0, 1, 0, 0, 0) + b"\x03web", "truncated name"),
        (struct.pack("!HHHHHH", 1, 0, 1, 0, 0, 0) + b"\x09web", "truncated name"),
        (struct.pack("!HHHHHH", 1, 0, 1, 0, 0, 0) + b"\xc0\x0c\x00\x01\x00\x01", "compressed"),
        (struct.pack("!HHHHHH", 1, 0, 1, 0, 0, 0) + b"\x03web\x00\x00\x01", "truncated question"),
    ],
)
def test_malformed_queries_raise_value_error(packet: bytes, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_query(packet)


LABEL = st.from_regex(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?", fullmatch=True)
NAME = st.lists(LABEL, min_size=1, max_size=6).map(".".join).filter(lambda n: len(n) <= 253)
IPV4 = st.ip_addresses(v=4).map(str)


@given(
    name=NAME,
    qtype=st.sampled_from([QTYPE_A, QTYPE_AAAA, 5, 33]),
    ident=st.integers(0, 0xFFFF),
    flags=st.integers(0, 0x7FFF),  # any query's flags (QR clear)
    addresses=st.lists(IPV4, max_size=8),
)
def test_any_valid_name_parses_lowercased_and_answers_round_trip(
    name: str, qtype: int, ident: int, flags: int, addresses: list[str]
) -> None:
    packet = dns_query(name, qtype, ident, flags)
    parsed_ident, parsed_flags, parsed_name, parsed_qtype, question = parse_query(packet)
    assert (parsed_ident, parsed_flags, parsed_name, parsed_qtype) == (ident, flags, name.lower(), qtype)
    assert question == packet[12:]
    response = build_response(ident, flags, question, 0, addresses)
    assert struct.unpack("!H", response[:2])[0] == ident
    assert struct.unpack("!H", response[2:4])[0] & 0x0100 == flags & 0x0100
    assert [rdata for *_, rdata in parse_answers(response, len(question))] == [
        socket.inet_aton(ip) for ip in addresses
    ]


@given(st.binary(max_size=64) | st.binary(max_size=40).map(lambda b: dns_query("a.b")[:12] + b))
def test_garbage_either_parses_or_raises_value_error(packet: bytes) -> None:
    with contextlib.suppress(ValueError):
        parse_query(packet)


# --- unit: $(VAR) expansion ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)", "alpha"),
        ("x-$(A)-$(B)-y", "x-alpha-beta-y"),
        ("$$(A)", "$(A)"),  # escaped: never expanded
        ("$$$(A)", "$alpha"),
        ("$$", "$"),
        ("cost: $5", "cost: $5"),  # a lone $ stays
        ("$", "$"),
        ("$(UNDEFINED)", "$(UNDEFINED)"),  # unknown: left as is
        ("$(A", "$(A"),  # unterminated
        ("$()", "$()"),
        ("$(REF)", "$(A)"),  # values are not expanded again
        ("$(A)$(A)", "alphaalpha"),
        ("$(WITH SPACE)", "spaced"),  # a relaxed variable name (any printable but '=')
        ("$(x $(A))", "$(x $(A))"),  # the reference is `x $(A`: unknown, so all of it stays
    ],
)
def test_expand(text: str, expected: str) -> None:
    env = {"A": "alpha", "B": "beta", "REF": "$(A)", "WITH SPACE": "spaced"}
    assert expand(text, env) == expected


VAR_NAME = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,20}", fullmatch=True)


@given(
    text=st.text(alphabet=st.characters(blacklist_characters="$")), env=st.dictionaries(VAR_NAME, st.text())
)
def test_expand_leaves_text_without_references_alone(text: str, env: dict[str, str]) -> None:
    assert expand(text, env) == text


@given(
    parts=st.lists(
        st.tuples(st.text(alphabet="abc ()-"), VAR_NAME, st.sampled_from(["ref", "escaped", "unknown"])),
        max_size=5,
    ),
    values=st.lists(st.text(), min_size=5, max_size=5),
)
def test_expand_references_escapes_and_unknowns(parts: list[tuple[str, str, str]], values: list[str]) -> None:
    env: dict[str, str] = {}
    text, expected = "", ""
    for i, (literal, name, kind) in enumerate(parts):
        text += literal
        expected += literal
        if kind == "ref":
            env.setdefault(name, values[i])
            text += f"$({name})"
            expected += env[name]
        elif kind == "escaped":
            text += f"$$({name})"
            expected += f"$({name})"
        else:
            name = f"UNSET_{name}"
            text += f"$({name})"
            expected += f"$({name})"
    env = {k: v for k, v in env.items() if not k.startswith("UNSET_")}
    assert expand(text, env) == expected


# --- unit: probes, resource fields, resolver --------------------------------------------------------


def test_probe_spec_defaults_are_the_kubelets() -> None:
    probe = ProbeSpec.from_dict("liveness", {"httpGet": {"path": "/healthz", "port": 8080}})
    assert probe == ProbeSpec(
        kind="liveness",
        handler={"httpGet": {"path": "/healthz", "port": 8080}},
        initial_delay=0.0,
        period=10.0,
        timeout=1.0,
        success_threshold=1,
        failure_threshold=3,
        termination_grace=None,
    )
    custom = ProbeSpec.from_dict(
        "startup",
        {
            "exec": {"command": ["true"]},
            "initialDelaySeconds": 2,
            "periodSeconds": 1,
            "timeoutSeconds": 5,
            "successThreshold": 1,
            "failureThreshold": 30,
            "terminationGracePeriodSeconds": 7,
        },
    )
    assert custom.handler == {"exec": {"command": ["true"]}}
    assert (custom.initial_delay, custom.period, custom.timeout) == (2.0, 1.0, 5.0)
    assert (custom.failure_threshold, custom.termination_grace) == (30, 7.0)


@pytest.mark.parametrize(
    ("resources", "resource", "expected"),
    [
        ({"limits": {"cpu": "500m"}}, "limits.cpu", "1"),  # rounded up to whole cores
        ({"limits": {"cpu": "1500m"}}, "limits.cpu", "2"),
        ({"limits": {"cpu": "2"}}, "limits.cpu", "2"),
        ({"limits": {"cpu": "2.5"}}, "limits.cpu", "3"),
        ({"requests": {"cpu": "1m"}}, "requests.cpu", "1"),
        ({"requests": {"cpu": 4}}, "requests.cpu", "4"),
        ({}, "limits.cpu", "1"),
        ({"limits": {"memory": "1073741824"}}, "limits.memory", "1073741824"),
        ({"requests": {"memory": "64Mi"}}, "requests.memory", "64Mi"),  # passed through as written
    ],
)
def test_resource_field_values(resources: dict[str, Any], resource: str, expected: str) -> None:
    container = {"name": "c", "resources": resources}
    assert _resource_value(container, {"resource": resource}) == expected


class FakeCore:
    """The two reads ClusterResolver makes, on fixed objects."""

    def __init__(self, services: dict[tuple[str, str], dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        self.services, self.pods = services, pods

    def read_namespaced_service(self, name: str, namespace: str) -> dict[str, Any]:
        if (namespace, name) not in self.services:
            raise LookupError(404)
        return self.services[namespace, name]

    def list_namespaced_pod(self, namespace: str, label_selector: str) -> dict[str, Any]:
        wanted = dict(term.split("=") for term in label_selector.split(","))
        return {
            "items": [
                p
                for p in self.pods
                if p["metadata"]["namespace"] == namespace
                and wanted.items() <= p["metadata"].get("labels", {}).items()
            ]
        }


class FakeApi:
    def __init__(self, core: FakeCore) -> None:
        self.core = core

    def plain(self, obj: Any) -> Any:
        return obj

    def is_not_found(self, exc: BaseException) -> bool:
        return isinstance(exc, LookupError)


def fake_pod(name: str, ip: str, ready: bool, **extra: Any) -> dict[str, Any]:
    meta = {"name": name, "namespace": "ns", "labels": {"app": "web"}}
    meta.update(extra.pop("metadata", {}))
    return {
        "metadata": meta,
        "spec": extra,
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def test_the_resolver_publishes_ready_pods_of_a_service_only() -> None:
    services = {
        ("ns", "web"): {"spec": {"selector": {"app": "web"}, "clusterIP": "None"}},
        ("ns", "bare"): {"spec": {}},
    }
    pods = [
        fake_pod("a", "10.0.0.3", True, hostname="a", subdomain="web"),
        fake_pod("b", "10.0.0.2", True),
        fake_pod("c", "10.0.0.4", False, hostname="c", subdomain="web"),  # not ready: not published
        fake_pod("d", "10.0.0.5", True, metadata={"deletionTimestamp": "2025-01-01T00:00:00Z"}),
    ]
    resolver = ClusterResolver(FakeApi(FakeCore(services, pods)))  # type: ignore[arg-type]
    assert resolver.resolve("web.ns.svc.cluster.local") == ["10.0.0.2", "10.0.0.3"]
    assert resolver.resolve("a.web.ns.svc.cluster.local") == ["10.0.0.3"]
    assert resolver.resolve("c.web.ns.svc.cluster.local") is None  # only ready pods have records
    assert resolver.resolve("bare.ns.svc.cluster.local") == []  # exists, no selector: no records
    assert resolver.resolve("nope.ns.svc.cluster.local") is None
    assert resolver.resolve("web.other.svc.cluster.local") is None
    assert resolver.resolve("web.ns.svc.cluster.local.example.com") is None
    assert resolver.resolve("example.com") is None


# --- e2e: helpers ----------------------------------------------------------------------------------


@dataclass
class Kube:
    """One test's namespace on the session's cluster, and the calls the tests make."""

    cluster: Cluster
    ns: str
    api: Any  # kubernetes.client.ApiClient
    core: Any  # kubernetes.client.CoreV1Api

    def plain(self, obj: Any) -> Any:
        return self.api.sanitize_for_serialization(obj)

    def create(self, *objects: dict[str, Any]) -> None:
        """Create namespaced objects (ConfigMap, Secret, PVC, Service, Pod) in this namespace."""
        creators = {
            "Pod": self.core.create_namespaced_pod,
            "ConfigMap": self.core.create_namespaced_config_map,
            "Secret": self.core.create_namespaced_secret,
            "PersistentVolumeClaim": self.core.create_namespaced_persistent_volume_claim,
            "Service": self.core.create_namespaced_service,
        }
        for obj in objects:
            creators[obj["kind"]](self.ns, obj)

    def pod(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            document: dict[str, Any] = self.plain(self.core.read_namespaced_pod(name, self.ns))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return document

    def wait(self, what: str, probe: Callable[[], T | None], timeout: float = TIMEOUT) -> T:
        """``wait_for``, failing with the namespace's diagnostics."""
        try:
            return wait_for(what, probe, timeout=timeout, interval=0.25)
        except ClusterError as exc:
            raise AssertionError(f"{exc}\n{self.cluster.diagnostics(self.ns)}") from exc

    def wait_pod(
        self, name: str, what: str, check: Callable[[dict[str, Any]], Any], timeout: float = TIMEOUT
    ) -> dict[str, Any]:
        """The pod once ``check(pod)`` is truthy."""

        def probe() -> dict[str, Any] | None:
            pod = self.pod(name)
            return pod if pod is not None and check(pod) else None

        return self.wait(f"pod {name}: {what}", probe, timeout)

    def wait_phase(self, name: str, phase: str, timeout: float = TIMEOUT) -> dict[str, Any]:
        return self.wait_pod(name, f"phase {phase}", lambda p: p["status"].get("phase") == phase, timeout)

    def events(self, name: str) -> list[dict[str, Any]]:
        """The Events about object ``name``, oldest first."""
        listing = self.plain(
            self.core.list_namespaced_event(self.ns, field_selector=f"involvedObject.name={name}")
        )
        items: list[dict[str, Any]] = listing.get("items", [])
        return sorted(items, key=lambda e: (e.get("lastTimestamp") or "", e["metadata"]["name"]))

    def log(self, pod: str, container: str) -> str:
        """What the container printed (every instance of it), from the log the agent keeps."""
        path = self.cluster.state_dir / "agent" / "pods" / f"{self.ns}_{pod}" / f"{container}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_json(self, pod: str, container: str) -> dict[str, Any]:
        """The last JSON object the container printed on a line of its own."""
        for line in reversed(self.log(pod, container).splitlines()):
            if line.startswith("{"):
                document: dict[str, Any] = json.loads(line)
                return document
        raise AssertionError(f"no JSON line in {pod}/{container}'s log:\n{self.log(pod, container)}")

    def wait_log(self, pod: str, container: str, text: str) -> None:
        """Until the container has printed ``text``."""
        self.wait(f"{pod}/{container} to print {text!r}", lambda: text in self.log(pod, container))


@pytest.fixture
def kube(e2e_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Kube]:
    """A fresh namespace (deleted at the end) whose ``default`` ServiceAccount exists."""
    from kubernetes import client

    name = "na-" + re.sub(r"[^a-z0-9-]", "-", request.node.name.removeprefix("test_").lower())[:40]
    name = name.rstrip("-")
    api = e2e_cluster.plane.api_client()
    kube = Kube(e2e_cluster, name, api, client.CoreV1Api(api))
    kube.core.create_namespace({"metadata": {"name": name}})
    try:
        # The ServiceAccount admission plugin refuses pods until the namespace's default account exists.
        kube.wait(
            "the default ServiceAccount",
            lambda: e2e_cluster.get("serviceaccount", "default", name),
            timeout=60,
        )
        yield kube
    finally:
        # Not waited for: its pods go with a grace period of a second or two.
        e2e_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
        api.close()


def pod(
    name: str,
    containers: list[dict[str, Any]],
    *,
    restart: str = "Never",
    init: list[dict[str, Any]] | None = None,
    volumes: list[dict[str, Any]] | None = None,
    grace: int = 1,
    labels: dict[str, str] | None = None,
    automount: bool = False,
    **spec: Any,
) -> dict[str, Any]:
    """A Pod manifest (``automount``: leave automountServiceAccountToken at its default)."""
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": grace,
            "containers": containers,
            "volumes": volumes or [],
            **spec,
        },
    }
    if init:
        body["spec"]["initContainers"] = init
    if not automount:
        body["spec"]["automountServiceAccountToken"] = False
    return body


def container(name: str, command: list[str], **fields: Any) -> dict[str, Any]:
    """A container: the image is ignored by the agent, the command is run."""
    return {"name": name, "image": "x", "command": command, **fields}


def sh(name: str, script: str, **fields: Any) -> dict[str, Any]:
    return container(name, ["sh", "-c", script], **fields)


def py(name: str, code: str, **fields: Any) -> dict[str, Any]:
    return container(name, ["python", "-c", code], **fields)


def status_of(pod: dict[str, Any], name: str) -> dict[str, Any]:
    """The container status (regular or init) called ``name``; {} if not reported yet."""
    statuses = pod["status"].get("containerStatuses", []) + pod["status"].get("initContainerStatuses", [])
    return next((s for s in statuses if s["name"] == name), {})


def condition(pod: dict[str, Any], kind: str) -> str | None:
    """The status ("True"/"False") of the pod's condition ``kind``."""
    for entry in pod["status"].get("conditions") or []:
        if entry["type"] == kind:
            return str(entry["status"])
    return None


def state(pod: dict[str, Any], name: str) -> str:
    """running, waiting or terminated: the current state of container ``name`` ('' if unknown)."""
    return next(iter(status_of(pod, name).get("state") or {}), "")


def host_path(name: str, path: Path) -> dict[str, Any]:
    return {"name": name, "hostPath": {"path": str(path), "type": "DirectoryOrCreate"}}


def empty_dir(name: str) -> dict[str, Any]:
    return {"name": name, "emptyDir": {}}


def mount(name: str, path: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "mountPath": path, **fields}


def exec_probe(*command: str, **fields: Any) -> dict[str, Any]:
    return {"exec": {"command": list(command)}, "periodSeconds": 1, "timeoutSeconds": 5, **fields}


def http_probe(path: str, port: int, **fields: Any) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": 1, "timeoutSeconds": 3, **fields}


def _time(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


# --- e2e: containers ------------------------------------------------------------------------------


@e2e
def test_a_native_sidecar_runs_before_init_and_main_and_stops_after_main(kube: Kube, tmp_path: Path) -> None:
    shared, ctl = f"{MNT}/shared", f"{MNT}/ctl"
    fetch = "urllib.request.urlopen('http://127.0.0.1:8081/order', timeout=10).read().decode().split()"
    sidecar = sh(
        "sidecar",
        f"echo sidecar >> {shared}/order && exec python -m http.server 8081 --directory {shared}",
        restartPolicy="Always",
        # The next init container starts once this has succeeded: the sidecar is serving.
        startupProbe=http_probe("/order", 8081, failureThreshold=60),
        volumeMounts=[mount("shared", shared)],
    )
    setup = py(
        "setup",
        "import urllib.request\n"
        f"seen = {fetch}\n"
        "assert seen == ['sidecar'], seen\n"
        f"open('{shared}/order', 'a').write('setup\\n')\n",
        volumeMounts=[mount("shared", shared)],
    )
    main = py(
        "main",
        "import json, os, time, urllib.request\n"
        f"open('{shared}/order', 'a').write('main\\n')\n"
        f"seen = {fetch}\n"
        f"while not os.path.exists('{ctl}/go'):\n"
        "    time.sleep(0.2)\n"
        f"print(json.dumps({{'order': seen, 'after': {fetch}}}), flush=True)\n",
        volumeMounts=[mount("shared", shared), mount("ctl", ctl)],
    )
    kube.create(
        pod(
            "sidecar",
            [main],
            init=[sidecar, setup],
            volumes=[empty_dir("shared"), host_path("ctl", tmp_path)],
        )
    )

    running = kube.wait_pod(
        "sidecar", "main running and Ready", lambda p: state(p, "main") == "running" and condition(p, "Ready")
    )
    assert running["status"]["phase"] == "Running"
    side, init, main_status = (status_of(running, n) for n in ("sidecar", "setup", "main"))
    assert side["state"].get("running"), side
    assert side["started"] is True
    assert side["ready"] is True
    assert init["state"]["terminated"]["exitCode"] == 0, init
    assert init["state"]["terminated"]["reason"] == "Completed"
    assert main_status["started"] is True
    assert main_status["ready"] is True
    assert [c["name"] for c in running["status"]["initContainerStatuses"]] == ["sidecar", "setup"]
    for kind in ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready"):
        assert condition(running, kind) == "True", (kind, running["status"]["conditions"])
    # The sidecar started before the init container, which finished before the main container started.
    assert _time(side["state"]["running"]["startedAt"]) <= _time(init["state"]["terminated"]["startedAt"])
    assert _time(init["state"]["terminated"]["finishedAt"]) <= _time(
        main_status["state"]["running"]["startedAt"]
    )

    (tmp_path / "go").touch()
    done = kube.wait_phase("sidecar", "Succeeded")
    printed = kube.log_json("sidecar", "main")
    assert printed["order"] == ["sidecar", "setup", "main"]
    assert printed["after"] == ["sidecar", "setup", "main"]  # the sidecar still served, at the very end
    main_done = status_of(done, "main")["state"]["terminated"]
    assert (main_done["exitCode"], main_done["reason"]) == (0, "Completed")

    # The sidecar is stopped once the main container has exited (its state may lag the phase by a tick).
    done = kube.wait_pod("sidecar", "the sidecar terminated", lambda p: state(p, "sidecar") == "terminated")
    side_done = status_of(done, "sidecar")["state"]["terminated"]
    assert _time(side_done["finishedAt"]) >= _time(main_done["finishedAt"])
    assert side_done["exitCode"] == 143, side_done  # SIGTERM, which http.server does not handle
    assert all(s["restartCount"] == 0 for s in done["status"]["initContainerStatuses"])
    assert condition(done, "Ready") == "False"
    assert condition(done, "ContainersReady") == "False"
    assert "Started" in [e["reason"] for e in kube.events("sidecar")]


@e2e
def test_restart_policies_crash_loop_back_off_and_on_failure(kube: Kube) -> None:
    kube.create(
        pod("crash", [sh("crash", "date +%s.%N; exit 3")], restart="Always"),
        pod(
            "once",
            [
                sh(
                    "once",
                    f"if [ -f {MNT}/state/ran ]; then echo second run; exit 0; fi; "
                    f"touch {MNT}/state/ran; echo first run; exit 4",
                    volumeMounts=[mount("state", f"{MNT}/state")],
                )
            ],
            restart="OnFailure",
            volumes=[empty_dir("state")],
        ),
    )

    # OnFailure: the failed run is restarted, the successful one is not.
    once = kube.wait_phase("once", "Succeeded")
    status = status_of(once, "once")
    assert status["restartCount"] == 1, status
    assert status["lastState"]["terminated"]["exitCode"] == 4
    assert status["state"]["terminated"]["exitCode"] == 0
    assert status["state"]["terminated"]["reason"] == "Completed"
    assert kube.log("once", "once").count("run") == 2

    # Always, crashing: restarted with a growing back-off, waiting in CrashLoopBackOff in between.
    def crash_looping(p: dict[str, Any]) -> bool:
        s = status_of(p, "crash")
        waiting = s.get("state", {}).get("waiting", {})
        return bool(s.get("restartCount", 0) >= 3 and waiting.get("reason") == "CrashLoopBackOff")

    crash = kube.wait_pod("crash", "crash-looping after 3 restarts", crash_looping)
    status = status_of(crash, "crash")
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert status["lastState"]["terminated"]["reason"] == "Error"
    assert "back-off" in status["state"]["waiting"]["message"]
    assert status["ready"] is False
    assert status["started"] is False
    assert crash["status"]["phase"] == "Running"
    assert condition(crash, "Ready") == "False"
    starts = [
        float(line) for line in kube.log("crash", "crash").splitlines() if re.fullmatch(r"\d+\.\d+", line)
    ]
    assert len(starts) >= 4, starts
    gaps = [b - a for a, b in itertools.pairwise(starts[:4])]
    # Back-off 1 s, 2 s, 4 s: each gap is at least that, plus the run and the agent's tick (seconds at most,
    # on a busy machine), so the gaps grow.
    for gap, backoff in zip(gaps, [1.0, 2.0, 4.0], strict=True):
        assert backoff <= gap < backoff + 5.0, (gaps, starts)
    assert gaps[0] < gaps[2], gaps
    reasons = [e["reason"] for e in kube.events("crash")]
    assert reasons.count("BackOff") >= 3, reasons
    assert reasons.count("Started") >= 4, reasons


@e2e
def test_termination_messages_from_the_file_or_the_log(kube: Kube) -> None:
    kube.create(
        pod("says", [sh("says", "echo starting; printf 'all done' > /dev/termination-log")]),
        pod(
            "custom",
            [sh("custom", f"printf 'custom path' > {MNT}/term", terminationMessagePath=f"{MNT}/term")],
        ),
        pod(
            "fails",
            [
                sh(
                    "fails",
                    "echo line one; echo the reason; exit 5",
                    terminationMessagePolicy="FallbackToLogsOnError",
                )
            ],
        ),
    )
    says = status_of(kube.wait_phase("says", "Succeeded"), "says")
    assert says["state"]["terminated"]["message"] == "all done"
    custom = status_of(kube.wait_phase("custom", "Succeeded"), "custom")
    assert custom["state"]["terminated"]["message"] == "custom path"
    fails = status_of(kube.wait_phase("fails", "Failed"), "fails")
    assert fails["state"]["terminated"]["message"].splitlines()[-2:] == ["line one", "the reason"]


@e2e
def test_probes_startup_gates_liveness_readiness_toggles_and_http_liveness_restarts(
    kube: Kube, tmp_path: Path
) -> None:
    ctl = f"{MNT}/ctl"
    app = container(
        "app",
        ["sleep", "3600"],
        # Liveness would fail until `started` exists (and kill the container at its second failure), but the
        # startup probe, failing meanwhile, gates it.
        startupProbe=exec_probe("test", "-f", f"{ctl}/started", failureThreshold=120),
        livenessProbe=exec_probe("test", "-f", f"{ctl}/started", failureThreshold=2),
        readinessProbe=exec_probe("test", "-f", f"{ctl}/ready", failureThreshold=1),
        volumeMounts=[mount("ctl", ctl)],
    )
    web = sh(
        "web",
        f"mkdir -p {ctl}/www && echo ok > {ctl}/www/healthz && "
        f"exec python -m http.server 8000 --directory {ctl}/www",
        startupProbe=http_probe("/healthz", 8000, failureThreshold=60),
        livenessProbe=http_probe("/healthz", 8000, failureThreshold=2),
        volumeMounts=[mount("ctl", ctl)],
    )
    kube.create(pod("probes", [app, web], restart="Always", volumes=[host_path("ctl", tmp_path)]))

    def app_events(reason: str, text: str) -> list[dict[str, Any]]:
        return [
            e
            for e in kube.events("probes")
            if e["reason"] == reason
            and text in e["message"]
            and e["involvedObject"].get("fieldPath") == "spec.containers{app}"
        ]

    kube.wait_pod("probes", "web started", lambda p: status_of(p, "web").get("started"))
    kube.wait(
        "three failed startup probes", lambda: len(app_events("Unhealthy", "Startup probe failed")) >= 3
    )
    probes = kube.pod("probes")
    assert probes is not None
    app_status = status_of(probes, "app")
    assert app_status["state"].get("running"), app_status
    assert app_status["restartCount"] == 0
    assert app_status["started"] is False
    assert app_status["ready"] is False
    assert condition(probes, "Ready") == "False"
    assert not app_events("Unhealthy", "Liveness"), "liveness probed before the startup probe succeeded"
    assert not app_events("Unhealthy", "Readiness"), "readiness probed before the startup probe succeeded"

    (tmp_path / "started").touch()
    probes = kube.wait_pod("probes", "app started", lambda p: status_of(p, "app").get("started"))
    assert status_of(probes, "app")["ready"] is False  # no `ready` file yet
    (tmp_path / "ready").touch()
    kube.wait_pod("probes", "Ready", lambda p: condition(p, "Ready") == "True")
    (tmp_path / "ready").unlink()
    probes = kube.wait_pod("probes", "not Ready", lambda p: condition(p, "Ready") == "False")
    assert status_of(probes, "app")["ready"] is False
    assert condition(probes, "ContainersReady") == "False"
    (tmp_path / "ready").touch()
    probes = kube.wait_pod("probes", "Ready again", lambda p: condition(p, "Ready") == "True")
    assert status_of(probes, "app")["restartCount"] == 0  # readiness never restarts; liveness passes
    assert app_events("Unhealthy", "Readiness probe failed")

    # A failing HTTP liveness probe: the container is killed and restarted (and, recreating its health
    # file when it starts, is healthy again).
    (tmp_path / "www" / "healthz").unlink()
    probes = kube.wait_pod(
        "probes",
        "web restarted and Ready",
        lambda p: status_of(p, "web").get("restartCount") == 1 and condition(p, "Ready") == "True",
    )
    web_status = status_of(probes, "web")
    assert web_status["lastState"]["terminated"]["exitCode"] == 143, web_status  # SIGTERM
    assert web_status["state"].get("running"), web_status
    web_events = [
        e for e in kube.events("probes") if e["involvedObject"].get("fieldPath") == "spec.containers{web}"
    ]
    unhealthy = [e["message"] for e in web_events if e["reason"] == "Unhealthy"]
    assert any("Liveness probe failed" in m and "statuscode: 404" in m for m in unhealthy), unhealthy
    killing = [e["message"] for e in web_events if e["reason"] == "Killing"]
    assert any("failed liveness probe, will be restarted" in m for m in killing), killing
    assert status_of(probes, "app")["restartCount"] == 0
    probes = kube.pod("probes")
    assert probes is not None
    assert status_of(probes, "web")["restartCount"] == 1


# --- e2e: inputs ----------------------------------------------------------------------------------

SHOW = """
import json, os, sys
def tree(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
names = ["POD_NAME", "POD_NAMESPACE", "POD_IP", "WHERE", "GREETING", "PASSWORD", "CPU_LIMIT", "HOSTNAME"]
print(json.dumps({
    "args": sys.argv[1:],
    "env": {name: os.environ.get(name) for name in names},
    "config": tree("%(config)s"),
    "app_conf": open("%(config)s/conf/app.conf").read(),
    "single": open("%(single)s").read(),
    "account": sorted(os.listdir(sa)),
    "token": open(sa + "/token").read(),
    "namespace": open(sa + "/namespace").read(),
    "ca": open(sa + "/ca.crt").read(),
}), flush=True)
"""


@e2e
def test_downward_api_config_map_and_secret_env_args_expansion_and_volumes(kube: Kube) -> None:
    config_dir, single = f"{MNT}/config", f"{MNT}/single/app.conf"
    kube.create(
        {
            "kind": "ConfigMap",
            "metadata": {"name": "settings"},
            "data": {"greeting": "hello", "app.conf": "x = 1\n", "unused": "nope"},
        },
        {"kind": "Secret", "metadata": {"name": "creds"}, "stringData": {"password": "s3cret"}},
    )

    def field(path: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}

    show = container(
        "show",
        ["python", "-c", SHOW % {"config": config_dir, "single": single}],
        args=["$(POD_NAME)", "$$(POD_NAME)", "$(NOT_DEFINED)", "ip=$(POD_IP)"],
        env=[
            {"name": "POD_NAME", "valueFrom": field("metadata.name")},
            {"name": "POD_NAMESPACE", "valueFrom": field("metadata.namespace")},
            {"name": "POD_IP", "valueFrom": field("status.podIP")},
            {"name": "WHERE", "value": "$(POD_NAME).$(POD_NAMESPACE)"},
            {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}}},
            {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
            {"name": "CPU_LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
        ],
        resources={"limits": {"cpu": "500m", "memory": "64Mi"}},
        volumeMounts=[
            mount("config", config_dir),
            mount("config", single, subPath="conf/app.conf"),  # one file of the volume
        ],
    )
    items = [{"key": "app.conf", "path": "conf/app.conf"}, {"key": "greeting", "path": "greeting.txt"}]
    kube.create(
        pod(
            "inputs",
            [show],
            volumes=[{"name": "config", "configMap": {"name": "settings", "items": items}}],
            automount=True,  # the one pod with the projected service-account token volume
        )
    )
    done = kube.wait_phase("inputs", "Succeeded")
    ip = done["status"]["podIP"]
    printed = kube.log_json("inputs", "show")
    assert printed["args"] == ["inputs", "$(POD_NAME)", "$(NOT_DEFINED)", f"ip={ip}"]
    assert printed["env"] == {
        "POD_NAME": "inputs",
        "POD_NAMESPACE": kube.ns,
        "POD_IP": ip,
        "WHERE": f"inputs.{kube.ns}",
        "GREETING": "hello",
        "PASSWORD": "s3cret",
        "CPU_LIMIT": "1",  # 500m, rounded up to whole cores as the kubelet does
        "HOSTNAME": "inputs",
    }
    assert printed["config"] == ["conf/app.conf", "greeting.txt"]  # only the items, at their paths
    assert printed["app_conf"] == printed["single"] == "x = 1\n"

    # The ServiceAccount admission plugin added the projected volume; the agent filled it: a token bound to
    # this pod (TokenRequest), the cluster's CA, the namespace.
    volumes = [v for v in done["spec"]["volumes"] if v["name"].startswith("kube-api-access-")]
    assert volumes, done["spec"]["volumes"]
    assert printed["account"] == ["ca.crt", "namespace", "token"]
    assert printed["namespace"] == kube.ns
    assert printed["ca"].startswith("-----BEGIN CERTIFICATE-----")
    payload = printed["token"].split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert claims["kubernetes.io"]["namespace"] == kube.ns
    assert claims["kubernetes.io"]["pod"] == {"name": "inputs", "uid": done["metadata"]["uid"]}
    assert claims["kubernetes.io"]["serviceaccount"]["name"] == "default"


@e2e
def test_empty_dir_is_private_a_pvc_is_shared_and_an_unbound_claim_waits(kube: Kube, tmp_path: Path) -> None:
    def volume(name: str, claim: str, path: Path) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
                "claimRef": {"namespace": kube.ns, "name": claim},
            },
        }

    def claim(name: str) -> dict[str, Any]:
        return {
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        }

    def user(name: str, claim_name: str, script: str, read_only: bool = False, **spec: Any) -> dict[str, Any]:
        mounts = [mount("scratch", f"{MNT}/scratch"), mount("data", f"{MNT}/data", readOnly=read_only)]
        return pod(
            name,
            [py("main", script, volumeMounts=mounts)],
            volumes=[
                empty_dir("scratch"),
                {"name": "data", "persistentVolumeClaim": {"claimName": claim_name}},
            ],
            **spec,
        )

    writer = f"""
import json, os, socket, time
me = socket.gethostname()
for d in ("{MNT}/scratch", "{MNT}/data"):
    open(os.path.join(d, me), "w").write(me)
deadline = time.monotonic() + 120
while len(os.listdir("{MNT}/data")) < 2 and time.monotonic() < deadline:  # both pods running
    time.sleep(0.2)
listing = {{name: sorted(os.listdir(f"{MNT}/{{name}}")) for name in ("scratch", "data")}}
print(json.dumps(listing), flush=True)
"""
    late = f"""
import errno, os
print("sees", os.listdir("{MNT}/data"), flush=True)
try:
    open("{MNT}/data/written", "w")
except OSError as exc:
    print("write:", errno.errorcode[exc.errno], flush=True)
"""
    pvs = [f"{kube.ns}-shared", f"{kube.ns}-late"]
    shared_dir, late_dir = tmp_path / "shared", tmp_path / "late"
    late_dir.mkdir()
    (late_dir / "seed").write_text("seed")
    cluster = kube.cluster
    try:
        # The late claim has no volume yet: a pod through the scheduler is unschedulable, and one bound to the
        # node directly (no scheduler) is held by the agent, Pending.
        kube.create(
            claim("late"),
            user("late-scheduled", "late", late, read_only=True),
            user("late-direct", "late", late, read_only=True, nodeName="trainguard-node"),
        )
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(volume(pvs[0], "shared", shared_dir)))
        kube.create(claim("shared"))
        kube.wait(
            "claim shared Bound",
            lambda: (cluster.get("pvc", "shared", kube.ns) or {}).get("status", {}).get("phase") == "Bound",
        )
        kube.create(user("writer-a", "shared", writer), user("writer-b", "shared", writer))

        for name in ("writer-a", "writer-b"):
            kube.wait_phase(name, "Succeeded")
            printed = kube.log_json(name, "main")
            assert printed["scratch"] == [name], printed  # its own emptyDir only
            assert printed["data"] == ["writer-a", "writer-b"], printed  # the claim's volume: shared
        assert sorted(p.name for p in shared_dir.iterdir()) == ["writer-a", "writer-b"]

        scheduled = kube.wait_pod(
            "late-scheduled",
            "unschedulable",
            lambda p: condition(p, "PodScheduled") == "False",
        )
        assert scheduled["status"]["phase"] == "Pending"
        direct = kube.wait_pod(
            "late-direct", "held for its claim", lambda p: "not bound" in p["status"].get("message", "")
        )
        assert direct["status"]["phase"] == "Pending"
        assert "containerStatuses" not in direct["status"] or all(
            "running" not in s["state"] for s in direct["status"]["containerStatuses"]
        )
        assert not kube.log("late-direct", "main")

        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(volume(pvs[1], "late", late_dir)))
        for name in ("late-scheduled", "late-direct"):
            started = kube.wait_phase(name, "Succeeded")
            assert "sees ['seed']" in kube.log(name, "main")
            assert "write: EROFS" in kube.log(name, "main")  # mounted readOnly
            assert "message" not in started["status"], started["status"]  # the wait is over
        assert sorted(p.name for p in late_dir.iterdir()) == ["seed"]
    finally:
        cluster.kubectl("delete", "pod", "--all", "-n", kube.ns, "--wait=false", check=False)
        cluster.kubectl("delete", "pvc", "--all", "-n", kube.ns, "--wait=false", check=False)
        cluster.kubectl("delete", "pv", *pvs, "--wait=false", check=False)


CLIENT = """
import json, os, socket, sys, urllib.request
def get(host):
    return urllib.request.urlopen(f"http://{host}:8000/name", timeout=10).read().decode().strip()
def addresses(name):
    try:
        return sorted({a[4][0] for a in socket.getaddrinfo(name, 8000, socket.AF_INET, socket.SOCK_STREAM)})
    except socket.gaierror as exc:
        return f"error: {exc}"
namespace = os.environ["POD_NAMESPACE"]
print(json.dumps({
    "hostname": socket.gethostname(),
    "self": socket.gethostbyname(socket.gethostname()),
    "by_ip": [get(ip) for ip in sys.argv[1:]],
    "web": addresses("web"),
    "fqdn": addresses(f"web.{namespace}.svc.cluster.local"),
    "missing": addresses("no-such-service"),
    "by_name": get("web"),
    "resolv": open("/etc/resolv.conf").read(),
    "hosts": open("/etc/hosts").read(),
}), flush=True)
"""


@e2e
def test_pods_have_their_own_ips_and_ports_and_dns_publishes_ready_pods(kube: Kube) -> None:
    www = f"{MNT}/www"

    def server(name: str, readiness_path: str) -> dict[str, Any]:
        web = sh(
            "web",
            f"hostname > {www}/name && exec python -m http.server 8000 --directory {www}",
            readinessProbe=http_probe(readiness_path, 8000),
            volumeMounts=[mount("www", www)],
        )
        return pod(name, [web], restart="Always", labels={"app": "web"}, volumes=[empty_dir("www")])

    kube.create(
        {
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 8000}]},
        },
        server("web-a", "/name"),
        server("web-b", "/not-there"),  # serves, but never ready
    )
    web_a = kube.wait_pod("web-a", "Ready", lambda p: condition(p, "Ready") == "True")
    kube.wait(
        "web-b serving and failing readiness",
        lambda: any(
            "statuscode: 404" in e["message"] for e in kube.events("web-b") if e["reason"] == "Unhealthy"
        ),
    )
    web_b = kube.pod("web-b")
    assert web_b is not None
    assert condition(web_b, "Ready") == "False"
    ip_a, ip_b = web_a["status"]["podIP"], web_b["status"]["podIP"]

    client = py(
        "client",
        CLIENT,
        args=[ip_a, ip_b],
        env=[{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
    )
    kube.create(pod("client", [client]))
    done = kube.wait_phase("client", "Succeeded")
    ip_client = done["status"]["podIP"]
    printed = kube.log_json("client", "client")
    assert len({ip_a, ip_b, ip_client}) == 3
    assert done["status"]["podIPs"] == [{"ip": ip_client}]
    assert done["status"]["hostIP"] not in (ip_a, ip_b, ip_client)
    # Both listen on port 8000, each in its own network namespace, and the hostname is the pod's name.
    assert printed["by_ip"] == ["web-a", "web-b"]
    assert printed["hostname"] == "client"
    assert printed["self"] == ip_client
    assert f"{ip_client}\tclient" in printed["hosts"]
    # The headless Service's name resolves (search path, then the agent's DNS) to its ready pods only.
    assert printed["web"] == [ip_a], printed
    assert printed["fqdn"] == [ip_a], printed
    assert printed["by_name"] == "web-a"
    assert printed["missing"].startswith("error:"), printed
    resolv = printed["resolv"].splitlines()
    assert f"search {kube.ns}.svc.cluster.local svc.cluster.local cluster.local" in resolv
    assert f"nameserver {done['status']['hostIP']}" in resolv
    assert "options ndots:5" in resolv


# --- e2e: deletion ---------------------------------------------------------------------------------

SIGTERM_SCRIPT = """
import signal, sys, time
def on_term(*_):
    print("got SIGTERM", flush=True)
    if sys.argv[1] == "exit":
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("up", flush=True)
while True:
    time.sleep(0.1)
"""


@e2e
def test_deletion_sends_sigterm_then_sigkill_after_the_grace_period(kube: Kube) -> None:
    grace = 4
    kube.create(
        pod("stubborn", [py("main", SIGTERM_SCRIPT, args=["ignore"])], grace=grace),
        pod("polite", [py("main", SIGTERM_SCRIPT, args=["exit"])], grace=30),
    )
    pids = {}
    for name in ("stubborn", "polite"):
        running = kube.wait_phase(name, "Running")
        kube.wait_log(name, "main", "up")  # its SIGTERM handler is installed
        pids[name] = int(status_of(running, "main")["containerID"].removeprefix("process://"))
        assert Path(f"/proc/{pids[name]}").exists()

    started = time.monotonic()
    kube.cluster.kubectl("delete", "pod", "stubborn", "polite", "-n", kube.ns, "--wait=false")
    gone: dict[str, float] = {}

    def both_gone() -> bool:
        for name in ("stubborn", "polite"):
            if name not in gone and kube.pod(name) is None:
                gone[name] = time.monotonic() - started
        return len(gone) == 2

    kube.wait("both pods removed", both_gone, timeout=grace + 60)
    assert grace <= gone["stubborn"] < grace + 10, gone  # SIGTERM ignored: SIGKILL after the grace period
    assert gone["polite"] < 10, gone  # exits on SIGTERM: gone long before its 30 s
    for name in ("stubborn", "polite"):
        assert "got SIGTERM" in kube.log(name, "main")
        assert not Path(f"/proc/{pids[name]}").exists(), f"{name}'s process outlived its pod"
        killing = [e["message"] for e in kube.events(name) if e["reason"] == "Killing"]
        assert killing == ["Stopping container main"], killing
