"""A lean fake vLLM for the benchmarks: streams like vLLM, costs little CPU.

    python -m bench.lean_fake --prefills 1 --decodes 1 --token-interval 0.002

Prints ``EPD_ENCODE_URLS=...`` / ``EPD_PREFILL_URLS=...`` / ``EPD_DECODE_URLS=...`` (one line
per role that has instances), then ``ready``, and serves until SIGINT/SIGTERM.

What a benchmark figure depends on, and this fake does as vLLM does:

- A stream's 200 head (chunked, ``text/event-stream``) goes out as soon as the request is
  accepted, before the first token.
- Every SSE event is **one write** (one ``send`` of one HTTP chunk), and tokens are spaced by
  ``--token-interval`` (default 2 ms): one "engine" per instance steps every running stream
  once per interval, as vLLM's engine steps its whole batch, then writes each stream's token.
  On the first step a chat stream also gets its role chunk, as vLLM sends it: a separate write,
  right before the first token. The last token carries ``finish_reason``; ``data: [DONE]`` and
  the chunked terminator follow at once, each a write of its own (as uvicorn sends them).
- Prefill (and encode) answers one JSON body after ``--prefill-time``; a prefill asked for
  ``do_remote_decode`` returns a NIXL-shaped ``kv_transfer_params``. A non-stream decode
  answers after ``max_tokens`` engine steps.
- ``--pacing stream`` gives each stream a timer of its own instead (its tokens ``interval``
  apart from its own start, as a server whose handler sleeps between writes paces them, e.g.
  ``bench/aiohttp_fake.py``): streams started at different moments then deliver their tokens
  at different moments, and a proxy wakes up for few at a time instead of for the whole batch.
- ``POST /v1/embeddings`` (a decode or combined instance) answers one JSON body after
  ``--prefill-time`` (an embedding is one forward pass, like a prefill): one vector of
  ``EMBEDDING_DIM`` floats per input, written as vLLM's answer is (``object: list``, ``data``,
  ``usage``).
- HTTP/1.1 keep-alive; ``GET /health`` and ``GET /v1/models`` answer 200.

What it does not do: validate DP ranks or prompt lengths, record requests, inject faults (that is
``epd_trio.testing.FakeVLLM``, on Hypercorn, for the tests). Why not that one here: Hypercorn
costs tens of microseconds per write, and on a 2-core machine every microsecond the fake spends
is taken from the proxy being measured. Here requests are parsed with h11; the token path is a
few byte concatenations and one non-blocking ``send`` on a plain socket, done by the engine
task, with no task switch per token. A write that would block is queued on the stream and
flushed by its connection task, so a slow reader never stalls the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import h11
import orjson
import trio

from epd_trio.testing.fake_vllm import media_parts

__all__ = ["DEFAULT_TOKEN_INTERVAL", "PACINGS", "Engine", "LeanFake", "Stream", "chunk", "serve_fakes"]

#: Seconds between two tokens of one stream: a real engine's decode step, a few ms.
DEFAULT_TOKEN_INTERVAL = 0.002
#: Seconds a prefill or encode takes before answering.
DEFAULT_PREFILL_TIME = 0.002
#: Tokens a decode generates when the request does not cap them lower.
DEFAULT_TOKENS = 16
ROLES = ("encode", "prefill", "decode", "prefill_decode")
#: How a stream's tokens are timed: one engine grid for all streams, or a timer per stream.
PACINGS = ("engine", "stream")
_WORDS = [orjson.dumps(" " + w) for w in (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()]
_DONE = b"data: [DONE]\n\n"
#: Floats in a fake embedding: a small sentence-embedding model's (all-MiniLM-L6-v2's 384).
EMBEDDING_DIM = 384
_VECTOR = [round(((i * 7919) % 1000) / 1000 - 0.5, 7) for i in range(EMBEDDING_DIM)]
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}


def chunk(payload: bytes) -> bytes:
    """``payload`` framed as one HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


@dataclass(eq=False, slots=True)
class Stream:
    """One running stream: the socket it writes to and the token frames still due."""

    sock: socket.socket
    #: Everything of an SSE event before the token's JSON string, and everything after it.
    prefix: bytes
    suffix: bytes
    last_suffix: bytes
    #: The role chunk a chat stream sends before its first token (None: none or already sent).
    first: bytes | None
    left: int
    #: Set by the engine after the last write.
    finished: bool = False
    #: Set by the engine when there is a backlog to flush or the stream finished.
    wake: trio.Event = field(default_factory=trio.Event)
    #: Bytes a ``send`` could not take; the connection task flushes them (order kept).
    backlog: bytearray = field(default_factory=bytearray)
    flushing: bool = False
    broken: bool = False
    words: itertools.cycle[bytes] = field(default_factory=lambda: itertools.cycle(_WORDS))

    def write(self, data: bytes) -> None:
        """One write: a non-blocking ``send``; what it does not take goes to the backlog."""
        if self.broken:
            return
        if self.backlog or self.flushing:
            self.backlog += data
            return
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:  # the client went away: stop producing for it
            self.broken = True
            self.left = 0
            return
        if sent < len(data):
            self.backlog += data[sent:]
            self.wake.set()

    def step(self) -> None:
        """Emit this stream's next token (and, after the last one, ``[DONE]``)."""
        if self.first is not None:
            self.write(chunk(self.first))
            self.first = None
        self.left -= 1
        if self.left > 0:
            self.write(chunk(self.prefix + next(self.words) + self.suffix))
        else:
            self.write(chunk(self.prefix + next(self.words) + self.last_suffix))
            self.write(chunk(_DONE))


class Engine:
    """Steps every running stream once per ``interval``, like an engine's decode batch.

    The loop sleeps on an event while no stream runs, so an idle fake costs nothing. Streams
    added during a step wait for the next one: every token is ``interval`` after the previous.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.running: list[Stream] = []
        self._wake = trio.Event()

    def add(self, stream: Stream) -> None:
        self.running.append(stream)
        self._wake.set()

    async def run(self) -> None:
        # Steps on a fixed grid (like an engine whose step takes ``interval``), not "sleep after
        # each step", which would stretch the spacing by the step's own time. Behind schedule
        # (a busy machine), the next step runs at once: a late token is not made later.
        deadline = trio.current_time()
        while True:
            if not self.running:
                await self._wake.wait()
                self._wake = trio.Event()
                deadline = trio.current_time()
            deadline = max(deadline + self.interval, trio.current_time() - self.interval)
            await trio.sleep_until(deadline)
            batch, self.running = self.running, []
            for stream in batch:
                stream.step()
                if stream.left > 0:
                    self.running.append(stream)
                else:
                    stream.finished = True
                    stream.wake.set()


async def _send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


@dataclass
class LeanFake:
    """One fake instance. ``await nursery.start(fake.serve)`` reports its base URL."""

    role: str = "decode"
    token_interval: float = DEFAULT_TOKEN_INTERVAL
    prefill_time: float = DEFAULT_PREFILL_TIME
    tokens: int = DEFAULT_TOKENS
    model: str = "fake-model"
    #: ``engine``: every stream on the engine's one grid; ``stream``: a timer per stream.
    pacing: str = "engine"
    url: str = ""
    #: API requests answered, by path (a cheap sanity check for the bench).
    answered: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}: {self.role!r}")
        if self.pacing not in PACINGS:
            raise ValueError(f"pacing must be one of {PACINGS}: {self.pacing!r}")
        self.engine = Engine(self.token_interval)
        self._ids = itertools.count()

    async def serve(self, host: str = "127.0.0.1", port: int = 0, *,
                    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(4096)
        listener.setblocking(False)
        self.url = f"http://{host}:{listener.getsockname()[1]}"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.engine.run)
                task_status.started(self.url)
                while True:
                    await trio.lowlevel.wait_readable(listener)
                    try:
                        sock, _ = listener.accept()
                    except BlockingIOError:
                        continue
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    nursery.start_soon(self._connection, sock)
        finally:
            listener.close()

    async def _connection(self, sock: socket.socket) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 << 20)
        request: h11.Request | None = None
        body = bytearray()
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    await trio.lowlevel.wait_readable(sock)
                    with contextlib.suppress(BlockingIOError):  # a spurious wake-up
                        conn.receive_data(sock.recv(65536))
                elif isinstance(event, h11.Request):
                    request, body = event, bytearray()
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    assert request is not None
                    await self._answer(sock, conn, request, bytes(body))
                    if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                        return
                    conn.start_next_cycle()
                else:  # ConnectionClosed
                    return
        except (OSError, h11.RemoteProtocolError):  # the client's fault: drop it, serve others
            return
        finally:
            sock.close()

    # -- answers ------------------------------------------------------------------------------
    async def _answer(self, sock: socket.socket, conn: h11.Connection, request: h11.Request,
                      raw: bytes) -> None:
        method, path = request.method, request.target.split(b"?", 1)[0]
        request_id = next((v.decode() for k, v in request.headers if k == b"x-request-id"),
                          None) or str(next(self._ids))
        if method == b"GET" and path == b"/health":
            await self._json(sock, conn, 200, b"", request_id)
        elif method == b"GET" and path == b"/v1/models":
            await self._json(sock, conn, 200, orjson.dumps({"object": "list", "data": [{
                "id": self.model, "object": "model", "created": 0, "owned_by": "vllm",
                "root": self.model, "parent": None, "max_model_len": 4096}]}), request_id)
        elif method == b"POST" and (
                path in (b"/v1/chat/completions", b"/v1/completions")
                or (path == b"/v1/embeddings" and self.role in ("decode", "prefill_decode"))):
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body = None
            if not isinstance(body, dict):
                await self._bad_request(sock, conn, "request body must be a JSON object",
                                        request_id)
            elif path != b"/v1/embeddings":
                self.answered += 1
                await self._completion(sock, conn, body, path == b"/v1/chat/completions",
                                       request_id)
            elif not isinstance(inputs := body.get("input"), (str, list)) or not inputs:
                await self._bad_request(sock, conn, "input must be a string or a non-empty list",
                                        request_id)
            else:
                self.answered += 1
                await self._embeddings(sock, conn, body, inputs, request_id)
        else:
            await self._json(sock, conn, 404, orjson.dumps({"detail": "Not Found"}), request_id)

    async def _json(self, sock: socket.socket, conn: h11.Connection, status: int, content: bytes,
                    request_id: str) -> None:
        head = conn.send(h11.Response(status_code=status, headers=[
            ("content-type", "application/json"), ("content-length", str(len(content))),
            ("x-request-id", request_id)], reason=_REASONS.get(status, b"")))
        data = conn.send(h11.Data(data=content)) if content else b""
        await _send_all(sock, head + data + conn.send(h11.EndOfMessage()))

    async def _completion(self, sock: socket.socket, conn: h11.Connection, body: dict[str, Any],
                          chat: bool, request_id: str) -> None:
        model = body.get("model", self.model)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        created = int(time.time())
        if self.role in ("encode", "prefill"):
            await trio.sleep(self.prefill_time)
            answer = (self._encoder_answer(rid, created, model, body) if self.role == "encode"
                      else self._text_answer(rid, created, model, chat, 1, request_id, body))
            await self._json(sock, conn, 200, orjson.dumps(answer), request_id)
            return
        tokens = _token_limit(body, self.tokens)
        if body.get("stream") is not True:
            await trio.sleep(self.token_interval * tokens)
            await self._json(sock, conn, 200, orjson.dumps(
                self._text_answer(rid, created, model, chat, tokens, request_id, body)),
                request_id)
            return
        # The head first, as vLLM sends it once the request is accepted; then the engine writes.
        await _send_all(sock, conn.send(h11.Response(status_code=200, headers=[
            ("content-type", "text/event-stream"), ("x-request-id", request_id)], reason=b"OK")))
        stream = _new_stream(sock, rid, created, model, chat, tokens)
        if tokens <= 0:
            stream.write(chunk(_DONE))
        elif self.pacing == "stream":
            # Its own grid, from its own start (a late step runs at once, as the engine's does).
            deadline = trio.current_time()
            while stream.left > 0:
                deadline = max(deadline + self.token_interval,
                               trio.current_time() - self.token_interval)
                await trio.sleep_until(deadline)
                stream.step()
                await self._flush(stream)
        else:
            self.engine.add(stream)
            while not stream.finished:
                # Woken by the engine: a backlog to flush (the socket was full), or the end.
                await stream.wake.wait()
                stream.wake = trio.Event()
                await self._flush(stream)
        await self._flush(stream)
        if stream.broken:
            raise BrokenPipeError("client went away")
        await _send_all(sock, conn.send(h11.EndOfMessage()))

    async def _bad_request(self, sock: socket.socket, conn: h11.Connection, message: str,
                           request_id: str) -> None:
        await self._json(sock, conn, 400, orjson.dumps({"error": {
            "message": message, "type": "BadRequestError", "param": None, "code": 400}}),
            request_id)

    async def _embeddings(self, sock: socket.socket, conn: h11.Connection, body: dict[str, Any],
                          inputs: str | list[Any], request_id: str) -> None:
        texts = [inputs] if isinstance(inputs, str) else inputs
        await trio.sleep(self.prefill_time)
        tokens = 8 * len(texts)
        await self._json(sock, conn, 200, orjson.dumps({
            "id": f"embd-{request_id}", "object": "list", "created": int(time.time()),
            "model": body.get("model", self.model),
            "data": [{"index": i, "object": "embedding", "embedding": _VECTOR}
                     for i in range(len(texts))],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                      "completion_tokens": 0}}), request_id)

    async def _flush(self, stream: Stream) -> None:
        # While this task sends, the engine appends to the backlog instead of sending itself.
        stream.flushing = True
        try:
            while stream.backlog:
                data, stream.backlog = bytes(stream.backlog), bytearray()
                await _send_all(stream.sock, data)
        finally:
            stream.flushing = False

    def _text_answer(self, rid: str, created: int, model: Any, chat: bool, tokens: int,
                     request_id: str, body: dict[str, Any]) -> dict[str, Any]:
        words = itertools.cycle(_WORDS)
        text = "".join(orjson.loads(next(words)) for _ in range(tokens)).lstrip()
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
             "finish_reason": "length", "stop_reason": None} if chat else
            {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
             "stop_reason": None})
        answer = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                  "created": created, "model": model, "choices": [choice],
                  "usage": {"prompt_tokens": 8, "completion_tokens": tokens,
                            "total_tokens": 8 + tokens}}
        params = body.get("kv_transfer_params")
        if self.role == "prefill" and isinstance(params, dict) and params.get("do_remote_decode"):
            port = int(self.url.rsplit(":", 1)[-1])
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [[1, 2, 3]], "remote_engine_id": f"lean-prefill-{port}",
                "remote_request_id": request_id, "remote_host": "127.0.0.1",
                "remote_port": port + 1, "tp_size": 1}
        return answer

    def _encoder_answer(self, rid: str, created: int, model: Any,
                        body: dict[str, Any]) -> dict[str, Any]:
        ec: dict[str, Any] = {}
        for index, part in enumerate(media_parts(body)):
            key = part.get("uuid") or hashlib.sha256(
                orjson.dumps(part, option=orjson.OPT_SORT_KEYS)).hexdigest()
            ec[key] = {"item_indices": [index], "metadata": {"image_grid_thw": [1, 4, 4]}}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": "length", "stop_reason": None}],
                "usage": {"prompt_tokens": len(ec), "completion_tokens": 0,
                          "total_tokens": len(ec)},
                "ec_transfer_params": ec}


def _new_stream(sock: socket.socket, rid: str, created: int, model: Any, chat: bool,
                tokens: int) -> Stream:
    base = orjson.dumps({"id": rid, "object": "chat.completion.chunk" if chat else
                         "text_completion", "created": created, "model": model})[:-1]
    if chat:
        prefix = b'data: ' + base + b',"choices":[{"index":0,"delta":{"content":'
        suffix = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        last = b'},"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
        first = (b'data: ' + base + b',"choices":[{"index":0,"delta":{"role":"assistant",'
                 b'"content":""},"logprobs":null,"finish_reason":null}]}\n\n')
    else:
        prefix = b'data: ' + base + b',"choices":[{"index":0,"text":'
        suffix = b',"logprobs":null,"finish_reason":null}]}\n\n'
        last = b',"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
        first = None
    return Stream(sock, prefix, suffix, last, first, tokens)


def _token_limit(body: dict[str, Any], default: int) -> int:
    limits = [v for k in ("max_tokens", "max_completion_tokens")
              if isinstance(v := body.get(k), int) and not isinstance(v, bool)]
    return max(min(limits) if limits else default, 0)




async def serve_fakes(args: argparse.Namespace) -> None:
    async with trio.open_nursery() as nursery:
        decode_role = "decode" if args.prefills else "prefill_decode"
        for role, count, name in (("encode", args.encoders, "ENCODE"),
                                  ("prefill", args.prefills, "PREFILL"),
                                  (decode_role, args.decodes, "DECODE")):
            urls = []
            for _ in range(count):
                fake = LeanFake(role, token_interval=args.token_interval,
                                prefill_time=args.prefill_time, tokens=args.tokens,
                                pacing=args.pacing)
                urls.append(await nursery.start(fake.serve, args.host))
            if urls:
                print(f"EPD_{name}_URLS={','.join(urls)}", flush=True)
        others = []
        for model in args.other_models:
            # One combined instance per other model, serving that name alone (bench.compare's
            # ``+pools`` peer gives each a pool of its own beside the measured one).
            fake = LeanFake("prefill_decode", token_interval=args.token_interval,
                            prefill_time=args.prefill_time, tokens=args.tokens,
                            pacing=args.pacing, model=model)
            others.append(f"{model}={await nursery.start(fake.serve, args.host)}")
        if others:
            print(f"EPD_OTHER_URLS={','.join(others)}", flush=True)
        print("ready", flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
        nursery.cancel_scope.cancel()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.lean_fake", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--encoders", type=int, default=0)
    p.add_argument("--prefills", type=int, default=1,
                   help="0 makes the decodes prefill_decode instances")
    p.add_argument("--decodes", type=int, default=1)
    p.add_argument("--token-interval", type=float, default=DEFAULT_TOKEN_INTERVAL,
                   help=f"seconds between two tokens of a stream (default {DEFAULT_TOKEN_INTERVAL})")
    p.add_argument("--prefill-time", type=float, default=DEFAULT_PREFILL_TIME,
                   help=f"seconds a prefill or encode takes (default {DEFAULT_PREFILL_TIME})")
    p.add_argument("--pacing", choices=PACINGS, default="engine",
                   help="engine: every stream's tokens on one shared grid, as an engine steps "
                   "its batch (default); stream: each stream on a timer of its own")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help="tokens when the request sets no max_tokens")
    p.add_argument("--other-models", type=lambda v: [m for m in v.split(",") if m], default=[],
                   metavar="NAME,...", help="one more combined instance per name, serving that "
                   "model alone (printed as EPD_OTHER_URLS=NAME=URL,...)")
    args = p.parse_args(argv)
    if args.decodes < 1:
        p.error("--decodes must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    trio.run(serve_fakes, parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
