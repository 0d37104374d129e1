"""The load generator's wire code, sans I/O: an HTTP/1.1 response reader and an SSE splitter.

Why not h11 on the client side: on a 2-core machine the load generator shares the CPU with the
proxy under test and its backends, and at 64 streams x 128 tokens it handles ~20 000 chunks a
second. h11 costs tens of microseconds per chunk in pure Python; this reader does the little a
benchmark client needs (status, content-length or chunked framing, keep-alive) in a few slices
per chunk. It reads only responses to requests it sent itself, from servers it chose: it
rejects what it does not understand (``WireError``) rather than guessing.

``ResponseReader.feed(data)`` returns the body bytes that piece completed, and sets ``status``,
``headers`` and ``done``; ``SSECounter.feed(body_bytes)`` splits the body into ``data:`` events
wherever the network cut it, and counts tokens, ``[DONE]`` and error events.
"""

from __future__ import annotations

__all__ = ["ResponseReader", "SSECounter", "WireError"]


class WireError(Exception):
    """The server's bytes are not an HTTP/1.1 response this reader understands."""


_HEAD_LIMIT = 64 * 1024


class ResponseReader:
    """One response's parser. ``feed`` it bytes; read ``status``/``done``/``keep_alive``.

    Bytes after the end of the response (a server must not send any unasked) are an error.
    """

    __slots__ = ("_buf", "_chunk_left", "_length", "_state", "done", "headers", "keep_alive",
                 "status")

    def __init__(self) -> None:
        self._buf = b""
        self._state = "head"  # head -> (length | size -> data -> crlf -> size ... -> trailer)
        self._length = 0
        self._chunk_left = 0
        self.status: int | None = None
        self.headers: dict[bytes, bytes] = {}
        self.keep_alive = True
        self.done = False

    def feed(self, data: bytes) -> list[bytes]:
        """Consume ``data``; return the body pieces it completed (possibly none)."""
        if self.done:
            if data:
                raise WireError("bytes after the end of the response")
            return []
        buf = self._buf + data if self._buf else data
        out: list[bytes] = []
        pos = 0
        while not self.done:
            state = self._state
            if state == "head":
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    if len(buf) - pos > _HEAD_LIMIT:
                        raise WireError("response head too long")
                    break
                self._parse_head(buf[pos:end])
                pos = end + 4
            elif state == "length":
                take = min(self._length, len(buf) - pos)
                if take:
                    out.append(buf[pos:pos + take])
                    pos += take
                    self._length -= take
                if self._length == 0:
                    self.done = True
                else:
                    break
            elif state == "size":
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                line = buf[pos:end].split(b";", 1)[0].strip()
                try:
                    self._chunk_left = int(line, 16)
                except ValueError:
                    raise WireError(f"bad chunk size {line!r}") from None
                pos = end + 2
                self._state = "data" if self._chunk_left else "trailer"
            elif state == "data":
                take = min(self._chunk_left, len(buf) - pos)
                if not take:
                    break
                out.append(buf[pos:pos + take])
                pos += take
                self._chunk_left -= take
                if self._chunk_left == 0:
                    self._state = "crlf"
            elif state == "crlf":
                if len(buf) - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise WireError("chunk not followed by CRLF")
                pos += 2
                self._state = "size"
            else:  # trailer: lines until an empty one
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                self.done = end == pos
                pos = end + 2
        rest = buf[pos:]
        if self.done and rest:
            raise WireError("bytes after the end of the response")
        self._buf = rest
        return out

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise WireError(f"bad status line {lines[0][:80]!r}")
        try:
            status = int(parts[1])
        except ValueError:
            raise WireError(f"bad status {parts[1]!r}") from None
        if 100 <= status < 200:  # an interim response: the real one follows
            return
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise WireError(f"bad header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        self.status, self.headers = status, headers
        connection = headers.get(b"connection", b"").lower()
        self.keep_alive = parts[0] == b"HTTP/1.1" and b"close" not in connection
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            self._state = "size"
        elif b"content-length" in headers:
            try:
                self._length = int(headers[b"content-length"])
            except ValueError:
                raise WireError("bad content-length") from None
            self._state = "length"
            self.done = self._length == 0
        elif status in (204, 304):
            self.done = True
        else:
            raise WireError("a body delimited by connection close is not supported")


class SSECounter:
    """Splits an SSE body into events, however the network cut it; counts what it saw.

    ``tokens`` counts ``data:`` events other than ``[DONE]`` and error events (for a chat
    stream that includes the role chunk and a usage chunk, if any).
    """

    __slots__ = ("_buf", "done", "errors", "tokens")

    def __init__(self) -> None:
        self._buf = b""
        self.tokens = 0
        self.errors = 0
        self.done = False

    def feed(self, data: bytes) -> int:
        """Consume body bytes; return how many events they completed."""
        buf = self._buf + data if self._buf else data
        start = 0
        events = 0
        while (end := buf.find(b"\n\n", start)) >= 0:
            event = buf[start:end]
            start = end + 2
            if not event.startswith(b"data:"):
                continue  # a comment or another field: not an event the bench counts
            events += 1
            payload = event[5:].lstrip()
            if payload == b"[DONE]":
                self.done = True
            elif payload.startswith(b'{"error"'):
                self.errors += 1
            else:
                self.tokens += 1
        self._buf = buf[start:]
        return events
