"""The operator's API calls: a step acting on a failure runs its calls in threads of its own."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from trainguard_operator.kube import KubeApi


def test_a_failures_calls_do_not_wait_behind_the_calls_queued_in_the_default_threads() -> None:
    async def scenario() -> tuple[str, bool]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        urgent_threads = ThreadPoolExecutor(1, thread_name_prefix="urgent")
        api = KubeApi(client=None, urgent_executor=urgent_threads)
        release = threading.Event()
        # The default threads are busy (a burst of admissions) ...
        admissions = [asyncio.ensure_future(api._call(release.wait, 10)) for _ in range(3)]
        queued = asyncio.ensure_future(api._call(threading.current_thread))
        await asyncio.sleep(0.05)
        # ... and the restart's call runs at once, in a thread of its own.
        urgent = await asyncio.wait_for(api.urgent()._call(lambda: threading.current_thread().name), 2)
        waiting = not queued.done()
        release.set()
        await asyncio.gather(*admissions, queued)
        urgent_threads.shutdown()
        return urgent, waiting

    name, ordinary_still_waiting = asyncio.run(scenario())
    assert name.startswith("urgent")
    assert ordinary_still_waiting


def test_without_urgent_threads_urgent_is_the_same_api() -> None:
    api = KubeApi(client=None)
    assert api.urgent() is api
