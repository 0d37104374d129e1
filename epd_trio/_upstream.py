"""Everything that talks to vLLM over HTTP: one call per leg, and the encoder fan-out.

Rules: httpx exceptions are translated to the proxy's ``UpstreamError`` tree in exactly one place
(``map_httpx_errors``), so callers handle one family; every call has a finite deadline (the
settings' stage timeouts, enforced with a trio deadline around the whole call, plus httpx's own
connect/read timeouts); cancellation is never caught here, so a client that goes away closes
every upstream connection of its request (vLLM sees the disconnect and aborts the work).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import httpx
import orjson
import trio

from ._cursors import EncoderCursor, Usable
from ._errors import (
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamTransportError,
)
from ._failover import NO_FAILOVER, Failover, with_failover
from ._fanout import fan_out
from ._rewrite import build_encoder_body, upstream_headers
from ._routing import Instance, group_by_target

CHAT_PATH = "/v1/chat/completions"


@contextmanager
def map_httpx_errors(
    stage: str, instance: str, deadline: float | None = None, detail: str = ""
) -> Iterator[None]:
    """Run a block against ``instance``; turn transport errors and deadlines into ``UpstreamError``.

    ``deadline`` (seconds) bounds the whole block, not just one socket read: a backend that
    trickles bytes slowly still cannot hold the request past it. ``detail`` prefixes the message
    (e.g. which items an encoder sub-request carried).
    """
    try:
        with trio.fail_after(deadline) if deadline is not None else _no_deadline():
            yield
    except trio.TooSlowError:
        raise UpstreamTimeout(
            f"{detail}no answer within {deadline:g} s", stage=stage, instance=instance
        ) from None
    except httpx.TimeoutException as exc:
        raise UpstreamTimeout(
            f"{detail}{type(exc).__name__} ({exc or 'timed out'})", stage=stage, instance=instance,
            connect=isinstance(exc, httpx.ConnectTimeout),
        ) from exc
    except httpx.TransportError as exc:
        raise UpstreamTransportError(
            f"{detail}{type(exc).__name__}: {exc or 'connection failed'}",
            stage=stage, instance=instance,
        ) from exc


@contextmanager
def _no_deadline() -> Iterator[None]:
    yield


def _encode_json(body: Mapping[str, Any]) -> bytes:
    return orjson.dumps(body)


async def post_json(
    client: httpx.AsyncClient,
    *,
    stage: str,
    instance: Instance,
    path: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    deadline: float,
    detail: str = "",
) -> httpx.Response:
    """POST a JSON body and read the whole answer; a non-2xx answer raises ``UpstreamStatusError``."""
    with map_httpx_errors(stage, instance.url, deadline, detail):
        response = await client.post(
            instance.url + path, content=_encode_json(body), headers=headers
        )
    if not response.is_success:
        raise UpstreamStatusError(
            stage=stage, instance=instance.url, upstream_status=response.status_code,
            upstream_body=response.content, detail=detail,
        )
    return response


async def open_stream(
    client: httpx.AsyncClient,
    *,
    stage: str,
    instance: Instance,
    path: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    deadline: float,
    idle_timeout: float,
) -> httpx.Response:
    """POST and return as soon as the response headers arrived, with the body still unread.

    ``deadline`` bounds the time to the headers; afterwards httpx's read timeout
    (``idle_timeout``) bounds each gap between chunks. The caller owns the returned response and
    must ``aclose()`` it. A non-2xx answer is read, closed, and raised as ``UpstreamStatusError``.
    """
    request = client.build_request(
        "POST", instance.url + path, content=_encode_json(body), headers=headers,
        timeout=httpx.Timeout(client.timeout.connect, read=idle_timeout,
                              write=client.timeout.write, pool=client.timeout.pool),
    )
    with map_httpx_errors(stage, instance.url, deadline):
        response = await client.send(request, stream=True)
        if not response.is_success:
            try:
                content = await response.aread()
            finally:
                await response.aclose()
            raise UpstreamStatusError(
                stage=stage, instance=instance.url, upstream_status=response.status_code,
                upstream_body=content,
            )
    return response


async def get(
    client: httpx.AsyncClient, stage: str, instance: Instance, path: str, deadline: float
) -> httpx.Response:
    """GET a small resource (``/health``, ``/v1/models``); non-2xx raises ``UpstreamStatusError``."""
    with map_httpx_errors(stage, instance.url, deadline):
        response = await client.get(instance.url + path)
    if not response.is_success:
        raise UpstreamStatusError(
            stage=stage, instance=instance.url, upstream_status=response.status_code,
            upstream_body=response.content,
        )
    return response


async def aclose_shielded(response: httpx.Response) -> None:
    """Close an upstream response even while the caller is being cancelled.

    Closing is what tells vLLM the request is gone (it aborts on disconnect), so it must not be
    skipped because the client's own cancellation arrived first.
    """
    with trio.CancelScope(shield=True):
        await response.aclose()


def sse_error_event(error: UpstreamError) -> bytes:
    """The frame that ends a stream which broke after its first byte (no silent truncation)."""
    return b"data: " + orjson.dumps(error.payload()) + b"\n\n"


async def relay_stream(
    response: httpx.Response,
    *,
    stage: str,
    instance: str,
    on_error: Callable[[UpstreamError], None] | None = None,
    on_abandon: Callable[[], None] | None = None,
) -> AsyncIterator[bytes]:
    """Yield the upstream bytes exactly as received (no re-chunking, no decoding).

    If the upstream breaks or goes silent past its idle timeout after bytes were sent, the stream
    ends with an SSE error event instead of a silent truncation (``on_error`` is told). If the
    consumer stops early (the client went away), ``on_abandon`` is told. The response is closed
    in every case, which makes vLLM abort the generation.
    """
    finished = False
    try:
        try:
            with map_httpx_errors(stage, instance):
                async for chunk in response.aiter_raw():
                    yield chunk
            finished = True
        except UpstreamError as error:
            finished = True
            if on_error is not None:
                on_error(error)
            yield sse_error_event(error)
    finally:
        if not finished and on_abandon is not None:
            on_abandon()
        await aclose_shielded(response)


@dataclass(frozen=True, slots=True)
class EncoderCall:
    """One encoder sub-request of a request: where it went and which items it carried."""

    index: int
    instance: Instance
    item_indices: tuple[int, ...]


async def run_encoder_fanout(
    client: httpx.AsyncClient,
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
    attempt is bounded by ``deadline`` seconds. ``EncoderCall.instance`` is where it succeeded.
    """
    if not items:
        return []
    assigned = await cursor.assign(len(items), usable)
    planned = [
        EncoderCall(k, instance, tuple(indices))
        for k, (instance, indices) in enumerate(group_by_target(assigned, max_batch))
    ]

    async def encode(call: EncoderCall) -> EncoderCall:
        encoder_body = build_encoder_body(body, [items[i] for i in call.item_indices])
        headers = upstream_headers(f"{request_id}-enc-{call.index}", None, authorization)
        detail = f"items {list(call.item_indices)}: "

        async def attempt(slot: tuple[Instance, int | None]) -> EncoderCall:
            await post_json(
                client, stage="encode", instance=slot[0], path=CHAT_PATH, body=encoder_body,
                headers=headers, deadline=deadline, detail=detail,
            )
            return replace(call, instance=slot[0])

        async def pick_next(tried: set[str]) -> tuple[Instance, int | None] | None:
            try:
                (instance,) = await cursor.assign(1, lambda e: e.url not in tried and (
                    usable is None or usable(e)))
            except LookupError:
                return None
            return instance, None

        return await with_failover(failover, "encode", (call.instance, None), attempt, pick_next)

    return await fan_out([partial(encode, call) for call in planned])
