"""Request builders shared by the integration tests."""

from __future__ import annotations

import hashlib
from typing import Any


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
