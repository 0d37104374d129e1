"""An in-process EPD cluster: fake vLLM instances plus the real proxy, all on 127.0.0.1.

Used by the integration tests, ``epd-trio demo`` and the burst bench; ``serve_proxy`` alone serves
the real-vLLM tests; ``run_moriio_cluster`` is the same with MoRIIO prefill/decode fakes that
register over ZMQ. Every server runs in one nursery owned by ``run_cluster``; leaving the
``async with`` block stops them all. The layering within ``testing/``: this module builds on
``fake_vllm`` and ``moriio`` (the stand-ins), and neither of those imports it back.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal

import trio

from .._app import create_app
from .._core.config import Settings, parse_setting
from .._core.routing import Instance, parse_instance
from .._observe.tracing import Tracing
from .._proxy import Proxy
from .._serve.serving import DEFAULT_KEEP_ALIVE, quiet_config, serve_app
from .fake_vllm import FakeVLLM, Role
from .moriio import MoriioSide, MoriioStandIn, TransferFabric, moriio_address


@dataclass
class Cluster:
    """The running cluster: the fakes by role, the proxy's URL and its settings."""

    encoders: list[FakeVLLM]
    prefills: list[FakeVLLM]
    decodes: list[FakeVLLM]
    settings: Settings
    proxy_url: str
    #: The proxy object behind the app (its registry, counters and cursors).
    proxy: Proxy

    @property
    def fakes(self) -> list[FakeVLLM]:
        return [*self.encoders, *self.prefills, *self.decodes]


async def _start_fakes(
    nursery: trio.Nursery, count: int, role: Role, dp_size: int, host: str,
    model: str = "fake-model",
) -> list[FakeVLLM]:
    fakes = [FakeVLLM(role=role, dp_size=dp_size, model=model) for _ in range(count)]
    for fake in fakes:
        await nursery.start(fake.serve, host)
    return fakes


async def answered(proxy: Proxy) -> None:
    """Until every instance of ``proxy``'s roster has said what it serves (the learner asks
    a newcomer at once, one round trip after it joined): before that, it serves no model."""
    await proxy.wait_roster(lambda roster: all(m.url in roster.served for m in roster.members))


@asynccontextmanager
async def serve_proxy(
    settings: Settings,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    keep_alive: float = DEFAULT_KEEP_ALIVE,
    clock: Callable[[], float] = time.monotonic,
    tracing: Tracing | None = None,
    plain_hypercorn: bool = False,
) -> AsyncIterator[tuple[str, Proxy]]:
    """Serve the real proxy app for ``settings`` in-process (Hypercorn trio worker, port 0 = any).

    Yields the proxy's base URL and the ``Proxy`` behind the app (its registry and counters).
    Leaving the block shuts the server down gracefully, which closes its upstream client.
    ``clock`` times MoRIIO registrations, ``tracing`` replaces the environment's (``create_app``);
    ``plain_hypercorn`` serves with Hypercorn's own connection class, as plain ``hypercorn``
    does, instead of ``epd-trio serve``'s.
    """
    app = create_app(settings, clock=clock, tracing=tracing)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(
            serve_app, app, quiet_config(host, port, keep_alive=keep_alive), stop,
            client_write_timeout=settings.client_write_timeout, plain_hypercorn=plain_hypercorn))
        try:
            yield url, app.extensions["epd_trio.proxy"]
        finally:
            stop.set()


@asynccontextmanager
async def run_cluster(
    *,
    encoders: int = 0,
    prefills: int = 0,
    prefill_dp: int = 1,
    decodes: int = 1,
    decode_dp: int = 1,
    decode_role: Role | None = None,
    host: str = "127.0.0.1",
    proxy_port: int = 0,
    keep_alive: float = DEFAULT_KEEP_ALIVE,
    tracing: Tracing | None = None,
    plain_hypercorn: bool = False,
    **settings: Any,
) -> AsyncIterator[Cluster]:
    """Start the fakes and the proxy (Hypercorn trio worker, in-process); stop all on exit.

    ``decode_role`` defaults to ``prefill_decode`` when there are no prefill instances (the
    E+PD / PD layouts) and ``decode`` otherwise. ``settings`` override ``Settings`` fields
    (``decodes=0, admin_key=...`` starts a proxy with no instance, waiting for registrations).
    """
    role: Role = decode_role or ("decode" if prefills else "prefill_decode")
    async with trio.open_nursery() as nursery:
        e = await _start_fakes(nursery, encoders, "encode", 1, host)
        p = await _start_fakes(nursery, prefills, "prefill", prefill_dp, host)
        d = await _start_fakes(nursery, decodes, role, decode_dp, host)
        config = Settings(**{
            "encode_urls": tuple(Instance(f.url) for f in e),
            "prefill_urls": tuple(Instance(f.url, prefill_dp) for f in p),
            "decode_urls": tuple(Instance(f.url, decode_dp) for f in d),
            **settings,
        })
        # The proxy shuts down gracefully (its upstream client is closed by the app's shutdown
        # hook) before the fakes are cancelled.
        async with serve_proxy(config, host=host, port=proxy_port, keep_alive=keep_alive,
                               tracing=tracing, plain_hypercorn=plain_hypercorn) as (url, proxy):
            yield Cluster(e, p, d, config, url, proxy)
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def run_moriio_cluster(
    *, mode: Literal["READ", "WRITE"] = "READ", encoders: int = 0, prefills: int = 1,
    prefill_dp: int = 1, decodes: int = 1, decode_dp: int = 1, prefill_tp: int = 1,
    decode_tp: int = 1, host: str = "127.0.0.1", proxy_port: int = 0,
    tracing: Tracing | None = None, **settings: Any,
) -> AsyncIterator[Cluster]:
    """Like ``run_cluster``, with prefill and decode fakes that speak MoRIIO and register over
    ZMQ (one ``MoriioStandIn`` each, on the proxy's registration socket at any free port); the
    block starts once every instance is in the roster."""
    fabric = TransferFabric()
    config = Settings(**{"kv_connector": "moriio", "moriio_registration": f"{host}:0",
                         "encode_urls": (), **settings})
    async with trio.open_nursery() as nursery:
        e = [FakeVLLM(role="encode") for _ in range(encoders)]
        p = [FakeVLLM(role="prefill", dp_size=prefill_dp) for _ in range(prefills)]
        d = [FakeVLLM(role="decode", dp_size=decode_dp) for _ in range(decodes)]
        for n, fake in enumerate([*p, *d]):
            fake.moriio = MoriioSide(moriio_address(host, 6300 + n, 61000 + n), mode,
                                     tp_size=prefill_tp if n < prefills else decode_tp,
                                     fabric=fabric)
        for fake in (*e, *p, *d):
            await nursery.start(fake.serve, host)
        config = replace(config, encode_urls=tuple(Instance(f.url) for f in e))
        async with serve_proxy(config, host=host, port=proxy_port, tracing=tracing) as (url, proxy):
            assert proxy.membership.moriio_endpoint is not None
            for fake in (*p, *d):
                assert fake.moriio is not None
                await nursery.start(MoriioStandIn(
                    proxy.membership.moriio_endpoint, "P" if fake.role == "prefill" else "D",
                    fake.url.removeprefix("http://"), fake.moriio.zmq_address,
                    dp_size=fake.dp_size, tp_size=fake.moriio.tp_size,
                    transfer_mode=mode).run)
                # One at a time: the roster (and so the rotation) is in the fakes' order.
                await proxy.wait_roster(lambda r, url=fake.url: r.find(url) is not None)
            await answered(proxy)
            yield Cluster(e, p, d, config, url, proxy)
        nursery.cancel_scope.cancel()


#: A model's instances by role: ``(encoders, prefills x DP, decodes x DP)`` counts.
Layout = tuple[int, tuple[int, int], tuple[int, int]]


@dataclass
class Fleet:
    """A running fleet of several models: each model's fakes by role, and the proxy."""

    #: By model: its ``encode``, ``prefill`` and ``decode`` fakes (each serves that name only).
    fakes: dict[str, dict[str, list[FakeVLLM]]]
    settings: Settings
    proxy_url: str
    proxy: Proxy

    def all(self) -> list[FakeVLLM]:
        return [fake for roles in self.fakes.values() for group in roles.values()
                for fake in group]


@asynccontextmanager
async def run_fleet(
    layouts: dict[str, Layout], *, tables: bool = True, host: str = "127.0.0.1",
    proxy_port: int = 0, pool_settings: dict[str, dict[str, Any]] | None = None,
    **settings: Any,
) -> AsyncIterator[Fleet]:
    """Fakes for each model of ``layouts`` (each serving that name alone), and the proxy in
    front of them all: with ``tables``, each model's instances in its ``[models."NAME"]``
    table (with ``pool_settings[NAME]``, its own settings and cap, beside them); without, in
    the top-level lists, every pool learned from ``/v1/models``. A model
    with no prefill has combined ``decode`` instances (the decode-alone pool). ``settings``
    override ``Settings`` fields."""
    async with trio.open_nursery() as nursery:
        fakes: dict[str, dict[str, list[FakeVLLM]]] = {}
        urls: dict[str, dict[str, list[str]]] = {}
        for model, (encoders, (prefills, prefill_dp), (decodes, decode_dp)) in layouts.items():
            roles: dict[str, list[FakeVLLM]] = {
                "encode": await _start_fakes(nursery, encoders, "encode", 1, host, model),
                "prefill": await _start_fakes(nursery, prefills, "prefill", prefill_dp, host,
                                              model),
                "decode": await _start_fakes(nursery, decodes, "decode", decode_dp, host, model)}
            fakes[model] = roles
            urls[model] = {role: [f"{f.url}#dp={f.dp_size}" for f in group]
                           for role, group in roles.items()}
        if tables:
            lists: dict[str, Any] = {"models": {
                m: {**{r: u for r, u in roles.items() if u}, **(pool_settings or {}).get(m, {})}
                for m, roles in urls.items()}}
        else:
            lists = {f"{role}_urls": tuple(parse_instance(u) for roles in urls.values()
                                           for u in roles[role])
                     for role in ("encode", "prefill", "decode")}
        config = Settings(**_parsed_tables({**lists, **settings}))
        async with serve_proxy(config, host=host, port=proxy_port) as (url, proxy):
            yield Fleet(fakes, config, url, proxy)
        nursery.cancel_scope.cancel()


def _parsed_tables(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with its tables (models, aliases, tenants) parsed as the config file's are."""
    return {key: (parse_setting(key, value, key) if key in _TABLES and isinstance(value, dict)
                  else value) for key, value in values.items()}


_TABLES = ("models", "model_aliases", "tenants")
