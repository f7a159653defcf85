"""A rank's sidecar under ``trainguard run``, treated the way a kubelet treats a pod's.

- Liveness: a probe passes on an HTTP status from 200 to 399; anything else, including no answer at
  all (the sidecar is down), is a failure. ``LIVENESS_FAILURE_THRESHOLD`` failures in a row (the value
  the operator renders for the kubelet) make the rank not alive; one passing probe resets the count.
- Restart: a sidecar that exits while its worker runs is started again (a native sidecar container has
  restartPolicy Always), at once the first time and then after a doubling delay from 10 s up to 5 min,
  as the kubelet's crash-loop backoff. A sidecar that stayed up for 10 minutes starts the count afresh.
"""

from __future__ import annotations

import os
import select
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from trainguard.core.probes import probe_timing

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
