"""One client request's path: encode -> prefill -> decode (PROTOCOL.md), given what it needs.

Like Hypercorn's ``H11Protocol`` beside its ``TCPServer``, the ``Pipeline`` holds the request
logic and is handed its I/O and state: the connection pools (``pools``), the routing cursors
(``routes``), the health view (``registry``: who is usable), the failover rules (from the
settings) and one observer (``accounting``) that every upstream leg reports to. It owns nothing
long-lived: the ``Proxy`` builds it once and keeps the roster, the lifecycle and the admin
routes. Stages run in order; each is skipped when the layout has no such stage (no encoders,
or a request without media: no encode stage; no prefill instances: decode does the whole
request).

Failure rules (docs/discussion/guarantees.md): encoder and prefill attempts fail over to another
instance (``max_attempts``); a decode that fails before its first byte is retried on another
decode slot, re-running prefill since its KV handle belongs to the failed attempt
(``decode_retries``); nothing is retried once a byte reached the client, and a 4xx is never
retried. Cancellation (the client left) is never caught: it closes every open leg.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

from ._accounting import Accounting, RequestAccount
from ._core.config import Settings
from ._core.errors import NoInstance
from ._core.failover import Allowed, Failover, Slot, next_slot, with_failover
from ._core.health import Registry
from ._core.names import PATH_OF_KIND, RequestKind
from ._core.policies import PrefixHint, prefix_hint, prompt_text
from ._core.rewrite import (
    build_decode_body,
    build_prefill_body,
    kv_transfer_params_of,
    parse_request,
    upstream_headers,
    with_item_uuids,
)
from ._core.routing import Instance
from ._cursors import EncoderCursor, SlotCursor
from ._http import UpstreamPool
from ._loads import DECODE_TOKENS, Loads
from ._upstream import Answer, StreamRelay, open_stream, post_json, run_encoder_fanout

log = logging.getLogger("epd_trio")


@dataclass(slots=True)
class Reply:
    """What the web layer sends back: a status, headers, and either bytes or a relayed stream
    (``stream.pump(send)`` sends it and closes it)."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    stream: StreamRelay | None = None


@dataclass(frozen=True, slots=True)
class Routes:
    """The routing cursors of one proxy: the global encoder cursor and one slot cursor per
    DP stage (their own counters: PROTOCOL.md "Decision"), each with its stage's policy, and
    the in-flight loads those policies read."""

    encoders: EncoderCursor
    prefills: SlotCursor
    decodes: SlotCursor
    loads: Loads


def requested_tokens(body: dict[str, Any]) -> int:
    """The request's own bound on its answer (``max_tokens`` or ``max_completion_tokens``),
    0 when it gives none: the size estimate that breaks decode's load ties."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


class Pipeline:
    """Runs one request through its stages (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        *,
        pools: Callable[[Instance], UpstreamPool],
        routes: Routes,
        registry: Registry,
        accounting: Accounting,
    ) -> None:
        self._settings = settings
        self._pools = pools
        self._routes = routes
        self._registry = registry
        self._accounting = accounting
        self._stage_failover = Failover(max_attempts=settings.max_attempts)
        self._decode_failover = Failover(max_attempts=1 + settings.decode_retries)

    async def run(
        self, kind: RequestKind, raw_body: bytes, *, request_id: str, resources: AsyncExitStack
    ) -> Reply:
        """Run the request through its stages and produce the reply.

        ``resources`` is the request's owner of anything that outlives this call (the open decode
        stream): the web layer closes it after the response is sent or the client went away.
        Raises ``ProxyError`` for anything the client must be told.
        """
        path = PATH_OF_KIND[kind]
        account = self._accounting.begin(path, request_id)
        resources.callback(account.finish)
        stage = "encode"
        try:
            request = parse_request(raw_body, kind)
            if request.dropped:
                log.debug("request %s: dropped the client's %s (the hand-off is the proxy's)",
                          request_id, ", ".join(request.dropped))
            account.trace.stream = request.stream
            body, items = with_item_uuids(request)
            routes = self._routes
            hint = (prefix_hint(prompt_text(body)) if "cache_aware" in (
                routes.prefills.policy.name, routes.decodes.policy.name) else None)
            size = requested_tokens(body) if self._settings.size_tiebreak else 0
            registry = self._registry
            if not registry.has("decode"):
                raise NoInstance("no decode instance is configured or registered yet")  # noqa: TRY301
            with_prefill = registry.has("prefill")
            if items and registry.has("encode"):
                account.encoded(await run_encoder_fanout(
                    self._pools, self._routes.encoders, body=body, items=items,
                    request_id=request_id, max_batch=self._settings.encoder_max_batch,
                    deadline=self._settings.encode_timeout, usable=registry.usable("encode"),
                    failover=self._stage_failover, observer=account, loads=routes.loads,
                ))
            stage = "prefill" if with_prefill else "decode"
            attempts = 0

            async def attempt(slot: Slot) -> Reply:
                nonlocal attempts, stage
                leg_id = request_id if not attempts else f"{request_id}-retry{attempts}"
                attempts += 1
                # The decode slot is counted from its choice (this attempt starts right after
                # it, with no checkpoint between), through the prefill, until the stream ends.
                key = (slot[0].url, slot[1])
                release = routes.loads.take("decode", key)
                if size:
                    release_count = release
                    release_size = routes.loads.take(DECODE_TOKENS, key, size)

                    def release() -> None:
                        release_count()
                        release_size()
                try:
                    decode_body: dict[str, Any] = body
                    if with_prefill:
                        stage = "prefill"
                        decode_body = await self._prefill(account, body, path, leg_id, hint)
                    stage = "decode"
                    reply = await self._decode(account, slot, decode_body, request.stream, path,
                                               leg_id, resources)
                except BaseException:
                    release()
                    raise
                if reply.stream is None:
                    release()
                else:
                    resources.callback(release)
                return reply

            decodes = routes.decodes
            first = await self._next_slot(decodes, "decode", hint, ())
            if first is None:  # the last decode instance left while this request started
                raise NoInstance("no decode instance is configured or registered")  # noqa: TRY301
            reply = await with_failover(
                self._decode_failover, "decode", first, attempt,
                partial(self._next_slot, decodes, "decode", hint, any_slot=True),
                account.retried)
        except BaseException as exc:
            account.failed(stage, exc)  # a cancellation is counted by stage
            raise
        reply.headers["x-request-id"] = request_id
        account.replied()
        return reply

    async def _next_slot(
        self, cursor: SlotCursor, stage: str, hint: PrefixHint | None, tried: Collection[Slot],
        any_slot: bool = False,
    ) -> Slot | None:
        """The next slot for a request that already tried ``tried``, chosen by the stage's
        policy within each step of ``fallback_steps`` (untried usable instances first; with
        ``any_slot``, other DP ranks, and a single slot again)."""

        async def choose(allowed: Allowed | None, exclude: Collection[Slot]) -> Slot:
            return cursor.next(allowed, exclude, hint)

        return await next_slot(choose, tried, self._registry.usable(stage), other_ranks=any_slot,
                               slot_count=cursor.slot_count)

    async def _prefill(
        self, account: RequestAccount, body: dict[str, Any], path: str, request_id: str,
        hint: PrefixHint | None,
    ) -> dict[str, Any]:
        """Prefill on the next prefill slot (with failover); the decode body with its KV handle."""
        prefill_body = build_prefill_body(body)
        loads = self._routes.loads

        async def attempt(slot: Slot) -> Answer:
            instance, rank = slot
            with loads.held("prefill", (instance.url, rank)), account.leg("prefill", slot):
                return await post_json(
                    self._pools(instance), stage="prefill", instance=instance, path=path,
                    body=prefill_body, headers=upstream_headers(request_id, rank),
                    deadline=self._settings.prefill_timeout,
                )

        prefills = self._routes.prefills
        first = await self._next_slot(prefills, "prefill", hint, ())
        if first is None:
            raise NoInstance("no prefill instance is configured or registered")
        response = await with_failover(self._stage_failover, "prefill", first, attempt,
                                       partial(self._next_slot, prefills, "prefill", hint),
                                       account.retried)
        params = kv_transfer_params_of(response.content)
        if params is None:
            account.kv_missing()
        return build_decode_body(body, params)

    async def _decode(
        self, account: RequestAccount, slot: Slot, body: dict[str, Any], stream: bool, path: str,
        request_id: str, resources: AsyncExitStack,
    ) -> Reply:
        instance, rank = slot
        headers = upstream_headers(request_id, rank)
        settings = self._settings
        with account.leg("decode", slot) as leg:
            if not stream:
                response = await post_json(
                    self._pools(instance), stage="decode", instance=instance, path=path,
                    body=body, headers=headers, deadline=settings.decode_timeout,
                )
                return Reply(response.status, {"content-type": response.content_type},
                             body=response.content)
            relay = await open_stream(
                self._pools(instance), stage="decode", instance=instance, path=path, body=body,
                headers=headers, deadline=settings.decode_timeout,
                idle_timeout=settings.stream_idle_timeout, on_error=leg.stream_failed,
                on_abandon=partial(account.client_cancelled, "decode"),
            )
            # The first bytes are here: from now on the request belongs to this decode
            # instance, and the leg stays in flight until the web layer closes the request's
            # resources (the stream is over, or the client left).
            resources.callback(leg.hold())
        resources.push_async_callback(relay.aclose)
        return Reply(
            relay.response.status,
            {"content-type": "text/event-stream", "cache-control": "no-cache"},
            stream=relay,
        )
