"""Being told to stop: SIGTERM (Kubernetes ends a pod with it, then waits its grace period before SIGKILL:
an eviction, a preemption, a node drain, ``trainguard run`` stopping its gang) and Ctrl-C.

A stop signal concerns the whole process, so there is one ``StopRequest`` per process (``STOP``). It
records the signal and returns at once; a guardian acts on it at its next step boundary, agreed over the
ranks within the step's own collective, by saving a checkpoint (when the last step was clean) and
exiting with ``128 + signal`` as a shell would report. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger("trainguard")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """The stop signal received, if any (``signal``), while at least one guardian holds the request.

    Handlers are installed by the first ``acquire`` (from the main thread only) and only over the default
    disposition, so a loop's own handler is left alone (the guardian then cannot checkpoint on that
    signal); the last ``release`` puts the defaults back, so the process stops as usual once no guardian
    is training.
    """

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self._holders = 0
        self._installed: dict[signal.Signals, object] = {}
        self._lock = threading.Lock()

    @property
    def requested(self) -> bool:
        """Whether a stop signal arrived."""
        return self.signal is not None

    def acquire(self) -> None:
        """Hold the request (install the handlers if this is the first holder)."""
        with self._lock:
            self._holders += 1
            if self._holders == 1:
                self.signal = None
                self._install()

    def release(self) -> None:
        """Let go of the request (put the defaults back if this was the last holder)."""
        with self._lock:
            self._holders = max(0, self._holders - 1)
            if self._holders == 0:
                self._uninstall()

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            current = signal.getsignal(sig)
            if current in (signal.SIG_DFL, signal.default_int_handler):
                self._installed[sig] = current
                signal.signal(sig, self._on_signal)

    def _uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._installed.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous)  # type: ignore[arg-type]
        self._installed.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        received = signal.Signals(signum)
        if self.signal is not None and received is signal.SIGINT:
            with self._lock:
                self._uninstall()
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
        self.signal = received
        log.warning("received %s: checkpointing at the next step boundary, then exiting", received.name)


#: The process's stop request, shared by every guardian in it.
STOP = StopRequest()
