"""Everything that talks to vLLM over HTTP: one call per leg, and the encoder fan-out.

Rules: the HTTP library's exceptions are translated to the proxy's ``UpstreamError`` tree in
exactly one place (``map_upstream_errors``), so callers handle one family; every call has a
finite deadline (the settings' stage timeouts, enforced with a trio deadline around the whole
call; for streams, a per-read idle timeout after the first bytes); cancellation is never caught
here, so a client that goes away closes every upstream connection of its request (vLLM sees the
disconnect and aborts the work).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from types import TracebackType
from typing import Any

import orjson
import trio

from .._core.config import Settings
from .._core.ec_handoff import encoder_transfer_params
from .._core.errors import (
    ProxyError,
    ProxyOverloaded,
    UpstreamError,
    UpstreamRefused,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamTransportError,
    sse_error_event,
)
from .._core.failover import (
    NO_FAILOVER,
    UNOBSERVED,
    Allowed,
    Failover,
    LegObserver,
    Slot,
    next_slot,
    with_failover,
)
from .._core.names import CHAT_PATH
from .._core.rewrite import build_encoder_body, ec_transfer_params_of, upstream_headers
from .._core.routing import Instance, group_by_target
from .._state.cursors import EncoderCursor, Usable
from .._state.loads import Loads
from .fanout import fan_out
from .pool import (
    ConnectRefused,
    ConnectTimeout,
    PoolTimeout,
    TimeoutException,
    TransportError,
    UpstreamClient,
    UpstreamPool,
    UpstreamResponse,
)


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
                          keepalive_expiry=settings.upstream_keepalive,
                          headers=upstream_auth_headers(settings))


class map_upstream_errors:  # used as a function: ``with map_upstream_errors(...)``
    """Run a block against ``instance``; turn transport errors and deadlines into ``UpstreamError``.

    ``deadline`` (seconds) bounds the whole block, not just one socket read: a backend that
    trickles bytes slowly still cannot hold the request past it. ``detail`` prefixes the message
    (e.g. which items an encoder sub-request carried).

    A class around one bare ``CancelScope``, not a generator around ``trio.fail_after``: every
    leg of every request enters it, and the two generator layers cost more than the scope.
    """

    __slots__ = ("_deadline", "_detail", "_instance", "_scope", "_stage")

    def __init__(self, stage: str, instance: str, deadline: float | None = None,
                 detail: str = "") -> None:
        self._stage = stage
        self._instance = instance
        self._deadline = deadline
        self._detail = detail
        self._scope: trio.CancelScope | None = None

    def __enter__(self) -> None:
        if self._deadline is not None:
            self._scope = trio.CancelScope(deadline=trio.current_time() + self._deadline)
            self._scope.__enter__()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        stage, instance, detail = self._stage, self._instance, self._detail
        scope = self._scope
        if scope is not None:
            swallowed = scope.__exit__(exc_type, exc, tb)
            if scope.cancelled_caught:
                raise UpstreamTimeout(f"{detail}no answer within {self._deadline:g} s",
                                      stage=stage, instance=instance) from None
            if swallowed:
                return True
        if exc is None:
            return False
        if isinstance(exc, PoolTimeout):
            raise ProxyOverloaded(
                f"{stage} stage: {instance} is at its EPD_MAX_CONNECTIONS limit and no place "
                "freed within EPD_QUEUE_TIMEOUT"
            ) from None
        if isinstance(exc, TimeoutException):
            raise UpstreamTimeout(
                f"{detail}{type(exc).__name__} ({exc or 'timed out'})", stage=stage,
                instance=instance, connect=isinstance(exc, ConnectTimeout),
            ) from exc
        if isinstance(exc, TransportError):
            error = UpstreamRefused if isinstance(exc, ConnectRefused) else UpstreamTransportError
            raise error(
                f"{detail}{type(exc).__name__}: {exc or 'connection failed'}",
                stage=stage, instance=instance,
            ) from exc
        return False


def _encode_json(body: Mapping[str, Any] | bytes) -> bytes:
    """A leg's body: a JSON object encoded, or bytes already made (a form relayed as it
    came, a JSON body the leg needs unchanged)."""
    return body if isinstance(body, bytes | bytearray) else orjson.dumps(body)


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole (successful) upstream answer."""

    status: int
    content_type: str
    content: bytes


async def post_json(
    pool: UpstreamPool,
    *,
    stage: str,
    instance: Instance,
    path: str,
    body: Mapping[str, Any] | bytes,
    headers: Mapping[str, str],
    deadline: float,
    detail: str = "",
) -> Answer:
    """POST a JSON body and read the whole answer; a non-2xx answer raises ``UpstreamStatusError``.

    ``deadline`` bounds the whole call (one trio deadline, no per-read timeout needed), so a long
    prefill or a long non-stream generation is not cut short by the stream idle timeout.
    """
    return await _fetch(pool, b"POST", path, stage=stage, instance=instance, deadline=deadline,
                        headers=headers, content=_encode_json(body), detail=detail)


async def _fetch(
    pool: UpstreamPool, method: bytes, path: str, *, stage: str, instance: Instance,
    deadline: float, headers: Mapping[str, str] = {}, content: bytes = b"", detail: str = "",
) -> Answer:
    """One request read whole within ``deadline``; a non-2xx answer raises."""
    with map_upstream_errors(stage, instance.url, deadline, detail):
        response = await pool.request(method, path.encode("ascii"), headers=headers,
                                      content=content)
        data = await response.aread()  # closes the response, even when cancelled
    _raise_for_status(response, stage, instance.url, data, detail)
    return Answer(response.status, response.header("content-type", "application/json") or "",
                  data)


def _raise_for_status(
    response: UpstreamResponse, stage: str, instance: str, body: bytes, detail: str = ""
) -> None:
    """A non-2xx answer becomes ``UpstreamStatusError`` (the one place that builds it)."""
    if not response.is_success:
        raise UpstreamStatusError(stage=stage, instance=instance,
                                  upstream_status=response.status, upstream_body=body,
                                  detail=detail)


#: Told when a relayed stream breaks after its first byte.
OnStreamError = Callable[[ProxyError], None]

#: Where a relay sends the bytes (the web layer's ``send`` of one body message).
SendBytes = Callable[[bytes], Awaitable[None]]


class StreamRelay:
    """An upstream stream that has produced its first body bytes, ready to be relayed.

    Why read the first chunk before answering the client: vLLM sends its 200 headers at once,
    so a decode that fails before generating anything (a failed KV pull, a crash) would otherwise
    reach the client as a 200 followed by an error event. Up to the first body byte the failure
    is still the proxy's to handle (it can fail over); after it, nothing is retried.

    ``pump(send)`` sends the upstream bytes exactly as received (no re-chunking, no decoding),
    everything one socket read brought in one ``send``: tokens that piled up while the proxy
    was busy leave together, and none waits for another. If the upstream then breaks or goes
    silent past its idle timeout, the stream ends with an SSE error event instead of a silent
    truncation (``on_error`` is told). ``aclose()`` (idempotent, safe under cancellation)
    closes the upstream connection with a reset, which makes vLLM abort the generation, and
    tells ``on_abandon`` if the stream had not finished (the client left).
    """

    def __init__(
        self, response: UpstreamResponse, first: bytes, *, stage: str, instance: str,
        idle_timeout: float, on_error: OnStreamError | None = None,
        on_abandon: Callable[[], None] | None = None,
    ) -> None:
        self.response = response
        self._first = first
        self._stage = stage
        self._instance = instance
        self._idle_timeout = idle_timeout
        self._finished = False
        self._closed = False
        self._on_error = on_error
        self._on_abandon = on_abandon
        #: The stream's last two chunks once it is over (where its ``usage`` event is).
        self.tail = first
        #: The relay loop's cancel scope while it runs, and the error ``cut`` ends it with.
        self._scope: trio.CancelScope | None = None
        self._cut: ProxyError | None = None

    def cut(self, error: ProxyError) -> None:
        """End the stream now with ``error`` as its last event (the shutdown's grace period is
        over): the relay stops reading, sends the event, tells ``on_error`` and closes the
        upstream (vLLM aborts the generation)."""
        self._cut = error
        if self._scope is not None:
            self._scope.cancel()

    async def pump(self, send: SendBytes) -> None:
        """Relay the whole stream to ``send``, then close it (see the class docstring)."""
        try:
            first, self._first = self._first, b""
            await send(first)
            error = await self._relay(send)
            if error is not None:
                await send(sse_error_event(error))
        finally:
            await self.aclose()

    async def _relay(self, send: SendBytes) -> ProxyError | None:
        """The bytes after the first; the error the stream ends with, if any.

        The idle deadline is one cancel scope for the whole stream, moved on at most every
        ``idle_timeout / 16`` (a scope per read cost more than the rest of a read): a silent
        upstream is cut between ``idle_timeout`` and a sixteenth more after its last bytes.
        The scope also covers ``send``, which is not the upstream's fault: a deadline that
        expires there (the client stopped reading) ends the stream as abandoned.
        """
        idle = self._idle_timeout
        slack = idle / 16
        receive = self.response.receive
        sending = False
        previous, last = b"", self.tail
        try:
            with map_upstream_errors(self._stage, self._instance), \
                    trio.CancelScope(deadline=trio.current_time() + idle + slack) as scope:
                self._scope = scope
                # ``_closed`` is checked before each read: the stalled-send watchdog may have
                # released the upstream while ``send`` waited for the client.
                while not self._closed and self._cut is None:
                    chunk = await receive(None)
                    if not chunk:
                        self._finished = True
                        self.tail = previous + last
                        return None
                    previous, last = last, chunk
                    now = trio.current_time()
                    if scope.deadline - now < idle:
                        scope.deadline = now + idle + slack
                    sending = True
                    await send(chunk)
                    sending = False
            self._scope = None
            if self._cut is not None:
                self._finished = True  # ended by the proxy, with an event: not abandoned
                if self._on_error is not None:
                    self._on_error(self._cut)
                return self._cut
            if scope.cancelled_caught and sending:
                return None  # the client stopped reading: nobody to tell
            if scope.cancelled_caught:
                raise UpstreamTimeout(f"no data for {idle:g} s", stage=self._stage,
                                      instance=self._instance)
            # Closed under us while the client was not reading (the stalled-send watchdog
            # released the upstream): the answer is incomplete, and must say so.
            self._finished = True
            return UpstreamError("the stream was released: the client did not read it in time",
                                 stage=self._stage, instance=self._instance)
        except UpstreamError as error:
            self._finished = True  # over, with an error event: not abandoned by the client
            if self._on_error is not None and not self._closed:  # released: the client's doing
                self._on_error(error)
            return error

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.response.aclose()  # shielded; resets a connection whose body did not end
        if not self._finished and self._on_abandon is not None:
            self._on_abandon()


async def open_stream(
    pool: UpstreamPool,
    *,
    stage: str,
    instance: Instance,
    path: str,
    body: Mapping[str, Any] | bytes,
    headers: Mapping[str, str],
    deadline: float,
    idle_timeout: float,
    on_error: OnStreamError | None = None,
    on_abandon: Callable[[], None] | None = None,
) -> StreamRelay:
    """POST and return once the response headers *and* the first body bytes have arrived.

    ``deadline`` bounds the time to the first body bytes; ``idle_timeout`` bounds every wait
    for data, so also each gap between chunks once the stream runs (the smaller of the two
    applies before the first bytes). The caller owns the relay and must ``aclose()`` it (or
    ``pump`` it, which closes it); ``on_error`` and ``on_abandon`` go to the relay. A non-2xx
    answer is read, closed, and raised as ``UpstreamStatusError``.
    """
    with map_upstream_errors(stage, instance.url, deadline):
        response = await pool.request(b"POST", path.encode("ascii"), headers=headers,
                                      content=_encode_json(body), read_timeout=idle_timeout)
        try:
            if not response.is_success:
                _raise_for_status(response, stage, instance.url, await response.aread())
            first = await response.receive()
            if not first:  # a 200 that ended without a byte: nothing was generated
                raise UpstreamTransportError("the stream ended before any data",  # noqa: TRY301
                                             stage=stage, instance=instance.url)
        except BaseException:
            await response.aclose()  # shielded: vLLM must see the close
            raise
    return StreamRelay(response, first, stage=stage, instance=instance.url,
                       idle_timeout=idle_timeout, on_error=on_error, on_abandon=on_abandon)


async def get(pool: UpstreamPool, stage: str, instance: Instance, path: str,
              deadline: float) -> Answer:
    """GET a small resource (``/health``, ``/v1/models``); non-2xx raises ``UpstreamStatusError``."""
    return await _fetch(pool, b"GET", path, stage=stage, instance=instance, deadline=deadline)


@dataclass(frozen=True, slots=True)
class EncoderCall:
    """One encoder sub-request of a request: where it went and which items it carried."""

    index: int
    instance: Instance
    item_indices: tuple[int, ...]
    #: The answer's top-level ``ec_transfer_params`` (None when absent or unreadable).
    ec_transfer_params: Any = None


#: The connection pool to use for one instance.
PoolFor = Callable[[Instance], UpstreamPool]


async def run_encoder_fanout(
    client: UpstreamClient | PoolFor,
    cursor: EncoderCursor,
    *,
    body: Mapping[str, Any],
    items: Sequence[Mapping[str, Any]],
    request_id: str,
    max_batch: int = 0,
    deadline: float = 300.0,
    authorization: str | None = None,
    usable: Usable | None = None,
    failover: Failover = NO_FAILOVER,
    observer: LegObserver = UNOBSERVED,
    consumer_zmq: str | None = None,
    transfer_ids: Sequence[str] = (),
    loads: Loads | None = None,
) -> list[EncoderCall]:
    """Encode every media item of one request, concurrently, on round-robin encoders.

    ``items`` are the request's media parts already carrying their ``uuid`` (see
    ``with_item_uuids``); ``body`` supplies ``model`` and the media-processing fields. Items are
    assigned from the shared ``cursor`` among the ``usable`` encoders (one locked step per
    request, before anything is sent), grouped per encoder (at most ``max_batch`` items per
    sub-request, 0 = no cap), and sent in one nursery. A sub-request that fails in a retryable
    way is retried on the next untried encoder in rotation (``failover.max_attempts`` in all);
    the first failure that stays a failure cancels the sibling sub-requests and is raised as one
    ``UpstreamError`` naming the ``encode`` stage, the instance and the item indices. Each
    attempt is bounded by ``deadline`` seconds and reported to ``observer`` (the proxy's
    accounting). ``EncoderCall.instance`` is where it succeeded, and ``ec_transfer_params``
    what that encoder reported. With a push (Mooncake) consumer, each sub-request names
    ``consumer_zmq`` and its items' ``transfer_ids`` (by global item index). ``loads`` counts
    each attempt's items in flight at its encoder (what the load-aware policies read); the
    failover order is ``fallback_steps``, with the cursor's policy choosing within each step.
    """
    if not items:
        return []
    pool_for: PoolFor = client.pool if isinstance(client, UpstreamClient) else client
    uuids = [str(item.get("uuid")) for item in items]
    book = loads if loads is not None else Loads()  # a caller without policies: counts nothing
    assigned = await cursor.assign(len(items), usable, uuids)
    planned = [
        EncoderCall(k, instance, tuple(indices))
        for k, (instance, indices) in enumerate(group_by_target(assigned, max_batch))
    ]

    async def encode(call: EncoderCall) -> EncoderCall:
        encoder_body = build_encoder_body(body, [items[i] for i in call.item_indices])
        if consumer_zmq is not None:
            encoder_body["ec_transfer_params"] = encoder_transfer_params(
                consumer_zmq, [transfer_ids[i] for i in call.item_indices])
        headers = upstream_headers(f"{request_id}-enc-{call.index}", None, authorization)
        detail = f"items {list(call.item_indices)}: "

        async def attempt(slot: Slot) -> EncoderCall:
            with book.held("encode", (slot[0].url, None), len(call.item_indices)), \
                    observer.leg("encode", slot) as leg:
                answer = await post_json(
                    pool_for(slot[0]), stage="encode", instance=slot[0], path=CHAT_PATH,
                    body=encoder_body, headers=traced(leg, headers), deadline=deadline,
                    detail=detail,
                )
                if leg is not None:
                    leg.answered(answer.status)
            return replace(call, instance=slot[0],
                           ec_transfer_params=ec_transfer_params_of(answer.content))

        async def choose(allowed: Allowed | None, exclude: object) -> Slot:
            (instance,) = await cursor.assign(1, allowed, [uuids[call.item_indices[0]]])
            return instance, None

        async def pick_next(tried: set[Slot]) -> Slot | None:
            return await next_slot(choose, tried, usable or _anything)

        return await with_failover(failover, "encode", (call.instance, None), attempt, pick_next,
                                   observer.retried)

    return await fan_out([partial(encode, call) for call in planned])


def _anything(instance: Instance) -> bool:
    return True


def traced(leg: Any, headers: dict[str, str]) -> dict[str, str]:
    """A leg's headers with its trace headers (``leg``: what ``LegObserver.leg`` yielded; an
    unobserved leg has none)."""
    return headers if leg is None else leg.traced(dict(headers))
