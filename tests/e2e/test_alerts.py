"""trainguard's Prometheus alerts, proven with Prometheus's own tools.

The rules are rendered from the chart with ``helm template`` and checked by ``promtool check rules``.
``promtool test rules`` then feeds each alert synthetic series and checks that it fires when it must
and stays silent when it must not, with its labels and expanded annotations. Finally a real Prometheus
server on 127.0.0.1 scrapes a real trainguard sidecar whose worker status shows rising dropped
samples and rollbacks, and the drop-rate and rollback alerts must reach "firing" through Prometheus's
own rule evaluation.

helm, promtool and prometheus come from ``scripts/tools.sh`` (CI runs it first): these tests fail,
not skip, when one is missing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.paths import REPO_ROOT
from tests.support.ports import free_port
from tests.support.tools import tool
from trainer_sidecar.contract.status import CheckpointRef, Phase, WorkerStatus, write_status
from trainer_sidecar.sidecar.server import WorkerStatusCollector

CHART = REPO_ROOT / "charts" / "trainguard"
DEFAULTS: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
ALERTS = (
    "TrainguardRollbackRateHigh",
    "TrainguardBatchDropRateHigh",
    "TrainguardJobHung",
    "TrainguardRestartsExhausted",
    "TrainguardCheckpointStale",
    "TrainguardStragglerRank",
)
JOB = {"job": "llm", "namespace": "ml"}


def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)


def rule_groups(tmp: Path, values: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The alert rule groups of the chart's PrometheusRule, rendered by helm with ``values``."""
    merged = {"monitoring": {"force": True}, **(values or {})}
    values_file = tmp / f"alert-values-{abs(hash(json.dumps(merged, sort_keys=True)))}.yaml"
    values_file.write_text(yaml.safe_dump(merged))
    home = REPO_ROOT / "build" / "helm-home"
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    result = subprocess.run(
        [
            *(tool("helm"), "template", "tg", str(CHART), "--values", str(values_file)),
            *("--show-only", "templates/alerts-prometheusrule.yaml"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rule = yaml.safe_load(result.stdout)
    assert rule["kind"] == "PrometheusRule"
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def write_rules(tmp: Path, groups: list[dict[str, Any]], name: str = "rules.yaml") -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("alerts")


@pytest.fixture(scope="module")
def groups(tmp: Path) -> list[dict[str, Any]]:
    return rule_groups(tmp)


@pytest.fixture(scope="module")
def rules_file(tmp: Path, groups: list[dict[str, Any]]) -> Path:
    return write_rules(tmp, groups)


def _rules(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in groups for r in g["rules"]}


# --------------------------------------------------------------------------------------------------
# The rules as files
# --------------------------------------------------------------------------------------------------


def test_promtool_accepts_the_rendered_rules(rules_file: Path) -> None:
    result = run(tool("promtool"), "check", "rules", "--lint=all", "--lint-fatal", str(rules_file))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout, result.stdout


def test_every_alert_is_documented_and_names_the_job(groups: list[dict[str, Any]]) -> None:
    rules = _rules(groups)
    assert set(rules) == set(ALERTS)
    readme = (CHART / "README.md").read_text()
    for name, rule in rules.items():
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, name
        for label in ("{{ $labels.job }}", "{{ $labels.namespace }}"):
            assert label in annotations["description"], (name, label)
        anchor = annotations["runbook_url"].rsplit("#", 1)[1]
        assert anchor == name.lower()
        assert re.search(rf"^## {name}$", readme, re.MULTILINE), f"README has no runbook section {name}"
        assert rule["labels"]["severity"] in {"warning", "critical"}


def test_disabled_alerts_and_extra_labels(tmp: Path) -> None:
    values = {
        "alerts": {
            "jobHung": {"enabled": False},
            "checkpointStale": {"enabled": False},
            "straggler": {"enabled": False},
            "labels": {"team": "ml-platform"},
        }
    }
    rules = _rules(rule_groups(tmp, values))
    assert set(rules) == {
        "TrainguardRollbackRateHigh",
        "TrainguardBatchDropRateHigh",
        "TrainguardRestartsExhausted",
    }
    assert all(r["labels"]["team"] == "ml-platform" for r in rules.values())


def test_thresholds_and_windows_come_from_values(tmp: Path) -> None:
    values = {
        "alerts": {
            "rollbackRate": {"window": "2h", "threshold": 7},
            "batchDropRate": {"window": "10m", "threshold": 0.005, "for": "1m"},
            "jobHung": {"afterSeconds": 900},
            "checkpointStale": {"maxAgeSeconds": 3600},
            "straggler": {"threshold": 2.5, "for": "30m"},
        }
    }
    rules = _rules(rule_groups(tmp, values))
    assert "[2h])) >= 7" in rules["TrainguardRollbackRateHigh"]["expr"]
    drop = rules["TrainguardBatchDropRateHigh"]
    assert drop["expr"].count("[10m]") == 2
    assert drop["expr"].endswith("> 0.005")
    assert drop["for"] == "1m"
    assert "[900s]" in rules["TrainguardJobHung"]["expr"]
    assert "> 900" in rules["TrainguardJobHung"]["expr"]
    assert "> 3600" in rules["TrainguardCheckpointStale"]["expr"]
    assert "offset 3600s" in rules["TrainguardCheckpointStale"]["expr"]
    assert rules["TrainguardStragglerRank"]["expr"].endswith("> 2.5")
    assert rules["TrainguardStragglerRank"]["for"] == "30m"


# --------------------------------------------------------------------------------------------------
# Every metric the rules and the dashboard use is one trainguard exports
# --------------------------------------------------------------------------------------------------


def sidecar_metric_names(tmp: Path) -> set[str]:
    """Every series name the sidecar exports for a worker whose status has every field set."""
    status_file = tmp / "full-status.json"
    now = time.time()
    write_status(
        status_file,
        WorkerStatus(
            started_at=now - 60,
            phase=Phase.RUNNING,
            step=10,
            last_step_time=now,
            loss=1.0,
            grad_norm=1.0,
            steps_total=10,
            samples_seen=100,
            last_clean_checkpoint=CheckpointRef(step=5, path="/ckpt/5", time=now - 30),
        ),
    )
    collector = WorkerStatusCollector(
        status_file, hang_timeout_seconds=300, startup_grace_seconds=600, job="j", namespace="n"
    )
    return {sample.name for family in collector.collect() for sample in family.samples}


def operator_metric_names() -> set[str]:
    """Every series name the operator's registry can export (trainguard_operator.metrics)."""
    from trainguard_operator.metrics import OperatorMetrics

    names: set[str] = set()
    for family in OperatorMetrics().registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        names |= {family.name + suffix for suffix in suffixes}
    return names


def dashboard_queries() -> list[str]:
    dashboard = json.loads((CHART / "dashboards" / "trainguard.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["query"]["query"])
    return queries


def test_rules_and_dashboard_use_only_exported_metrics(groups: list[dict[str, Any]], tmp: Path) -> None:
    exported = sidecar_metric_names(tmp) | operator_metric_names()
    assert "trainguard_worker_dropped_samples_total" in exported
    assert "trainguard_job_phase" in exported
    expressions = [r["expr"] for r in _rules(groups).values()] + dashboard_queries()
    used = {name for expr in expressions for name in re.findall(r"\btrainguard_\w+", expr)}
    assert used - exported == set(), "queries use metrics nobody exports"


def test_promtool_parses_every_dashboard_query(tmp: Path) -> None:
    """Each panel's query is PromQL Prometheus accepts (Grafana's variables filled in)."""
    rules = []
    for number, query in enumerate(dashboard_queries()):
        if query.startswith("label_values("):  # Grafana's own function, not PromQL: check its selector
            query = re.sub(r"^label_values\((.*), \w+\)$", r"\1", query)
        expr = query.replace("$__rate_interval", "5m").replace("$namespace", ".*").replace("$job", ".*")
        rules.append({"record": f"dashboard:query_{number}:check", "expr": expr})
    path = write_rules(tmp, [{"name": "dashboard", "rules": rules}], "dashboard-rules.yaml")
    result = run(tool("promtool"), "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------------------------------
# promtool test rules: each alert fires when it must and stays silent when it must not
# --------------------------------------------------------------------------------------------------


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    """One input series of a promtool test: ``name{JOB labels, labels}`` with promtool's value syntax."""
    all_labels = {**JOB, **labels}
    selector = ",".join(f'{k}="{v}"' for k, v in sorted(all_labels.items()))
    return {"series": f"{name}{{{selector}}}", "values": values}


def ranks(name: str, values: str, count: int = 2) -> list[dict[str, str]]:
    """The same series for each rank's pod."""
    return [series(name, values, pod=f"llm-worker-{rank}") for rank in range(count)]


def expected_alert(
    rule: Mapping[str, Any], value_text: str | None = None, **labels: str
) -> dict[str, dict[str, str]]:
    """The alert promtool must see: the rule's labels plus the job's, and its annotations expanded."""
    annotations = {}
    for key, text in rule["annotations"].items():
        text = text.replace("{{ $labels.job }}", JOB["job"]).replace(
            "{{ $labels.namespace }}", JOB["namespace"]
        )
        for label, value in labels.items():
            text = text.replace(f"{{{{ $labels.{label} }}}}", value)
        if value_text is not None:
            text = re.sub(r"\{\{ \$value[^}]*\}\}", value_text, text)
        assert "{{" not in text, f"unexpanded template in {rule['alert']}: {text}"
        annotations[key] = text
    return {"exp_labels": {**rule["labels"], **JOB, **labels}, "exp_annotations": annotations}


def case(
    name: str,
    input_series: list[dict[str, str]],
    alert: str,
    checks: list[tuple[str, bool]],
    rules: Mapping[str, Any],
    value_text: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A promtool test: the series, then per (eval time, firing?) the alert expected (or none), with
    ``labels`` beyond the job's (a rank)."""
    return {
        "name": name,
        "interval": "1m",
        "input_series": input_series,
        "alert_rule_test": [
            {
                "eval_time": at,
                "alertname": alert,
                "exp_alerts": [expected_alert(rules[alert], value_text, **(labels or {}))] if firing else [],
            }
            for at, firing in checks
        ],
    }


def promtool_cases(rules: Mapping[str, Any]) -> list[dict[str, Any]]:
    defaults = DEFAULTS["alerts"]
    assert defaults["rollbackRate"]["window"] == "1h"
    assert defaults["rollbackRate"]["threshold"] == 3
    assert defaults["batchDropRate"]["threshold"] == 0.001
    assert defaults["batchDropRate"]["for"] == "5m"
    assert defaults["jobHung"]["afterSeconds"] == 1800
    assert defaults["checkpointStale"]["maxAgeSeconds"] == 7200
    assert defaults["straggler"]["threshold"] == 1.5
    assert defaults["straggler"]["for"] == "10m"
    score = "trainguard_worker_straggler_score"
    rollbacks = "trainguard_worker_rollbacks_total"
    samples, dropped = "trainguard_worker_samples_total", "trainguard_worker_dropped_samples_total"
    steps, phase = "trainguard_worker_steps_total", "trainguard_job_phase"
    checkpoint = "trainguard_worker_last_clean_checkpoint_timestamp_seconds"
    return [
        # --- TrainguardRollbackRateHigh: 3 rollbacks in the hour fire, 2 do not, old ones fade.
        case(
            "three rollbacks within the hour fire (every rank rolls back together: counted once)",
            ranks(rollbacks, "0x20 1 2 3x60"),
            "TrainguardRollbackRateHigh",
            # the window is (t-1h, t]: from 80m on it no longer holds the sample (20m) before the first
            # rollback, so only two are counted
            [("15m", False), ("60m", True), ("79m", True), ("80m", False)],
            rules,
        ),
        case(
            "two rollbacks within the hour stay silent",
            ranks(rollbacks, "0x20 1 2x60"),
            "TrainguardRollbackRateHigh",
            [("30m", False), ("60m", False)],
            rules,
        ),
        # --- TrainguardBatchDropRateHigh: 0.2 % fires after `for`, 0.005 % never.
        case(
            "a drop ratio of 0.2 % fires once it held for 5m",
            ranks(samples, "0+10000x60") + ranks(dropped, "0+20x60"),
            "TrainguardBatchDropRateHigh",
            [("4m", False), ("10m", True), ("40m", True)],
            rules,
            value_text="0.2%",
        ),
        case(
            "one rank dropping 0.4 % of its shard makes the job's ratio 0.2 %: fires",
            [
                series(samples, "0+10000x60", pod="llm-worker-0"),
                series(samples, "0+10000x60", pod="llm-worker-1"),
                series(dropped, "0+40x60", pod="llm-worker-0"),
                series(dropped, "0x60", pod="llm-worker-1"),
            ],
            "TrainguardBatchDropRateHigh",
            [("40m", True)],
            rules,
            value_text="0.2%",
        ),
        case(
            "a normal drop ratio of 0.005 % stays silent",
            ranks(samples, "0+10000x60") + ranks(dropped, "0+0.5x60"),
            "TrainguardBatchDropRateHigh",
            [("10m", False), ("40m", False)],
            rules,
        ),
        case(
            "no samples at all (0/0) stays silent",
            ranks(samples, "0x60") + ranks(dropped, "0x60"),
            "TrainguardBatchDropRateHigh",
            [("40m", False)],
            rules,
        ),
        # --- TrainguardJobHung
        case(
            "a Running job whose last step was at 10m fires 30m later, plus the 5m of `for`",
            [*ranks(steps, "0+10x10 100x60"), series(phase, "1x70", phase="Running")],
            "TrainguardJobHung",
            [("38m", False), ("43m", False), ("44m", True), ("60m", True)],
            rules,
        ),
        case(
            "a Running job that keeps stepping stays silent",
            [*ranks(steps, "0+10x70"), series(phase, "1x70", phase="Running")],
            "TrainguardJobHung",
            [("60m", False)],
            rules,
        ),
        case(
            "a Restarting job whose pods never come up (no worker series at all) fires",
            [series(phase, "1x70", phase="Restarting")],
            "TrainguardJobHung",
            [("30m", False), ("40m", True)],
            rules,
        ),
        case(
            "a job Running for 15m that has not stepped yet stays silent",
            [series(phase, "_x50 1x20", phase="Running")],
            "TrainguardJobHung",
            [("65m", False)],
            rules,
        ),
        case(
            "a Succeeded job with flat steps stays silent",
            [
                *ranks(steps, "100x70"),
                series(phase, "1x70", phase="Succeeded"),
                series(phase, "0x70", phase="Running"),
            ],
            "TrainguardJobHung",
            [("60m", False)],
            rules,
        ),
        case(
            "without operator metrics, a sidecar whose worker has not stepped for 30m fires",
            ranks("trainguard_worker_seconds_since_last_step", "0+60x70"),
            "TrainguardJobHung",
            [("33m", False), ("40m", True)],
            rules,
        ),
        # --- TrainguardRestartsExhausted
        case(
            "a job the operator gave up on (phase Failed) fires at once",
            [series(phase, "0x10 1x10", phase="Failed"), series(phase, "1x10 0x10", phase="Running")],
            "TrainguardRestartsExhausted",
            [("5m", False), ("11m", True)],
            rules,
        ),
        # --- TrainguardCheckpointStale
        case(
            "a clean checkpoint from time 0 goes stale after 7200 s (+5m)",
            ranks(checkpoint, "0x150"),
            "TrainguardCheckpointStale",
            [("110m", False), ("124m", False), ("126m", True)],
            rules,
        ),
        case(
            "fresh clean checkpoints stay silent",
            ranks(checkpoint, "0+60x150"),
            "TrainguardCheckpointStale",
            [("130m", False)],
            rules,
        ),
        case(
            "a job stepping for more than 7200 s without any clean checkpoint fires",
            ranks("trainguard_worker_step", "0+10x150"),
            "TrainguardCheckpointStale",
            [("100m", False), ("130m", True)],
            rules,
        ),
        case(
            "a job started 30m ago without a checkpoint yet stays silent",
            ranks("trainguard_worker_step", "_x100 0+10x50"),
            "TrainguardCheckpointStale",
            [("130m", False)],
            rules,
        ),
        # --- TrainguardStragglerRank: the operator's score per rank.
        case(
            "rank 1 at twice the others' compute fires once it held for 10m, naming the rank",
            [series(score, "0.5x40", rank="0"), series(score, "2x40", rank="1")],
            "TrainguardStragglerRank",
            [("9m", False), ("11m", True), ("30m", True)],
            rules,
            value_text="2.00",
            labels={"rank": "1"},
        ),
        case(
            "a rank slower than the threshold for 5m only stays silent",
            [series(score, "1x40", rank="0"), series(score, "1x10 3x5 1x25", rank="1")],
            "TrainguardStragglerRank",
            [("14m", False), ("20m", False), ("30m", False)],
            rules,
        ),
        case(
            "ranks within 1.3x of each other stay silent",
            [series(score, "0.77x40", rank="0"), series(score, "1.3x40", rank="1")],
            "TrainguardStragglerRank",
            [("30m", False)],
            rules,
        ),
    ]


def test_promtool_unit_tests_each_alert_fires_and_stays_silent(
    rules_file: Path, groups: list[dict[str, Any]], tmp: Path
) -> None:
    rules = _rules(groups)
    cases = promtool_cases(rules)
    assert {c["alert_rule_test"][0]["alertname"] for c in cases} == set(ALERTS)
    tests_file = tmp / "alerts_test.yaml"
    tests_file.write_text(
        yaml.safe_dump(
            {"rule_files": [rules_file.name], "evaluation_interval": "1m", "tests": cases}, sort_keys=False
        )
    )
    result = run(tool("promtool"), "test", "rules", str(tests_file))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_can_fail(rules_file: Path, groups: list[dict[str, Any]], tmp: Path) -> None:
    """The harness is not vacuous: a case with the wrong expectation makes promtool fail."""
    rules = _rules(groups)
    wrong = case(
        "0.005 % claimed to fire",
        ranks("trainguard_worker_samples_total", "0+10000x60")
        + ranks("trainguard_worker_dropped_samples_total", "0+0.5x60"),
        "TrainguardBatchDropRateHigh",
        [("40m", True)],
        rules,
        value_text="0.005%",
    )
    tests_file = tmp / "wrong_test.yaml"
    tests_file.write_text(yaml.safe_dump({"rule_files": [rules_file.name], "tests": [wrong]}))
    result = run(tool("promtool"), "test", "rules", str(tests_file))
    assert result.returncode != 0
    assert "TrainguardBatchDropRateHigh" in result.stdout + result.stderr


# --------------------------------------------------------------------------------------------------
# End to end: a real Prometheus scraping a real sidecar
# --------------------------------------------------------------------------------------------------


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def stop(process: subprocess.Popen[Any]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


class FaultyWorker:
    """Publishes a worker's status file as a guardian would, with bad samples and NaN bursts: every
    tick 1000 samples seen, 5 of them dropped (0.5 %), and a rollback every few ticks."""

    def __init__(self, path: Path, tick_seconds: float = 0.25) -> None:
        self.path = path
        self.tick_seconds = tick_seconds
        self.status = WorkerStatus(started_at=time.time(), phase=Phase.RUNNING)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="faulty-worker", daemon=True)
        self.publish()

    def publish(self) -> None:
        status = self.status
        status.step += 1
        status.steps_total += 1
        status.samples_seen += 1000
        status.samples_dropped += 5
        if status.step % 4 == 0:
            status.rollbacks += 1
            status.skipped_steps += 3
        status.last_step_time = status.updated_at = time.time()
        status.loss = 2.5
        write_status(self.path, status)

    def _run(self) -> None:
        while not self._stop.wait(self.tick_seconds):
            self.publish()

    def __enter__(self) -> FaultyWorker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[str, FaultyWorker]]:
    """A real sidecar process (python -m trainer_sidecar.sidecar) serving a faulty worker's status."""
    status_file = tmp_path / "status.json"
    with FaultyWorker(status_file) as worker:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "trainer_sidecar.sidecar", "--port", "0", "--host", "127.0.0.1"),
                *("--status-file", str(status_file), "--job", "e2e-llm", "--namespace", "e2e-ml"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            match = re.search(r"listening on (http://\S+)", line)
            assert match, (
                f"the sidecar did not start: {line!r} {process.stderr.read() if process.stderr else ''}"
            )
            yield match.group(1), worker
        finally:
            stop(process)


@pytest.fixture
def prometheus(tmp_path: Path, sidecar: tuple[str, FaultyWorker]) -> Iterator[str]:
    """A real Prometheus on 127.0.0.1 scraping the sidecar every second with the chart's rules, set to
    short windows (30s) and no `for`, evaluated every second."""
    sidecar_url, _ = sidecar
    values = {
        "alerts": {
            "rollbackRate": {"window": "30s", "threshold": 2, "for": "0s"},
            "batchDropRate": {"window": "30s", "for": "0s"},
        }
    }
    rules = write_rules(tmp_path, rule_groups(tmp_path, values))
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
                "rule_files": [str(rules)],
                "scrape_configs": [
                    {
                        # as the chart's PodMonitor: the sidecar's job/namespace labels win
                        "job_name": "trainguard-sidecar",
                        "honor_labels": True,
                        "static_configs": [{"targets": [sidecar_url.removeprefix("http://")]}],
                    }
                ],
            }
        )
    )
    check = run(tool("promtool"), "check", "config", str(config))
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            tool("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready in 30 s"
            time.sleep(0.2)
        yield url
    finally:
        stop(process)
        log.close()


def test_a_real_prometheus_fires_the_drop_rate_and_rollback_alerts(
    prometheus: str, sidecar: tuple[str, FaultyWorker]
) -> None:
    wanted = {"TrainguardBatchDropRateHigh", "TrainguardRollbackRateHigh"}
    deadline = time.monotonic() + 60
    firing: dict[str, dict[str, Any]] = {}
    seen: list[Any] = []
    while time.monotonic() < deadline:
        alerts = get_json(f"{prometheus}/api/v1/alerts")["data"]["alerts"]
        seen = alerts
        firing = {a["labels"]["alertname"]: a for a in alerts if a["state"] == "firing"}
        if wanted <= set(firing):
            break
        time.sleep(0.5)
    assert wanted <= set(firing), f"not firing within 60 s; alerts: {json.dumps(seen, indent=1)}"
    for name in wanted:
        alert = firing[name]
        # honor_labels: the alert names the GuardedTrainingJob, not the scrape job
        assert alert["labels"]["job"] == "e2e-llm", alert
        assert alert["labels"]["namespace"] == "e2e-ml", alert
        assert "Job e2e-llm in namespace e2e-ml" in alert["annotations"]["description"]
    drop = float(firing["TrainguardBatchDropRateHigh"]["value"])
    assert drop == pytest.approx(0.005, rel=0.05)
    assert "0.5%" in firing["TrainguardBatchDropRateHigh"]["annotations"]["description"]
    # the other alerts stay silent for this job
    others = {a["labels"]["alertname"] for a in seen} - wanted
    assert others == set(), others
    # Prometheus evaluated the chart's own rules, loaded from the rendered group
    groups = get_json(f"{prometheus}/api/v1/rules")["data"]["groups"]
    assert {r["name"] for g in groups for r in g["rules"]} == set(ALERTS)
