"""A replica's name in the shared state store when ``EPD_REPLICA_ID`` is unset.

It lives here, not with the process set-up, because the owner needs it to build its state link
and must not import the process layer.
"""

from __future__ import annotations

import os
import socket


def default_replica_id() -> str:
    """The host name and the process id: unique per process and readable in ``GET /instances``.
    (The workers of ``epd-trio serve --workers N`` get this name of their parent, each with its
    worker suffix: ``_core.shared_state.worker_replica_id``.)"""
    return f"{socket.gethostname()}-{os.getpid()}"
