"""``POST /v1/chat/completions``, ``/v1/completions`` and vLLM's other model endpoints
(``MODEL_ENDPOINTS``: embeddings, scores, tokenizing, audio...) as plain ASGI: the hot path.

Why below Quart: these routes are nearly all the traffic, and they need nothing Quart
offers (no form parsing, sessions, templates or hooks): the body is read as bytes, handed to
``Proxy.handle`` and the ``Reply`` is sent as it is. Going through Quart's request and response
objects, its contexts and its per-chunk body wrapper cost measurable CPU per request and per
relayed chunk (docs/discussion/performance.md). Every other route (models, health, admin) stays a Quart
route, where convenience matters more than microseconds.

The contract is Quart's for the client: an OpenAI-style JSON error for every failure (413 over
the body limit, 405 for another method), and a client that disconnects cancels the request:
under ``epd-trio serve`` the HTTP/1.x connection cancels it when its client closes it
(``_web/client_gone``); otherwise, like quart-trio, a task waits for ``http.disconnect`` and
cancels the request's nursery.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from functools import partial
from typing import Any

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendEvent

from .._admission.fair import FairAdmission, Ticket
from .._admission.gate import Admission
from .._core.auth import ClientKeys, first_header
from .._core.errors import (
    INTERNAL_ERROR,
    BadRequest,
    BodyTimeout,
    BodyTooLarge,
    MethodNotAllowed,
    ProxyError,
    error_reply,
    sse_error_event,
)
from .._core.names import KIND_OF_PATH
from .._core.rewrite import new_request_id
from .._core.tracing import client_context
from .._observe.tracing import NO_TRACE_CONTEXT
from .._pipeline import Reply
from .._proxy import Proxy
from .client_gone import client_gone
from .drain import Drain, InFlight

log = logging.getLogger("epd_trio")

Send = Callable[[ASGISendEvent], Awaitable[None]]


class _ClientGone(Exception):
    """The client disconnected before its body was complete: there is no one to answer."""


#: Bodies longer than this (by their content-length) are read into one buffer of that size.
LARGE_BODY_BYTES = 1024 * 1024


class CompletionEndpoints:
    """Serves the paths of ``KIND_OF_PATH`` and ``MODEL_ENDPOINTS`` for one ``Proxy``;
    ``ProxyASGI`` routes them here."""

    def __init__(self, proxy: Proxy, max_body_bytes: int,
                 client_keys: ClientKeys | None = None,
                 admission: Admission | FairAdmission | None = None,
                 body_timeout: float = 60.0, drain: Drain | None = None) -> None:
        self._proxy = proxy
        #: The requests in flight, and the shutdown that refuses new ones (``_web/drain``).
        self.drain = drain if drain is not None else Drain(0.0, lambda: None)
        self._body_timeout = body_timeout
        self._admission = admission
        self._max_body_bytes = max_body_bytes
        self._client_keys = client_keys if client_keys is not None and client_keys.enabled \
            else None
        sticky = proxy.settings.alias_sticky_header
        #: The header that keeps a client on one alias target (``EPD_ALIAS_STICKY_HEADER``).
        self._sticky = None if sticky is None else sticky.encode("latin-1")

    async def __call__(self, scope: dict[str, Any], receive: ASGIReceiveCallable, send: Send,
                       resources: AsyncExitStack) -> None:
        started = time.perf_counter()
        headers = scope["headers"]
        # The id first: a refusal below carries it and is logged under it, like an answer.
        request_id = new_request_id(first_header(headers, b"x-request-id"))
        if self.drain.draining:  # before anything else: the process is about to exit
            await self._refuse(scope["path"], request_id, started, send, self.drain.refusal())
            return
        # In flight from here: the shutdown's grace covers reading its body too. One cancel
        # scope serves the drain and, under epd-trio serve, the client's leaving.
        entry = self.drain.add()
        try:
            gone = client_gone(scope)
            with trio.CancelScope() as whole:
                entry.scope = whole
                if gone is None:
                    await self._handle(scope, receive, send, resources, request_id, started,
                                       entry)
                else:  # the connection cancels the request if its client leaves
                    with gone.cancelling(whole):
                        await self._handle(scope, receive, send, resources, request_id,
                                           started, entry, watch=False)
            if entry.cut and not entry.started:  # the shutdown ended it before its reply
                error = self.drain.refusal_at_end()
                if entry.handed:  # the pipeline's accounting counted it
                    await _send_error(send, error, {"x-request-id": request_id})
                else:
                    await self._refuse(scope["path"], request_id, started, send, error)
            elif whole.cancelled_caught and not entry.handed:  # it left while sending its body
                self._proxy.pipeline.accounting.left_early(scope["path"], request_id, started)
        finally:
            self.drain.discard(entry)

    async def _refuse(self, path: str, request_id: str, started: float, send: Send,
                      error: ProxyError, tenant: str | None = None) -> None:
        """Answer ``error`` before the pipeline ran: counted and logged like any request
        (``tenant``: its tenant, once fair admission named it)."""
        self._proxy.pipeline.accounting.refused(path, request_id, started, error, tenant)
        await _send_error(send, error, {"x-request-id": request_id})

    async def _handle(self, scope: dict[str, Any], receive: ASGIReceiveCallable, send: Send,
                      resources: AsyncExitStack, request_id: str, started: float,
                      entry: InFlight, *, watch: bool = True) -> None:
        """The request, once in flight: refusals, its body, the pipeline. ``watch``: start a
        task that cancels it on ``http.disconnect`` (no ``ClientGone`` to do it)."""
        headers = scope["headers"]
        ticket: Ticket | None = None
        tenant: str | None = None
        try:
            if scope["method"] != "POST":
                raise MethodNotAllowed(scope["method"])
            if self._client_keys is not None:  # before reading the body: it may be 64 MB
                self._client_keys.check(first_header(headers, b"authorization"))
            admission = self._admission  # before reading it too: the cap bounds memory
            if isinstance(admission, FairAdmission):
                named = admission.tenant_of(headers)
                tenant = named.name
                ticket = await admission.enter(named, resources)
            elif admission is not None:
                await admission.enter(resources)
            with trio.move_on_after(self._body_timeout) as reading:
                raw = await self._read_body(headers, receive)
            if reading.cancelled_caught:
                raise BodyTimeout(self._body_timeout)
        except _ClientGone:
            self._proxy.pipeline.accounting.left_early(scope["path"], request_id, started)
            return
        except ProxyError as exc:
            entry.started = True
            await self._refuse(scope["path"], request_id, started, send, exc, tenant)
            return
        traceparent = first_header(headers, b"traceparent")
        trace_context = (NO_TRACE_CONTEXT if traceparent is None
                         else client_context(traceparent, first_header(headers, b"tracestate")))
        path = scope["path"]
        kind = KIND_OF_PATH.get(path)
        entry.handed = True
        session = None if self._sticky is None else first_header(headers, self._sticky)
        if kind is None:  # vLLM's other endpoints (MODEL_ENDPOINTS)
            handle = partial(self._proxy.handle_api, path, raw,
                             content_type=first_header(headers, b"content-type"))
        else:
            handle = partial(self._proxy.handle, kind, raw)
        respond = partial(self._respond, handle, request_id, send, resources, trace_context,
                          entry, ticket, session)
        if not watch:
            await respond()
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            await respond()
            nursery.cancel_scope.cancel()

    async def _read_body(self, headers: list[tuple[bytes, bytes]],
                         receive: ASGIReceiveCallable) -> bytes:
        limit = self._max_body_bytes
        declared = first_header(headers, b"content-length")
        if declared is not None and declared.isdigit():
            length = int(declared)
            if length > limit:
                raise BodyTooLarge(limit)
            if length > LARGE_BODY_BYTES:
                return await self._read_large_body(length, receive)
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            parts.append(chunk)
            if not message.get("more_body", False):
                return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _read_large_body(self, declared: int, receive: ASGIReceiveCallable) -> bytes:
        """A large body (an audio upload) read into one buffer of its declared length, so it
        is held once while it arrives: joined from its chunks it would be held twice at the
        end. The server has checked the length against the bytes that come."""
        body = bytearray(declared)
        view = memoryview(body)
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            if size + len(chunk) > declared:
                raise BadRequest("the body is longer than its content-length")
            view[size:size + len(chunk)] = chunk
            size += len(chunk)
            if not message.get("more_body", False):
                if size != declared:
                    raise BadRequest("the body is shorter than its content-length")
                view.release()
                return body  # type: ignore[return-value]  # bytes-like, read as bytes

    async def _respond(self, handle: Callable[..., Awaitable[Reply]], request_id: str,
                       send: Send, resources: AsyncExitStack,
                       trace_context: Mapping[str, str], entry: InFlight,
                       ticket: Ticket | None, session: str | None) -> None:
        """The request through the proxy (``handle``: its kind's, given the body), and its
        reply or its error sent."""
        try:
            reply = await handle(request_id=request_id, resources=resources,
                                 trace_context=trace_context, ticket=ticket, session=session)
        except Exception as exc:
            if not isinstance(exc, ProxyError):
                log.exception("unexpected error while handling request %s", request_id)
            entry.started = True
            await _send_error(send, exc, {"x-request-id": request_id})
            return
        await _send_reply(send, reply, request_id, entry, ticket)


async def _send_reply(send: Send, reply: Reply, request_id: str, entry: InFlight,
                      ticket: Ticket | None = None) -> None:
    entry.started = True
    if reply.stream is None:
        # A complete body goes out with its length, as vLLM sends it: no chunked framing, and
        # no terminating chunk as a third write (the server can send head and body as one).
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": _asgi_headers(reply.headers, len(reply.body))})
        await send({"type": "http.response.body", "body": reply.body})
        return
    await send({"type": "http.response.start", "status": reply.status,
                "headers": _asgi_headers(reply.headers)})
    stream = reply.stream
    entry.relay = stream  # the shutdown ends it with an error event, not a cancellation

    async def send_body(chunk: bytes) -> None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})

    if ticket is not None and ticket.metered:  # a stream without usage settles what it sent
        plain_send = send_body

        async def send_body(chunk: bytes) -> None:
            ticket.relayed(chunk)
            await plain_send(chunk)

    try:
        await stream.pump(send_body)  # closes the stream, however it ends
    except Exception:
        # A bug, not an upstream failure (the relay turns those into an error event itself):
        # the client still gets a stream that says it broke, not a silent truncation.
        log.exception("unexpected error while streaming request %s", request_id)
        await send_body(sse_error_event(INTERNAL_ERROR))
    await send({"type": "http.response.body", "body": b""})


async def _send_error(send: Send, exc: BaseException,
                      extra_headers: Mapping[str, str] | None = None) -> None:
    status, headers, body = error_reply(exc)
    await send({"type": "http.response.start", "status": status,
                "headers": _asgi_headers({**headers, **(extra_headers or {})}, len(body))})
    await send({"type": "http.response.body", "body": body})


async def _cancel_on_disconnect(receive: ASGIReceiveCallable, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def _asgi_headers(headers: Mapping[str, str],
                  length: int | None = None) -> list[tuple[bytes, bytes]]:
    out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    if length is not None and "content-length" not in headers:
        out.append((b"content-length", str(length).encode()))
    return out


