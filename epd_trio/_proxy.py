"""The E -> P -> D pipeline for one client request (PROTOCOL.md), independent of the web framework.

``Proxy`` owns the routing state (one encoder cursor, a prefill and a decode slot cursor), the
health ``Registry`` and the upstream connection pools; it takes the raw client body and returns a
``Reply`` for the web layer to send. Stages run in order; each is skipped when the layout has no
such role (no encoders, or a request without media: no encode stage; no prefill instances:
decode does the whole request).

Failure rules (README "Guarantees"): encoder and prefill attempts fail over to another instance
(``max_attempts``); a decode that fails before its first byte is retried on another decode slot,
re-running prefill since its KV handle belongs to the failed attempt (``decode_retries``);
nothing is retried once a byte reached the client, and a 4xx is never retried.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from ._config import Settings
from ._counters import CursorCounters
from ._cursors import EncoderCursor, SlotCursor
from ._errors import NoInstance, UpstreamError
from ._failover import Failover, Slot, is_retryable, with_failover
from ._health import InstanceState, Registry
from ._http import UpstreamClient, UpstreamPool
from ._metrics import ProxyMetrics
from ._prober import run_prober
from ._profile import ProfileReport, run_profile
from ._rewrite import (
    Kind,
    build_decode_body,
    build_prefill_body,
    kv_transfer_params_of,
    parse_request,
    upstream_headers,
    with_item_uuids,
)
from ._roster import (
    ROUTING_ROLES,
    Roster,
    expired,
    forget,
    layout_name,
    parse_instance_url,
    parse_registration,
    register,
    static_roster,
    unregister,
)
from ._roster_store import LocalRosterStore, RosterStore
from ._routing import Instance
from ._trace import RequestTrace
from ._upstream import CHAT_PATH, Answer, get, open_stream, post_json, run_encoder_fanout

log = logging.getLogger("epd_trio")

PATHS: dict[Kind, str] = {"chat": CHAT_PATH, "completions": "/v1/completions"}


@dataclass(slots=True)
class Reply:
    """What the web layer sends back: a status, headers, and either bytes or a byte stream."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None


def new_request_id(client_value: str | None) -> str:
    """Keep the client's ``x-request-id`` (it ties our legs to their logs), else a fresh one."""
    value = (client_value or "").strip()
    # ASCII only: it goes into upstream headers, and an id that cannot be encoded must not be a 500.
    keep = value and len(value) <= 256 and value.isascii() and value.isprintable()
    return value if keep else uuid.uuid4().hex


def upstream_auth_headers(settings: Settings) -> dict[str, str]:
    """Headers every call to vLLM carries: its ``--api-key`` as a bearer token, when configured."""
    key = settings.upstream_api_key
    return {"authorization": f"Bearer {key}"} if key else {}


def make_client(settings: Settings) -> UpstreamClient:
    """The upstream pools: per instance at most ``max_connections`` requests per DP rank; every
    request carries the upstream API key, if one is configured."""
    return UpstreamClient(max_connections=settings.max_connections,
                          connect_timeout=settings.connect_timeout,
                          queue_timeout=settings.queue_timeout,
                          headers=upstream_auth_headers(settings))


class Proxy:
    """Routing state, health and upstream calls for one proxy process.

    ``start(nursery)`` opens the upstream pools and starts the health prober in ``nursery``;
    ``aclose()`` stops the prober, then closes the pools. Everything per request happens in
    ``handle``.

    The instances come from a roster (``_roster.py``): the configured ones, plus those that
    register themselves through ``register``. The roster lives in a ``RosterStore`` (this
    process's, or the shared memory of ``epd-trio serve --workers N``); every new version is
    applied here by ``_apply``: health states, cursors and upstream pools follow it. The pools
    of an instance that left keep serving the requests already routed there; the prober's
    housekeeping closes them once idle (``reap_clients``), ``aclose`` closes all.
    """

    def __init__(self, settings: Settings, counters: CursorCounters | None = None) -> None:
        self.settings = settings
        counters = counters if counters is not None else CursorCounters.local()
        self.registry = Registry(threshold=settings.health_threshold)
        #: Every count the proxy exports (``/metrics``) and each request's trace (request log).
        self.metrics = ProxyMetrics(enabled=settings.metrics, request_log=settings.request_log)
        self.registry.on_change.append(_log_health_change)
        self.registry.on_change.append(self.metrics.health_changed)
        self.encoders = EncoderCursor((), counter=counters.encode)
        self.prefills = SlotCursor((), counter=counters.prefill)
        self.decodes = SlotCursor((), counter=counters.decode)
        self._failover = Failover(max_attempts=settings.max_attempts, track=self._track,
                                  on_retry=self.metrics.retried)
        self._decode_failover = Failover(max_attempts=1 + settings.decode_retries,
                                         on_retry=self.metrics.retried)
        self._upstream: UpstreamClient | None = None
        self._probe_client: UpstreamClient | None = None
        self._prober: trio.CancelScope | None = None
        self._roster_changed = trio.Event()
        self.roster = Roster()
        self._store: RosterStore = (counters.roster if counters.roster is not None
                                    else LocalRosterStore(counters))
        initial = static_roster(settings.encode_urls, settings.prefill_urls, settings.decode_urls)
        self._apply(initial)
        self._store.attach(initial, self._apply)

    # -- the roster ------------------------------------------------------------------------------
    def _apply(self, roster: Roster) -> None:
        """Follow a new roster version: health states, cursors, pools (synchronous: it runs
        inside a cursor's counter step when another worker changed the roster)."""
        self.roster = roster
        self.registry.set_members({role: roster.of(role) for role in ROUTING_ROLES})
        self.metrics.set_members(self.registry.states())
        self.encoders.update(roster.of("encode"), roster.epochs["encode"])
        self.prefills.update(roster.of("prefill"), roster.epochs["prefill"])
        self.decodes.update(roster.of("decode"), roster.epochs["decode"])
        for client in (self._upstream, self._probe_client):
            if client is not None:
                client.follow(m.instance for m in roster.members)
        self._roster_changed.set()
        self._roster_changed = trio.Event()

    async def wait_roster(self, predicate: Callable[[Roster], bool]) -> None:
        """Wait until ``predicate(roster)`` holds (re-checked at each new roster version)."""
        while True:
            self._store.poll()
            if predicate(self.roster):
                return
            await self._roster_changed.wait()

    def register(self, raw_body: bytes) -> bool:
        """``POST /instances``: add or refresh an instance; True when it was new.

        Raises ``BadRequest`` (400) for a bad body or a prefill_decode / prefill+decode mix,
        ``Conflict`` (409) for a known URL changing its role.
        """
        member = parse_registration(raw_body, time.monotonic())
        created = self._store.update(lambda roster, counters: register(roster, member, counters))
        if created:
            log.warning("%s instance %s registered (dp_size %d)", member.kind, member.url,
                        member.instance.dp_size)
        return created

    def unregister(self, url: object) -> bool:
        """``DELETE /instances``: remove the instance at ``url``; True when it was there."""
        target = parse_instance_url(url).url
        removed = self._store.update(lambda roster, counters: unregister(roster, target, counters))
        if removed:
            log.warning("instance %s unregistered", target)
        return removed

    def expire(self, now: float | None = None) -> list[str]:
        """Forget the registered instances that have been out of rotation and silent for
        ``instance_ttl`` (judged on this worker's health view and the shared roster)."""
        evicted = self.registry.evicted()
        if not evicted:
            return []
        now = time.monotonic() if now is None else now
        ttl = self.settings.instance_ttl

        def change(roster: Roster, counters: Any) -> tuple[Roster, list[str]]:
            urls = expired(roster, evicted, now, ttl)
            return forget(roster, urls, counters), urls

        urls = self._store.update(change)
        for url in urls:
            log.warning("instance %s forgotten: out of rotation and not registered for %g s",
                        url, ttl)
        return urls

    def instances(self) -> dict[str, Any]:
        """``GET /instances``: every instance by role, where it comes from, and its state."""
        roster = self._store.current()
        now = time.monotonic()
        listing: dict[str, list[dict[str, Any]]] = {kind: [] for kind in (
            "encode", "prefill", "decode", "prefill_decode")}
        for member in roster.members:
            entry = self.registry.state_for(member.role, member.instance).report()
            entry.update(source="static" if member.static else "registered",
                         ec_zmq_addrs=list(member.ec_zmq_addrs))
            if not member.static:
                entry["registered_seconds_ago"] = round(now - member.registered_at, 3)
            listing[member.kind].append(entry)
        # Health is each worker's own view (each probes on its own): say whose view this is.
        return {"layout": layout_name(roster), "version": roster.version,
                "worker_pid": os.getpid(), "instances": listing}

    def client(self, instance: Instance) -> UpstreamPool:
        """The connection pool for ``instance`` (one per instance, see ``make_client``)."""
        if self._upstream is None:
            raise RuntimeError("Proxy.client used outside start()/aclose()")
        return self._upstream.pool(instance)

    async def reap_clients(self) -> int:
        """Close the pools of instances that left, once nothing is in flight on them; returns
        how many request pools were closed."""
        closed = 0
        if self._probe_client is not None:
            await self._probe_client.reap()
        if self._upstream is not None:
            closed = await self._upstream.reap()
        return closed

    async def start(self, nursery: trio.Nursery | None = None) -> None:
        """Open the upstream pools; with a ``nursery``, also start the health prober in it."""
        self._upstream = make_client(self.settings)
        self._upstream.follow(m.instance for m in self.roster.members)
        if nursery is not None:
            # Probes get their own small pools: a pool full of long streams must not delay
            # them into timeouts that would evict healthy instances.
            self._probe_client = UpstreamClient(
                max_connections=4, connect_timeout=self.settings.health_timeout,
                queue_timeout=self.settings.health_timeout,
                headers=upstream_auth_headers(self.settings))
            self._probe_client.follow(m.instance for m in self.roster.members)
            self._prober = await nursery.start(self._run_prober, self._probe_client)

    async def _run_prober(
        self, client: UpstreamClient, task_status: trio.TaskStatus[trio.CancelScope]
    ) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            await run_prober(client, self.registry, interval=self.settings.health_interval,
                             probe_timeout=self.settings.health_timeout,
                             before_round=self._store.poll, after_round=self._housekeeping)

    async def _housekeeping(self) -> None:
        """After each probe round: forget the long-gone registered instances, close the pools
        nobody uses any more."""
        self.expire()
        await self.reap_clients()

    async def aclose(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            self._prober = None
        with trio.CancelScope(shield=True):
            for client in (self._upstream, self._probe_client):
                if client is not None:
                    await client.aclose()
        self._upstream = self._probe_client = None

    # -- bookkeeping ---------------------------------------------------------------------------
    @contextmanager
    def _track(self, stage: str, slot: Slot) -> Iterator[None]:
        """Count one upstream attempt: in flight while it runs, its outcome fed to health."""
        instance, rank = slot
        state = self.registry.state_for(stage, instance)
        state.in_flight += 1
        state.sent += 1
        attempt, outcome = self.metrics.attempt(stage, instance, rank), "cancelled"
        try:
            yield
        except UpstreamError as error:
            outcome = "error"
            self._count_failure(state, error)
            raise
        else:
            outcome = "ok"
            self.registry.succeeded(state)
        finally:
            state.in_flight -= 1
            self.metrics.attempt_done(attempt, outcome)

    def _count_failure(self, state: InstanceState, error: UpstreamError) -> None:
        """An upstream failure at ``state``'s instance: its error count, and its health."""
        if is_retryable(error):  # a 4xx is the client's fault, not the instance's
            state.errors += 1
            self.metrics.upstream_failed(state.role, state.url)
        if error.instance_failure:
            self.registry.failed(state)

    async def _next_slot(
        self, cursor: SlotCursor, role: str, tried: set[Slot], any_slot: bool = False
    ) -> Slot | None:
        """The next usable slot on an instance not tried yet; with ``any_slot``, failing that,
        an untried slot (another DP rank) of a tried instance."""
        usable = self.registry.usable(role)
        urls = {inst.url for inst, _ in tried}
        try:
            return cursor.next(lambda inst: inst.url not in urls and usable(inst))
        except LookupError:
            if not any_slot:
                return None
        try:
            return cursor.next(usable, exclude=tried)
        except LookupError:
            return None

    # -- the pipeline --------------------------------------------------------------------------
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
        trace = self.metrics.begin(PATHS[kind], request_id)
        resources.callback(self.metrics.finish, trace)
        stage = "encode"
        try:
            request = parse_request(raw_body, kind)
            trace.stream = request.stream
            body, items = with_item_uuids(request)
            self._store.poll()  # one word read: did another worker change the roster?
            registry = self.registry
            if not registry.has("decode"):
                raise NoInstance("no decode instance is configured or registered yet")  # noqa: TRY301
            with_prefill = registry.has("prefill")
            if items and registry.has("encode"):
                self.metrics.encoded(await run_encoder_fanout(
                    self.client, self.encoders, body=body, items=items, request_id=request_id,
                    max_batch=self.settings.encoder_max_batch,
                    deadline=self.settings.encode_timeout, authorization=authorization,
                    usable=self.registry.usable("encode"), failover=self._failover,
                ))
            stage = "prefill" if with_prefill else "decode"
            attempts = 0

            async def attempt(slot: Slot) -> Reply:
                nonlocal attempts, stage
                leg_id = request_id if not attempts else f"{request_id}-retry{attempts}"
                attempts += 1
                decode_body: dict[str, Any] = body
                if with_prefill:
                    stage = "prefill"
                    decode_body = await self._prefill(body, PATHS[kind], leg_id, authorization)
                stage = "decode"
                return await self._decode(slot, decode_body, request.stream, PATHS[kind],
                                          leg_id, authorization, resources, trace)

            first = await self._next_slot(self.decodes, "decode", set())
            if first is None:  # the last decode instance left while this request started
                raise NoInstance("no decode instance is configured or registered")  # noqa: TRY301
            reply = await with_failover(
                self._decode_failover, "decode", first, attempt,
                partial(self._next_slot, self.decodes, "decode", any_slot=True))
        except BaseException as exc:
            self.metrics.failed(trace, stage, exc)  # a cancellation is counted by stage
            raise
        reply.headers["x-request-id"] = request_id
        self.metrics.replied(trace)
        return reply

    async def _prefill(
        self, body: dict[str, Any], path: str, request_id: str, authorization: str | None
    ) -> dict[str, Any]:
        """Prefill on the next prefill slot (with failover); the decode body with its KV handle."""
        prefill_body = build_prefill_body(body)

        async def attempt(slot: Slot) -> Answer:
            instance, rank = slot
            return await post_json(
                self.client(instance), stage="prefill", instance=instance, path=path, body=prefill_body,
                headers=upstream_headers(request_id, rank, authorization),
                deadline=self.settings.prefill_timeout,
            )

        first = await self._next_slot(self.prefills, "prefill", set())
        if first is None:
            raise NoInstance("no prefill instance is configured or registered")
        response = await with_failover(self._failover, "prefill", first, attempt,
                                       partial(self._next_slot, self.prefills, "prefill"))
        params = kv_transfer_params_of(response.content)
        if params is None:
            self.metrics.kv_missing()
        return build_decode_body(body, params)

    async def _decode(
        self, slot: Slot, body: dict[str, Any], stream: bool, path: str, request_id: str,
        authorization: str | None, resources: AsyncExitStack, trace: RequestTrace,
    ) -> Reply:
        instance, rank = slot
        headers = upstream_headers(request_id, rank, authorization)
        with self._track("decode", slot):
            if not stream:
                response = await post_json(
                    self.client(instance), stage="decode", instance=instance, path=path, body=body,
                    headers=headers, deadline=self.settings.decode_timeout,
                )
                return Reply(response.status, {"content-type": response.content_type},
                             body=response.content)
            relay = await open_stream(
                self.client(instance), stage="decode", instance=instance, path=path, body=body,
                headers=headers, deadline=self.settings.decode_timeout,
                idle_timeout=self.settings.stream_idle_timeout,
            )
        # The first bytes are here: from now on the request belongs to this decode instance.
        # The stream stays in flight until the web layer closes the request's resources.
        state = self.registry.state_for("decode", instance)
        state.in_flight += 1
        in_flight = self.metrics.in_flight("decode", instance.url)
        in_flight.inc()

        def stream_abandoned() -> None:
            self.metrics.client_cancelled("decode", trace)

        def stream_failed(error: UpstreamError) -> None:
            self._count_failure(state, error)
            self.metrics.stream_failed(trace, error)

        def stream_closed() -> None:
            state.in_flight -= 1
            in_flight.dec()

        relay.on_error = stream_failed
        relay.on_abandon = stream_abandoned
        resources.callback(stream_closed)
        resources.push_async_callback(relay.aclose)
        return Reply(
            relay.response.status,
            {"content-type": "text/event-stream", "cache-control": "no-cache"},
            stream=relay.relay(),
        )

    # -- other endpoints -----------------------------------------------------------------------
    async def models(self) -> Reply:
        """``GET /v1/models`` from the first live decode-side instance that answers."""
        self._store.poll()
        usable = self.registry.usable("decode")
        candidates = sorted(self.roster.of("decode"), key=lambda inst: not usable(inst))
        if not candidates:
            raise NoInstance("no decode instance is configured or registered yet")
        last_error: UpstreamError | None = None
        for instance in candidates:
            try:
                response = await get(self.client(instance), "decode", instance, "/v1/models",
                                     self.settings.health_timeout + self.settings.connect_timeout)
            except UpstreamError as error:
                last_error = error
                continue
            return Reply(response.status, {"content-type": response.content_type},
                         body=response.content)
        assert last_error is not None
        raise last_error

    def health(self) -> tuple[bool, dict[str, Any]]:
        """200-worthy when there is a decode-side instance and every role has a live one; the
        per-instance report."""
        self._store.poll()
        ok = self.registry.healthy()
        return ok, {"status": "ok" if ok else "unavailable", "layout": layout_name(self.roster),
                    "ready": self.registry.ready(), "roles": self.registry.report()}

    def ready(self) -> bool:
        self._store.poll()
        return self.registry.ready()

    async def profile(self, action: str, raw_body: bytes) -> ProfileReport:
        """``POST /start_profile`` / ``/stop_profile`` on every instance of every role."""
        self._store.poll()
        targets = [(m.kind, m.instance) for m in self.roster.members]
        return await run_profile(action, raw_body, targets, self.client,
                                 deadline=self.settings.profile_timeout)


def _log_health_change(state: Any) -> None:
    if state.live:
        log.warning("%s instance %s is back in rotation", state.role, state.url)
    else:
        log.warning("%s instance %s left the rotation after %d consecutive failures",
                    state.role, state.url, state.consecutive_failures)
