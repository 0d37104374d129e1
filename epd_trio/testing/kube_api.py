"""A FAKE Kubernetes API server, at the protocol level: pods listed and watched as the API does.

No API server can run on the test machines, so this fake serves the two calls the proxy makes,
over real HTTP/1.1 (h11) on a loopback port:

- ``GET /api/v1/namespaces/NS/pods?labelSelector=...&limit=N[&continue=T]``: a ``PodList``
  (pages of at most ``page_size``, a ``continue`` token, the list's ``resourceVersion``);
- ``...&watch=true&resourceVersion=RV&allowWatchBookmarks=true&timeoutSeconds=S``: a chunked
  stream of JSON lines, the events after ``RV`` first, then live ones; ended after ``S``.

What the tests steer: pods put and deleted (each a new ``resourceVersion``; a watch sees them as
the API server's watch cache sends them to a label selector: a pod relabelled out of the
selector arrives as DELETED, one relabelled into it as ADDED), bookmarks,
``compact`` (forget the history: a watch from before it gets 410 Gone, as an HTTP status or as
an ``ERROR`` event, ``gone_as``), ``expire_watches`` (an ``ERROR`` 410 on the open watches),
``drop_watches`` (the connections cut mid-stream, no final chunk), ``stop``/``start`` (the
server unreachable). Over TLS when given an ``ssl_context`` (the client certificates it saw are
in ``client_certs``), and answering 401 without ``Authorization: Bearer TOKEN`` when given a
``token``. Every object is built with the official ``kubernetes`` client's models,
so the JSON is the API's own shape (camelCase, ``podIP``, ``deletionTimestamp``).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
import orjson
import trio
from kubernetes.client import (
    ApiClient,
    V1ListMeta,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodList,
    V1PodStatus,
    V1Status,
    V1WatchEvent,
)

_DROP = object()


def to_json(model: Any) -> Any:
    return ApiClient().sanitize_for_serialization(model)


def make_pod(
    name: str, ip: str | None, labels: dict[str, str], *, ready: bool = True,
    phase: str = "Running", deleting: bool = False, annotations: dict[str, str] | None = None,
    namespace: str = "ns",
) -> dict[str, Any]:
    """A Pod as the API serializes it (its resourceVersion is set when the fake stores it)."""
    when = datetime.datetime(2026, 12, 2, tzinfo=datetime.UTC) if deleting else None
    return to_json(V1Pod(
        api_version="v1", kind="Pod",
        metadata=V1ObjectMeta(name=name, namespace=namespace, uid=f"uid-{name}", labels=labels,
                              annotations=annotations, deletion_timestamp=when),
        status=V1PodStatus(phase=phase, pod_ip=ip, conditions=[
            V1PodCondition(type="Ready", status="True" if ready else "False")])))


def _at(pod: dict[str, Any], version: int) -> dict[str, Any]:
    return {**pod, "metadata": {**pod["metadata"], "resourceVersion": str(version)}}


@dataclass(frozen=True)
class Change:
    """One change to a pod: the pod after it, and before it (None when it is new)."""

    type: str
    pod: dict[str, Any]
    previous: dict[str, Any] | None

    def seen_by(self, selector: str) -> dict[str, Any] | None:
        """The event a watch with ``selector`` gets, as the API server's watch cache makes it:
        a pod that stops matching is DELETED (its last matching state, at the new version),
        one that starts matching is ADDED, one that matches neither before nor after is not
        sent at all."""
        if self.type == "DELETED":
            return _event("DELETED", self.pod) if _labelled(selector, self.pod) else None
        now = _labelled(selector, self.pod)
        before = self.previous is not None and _labelled(selector, self.previous)
        if now and before:
            return _event("MODIFIED", self.pod)
        if now:
            return _event("ADDED", self.pod)
        if before:
            assert self.previous is not None
            return _event("DELETED", self.previous)
        return None


def _labelled(selector: str, pod: dict[str, Any]) -> bool:
    return matches(selector, (pod.get("metadata") or {}).get("labels") or {})


def _event(kind: str, pod: dict[str, Any]) -> dict[str, Any]:
    return to_json(V1WatchEvent(type=kind, object=pod))


def matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, selector.split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class FakeKubeApi:
    def __init__(self, namespace: str = "ns", page_size: int = 500, *,
                 ssl_context: ssl.SSLContext | None = None, token: str | None = None) -> None:
        self.namespace = namespace
        self.page_size = page_size
        self.ssl_context = ssl_context
        self.token = token
        #: The subject of each client certificate presented (TLS only; None: none presented).
        self.client_certs: list[Any] = []
        self.pods: dict[str, dict[str, Any]] = {}
        self._versions = itertools.count(100)
        self.resource_version = next(self._versions)
        #: Every change since the last ``compact``: ``(resourceVersion, Change)``.
        self.history: list[tuple[int, Change]] = []
        #: Every event line a watch sent: ``(labelSelector, type, pod name)``.
        self.sent: list[tuple[str, str, str]] = []
        self.oldest = 0
        #: How a too-old watch is refused: ``status`` (HTTP 410) or ``event`` (an ERROR line).
        self.gone_as = "status"
        #: Every request: ``(kind, query)``, kind ``list`` or ``watch``.
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.authorization: list[str | None] = []
        #: Continue tokens to refuse with 410 (the API's "continue token expired"), then serve.
        self.expire_continues = 0
        #: Lists get no answer at all while set (an API server that stalls).
        self.stall_lists = False
        #: Lists to refuse with 410 Gone (the version listed from is no longer kept), then serve.
        self.gone_lists = 0
        #: Watches to end as soon as they have sent the events they owe (a proxy or load
        #: balancer that cuts them), then serve.
        self.end_watches = 0
        #: ``trio.current_time()`` of each request, in the order of ``requests``.
        self.times: list[float] = []
        self._watchers: list[trio.MemorySendChannel[Any]] = []
        self._changed = trio.Event()
        self._scope: trio.CancelScope | None = None
        self.port = 0

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    # -- what the tests steer ----------------------------------------------------------------
    def put(self, pod: dict[str, Any]) -> int:
        """Add or change a pod; returns its new resourceVersion."""
        name = pod["metadata"]["name"]
        previous = self.pods.get(name)
        version = self._bump()
        pod = _at(pod, version)
        self.pods[name] = pod
        self._emit(version, Change("MODIFIED" if previous else "ADDED", pod,
                                   _at(previous, version) if previous else None))
        return version

    def delete(self, name: str) -> int:
        version = self._bump()
        pod = _at(self.pods.pop(name), version)
        self._emit(version, Change("DELETED", pod, pod))
        return version

    def bookmark(self) -> int:
        """A BOOKMARK on every open watch (that asked for them), at a new version."""
        version = self._bump()
        event = to_json(V1WatchEvent(type="BOOKMARK", object={
            "kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(version)}}))
        self._send_all(("bookmark", event))
        return version

    def compact(self) -> None:
        """Forget the history, as etcd's compaction does: older versions are Gone."""
        self.history.clear()
        self.oldest = self.resource_version

    def expire_watches(self) -> None:
        """An ERROR event 410 on every open watch (the API's 'too old resource version')."""
        self._send_all(("error", self._gone_event()))
        self._send_all(("end", None))

    def send_raw(self, data: bytes) -> None:
        """Bytes on every open watch, as they are (a malformed line)."""
        self._send_all(("raw", data))

    def drop_watches(self) -> None:
        """Cut every open watch connection mid-stream."""
        self._send_all(("drop", None))

    @property
    def watching(self) -> int:
        return len(self._watchers)

    async def wait_until(self, predicate: Any) -> None:
        while not predicate():
            await self._changed.wait()

    def watches(self) -> list[dict[str, str]]:
        return [query for kind, query in self.requests if kind == "watch"]

    def lists(self) -> list[dict[str, str]]:
        return [query for kind, query in self.requests if kind == "list"]

    def times_of(self, wanted: str) -> list[float]:
        """When each request of a kind (``list`` or ``watch``) came, on trio's clock."""
        return [t for (kind, _q), t in zip(self.requests, self.times, strict=True)
                if kind == wanted]

    # -- serving ----------------------------------------------------------------------------
    async def serve(self, port: int = 0, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        with trio.CancelScope() as self._scope:
            listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
            self.port = listeners[0].socket.getsockname()[1]
            async with trio.open_nursery() as nursery:
                task_status.started(self.url)
                await trio.serve_listeners(self._connection, listeners,
                                           handler_nursery=nursery)

    def stop(self) -> None:
        """Close the listener and every connection: the API server is unreachable."""
        if self._scope is not None:
            self._scope.cancel()
        self._watchers.clear()
        self._step()

    def _bump(self) -> int:
        self.resource_version = next(self._versions)
        return self.resource_version

    def _emit(self, version: int, change: Change) -> None:
        self.history.append((version, change))
        self._send_all(("event", change))

    def _send_all(self, item: Any) -> None:
        for channel in list(self._watchers):
            with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError):
                channel.send_nowait(item)

    def _step(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _gone_event(self) -> dict[str, Any]:
        return to_json(V1WatchEvent(type="ERROR", object=to_json(V1Status(
            api_version="v1", kind="Status", status="Failure", reason="Expired", code=410,
            message=f"too old resource version: ({self.oldest})", metadata=V1ListMeta()))))

    async def _connection(self, tcp: trio.SocketStream) -> None:
        stream: trio.abc.Stream = tcp
        if self.ssl_context is not None:
            stream = trio.SSLStream(tcp, self.ssl_context, server_side=True)
            try:
                await stream.do_handshake()
            except trio.BrokenResourceError:  # the client refused our certificate, or we its
                await tcp.aclose()
                return
            peer = stream.getpeercert()
            self.client_certs.append(peer.get("subject") if peer else None)
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request = await self._next_request(conn, stream)
                if request is None:
                    return
                keep = await self._answer(conn, stream, request)
                if not keep or conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.aclose()

    async def _next_request(self, conn: h11.Connection, stream: trio.abc.Stream
                            ) -> h11.Request | None:
        request = None
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return None
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.EndOfMessage):
                return request
            elif isinstance(event, h11.ConnectionClosed):
                return None

    async def _send(self, conn: h11.Connection, stream: trio.abc.Stream, event: Any) -> None:
        await stream.send_all(conn.send(event) or b"")

    async def _json(self, conn: h11.Connection, stream: trio.abc.Stream, status: int,
                    body: Any) -> None:
        raw = orjson.dumps(body)
        await self._send(conn, stream, h11.Response(status_code=status, headers=[
            ("content-type", "application/json"), ("content-length", str(len(raw)))]))
        await self._send(conn, stream, h11.Data(data=raw))
        await self._send(conn, stream, h11.EndOfMessage())

    async def _answer(self, conn: h11.Connection, stream: trio.abc.Stream,
                      request: h11.Request) -> bool:
        target = urlsplit(request.target.decode())
        query = {k: v[0] for k, v in parse_qs(target.query).items()}
        headers = {k.decode().lower(): v.decode() for k, v in request.headers}
        self.authorization.append(headers.get("authorization"))
        if self.token is not None and headers.get("authorization") != f"Bearer {self.token}":
            await self._json(conn, stream, 401, to_json(V1Status(
                api_version="v1", kind="Status", status="Failure", code=401,
                reason="Unauthorized", message="Unauthorized")))
            return True
        if target.path != f"/api/v1/namespaces/{self.namespace}/pods":
            await self._json(conn, stream, 404, to_json(V1Status(
                api_version="v1", kind="Status", status="Failure", code=404, reason="NotFound",
                message=f"the fake serves pods of {self.namespace} only")))
            return True
        watching = query.get("watch") in ("true", "1")
        self.requests.append(("watch" if watching else "list", query))
        self.times.append(trio.current_time())
        self._step()
        if watching:
            return await self._watch(conn, stream, query)
        await self._list(conn, stream, query)
        return True

    async def _list(self, conn: h11.Connection, stream: trio.abc.Stream,
                    query: dict[str, str]) -> None:
        if self.stall_lists:
            await trio.sleep_forever()
        if self.gone_lists:
            self.gone_lists -= 1
            await self._json(conn, stream, 410, to_json(V1Status(
                api_version="v1", kind="Status", status="Failure", reason="Expired", code=410,
                message="too old resource version", metadata=V1ListMeta())))
            return
        selector = query.get("labelSelector", "")
        names = sorted(n for n, p in self.pods.items()
                       if matches(selector, p["metadata"].get("labels") or {}))
        if "continue" in query and self.expire_continues:
            self.expire_continues -= 1
            await self._json(conn, stream, 410, to_json(V1Status(
                api_version="v1", kind="Status", status="Failure", reason="Expired", code=410,
                message="The provided continue parameter is too old", metadata=V1ListMeta())))
            return
        start = int(query.get("continue", "0"))
        size = min(int(query.get("limit", "500")), self.page_size)
        page = names[start:start + size]
        more = str(start + size) if start + size < len(names) else None
        await self._json(conn, stream, 200, to_json(V1PodList(
            api_version="v1", kind="PodList", items=[],
            metadata=V1ListMeta(resource_version=str(self.resource_version), _continue=more)))
            | {"items": [self.pods[n] for n in page]})

    async def _watch(self, conn: h11.Connection, stream: trio.abc.Stream,
                     query: dict[str, str]) -> bool:
        since = int(query.get("resourceVersion") or 0)
        if since and since < self.oldest and self.gone_as == "status":
            await self._json(conn, stream, 410, self._gone_event()["object"])
            return True
        selector = query.get("labelSelector", "")
        bookmarks = query.get("allowWatchBookmarks") == "true"
        send, receive = trio.open_memory_channel[Any](1000)
        await self._send(conn, stream, h11.Response(status_code=200, headers=[
            ("content-type", "application/json"), ("transfer-encoding", "chunked")]))

        async def line(event: dict[str, Any]) -> None:
            raw = orjson.dumps(event) + b"\n"
            # Two chunks per line: the client must join a line split across chunks.
            await self._send(conn, stream, h11.Data(data=raw[: len(raw) // 2]))
            await self._send(conn, stream, h11.Data(data=raw[len(raw) // 2:]))

        async def change_line(change: Change) -> None:
            event = change.seen_by(selector)
            if event is not None:
                self.sent.append((selector, event["type"], event["object"]["metadata"]["name"]))
                await line(event)

        if since and since < self.oldest:  # gone_as == "event"
            await line(self._gone_event())
            await self._send(conn, stream, h11.EndOfMessage())
            return True
        for version, change in self.history:
            if version > since:
                await change_line(change)
        if self.end_watches:
            self.end_watches -= 1
            await self._send(conn, stream, h11.EndOfMessage())
            return True
        self._watchers.append(send)
        self._step()
        try:
            with trio.move_on_after(float(query.get("timeoutSeconds", "1800"))):
                async for kind, event in receive:
                    if kind == "drop":
                        return False
                    if kind == "end":
                        break
                    if kind == "raw":
                        await self._send(conn, stream, h11.Data(data=event))
                    elif kind == "error":
                        await line(event)
                    elif kind == "bookmark":
                        if bookmarks:
                            await line(event)
                    else:
                        await change_line(event)
            await self._send(conn, stream, h11.EndOfMessage())
            return True
        finally:
            if send in self._watchers:
                self._watchers.remove(send)
            self._step()
