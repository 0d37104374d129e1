"""Serving an ASGI app in-process on Hypercorn's trio worker (tests, demo, bench).

``hypercorn --worker-class trio epd_trio.app:app`` is the production path; this is the same
worker started programmatically so a test or the demo owns the server's lifetime through a
nursery and learns the bound port from ``task_status`` (bind to port 0, no races on free ports).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

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


async def serve_app(
    app: Any,
    config: Config,
    shutdown: trio.Event | None = None,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app``; reports the base URL (``http://host:port``) once bound.

    Returns after a graceful shutdown once ``shutdown`` is set (connections drain for
    ``config.graceful_timeout``, then the app's shutdown hooks run and close its upstream
    client); without an event it serves until cancelled.
    """
    trigger = shutdown.wait if shutdown is not None else None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, config, shutdown_trigger=trigger))
        task_status.started(binds[0])
