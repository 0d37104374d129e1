"""How one attempt gets its KV cache from prefill to decode: a strategy, chosen per attempt.

Each attempt of a request (``_pipeline.RequestRun.attempt``) reads encode -> hand-off ->
decode, and the hand-off is the part that differs between layouts and connectors:

- ``DecodeOnly``: no prefill instances, so decode does the whole request.
- ``PrefillThenDecode``: the generic hand-off (NIXL and other ``kv_transfer_params``
  connectors). Prefill answers with a KV handle, which decode's body carries.
- ``MoriioRead``: MoRIIO in READ mode. Prefill first, then decode. Both legs carry one id that
  names both peers' ZMQ addresses.
- ``MoriioWrite``: MoRIIO in WRITE mode. Decode allocates its blocks and the prefill pushes
  the KV into them, so the two legs run concurrently, in one nursery.

Why a strategy per attempt and not branches in the pipeline: the branches read the same
flags in three places (which prefill to choose before the encoders, which id the legs carry,
whether the legs run in order or together), and the next hand-off had nowhere to go. The
prefill bypass is one: decode alone when decode already holds the prompt's KV. It would be one
more rule in ``choose_handoff`` returning ``DECODE_ONLY``. Why per attempt: the transfer mode
is the roster's (its first MoRIIO registration fixes it), so a retry reads it again.

The strategies hold no state (each is one module-level instance): an attempt's state is on
its ``RequestRun``, whose helpers do the legs (``encoded``, ``post``, ``decode``,
``prefill_failover``). So choosing a strategy allocates nothing on the request path.

Failure and cancellation: a strategy raises what its legs raise. A MoRIIO WRITE attempt whose
prefill fails cancels its decode, closes any stream that decode opened, and notes the prefill
as tried so the next attempt chooses another one. Nothing is caught on cancellation.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection
from functools import partial
from typing import Any, Protocol, TypeVar

import trio

from ._core.errors import NoInstance
from ._core.failover import Slot
from ._core.moriio import (
    MoriioPeer,
    decode_kv_params,
    moriio_request_id,
    new_transfer_id,
    prefill_kv_params,
)
from ._core.names import Stage
from ._core.rewrite import build_decode_body, build_prefill_body, kv_transfer_params_of
from ._core.routing import Instance
from ._upstream.fanout import fan_out
from ._upstream.legs import Answer
from ._upstream.reply import Reply

log = logging.getLogger("epd_trio")
T = TypeVar("T")


class KvAccount(Protocol):
    def kv_missing(self) -> None: ...


class RequestRun(Protocol):
    """What a hand-off needs of the request it runs an attempt of: the legs every hand-off is
    made of (``_pipeline.RequestRun`` has them). A protocol, so this module never imports the
    pipeline that chooses its strategies (no import circle, not even a type-only one)."""

    body: dict[str, Any]
    request_id: str
    account: KvAccount
    prefills_tried: set[Slot] | None
    committed: bool

    async def next_slot(self, stage: Stage, tried: Collection[Slot],
                        any_slot: bool = False) -> Slot | None: ...

    async def encoded(self, leg_id: str, consumer: Slot) -> dict[str, Any]: ...

    async def prefill_failover(self, first: Slot,
                               attempt: Callable[[Slot], Awaitable[T]]) -> T: ...

    async def post(self, stage: Stage, slot: Slot, body: dict[str, Any], leg_id: str, *,
                   beside: bool = False) -> Answer: ...

    async def decode(self, slot: Slot, body: dict[str, Any], leg_id: str) -> Reply: ...

    def moriio_peer(self, instance: Instance) -> MoriioPeer | None: ...

    def prefill_failed(self, slot: Slot) -> None: ...

    async def close_stream(self) -> None: ...


class HandOff(Protocol):
    """One attempt's legs after its decode slot is chosen (its load held by the run)."""

    #: Inner stages the decode failover retries too: stages with no failover of their own.
    also_retry: tuple[Stage, ...]

    async def run(self, run: RequestRun, slot: Slot, leg_id: str) -> Reply:
        """Encode, hand the KV over, decode on ``slot``; ``leg_id``: the attempt's id."""
        ...


class DecodeOnly:
    """No prefill stage: the decode instance prefills the prompt itself."""

    __slots__ = ()
    also_retry: tuple[Stage, ...] = ()

    async def run(self, run: RequestRun, slot: Slot, leg_id: str) -> Reply:
        return await run.decode(slot, await run.encoded(leg_id, slot), leg_id)


class PrefillThenDecode:
    """The generic hand-off: prefill (with its own failover) answers with its
    ``kv_transfer_params``; decode's body carries them."""

    __slots__ = ()
    also_retry: tuple[Stage, ...] = ()

    async def run(self, run: RequestRun, slot: Slot, leg_id: str) -> Reply:
        # The consumer slot is chosen before the encoders are called (as upstream): a push
        # consumer's address goes on the encoder sub-requests.
        first = await run.next_slot("prefill", ())
        if first is None:
            raise NoInstance("no prefill instance is configured or registered")
        prefill_body = build_prefill_body(await run.encoded(leg_id, first))
        answer = await run.prefill_failover(
            first, partial(run.post, "prefill", body=prefill_body, leg_id=leg_id))
        params = kv_transfer_params_of(answer.content)
        if params is None:
            run.account.kv_missing()
        # Decode after a prefill gets the client's body (items with their uuid): it is no
        # encoder-cache consumer, and vLLM wants embeds values there.
        return await run.decode(slot, build_decode_body(run.body, params), leg_id)


def _decode_peer(run: RequestRun, slot: Slot) -> MoriioPeer:
    peer = run.moriio_peer(slot[0])
    if peer is None:  # it left the roster since it was chosen
        raise NoInstance(f"decode instance {slot[0].url} is no longer registered")
    return peer


def _moriio_legs(
    run: RequestRun, body: dict[str, Any], decode_peer: MoriioPeer, prefill: Slot,
) -> tuple[str, str, MoriioPeer, dict[str, Any]]:
    """A MoRIIO pair's ids and prefill body: the id both legs carry (it names both peers),
    a fresh transfer id, the prefill's peer, and its body with the transfer parameters."""
    prefill_peer = run.moriio_peer(prefill[0])
    if prefill_peer is None:
        raise NoInstance(f"prefill instance {prefill[0].url} is no longer registered")
    leg_id, transfer_id = moriio_request_id(prefill_peer, decode_peer), new_transfer_id()
    log.debug("request %s: MoRIIO legs %s, transfer %s", run.request_id, leg_id, transfer_id)
    prefill_body = {**build_prefill_body(body),
                    "kv_transfer_params": prefill_kv_params(transfer_id, decode_peer)}
    return leg_id, transfer_id, prefill_peer, prefill_body


class MoriioRead:
    """MoRIIO READ: prefill first (with its own failover, each attempt with fresh ids), then
    decode with the prefill's handle, which pulls the KV."""

    __slots__ = ()
    also_retry: tuple[Stage, ...] = ()

    async def run(self, run: RequestRun, slot: Slot, leg_id: str) -> Reply:
        body = await run.encoded(leg_id, slot)
        decode_peer = _decode_peer(run, slot)
        first = await run.next_slot("prefill", ())
        if first is None:
            raise NoInstance("no MoRIIO prefill instance is registered")
        prefill, leg_id, transfer_id, prefill_peer, answer = await run.prefill_failover(
            first, partial(self._prefill, run, body, decode_peer))
        handle = kv_transfer_params_of(answer.content)
        if handle is None:
            run.account.kv_missing()
        decode_body = build_decode_body(
            run.body, decode_kv_params(transfer_id, prefill_peer, prefill[1], handle or {}))
        return await run.decode(slot, decode_body, leg_id)

    @staticmethod
    async def _prefill(
        run: RequestRun, body: dict[str, Any], decode_peer: MoriioPeer, prefill: Slot,
    ) -> tuple[Slot, str, str, MoriioPeer, Any]:
        leg_id, transfer_id, prefill_peer, prefill_body = _moriio_legs(
            run, body, decode_peer, prefill)
        answer = await run.post("prefill", prefill, prefill_body, leg_id)
        return prefill, leg_id, transfer_id, prefill_peer, answer


class MoriioWrite:
    """MoRIIO WRITE: decode allocates its blocks and tells the prefill, which pushes the KV,
    so both legs run concurrently in one nursery (``fan_out``).

    Upstream fires that prefill and never looks at it; here a prefill failure cancels decode
    and the attempt fails, and the decode failover retries it (``also_retry``), choosing
    another prefill. The attempt succeeds only once decode's first bytes *and* prefill's
    answer are in, so no prefill failure can reach a client already answered (in WRITE mode
    prefill answers first: decode cannot generate before the KV is written). Decode is the
    leg the client waits on: the prefill runs ``beside`` it, and a cancellation counts as
    decode's.
    """

    __slots__ = ()
    also_retry: tuple[Stage, ...] = ("prefill",)

    async def run(self, run: RequestRun, slot: Slot, leg_id: str) -> Reply:
        body = await run.encoded(leg_id, slot)
        decode_peer = _decode_peer(run, slot)
        prefill = (await run.next_slot("prefill", run.prefills_tried or ())
                   or await run.next_slot("prefill", ()))
        if prefill is None:
            raise NoInstance("no MoRIIO prefill instance is registered")
        leg_id, transfer_id, prefill_peer, prefill_body = _moriio_legs(
            run, body, decode_peer, prefill)
        decode_body = build_decode_body(
            run.body, decode_kv_params(transfer_id, prefill_peer, prefill[1]))
        # Until both legs succeeded the decode stream is the attempt's: a failed attempt
        # closes it at once, and its close is no client leaving.
        run.committed = False
        try:
            _, reply = await fan_out([
                partial(run.post, "prefill", prefill, prefill_body, leg_id, beside=True),
                partial(run.decode, slot, decode_body, leg_id),
            ])
        except BaseException as exc:
            if getattr(exc, "stage", None) == "prefill":
                run.prefill_failed(prefill)  # the next attempt chooses another one
            with trio.CancelScope(shield=True):
                await run.close_stream()
            raise
        finally:
            run.committed = True
        return reply


DECODE_ONLY = DecodeOnly()
PREFILL_THEN_DECODE = PrefillThenDecode()
MORIIO_READ = MoriioRead()
MORIIO_WRITE = MoriioWrite()


def choose_handoff(*, moriio: bool, with_prefill: bool, transfer_mode: str | None) -> HandOff:
    """The hand-off of one attempt: from the connector (``moriio``), whether the roster has
    prefill instances, and MoRIIO's transfer mode (the roster's; READ unless it is WRITE).

    Raises ``NoInstance`` for MoRIIO without a prefill instance: a MoRIIO decode leg is
    always half of a pair, its id naming its prefill peer."""
    if not with_prefill:
        if moriio:
            raise NoInstance("MoRIIO needs a prefill instance: none is registered")
        return DECODE_ONLY
    if not moriio:
        return PREFILL_THEN_DECODE
    return MORIIO_WRITE if transfer_mode == "WRITE" else MORIIO_READ
