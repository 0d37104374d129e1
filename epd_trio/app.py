"""The served app: ``hypercorn --worker-class trio epd_trio.app:app``.

Configuration is read from the environment (and ``EPD_CONFIG``) when this module is imported, so a
missing or malformed setting stops the server before it binds, with one line naming the variable
instead of a traceback. Code that builds its own settings should call ``create_app`` instead of
importing this module.
"""

from __future__ import annotations

import os
import sys

from ._app import create_app
from ._core.config import ConfigError
from ._environment import load_settings
from ._observe.tracing import create_tracing
from ._serve.process import setup_serving_process

try:
    settings = load_settings()
    tracing = create_tracing(os.environ)
    setup_serving_process(settings)
    # Refuses what only building the app reads, such as a rediss:// URL's TLS files.
    app = create_app(settings, tracing=tracing)
except ConfigError as exc:
    print(f"epd_trio: configuration error: {exc}", file=sys.stderr)
    raise SystemExit(2) from None
