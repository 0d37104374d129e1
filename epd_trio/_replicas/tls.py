"""The TLS context of a ``rediss://`` state URL: one per link, shared by coredis and the cursor.

Why one context built here: coredis, given only ``ssl=True``, verifies the server's chain but
not its host name (its default), while the cursor's lean link used Python's defaults (chain and
host name). Both connections now use the same context: the system's certificate authorities or
the URL's ``ssl_ca_certs``, the host name checked, and a client certificate when the URL gives
one. It is built when the app is made (``StateLink``), and ``epd-trio serve`` builds it once
more before any worker starts, so a path that cannot be read or a file that is not PEM stops
the proxy with one line naming ``EPD_STATE_URL`` and the parameter (once, not once per worker;
plain ``hypercorn`` says it as ``epd_trio.app`` is imported), not a handshake failure retried
forever.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable

from .._core.config import ConfigError, env_name
from .._core.state_url import StateURL


def tls_context(url: StateURL) -> ssl.SSLContext | None:
    """The context for ``url`` (None unless it is ``rediss://``); ``ConfigError`` when a file
    it names cannot be used."""
    if not url.tls:
        return None
    context = ssl.create_default_context()
    if url.ca_certs is not None:
        where = {"capath" if os.path.isdir(url.ca_certs) else "cafile": url.ca_certs}
        _load("ssl_ca_certs", url.ca_certs, lambda: context.load_verify_locations(**where))
    if url.certfile is not None and url.keyfile is not None:
        certfile, keyfile = url.certfile, url.keyfile
        _load("ssl_certfile", certfile,
              lambda: context.load_cert_chain(certfile=certfile, keyfile=keyfile))
    return context


def _load(parameter: str, path: str, load: Callable[[], object]) -> None:
    try:
        load()
    except OSError as exc:  # unreadable; or an ssl.SSLError: not PEM, a key that does not fit
        ssl_reason = exc.reason if isinstance(exc, ssl.SSLError) else None
        reason = ssl_reason or exc.strerror or str(exc)
        raise ConfigError(env_name("state_url"),
                          f"{parameter}: cannot use {path}: {reason}") from None
