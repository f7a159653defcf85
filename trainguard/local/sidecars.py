"""A rank's sidecar under ``trainguard run``, treated the way a kubelet treats a pod's.

- Liveness: a probe passes on an HTTP status from 200 to 399; anything else, including no answer at
  all (the sidecar is down), is a failure. ``LIVENESS_FAILURE_THRESHOLD`` failures in a row (the value
  the operator renders for the kubelet) make the rank not alive; one passing probe resets the count.
- Restart: a sidecar that exits while its worker runs is started again (a native sidecar container has
  restartPolicy Always), at once the first time and then after a doubling delay from 10 s up to 5 min,
  as the kubelet's crash-loop backoff. A sidecar that stayed up for 10 minutes starts the count afresh.
- Probing: ``probe`` reads each rank's ``/status`` and ``/healthz`` into its ``RankProcesses`` once a probe
  period; between probes ``read_status`` reads the status alone (as the operator's poll does).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from trainer_sidecar.contract.env import PREFIX
from trainer_sidecar.contract.status import Phase, WorkerStatus
from trainguard.core.environment import sidecar_environment
from trainguard.core.observation import SidecarReport
from trainguard.core.probes import probe_timing
from trainguard.core.spec import GuardedTrainingJob
from trainguard.local.launch import RunRefused, printable

#: Failed probes in a row after which a rank is not alive (the kubelet's failureThreshold we render).
LIVENESS_FAILURE_THRESHOLD = probe_timing(1)["liveness_failure_threshold"]
SIDECAR_START_TIMEOUT = 30.0
_FIRST_BACKOFF_SECONDS = 10.0
_MAX_BACKOFF_SECONDS = 300.0
_BACKOFF_RESET_SECONDS = 600.0
_URL_LINE_LIMIT = 64 * 1024

Spawner = Callable[..., "subprocess.Popen[Any]"]


def restart_delay(restarts_so_far: int) -> float:
    """Seconds to wait before restarting a sidecar that has already been restarted ``restarts_so_far``
    times since it last ran steadily: 0, 10, 20, 40, ... capped at 300."""
    if restarts_so_far <= 0:
        return 0.0
    return min(_MAX_BACKOFF_SECONDS, _FIRST_BACKOFF_SECONDS * float(2 ** min(restarts_so_far - 1, 16)))


def probe_passed(code: int) -> bool:
    """Whether an HTTP status code is a passing probe (0 stands for no answer)."""
    return 200 <= code < 400


def liveness(
    consecutive_failures: int, failed_for: float | None = None, exit_grace: float = 0.0
) -> bool | None:
    """A rank's liveness after this many failed probes in a row: True (the last probe passed), None
    (failing, but below the threshold), False (not alive).

    A worker that published its final status "failed" ``failed_for`` seconds ago is about to exit with
    the code that says why (a configuration error): for ``exit_grace`` seconds it is not declared dead
    (None), so the exit code, not a hang, becomes the failure. After that it is judged as any other.
    """
    if consecutive_failures <= 0:
        return True
    if consecutive_failures < LIVENESS_FAILURE_THRESHOLD:
        return None
    return None if failed_for is not None and failed_for < exit_grace else False


def http_get(url: str, timeout: float) -> tuple[int, bytes]:
    """(status, body) of a GET; (0, b"") when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), bytes(response.read(_URL_LINE_LIMIT))
    except urllib.error.HTTPError as error:
        return int(error.code), bytes(error.read(_URL_LINE_LIMIT))
    except (urllib.error.URLError, OSError, TimeoutError, ValueError):
        return 0, b""


def listening_url(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The URL a starting sidecar prints ("... listening on URL"); "" if it exits or says nothing in time."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buffer = b""
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0 and len(buffer) < _URL_LINE_LIMIT:
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buffer += chunk
        for line in buffer.split(b"\n")[:-1]:
            if b"listening on" in line:
                return line.decode(errors="replace").strip().rsplit(" ", 1)[-1]
    return ""


class SidecarProcess:
    """One rank's sidecar process: started through ``spawn`` (which registers it for cleanup),
    restarted with backoff when it dies. ``url`` is "" while no sidecar answers."""

    def __init__(
        self, argv: Sequence[str], log_path: Path, spawn: Spawner, env: dict[str, str] | None = None
    ) -> None:
        self.argv = list(argv)
        self.env = env
        self.log_path = log_path
        self.spawn = spawn
        self.proc: subprocess.Popen[Any] | None = None
        self.url = ""
        self.restarts = 0
        self.started = 0.0
        self.due: float | None = None
        self.last_exit: int | None = None

    def start(self) -> bool:
        """Start a sidecar and wait for its URL; False (and nothing left running) if it did not come up."""
        self.launch()
        return self.wait_until_listening()

    def launch(self) -> None:
        """Start the sidecar process without waiting for it (``wait_until_listening`` then does), so that
        several sidecars start side by side."""
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = self.spawn(self.argv, stdout=subprocess.PIPE, stderr=log, env=self.env)
        self.started = time.monotonic()

    def wait_until_listening(self) -> bool:
        """Wait for the launched sidecar's URL; False (and nothing left running) if it did not come up."""
        assert self.proc is not None, "launch() first"
        self.url = listening_url(self.proc, SIDECAR_START_TIMEOUT)
        if not self.url:
            self.stop()
        return bool(self.url)

    def keep_running(self) -> str:
        """Restart the sidecar if it has exited and its backoff has passed; what happened, or ""."""
        now = time.monotonic()
        if self.proc is not None and self.proc.poll() is None and self.url:
            return ""
        if self.due is None:
            self.last_exit = self.proc.poll() if self.proc is not None else None
            if now - self.started >= _BACKOFF_RESET_SECONDS:
                self.restarts = 0
            self.due = now + restart_delay(self.restarts)
        if now < self.due:
            return ""
        self.due = None
        self.restarts += 1
        if self.start():
            return f"sidecar exited (code {self.last_exit}); restarted (restart {self.restarts})"
        return f"sidecar exited (code {self.last_exit}) and did not come back (restart {self.restarts})"

    def healthz(self, timeout: float) -> tuple[int, bytes]:
        """The liveness probe: (status, body), (0, b"") when no sidecar answers."""
        if not self.url or self.proc is None or self.proc.poll() is not None:
            return 0, b""
        return http_get(self.url + "/healthz", timeout)

    def get(self, path: str, timeout: float) -> tuple[int, bytes]:
        """GET ``path`` from the sidecar ((0, b"") when none answers)."""
        if not self.url:
            return 0, b""
        return http_get(self.url + path, timeout)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace``; close the pipe."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        stdout: IO[bytes] | None = proc.stdout
        if stdout is not None:
            stdout.close()
        self.url = ""


# ------------------------------------------------------------------- the ranks, probed through them ---
TERMINATION_MESSAGE_FILE = "termination-log"


@dataclass
class RankProcesses:
    """One rank of one attempt: the worker, its sidecar, and where their files are."""

    rank: int
    worker: subprocess.Popen[bytes]
    sidecar: SidecarProcess
    status_file: Path
    log_path: Path
    alive: bool | None = None
    health_reason: str = ""
    probe_failures: int = 0
    failed_since: float | None = None
    exit_reason: str | None = None
    #: When the runner first saw the worker ended (``time.monotonic()``; None while it runs).
    ended_at: float | None = None
    #: The worker's status as its sidecar last served it (None: not read yet).
    status: WorkerStatus | None = None
    #: The hang timeout its sidecar last said it judges the worker by (None: not said yet).
    hang_timeout_seconds: float | None = None
    #: Its sidecar's own verdict in its last ``/status`` (None: not read yet), and the reason it gave.
    verdict_alive: bool | None = None
    verdict_reason: str = ""

    @property
    def sidecar_url(self) -> str:
        """Where the rank's sidecar answers ("" while it is down)."""
        return self.sidecar.url

    @property
    def termination_file(self) -> Path:
        """The worker's termination-message file (``TRAINGUARD_TERMINATION_MESSAGE_PATH``)."""
        return self.status_file.with_name(TERMINATION_MESSAGE_FILE)


def sidecar_env(job: GuardedTrainingJob, status_file: Path) -> dict[str, str]:
    """The environment of one rank's sidecar: the job's, as the operator renders it, on loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env.update(sidecar_environment(job, status_file=str(status_file), host="127.0.0.1", port=0).variables())
    return env


def launch_sidecars(
    job: GuardedTrainingJob, attempt_dir: Path, spawn: Spawner
) -> list[tuple[int, SidecarProcess, Path]]:
    """Start the sidecars of the attempt whose folder is ``attempt_dir`` side by side (their start costs
    one sidecar's time, not one per rank) and wait until each listens; each rank's sidecar and status
    file. RunRefused if one does not start."""
    sidecars = []
    for rank in range(job.spec.replicas):
        status_file = attempt_dir / f"rank-{rank}" / "status.json"
        status_file.parent.mkdir(parents=True, exist_ok=True)
        sidecar = SidecarProcess(
            [sys.executable, "-m", "trainer_sidecar.sidecar"],
            status_file.with_name("sidecar.log"),
            spawn,
            env=sidecar_env(job, status_file),
        )
        sidecar.launch()
        sidecars.append((rank, sidecar, status_file))
    for rank, sidecar, _ in sidecars:
        if not sidecar.wait_until_listening():
            raise RunRefused(f"rank {rank}'s sidecar did not start: see {sidecar.log_path}")
    return sidecars


def probe(
    ranks: Sequence[RankProcesses],
    probe_period_seconds: float,
    stop_grace_seconds: float,
    event: Callable[[str, str], Any],
) -> None:
    """Ask every sidecar for liveness (like the kubelet's probe) and status (like the operator).

    A sidecar that exited is restarted first (with backoff; ``event`` is told). A failed or unanswered
    probe counts towards the failure threshold; a rank is not alive once the threshold is reached, or as
    soon as its sidecar's own verdict in ``/status`` says so (``heed_verdict``).
    """
    timeout = min(5.0, probe_period_seconds)
    for rank in ranks:
        if rank.worker.poll() is not None:
            continue
        happened = rank.sidecar.keep_running()
        if happened:
            event("sidecar", f"rank {rank.rank}: {happened}")
        fetch_status(rank)
        code, body = rank.sidecar.healthz(timeout)
        rank.probe_failures = 0 if probe_passed(code) else rank.probe_failures + 1
        rank.alive = rank_liveness(rank, stop_grace_seconds)
        rank.health_reason = "" if probe_passed(code) else probe_failure(rank, code, body)
        heed_verdict(rank)


def heed_verdict(rank: RankProcesses) -> None:
    """A worker its sidecar judges not alive is not alive at once, as the operator acts on the same
    verdict at its poll of ``/status``: the kubelet's threshold of failed probes is there to ride out
    probes that went unanswered, not to second-guess a verdict, and waiting for it added two probe
    periods to every hang's detection. A worker that published its final "failed" keeps the stop
    grace to exit (``rank_liveness``)."""
    ending = rank.status is not None and rank.status.phase is Phase.FAILED
    if rank.verdict_alive is False and not ending:
        rank.alive = False
        rank.health_reason = rank.verdict_reason


def rank_liveness(rank: RankProcesses, stop_grace_seconds: float) -> bool | None:
    """The kubelet's verdict, except that a worker that published its final status ("failed") gets
    the stop grace to exit: its exit code (a configuration error) says more than a hang would."""
    if rank.status is None or rank.status.phase is not Phase.FAILED:
        rank.failed_since = None
        return liveness(rank.probe_failures)
    now = time.monotonic()
    rank.failed_since = rank.failed_since if rank.failed_since is not None else now
    return liveness(rank.probe_failures, now - rank.failed_since, stop_grace_seconds)


def probe_failure(rank: RankProcesses, code: int, body: bytes) -> str:
    """Why a rank's liveness probe failed, as the kubelet's event says it."""
    answer = printable(body.decode(errors="replace")) if code else ""
    if not answer:
        answer = f"HTTP {code}" if code else "no answer (the sidecar is down)"
    times = "once" if rank.probe_failures == 1 else f"{rank.probe_failures} times in a row"
    return f"liveness probe failed {times}: {answer}"


def read_status(rank: RankProcesses) -> None:
    """Refresh one rank's status from its sidecar's /status (kept as it was when none can be had),
    and heed the sidecar's verdict in it."""
    if fetch_status(rank):
        heed_verdict(rank)


def fetch_status(rank: RankProcesses) -> bool:
    """Read one rank's /status into ``rank`` (its status, hang timeout and the sidecar's verdict);
    whether the sidecar answered with one."""
    code, body = rank.sidecar.get("/status", 2.0)
    if code != 200:
        return False
    report = SidecarReport.from_document(body)
    if report.status is not None:
        rank.status = report.status
    if report.hang_timeout_seconds is not None:
        rank.hang_timeout_seconds = report.hang_timeout_seconds
    if report.reachable:
        rank.verdict_alive, rank.verdict_reason = report.alive, report.reason
    return report.reachable
