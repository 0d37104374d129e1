"""Everything that talks to vLLM over HTTP: one call per leg, and the encoder fan-out.

Rules: the HTTP library's exceptions are translated to the proxy's ``UpstreamError`` tree in
exactly one place (``map_upstream_errors``), so callers handle one family; every call has a
finite deadline (the settings' stage timeouts, enforced with a trio deadline around the whole
call; for streams, a per-read idle timeout after the first bytes); cancellation is never caught
here, so a client that goes away closes every upstream connection of its request (vLLM sees the
disconnect and aborts the work).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import orjson
import trio

from ._core.config import Settings
from ._core.errors import (
    ProxyOverloaded,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamTransportError,
    sse_error_event,
)
from ._core.failover import (
    NO_FAILOVER,
    UNOBSERVED,
    Allowed,
    Failover,
    LegObserver,
    Slot,
    next_slot,
    with_failover,
)
from ._core.names import CHAT_PATH
from ._core.rewrite import build_encoder_body, upstream_headers
from ._core.routing import Instance, group_by_target
from ._cursors import EncoderCursor, Usable
from ._fanout import fan_out
from ._http import (
    ConnectTimeout,
    PoolTimeout,
    TimeoutException,
    TransportError,
    UpstreamClient,
    UpstreamPool,
    UpstreamResponse,
    reset_on_close,
)
from ._loads import Loads


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


@contextmanager
def map_upstream_errors(
    stage: str, instance: str, deadline: float | None = None, detail: str = ""
) -> Iterator[None]:
    """Run a block against ``instance``; turn transport errors and deadlines into ``UpstreamError``.

    ``deadline`` (seconds) bounds the whole block, not just one socket read: a backend that
    trickles bytes slowly still cannot hold the request past it. ``detail`` prefixes the message
    (e.g. which items an encoder sub-request carried).
    """
    try:
        with trio.fail_after(deadline) if deadline is not None else contextlib.nullcontext():
            yield
    except PoolTimeout:
        raise ProxyOverloaded(
            f"{stage} stage: {instance} is at its EPD_MAX_CONNECTIONS limit and no place freed "
            "within EPD_QUEUE_TIMEOUT"
        ) from None
    except trio.TooSlowError:
        raise UpstreamTimeout(
            f"{detail}no answer within {deadline:g} s", stage=stage, instance=instance
        ) from None
    except TimeoutException as exc:
        raise UpstreamTimeout(
            f"{detail}{type(exc).__name__} ({exc or 'timed out'})", stage=stage, instance=instance,
            connect=isinstance(exc, ConnectTimeout),
        ) from exc
    except TransportError as exc:
        raise UpstreamTransportError(
            f"{detail}{type(exc).__name__}: {exc or 'connection failed'}",
            stage=stage, instance=instance,
        ) from exc


def _encode_json(body: Mapping[str, Any]) -> bytes:
    return orjson.dumps(body)


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
    body: Mapping[str, Any],
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
OnStreamError = Callable[[UpstreamError], None]


class StreamRelay:
    """An upstream stream that has produced its first body bytes, ready to be relayed.

    Why read the first chunk before answering the client: vLLM sends its 200 headers at once,
    so a decode that fails before generating anything (a failed KV pull, a crash) would otherwise
    reach the client as a 200 followed by an error event. Up to the first body byte the failure
    is still the proxy's to handle (it can fail over); after it, nothing is retried.

    ``relay()`` yields the upstream bytes exactly as received (no re-chunking, no decoding). If
    the upstream then breaks or goes silent past its idle timeout, the stream ends with an SSE
    error event instead of a silent truncation (``on_error`` is told). ``aclose()`` (idempotent,
    safe under cancellation) closes the upstream connection, which makes vLLM abort the
    generation, and tells ``on_abandon`` if the stream had not finished (the client left).
    """

    def __init__(
        self, response: UpstreamResponse, chunks: AsyncGenerator[bytes, None], first: bytes, *,
        stage: str, instance: str, on_error: OnStreamError | None = None,
        on_abandon: Callable[[], None] | None = None,
    ) -> None:
        self.response = response
        self._chunks = chunks
        self._first = first
        self._stage = stage
        self._instance = instance
        self._finished = False
        self._closed = False
        self._on_error = on_error
        self._on_abandon = on_abandon

    async def relay(self) -> AsyncIterator[bytes]:
        try:
            yield self._first
            try:
                with map_upstream_errors(self._stage, self._instance):
                    # ``_closed`` is checked before each read, not after: the stalled-send
                    # watchdog may be closing ``_chunks`` right now (``aclose`` sets the flag
                    # first), and reading a generator being closed raises RuntimeError.
                    while not self._closed:
                        chunk = await anext(self._chunks, None)
                        if chunk is None:
                            break
                        yield chunk
                if not self._closed:
                    self._finished = True
                    return
                # Closed under us while the client was not reading (the stalled-send watchdog
                # released the upstream): the answer is incomplete, and must say so.
                raise UpstreamError("the stream was released: the client did not read it in "  # noqa: TRY301
                                    "time", stage=self._stage, instance=self._instance)
            except UpstreamError as error:
                released = self._closed  # the client's doing, not the instance's
                self._finished = True
                if self._on_error is not None and not released:
                    self._on_error(error)
                yield sse_error_event(error)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._finished:  # abandoned: make vLLM see a reset, not a FIN (it aborts)
            reset_on_close(self.response.socket)
        with trio.CancelScope(shield=True):
            await self._chunks.aclose()
            await self.response.aclose()
        if not self._finished and self._on_abandon is not None:
            self._on_abandon()


async def open_stream(
    pool: UpstreamPool,
    *,
    stage: str,
    instance: Instance,
    path: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    deadline: float,
    idle_timeout: float,
    on_error: OnStreamError | None = None,
    on_abandon: Callable[[], None] | None = None,
) -> StreamRelay:
    """POST and return once the response headers *and* the first body bytes have arrived.

    ``deadline`` bounds the time to the first body bytes; the per-read timeout
    (``idle_timeout``) bounds every wait for data, so also each gap between chunks once the
    stream runs (the smaller of the two applies before the first bytes). The caller owns the
    relay and must ``aclose()`` it; ``on_error`` and ``on_abandon`` go to the relay. A non-2xx
    answer is read, closed, and raised as ``UpstreamStatusError``.
    """
    with map_upstream_errors(stage, instance.url, deadline):
        response = await pool.request(b"POST", path.encode("ascii"), headers=headers,
                                      content=_encode_json(body), read_timeout=idle_timeout)
        try:
            chunks, first = await _first_bytes(response, stage, instance.url)
        except BaseException:
            await response.aclose()  # shielded: vLLM must see the close
            raise
    return StreamRelay(response, chunks, first, stage=stage, instance=instance.url,
                       on_error=on_error, on_abandon=on_abandon)


async def _first_bytes(
    response: UpstreamResponse, stage: str, instance: str
) -> tuple[AsyncGenerator[bytes, None], bytes]:
    if not response.is_success:
        _raise_for_status(response, stage, instance, await response.aread())
    chunks = response.aiter_raw()
    try:
        first = await anext(chunks, None)
        if not first:  # a 200 that ended without a byte: nothing was generated
            raise UpstreamTransportError("the stream ended before any data", stage=stage,  # noqa: TRY301
                                         instance=instance)
    except BaseException:
        with trio.CancelScope(shield=True):
            await chunks.aclose()
        raise
    return chunks, first


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
    accounting). ``EncoderCall.instance`` is where it succeeded. ``loads`` counts each attempt's
    items in flight at its encoder (what the load-aware policies read); the failover order is
    ``fallback_steps``', with the cursor's policy choosing within each step.
    """
    if not items:
        return []
    pool_for: PoolFor = client.pool if isinstance(client, UpstreamClient) else client
    uuids = [str(item.get("uuid")) for item in items]
    assigned = await cursor.assign(len(items), usable, uuids)
    planned = [
        EncoderCall(k, instance, tuple(indices))
        for k, (instance, indices) in enumerate(group_by_target(assigned, max_batch))
    ]

    async def encode(call: EncoderCall) -> EncoderCall:
        encoder_body = build_encoder_body(body, [items[i] for i in call.item_indices])
        headers = upstream_headers(f"{request_id}-enc-{call.index}", None, authorization)
        detail = f"items {list(call.item_indices)}: "

        async def attempt(slot: Slot) -> EncoderCall:
            with (loads.held("encode", (slot[0].url, None), len(call.item_indices))
                  if loads is not None else contextlib.nullcontext()), observer.leg("encode", slot):
                await post_json(
                    pool_for(slot[0]), stage="encode", instance=slot[0], path=CHAT_PATH,
                    body=encoder_body, headers=headers, deadline=deadline, detail=detail,
                )
            return replace(call, instance=slot[0])

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
