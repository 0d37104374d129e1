"""Serving an ASGI app in-process on Hypercorn's trio worker (tests, demo, bench).

This is the worker ``epd-trio serve`` runs (``_server.worker_serve``: Hypercorn's, with the
connection class of ``_serve/server``), started programmatically so a test or the demo owns the
server's lifetime through a nursery and learns the bound port from ``task_status`` (bind to port
0, no races on free ports). ``plain_hypercorn=True`` serves with Hypercorn's own classes instead,
as ``hypercorn --worker-class trio epd_trio.app:app`` does.
"""

from __future__ import annotations

import socket
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio.run import worker_serve as hypercorn_worker_serve
from hypercorn.utils import wrap_app

from .server import worker_serve

#: Hypercorn's own default listen backlog is 100: a burst of simultaneous connections beyond it
#: gets refused or reset. The kernel caps the value at net.core.somaxconn.
DEFAULT_BACKLOG = 4096
#: Seconds an idle keep-alive client connection is kept open.
DEFAULT_KEEP_ALIVE = 75.0


def quiet_config(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    backlog: int = DEFAULT_BACKLOG,
    keep_alive: float = DEFAULT_KEEP_ALIVE,
) -> Config:
    """A Hypercorn config for in-process serving: no access log, deep backlog."""
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    config.backlog = backlog
    config.keep_alive_timeout = keep_alive
    return config


def listening_sockets(config: Config, client_write_timeout: float | None = None) -> Sockets:
    """Bind and listen on ``config.bind``; with ``client_write_timeout``, set TCP_USER_TIMEOUT.

    TCP_USER_TIMEOUT (inherited by every accepted connection) makes the kernel abort a
    connection whose sent data stays unacknowledged, or whose receive window stays closed, for
    that long: the only way to unblock Hypercorn's shielded, timeout-less socket writes to a
    client that stopped reading. A client that reads, however slowly, keeps it alive.
    """
    sockets = config.create_sockets()
    for sock in sockets.insecure_sockets:
        if client_write_timeout is not None and hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                            int(client_write_timeout * 1000))
        sock.listen(config.backlog)
    return sockets


async def serve_app(
    app: Any,
    config: Config,
    shutdown: trio.Event | None = None,
    *,
    client_write_timeout: float | None = None,
    plain_hypercorn: bool = False,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app``; reports the base URL (``http://host:port``) once bound.

    Returns after a graceful shutdown once ``shutdown`` is set (connections drain for
    ``config.graceful_timeout``, then the app's shutdown hooks run and close its upstream
    client); without an event it serves until cancelled.
    """
    serve = hypercorn_worker_serve if plain_hypercorn else worker_serve
    trigger = shutdown.wait if shutdown is not None else None
    sockets = listening_sockets(config, client_write_timeout)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(
            serve, wrap_app(app, config.wsgi_max_body_size, None), config,
            sockets=sockets, shutdown_trigger=trigger))
        task_status.started(binds[0])
