"""Loopback ports for servers that a test starts, and may stop and start again on the same port.

Why not ``bind(port 0)``: the kernel hands that out from its ephemeral range, the range it also
gives every outgoing connection's local port. A server stopped for a restart leaves its port
free, and any connection opened meanwhile (a test's client, a vLLM engine's ZMQ socket) may take
it; the restart then fails with "Address already in use". That happened in CI to a vLLM prefill's
NIXL side channel. Ports below the ephemeral range are never handed out that way, so only another
listener could take them, and a listener is seen by the check made when they are picked.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Where Linux keeps its ephemeral range ("32768\t60999" by default).
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Below this, ports belong to well-known and registered services more often than not.
LOWEST = 20000
#: The fewest candidate ports worth choosing from; with fewer, the kernel's port 0 is used.
FEWEST = 2000
#: Ports tried before giving up (a machine whose candidates are nearly all taken).
TRIES = 10_000


def ephemeral_range(path: Path = EPHEMERAL_RANGE) -> tuple[int, int]:
    """The kernel's ephemeral range; Linux's default where it cannot be read."""
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def candidates(ephemeral: tuple[int, int]) -> range | None:
    """Ports to pick listening ports from: those between ``LOWEST`` and the ephemeral range, or
    above it up to 65535, whichever is larger; None when neither is worth it (a range widened to
    cover nearly everything)."""
    low, high = ephemeral
    below = range(LOWEST, low)
    above = range(high + 1, 65536)
    best = max(below, above, key=len)
    return best if len(best) >= FEWEST else None


def _bound(port: int, host: str, udp: bool) -> list[socket.socket]:
    """Sockets holding ``port`` (TCP, and UDP too if asked); empty when it is taken.

    No ``SO_REUSEADDR``: a port with a connection in TIME_WAIT is refused here too, so what is
    picked is free for any server, whatever options it binds with."""
    held: list[socket.socket] = []
    kinds = (socket.SOCK_STREAM, socket.SOCK_DGRAM) if udp else (socket.SOCK_STREAM,)
    try:
        for kind in kinds:
            sock = socket.socket(socket.AF_INET, kind)
            held.append(sock)
            sock.bind((host, port))
            port = sock.getsockname()[1]  # port 0: the others take the one the kernel gave
    except OSError:
        for sock in held:
            sock.close()
        return []
    return held


def free_ports(count: int, host: str = "127.0.0.1", *, udp: bool = False,
               rng: random.Random | None = None) -> list[int]:
    """``count`` distinct ports nobody listens on now, outside the ephemeral range (see the
    module's docstring). Each is held until all are picked. ``udp``: free for UDP as well.

    A server started afterwards may still lose its port to another listener in between; the
    callers' start retries cover that rare case, as they did with port 0.
    """
    pool = candidates(ephemeral_range())
    rng = rng or random.Random()
    held: list[socket.socket] = []
    ports: list[int] = []
    tries = 0
    try:
        while len(ports) < count:
            if tries == TRIES:
                raise OSError(f"no {count} free ports found in {TRIES} tries")
            tries += 1
            port = rng.choice(pool) if pool is not None else 0
            sockets = _bound(port, host, udp)
            if sockets:
                held += sockets
                ports.append(sockets[0].getsockname()[1])
        return ports
    finally:
        for sock in held:
            sock.close()


def free_port(host: str = "127.0.0.1", *, udp: bool = False) -> int:
    """One port as ``free_ports`` picks them."""
    return free_ports(1, host, udp=udp)[0]
