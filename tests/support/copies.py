"""Control over the background copier that snapshots and checkpoints use (``tensors.tensorstate``),
for tests that must decide what a training loop does before a copy runs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from trainer_sidecar.tensors import tensorstate


@contextmanager
def copies_held() -> Iterator[threading.Event]:
    """Hold every background copy started inside the block until the yielded event is set (at the latest
    when the block ends): the copier has one thread, and it is kept busy waiting for the event."""
    release = threading.Event()
    tensorstate._COPIER.submit(release.wait)
    try:
        yield release
    finally:
        release.set()
