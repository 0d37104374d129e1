"""The proxy's log output: level, and text or JSON lines (``EPD_LOG_LEVEL``, ``EPD_LOG_FORMAT``).

Loggers: ``epd_trio`` carries the operational warnings (an instance left or rejoined the rotation,
a failover, a request that failed upstream, a stream that broke, a stalled client);
``epd_trio.requests`` carries one INFO line per request, only when ``EPD_REQUEST_LOG`` is on
(``_request_log.log_request``). A record may carry structured ``fields`` (``extra={"fields":
{...}}``): the JSON format puts them at the top level of the object, the text format appends
them as ``key=value``.

``configure_logging`` gives the ``epd_trio`` logger its own stderr handler; the entry points call
it (``epd-trio serve``, ``epd_trio.app``), ``create_app`` does not, so a service embedding the app
keeps its own logging setup. It leaves other libraries' loggers at their level (httpx logs every
request at INFO, which the proxy must not turn on).

``epd-trio serve`` owns its process, so there every line the process writes is one of these
records, in one format, on one stream (``capture_process_output``): Hypercorn's own lines
(``epd_trio.server``: its start line, an application error with its traceback), the access log
(``epd_trio.access``, ``--access-log``: one line per request, with its fields), the serve
command's lifecycle lines (``epd_trio.serve``: listening, signals, shutdown), other libraries'
warnings (the root logger) and an uncaught exception's traceback (``sys.excepthook``).
"""

from __future__ import annotations

import logging
import sys
import threading
from datetime import UTC, datetime
from types import TracebackType
from typing import IO, Any

import orjson
from hypercorn.logging import Logger as HypercornLogger

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


#: Hypercorn's own lines (``config.errorlog``), the access log (``config.accesslog``) and the
#: serve command's lifecycle lines: children of ``epd_trio``, so they share its handler.
SERVER_LOGGER = "epd_trio.server"
ACCESS_LOGGER = "epd_trio.access"
SERVE_LOGGER = "epd_trio.serve"


class AccessLogger(HypercornLogger):
    """Hypercorn's logger (``config.logger_class``) with an access line made of fields.

    Hypercorn's access line is one preformatted string (its common-log format); as a record of
    ``epd_trio.access`` it takes the process's format, and its fields (client, method, path,
    status, bytes, duration, request id) are fields, so the JSON format needs no parsing of it.
    A request whose stream closed before its response ended (the client left) has no status.
    """

    async def access(self, request: Any, response: Any, request_time: float) -> None:
        if self.access_logger is None:
            return
        headers = dict(response.get("headers", ())) if response is not None else {}
        status = response["status"] if response is not None else None
        query = request.get("query_string", b"").decode("latin1")
        path = request["path"] + (f"?{query}" if query else "")
        method = request.get("method", "GET")
        client = request.get("client")
        user_agent = next((v.decode("latin1") for k, v in request["headers"]
                           if k.lower() == b"user-agent"), None)
        length = headers.get(b"content-length")
        request_id = headers.get(b"x-request-id")
        fields = {
            "client": f"{client[0]}:{client[1]}" if client and len(client) == 2 else client,
            "method": method, "path": path, "http_version": request.get("http_version"),
            "status": status, "bytes": int(length) if length and length.isdigit() else None,
            "duration_s": round(request_time, 6), "user_agent": user_agent,
            "request_id": request_id.decode("latin1") if request_id else None,
        }
        self.access_logger.info(
            "%s %s %s", method, text_value(path),
            status if status is not None else "- (the client left before the response ended)",
            extra={"fields": {k: v for k, v in fields.items() if v is not None}})


def capture_process_output(level: str) -> None:
    """Send everything else this process would write to stderr through the ``epd_trio`` handler.

    Only for a process this package owns (``epd-trio serve``): other libraries' records at
    WARNING and above (the root logger, which would otherwise print them bare), the warnings
    module's warnings, an uncaught
    exception in the main thread or any other thread, and the serve command's own lifecycle
    lines, which are written whatever ``level`` says (an operator always sees "listening on").
    """
    ours = logging.getLogger("epd_trio")
    handler = next(h for h in ours.handlers if getattr(h, _MARK, False))
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, _MARK, False):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(logging.WARNING, logging.getLevelName(level.upper())))
    logging.captureWarnings(True)  # the warnings module's lines: records of py.warnings
    logging.getLogger(SERVE_LOGGER).setLevel(logging.INFO)
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO)  # asked for by --access-log
    crashed = logging.getLogger(SERVER_LOGGER)

    def excepthook(kind: type[BaseException], value: BaseException,
                   tb: TracebackType | None) -> None:
        crashed.critical("uncaught %s: %s", kind.__name__, value, exc_info=(kind, value, tb))

    def thread_excepthook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        crashed.critical("uncaught %s in thread %s: %s", args.exc_type.__name__, name,
                         args.exc_value,
                         exc_info=(args.exc_type, args.exc_value or args.exc_type(),
                                   args.exc_traceback))

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
