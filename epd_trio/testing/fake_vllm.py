"""A fake vLLM OpenAI server for tests, the demo and the bench: fast, observable, breakable.

It speaks the subset of vLLM's API the proxy uses, with the behaviour observed on real vLLM (the
suite in ``tests/e2e_vllm`` runs the proxy against it): an ``X-data-parallel-rank`` outside
``[0, dp_size)`` is a 400; the ``X-Request-Id`` becomes the response id and is echoed; an encoder
answers with ``ec_transfer_params`` keyed by each item's ``uuid``; a prefill asked for
``do_remote_decode`` returns a NIXL-shaped ``kv_transfer_params``; a prompt over
``max_model_len`` is a 400; a stream's 200 headers go out before the engine's wait, its first
chunk after it. Generated text is deterministic in the prompt, so "through the proxy" can be
compared with "direct".
Opt-in, off by default (the bench relies on the default fake being cheap): ``kv=KVConfig(...)``
gives each DP rank a prefix cache that reports vLLM's KV cache events (``fake_kv``), and
``render=True`` serves ``POST /v1/chat/completions/render`` and ``/v1/completions/render`` with
vLLM's ``GenerateRequest`` JSON, tokenized exactly as that cache sees the prompt (``render``).
With ``api_key`` set it answers ``/v1/...`` requests without ``Authorization: Bearer <key>`` with
401 ``{"error": "Unauthorized"}``, as ``vllm serve --api-key`` does (other paths stay open). The
profiler routes ``POST /start_profile`` / ``/stop_profile`` answer 200 with an empty body when
``behaviour.profiler`` is on, else 404 (vLLM registers them only when a profiler is configured).

It is a raw ASGI app (no framework) so it costs little CPU next to the proxy under test, and so it
can see a client disconnect exactly: each request runs beside a watcher of ``receive()``; an
``http.disconnect`` before the response finished cancels the handler and is counted.

Everything it receives is recorded (``received``), and ``wait_until`` lets tests synchronise on
its state without sleeping.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
import trio

from .._serve.serving import quiet_config, serve_app
from . import fake_api
from .fake_kv import FakeKV, KVConfig
from .moriio import MoriioSide
from .render import (
    DEFAULT_PLACEHOLDER_TOKENS,
    Rendered,
    generate_request,
    render_body,
    render_chat,
    render_prompts,
)
from .sim_engine import SimEngine

Role = Literal["encode", "prefill", "decode", "prefill_decode"]
ROLES: tuple[Role, ...] = ("encode", "prefill", "decode", "prefill_decode")
_MEDIA = ("image_url", "audio_url", "input_audio", "video_url")
#: The model list: asked by the proxy's model learner, not a request it routes.
MODELS_PATH = "/v1/models"
#: FastAPI's 404 body for a path with no route (vLLM's, for an endpoint its task lacks).
NO_ROUTE = orjson.dumps({"detail": "Not Found"})
_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


@dataclass
class Behaviour:
    """Knobs a test turns to make this server slow or broken (read at each request)."""

    #: Seconds the "engine" takes before answering: before the response headers, or for a
    #: stream (as on vLLM) after its 200 headers, before its first chunk. Also ``hang``, ``gate``.
    latency: float = 0.0
    #: Seconds between two stream chunks.
    chunk_delay: float = 0.0
    #: Tokens a decode generates when the request does not cap them lower.
    tokens: int = 8
    #: Answer with this HTTP status (and a vLLM-style error body) instead of working.
    fail_status: int | None = None
    #: How many requests get ``fail_status`` (None: all of them, while it is set).
    fail_count: int | None = None
    #: Never answer (a stream: never send a byte after its headers) until the client goes away.
    hang: bool = False
    #: Streams: after this many chunks, stop without finishing the HTTP response (broken stream).
    break_after: int | None = None
    #: Awaited before answering each request: lets a test hold a request at a known point.
    gate: Callable[[], Awaitable[None]] | None = None
    #: Streams: awaited before each chunk after the first, so a test holds a stream that is
    #: running (its first bytes relayed) for as long as it needs, without a clock.
    chunk_gate: Callable[[], Awaitable[None]] | None = None
    #: Prompt length limit, in whitespace-separated words plus media items.
    max_model_len: int = 4096
    #: ``GET /health`` answers 200 when True, 503 when False.
    healthy: bool = True
    #: A profiler is configured: ``/start_profile`` and ``/stop_profile`` exist (else 404).
    profiler: bool = False
    #: An encoder's ``ec_transfer_params`` from its sub-request's media parts (in order); by
    #: default, like vLLM 0.32's ECExampleConnector on a Qwen2-VL model: per item, keyed by its
    #: ``uuid``, ``{"item_indices": [position], "metadata": {"image_grid_thw": [[1, 4, 4]]}}``.
    ec_report: Callable[[list[Mapping[str, Any]]], Any] | None = None
    #: Seconds ``/v1/.../render`` takes (a slow tokenizer: the proxy's fallback after a timeout).
    render_latency: float = 0.0
    #: ``/v1/.../render`` answers this status (a vLLM-style error body) instead of rendering.
    render_fail_status: int | None = None
    #: How many renders get ``render_fail_status`` (None: all of them, while it is set).
    render_fail_count: int | None = None
    #: ``POST /v1/load_lora_adapter`` answers this status (vLLM's error body) instead of
    #: loading (a 500: the engine failed to load it).
    load_fail_status: int | None = None


@dataclass
class Received:
    """One request as the server saw it."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    rank: int | None
    request_id: str | None
    #: Set when the client disconnected before the response was complete.
    disconnected: bool = False
    #: ``trio.current_time()`` when that disconnect was seen.
    disconnected_at: float | None = None
    #: Status answered (None while in flight or when the client left first).
    status: int | None = None
    #: The exact response body bytes sent (for byte-for-byte pass-through checks).
    sent: bytearray = field(default_factory=bytearray)


@dataclass
class FakeVLLM:
    """One fake vLLM server. Serve it with ``await nursery.start(fake.serve)``."""

    role: Role = "decode"
    dp_size: int = 1
    model: str = "fake-model"
    #: Every name it serves (``vllm serve --served-model-name a b``), listed in ``/v1/models``;
    #: a request for another name gets vLLM's 404. Empty: ``model`` alone.
    served_names: tuple[str, ...] = ()
    #: Whether it has a ``/v1/models`` route (False: FastAPI's 404 there, as an
    #: OpenAI-compatible server without it; then it accepts any name, as such servers do).
    models_route: bool = True
    #: The LoRA adapters it holds, name -> path (``vllm serve --enable-lora --lora-modules``):
    #: listed in ``/v1/models`` with ``parent`` its first served name, and served.
    adapters: dict[str, str] = field(default_factory=dict)
    #: Where ``POST /v1/load_lora_adapter`` finds adapters (None: any path; else vLLM's 404
    #: for any other), as ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` does.
    lora_paths: frozenset[str] | None = None
    #: Adapter loads answered 200, by name (a test counts them per instance).
    loads: list[str] = field(default_factory=list)
    #: ``/metrics``' ``vllm:lora_requests_info``: the adapters it runs, those it queues, and
    #: its ``max_lora`` (None: no such series).
    lora_info: tuple[tuple[str, ...], tuple[str, ...], int] | None = None
    #: What it serves besides chat and completions (``fake_api.TASK_ENDPOINTS``): ``generate``
    #: as ``vllm serve``; ``embed``, ``score``, ``classify`` as ``--runner pooling``
    #: (chat and completions are then FastAPI's 404); ``transcription``, a speech model.
    tasks: frozenset[str] = frozenset({"generate"})
    #: Like ``vllm serve --api-key``: ``/v1/...`` requests need ``Authorization: Bearer <key>``.
    api_key: str | None = None
    #: Between a successful ``/start_profile`` and ``/stop_profile``.
    profiling: bool = False
    #: Speak vLLM's MoRIIO connector (``epd_trio.testing.moriio``): prefill and decode legs are
    #: checked as the connector reads them (a 400 otherwise), a prefill answers like its
    #: producer, a WRITE-mode decode waits for its prefill's KV.
    moriio: MoriioSide | None = None
    behaviour: Behaviour = field(default_factory=Behaviour)
    #: A simulated batch engine (``sim_engine``): answers are paced by its steps, its prefix
    #: and encoder caches, and ``GET /metrics`` serves its gauges. None: fixed delays only.
    engine: SimEngine | None = None
    #: A prefix cache per DP rank reporting vLLM's KV events (``fake_kv.KVConfig``). None: off.
    kv: KVConfig | None = None
    #: Serve vLLM's render endpoints (``render``). Off: 404, as a vLLM without them.
    render: bool = False
    #: The state behind ``kv`` (its caches, ``reset``, ``restart``).
    kv_state: FakeKV | None = field(default=None, init=False, repr=False)
    received: list[Received] = field(default_factory=list)
    #: API (``/v1/...``) requests being answered now; health probes are not counted.
    in_flight: int = 0
    disconnects: int = 0
    url: str = ""
    _changed: trio.Event = field(default_factory=trio.Event, repr=False)
    _scope: trio.CancelScope | None = field(default=None, repr=False)
    _ids: itertools.count[int] = field(default_factory=itertools.count, repr=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}: {self.role!r}")
        if not self.served_names:
            self.served_names = (self.model,)
        if self.kv is not None:
            self.kv_state = FakeKV(self.kv, self.dp_size, self.engine)

    # -- observation -----------------------------------------------------------------------
    def requests(self, path: str | None = "/v1/") -> list[Received]:
        """Recorded requests whose path starts with ``path`` (default: the OpenAI API ones the
        proxy routes; the model list the proxy asks for, like its health probes, only when
        ``path`` names it)."""
        return [r for r in self.received if path is None or (
            r.path.startswith(path) and (r.path != MODELS_PATH or path == MODELS_PATH))]

    def stats(self) -> dict[str, Any]:
        """What this server received, in numbers (served as ``GET /fake/stats`` for the bench)."""
        api = self.requests()
        ranks: dict[str, int] = {}
        for r in api:
            key = "none" if r.rank is None else str(r.rank)
            ranks[key] = ranks.get(key, 0) + 1
        items = sum(len(media_parts(r.body)) for r in api if isinstance(r.body, dict))
        stats = {"role": self.role, "dp_size": self.dp_size, "requests": len(api),
                 "items": items, "ranks": ranks, "disconnects": self.disconnects,
                 "profiling": self.profiling}
        if self.kv_state is not None:
            stats["prefix_cache"] = [{"queries": c.queries, "hits": c.hits, "blocks": len(c)}
                                     for c in self.kv_state.caches]
        return stats

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds; re-checked after every state change of this server."""
        while not predicate():
            await self._changed.wait()

    # -- serving -----------------------------------------------------------------------------
    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve on ``host:port`` (0 = any free port) until cancelled; reports the base URL."""
        with trio.CancelScope() as self._scope:
            async with trio.open_nursery() as nursery:
                publisher = self.kv.publisher if self.kv is not None else None
                if publisher is not None and publisher.endpoints is None:
                    await nursery.start(publisher.run)
                if self.engine is not None:
                    await nursery.start(self.engine.run)
                self.url = await nursery.start(serve_app, self, quiet_config(host, port))
                task_status.started(self.url)

    def stop(self) -> None:
        """Kill the server abruptly: listener and open connections close, like a crashed vLLM."""
        if self._scope is not None:
            self._scope.cancel()

    # -- ASGI ----------------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        raw = b"".join(chunks)
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = raw
        record = Received(
            method=scope["method"], path=scope["path"], headers=headers, body=body,
            rank=_int_or_none(headers.get("x-data-parallel-rank")),
            request_id=headers.get("x-request-id"),
        )
        self.received.append(record)
        api = record.path.startswith("/v1/") and record.path != MODELS_PATH
        self.in_flight += api
        self._notify()
        finishing = False

        async def respond(status: int, content: bytes, content_type: str = "application/json",
                          more: bool = False) -> None:
            nonlocal finishing
            record.status = status
            await send({
                "type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()),
                            (b"x-request-id", (record.request_id or "").encode())],
            })
            if not more:
                finishing = True
                record.sent += content
                await send({"type": "http.response.body", "body": content})

        async def body_chunk(content: bytes, last: bool) -> None:
            nonlocal finishing
            finishing = finishing or last
            record.sent += content
            self._notify()
            await send({"type": "http.response.body", "body": content, "more_body": not last})

        def client_left() -> None:
            # Counted in ``disconnects`` once the handler has finished (below), so a test that
            # sees the disconnect also sees the request no longer in flight.
            if not finishing and not record.disconnected:
                record.disconnected = True
                record.disconnected_at = trio.current_time()

        # Hypercorn either delivers ``http.disconnect`` (seen by the watcher) or cancels the app
        # task when the connection closes; both count as the client going away.
        try:
            async with trio.open_nursery() as nursery:

                async def watch_disconnect() -> None:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            break
                    client_left()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch_disconnect)
                await self._handle(record, respond, body_chunk)
                nursery.cancel_scope.cancel()
        except BaseException as exc:
            cancelled = isinstance(exc, trio.Cancelled) or (
                isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[1] is None)
            if cancelled:
                client_left()
            raise
        finally:
            self.in_flight -= api
            self.disconnects += record.disconnected
            self._notify()

    async def _api(self, record: Received, respond: Any, body_chunk: Any) -> None:
        """One of the other endpoints (``fake_api``), where its tasks serve it."""
        if not any(record.path in fake_api.TASK_ENDPOINTS[t] for t in self.tasks):
            await respond(404, NO_ROUTE)  # FastAPI's: no route
            return
        if await self._misbehave(respond):  # the engine's time, and any injected failure
            return
        body: Any = record.body
        if fake_api.is_form(record.path):
            try:
                fields = fake_api.form_of(body if isinstance(body, bytes) else b"",
                                          record.headers.get("content-type", ""))
            except ValueError:
                await respond(400, _error("expected a multipart form", "BadRequestError", 400))
                return
            body = {"model": fields["model"].decode()} if "model" in fields else {}
        unknown = self._unknown_model(body)
        if unknown is not None:
            await respond(404, unknown)
            return
        model = self._answer_model(body)
        if fake_api.is_form(record.path):
            await fake_api.answer_form(record.path, fields, model, respond, body_chunk,
                                       self._generate({"prompt": str(len(fields))}))
            return
        if not isinstance(body, dict):
            await respond(400, _error("expected a JSON object", "BadRequestError", 400))
            return
        await respond(200, orjson.dumps(fake_api.json_answer(record.path, body, model)))

    def _answer_model(self, body: Any) -> str:
        """The ``model`` an answer names: like vLLM, its first served name, whichever of its
        names the request used, or the adapter a LoRA request named (a server without
        ``/v1/models`` echoes the request's)."""
        name = body.get("model") if isinstance(body, dict) else None
        if self.models_route:
            return name if name in self.adapters else self.served_names[0]
        return name if isinstance(name, str) else self.model

    async def _load_lora(self, body: Any, respond: Any) -> None:
        """vLLM's ``POST /v1/load_lora_adapter`` (runtime updating on): plain-text success,
        400 for a name already loaded (unless ``load_inplace``), 404 for a path it cannot
        find, and ``behaviour.load_fail_status`` for an engine that failed."""
        name = body.get("lora_name") if isinstance(body, dict) else None
        path = body.get("lora_path") if isinstance(body, dict) else None
        if not isinstance(name, str) or not isinstance(path, str):
            await respond(400, _error("lora_name and lora_path are required",
                                      "BadRequestError", 400))
            return
        failing = self.behaviour.load_fail_status
        if failing is not None:
            await respond(failing, _error(f"Loading lora {name} failed: engine error",
                                          "InternalServerError", failing))
            return
        if name in self.adapters and not body.get("load_inplace"):
            await respond(400, _error(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.", "InvalidUserInput", 400))
            return
        if self.lora_paths is not None and path not in self.lora_paths:
            await respond(404, _error(f"Loading lora {name} failed: No adapter found for "
                                      f"{path}", "NotFoundError", 404))
            return
        self.adapters[name] = path
        self.loads.append(name)
        await respond(200, f"Success: LoRA adapter '{name}' added successfully.".encode(),
                      "text/plain; charset=utf-8")

    def _unknown_model(self, body: Any) -> bytes | None:
        """vLLM's 404 for a name it does not serve (its message lists the names it does);
        None for a served name, or a body without one (vLLM takes its first name then)."""
        name = body.get("model") if isinstance(body, dict) else None
        if (name is None or name in self.served_names or name in self.adapters
                or not self.models_route):
            return None
        return _error(f"The model `{name}` does not exist. Valid aliases: "
                      f"{', '.join(self.served_names)}.", "NotFoundError", 404, "model")

    async def _handle(self, record: Received, respond: Any, body_chunk: Any) -> None:
        b = self.behaviour
        if self.api_key is not None and record.path.startswith("/v1") and (
                record.headers.get("authorization") != f"Bearer {self.api_key}"):
            await respond(401, orjson.dumps({"error": "Unauthorized"}))
            return
        if record.path == "/health":
            await respond(200 if b.healthy else 503, b"")
            return
        if record.path == "/fake/stats":
            await respond(200, orjson.dumps(self.stats()))
            return
        if record.path == "/metrics" and (self.engine is not None or self.kv_state is not None
                                          or self.lora_info is not None):
            text = (self.engine.metrics_text(self.model, self.role == "encode")
                    if self.engine is not None
                    else self.kv_state.metrics_text(self.model) if self.kv_state is not None
                    else "")
            if self.lora_info is not None:
                running, waiting, most = self.lora_info
                text += ("# TYPE vllm:lora_requests_info gauge\nvllm:lora_requests_info{"
                         f'max_lora="{most}",running_lora_adapters="{",".join(running)}",'
                         f'waiting_lora_adapters="{",".join(waiting)}"}} {time.time()}\n')
            await respond(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")
            return
        if record.path == "/reset_prefix_cache" and self.kv_state is not None:
            self.kv_state.reset()
            await respond(200, b"")
            return
        if record.path in _RENDER_PATHS and record.method == "POST" and self.render:
            await self._render(record, respond)
            return
        if record.path == "/v1/models" and record.method == "GET":
            if not self.models_route:
                await respond(404, NO_ROUTE)
                return
            await respond(200, orjson.dumps({"object": "list", "data": [*({
                "id": name, "object": "model", "created": 0, "owned_by": "vllm",
                "root": self.served_names[0], "parent": None,
                "max_model_len": b.max_model_len} for name in self.served_names), *({
                "id": name, "object": "model", "created": 0, "owned_by": "vllm",
                "root": path, "parent": self.served_names[0], "max_model_len": None}
                for name, path in self.adapters.items())]}))
            return
        if record.path == "/v1/load_lora_adapter" and record.method == "POST":
            if record.headers.get("content-type") != "application/json":  # as vLLM 0.32
                await respond(400, _error("1 validation error:\n  Unsupported Media Type: Only "
                                          "'application/json' is allowed", "BadRequestError",
                                          400))
                return
            await self._load_lora(record.body, respond)
            return
        if record.path in ("/start_profile", "/stop_profile") and record.method == "POST":
            if not b.profiler:  # FastAPI's answer for a route that does not exist
                await respond(404, NO_ROUTE)
            elif not await self._misbehave(respond):
                self.profiling = record.path == "/start_profile"
                await respond(200, b"")
            return
        if record.method == "POST" and record.path in fake_api.ENDPOINTS:
            await self._api(record, respond, body_chunk)
            return
        if (record.method != "POST" or record.path not in ("/v1/chat/completions",
                                                            "/v1/completions")
                or "generate" not in self.tasks):
            await respond(404, NO_ROUTE if record.method == "POST"
                          and "generate" not in self.tasks
                          else _error("Not Found", "NotFoundError", 404))
            return
        body = record.body
        streams = self.role != "encode" and isinstance(body, dict) and body.get("stream") is True
        if await (self._injected_failure(respond) if streams else self._misbehave(respond)):
            return
        unknown = self._unknown_model(body)
        if unknown is not None:
            await respond(404, unknown)
            return
        problem = self._validate(record)
        if not problem and self.moriio is not None and self.role in ("prefill", "decode"):
            problem = self.moriio.check(self.role, record.request_id, body)
        if problem:
            await respond(400, _error(problem, "BadRequestError", 400))
            return
        chat = record.path == "/v1/chat/completions"
        request_id = record.request_id or f"{next(self._ids)}"
        if self.role == "encode":
            if self.engine is not None:
                await self.engine.encode([str(p.get("uuid") or _content_hash(p))
                                          for p in media_parts(body)])
            await respond(200, orjson.dumps(self._encoder_answer(request_id, body)))
            return
        words = self._generate(body)
        kv = self._kv_transfer_params(request_id, body, record.rank)
        rendered = (render_body(body, chat, placeholder_tokens=self.kv_state.config.placeholder_tokens)
                    if self.kv_state is not None else None)
        admitted: list[int] = []  # the cached prefix (tokens), once the cache has the request
        if rendered is not None and self.engine is None and self.kv_state is not None:
            admitted.append(self.kv_state.admit(record.rank or 0, rendered,
                                                store=self.kv_state.stores(_remote(self.role, body))))
        ticks = self._engine_ticks(record, body, len(words), rendered, admitted.append)
        prompt_tokens = len(rendered.token_ids) if rendered is not None else _prompt_len(body, chat)
        details = self.kv_state is not None and self.kv_state.config.prompt_tokens_details

        def usage_of(completion: int) -> dict[str, Any]:
            return _usage(prompt_tokens, completion, admitted[0] if admitted else 0) if details \
                else _usage(prompt_tokens, completion)

        try:
            if streams:
                # Like vLLM: a stream's 200 and SSE headers go out once the request is
                # accepted, before the engine has it; its first body bytes wait for the engine
                # (here the gate, latency and hang knobs; on real vLLM seconds when a KV pull
                # is slow).
                await respond(200, b"", "text/event-stream", more=True)
                await self._engine_time()
                await self._remote_kv(body)
                await self._stream(request_id, body, words, chat, body_chunk, usage_of, ticks)
                return
            await self._remote_kv(body)
            if ticks is not None:
                async for _ in ticks:
                    pass
        finally:
            if ticks is not None:
                await ticks.aclose()  # leaves the engine's batch (the client may have left)
        text = " ".join(words)
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text,
                                     "reasoning_content": None, "tool_calls": []},
             "logprobs": None, "finish_reason": "length", "stop_reason": None}
            if chat else
            {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
             "stop_reason": None, "prompt_logprobs": None}
        )
        await respond(200, orjson.dumps({
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self._answer_model(body),
            "choices": [choice],
            "usage": usage_of(len(words)),
            "prompt_logprobs": None,
            "kv_transfer_params": kv,
        }))

    async def _misbehave(self, respond: Any) -> bool:
        """Apply the gate, latency, hang and injected-failure knobs; True when it answered."""
        await self._engine_time()
        return await self._injected_failure(respond)

    async def _engine_time(self) -> None:
        """The time the "engine" takes before answering: the gate, latency and hang knobs."""
        b = self.behaviour
        if b.gate is not None:
            await b.gate()
        if b.latency:
            await trio.sleep(b.latency)
        if b.hang:
            await trio.sleep_forever()

    async def _injected_failure(self, respond: Any) -> bool:
        """Answer with the injected failure status, if one is set; True when it answered."""
        b = self.behaviour
        if b.fail_status is not None and (b.fail_count is None or b.fail_count > 0):
            if b.fail_count is not None:
                b.fail_count -= 1
            await respond(b.fail_status, _error(f"injected failure ({b.fail_status})",
                                                "InternalServerError", b.fail_status))
            return True
        return False

    def _validate(self, record: Received) -> str | None:
        body = record.body
        if not isinstance(body, dict):
            return "request body must be a JSON object"
        rank_header = record.headers.get("x-data-parallel-rank")
        if rank_header is not None:
            if record.rank is None:
                return f"invalid X-data-parallel-rank header: {rank_header!r}"
            if not 0 <= record.rank < self.dp_size:
                return (f"data_parallel_rank {record.rank} is out of range "
                        f"[0, {self.dp_size}).")
        chat = record.path == "/v1/chat/completions"
        length = _prompt_len(body, chat)
        if length > self.behaviour.max_model_len:
            return (f"This model's maximum context length is {self.behaviour.max_model_len} "
                    f"tokens. However, your request has {length} input tokens.")
        return None

    def _encoder_answer(self, request_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        parts = media_parts(body)
        report = self.behaviour.ec_report
        ec: Any = report(parts) if report is not None else default_ec_report(parts)
        return {
            "id": f"chatcmpl-{request_id}", "object": "chat.completion",
            "created": int(time.time()), "model": self._answer_model(body),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": "length", "stop_reason": None}],
            "usage": {"prompt_tokens": len(parts), "completion_tokens": 0,
                      "total_tokens": len(parts)},
            "ec_transfer_params": ec,
        }

    async def _remote_kv(self, body: Mapping[str, Any]) -> None:
        """A MoRIIO WRITE decode waits for its prefill to push the KV."""
        if self.moriio is not None and self.role == "decode":
            await self.moriio.before_decode(body["kv_transfer_params"])

    def _kv_transfer_params(self, request_id: str, body: Mapping[str, Any],
                            rank: int | None = None) -> Any:
        params = body.get("kv_transfer_params")
        if self.role == "prefill" and isinstance(params, dict) and self.moriio is not None:
            return self.moriio.prefill_answer(params, rank, self.dp_size)
        if self.role == "prefill" and isinstance(params, dict) and params.get("do_remote_decode"):
            port = int(self.url.rsplit(":", 1)[-1]) if self.url else 0
            return {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [[1, 2, 3]], "remote_engine_id": f"fake-prefill-{port}",
                "remote_request_id": request_id, "remote_host": "127.0.0.1",
                "remote_port": port + 1, "tp_size": 1,
            }
        return None

    def _engine_ticks(
        self, record: Received, body: Mapping[str, Any], tokens: int,
        rendered: Rendered | None = None, on_admit: Callable[[int], object] | None = None,
    ) -> AsyncIterator[int] | None:
        """The simulated engine's steps for this request (one per token), or None without one.

        A decode whose KV comes from a prefill skips the prefill cost, as with NIXL. With
        ``kv`` on, the engine caches the rendered token ids (the events carry them)."""
        if self.engine is None:
            return None
        remote = _remote(self.role, body)
        if rendered is None or self.kv_state is None:
            return self.engine.generate(record.rank or 0, prompt_words(body), tokens,
                                        prefill=not remote)
        ids = rendered.token_ids
        return self.engine.generate(
            record.rank or 0, ids, tokens, prefill=not remote, store=self.kv_state.stores(remote),
            extra_keys=rendered.extra_keys(self.kv_state.block_size), hit_limit=len(ids) - 1,
            on_admit=on_admit)

    async def _render(self, record: Received, respond: Any) -> None:
        """vLLM's render endpoints: the prompt as this fake's cache tokenizes it."""
        b, body = self.behaviour, record.body
        if b.render_latency:
            await trio.sleep(b.render_latency)
        if b.render_fail_status is not None and (b.render_fail_count is None or b.render_fail_count > 0):
            if b.render_fail_count is not None:
                b.render_fail_count -= 1
            await respond(b.render_fail_status, _error(f"injected render failure ({b.render_fail_status})",
                                                       "InternalServerError", b.render_fail_status))
            return
        if not isinstance(body, dict):
            await respond(400, _error("request body must be a JSON object", "BadRequestError", 400))
            return
        chat = record.path == "/v1/chat/completions/render"
        places = (self.kv_state.config.placeholder_tokens if self.kv_state is not None
                  else DEFAULT_PLACEHOLDER_TOKENS)
        prompts = [render_chat(body, placeholder_tokens=places)] if chat else render_prompts(body)
        too_long = [len(p.token_ids) for p in prompts if len(p.token_ids) > b.max_model_len]
        if not prompts or too_long:
            message = (f"This model's maximum context length is {b.max_model_len} tokens. However, "
                       f"your request has {too_long[0]} input tokens." if too_long
                       else "the request has no prompt")
            await respond(400, _error(message, "BadRequestError", 400))
            return
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{record.request_id or next(self._ids)}"
        answers = [generate_request(p, body, request_id, self.model) for p in prompts]
        await respond(200, orjson.dumps(answers[0] if chat else answers))

    def _generate(self, body: Mapping[str, Any]) -> list[str]:
        limit = self.behaviour.tokens
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                limit = min(limit, value)
        # An adapter changes the answer (its weights do), as on real vLLM; the base's name
        # does not (one engine, however it is named).
        lora = body.get("model") if body.get("model") in self.adapters else None
        prompt = body.get("messages", body.get("prompt"))
        seed = hashlib.sha256(orjson.dumps(
            prompt if lora is None else [prompt, lora], option=orjson.OPT_SORT_KEYS,
        )).digest()
        return [_WORDS[seed[i % len(seed)] % len(_WORDS)] for i in range(max(limit, 0))]

    async def _stream(self, request_id: str, body: Mapping[str, Any], words: list[str],
                      chat: bool, body_chunk: Any, usage_of: Callable[[int], dict[str, Any]],
                      ticks: AsyncIterator[int] | None = None) -> None:
        b = self.behaviour
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", "object": obj,
                "created": int(time.time()), "model": self._answer_model(body)}

        def frame(piece: str | None, finish: str | None, first: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else (
                    {"content": piece} if piece is not None else {})
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None,
                          "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = None
            return b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"

        # Like vLLM (and the OpenAI API): with stream_options.include_usage the last chunk
        # before [DONE] has no choices and carries the usage.
        options = body.get("stream_options")
        usage = isinstance(options, dict) and options.get("include_usage") is True

        def frames() -> Iterator[bytes]:  # lazily: a test may ask for millions of tokens
            if chat:
                yield frame(None, None, first=True)
            for i, word in enumerate(words):
                yield frame(("" if i == 0 else " ") + word, None)
            yield frame(None, "length")
            if usage:
                yield b"data: " + orjson.dumps({**base, "choices": [],
                                               "usage": usage_of(len(words))}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        count = len(words) + 2 + chat + usage
        # With an engine, frame i waits for its token's step: a chat's role chunk comes with
        # the first token, and the finish chunk, usage and [DONE] right after the last.
        first_word = 1 if chat else 0
        for i, data in enumerate(frames()):
            if b.break_after is not None and i >= b.break_after:
                # End the handler without finishing the response: Hypercorn then closes the
                # connection mid-body, which a client sees as a broken stream.
                raise _BrokenStream
            if b.chunk_delay and i:
                await trio.sleep(b.chunk_delay)
            if b.chunk_gate is not None and i:
                await b.chunk_gate()
            if ticks is not None and (i == 0 or first_word < i <= len(words) - 1 + first_word):
                await anext(ticks, None)
            await body_chunk(data, last=i == count - 1)
        if ticks is not None:
            async for _ in ticks:  # a chat with no word still took its step
                pass


class _BrokenStream(Exception):
    """Raised inside the ASGI app to make Hypercorn drop a response mid-body."""


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _error(message: str, kind: str, status: int, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}})


def _usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if cached is not None:  # vLLM --enable-prompt-tokens-details
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _remote(role: str, body: Mapping[str, Any]) -> bool:
    """A decode whose prompt's KV comes from a prefill (``do_remote_prefill``)."""
    params = body.get("kv_transfer_params")
    return role == "decode" and isinstance(params, dict) and bool(params.get("do_remote_prefill"))


_RENDER_PATHS = ("/v1/chat/completions/render", "/v1/completions/render")


def _int_or_none(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def media_parts(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The media content parts of a chat body, in order (the bench's lean fake uses it too)."""
    parts = []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts += [p for p in content if isinstance(p, dict) and p.get("type") in _MEDIA]
    return parts


def default_ec_report(parts: list[Mapping[str, Any]]) -> dict[str, Any]:
    """What vLLM 0.32's ECExampleConnector reports for these parts on a Qwen2-VL encoder."""
    ec: dict[str, Any] = {}
    for index, part in enumerate(parts):
        key = part.get("uuid") or _content_hash(part)
        entry = ec.setdefault(key, {"item_indices": [], "metadata": {"image_grid_thw": [[1, 4, 4]]}})
        entry["item_indices"].append(index)
    return ec


def prompt_words(body: Mapping[str, Any]) -> list[str]:
    """The prompt as the simulated engine tokenizes it: one token per word, a media item one
    token (its ``uuid``)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt.split()
    words: list[str] = []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            words += content.split()
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    words += str(part.get("text", "")).split()
                elif isinstance(part, dict):
                    words.append(str(part.get("uuid") or _content_hash(part)))
    return words


def _content_hash(part: Mapping[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(part, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _prompt_len(body: Mapping[str, Any], chat: bool) -> int:
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return len(prompt.split())
        return len(prompt) if isinstance(prompt, list) else 0
    total = 0
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content.split())
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    total += len(str(part.get("text", "")).split())
                else:
                    total += 1
    return total
