"""The proxy's exception tree; each exception knows the HTTP status and OpenAI error it becomes.

    ProxyError                 status, OpenAI ``type``; rendered by one handler in the app
    +-- BadRequest             the client's input is wrong (4xx, never retried)
    |   +-- MalformedHTTP      not HTTP at all: refused by the server before any route (400)
    +-- HeadersTooLarge        the request head is over the server's limit (431)
    +-- Unauthorized           missing or wrong API key (401)
    |   +-- AdminUnauthorized  missing or wrong ``X-API-Key`` on an admin route (401)
    +-- AdminDisabled          an admin route while no admin key is configured (403)
    +-- BodyTooLarge           the request body is over ``EPD_MAX_BODY_BYTES`` (413)
    +-- Conflict               a registration contradicts the roster (409)
    +-- RosterFull             the shared roster area has no room for a change (503)
    +-- NoInstance             no instance of a needed role is configured or registered (503)
    |   +-- ModelUnavailable   a model's pool has no live instance of a stage (503, Retry-After)
    |       +-- AdapterUnavailable  no live instance of a stage holds the LoRA adapter (503)
    |           +-- AdapterLoadFailed  loading it on demand failed at an instance (503)
    +-- ModelNotFound          no pool, alias or any-name instance serves the name (vLLM's 404)
    +-- ProxyOverloaded        no free upstream connection in time (503, the proxy's own limit)
    |   +-- AtCapacity         too many client requests in flight (503 with Retry-After)
    +-- RateLimited            a tenant over one of its own limits (429 with Retry-After)
    +-- UpstreamError          a stage failed: names ``stage`` and ``instance``
        +-- UpstreamStatusError    the instance answered non-2xx (relays a 4xx body as is)
        +-- UpstreamTransportError connect/read failure (502)
        +-- EncoderHandoffError    an encoder's ec_transfer_params match no item (502)
        +-- UpstreamTimeout        a deadline expired (504)

Like h11's ``error_status_hint``, the status travels with the exception so the route code never
maps errors itself, and nothing here does I/O: ``error_reply`` is the one function that turns
any exception into what the client gets (status, headers, body), and ``sse_error_event`` the
frame that ends a stream broken after its first byte.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

#: A message that opens with a quoted field name (``'model' is required``) names its ``param``.
_LEADING_FIELD = re.compile(r"'([A-Za-z_][\w.\[\]]*)'")


def error_payload(
    message: str, *, type: str, code: int | str, param: str | None = None, **extra: Any
) -> dict[str, Any]:
    """The OpenAI error shape ``{"error": {"message", "type", "param", "code", ...}}``.

    ``code`` is the HTTP status, as vLLM's own server does; ``param`` names the request field at
    fault, so a client (the OpenAI SDK shows it) need not parse the message; ``extra`` adds
    machine-readable fields (``stage``, ``instance``) for upstream failures.
    """
    return {"error": {"message": message, "type": type, "param": param, "code": code, **extra}}


class ProxyError(Exception):
    """Base: something the client must be told, with a status and an OpenAI error type."""

    status: int = 500
    type: str = "internal_error"
    #: The OpenAI ``code``; None: the HTTP status, as vLLM answers.
    code: str | None = None
    #: Extra response headers.
    headers: dict[str, str] = {}  # noqa: RUF012 (never mutated)
    #: The request field at fault (OpenAI's ``param``), if one is.
    param: str | None = None

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        if param is not None:
            self.param = param

    def payload(self) -> dict[str, Any]:
        return error_payload(self.message, type=self.type, param=self.param,
                             code=self.status if self.code is None else self.code)

    def body(self) -> bytes:
        return orjson.dumps(self.payload())


class BadRequest(ProxyError):
    """The client sent something the proxy cannot forward (malformed JSON, wrong field types).

    Without an explicit ``param``, a message that opens with a quoted field name (``'model' is
    required``, as every field check here words it) names that field: one wording rule instead
    of each raise repeating the name.
    """

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 param: str | None = None) -> None:
        if param is None and (match := _LEADING_FIELD.match(message)):
            param = match.group(1)
        super().__init__(message, status=status, type=type, param=param)


class MalformedHTTP(BadRequest):
    """Bytes the HTTP server could not parse as a request (h11's ``RemoteProtocolError``):
    answered by the server itself, before any route, and the connection is closed."""

    def __init__(self) -> None:
        super().__init__("the request is not valid HTTP/1.1 (a malformed request line, header "
                         "or body framing)")


class HeadersTooLarge(ProxyError):
    """The request line and headers exceed what the server buffers (Hypercorn's
    ``h11_max_incomplete_size``): refused before any route, and the connection is closed."""

    status = 431
    type = "invalid_request_error"

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request line and headers are larger than the limit of {limit} "
                         "bytes")


class Unauthorized(ProxyError):
    """Missing or wrong key; shaped like OpenAI's own answer to a bad API key."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    headers = {"www-authenticate": "Bearer"}  # noqa: RUF012


class AdminUnauthorized(Unauthorized):
    """Missing or wrong ``X-API-Key`` on an admin route."""

    code = "invalid_admin_key"
    headers = {}  # noqa: RUF012


class AdminDisabled(ProxyError):
    """An admin route was called but no admin key is configured: the routes are off."""

    status = 403
    type = "permission_error"
    code = "admin_disabled"


class BodyTooLarge(ProxyError):
    """The request body is larger than the proxy accepts (checked before it is read whole)."""

    status = 413
    type = "invalid_request_error"
    #: Refused before the body is read whole (or at all, when its declared length is over):
    #: the rest may still come, so the connection cannot carry another request.
    headers = {"connection": "close"}  # noqa: RUF012 (never mutated)

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body is larger than the limit of {limit} bytes")


class MethodNotAllowed(ProxyError):
    """A completion route called with another method than POST."""

    status = 405
    type = "invalid_request_error"
    headers = {"allow": "POST"}  # noqa: RUF012 (never mutated)

    def __init__(self, method: str) -> None:
        super().__init__(f"method {method} is not allowed here; use POST")


class ShuttingDown(ProxyError):
    """The proxy is shutting down: a new request refused while it drains, or one still in
    flight when its grace period (``EPD_SHUTDOWN_GRACE``) ended (a stream gets it as its last
    SSE event)."""

    status = 503
    type = "service_unavailable"
    code = "shutting_down"
    #: The process is about to exit: the client should not send another request here.
    headers = {"connection": "close"}  # noqa: RUF012 (never mutated)


class BodyTimeout(ProxyError):
    """The client did not send its whole body within ``EPD_BODY_TIMEOUT``."""

    status = 408
    type = "invalid_request_error"
    #: The rest of the body may still come: the connection cannot carry another request.
    headers = {"connection": "close"}  # noqa: RUF012 (never mutated)

    def __init__(self, limit: float) -> None:
        super().__init__(f"request body not received within {limit:g} s")


class Conflict(ProxyError):
    """A registration contradicts what is known (an instance changing its role)."""

    status = 409
    type = "conflict_error"


class RosterFull(ProxyError):
    """A roster change would not fit the shared-memory area of ``epd-trio serve --workers N``."""

    status = 503
    type = "roster_full"


class NoInstance(ProxyError):
    """No instance serves a role the request needs (none configured, none registered yet)."""

    status = 503
    type = "service_unavailable"
    code = "no_instance"


class ModelUnavailable(NoInstance):
    """A known model whose pool has no live instance of a stage the request needs: the model
    exists and will come back, so the client is told when to retry."""

    code = "model_unavailable"
    headers = {"retry-after": "1"}  # noqa: RUF012 (never mutated)

    def __init__(self, model: str, stage: str, *, what: str = "model") -> None:
        super().__init__(f"{what} {model!r} has no live {stage} instance in its pool")
        self.model, self.stage = model, stage


class AdapterUnavailable(ModelUnavailable):
    """A LoRA adapter no live instance of a stage it needs holds in its base model's pool
    (and the proxy may not load it there): a request needs it on prefill and decode both."""

    code = "adapter_unavailable"

    def __init__(self, adapter: str, model: str, stage: str) -> None:
        NoInstance.__init__(self, f"adapter {adapter!r} of model {model!r} is held by no live "
                            f"{stage} instance")
        self.model, self.stage = adapter, stage


class AdapterLoadFailed(AdapterUnavailable):
    """Loading a LoRA adapter on demand failed at an instance: vLLM's own message and the
    instance's URL (that instance is not asked again for it for a health interval)."""

    code = "adapter_load_failed"

    def __init__(self, adapter: str, stage: str, instance: str, why: str) -> None:
        NoInstance.__init__(self, f"loading adapter {adapter!r} at {stage} instance {instance} "
                            f"failed: {why}")
        self.model, self.stage, self.instance = adapter, stage, instance


class ModelNotFound(ProxyError):
    """No pool, alias or any-name instance serves the name: vLLM's own 404, word for word, so
    a client sees what it sees from one vLLM server. A name a tenant may not use gets the
    same answer (OpenAI's "does not exist or you do not have access to it"), and the message
    never lists the names served (vLLM's does: a tenant must not learn what it may not use)."""

    status = 404
    type = "NotFoundError"
    param = "model"

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.")


class ProxyOverloaded(ProxyError):
    """The proxy's own upstream connection pool had no free connection in time.

    Not the instance's fault: not retried elsewhere and not counted against its health.
    """

    status = 503
    type = "proxy_overloaded"


class AtCapacity(ProxyOverloaded):
    """The proxy already serves ``EPD_MAX_INFLIGHT`` client requests and no place freed within
    ``EPD_ADMISSION_TIMEOUT``: blamed on nobody, so the client is told when to come back."""

    code = "proxy_at_capacity"
    headers = {"retry-after": "1"}  # noqa: RUF012 (never mutated)


class RateLimited(ProxyError):
    """A tenant is over one of its own limits (``max_inflight``, ``requests_per_minute``,
    ``tokens_per_minute``): a 429 shaped like OpenAI's, the limit named by its setting's name
    in ``param``, and ``Retry-After`` computed from the limit's bucket."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, tenant: str, limit: str, value: int, retry_after: int) -> None:
        super().__init__(f"tenant {tenant!r} is over its {limit} ({value}); retry after "
                         f"{retry_after} s")
        self.limit = limit
        self.headers = {"retry-after": str(retry_after)}

    def payload(self) -> dict[str, Any]:
        payload = super().payload()
        payload["error"]["param"] = self.limit
        return payload


class UpstreamError(ProxyError):
    """A stage (``encode`` / ``prefill`` / ``decode``) failed at one instance."""

    status = 502
    type = "upstream_error"
    #: The instance itself looks down (refused/reset/unreachable): counts as a failed probe.
    instance_failure: bool = False
    #: The instance is down for sure (nothing listens: its connection was refused): out of
    #: the rotation at once, without waiting for ``health_threshold`` failures.
    instance_down: bool = False

    def __init__(
        self, message: str, *, stage: str, instance: str, status: int | None = None
    ) -> None:
        super().__init__(f"{stage} stage failed at {instance}: {message}", status=status)
        self.stage = stage
        self.instance = instance

    def payload(self) -> dict[str, Any]:
        return error_payload(
            self.message, type=self.type, code=self.status, stage=self.stage,
            instance=self.instance,
        )


class UpstreamStatusError(UpstreamError):
    """The instance answered with a non-2xx status.

    A 4xx means the client's request was bad (e.g. vLLM rejects a too-long prompt): it is relayed
    with the upstream status, and for prefill/decode with the upstream body unchanged, since those
    legs carry the client's own body. A 5xx becomes a 502 naming the stage.
    """

    def __init__(
        self, *, stage: str, instance: str, upstream_status: int, upstream_body: bytes,
        detail: str = "",
    ) -> None:
        self.upstream_status = upstream_status
        self.upstream_body = upstream_body
        # 401/403 from vLLM refuse the *proxy's* credentials (its --api-key), not the client's:
        # relaying them would tell the client its own key is wrong. A 502 that says so instead.
        refused_proxy = upstream_status in (401, 403)
        is_client_error = 400 <= upstream_status < 500 and not refused_proxy
        snippet = upstream_message(upstream_body)
        hint = (" (the instance refused the proxy's credentials: check EPD_UPSTREAM_API_KEY)"
                if refused_proxy else "")
        super().__init__(
            f"{detail}HTTP {upstream_status}" + (f": {snippet}" if snippet else "") + hint,
            stage=stage, instance=instance,
            status=upstream_status if is_client_error else 502,
        )
        if is_client_error:
            self.type = "invalid_request_error"

    @property
    def relays_body(self) -> bool:
        """True when the upstream body itself should reach the client (a prefill/decode 4xx)."""
        return self.status < 500 and self.stage != "encode" and _is_error_json(self.upstream_body)

    def body(self) -> bytes:
        return self.upstream_body if self.relays_body else super().body()


class UpstreamTransportError(UpstreamError):
    """Connecting to, writing to or reading from the instance failed."""

    status = 502
    instance_failure = True


class UpstreamRefused(UpstreamTransportError):
    """The instance refused the connection: nothing listens on its port. A vLLM whose engine
    died answers what it had in flight with a 500 ("EngineCore encountered an issue"), then
    exits (issue 30), so the first refusal evicts it rather than the third."""

    instance_down = True


class EncoderHandoffError(UpstreamError):
    """The encoder's ``ec_transfer_params`` cannot be matched to the items it encoded (an index
    out of range, repeated, or an item no entry names): the consumer would look up the wrong
    cache entries, so the request fails (502) naming the ``encode`` stage and the encoder."""

    def __init__(self, message: str, *, instance: str) -> None:
        super().__init__(message, stage="encode", instance=instance)


class UpstreamTimeout(UpstreamError):
    """A stage deadline expired before the instance answered (``connect``: it never accepted)."""

    status = 504
    type = "upstream_timeout"

    def __init__(self, message: str, *, stage: str, instance: str, connect: bool = False) -> None:
        super().__init__(message, stage=stage, instance=instance)
        self.instance_failure = connect


def upstream_message(body: bytes, limit: int = 300) -> str:
    """A short human-readable reason from an upstream error body (vLLM's JSON or plain text)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:limit].decode("utf-8", "replace").strip()
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"][:limit]
        if isinstance(parsed.get("message"), str):
            return parsed["message"][:limit]
        if isinstance(parsed.get("detail"), str):
            return parsed["detail"][:limit]
    return body[:limit].decode("utf-8", "replace").strip()


def _is_error_json(body: bytes) -> bool:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    # vLLM's own errors ({"error": ...}), and FastAPI's, which vLLM answers for a route it
    # does not have ({"detail": "Not Found"}: a model without the task).
    return isinstance(parsed, dict) and (isinstance(parsed.get("error"), dict | str)
                                         or isinstance(parsed.get("detail"), str | list))


class MalformedRegistration(ValueError):
    """A MoRIIO registration frame the proxy cannot use (bad msgpack, a missing or wrong field).

    Not a ``ProxyError``: no client is told. The ZMQ listener logs it and drops the frame, and
    goes on listening.
    """


class RegistrationRefused(ValueError):
    """A well-formed MoRIIO registration the roster refuses (the other transfer mode, a role
    change, a roster that is full): logged, and the instance gets no traffic."""


#: What a client is told about an error that is not a ``ProxyError`` (a bug): nothing more.
INTERNAL_ERROR = ProxyError("internal proxy error")


def error_reply(exc: BaseException) -> tuple[int, dict[str, str], bytes]:
    """Every failure the client is told about, as (status, headers, OpenAI error body).

    A ``ProxyError`` carries its own status and body; anything else is a 500 with a generic
    message (the traceback goes to the log, never to the client).
    """
    error = exc if isinstance(exc, ProxyError) else INTERNAL_ERROR
    return error.status, {"content-type": "application/json", **error.headers}, error.body()


def sse_error_event(error: ProxyError) -> bytes:
    """The frame that ends a stream which broke after its first byte (no silent truncation)."""
    return b"data: " + orjson.dumps(error.payload()) + b"\n\n"
