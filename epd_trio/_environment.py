"""Where settings come from: the config file, the environment and the command line (the I/O).

The rules (which source wins, how each value is parsed, what is refused) are pure and live in
``_core/config.py``; this module only reads the file and ``os.environ`` and hands them over.
"""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Mapping
from typing import Any

from ._core.config import ENV_PREFIX, ConfigError, Settings, settings_from, unknown_settings

log = logging.getLogger("epd_trio")


def load_settings(
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    config_path: str | None = None,
) -> Settings:
    """Read the config file (``config_path``, else ``EPD_CONFIG``), the environment and flags.

    Raises ``ConfigError`` (one line naming the variable or flag) on any problem.
    """
    environ = os.environ if environ is None else environ
    path = config_path or environ.get(ENV_PREFIX + "CONFIG", "").strip()
    file_values: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as f:
                file_values = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(ENV_PREFIX + "CONFIG", f"cannot read {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(ENV_PREFIX + "CONFIG", f"{path} is not valid TOML: {exc}") from None
    settings = settings_from(environ, file_values, flags)
    for name, close in unknown_settings(environ):
        hint = f"; did you mean {close}?" if close else ""
        log.warning("unknown setting %s is ignored%s (epd-trio serve --help lists them all)",
                    name, hint)
    return settings
