"""One client request's path: encode -> hand-off -> decode (docs/discussion/protocol.md).

Like Hypercorn's ``H11Protocol`` beside its ``TCPServer``, the ``Pipeline`` holds the request
logic and is handed its I/O and state: the connection pools (``pools``), the routing cursors
(``routes``), the health view (``registry``: who is usable), the failover rules (from the
settings) and one observer (``accounting``) that every upstream leg reports to. It owns nothing
long-lived: the ``Proxy`` builds it once and keeps the roster, the lifecycle and the admin
routes.

Each client request is one ``RequestRun``, as each HTTP stream is one ``HTTPStream`` in
Hypercorn: the object carries the request's state (its parsed body, its attempts, its decode
slot's load, its open stream) where closures over ``nonlocal`` variables used to, and its stage
is recorded on its account as each leg opens (``RequestAccount.stage``). An attempt reads
encode -> hand-off -> decode; the hand-off is a strategy chosen per attempt (``_handoff``):
decode alone (no prefill instances), prefill then decode (the generic ``kv_transfer_params``
hand-off, MoRIIO READ), or both at once (MoRIIO WRITE). Stages are skipped when the layout has
no such stage (no encoders, or a request without media: no encode stage).

Failure rules (docs/discussion/guarantees.md): encoder and prefill attempts fail over to another
instance (``max_attempts``); a decode that fails before its first byte is retried on another
decode slot, re-running prefill since its KV handle belongs to the failed attempt
(``decode_retries``); nothing is retried once a byte reached the client, and a 4xx is never
retried. Cancellation (the client left) is never caught: it closes every open leg.

Resource handling: a request registers one clean-up with the web layer's resources
(``RequestRun.close``): it closes the decode stream if one is open, releases the decode leg and
slot, and finishes the account, in that order, whatever happened before.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Collection, Coroutine
from contextlib import AsyncExitStack
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

from ._admission.fair import Ticket
from ._core.config import Settings
from ._core.ec_handoff import EncoderReport, consumer_body, match_reports
from ._core.engine_load import adapter_ranks
from ._core.errors import AdapterUnavailable, ModelUnavailable, NoInstance
from ._core.failover import Failover, Slot, with_failover
from ._core.health import Registry
from ._core.moriio import MoriioPeer
from ._core.names import PATH_OF_KIND, RequestKind, Stage
from ._core.policies import PrefixHint, prefix_hint, prompt_text
from ._core.rewrite import parse_request, upstream_headers, with_item_uuids
from ._core.routing import Instance
from ._handoff import DECODE_ONLY, HandOff, choose_handoff
from ._kv_routing import KvLookup, KvRouting
from ._model_pools import ModelPools
from ._models.catalog import AdapterOf
from ._models.loading import AdapterLoader
from ._observe.accounting import Accounting, Leg, RequestAccount
from ._observe.tracing import NO_TRACE_CONTEXT, TraceHeaders
from ._state.cursors import choose_slot
from ._state.loads import DECODE_TOKENS, Loads
from ._upstream.legs import Answer, StreamRelay, open_stream, post_json, run_encoder_fanout
from ._upstream.pool import UpstreamPool
from ._upstream.reply import Reply as Reply

#: The MoRIIO side of an instance (None: it did not register over ZMQ), and the transfer mode
#: the roster's first MoRIIO registration fixed.
PeerOf = Callable[[Instance], MoriioPeer | None]
ModeOf = Callable[[], str | None]
T = TypeVar("T")

log = logging.getLogger("epd_trio")


def _both(first: Callable[[Instance], bool],
          second: Callable[[Instance], bool]) -> Callable[[Instance], bool]:
    return lambda inst: first(inst) and second(inst)


def requested_tokens(body: dict[str, Any]) -> int:
    """The request's own bound on its answer (``max_tokens`` or ``max_completion_tokens``),
    0 when it gives none: the size estimate that breaks decode's load ties."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0




class Pipeline:
    """Runs each request through its stages (see the module docstring); what every request
    shares: settings, pools, each model's routes, health, accounting and the MoRIIO roster
    views."""

    def __init__(
        self,
        settings: Settings,
        *,
        pools: Callable[[Instance], UpstreamPool],
        models: ModelPools,
        loads: Loads,
        registry: Registry,
        accounting: Accounting,
        moriio_peer: PeerOf | None = None,
        transfer_mode: ModeOf | None = None,
        ec_zmq_addrs: Callable[[Instance], tuple[str, ...]] | None = None,
        kv: KvRouting | None = None,
        adapter_loader: AdapterLoader | None = None,
    ) -> None:
        self.settings = settings
        #: The KV index and the render call (``precise_cache_aware``, the prefill bypass).
        self.kv = kv
        #: Loads configured adapters on demand (``EPD_LORA_LOAD``); None: off.
        self.adapter_loader = adapter_loader
        #: Each model's pool and its routes (cursors, policies): a request resolves its own.
        self.models = models
        #: In-flight requests per stage and slot, shared by every pool (an instance's load
        #: counts once, whichever names it serves).
        self.loads = loads
        #: Decode alone when its slot holds all but this many of the prompt's tokens (0: off).
        self.bypass_threshold = settings.pd_uncached_token_threshold
        #: A push (Mooncake) encoder-cache consumer's addresses, one per DP rank.
        self.ec_addrs = ec_zmq_addrs or (lambda inst: ())
        #: MoRIIO: legs go only to instances that registered over ZMQ (their address is in the
        #: request id); None for the generic hand-off.
        self.peer: PeerOf | None = (
            (moriio_peer or (lambda inst: None)) if settings.kv_connector == "moriio" else None)
        self.transfer_mode: ModeOf = transfer_mode or (lambda: None)
        peer = self.peer
        #: Which instances a leg may go to at all: with MoRIIO, only those whose ZMQ address is
        #: known (the connector finds its peer in the request id); None: any.
        self.routable = None if peer is None else (lambda inst: peer(inst) is not None)
        self.pools = pools
        self.registry = registry
        self.accounting = accounting
        self.stage_failover = Failover(max_attempts=settings.max_attempts)
        self.decode_failover = Failover(max_attempts=1 + settings.decode_retries)

    def run(
        self, kind: RequestKind, raw_body: bytes, *, request_id: str, resources: AsyncExitStack,
        trace_context: TraceHeaders = NO_TRACE_CONTEXT, ticket: Ticket | None = None,
        session: str | None = None,
    ) -> Coroutine[Any, Any, Reply]:
        """Run the request through its stages and produce the reply.

        ``resources`` is the request's owner of anything that outlives this call (the open decode
        stream): the web layer closes it after the response is sent or the client went away.
        ``trace_context``: the client's ``traceparent`` / ``tracestate``, which every leg
        carries on (or its tracing span's, with tracing on). ``ticket``: the request's
        tenant side (fair admission): its priority and token reservation, applied to the
        parsed body, and the answer's usage reported back. ``session``: the value of
        ``EPD_ALIAS_STICKY_HEADER``, which keeps the client on one alias target. Raises
        ``ProxyError`` for anything the client must be told.

        The coroutine to await is ``run_on``'s: a frame of its own here would resume with
        every wait of the request, for nothing.
        """
        return self.run_on(RequestRun, PATH_OF_KIND[kind], partial(
            RequestRun.reply, kind=kind, raw_body=raw_body, resources=resources,
            session=session), request_id=request_id, resources=resources,
            trace_context=trace_context, ticket=ticket)

    async def run_on(
        self, kind_of_run: type[RequestRun], path: str,
        reply: Callable[[Any], Awaitable[Reply]], *, request_id: str,
        resources: AsyncExitStack, trace_context: TraceHeaders, ticket: Ticket | None,
    ) -> Reply:
        """One request of ``path``, as a ``kind_of_run`` (a ``RequestRun``, or a run of the
        other endpoints: ``_model_api``) whose ``reply`` makes its answer: the account, the
        one clean-up, the failure counted, the request id on the answer."""
        account = self.accounting.begin(path, request_id, trace_context)
        run = kind_of_run(self, account, path, request_id, ticket)
        resources.push_async_callback(run.close)
        try:
            answer = await reply(run)
        except BaseException as exc:
            account.failed(exc)  # a cancellation is counted by the stage the client waited on
            raise
        answer.headers["x-request-id"] = request_id
        account.replied()
        return answer

    def handoff(self, with_prefill: bool) -> HandOff:
        """The hand-off of an attempt, on the roster as it is now (``choose_handoff``)."""
        moriio = self.peer is not None
        return choose_handoff(moriio=moriio, with_prefill=with_prefill,
                              transfer_mode=self.transfer_mode() if moriio else None)


class RequestRun:
    """One client request in the pipeline: its parsed body, its attempts, and what it holds
    until the web layer closes its resources (the decode slot's load, the decode leg, the
    open stream). Its helpers are the legs every hand-off is made of (``_handoff``)."""

    __slots__ = ("_decode_load", "_decode_size", "account", "adapter", "attempts", "body",
                 "committed", "content_type", "encode", "hint", "holders", "items", "kv", "path",
                 "pipeline", "prefills_tried", "relay", "request", "request_id", "route", "size",
                 "stream_leg", "ticket", "with_prefill")
    #: A request of vLLM's other endpoints (``_model_api``): decode alone, whatever the layout.
    api = False

    def __init__(self, pipeline: Pipeline, account: RequestAccount, path: str,
                 request_id: str, ticket: Ticket | None = None) -> None:
        self.pipeline = pipeline
        self.ticket = ticket
        self.account = account
        #: The client-facing path, the same on every upstream leg.
        self.path = path
        #: The request's one id (the client's ``x-request-id`` or the proxy's). Each attempt's
        #: legs carry a ``leg_id`` made from it (MoRIIO: one naming both peers instead).
        self.request_id = request_id
        self.attempts = 0
        #: MoRIIO WRITE's prefill slots that failed, avoided by the next attempt (made at the
        #: first failure).
        self.prefills_tried: set[Slot] | None = None
        #: Whether the open stream is the client's: False while a MoRIIO WRITE attempt is not
        #: yet committed (closing its stream is then no client leaving).
        self.committed = True
        self.relay: StreamRelay | None = None
        self.stream_leg: Leg | None = None
        self._decode_load: Callable[[], None] | None = None
        self._decode_size: Callable[[], None] | None = None
        self.adapter: AdapterOf | None = None
        self.holders: frozenset[str] | None = None
        self.hint: PrefixHint | None = None
        self.kv: KvLookup | None = None
        #: The legs' content type when their body is not JSON (a multipart form).
        self.content_type: str | None = None

    async def reply(self, *, kind: RequestKind, raw_body: bytes, resources: AsyncExitStack,
                    session: str | None = None) -> Reply:
        """Parse and validate the body, find its model's pool, then decode with failover:
        each attempt on its own decode slot (``attempt``)."""
        request = parse_request(raw_body, kind)
        pipeline = self.pipeline
        ticket = self.ticket
        leg_model = await self.resolve(request.body.get("model"), resources, session)
        if leg_model is not None:  # an alias's target, or the one model: every leg names it
            request = replace(request, body={**request.body, "model": leg_model})
        route, adapter = self.route, self.adapter
        if ticket is not None:  # its tenant's priority and token limit, on the body
            request = replace(request, body=await self._admit(request.body))
        self.request = request
        if request.dropped:
            log.debug("request %s: dropped the client's %s (the hand-off is the proxy's)",
                      self.request_id, ", ".join(request.dropped))
        account = self.account
        account.trace.stream = request.stream
        #: The client's body with each item's uuid (what decode gets after a prefill).
        self.body, self.items = body, items = with_item_uuids(request)
        self.with_prefill = route.needs("prefill")
        self.encode = bool(items) and route.needs("encode")
        await self._ready_pool()
        self.hint = prefix_hint(prompt_text(body)) if route.hinted else None
        #: What the engines hold of this prompt (None: no index, or no render in time).
        self.kv = (None if pipeline.kv is None else await pipeline.kv.lookup(
            self.path, body, self.request_id, account, route.pool,
            None if adapter is None else adapter.name))
        self.size = requested_tokens(body) if route.settings.size_tiebreak else 0
        return await self._decode_with_failover(pipeline.handoff(self.with_prefill).also_retry)

    async def _admit(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with its tenant's priority and token limit (``Ticket.admitted``), once its
        limits let it in; a request they refuse is logged at its priority too."""
        ticket, trace = self.ticket, self.account.trace
        assert ticket is not None
        trace.tenant, trace.queued = ticket.tenant.name, ticket.queued
        try:
            return await ticket.admitted(body)
        finally:
            trace.priority = ticket.priority

    async def _ready_pool(self) -> None:
        """A configured adapter loaded where a stage this request needs lacks it
        (``EPD_LORA_LOAD``: ``_load_adapter``), then the pool checked (``_check_pool``)."""
        adapter = self.adapter
        if adapter is not None and adapter.table is not None and self.pipeline.adapter_loader:
            await self._load_adapter()
        self._check_pool()

    async def _decode_with_failover(self, also_retry: Collection[str] = ()) -> Reply:
        """The request's attempts (``attempt``), each on its own decode slot."""
        first = await self.next_slot("decode", ())
        if first is None:  # the last decode instance left while this request started
            raise NoInstance("no decode instance is configured or registered")
        return await with_failover(
            self.pipeline.decode_failover, "decode", first, self.attempt,
            partial(self.next_slot, "decode", any_slot=True), self.account.retried,
            also_retry=also_retry)

    async def resolve(self, asked: Any, resources: AsyncExitStack,
                      session: str | None) -> str | None:
        """The request's model name resolved (``ModelPools.resolve``): its route, adapter and
        holders set on the run, its model's own cap taken; the name every leg must carry
        instead of the client's, if any."""
        pipeline, ticket, trace = self.pipeline, self.ticket, self.account.trace
        trace.model = asked
        route, leg_model, adapter = pipeline.models.resolve(
            asked, session=session, allowed=None if ticket is None else ticket.tenant.models)
        self.route = route
        self.adapter = adapter
        #: An adapter's legs go only to its holders (prefill and decode both).
        self.holders = None if adapter is None else adapter.pool.holders(adapter.name)
        trace.pool = route.model if adapter is None else adapter.name
        if route.admission is not None:  # the model's own cap, beside the proxy's
            await route.admission.enter(resources)
        return leg_model

    def _check_pool(self) -> None:
        """A 503 naming the model and the stage when its pool has no live instance of a stage
        this request needs (vLLM is never asked what cannot be served)."""
        route = self.route
        if not route.needs("decode"):
            raise NoInstance(f"model {route.model!r} has no decode instance configured or "
                             "registered yet")
        models = self.pipeline.models
        for stage, needed in (("decode", True), ("prefill", self.with_prefill),
                              ("encode", self.encode)):
            if needed and not models.live(route.pool, stage):
                raise ModelUnavailable(route.model, stage)
        adapter = self.adapter
        if adapter is not None:
            for stage, needed in (("decode", True), ("prefill", self.with_prefill)):
                if needed and not models.holds(route.pool, adapter.name, stage):
                    raise AdapterUnavailable(adapter.name, route.model, stage)

    async def _load_adapter(self) -> None:
        """A configured adapter no live instance of a needed stage holds, loaded there on
        demand (``_models.loading``): on the instance the pool's policy picks, or after the
        load another request started for it; then the request routes to its holders."""
        adapter, pipeline = self.adapter, self.pipeline
        loader = pipeline.adapter_loader
        assert adapter is not None and adapter.table is not None and loader is not None
        name = adapter.name
        for stage, needed in (("prefill", self.with_prefill), ("decode", True)):
            while needed and not pipeline.models.holds(self.route.pool, name, stage):
                load = loader.loading(name, stage)
                if load is not None:
                    await loader.wait(load)
                    continue
                slot = await self._slot(stage, (), lambda inst: loader.may_load(inst.url, name))
                if slot is None:
                    break  # nowhere to load it: the check below says so
                await loader.load(adapter.table, stage, slot[0])
        self.holders = self.route.pool.holders(name)

    async def attempt(self, slot: Slot) -> Reply:
        """One attempt from the client's body on the decode ``slot``: encode (again, on a
        retry: the handles belong to the attempt and its consumer), hand-off, decode."""
        attempts = self.attempts
        leg_id = self.request_id if not attempts else f"{self.request_id}-retry{attempts}"
        self.attempts = attempts + 1
        handoff = (DECODE_ONLY if self.api else
                   self.pipeline.handoff(self.with_prefill and not self._bypass(slot)))
        # The decode slot is counted from its choice (this attempt starts right after it,
        # with no checkpoint between), through the prefill, until the stream ends.
        loads, key = self.pipeline.loads, (slot[0].url, slot[1])
        self._decode_load = loads.take("decode", key)
        if self.size:
            self._decode_size = loads.take(DECODE_TOKENS, key, self.size)
        try:
            reply = await handoff.run(self, slot, leg_id)
        except BaseException:
            self._release_decode()
            raise
        if reply.stream is None:
            self._release_decode()
        return reply

    async def next_slot(self, stage: Stage, tried: Collection[Slot],
                        any_slot: bool = False) -> Slot | None:
        """``choose_slot`` on this stage's health view and the instances a leg may go to (an
        adapter's holders, the best ranked first: ``_best_holders``)."""
        routable = self.holders
        if routable is not None and self.pipeline.loads.lora:
            routable = self._best_holders(stage, routable, tried)
        return await self._slot(stage, tried, None if routable is None else (
            lambda inst: inst.url in routable), any_slot)

    def _best_holders(self, stage: Stage, holders: frozenset[str],
                      tried: Collection[Slot]) -> frozenset[str]:
        """The holders of the request's adapter in its best rank that has a live instance of
        ``stage`` not yet tried (``engine_load.adapter_ranks``: running it, room for it,
        queueing it, the rest), read from the instances' own ``vllm:lora_requests_info``."""
        assert self.adapter is not None
        usable = self.pipeline.registry.usable(stage)
        gone = {slot[0].url for slot in tried}
        open_urls = {inst.url for inst in self.route.pool.of(stage)
                     if usable(inst) and inst.url not in gone}
        for rank in adapter_ranks(self.adapter.name, holders, self.pipeline.loads.lora):
            if rank & open_urls:
                return rank
        return holders

    async def _slot(self, stage: Stage, tried: Collection[Slot],
                    allowed: Callable[[Instance], bool] | None,
                    any_slot: bool = False) -> Slot | None:
        """``next_slot`` among the instances ``allowed`` (an adapter's holders, those that
        may load it: None, any)."""
        pipeline, route = self.pipeline, self.route
        cursor = route.decodes if stage == "decode" else route.prefills
        kv = self.kv if stage in route.precise else None
        routable = pipeline.routable
        if allowed is not None:
            routable = allowed if routable is None else _both(allowed, routable)
        slot = await choose_slot(cursor, pipeline.registry.usable(stage),
                                 self.hint if kv is None else kv.cached, tried,
                                 routable=routable, any_slot=any_slot)
        if kv is not None and slot is not None and pipeline.kv is not None:
            pipeline.kv.decided(stage, (slot[0].url, slot[1]), kv, self.account)
        return slot

    def _bypass(self, slot: Slot) -> bool:
        """Whether this attempt skips the prefill leg: its decode slot already holds all but
        ``EPD_PD_UNCACHED_TOKEN_THRESHOLD`` of the prompt (the index says so only for an exact
        slot). Not with MoRIIO, whose decode waits for a prefill's transfer."""
        pipeline, kv = self.pipeline, self.kv
        if (not pipeline.bypass_threshold or kv is None or not self.with_prefill
                or pipeline.peer is not None):
            return False
        key = (slot[0].url, slot[1])
        if key not in kv.cached.held or kv.cached.uncached(key) > pipeline.bypass_threshold:
            return False
        self.account.prefill_bypassed()
        return True

    def moriio_peer(self, instance: Instance) -> MoriioPeer | None:
        """``instance``'s MoRIIO side (None: it is not registered over ZMQ)."""
        peer = self.pipeline.peer
        return None if peer is None else peer(instance)

    def prefill_failed(self, slot: Slot) -> None:
        """A MoRIIO WRITE prefill failed at ``slot``: the next attempt chooses another."""
        if self.prefills_tried is None:
            self.prefills_tried = set()
        self.prefills_tried.add(slot)

    async def prefill_failover(self, first: Slot, attempt: Callable[[Slot], Awaitable[T]]) -> T:
        """``attempt`` on ``first``, failing over to other prefill slots."""
        return await with_failover(self.pipeline.stage_failover, "prefill", first, attempt,
                                   partial(self.next_slot, "prefill"), self.account.retried)

    async def encoded(self, leg_id: str, consumer: Slot) -> dict[str, Any]:
        """The body of the consumer leg (on ``consumer``): the client's, or, with an encode
        stage, every item encoded and the hand-off written in (``ec_handoff.consumer_body``).

        A push (Mooncake) consumer, one that registered ``ec_zmq_addrs``, gets the encoders'
        output at the address of the DP rank its leg was routed to: that address and a fresh
        transfer id per item go on the encoder sub-requests."""
        body = self.body
        if not self.encode:
            return body
        pipeline, items, account = self.pipeline, self.items, self.account
        settings = pipeline.settings
        addrs = pipeline.ec_addrs(consumer[0])
        rank = consumer[1] or 0
        consumer_zmq = addrs[rank] if rank < len(addrs) else None
        transfer_ids = [uuid.uuid4().hex for _ in items] if consumer_zmq else []
        # An adapter's encoders run its base model's encoder: any of the pool, under its name.
        encode_body = body if self.adapter is None else {**body, "model": self.route.model}
        calls = await run_encoder_fanout(
            pipeline.pools, self.route.encoders, body=encode_body, items=items,
            request_id=leg_id, max_batch=self.route.max_batch,
            deadline=settings.encode_timeout, usable=pipeline.registry.usable("encode"),
            failover=pipeline.stage_failover, observer=account, loads=pipeline.loads,
            consumer_zmq=consumer_zmq, transfer_ids=transfer_ids)
        account.encoded(calls)
        handoff = match_reports(
            [EncoderReport(c.instance.url, c.item_indices, c.ec_transfer_params) for c in calls],
            [item["uuid"] for item in items], transfer_ids)
        return consumer_body(body, self.request.media, handoff,
                             rewrite=settings.ec_rewrite)

    async def post(self, stage: Stage, slot: Slot, body: dict[str, Any], leg_id: str, *,
                   beside: bool = False) -> Answer:
        """One leg answered with one body (a prefill, or a decode not streamed): open the leg,
        post, note its status. A prefill's load is held here, for its leg; a decode's is its
        attempt's. ``beside``: the leg runs beside the one the client waits on."""
        instance, rank = slot
        pipeline = self.pipeline
        prefill = stage == "prefill"
        release = pipeline.loads.take(stage, (instance.url, rank)) if prefill else None
        try:
            with self.account.leg(stage, slot, beside=beside) as leg:
                answer = await post_json(
                    pipeline.pools(instance), stage=stage, instance=instance, path=self.path,
                    body=body, headers=leg.traced(upstream_headers(
                        leg_id, rank, content_type=self.content_type)),
                    deadline=(pipeline.settings.prefill_timeout if prefill
                              else pipeline.settings.decode_timeout))
                leg.answered(answer.status)
                return answer
        finally:
            if release is not None:
                release()

    async def decode(self, slot: Slot, body: dict[str, Any], leg_id: str) -> Reply:
        """Decode on ``slot``: its answer, or its stream once its first bytes are in (then
        the run holds it, its leg and its slot until ``close``)."""
        if not self.request.stream:
            answer = await self.post("decode", slot, body, leg_id)
            self.account.read_usage(answer.content)
            if self.ticket is not None:
                self.ticket.answered(answer.content)
            return Reply(answer.status, {"content-type": answer.content_type},
                         body=answer.content)
        instance, rank = slot
        settings = self.pipeline.settings
        with self.account.leg("decode", slot) as leg:
            relay = await open_stream(
                self.pipeline.pools(instance), stage="decode", instance=instance,
                path=self.path, body=body, headers=leg.traced(upstream_headers(
                    leg_id, rank, content_type=self.content_type)),
                deadline=settings.decode_timeout, idle_timeout=settings.stream_idle_timeout,
                on_error=leg.stream_failed, on_abandon=self._abandoned,
            )
            leg.answered(relay.response.status)
            # The first bytes are here: from now on the request belongs to this decode
            # instance, and the leg stays in flight until the stream is closed.
            leg.hold()
            self.relay, self.stream_leg = relay, leg
        return Reply(
            relay.response.status,
            {"content-type": "text/event-stream", "cache-control": "no-cache"},
            stream=relay,
        )


    def _abandoned(self) -> None:
        """The stream was closed before its end: the client left, unless the stream was a
        MoRIIO WRITE attempt's that failed over (the client never saw it)."""
        if self.committed and self.stream_leg is not None:
            self.stream_leg.client_left()

    async def close_stream(self) -> None:
        """Close the open decode stream, if any (safe under cancellation); its usage read
        (for a recorded span), its leg released."""
        relay, leg = self.relay, self.stream_leg
        if relay is None or leg is None:
            return
        self.relay = None  # the leg stays: an unfinished stream's close tells it (_abandoned)
        try:
            await relay.aclose()
        finally:
            self.stream_leg = None
            self.account.read_usage(relay.tail)
            if self.ticket is not None:
                self.ticket.answered(relay.tail)
            leg.release()

    async def close(self) -> None:
        """The request is over (its reply sent, or its client gone): the one clean-up it
        leaves with the web layer's resources (the module docstring's order)."""
        try:
            await self.close_stream()
        finally:
            self._release_decode()
            self.account.finish()

    def _release_decode(self) -> None:
        """The decode slot's load (and size) given back."""
        load, size = self._decode_load, self._decode_size
        self._decode_load = self._decode_size = None
        if load is not None:
            load()
        if size is not None:
            size()
