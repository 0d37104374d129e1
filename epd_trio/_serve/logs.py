"""The proxy's log output: level, and text or JSON lines (``EPD_LOG_LEVEL``, ``EPD_LOG_FORMAT``).

Loggers: ``epd_trio`` carries the operational warnings (an instance left or rejoined the rotation,
a failover, a request that failed upstream, a stream that broke, a stalled client);
``epd_trio.requests`` carries one INFO line per request, only when ``EPD_REQUEST_LOG`` is on
(``_request_log.log_request``). A record may carry structured ``fields`` (``extra={"fields":
{...}}``): the JSON format puts them at the top level of the object, the text format appends
them as ``key=value``.

``configure_logging`` gives the ``epd_trio`` logger its own stderr handler; the entry points call
it (``epd-trio serve``, ``epd_trio.app``), ``create_app`` does not, so a service embedding the app
keeps its own logging setup. It leaves the root logger and other libraries' loggers alone (httpx
logs every request at INFO, which the proxy must not turn on).
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import IO, Any

import orjson

from .._core.trace import text_value

#: The attribute marking the handler installed here (so reconfiguring replaces it).
_MARK = "_epd_trio_handler"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time``, ``level``, ``logger``, ``message``, then the fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _fields(record).items():
            out.setdefault(key, value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message key=value ...`` (nested values as compact JSON)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        # One event, one line: a message may quote an upstream's error text, and a newline in
        # it must not start what looks like another log line (tracebacks are added after this).
        line = super().formatMessage(record).replace("\r", "\\r").replace("\n", "\\n")
        extra = " ".join(f"{key}={text_value(value)}" for key, value in _fields(record).items())
        return f"{line} {extra}" if extra else line


def configure_logging(
    level: str = "INFO", fmt: str = "text", stream: IO[str] | None = None
) -> logging.Handler:
    """Send the ``epd_trio`` loggers' records at ``level`` and above to ``stream`` (stderr).

    Idempotent: a second call replaces the handler of the first. The records do not propagate
    to the root logger, so an application that also logs to the root sees them once.
    """
    logger = logging.getLogger("epd_trio")
    for handler in list(logger.handlers):
        if getattr(handler, _MARK, False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    setattr(handler, _MARK, True)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return handler
