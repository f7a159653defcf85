"""Asking the sidecars for ``/status``, and giving them restart orders: bounded concurrency over all jobs,
a timeout per request."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

import aiohttp
from trainguard_operator.inplace import OrderSigner

from trainer_sidecar.contract.inplace import ORDER_PATH, RestartOrder
from trainguard.core.observation import SidecarReport

#: The sidecar's answers when it wrote an order for its launcher, and when its attempt already runs or
#: was ordered there (an order sent again, by an operator that restarted before it knew the answer).
ORDER_ACCEPTED = 202
ORDER_ALREADY_TAKEN = 200
#: Tries of an order whose connection could not be made (so nothing was sent), and the pause after each.
ORDER_CONNECT_TRIES = 3
ORDER_RETRY_SECONDS = 0.2


class SidecarPoller:
    """Polls ``http://<podIP>:<port>/status``; at most ``concurrency`` requests are in flight at once.

    A sidecar that cannot be reached, times out or answers garbage gives an unreachable report (its rank
    counts as "not known"), never an exception.
    """

    def __init__(self, port: int, concurrency: int, timeout_seconds: float) -> None:
        self.port = port
        self.timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._semaphore = asyncio.Semaphore(concurrency)
        self._session: aiohttp.ClientSession | None = None
        self._order_session: aiohttp.ClientSession | None = None

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    async def _order_client(self) -> aiohttp.ClientSession:
        # Every order on a connection of its own: a pooled one may be closed by the sidecar (it drops a
        # connection idle for its handler timeout) just as the order goes out, and an order that fails
        # for that makes a restart in place fall back to a new PyTorchJob for nothing. (A poll's GET on
        # such a connection is repeated on a new one by aiohttp itself; a POST never is.)
        if self._order_session is None or self._order_session.closed:
            connector = aiohttp.TCPConnector(force_close=True)
            self._order_session = aiohttp.ClientSession(timeout=self.timeout, connector=connector)
        return self._order_session

    async def close(self) -> None:
        """Close the HTTP sessions."""
        for session in (self._session, self._order_session):
            if session is not None:
                await session.close()
        self._session = self._order_session = None

    def url(self, ip: str, path: str = "/status") -> str:
        """The URL of ``path`` on the sidecar of the pod at ``ip``."""
        host = f"[{ip}]" if ":" in ip else ip
        return f"http://{host}:{self.port}{path}"

    async def order(self, ip: str, pod: str, signer: OrderSigner, order: RestartOrder) -> str:
        """Give the sidecar of the pod ``pod`` at ``ip`` a restart order, signed for it by ``signer``: ""
        once it took it (or its attempt already runs or was ordered there), else why not (its answer, or
        why it could not be reached). Never raises for what the network or a sidecar does.

        The order goes on a new connection, signed when its turn comes (it is good for a minute). A
        connection that could not be made is tried again, up to ``ORDER_CONNECT_TRIES`` times in all:
        nothing was sent. Any other failure is final: the sidecar may have taken the order."""
        headers = {"Authorization": f"Bearer {signer.token}", "Content-Type": "application/json"}
        async with self._semaphore:
            body = signer.body(pod, order, time.time())
            session = await self._order_client()
            why = ""
            for tried in range(1, ORDER_CONNECT_TRIES + 1):
                try:
                    async with session.post(self.url(ip, ORDER_PATH), data=body, headers=headers) as answer:
                        if answer.status in (ORDER_ACCEPTED, ORDER_ALREADY_TAKEN):
                            return ""
                        text = (await answer.text())[:300]
                        return f"{ORDER_PATH} answered {answer.status}: {text.strip()}"
                except aiohttp.ClientConnectorError as exc:
                    why = f"{type(exc).__name__}: {exc}"
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    return f"{type(exc).__name__}: {exc}"
                if tried < ORDER_CONNECT_TRIES:
                    await asyncio.sleep(ORDER_RETRY_SECONDS)
        return f"{why} (tried {ORDER_CONNECT_TRIES} times)"

    async def report(self, ip: str) -> SidecarReport:
        """One sidecar's report."""
        async with self._semaphore:
            session = await self._client()
            try:
                async with session.get(self.url(ip)) as response:
                    if response.status != 200:
                        return SidecarReport(reachable=False, reason=f"/status answered {response.status}")
                    text = await response.text()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                return SidecarReport(reachable=False, reason=f"{type(exc).__name__}: {exc}")
        try:
            return SidecarReport.from_document(json.loads(text))
        except ValueError as exc:
            return SidecarReport(reachable=False, reason=f"/status is not JSON: {exc}")

    async def reports(self, targets: Sequence[tuple[str, str]]) -> dict[str, SidecarReport]:
        """Reports by pod name for ``(pod name, pod IP)`` targets, asked concurrently (within the bound)."""
        answers = await asyncio.gather(*(self.report(ip) for _, ip in targets))
        return {name: answer for (name, _), answer in zip(targets, answers, strict=True)}
