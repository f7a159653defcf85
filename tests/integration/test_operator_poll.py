"""The operator's HTTP client of the sidecars (``SidecarPoller``) against a loopback server that plays a
sidecar at the edges of its connections: what a restart order needs to get through, and what it must
never do twice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio
from trainguard_operator.inplace import order_signer
from trainguard_operator.poll import ORDER_CONNECT_TRIES, ORDER_RETRY_SECONDS, SidecarPoller

from tests.support.ports import free_ports
from trainer_sidecar.contract.inplace import (
    ORDER_PATH,
    LauncherPhase,
    LauncherState,
    RestartOrder,
    StopMode,
    order_token_digest,
    read_order,
    write_launcher_state,
)
from trainer_sidecar.sidecar.server import SidecarServer

pytestmark = pytest.mark.asyncio

ORDER = RestartOrder(attempt=2, environment={}, stop=StopMode.KILL, start_delay_seconds=2.0)
SIGNER = order_signer("k" * 40, "uid-tiny-lm", "default", "tiny-lm-1")
POD = "tiny-lm-1-worker-0"


@dataclass
class Sidecar:
    """A sidecar's HTTP/1.1 server reduced to its connections: it answers the first request of every
    connection and keeps the connection open; a later request on a kept connection finds it closed
    (the sidecar dropped it as idle just as the request went out). ``answer_orders`` False: an order is
    read, then the connection is dropped unanswered (the order may have been taken)."""

    answer_orders: bool = True
    connections: int = 0
    requests: list[str] = field(default_factory=list)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *header_lines = head.decode().split("\r\n")
            length = next(
                (int(h.split(":", 1)[1]) for h in header_lines if h.lower().startswith("content-length:")), 0
            )
            await reader.readexactly(length)
            self.requests.append(request_line)
            is_order = request_line.startswith("POST")
            if is_order and not self.answer_orders:
                return
            status, body = ("202 Accepted", b"taken\n") if is_order else ("200 OK", b"{}")
            writer.write(f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            await reader.read(1)  # kept open until the client closes it, or a second request comes
        finally:
            writer.close()


@pytest_asyncio.fixture
async def poller() -> AsyncIterator[SidecarPoller]:
    client = SidecarPoller(free_ports(1)[0], concurrency=4, timeout_seconds=5.0)
    yield client
    await client.close()


async def listen(sidecar: Sidecar, port: int) -> asyncio.Server:
    return await asyncio.start_server(sidecar.serve, "127.0.0.1", port)


async def test_an_order_after_a_poll_goes_on_a_connection_of_its_own(poller: SidecarPoller) -> None:
    """The poll's connection is kept in the pool, and the sidecar closes it as the order would go out on
    it: the order still gets through, on a new connection."""
    sidecar = Sidecar()
    async with await listen(sidecar, poller.port):
        await poller.report("127.0.0.1")  # its body is no status: only its connection matters here
        assert await poller.order("127.0.0.1", POD, SIGNER, ORDER) == ""
    assert sidecar.requests == ["GET /status HTTP/1.1", f"POST {ORDER_PATH} HTTP/1.1"]
    assert sidecar.connections == 2


async def test_an_order_to_a_sidecar_that_listens_a_moment_late_is_tried_again(poller: SidecarPoller) -> None:
    sidecar = Sidecar()

    async def late() -> asyncio.Server:
        await asyncio.sleep(ORDER_RETRY_SECONDS / 2)
        return await listen(sidecar, poller.port)

    starting = asyncio.create_task(late())
    why = await poller.order("127.0.0.1", POD, SIGNER, ORDER)
    async with await starting:
        assert why == ""
    assert sidecar.requests == [f"POST {ORDER_PATH} HTTP/1.1"]


async def test_an_order_nobody_listens_for_fails_after_every_try_and_says_so(poller: SidecarPoller) -> None:
    why = await poller.order("127.0.0.1", POD, SIGNER, ORDER)
    assert "ClientConnectorError" in why, why
    assert f"tried {ORDER_CONNECT_TRIES} times" in why, why


async def test_an_order_sent_but_not_answered_is_never_sent_again(poller: SidecarPoller) -> None:
    """The sidecar read the order and dropped the connection: it may have taken it, so the order is not
    repeated (a repeat of a taken order is refused as not newer, which would fail the restart)."""
    sidecar = Sidecar(answer_orders=False)
    async with await listen(sidecar, poller.port):
        why = await poller.order("127.0.0.1", POD, SIGNER, ORDER)
    assert why, "an unanswered order was reported as taken"
    assert sidecar.requests == [f"POST {ORDER_PATH} HTTP/1.1"]


async def test_an_order_to_a_real_sidecar_is_taken_once_and_sent_again_is_still_taken(
    poller: SidecarPoller, tmp_path: Path
) -> None:
    """Against the sidecar itself: the operator's signed order is taken (202); sent again, as by an
    operator restarted before it knew the answer, it is answered "already ordered" (200), which counts
    as taken; an order signed for another pod is refused."""
    now = time.time()
    state = LauncherState(attempt=1, phase=LauncherPhase.RUNNING, since=now, updated_at=now)
    write_launcher_state(tmp_path, state)
    sidecar = SidecarServer(
        tmp_path / "status.json",
        host="127.0.0.1",
        port=poller.port,
        order_token_sha256=order_token_digest(SIGNER.token),
        order_signing_key=SIGNER.signing_key,
        pod_name=POD,
    )
    with sidecar:
        assert await poller.order("127.0.0.1", POD, SIGNER, ORDER) == ""
        assert await poller.order("127.0.0.1", POD, SIGNER, ORDER) == ""
        why = await poller.order("127.0.0.1", "tiny-lm-1-worker-1", SIGNER, ORDER)
    assert why.startswith(f"{ORDER_PATH} answered 403: the order is for pod default/tiny-lm-1-worker-1"), why
    assert read_order(tmp_path).order == ORDER
