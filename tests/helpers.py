"""Request builders and a ``/metrics`` reader shared by the integration tests."""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import trio
from prometheus_client.parser import text_string_to_metric_families

from epd_trio._core.names import PATH_OF_KIND

#: The client-facing paths the tests call.
CHAT = PATH_OF_KIND["chat"]
COMPLETIONS = PATH_OF_KIND["completions"]


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
async def hold_admission_places(url: str, count: int) -> AsyncIterator[None]:
    """``count`` chat requests at ``url`` that send their headers and never their body: each
    holds an admission place (taken before the body is read) until the block ends and its
    connection closes."""
    parts = urlsplit(url)
    async with AsyncExitStack() as held:
        for _ in range(count):
            stream = await held.enter_async_context(
                await trio.open_tcp_stream(parts.hostname, parts.port))
            await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                                  b"content-type: application/json\r\ncontent-length: 100"
                                  b"\r\n\r\n{")
        yield


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


# -- reading a proxy's own metrics in-process (no scrape) -----------------------------------------
STAGES = ("encode", "prefill", "decode")


def metric(proxy: Any, name: str, **labels: str) -> float:
    """One sample's current value in ``proxy``'s registry (all workers'), 0 when absent."""
    registry = proxy.metrics.registry
    return 0.0 if registry is None else registry.get_sample_value(name, labels) or 0.0


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
