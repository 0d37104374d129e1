"""Kubernetes discovery: list, then watch, the pods of each role's label selector.

One task per role (``EPD_DECODE_SELECTOR``, ...), each doing what client-go's reflector does:

- **list** the pods (``GET /api/v1/namespaces/NS/pods?labelSelector=...``, in pages of
  ``LIST_PAGE`` with ``continue``), and take the list's ``resourceVersion``;
- **watch** from there (``watch=true&resourceVersion=RV&allowWatchBookmarks=true``): the answer
  is a chunked stream of JSON lines, one event each, folded into the view
  (``_core/discovery.PodView``); a ``BOOKMARK`` only moves the version watched from. The API
  ends a watch after ``timeoutSeconds``: the next one starts from the last version seen;
- **410 Gone** (as the watch's status, or an ``ERROR`` event: the version is older than the API
  server keeps) means list again; so does a list whose ``continue`` token expired. Once at
  once; a 410 again before a watch ended in time backs off like an error;
- a **dropped connection**, a timeout, a 5xx or a refusal: reconnect after a backoff (doubling
  from 0.5 s to 30 s, jittered), watching from the last version seen. So does a watch that
  ended cleanly within a second without an event (client-go's "very short watch").

Until a new answer comes, the roster keeps the last view: an API server that is unreachable
never empties it. After every list and every event, the role's Ready pods replace its
members in the roster (``apply``; idempotent, so an event that changes no instance costs one
comparison).

Why httpx and not a Kubernetes client: the official client is synchronous (a thread per
watch); ``kubernetes-asyncio`` is asyncio only. ``kr8s`` runs on anyio (so on trio), but its
``async_watch`` (read in kr8s' ``_api.py``) does what this module must not: it asks for no
bookmarks, reads with no timeout (a half-open connection hangs it for ever), answers a 410 by
watching again from the same expired version instead of listing, and ends with an exception on
a dropped connection; it also brings a dozen dependencies for the two GETs used here. httpx is
already a dependency and runs on trio natively.

How the API server is reached (in-cluster, a kubeconfig, or a given URL) is ``_discovery/kube_api``'s.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from contextlib import aclosing
from typing import Any

import httpx
import orjson
import trio

from .._core.discovery import (
    Discovered,
    PodView,
    backoff,
    watch_event,
)
from .kube_api import KubeApi, KubeConnection

log = logging.getLogger("epd_trio.discovery")
#: Pods per list page.
LIST_PAGE = 500
#: Seconds a watch is asked to last (``timeoutSeconds``); the read timeout is longer, so a
#: connection that went silent without closing is noticed within ``WATCH_SECONDS + 30``.
WATCH_SECONDS = 60
#: Seconds to connect, and to get a list's answer.
REQUEST_TIMEOUT = 10.0
#: Seconds under which a watch that delivered no event is a failure (``ShortWatch``).
SHORT_WATCH = 1.0
#: A list's timeouts: connect, send, read, each REQUEST_TIMEOUT.
LIST_TIMEOUT = httpx.Timeout(REQUEST_TIMEOUT)

Apply = Callable[[str, str, Sequence[Discovered]], tuple[list[str], list[str]]]


class ApiError(Exception):
    """The API answered with an error status (401, 403, 5xx ...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Gone(Exception):
    """410: the version watched or listed from is no longer kept; list again."""


class ShortWatch(Exception):
    """A watch that ended cleanly within ``SHORT_WATCH`` having delivered nothing: something
    between here and the API server cuts it. Handled as an error (backoff), as client-go's
    reflector does ("very short watch"), or it would be asked again in a busy loop."""


class KubernetesDiscovery:
    """One list-and-watch task per ``(role, selector)``, until cancelled.

    ``run`` reports started once every role's first list answered or failed, so a proxy serves
    with the pods already known.
    """

    def __init__(
        self, selectors: Sequence[tuple[str, str]], apply: Apply, *, api: KubeApi, port: int,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._selectors = list(selectors)
        self._apply = apply
        self._api = api
        self._port = port
        self._jitter = jitter
        self._connection: KubeConnection | None = None
        #: The view of each role (pods and the version watched from).
        self.views: dict[str, PodView | None] = dict.fromkeys((r for r, _ in self._selectors))
        #: Counts per role: lists made, watch events handled, reconnects after errors.
        self.lists: dict[str, int] = dict.fromkeys(self.views, 0)
        self.events: dict[str, int] = dict.fromkeys(self.views, 0)
        self.reconnects: dict[str, int] = dict.fromkeys(self.views, 0)
        #: The pods each role skips as unusable now (a bad IP or annotation): each is warned
        #: about once, when it starts being skipped, not at every event.
        self._skipped: dict[str, set[str]] = {role: set() for role in self.views}
        self._changed = trio.Event()

    @staticmethod
    def source(role: str, selector: str) -> str:
        return f"kubernetes {role} {selector}"

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, re-checked after each list, event and error."""
        while not predicate():
            await self._changed.wait()

    def _step(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # Nothing to reach the API server with (no pod, no kubeconfig, a refused one): start-up
        # fails here with an OSError naming the cause.
        self._connection = connection = self._api.connect()
        timeout = httpx.Timeout(REQUEST_TIMEOUT, read=WATCH_SECONDS + 30)
        log.info("Kubernetes discovery in namespace %s at %s: %s", connection.namespace,
                 connection.described,
                 "; ".join(f"{role} {sel}" for role, sel in self._selectors))
        # A connection per call (a watch lasts a minute, lists are rare): no reuse of a
        # connection the API server may be closing, and nothing to go stale between calls.
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=connection.base_url, verify=connection.verify,
                                     timeout=timeout, limits=limits) as client:
            path = f"/api/v1/namespaces/{connection.namespace}/pods"
            firsts = []
            async with trio.open_nursery() as nursery:
                for role, selector in self._selectors:
                    first = trio.Event()
                    firsts.append(first)
                    nursery.start_soon(self._follow, client, path, role, selector, first)
                for first in firsts:
                    await first.wait()
                task_status.started()

    async def _follow(self, client: httpx.AsyncClient, path: str, role: str, selector: str,
                      first: trio.Event) -> None:
        failures = gone = 0
        view: PodView | None = None
        while True:
            try:
                if view is None:
                    view = await self._list(client, path, selector)
                    self.lists[role] += 1
                    self._publish(role, selector, view)
                    first.set()
                view = await self._watch_in_time(client, path, role, selector, view)
                failures = gone = 0  # the watch ran its course: watch on from there
            except Gone:
                # Once: list again at once (the version just expired). Again before a watch
                # ended in time: back off, as for an error (an API server answering 410 to
                # every list would otherwise be asked in a loop).
                view = None
                failures, gone = 0, gone + 1
                if gone == 1:
                    log.info("Kubernetes %s: resource version gone (410); listing again", role)
                    continue
                await self._back_off(
                    role, first, gone - 1, gone <= 4 or gone % 10 == 0,
                    "Kubernetes %s: 410 Gone %d times in a row; keeping the last view, "
                    "listing again in %.1f s", role, gone)
            except Exception as exc:
                # httpx errors, error statuses, malformed lines or objects, the roster full.
                view = self.views[role]  # the events before the break are kept
                failures += 1
                await self._back_off(
                    role, first, failures, failures <= 3 or failures % 10 == 0,
                    "Kubernetes %s discovery: %s: %s; keeping the last view, retrying in %.1f s",
                    role, type(exc).__name__, exc)

    async def _back_off(self, role: str, first: trio.Event, attempt: int, loud: bool,
                        message: str, *args: object) -> None:
        """Wait ``backoff(attempt)`` before ``_follow`` tries again, after a failure or a
        repeated 410. Start-up is not held (``first``: it goes on with the last view, maybe
        none), the reconnect is counted, and ``message % (*args, delay)`` is logged as a
        warning when ``loud`` (the first few in a row, then every tenth), else at debug level:
        an API server down for an hour must not flood the log."""
        first.set()
        self.reconnects[role] += 1
        delay = backoff(attempt, self._jitter())
        log.log(logging.WARNING if loud else logging.DEBUG, message, *args, delay)
        self._step()
        await trio.sleep(delay)

    def _headers(self) -> dict[str, str]:
        assert self._connection is not None
        token = self._connection.token()
        return {"accept": "application/json",
                **({"authorization": f"Bearer {token}"} if token else {})}

    async def _list(self, client: httpx.AsyncClient, path: str, selector: str) -> PodView:
        params: dict[str, Any] = {"labelSelector": selector, "limit": LIST_PAGE}
        view: PodView | None = None
        while True:
            # The client's read timeout is the watch's (minutes); a list answers in seconds.
            response = await client.get(path, params=params, headers=self._headers(),
                                        timeout=LIST_TIMEOUT)
            if response.status_code == 410:
                # The continue token expired between two pages, or the version is gone: list
                # again from the start (``_follow`` decides when).
                raise Gone
            page = _json_or_raise(response)
            view = PodView.listed(page) if view is None else view.merged(page)
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return view
            params["continue"] = token

    async def _watch_in_time(self, client: httpx.AsyncClient, path: str, role: str,
                             selector: str, view: PodView) -> PodView:
        """``_watch``, raising ``ShortWatch`` if it ended at once without an event."""
        started, events = trio.current_time(), self.events[role]
        view = await self._watch(client, path, role, selector, view)
        lasted = trio.current_time() - started
        if self.events[role] == events and lasted < SHORT_WATCH:
            raise ShortWatch(f"the watch ended after {lasted:.1f} s without an event")
        return view

    async def _watch(self, client: httpx.AsyncClient, path: str, role: str, selector: str,
                     view: PodView) -> PodView:
        params = {"labelSelector": selector, "watch": "true", "allowWatchBookmarks": "true",
                  "timeoutSeconds": WATCH_SECONDS}
        if view.resource_version:
            params["resourceVersion"] = view.resource_version
        async with client.stream("GET", path, params=params, headers=self._headers()) as response:
            if response.status_code == 410:
                raise Gone
            if response.status_code != 200:
                await response.aread()
                _json_or_raise(response)
            # Closed here, not by the garbage collector, when an event ends the watch early.
            async with aclosing(response.aiter_lines()) as lines:
                async for line in lines:
                    if not line.strip():
                        continue
                    event = watch_event(line.encode())
                    if event.expired:
                        raise Gone
                    if event.type == "ERROR":
                        raise ApiError(int(event.object.get("code") or 500),
                                       str(event.object.get("message", "watch error")))
                    view = view.apply(event)
                    self.events[role] += 1
                    self._publish(role, selector, view)
        return view

    def _publish(self, role: str, selector: str, view: PodView) -> None:
        self.views[role] = view
        instances, reasons = view.instances(self._port, role)
        skipped = {reason for reason in reasons if " skipped: " in reason}
        for reason in reasons:
            if reason in skipped and reason not in self._skipped[role]:
                log.warning("Kubernetes %s: %s", role, reason)
            else:
                log.debug("Kubernetes %s: %s", role, reason)
        self._skipped[role] = skipped
        joined, left = self._apply(self.source(role, selector), role, instances)
        for url in joined:
            log.info("%s instance %s joined (Kubernetes pod, %s)", role, url, selector)
        for url in left:
            log.info("%s instance %s left (its pod is gone or not Ready)", role, url)
        self._step()


def _json_or_raise(response: httpx.Response) -> dict[str, Any]:
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        body = None
    if response.status_code != 200 or not isinstance(body, dict):
        message = body.get("message") if isinstance(body, dict) else response.text[:200]
        if response.status_code in (401, 403):
            message = (f"{message} (the proxy's service account needs get, list and watch on "
                       "pods: docs/how-to/discovery.md)")
        raise ApiError(response.status_code, str(message))
    return body
