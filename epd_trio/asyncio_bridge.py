"""Call the encoder fan-out and the routing cursors from asyncio code, via trio-asyncio.

Why a bridge and not an asyncio copy: the fan-out's guarantees (the first failing sub-request
cancels its siblings and closes their connections, so vLLM aborts them; one error names the stage,
the instance and the items) come from Trio's nurseries, and the cursors' fairness from owning one
position per process. An asyncio service gets the same objects and the same semantics by calling
into Trio, instead of a second implementation that would drift.

Who owns the loop. trio-asyncio runs an asyncio event loop *on top of* Trio; its supported
direction is a Trio program hosting asyncio code. An asyncio program therefore starts through
``run(main)`` (instead of ``asyncio.run(main())``): Trio runs underneath, ``main`` and everything
it awaits is ordinary asyncio code on trio-asyncio's loop, and each bridged call below runs as
its own Trio task in that same thread. A loop that trio-asyncio does not drive (a stock or uvloop
loop started by ``asyncio.run``, uvicorn, ...) cannot call Trio code: ``AsyncioBridge`` refuses
to start there with a ``RuntimeError`` saying so. (Trio's own guest mode,
``trio.lowlevel.start_guest_run``, is the tool for that case; it is not wrapped here.)

Side effect of importing this module: importing ``trio_asyncio`` replaces asyncio's event-loop
policy functions process-wide; afterwards a plain ``asyncio.run()`` gets trio-asyncio's
"compatibility mode" loop, which its authors support only for test suites. That is why this
module is not imported by ``epd_trio`` itself and needs the ``epd-trio[asyncio]`` extra. Import it
before anything has imported anyio's asyncio backend (anyio's pytest plugin does, at start-up):
that module binds asyncio's original ``get_running_loop``, so anyio-based asyncio libraries
(httpx's async client, the openai SDK) would find no loop on trio-asyncio's; a ``RuntimeWarning``
says so at import.

Cancellation. Cancelling the asyncio task that awaits a bridged call (``task.cancel()``,
``asyncio.timeout``, a client that went away) cancels the Trio task running it; the fan-out's
nursery then cancels every sub-request and closes its connection, and only after that cleanup
has finished does the awaiting task get ``asyncio.CancelledError``.

Errors. A failed call raises exactly one ``epd_trio.ProxyError``, the same exception the Trio API
raises: ``BadRequest`` for a body that cannot be forwarded, an ``UpstreamError`` (``.stage``,
``.instance``, ``.status``; the message names the items) when an encoder fails, ``ProxyOverloaded``
when no upstream connection place frees in time. Never an ``ExceptionGroup``, never a Trio
exception.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

import orjson
import trio
import trio_asyncio

from ._core.config import Settings
from ._core.failover import Failover
from ._core.rewrite import parse_request, with_item_uuids
from ._core.routing import Instance
from ._state.cursors import EncoderCursor, SlotCursor
from ._upstream.legs import EncoderCall, make_client, run_encoder_fanout
from ._upstream.pool import UpstreamClient, UpstreamPool

T = TypeVar("T")
P = ParamSpec("P")


def _check_anyio_binding() -> None:
    """Warn when anyio's asyncio backend holds asyncio's unpatched ``get_running_loop``."""
    backend = sys.modules.get("anyio._backends._asyncio")
    if getattr(backend, "get_running_loop", asyncio.get_running_loop) is not (
            asyncio.get_running_loop):
        warnings.warn(
            "anyio's asyncio backend was imported before trio-asyncio: anyio-based asyncio "
            "libraries (httpx, openai) will not find trio-asyncio's loop; import "
            "epd_trio.asyncio_bridge earlier (and run pytest with -p no:anyio)",
            RuntimeWarning, stacklevel=3)


_check_anyio_binding()


def run(main: Callable[P, Coroutine[Any, Any, T]], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run the asyncio coroutine function ``main(*args, **kwargs)`` as the whole program.

    Use it where the program would call ``asyncio.run(main())``: it starts Trio, opens a
    trio-asyncio loop on it, runs ``main`` as asyncio code, and closes both when ``main``
    returns. Like ``asyncio.run``, it returns ``main``'s result or raises its exception as is
    (not wrapped in the ``ExceptionGroup`` of the nurseries it passed through).
    """
    try:
        return trio_asyncio.run(partial(trio_asyncio.aio_as_trio(main), *args, **kwargs))
    except BaseExceptionGroup as group:
        sole = _sole_exception(group)
        if sole is None:
            raise
        raise sole from None


def _sole_exception(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception inside nested single-member groups; ``None`` if there are several."""
    while len(group.exceptions) == 1:
        (inner,) = group.exceptions
        if not isinstance(inner, BaseExceptionGroup):
            return inner
        group = inner
    return None


@dataclass(frozen=True, slots=True)
class Encoded:
    """One request after its encode stage: what to send to prefill/decode next."""

    #: The client body whose media parts now carry their ``uuid`` (the original is unchanged);
    #: send this to prefill and decode so they find the encoders' cache entries.
    body: dict[str, Any]
    #: The media parts, in order, as tagged in ``body``.
    items: list[dict[str, Any]]
    #: Each encoder sub-request: where it succeeded and which items it carried (empty when the
    #: request had no media or no encoder is configured: then there is no encode stage).
    calls: list[EncoderCall]
    #: The request id the encoder legs were derived from (``{request_id}-enc-{k}``).
    request_id: str


class AsyncioBridge:
    """The encoder fan-out and the routing cursors of one EPD cluster, for asyncio code.

    Built from ``Settings`` (so ``load_settings()`` configures it from the same ``EPD_*``
    variables as the proxy): the encoder cursor and the prefill and decode slot cursors are the
    proxy's own classes, each persisting across calls; upstream connections come from the
    proxy's per-instance pools (``EPD_MAX_CONNECTIONS``, ``EPD_QUEUE_TIMEOUT``); encoder sub-requests
    fail over like the proxy's (``EPD_MAX_ATTEMPTS``) within ``EPD_ENCODE_TIMEOUT`` per attempt.
    There is no background health probing here: a dead encoder costs each request that lands on
    it one failed attempt. Nor discovery: the bridge routes over the instances listed by URL
    (``dns+`` names and Kubernetes selectors need the proxy's background tasks).

    Use it as ``async with AsyncioBridge(settings) as bridge:`` inside a program started by
    ``run()``. Leaving the block closes the upstream connections.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._encoders = EncoderCursor(settings.listed("encode"))
        self._prefills = SlotCursor(settings.listed("prefill"))
        self._decodes = SlotCursor(settings.listed("decode"))
        self._failover = Failover(max_attempts=settings.max_attempts)
        self._client: UpstreamClient | None = None
        self._loop: trio_asyncio.TrioEventLoop | None = None
        #: Set by ``aclose``: a call still running must not open new connections.
        self._closing = False

    async def __aenter__(self) -> AsyncioBridge:
        loop = asyncio.get_running_loop()
        if not isinstance(loop, trio_asyncio.TrioEventLoop):  # the wrong runtime, not argument
            raise RuntimeError(  # noqa: TRY004
                f"AsyncioBridge needs trio-asyncio's loop, not {type(loop).__name__}: start "
                "the program with epd_trio.asyncio_bridge.run(main) instead of asyncio.run()")
        self._loop = loop
        self._closing = False
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every upstream connection (idempotent); calls then fail until re-entered."""
        if self._loop is not None:
            self._closing = True
            try:
                await self._call(self._close_client)
            finally:
                self._loop = None

    # -- bridged calls ---------------------------------------------------------------------------
    async def encode(
        self, body: Mapping[str, Any] | bytes, *, request_id: str | None = None,
        authorization: str | None = None,
    ) -> Encoded:
        """Validate a chat request, tag its media items, and encode them on the encoders.

        ``body`` is the client's chat-completions body (parsed, or raw JSON bytes). Items are
        assigned round-robin from the bridge's encoder cursor (continuing where the previous
        call stopped), grouped per encoder (``EPD_ENCODER_MAX_BATCH``) and sent concurrently in
        one Trio nursery; ``authorization`` is sent as the ``Authorization`` header. Raises
        ``BadRequest`` for a malformed body and ``UpstreamError`` when an encoder fails (the
        other sub-requests are cancelled first); see the module docstring for cancellation.
        """
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        tagged, items = with_item_uuids(parse_request(raw, "chat"))
        request_id = request_id or uuid.uuid4().hex
        calls: list[EncoderCall] = []
        if items and self._encoders.encoders:
            calls = await self._call(partial(
                run_encoder_fanout, self._pool, self._encoders, body=tagged, items=items,
                request_id=request_id, max_batch=self.settings.encoder_max_batch,
                deadline=self.settings.encode_timeout, authorization=authorization,
                failover=self._failover,
            ))
        return Encoded(tagged, items, calls, request_id)

    async def assign_encoders(self, count: int) -> list[Instance]:
        """The encoders for ``count`` items, advancing the shared round-robin cursor.

        For a service that sends its own encoder requests. Raises ``LookupError`` when no
        encoder is configured.
        """
        return await self._call(self._encoders.assign, count)

    # -- plain calls (no Trio needed) ------------------------------------------------------------
    def next_prefill(self) -> tuple[Instance, int | None]:
        """The next prefill ``(instance, dp_rank)`` slot, flat interleaved (docs/discussion/protocol.md).

        Send the rank as ``X-data-parallel-rank`` when it is not ``None``. A plain call: the
        cursor advances without a checkpoint, so it is atomic under asyncio too. Raises
        ``LookupError`` when no prefill instance is configured.
        """
        return self._prefills.next()

    def next_decode(self) -> tuple[Instance, int | None]:
        """The next decode ``(instance, dp_rank)`` slot; its own counter, independent of prefill's."""
        return self._decodes.next()

    # -- the Trio side ---------------------------------------------------------------------------
    async def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run the Trio function ``fn(*args)`` as a Trio task and await its result from asyncio.

        trio-asyncio ties the two: cancelling the awaiting asyncio task cancels the Trio task's
        scope and waits for it to finish; the Trio task's exception is raised here unchanged.
        """
        if self._loop is None:
            raise RuntimeError("use the bridge inside 'async with AsyncioBridge(settings)'")

        async def checked() -> T:
            result = await fn(*args)
            # trio-asyncio reports the asyncio task as cancelled only if Trio raised Cancelled;
            # a call that finished without another checkpoint (a shielded close) would swallow
            # the task's cancellation. This checkpoint raises it if it is pending.
            await trio.lowlevel.checkpoint_if_cancelled()
            return result

        return await trio_asyncio.trio_as_aio(checked, loop=self._loop)()

    def _pool(self, instance: Instance) -> UpstreamPool:
        # Pools are made on first use, inside a Trio task: their connections belong to Trio.
        if self._closing:  # closed while a call was still running: no new connections
            raise RuntimeError("the bridge was closed")
        if self._client is None:
            self._client = make_client(self.settings)
        return self._client.pool(instance)

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with trio.CancelScope(shield=True):
                await client.aclose()


__all__ = ["AsyncioBridge", "Encoded", "run"]
