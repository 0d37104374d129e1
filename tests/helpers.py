"""Request builders, a ``/metrics`` reader and servers run as processes, shared by the
integration tests."""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import trio
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from epd_trio._core.names import PATH_OF_KIND
from epd_trio._state.roster_store import SharedRoutingState
from epd_trio.testing import FakeVLLM
from epd_trio.testing.moriio import MoriioSide, TransferFabric, moriio_address
from epd_trio.testing.process import read_until, stop_process

#: The client-facing paths the tests call.
CHAT = PATH_OF_KIND["chat"]
COMPLETIONS = PATH_OF_KIND["completions"]


def second_view(state: SharedRoutingState) -> SharedRoutingState:
    """What a spawned worker of ``epd-trio serve`` gets: the same shared memory, its own
    per-process part (two workers in one test process)."""
    other: Any = SharedRoutingState.__new__(SharedRoutingState)
    other.__setstate__(state.__getstate__())
    return other


def image(n: int) -> dict[str, Any]:
    """A distinct small image item (data URL); its uuid is the SHA-256 of the URL."""
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,iVBORw0KGgo{n:08d}"}}


def url_uuid(part: dict[str, Any]) -> str:
    return hashlib.sha256(part["image_url"]["url"].encode()).hexdigest()


def chat_body(*items: dict[str, Any], text: str = "describe", **extra: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": [*items, {"type": "text", "text": text}]}],
        "max_tokens": 5,
        **extra,
    }


async def open_stuck_stream(url: str) -> trio.SocketStream:
    """Ask ``url`` for a huge chat stream over a raw socket, and (the caller) never read it."""
    parts = urlsplit(url)
    stuck = await trio.open_tcp_stream(parts.hostname, parts.port)
    body = orjson.dumps({**chat_body(), "stream": True, "max_tokens": 10**6})
    await stuck.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
        b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    return stuck


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@asynccontextmanager
async def hold_admission_places(url: str, count: int, api_key: str | None = None
                                ) -> AsyncIterator[None]:
    """``count`` chat requests at ``url`` (with ``api_key``, if given) that send their headers
    and never their body: each holds an admission place (taken before the body is read) until
    the block ends and its connection closes."""
    auth = b"" if api_key is None else f"authorization: Bearer {api_key}\r\n".encode()
    parts = urlsplit(url)
    async with AsyncExitStack() as held:
        for _ in range(count):
            stream = await held.enter_async_context(
                await trio.open_tcp_stream(parts.hostname, parts.port))
            await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + auth
                                  + b"content-type: application/json\r\ncontent-length: 100"
                                  b"\r\n\r\n{")
        yield


async def post_until_cancelled(client: httpx.AsyncClient, url: str, scope: trio.CancelScope,
                               **request: Any) -> None:
    """POST to ``url`` (``request``: httpx's arguments) until ``scope`` is cancelled: a
    request that holds its place while its decode hangs."""
    with scope:
        await client.post(url, **request)


class Samples:
    """A parsed ``/metrics`` scrape: sample values by name and labels."""

    def __init__(self, text: str) -> None:
        self.samples = [(s.name, s.labels, s.value)
                        for family in text_string_to_metric_families(text)
                        for s in family.samples]

    def get(self, name: str, **labels: str) -> float:
        """The value of the one sample with exactly these labels (0 when absent)."""
        found = [v for n, lab, v in self.samples if n == name and lab == labels]
        assert len(found) <= 1, (name, labels, found)
        return found[0] if found else 0.0

    def sum(self, name: str, **labels: str) -> float:
        """The sum over every sample whose labels include these."""
        return sum(v for n, lab, v in self.samples
                   if n == name and all(lab.get(k) == x for k, x in labels.items()))

    def by(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """Non-zero values of ``name`` keyed by one label (e.g. per instance)."""
        out: dict[str, float] = {}
        for n, lab, v in self.samples:
            if n == name and v and all(lab.get(k) == x for k, x in labels.items()):
                out[lab[label]] = out.get(lab[label], 0.0) + v
        return out


async def scrape(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str] | None = None
) -> Samples:
    r = await client.get(base_url + "/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return Samples(r.text)


def requests_per_worker(metrics_dir: str | os.PathLike[str]) -> dict[int, float]:
    """Each worker's own count of successful requests, from its own counter file in the
    ``PROMETHEUS_MULTIPROC_DIR`` of ``epd-trio serve --workers N`` (``counter_<pid>.db``;
    the pid as the worker knows it, in its container if it runs in one), keyed by that pid.
    A scrape adds the files up; this shows which worker served what."""
    counts = {}
    for path in Path(metrics_dir).glob("counter_*.db"):
        samples = [s for family in MultiProcessCollector.merge([str(path)])
                   for s in family.samples
                   if s.name == "epd_trio_requests_total" and s.labels.get("outcome") == "ok"]
        counts[int(path.stem.removeprefix("counter_"))] = sum(s.value for s in samples)
    return counts


# -- reading a proxy's own metrics in-process (no scrape) -----------------------------------------
STAGES = ("encode", "prefill", "decode")


def metric(proxy: Any, name: str, **labels: str) -> float:
    """The current value in ``proxy``'s registry (all workers') of the samples of ``name``
    whose labels include ``labels`` (one sample when they name them all), 0 when absent."""
    registry = proxy.metrics.registry
    if registry is None:
        return 0.0
    return sum(sample.value for family in registry.collect() for sample in family.samples
               if sample.name == name
               and all(sample.labels.get(key) == value for key, value in labels.items()))


async def poll_until(check: Callable[[], bool | Awaitable[bool]], limit: float) -> float:
    """Seconds until ``check()`` held (polled every 10 ms); fails after ``limit`` seconds.
    ``check`` may be async (a request to ask: ``/ready``, a scrape), then it is awaited.

    Polling, not sleeping as synchronisation, for what has no event to wait on: the kernel's
    socket table, another process's fds, a proxy's gauge while a request crosses a socket, a
    server in another process or a container becoming ready."""
    began = trio.current_time()
    with trio.fail_after(limit):
        while True:
            held = check()
            if inspect.isawaitable(held):
                held = await held
            if held:
                break
            await trio.sleep(0.01)
    return trio.current_time() - began


def queued(proxy: Any, tenant: str, priority: int = 0) -> float:
    """How many of ``tenant``'s requests wait for an admission place at ``proxy``."""
    return metric(proxy, "epd_trio_tenant_queue_depth", tenant=tenant, priority=str(priority))


def by_stage(proxy: Any, name: str) -> dict[str, float]:
    """A per-stage counter's non-zero values, e.g. ``by_stage(p, "epd_trio_retries_total")``."""
    values = {stage: metric(proxy, name, stage=stage) for stage in STAGES}
    return {stage: value for stage, value in values.items() if value}


def retries(proxy: Any) -> dict[str, float]:
    return by_stage(proxy, "epd_trio_retries_total")


def client_cancels(proxy: Any) -> dict[str, float]:
    return by_stage(proxy, "epd_trio_client_cancellations_total")


async def start_fakes(nursery: trio.Nursery, *fakes: Any) -> list[Any]:
    """Serve each fake vLLM on its own ephemeral port in ``nursery`` (ready when this returns)."""
    for fake in fakes:
        await nursery.start(fake.serve)
    return list(fakes)


#: Loopback addresses that stand for the pods of a headless Service or a label selector.
POD_ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


async def serve_on_addresses(
    nursery: trio.Nursery, fakes: list[Any], addresses: tuple[str, ...] = POD_ADDRESSES
) -> int:
    """Serve each fake on its own loopback address, all on one port (the first one's), as
    discovered pods listen: the discovered URL is the address plus that port."""
    first = await nursery.start(fakes[0].serve, addresses[0], 0)
    port = int(first.rsplit(":", 1)[1])
    for fake, address in zip(fakes[1:], addresses[1:len(fakes)], strict=True):
        await nursery.start(fake.serve, address, port)
    return port


#: What ``epd-trio serve`` prints once it accepts connections (the URL is the group).
SERVING = rb"listening on (http://[^\s\"]+)"  # text, or inside a JSON line


@dataclass
class ServerProcess:
    """A server started by ``server_process``: its URL, its stderr so far, and its process."""

    url: str
    process: trio.Process
    #: Everything the process wrote to stderr, growing while it runs (drained in a task).
    log: bytearray = field(default_factory=bytearray)
    #: Set when the drain read the end of that stderr: wait for it before reading ``log`` for
    #: what the process said last (at exit), or a line still in the pipe is missed.
    ended: trio.Event = field(default_factory=trio.Event)

    async def whole_log(self, limit: float = 30.0) -> bytes:
        """``log`` once stderr has ended (the process exited): all of it."""
        with trio.fail_after(limit):
            await self.ended.wait()
        return bytes(self.log)


@asynccontextmanager
async def server_process(
    nursery: trio.Nursery, command: list[str], env: dict[str, str], *,
    pattern: bytes = SERVING, limit: float = 30.0,
    stop: Callable[[trio.Process], Awaitable[None]] = stop_process,
) -> AsyncIterator[ServerProcess]:
    """Start a server as a subprocess (``epd-trio serve``, plain ``hypercorn``, ``podman
    run``), and yield once ``pattern`` shows its URL in its stderr. A task in ``nursery`` keeps
    reading that stderr into ``log`` so the process never blocks on a full pipe, and sets
    ``ended`` at its end. On the way out ``stop`` ends it (``stop_process``: SIGTERM, then
    SIGKILL; a container is removed by name instead), also when the test fails or is
    cancelled."""
    process = await trio.lowlevel.open_process(command, env=env, stderr=subprocess.PIPE)
    try:
        stderr = process.stderr
        assert stderr is not None
        match, seen = await read_until(stderr, pattern, limit=limit)
        served = ServerProcess(match.group(1).decode(), process, bytearray(seen))

        async def drain() -> None:
            async for chunk in stderr:
                served.log.extend(chunk)
            served.ended.set()

        nursery.start_soon(drain)
        yield served
    finally:
        await stop(process)


async def instances_listing(url: str, api_key: str) -> dict[str, Any]:
    """``GET /instances``, on a fresh connection: with ``--workers N`` any worker answers."""
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        r = await client.get(url + "/instances", headers={"x-api-key": api_key})
        assert r.status_code == 200, r.text
        return r.json()


async def every_worker_lists(url: str, count: int, api_key: str, *, workers: int = 2,
                             role: str = "decode", limit: float = 30.0) -> None:
    """Return once ``workers`` different worker processes behind ``url`` have each listed
    ``count`` instances of ``role``, every one of them serving a model: an instance serves
    nothing until it has answered ``/v1/models``, and a request sent before that would miss it
    (polled: no event crosses processes; each call is a round trip, so the loop does not spin)."""
    seen: set[int] = set()
    with trio.fail_after(limit):
        while len(seen) < workers:
            answer = await instances_listing(url, api_key)
            listed = answer["instances"][role]
            if len(listed) == count and all(entry["models"] for entry in listed):
                seen.add(answer["worker_pid"])


def moriio_pair(mode: str, handshake: int, notify: int, *,
                prefill_dp: int = 1) -> tuple[FakeVLLM, FakeVLLM]:
    """A prefill and a decode fake that speak MoRIIO in ``mode`` over one transfer fabric;
    their ZMQ handshake and notify ports are ``handshake`` and ``notify``, plus 1 for decode."""
    fabric = TransferFabric()
    prefill, decode = FakeVLLM("prefill", dp_size=prefill_dp), FakeVLLM("decode")
    for n, fake in enumerate((prefill, decode)):
        fake.moriio = MoriioSide(moriio_address("127.0.0.1", handshake + n, notify + n), mode,
                                 fabric=fabric)
    return prefill, decode
