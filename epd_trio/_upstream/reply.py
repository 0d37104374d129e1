"""What a client request's path hands the web layer: a status, headers, and bytes or a stream.

Its own module because both the pipeline (which builds it) and the hand-offs (each attempt's
strategy returns one) name it, and the hand-offs must not import the pipeline that imports them;
in ``_upstream`` because what it carries is an instance's answer and the relay of its stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from .legs import StreamRelay


@dataclass(slots=True)
class Reply:
    """What the web layer sends back: a status, headers, and either bytes or a relayed stream
    (``stream.pump(send)`` sends it and closes it)."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    stream: StreamRelay | None = None
