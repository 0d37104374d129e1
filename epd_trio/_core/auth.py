"""Key checks for the client API keys and the admin key (pure: no I/O, no framework).

Keys are hashed once at start-up (SHA-256, as vLLM's own ``--api-key`` middleware does) and a
presented key is hashed and compared with ``hmac.compare_digest`` against every configured
one, without stopping at the first match: the time taken says nothing about how much of a key
was right, nor which key matched. One hash and one compare per configured key per request
(about a microsecond for a few keys): cheap enough for the hot path.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from .errors import AdminDisabled, AdminUnauthorized, Unauthorized


def first_header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The value of the first ``name`` header of an ASGI head, else None. Every reader of a
    request's head reads a repeated header this way: the key check and the tenant lookup
    must see the same ``authorization``, or a second one could move a checked request to
    another tenant."""
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def bearer_token(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` value (scheme case-insensitive), else None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _matches(presented: str, digests: tuple[bytes, ...]) -> bool:
    candidate = _digest(presented)
    found = False
    for digest in digests:
        found |= hmac.compare_digest(candidate, digest)
    return found


class ClientKeys:
    """The ``Authorization: Bearer <key>`` check of the OpenAI routes (off without keys)."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(k) for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> None:
        """Raise ``Unauthorized`` (401) unless ``authorization`` carries a configured key."""
        if not self._digests:
            return
        token = bearer_token(authorization)
        if token is None:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        if not _matches(token, self._digests):
            raise Unauthorized("incorrect API key provided")


class AdminKey:
    """The ``X-API-Key`` check of the admin routes.

    ``required=True`` routes (registration) are off without a configured key: 403. Other admin
    routes (profiling) are open without one, and need it once it is configured.
    """

    def __init__(self, key: str | None) -> None:
        self._digests = (_digest(key),) if key else ()

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, presented: str | None, *, required: bool) -> None:
        """Raise ``AdminDisabled`` (403) or ``Unauthorized`` (401) unless allowed."""
        if not self._digests:
            if required:
                raise AdminDisabled("instance registration is disabled: the proxy has no admin "
                                    "key (set EPD_ADMIN_KEY)")
            return
        if not presented or not _matches(presented, self._digests):
            raise AdminUnauthorized("missing or wrong admin key: send 'X-API-Key: <EPD_ADMIN_KEY>'")
