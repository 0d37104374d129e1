"""The quart-trio routes: parse -> ``Proxy`` -> reply. Thin on purpose; the pipeline is in ``_pipeline``.

Every failure the client can see is rendered by ``_core.errors.error_reply``, as an OpenAI-style
JSON error (``{"error": {"message", "type", "code"}}``), here and in the completion endpoints: a
``ProxyError`` carries its own status, a Werkzeug ``HTTPException`` (404, 405, 413) keeps its
status, and anything unexpected is a 500 with a generic message (the traceback goes to the log,
never to the client).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import trio
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from ._admission.fair import FairAdmission
from ._admission.gate import Admission
from ._core.auth import AdminKey, ClientKeys, bearer_token
from ._core.config import Settings
from ._core.errors import INTERNAL_ERROR, BodyTooLarge, ProxyError, error_reply
from ._core.rewrite import json_object, new_request_id
from ._core.tenants import TenantTable
from ._observe.tracing import Tracing, create_tracing
from ._proxy import Proxy
from ._replicas.limits import SharedLimits
from ._state.roster_store import SharedRoutingState
from ._state.tasks import named
from ._web.asgi import ProxyASGI
from ._web.drain import Drain
from ._web.endpoints import CompletionEndpoints

log = logging.getLogger("epd_trio")

_OPENAI_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


def _routing_message(status: int, method: str, path: str, exc: HTTPException) -> str | None:
    """404 and 405 in the words of OpenAI's own API ("Invalid URL (GET /v1/nope)"), not
    Werkzeug's prose for a browser ("If you entered the URL manually..."); None for any other
    status, whose own description is kept."""
    if status == 404:
        return f"Invalid URL ({method} {path})"
    if isinstance(exc, MethodNotAllowed):
        allowed = ", ".join(exc.valid_methods or ())
        return f"method {method} is not allowed on {path}" + (
            f" (allowed: {allowed})" if allowed else "")
    return None


def _json(status: int, payload: object, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status=status, headers=headers,
                    content_type="application/json")


def _error(exc: BaseException) -> Response:
    status, headers, body = error_reply(exc)
    return Response(body, status=status, headers=headers)


@dataclass(frozen=True, slots=True)
class _AdmissionWiring:
    """The admission gate of one app, and what it needs running: a plain cap without tenants,
    else the fair gate with its limits in Redis (``EPD_STATE_URL``), in the workers' shared
    memory (``--workers N``), or in this process."""

    admission: Admission | FairAdmission
    #: The tenants' buckets and place leases in Redis, with ``EPD_STATE_URL``.
    shared_limits: SharedLimits | None
    #: Whether some tenant has a ``max_inflight``: only then are places leased in Redis.
    leases_places: bool

    @classmethod
    def build(cls, settings: Settings, tenants: TenantTable, proxy: Proxy,
              shared: SharedRoutingState | None) -> _AdmissionWiring:
        if not settings.tenants and settings.tenant_header is None:
            return cls(Admission(settings.max_inflight, settings.admission_timeout), None, False)
        limits = (None if proxy.state is None else
                  SharedLimits(proxy.state, proxy.metrics, timeout=settings.state_limits_timeout))
        fair = FairAdmission(
            max_inflight=settings.max_inflight, timeout=settings.admission_timeout,
            table=tenants, aging=settings.priority_aging, tenant_header=settings.tenant_header,
            shared=(limits if limits is not None else None if shared is None else shared.buckets),
            places=shared.places if shared is not None and proxy.state is None else None,
            leases=limits, observer=proxy.metrics, headroom=settings.priority_headroom)
        if proxy.state is not None:
            proxy.state.tenant_inflight = fair.per_tenant  # published with its loads
            proxy.state.on_loads = fair.refresh  # the others' counts may free a tenant
        return cls(fair, limits, any(t.max_inflight for t in settings.tenants))

    async def start(self, nursery: trio.Nursery) -> list[trio.CancelScope]:
        """Start the gate's tasks in ``nursery``; the scopes to cancel before the proxy
        closes (the lease keeper renews until the proxy's task nursery ends, so leases stay
        held while requests drain)."""
        scopes = []
        if isinstance(self.admission, FairAdmission) and self.admission.across_workers:
            scopes.append(await nursery.start(named(
                "admission's look at the other workers", self.admission.follow_workers)))
        if self.shared_limits is not None and self.leases_places:
            await nursery.start(named("tenants' place leases", self.shared_limits.keep_places))
        return scopes


def create_app(
    settings: Settings, shared: SharedRoutingState | None = None, *, moriio_listener: bool = True,
    discovery: bool | None = None, clock: Callable[[], float] = time.monotonic,
    tracing: Tracing | None = None, on_failure: Callable[[str], None] | None = None,
) -> QuartTrio:
    """A quart-trio app serving the proxy for ``settings`` (the upstream client opens at startup).

    ``shared`` lets several worker processes share their routing positions and roster
    (``epd-trio serve`` passes its shared memory); by default each app routes on its own.
    With ``EPD_KV_CONNECTOR=moriio`` the app's lifespan also owns the ZMQ registration socket,
    unless ``moriio_listener`` is False (the other workers of ``epd-trio serve``); ``clock``
    times MoRIIO registrations (tests pass trio's virtual clock). ``discovery`` says whether this app
    runs the DNS and Kubernetes discovery loops (default: unless it shares its roster's memory
    with other workers and is not the one binding the MoRIIO socket). ``tracing``: by default
    from the OpenTelemetry variables of the environment (off unless an OTLP endpoint is set;
    ``ConfigError`` for a bad one, or for tracing on without the ``otel`` extra).
    ``on_failure`` stops the process when a per-process task dies (``_state/tasks.py``);
    without it the app keeps serving and ``/health`` and ``/ready`` say it has failed.

    What it wires, each piece in a function of its own below: the proxy and the admission gate,
    the completion endpoints below Quart (``ProxyASGI``), request ids and refusals, the
    lifespan's tasks, and the Quart routes by kind (OpenAI, probes, admin, metrics, errors).
    """
    if tracing is None:
        tracing = create_tracing(os.environ)
    app = QuartTrio("epd_trio")
    app.config.update(
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        # Quart cuts any response after RESPONSE_TIMEOUT (default 60 s); streams are bounded by
        # the proxy's own idle timeout instead.
        RESPONSE_TIMEOUT=None,
    )
    if discovery is None:
        # One process of those sharing a roster in memory discovers for them all; a process
        # with a roster of its own (one worker, or each worker a replica of EPD_STATE_URL,
        # which shares no discovered instance) discovers for itself.
        discovery = moriio_listener or shared is None
    proxy = Proxy(settings, shared, moriio_listener=moriio_listener, discovery=discovery,
                  clock=clock, tracing=tracing, on_failure=on_failure)
    app.extensions["epd_trio.proxy"] = proxy
    tenants = TenantTable(settings.tenants)
    client_keys = ClientKeys((*settings.api_keys, *tenants.keys))
    admin_key = AdminKey(settings.admin_key)
    gate = _AdmissionWiring.build(settings, tenants, proxy, shared)
    asgi = _completions_below_quart(app, settings, proxy, client_keys, gate)
    refused = _Refusals(app, proxy.pipeline.accounting)
    _request_ids(app)
    _lifespan(app, proxy, asgi, gate, tracing)
    _openai_routes(app, proxy, settings, client_keys, tenants)
    _probe_routes(app, proxy, app.extensions["epd_trio.drain"])
    _admin_routes(app, proxy, admin_key)
    _metrics_route(app, proxy, admin_key, refused)
    _error_handlers(app, settings, refused)
    return app


def _completions_below_quart(app: QuartTrio, settings: Settings, proxy: Proxy,
                             client_keys: ClientKeys, gate: _AdmissionWiring) -> ProxyASGI:
    """The two completion routes as plain ASGI below Quart (``_web/endpoints``), with the
    shutdown's drain (``epd-trio serve``'s shutdown trigger runs it)."""
    accounting = proxy.pipeline.accounting
    drain = Drain(settings.shutdown_grace,
                  on_cut=lambda: setattr(accounting, "shutting_down", True))
    asgi = ProxyASGI(app.asgi_app, write_timeout=settings.client_write_timeout,
                     endpoints=CompletionEndpoints(
                         proxy, settings.max_body_bytes, client_keys, gate.admission,
                         body_timeout=settings.body_timeout, drain=drain))
    app.asgi_app = asgi  # type: ignore[method-assign]
    app.extensions["epd_trio.asgi"] = asgi
    app.extensions["epd_trio.drain"] = drain
    return asgi


class _Refusals:
    """Every refusal of a Quart route answered, counted and logged, as the completion
    endpoints' refusals are (issue 31). Paths no route knows count as "other", so a scan of
    random URLs cannot grow the metric's labels."""

    def __init__(self, app: QuartTrio, accounting: Any) -> None:
        self._app = app
        self._accounting = accounting
        self._known: set[str] = set()

    def __call__(self, error: ProxyError, reply: BaseException | None = None) -> Response:
        """``reply`` (default ``error``) answered, ``error`` counted and logged."""
        if not self._known:
            self._known.update(rule.rule for rule in self._app.url_map.iter_rules())
        endpoint = request.path if request.path in self._known else "other"
        request_id = getattr(g, "request_id", None) or new_request_id(None)
        self._accounting.refused(endpoint, request_id, getattr(g, "started", time.perf_counter()),
                                 error)
        return _error(error if reply is None else reply)


def _request_ids(app: QuartTrio) -> None:
    """Every request of the Quart routes has an id: the client's x-request-id or a new one,
    sent back on every answer."""

    @app.before_request
    async def _identify() -> None:
        g.request_id = new_request_id(request.headers.get("x-request-id"))
        g.started = time.perf_counter()

    @app.after_request
    async def _tag(response: Response) -> Response:
        request_id = getattr(g, "request_id", None)
        if request_id is not None:
            response.headers["x-request-id"] = request_id
        return response


def _lifespan(app: QuartTrio, proxy: Proxy, asgi: ProxyASGI, gate: _AdmissionWiring,
              tracing: Tracing) -> None:
    """The per-process tasks: started before serving under one owner, with one policy
    (``_state/tasks.py``); stopped after serving, the proxy closed, the last spans sent."""
    watchdog: list[trio.CancelScope] = []

    @app.before_serving
    async def _open() -> None:
        async def start(nursery: trio.Nursery) -> None:
            await proxy.start(nursery)
            watchdog.append(await nursery.start(
                named("stalled-send watchdog", asgi.watch_stalled_sends)))
            watchdog.extend(await gate.start(nursery))

        await app.nursery.start(_closed_when_cancelled, proxy, start)

    @app.after_serving
    async def _close() -> None:
        for scope in watchdog:
            scope.cancel()
        await proxy.aclose()
        await tracing.aclose()  # the last spans, within a bounded time


async def _closed_when_cancelled(
    proxy: Proxy, start: Callable[[trio.Nursery], Awaitable[None]],
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The per-process tasks; the proxy's upstream sockets closed if they are cancelled.

    Why: a serve cancelled from outside (an embedding application's nursery, a test's) never
    reaches ``after_serving``, and its keep-alive connections were left for the garbage
    collector to find (a ``ResourceWarning`` in whatever ran next). A task's death is not a
    cancellation: the proxy keeps serving and says it failed (``Supervisor``)."""
    try:
        await proxy.tasks.run(start, task_status=task_status)
    except BaseException:
        with trio.CancelScope(shield=True):
            await proxy.aclose()
        raise


def _openai_routes(app: QuartTrio, proxy: Proxy, settings: Settings, client_keys: ClientKeys,
                   tenants: TenantTable) -> None:
    """``GET /v1/models`` (POST /v1/chat/completions and /v1/completions are
    ``CompletionEndpoints``, below Quart)."""

    @app.get("/v1/models")
    async def models() -> Response:
        authorization = request.headers.get("authorization")
        client_keys.check(authorization)
        # A tenant with a model list sees only what it may use (found as a request's is).
        named = (request.headers.get(settings.tenant_header)
                 if settings.tenant_header is not None else None)
        tenant = tenants.resolve(bearer_token(authorization), named)
        return _json(200, proxy.models_listing(tenant.models))


def _probe_routes(app: QuartTrio, proxy: Proxy, drain: Drain) -> None:
    """Liveness (``/health``) and readiness (``/ready``)."""

    @app.get("/health")
    async def health() -> Response:
        # Liveness: 200 while the process serves, whatever the instances' state. A 503 here
        # restart-loops a proxy whose instances only self-register (Kubernetes,
        # docs/how-to/kubernetes.md); readiness, which may say no, is /ready.
        return _json(200, proxy.health())

    @app.get("/ready")
    async def ready() -> Response:
        ok, reason = proxy.readiness()
        if drain.draining:  # at once: a load balancer stops sending here before the exit
            ok, reason = False, "the proxy is shutting down"
        body: dict[str, object] = {"ready": ok, "roles": proxy.roles()}
        if reason is not None:
            body["reason"] = reason
        return _json(200 if ok else 503, body)


def _admin_routes(app: QuartTrio, proxy: Proxy, admin_key: AdminKey) -> None:
    """Registrations and profiling, behind ``X-API-Key`` (docs/how-to/operations.md)."""

    @app.post("/instances")
    async def register_instance() -> Response:
        admin_key.check(request.headers.get("x-api-key"), required=True)
        body = await request.get_data(cache=False)
        created = proxy.register(body)
        await proxy.ask_registered(body)  # what it serves, before it is told it is in
        return _json(200, {"registered": created})

    @app.delete("/instances")
    async def unregister_instance() -> Response:
        admin_key.check(request.headers.get("x-api-key"), required=True)
        url = request.args.get("url")
        if url is None:  # vLLM's registrar sends its registration body instead
            url = json_object(await request.get_data(cache=False), empty_ok=True).get("url")
        return _json(200, {"removed": proxy.unregister(url)})

    @app.get("/instances")
    async def list_instances() -> Response:
        admin_key.check(request.headers.get("x-api-key"), required=True)
        return _json(200, proxy.instances())

    async def profile(action: str) -> Response:
        admin_key.check(request.headers.get("x-api-key"), required=False)
        report = await proxy.profile(action, await request.get_data(cache=False))
        return _json(report.status, report.body)

    @app.post("/start_profile")
    async def start_profile() -> Response:
        return await profile("start_profile")

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        return await profile("stop_profile")


def _metrics_route(app: QuartTrio, proxy: Proxy, admin_key: AdminKey,
                   refused: _Refusals) -> None:
    """``GET /metrics``: like profiling, open without an admin key, behind it once one is
    set; also as a bearer token, which is how Prometheus scrape configs authenticate."""

    @app.get("/metrics")
    async def metrics() -> Response:
        admin_key.check(request.headers.get("x-api-key")
                        or bearer_token(request.headers.get("authorization")), required=False)
        # Off the event loop: merging the worker files of a multiprocess scrape takes a few ms.
        text = await trio.to_thread.run_sync(proxy.metrics.exposition)
        if text is None:
            return refused(ProxyError("metrics are disabled (EPD_METRICS)", status=404,
                                      type="not_found_error"))
        return Response(text, status=200, content_type=CONTENT_TYPE_LATEST)


def _error_handlers(app: QuartTrio, settings: Settings, refused: _Refusals) -> None:
    """The one rendering of every failure of a Quart route (the module docstring)."""

    @app.errorhandler(ProxyError)
    async def _proxy_error(exc: ProxyError) -> Response:
        return refused(exc)

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        if status == 413:
            return refused(BodyTooLarge(settings.max_body_bytes))
        response = refused(ProxyError(
            _routing_message(status, request.method, request.path, exc)
            or exc.description or exc.name,
            status=status, type=_OPENAI_TYPES.get(status, "invalid_request_error")))
        if isinstance(exc, MethodNotAllowed) and exc.valid_methods:
            response.headers["allow"] = ", ".join(exc.valid_methods)
        return response

    @app.errorhandler(Exception)
    async def _unexpected(exc: Exception) -> Response:
        log.exception("unexpected error while handling %s %s", request.method, request.path)
        return refused(INTERNAL_ERROR, exc)
