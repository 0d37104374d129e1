"""What the proxy says about one request in its logs: the request line and its warnings.

The content comes from the request's ``RequestTrace`` (``_core/trace.py``, plain data); this
module only decides the logger, the level and the words. ``epd_trio.requests`` gets one INFO
line per request when ``EPD_REQUEST_LOG`` is on; ``epd_trio`` gets the operational warnings
(a failover, a request that failed upstream, a stream that broke), each carrying the request id
so an operator can join them to the request line.
"""

from __future__ import annotations

import logging

from .._core.errors import UpstreamError
from .._core.routing import Instance
from .._core.trace import RequestTrace, request_fields, text_value

log = logging.getLogger("epd_trio")
request_log = logging.getLogger("epd_trio.requests")


def log_request(trace: RequestTrace, finished: float) -> None:
    """The request line (``finished``: ``perf_counter()`` when the request ended)."""
    if not request_log.isEnabledFor(logging.INFO):
        return
    fields = request_fields(trace, finished)
    request_log.info("%s %s %s %d in %.1f ms", text_value(trace.request_id), trace.endpoint,
                     fields["outcome"], trace.status, fields["duration_s"] * 1000,
                     extra={"fields": fields})


def _fields(trace: RequestTrace, error: UpstreamError) -> dict[str, object]:
    return {"fields": {"request_id": trace.request_id, "stage": error.stage,
                       "instance": error.instance}}


def log_upstream_failure(trace: RequestTrace, error: UpstreamError) -> None:
    """The request failed before its first byte because a stage failed."""
    log.warning("request %s failed: %s", text_value(trace.request_id), error.message,
                extra=_fields(trace, error))


def log_stream_failure(trace: RequestTrace, error: UpstreamError) -> None:
    log.warning("request %s: stream broke after its first byte: %s",
                text_value(trace.request_id),
                error.message, extra=_fields(trace, error))


def log_retry(trace: RequestTrace, stage: str, instance: Instance, error: UpstreamError) -> None:
    """``stage`` failed at ``error.instance`` (``instance`` is the attempt's slot: the decode
    instance of a MoRIIO WRITE attempt whose prefill failed)."""
    failed = error.instance or instance.url
    log.warning("retrying %s after failure at %s: %s", stage, failed, error.message,
                extra={"fields": {"request_id": trace.request_id, "stage": stage,
                                  "instance": failed}})
