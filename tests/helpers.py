"""Request builders shared by the integration tests."""

from __future__ import annotations

import hashlib
from typing import Any
from urllib.parse import urlsplit

import orjson
import trio


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
