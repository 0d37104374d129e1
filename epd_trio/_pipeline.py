"""One client request's path: encode -> prefill -> decode (docs/discussion/protocol.md), given what it needs.

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
import uuid
from collections.abc import Callable, Collection
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from ._core.config import Settings
from ._core.ec_handoff import EncoderReport, consumer_body, match_reports
from ._core.errors import NoInstance
from ._core.failover import Failover, Slot, with_failover
from ._core.health import Registry
from ._core.moriio import (
    MoriioPeer,
    decode_kv_params,
    moriio_request_id,
    new_transfer_id,
    prefill_kv_params,
)
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
from ._observe.accounting import Accounting, RequestAccount
from ._observe.tracing import NO_TRACE_CONTEXT, TraceHeaders
from ._state.cursors import EncoderCursor, SlotCursor, Usable, choose_slot
from ._state.loads import DECODE_TOKENS, Loads
from ._upstream.fanout import fan_out
from ._upstream.legs import Answer, StreamRelay, open_stream, post_json, run_encoder_fanout
from ._upstream.pool import UpstreamPool

#: The MoRIIO side of an instance (None: it did not register over ZMQ), and the transfer mode
#: the roster's first MoRIIO registration fixed.
PeerOf = Callable[[Instance], MoriioPeer | None]
ModeOf = Callable[[], str | None]

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
    DP stage (their own counters: docs/discussion/protocol.md "Decision"), each with its stage's policy, and
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
        moriio_peer: PeerOf | None = None,
        transfer_mode: ModeOf | None = None,
        ec_zmq_addrs: Callable[[Instance], tuple[str, ...]] | None = None,
    ) -> None:
        self._settings = settings
        #: A push (Mooncake) encoder-cache consumer's addresses, one per DP rank.
        self._ec_addrs = ec_zmq_addrs or (lambda inst: ())
        #: MoRIIO: legs go only to instances that registered over ZMQ (their address is in the
        #: request id); None for the generic hand-off.
        self._peer: PeerOf | None = (
            (moriio_peer or (lambda inst: None)) if settings.kv_connector == "moriio" else None)
        self._transfer_mode: ModeOf = transfer_mode or (lambda: None)
        self._pools = pools
        self._routes = routes
        self._registry = registry
        self._accounting = accounting
        self._stage_failover = Failover(max_attempts=settings.max_attempts)
        self._decode_failover = Failover(max_attempts=1 + settings.decode_retries)

    async def run(
        self, kind: RequestKind, raw_body: bytes, *, request_id: str, resources: AsyncExitStack,
        trace_context: TraceHeaders = NO_TRACE_CONTEXT,
    ) -> Reply:
        """Run the request through its stages and produce the reply.

        ``resources`` is the request's owner of anything that outlives this call (the open decode
        stream): the web layer closes it after the response is sent or the client went away.
        ``trace_context``: the client's ``traceparent`` / ``tracestate``, which every leg
        carries on (or its tracing span's, with tracing on). Raises ``ProxyError`` for
        anything the client must be told.
        """
        path = PATH_OF_KIND[kind]
        account = self._accounting.begin(path, request_id, trace_context)
        resources.callback(account.finish)
        try:
            request = parse_request(raw_body, kind)
            if request.dropped:
                log.debug("request %s: dropped the client's %s (the hand-off is the proxy's)",
                          request_id, ", ".join(request.dropped))
            account.trace.stream = request.stream
            account.trace.model = request.body["model"]
            body, items = with_item_uuids(request)
            routes = self._routes
            hint = (prefix_hint(prompt_text(body)) if "cache_aware" in (
                routes.prefills.policy.name, routes.decodes.policy.name) else None)
            size = requested_tokens(body) if self._settings.size_tiebreak else 0
            registry = self._registry
            if not registry.has("decode"):
                raise NoInstance("no decode instance is configured or registered yet")  # noqa: TRY301
            with_prefill = registry.has("prefill")
            encode = bool(items) and registry.has("encode")
            attempts = 0
            if self._peer is not None and not with_prefill:
                raise NoInstance("MoRIIO needs a prefill instance: none is registered")  # noqa: TRY301
            prefills_tried: set[Slot] = set()
            prefills = routes.prefills

            async def attempt(slot: Slot) -> Reply:
                """One attempt from the client's body: encode (again, on a retry: the handles
                belong to the attempt and its consumer), prefill, decode."""
                nonlocal attempts
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
                    reply = await legs(slot, leg_id)
                except BaseException:
                    release()
                    raise
                if reply.stream is None:
                    release()
                else:
                    resources.callback(release)
                return reply

            async def legs(slot: Slot, leg_id: str) -> Reply:
                # The consumer slot is chosen before the encoders are called (as upstream):
                # a push consumer's address goes on the encoder sub-requests.
                first_prefill: Slot | None = None
                if with_prefill and self._peer is None:
                    first_prefill = await self._next_slot(prefills, "prefill", hint, ())
                    if first_prefill is None:
                        raise NoInstance("no prefill instance is configured or registered")  # noqa: TRY301
                consumer_body = body
                if encode:
                    consumer_body = await self._encode(account, body, request.media, items,
                                                       leg_id, first_prefill or slot)
                if self._peer is not None:
                    return await self._moriio(account, slot, consumer_body, body, request.stream,
                                              path, request_id, resources, prefills_tried, hint)
                decode_body: dict[str, Any] = consumer_body
                if first_prefill is not None:
                    # Decode after a prefill gets the client's body (items with their uuid):
                    # it is no encoder-cache consumer, and vLLM wants embeds values there.
                    decode_body = await self._prefill(account, consumer_body, body, path,
                                                      leg_id, first_prefill, hint)
                return await self._decode(account, slot, decode_body, request.stream, path,
                                          leg_id, resources)

            decodes = routes.decodes
            first = await self._next_slot(decodes, "decode", hint, ())
            if first is None:  # the last decode instance left while this request started
                raise NoInstance("no decode instance is configured or registered")  # noqa: TRY301
            reply = await with_failover(
                self._decode_failover, "decode", first, attempt,
                partial(self._next_slot, decodes, "decode", hint, any_slot=True),
                account.retried,
                # MoRIIO WRITE: prefill runs beside decode, with no failover of its own.
                also_retry=("prefill",) if self._peer is not None
                and self._transfer_mode() == "WRITE" else ())
        except BaseException as exc:
            account.failed(exc)  # a cancellation is counted by the stage the client waited on
            raise
        reply.headers["x-request-id"] = request_id
        account.replied()
        return reply

    async def _next_slot(
        self, cursor: SlotCursor, stage: str, hint: PrefixHint | None, tried: Collection[Slot],
        any_slot: bool = False,
    ) -> Slot | None:
        """``choose_slot`` on this stage's health view and the instances a leg may go to."""
        return await choose_slot(cursor, self._registry.usable(stage), hint, tried,
                                 routable=self._routable(), any_slot=any_slot)

    def _routable(self) -> Usable | None:
        """Which instances a leg may go to at all: with MoRIIO, only those whose ZMQ address is
        known (the connector finds its peer in the request id); None: any."""
        peer = self._peer
        if peer is None:
            return None
        return lambda inst: peer(inst) is not None

    async def _prefill(
        self, account: RequestAccount, body: dict[str, Any], decode_base: dict[str, Any],
        path: str, request_id: str, first: Slot, hint: PrefixHint | None,
    ) -> dict[str, Any]:
        """Prefill ``body`` on ``first`` (with failover); ``decode_base`` with the KV handle."""
        prefill_body = build_prefill_body(body)
        loads = self._routes.loads

        async def attempt(slot: Slot) -> Answer:
            instance, rank = slot
            with loads.held("prefill", (instance.url, rank)), \
                    account.leg("prefill", slot) as leg:
                answer = await post_json(
                    self._pools(instance), stage="prefill", instance=instance, path=path,
                    body=prefill_body, headers=leg.traced(upstream_headers(request_id, rank)),
                    deadline=self._settings.prefill_timeout,
                )
                leg.answered(answer.status)
                return answer

        prefills = self._routes.prefills
        response = await with_failover(self._stage_failover, "prefill", first, attempt,
                                       partial(self._next_slot, prefills, "prefill", hint),
                                       account.retried)
        params = kv_transfer_params_of(response.content)
        if params is None:
            account.kv_missing()
        return build_decode_body(decode_base, params)

    async def _encode(
        self, account: RequestAccount, body: dict[str, Any], media: tuple[tuple[int, int], ...],
        items: list[dict[str, Any]], request_id: str, consumer: Slot,
    ) -> dict[str, Any]:
        """Encode every item; the consumer leg's body (``ec_handoff.consumer_body``).

        A push (Mooncake) consumer, one that registered ``ec_zmq_addrs``, gets the encoders'
        output at the address of the DP rank its leg was routed to: that address and a fresh
        transfer id per item go on the encoder sub-requests."""
        addrs = self._ec_addrs(consumer[0])
        rank = consumer[1] or 0
        consumer_zmq = addrs[rank] if rank < len(addrs) else None
        transfer_ids = [uuid.uuid4().hex for _ in items] if consumer_zmq else []
        calls = await run_encoder_fanout(
            self._pools, self._routes.encoders, body=body, items=items,
            request_id=request_id, max_batch=self._settings.encoder_max_batch,
            deadline=self._settings.encode_timeout, usable=self._registry.usable("encode"),
            failover=self._stage_failover, observer=account, loads=self._routes.loads,
            consumer_zmq=consumer_zmq, transfer_ids=transfer_ids)
        account.encoded(calls)
        handoff = match_reports(
            [EncoderReport(c.instance.url, c.item_indices, c.ec_transfer_params) for c in calls],
            [item["uuid"] for item in items], transfer_ids)
        return consumer_body(body, media, handoff, rewrite=self._settings.ec_rewrite)

    async def _moriio(
        self, account: RequestAccount, slot: Slot, body: dict[str, Any],
        decode_base: dict[str, Any], stream: bool, path: str, client_id: str,
        resources: AsyncExitStack, prefills_tried: set[Slot], hint: PrefixHint | None = None,
    ) -> Reply:
        """One attempt over MoRIIO: both legs carry the id naming both peers' ZMQ addresses.

        READ: prefill first (with its own failover; each attempt gets a fresh id and transfer
        id), then decode with the prefill's handle. WRITE: decode allocates its blocks and
        tells the prefill, which pushes the KV, so the two legs run concurrently in one
        nursery. Upstream fires that prefill and never looks at it; here a prefill failure
        cancels decode and the attempt fails (the caller fails over, choosing another
        prefill). The attempt succeeds only once decode's first bytes *and* prefill's answer are
        in, so no prefill failure can reach a client already answered (in WRITE mode prefill
        answers first: decode cannot generate before the KV is written). The WRITE prefill
        runs ``beside`` its decode: the stage the client waits on (a cancellation is counted by
        it) stays decode's.
        """
        peer = self._peer
        assert peer is not None
        decode_instance = slot[0]
        decode_peer = peer(decode_instance)
        if decode_peer is None:  # it left the roster since it was chosen
            raise NoInstance(f"decode instance {decode_instance.url} is no longer registered")
        prefills = self._routes.prefills
        settings = self._settings

        def legs(prefill: Slot) -> tuple[str, str, MoriioPeer, dict[str, Any]]:
            prefill_peer = peer(prefill[0])
            if prefill_peer is None:
                raise NoInstance(f"prefill instance {prefill[0].url} is no longer registered")
            leg_id, transfer_id = moriio_request_id(prefill_peer, decode_peer), new_transfer_id()
            log.debug("request %s: MoRIIO legs %s, transfer %s", client_id, leg_id, transfer_id)
            prefill_body = {**build_prefill_body(body),
                            "kv_transfer_params": prefill_kv_params(transfer_id, decode_peer)}
            return leg_id, transfer_id, prefill_peer, prefill_body

        loads = self._routes.loads

        async def prefill_call(prefill: Slot, leg_id: str, prefill_body: dict[str, Any],
                               beside: bool = False) -> Answer:
            with loads.held("prefill", (prefill[0].url, prefill[1])), \
                    account.leg("prefill", prefill, beside=beside) as leg:
                answer = await post_json(
                    self._pools(prefill[0]), stage="prefill", instance=prefill[0], path=path,
                    body=prefill_body, headers=leg.traced(upstream_headers(leg_id, prefill[1])),
                    deadline=settings.prefill_timeout)
                leg.answered(answer.status)
                return answer

        if self._transfer_mode() != "WRITE":
            async def read_attempt(prefill: Slot) -> tuple[Slot, str, str, MoriioPeer, Answer]:
                leg_id, transfer_id, prefill_peer, prefill_body = legs(prefill)
                answer = await prefill_call(prefill, leg_id, prefill_body)
                return prefill, leg_id, transfer_id, prefill_peer, answer

            first = await self._next_slot(prefills, "prefill", hint, ())
            if first is None:
                raise NoInstance("no MoRIIO prefill instance is registered")
            prefill, leg_id, transfer_id, prefill_peer, answer = await with_failover(
                self._stage_failover, "prefill", first, read_attempt,
                partial(self._next_slot, prefills, "prefill", hint), account.retried)
            handle = kv_transfer_params_of(answer.content)
            if handle is None:
                account.kv_missing()
            decode_body = build_decode_body(
                decode_base, decode_kv_params(transfer_id, prefill_peer, prefill[1], handle or {}))
            return await self._decode(account, slot, decode_body, stream, path, leg_id,
                                      resources)

        prefill = (await self._next_slot(prefills, "prefill", hint, prefills_tried)
                   or await self._next_slot(prefills, "prefill", hint, ()))
        if prefill is None:
            raise NoInstance("no MoRIIO prefill instance is registered")
        leg_id, transfer_id, prefill_peer, prefill_body = legs(prefill)
        decode_body = build_decode_body(
            decode_base, decode_kv_params(transfer_id, prefill_peer, prefill[1]))
        # The decode stream's resources belong to this attempt until both legs succeeded: a
        # failed attempt closes its stream at once, not when the client's request ends.
        attempt_resources = AsyncExitStack()
        committed = False
        try:
            _, reply = await fan_out([
                partial(prefill_call, prefill, leg_id, prefill_body, beside=True),
                partial(self._decode, account, slot, decode_body, stream, path, leg_id,
                        attempt_resources, lambda: committed),
            ])
        except BaseException as exc:
            if getattr(exc, "stage", None) == "prefill":
                prefills_tried.add(prefill)
            with trio.CancelScope(shield=True):
                await attempt_resources.aclose()
            raise
        committed = True
        resources.push_async_callback(attempt_resources.aclose)
        return reply

    async def _decode(
        self, account: RequestAccount, slot: Slot, body: dict[str, Any], stream: bool, path: str,
        request_id: str, resources: AsyncExitStack,
        committed: Callable[[], bool] = lambda: True,
    ) -> Reply:
        """Decode on ``slot``. ``committed``: whether an abandoned stream counts as the client
        leaving (a MoRIIO WRITE attempt that fails over closes a stream the client never saw)."""
        instance, rank = slot

        def abandoned() -> None:
            if committed():
                leg.client_left()

        settings = self._settings
        with account.leg("decode", slot) as leg:
            headers = leg.traced(upstream_headers(request_id, rank))
            if not stream:
                response = await post_json(
                    self._pools(instance), stage="decode", instance=instance, path=path,
                    body=body, headers=headers, deadline=settings.decode_timeout,
                )
                leg.answered(response.status)
                account.read_usage(response.content)
                return Reply(response.status, {"content-type": response.content_type},
                             body=response.content)
            relay = await open_stream(
                self._pools(instance), stage="decode", instance=instance, path=path, body=body,
                headers=headers, deadline=settings.decode_timeout,
                idle_timeout=settings.stream_idle_timeout, on_error=leg.stream_failed,
                on_abandon=abandoned,
            )
            leg.answered(relay.response.status)
            # The first bytes are here: from now on the request belongs to this decode
            # instance, and the leg stays in flight until the web layer closes the request's
            # resources (the stream is over, or the client left).
            resources.callback(leg.hold())
        if account.spans.recording:  # after the stream is closed: its usage, from its tail
            resources.callback(lambda: account.read_usage(relay.tail))
        resources.push_async_callback(relay.aclose)
        return Reply(
            relay.response.status,
            {"content-type": "text/event-stream", "cache-control": "no-cache"},
            stream=relay,
        )
