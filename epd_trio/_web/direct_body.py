"""A relayed token written to the client's socket from the request itself, not through ASGI.

Under ASGI each relayed chunk is a message: a dict, the server's stream state machine, an
event object, the protocol's framing, a lock and a write, about a third of what a token costs
the proxy in Python (docs/discussion/performance.md). ``epd-trio serve``'s connection class
owns the socket, so it offers its HTTP/1.1 requests a writer (``scope["state"][DIRECT_BODY]``)
that frames a chunk and writes it in one non-blocking call, without any of that. The writer
declines whatever it cannot do that way (TLS, HTTP/1.0 or HTTP/2, a response with a length, a
write in progress, a full socket), and the request sends that chunk as an ASGI message as
before: plain Hypercorn offers no writer, and every request there takes the ASGI path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Protocol

__all__ = ["DECLINED", "DIRECT_BODY", "PARTIAL", "WRITTEN", "WRITTEN_YIELD", "ChunkWriter",
           "chunk_writer"]

#: The key of a connection's ``ChunkWriter`` in its ASGI state.
DIRECT_BODY: Final = "epd_trio.direct_body"

#: What ``ChunkWriter.write_chunk`` did with a chunk.
DECLINED: Final = 0  # nothing written: send the chunk as an ASGI message
WRITTEN: Final = 1  # all of it
WRITTEN_YIELD: Final = 2  # all of it, and the writer has not yielded for a while: yield now
PARTIAL: Final = 3  # the kernel took part of it: await ``flush_chunk()`` before anything else


class ChunkWriter(Protocol):
    """The connection's side (``epd_trio._serve.server.ProxyTCPServer``)."""

    def write_chunk(self, data: bytes) -> int:
        """Frame ``data`` as one chunk of the response's chunked body and write it now
        (never waits); one of ``DECLINED``, ``WRITTEN``, ``WRITTEN_YIELD``, ``PARTIAL``."""

    async def flush_chunk(self) -> None:
        """Write the rest of a ``PARTIAL`` chunk, waiting for the client to read."""


def chunk_writer(scope: Mapping[str, Any]) -> ChunkWriter | None:
    """The request's connection's writer, if its server offers one and the request is HTTP/1.1
    (one request per connection at a time, so the connection's response is this one's)."""
    state = scope.get("state")
    if state is None or scope.get("http_version") != "1.1":
        return None
    return state.get(DIRECT_BODY)
