"""The E -> P -> D pipeline for one client request (PROTOCOL.md), independent of the web framework.

``Proxy`` owns the routing state (one encoder cursor, a prefill and a decode slot cursor) and the
pooled httpx client; it takes the raw client body and returns a ``Reply`` for the web layer to send.
Stages run in order; each is skipped when the layout has no such role (no encoders, or a request
without media: no encode stage; no prefill instances: decode does the whole request).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import trio

from ._config import Settings
from ._cursors import EncoderCursor, SlotCursor
from ._errors import UpstreamError
from ._fanout import fan_out
from ._rewrite import (
    Kind,
    build_decode_body,
    build_prefill_body,
    kv_transfer_params_of,
    parse_request,
    upstream_headers,
    with_item_uuids,
)
from ._routing import Instance
from ._upstream import (
    CHAT_PATH,
    aclose_shielded,
    get,
    open_stream,
    post_json,
    relay_stream,
    run_encoder_fanout,
)

PATHS: dict[Kind, str] = {"chat": CHAT_PATH, "completions": "/v1/completions"}


@dataclass(slots=True)
class Reply:
    """What the web layer sends back: a status, headers, and either bytes or a byte stream."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None


@dataclass(slots=True)
class Route:
    """Which instances one request used (kept for logs, metrics and tests)."""

    encoders: list[str] = field(default_factory=list)
    prefill: tuple[str, int | None] | None = None
    decode: tuple[str, int | None] | None = None


def new_request_id(client_value: str | None) -> str:
    """Keep the client's ``x-request-id`` (it ties our legs to their logs), else a fresh one."""
    value = (client_value or "").strip()
    return value if value and len(value) <= 256 and value.isprintable() else uuid.uuid4().hex


def make_client(settings: Settings) -> httpx.AsyncClient:
    """The pooled upstream client: finite timeouts everywhere, no environment proxies.

    ``trust_env=False`` because an ``HTTP_PROXY`` meant for outbound traffic must never reroute
    the proxy's calls to its own backends.
    """
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            connect=settings.connect_timeout,
            read=settings.stream_idle_timeout,
            write=settings.connect_timeout + 60.0,
            pool=settings.connect_timeout,
        ),
        limits=httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_connections,
            keepalive_expiry=30.0,
        ),
        trust_env=False,
    )


class Proxy:
    """Routing state and upstream calls for one proxy process.

    The client must be opened before serving and closed after (``async with proxy.running():``
    or the app's lifespan hooks); everything per request happens in ``handle``.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.encoders = EncoderCursor(settings.encode_urls)
        self.prefills = SlotCursor(settings.prefill_urls)
        self.decodes = SlotCursor(settings.decode_urls)
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("Proxy.client used outside start()/aclose()")
        return self._client

    async def start(self) -> None:
        self._client = make_client(self.settings)

    async def aclose(self) -> None:
        if self._client is not None:
            with trio.CancelScope(shield=True):
                await self._client.aclose()
            self._client = None

    async def handle(
        self,
        kind: Kind,
        raw_body: bytes,
        *,
        request_id: str,
        resources: AsyncExitStack,
        authorization: str | None = None,
    ) -> Reply:
        """Run the request through its stages and produce the reply.

        ``resources`` is the request's owner of anything that outlives this call (the open decode
        stream): the web layer closes it after the response is sent or the client went away.
        Raises ``ProxyError`` for anything the client must be told.
        """
        settings = self.settings
        request = parse_request(raw_body, kind)
        body, items = with_item_uuids(request)
        reply_headers = {"x-request-id": request_id}

        if items and settings.encode_urls:
            await run_encoder_fanout(
                self.client, self.encoders, body=body, items=items, request_id=request_id,
                max_batch=settings.encoder_max_batch, deadline=settings.encode_timeout,
                authorization=authorization,
            )

        path = PATHS[kind]
        decode_body: dict[str, Any] = body
        if settings.prefill_urls:
            prefill, rank = self.prefills.next()
            response = await post_json(
                self.client, stage="prefill", instance=prefill, path=path,
                body=build_prefill_body(body),
                headers=upstream_headers(request_id, rank, authorization),
                deadline=settings.prefill_timeout,
            )
            decode_body = build_decode_body(body, kv_transfer_params_of(response.content))

        decode, rank = self.decodes.next()
        headers = upstream_headers(request_id, rank, authorization)
        if not request.stream:
            response = await post_json(
                self.client, stage="decode", instance=decode, path=path, body=decode_body,
                headers=headers, deadline=settings.decode_timeout,
            )
            content_type = response.headers.get("content-type", "application/json")
            return Reply(response.status_code, {**reply_headers, "content-type": content_type},
                         body=response.content)

        response = await open_stream(
            self.client, stage="decode", instance=decode, path=path, body=decode_body,
            headers=headers, deadline=settings.decode_timeout,
            idle_timeout=settings.stream_idle_timeout,
        )
        resources.push_async_callback(aclose_shielded, response)
        return Reply(
            response.status_code,
            {**reply_headers, "content-type": "text/event-stream", "cache-control": "no-cache"},
            stream=relay_stream(response, stage="decode", instance=decode.url),
        )

    async def models(self) -> Reply:
        """``GET /v1/models`` from the first decode-side instance that answers."""
        last_error: UpstreamError | None = None
        for instance in self.settings.decode_urls:
            try:
                with_deadline = self.settings.connect_timeout + 5.0
                response = await get(self.client, "decode", instance, "/v1/models", with_deadline)
            except UpstreamError as exc:
                last_error = exc
                continue
            content_type = response.headers.get("content-type", "application/json")
            return Reply(response.status_code, {"content-type": content_type}, body=response.content)
        assert last_error is not None
        raise last_error

    async def health(self, probe_timeout: float = 2.0) -> tuple[bool, dict[str, Any]]:
        """Probe every instance's ``/health`` concurrently; healthy when each role has a live one."""
        roles = {
            "encode": self.settings.encode_urls,
            "prefill": self.settings.prefill_urls,
            "decode": self.settings.decode_urls,
        }
        targets = [(role, inst) for role, insts in roles.items() for inst in insts]

        async def probe(role: str, instance: Instance) -> bool:
            try:
                await get(self.client, role, instance, "/health", probe_timeout)
            except UpstreamError:
                return False
            return True

        results = await fan_out([partial(probe, role, inst) for role, inst in targets])
        report: dict[str, Any] = {"layout": self.settings.layout, "roles": {}}
        ok = True
        for role, instances in roles.items():
            if not instances:
                continue
            states = [
                {"url": inst.url, "dp_size": inst.dp_size, "healthy": healthy}
                for (r, inst), healthy in zip(targets, results, strict=True)
                if r == role
            ]
            report["roles"][role] = states
            ok = ok and any(s["healthy"] for s in states)
        report["status"] = "ok" if ok else "unavailable"
        return ok, report
