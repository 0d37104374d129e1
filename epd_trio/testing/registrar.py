"""vLLM's HTTP registrar on Trio: an instance announcing itself to one or several proxies.

A vLLM instance started with ``proxy_url`` in its EC transfer config registers itself with the
proxy over HTTP. vLLM 0.32 (the CPU wheel the real-vLLM suite runs) does not ship that
registrar yet, so this module behaves as vLLM's does, for tests and demos: a replicated proxy
must take the registrations of instances it never heard of at start, and lose them when they
stop.

Followed: ``vllm/distributed/ec_transfer/proxy/register.py`` (``ProxyRegistrar`` and
``maybe_start``), vLLM main as of its commit 92129c60 (read for its behaviour, not copied):

- ``proxy_url`` is one URL or a list; every proxy gets the same record
  ``{"role", "url", "ec_zmq_addrs", "dp_size"}`` at ``{proxy}/instances`` (trailing slashes
  stripped from both URLs).
- **Start:** a round POSTs to every proxy at once, and every round goes to all of them again,
  also to those that accepted before. Rounds repeat every 5 s until one round is accepted by
  all. A proxy that is still starting then costs seconds, not an announce interval.
- **Accepted means status 200**, and nothing else: a 201 or a 4xx is "rejected", logged at
  WARNING with the status and the body. A transport error or a timeout (5 s per request) is
  logged at DEBUG. vLLM treats both the same way: not accepted, tried again next round, never
  raised.
- **Then** a round every 30 s (``proxy_announce_interval``), with its outcome ignored: a proxy
  that restarted empty is refilled at the next announce, not sooner.
- **Stop:** the announcing stops, then one DELETE round sends the same record as the body.
  There is no retry, and its outcome is ignored.
- vLLM opens a new HTTP session per round, and so does this module: each round makes new
  connections, so a list that names one Kubernetes Service may reach another replica per round.

Where this differs from vLLM: ``api_key`` sends ``X-API-Key``, which this proxy's admin routes
need. vLLM's registrar sends no header at all, and its own proxy checks none. Stopping is Trio's
way: cancelling ``run`` (or leaving ``run_registrar``'s block) sends the DELETE round, shielded
and bounded by the request timeout.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

log = logging.getLogger(__name__)

#: vLLM's ``_RETRY_INTERVAL``: seconds between start-up rounds until every proxy accepts.
DEFAULT_RETRY_INTERVAL = 5.0
#: vLLM's ``DEFAULT_ANNOUNCE_INTERVAL`` (``proxy_announce_interval``): seconds between announces.
DEFAULT_ANNOUNCE_INTERVAL = 30.0
#: vLLM's ``_REQUEST_TIMEOUT``: the whole of one request, connect to body.
DEFAULT_REQUEST_TIMEOUT = 5.0


class Registrar:
    """Keeps one instance in the roster of every proxy in ``proxy_url``.

    Start it with ``await nursery.start(registrar.run)``. It returns at once (vLLM never holds
    an instance's start-up for its proxies) and announces in the background until cancelled,
    then sends its DELETE round. ``wait_until`` lets a test follow it without sleeping.
    ``transport`` is for tests (``httpx.MockTransport`` on a virtual clock); by default each
    round opens real connections.
    """

    def __init__(
        self,
        proxy_url: str | Sequence[str],
        *,
        role: str,
        url: str,
        ec_zmq_addrs: Sequence[str] = (),
        dp_size: int = 1,
        api_key: str | None = None,
        retry_interval: float = DEFAULT_RETRY_INTERVAL,
        announce_interval: float = DEFAULT_ANNOUNCE_INTERVAL,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        urls = [proxy_url] if isinstance(proxy_url, str) else list(proxy_url)
        if not urls:
            raise ValueError("Registrar needs at least one proxy URL")
        self.proxy_urls = [u.rstrip("/") for u in urls]
        self.record: dict[str, Any] = {"role": role, "url": url.rstrip("/"),
                                       "ec_zmq_addrs": list(ec_zmq_addrs), "dp_size": dp_size}
        self.retry_interval = retry_interval
        self.announce_interval = announce_interval
        self.request_timeout = request_timeout
        self._headers = {} if api_key is None else {"x-api-key": api_key}
        self._transport = transport
        #: Rounds sent so far, DELETE included.
        self.rounds = 0
        #: Whether one round was accepted by every proxy (the start-up retries are over).
        self.registered = False
        #: Each proxy's answer in its latest round: True when it accepted (status 200).
        self.accepted: dict[str, bool] = dict.fromkeys(self.proxy_urls, False)
        self._progress = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, re-checked after each round."""
        while not predicate():
            await self._progress.wait()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Announce until cancelled, then leave every proxy's roster (one DELETE round)."""
        task_status.started()
        try:
            while not await self._round("POST"):  # noqa: ASYNC110 (the sleep is the schedule)
                await trio.sleep(self.retry_interval)
            self.registered = True
            self._changed()
            while True:
                await trio.sleep(self.announce_interval)
                await self._round("POST")
        finally:
            # Bounded: every request of the round has its own ``request_timeout``.
            with trio.CancelScope(shield=True):
                await self._round("DELETE")

    async def _round(self, method: str) -> bool:
        """Send the record to every proxy at once; whether all of them accepted it."""
        answers: dict[str, bool] = {}
        async with httpx.AsyncClient(transport=self._transport, trust_env=False,
                                     timeout=self.request_timeout) as client, \
                trio.open_nursery() as nursery:
            for proxy in self.proxy_urls:
                nursery.start_soon(self._send, client, method, proxy, answers)
        self.accepted = answers
        self.rounds += 1
        self._changed()
        return all(answers.values())

    async def _send(
        self, client: httpx.AsyncClient, method: str, proxy: str, answers: dict[str, bool]
    ) -> None:
        answers[proxy] = False
        with trio.move_on_after(self.request_timeout) as scope:
            try:
                response = await client.request(method, f"{proxy}/instances", json=self.record,
                                                headers=self._headers)
            except (httpx.HTTPError, httpx.InvalidURL, OSError) as exc:  # vLLM: never raised
                log.debug("could not reach the proxy %s: %r", proxy, exc)
                return
        if scope.cancelled_caught:
            log.debug("the proxy %s did not answer within %g s", proxy, self.request_timeout)
            return
        if response.status_code == 200:
            answers[proxy] = True
        else:
            log.warning("the proxy %s refused the %s of %s with %d: %s", proxy, method,
                        self.record["url"], response.status_code, response.text)

    def _changed(self) -> None:
        self._progress.set()
        self._progress = trio.Event()


@asynccontextmanager
async def run_registrar(proxy_url: str | Sequence[str], **options: Any) -> AsyncIterator[Registrar]:
    """A running ``Registrar`` (same arguments) for the block; leaving it sends the DELETEs.

    ``async with run_registrar([a, b, c], role="encode", url=fake.url, api_key=KEY) as r:``
    announces to three replicas; ``await r.wait_until(lambda: r.registered)`` waits for all.
    """
    registrar = Registrar(proxy_url, **options)
    async with trio.open_nursery() as nursery:
        await nursery.start(registrar.run)
        yield registrar
        nursery.cancel_scope.cancel()
