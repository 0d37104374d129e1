"""A fake vLLM on aiohttp, paced per stream: ``bench.compare --fake aiohttp``.

    <python with aiohttp> bench/aiohttp_fake.py --prefills 1 --decodes 1 --token-interval 0.005

Why it exists: issue 33's independent lab measured the proxies behind fakes written this way
(an aiohttp server, each stream a handler that sleeps ``--token-interval`` and writes one
token), and read a ratio ``bench.compare`` on ``bench.lean_fake`` did not reproduce. The two
fakes differ in one thing that matters to a proxy: **when** tokens arrive. The lean fake's
engine steps every running stream on one shared grid, so all streams' tokens land in the same
instant and the proxy serves them in one wake-up; here each stream keeps its own timer, so
tokens of different streams arrive spread over the interval and a proxy wakes up for few of
them at a time, as behind a real server whose streams started at different moments.

Same command line and output as ``bench.lean_fake`` (``EPD_<ROLE>_URLS=...`` lines, then
``ready``; serves until SIGINT/SIGTERM), the same response shapes: the stream's head before
its first token, a chat stream's role chunk as a write of its own, one write per token, the
last carrying ``finish_reason``, then ``data: [DONE]``. Prefill returns a NIXL-shaped
``kv_transfer_params``, an encoder ``ec_transfer_params`` per item.

It runs under a Python that has aiohttp (``--fake-python``; by default the EPD proxy's
reference venv): aiohttp is no dependency of epd_trio, so this file uses the standard library
and aiohttp only.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import signal
import sys
import time

_WORDS = [json.dumps(" " + w).encode() for w in (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()]
_MEDIA = ("image_url", "audio_url", "input_audio", "video_url")


def _token_limit(body: dict, default: int) -> int:
    limits = [v for k in ("max_tokens", "max_completion_tokens")
              if isinstance(v := body.get(k), int) and not isinstance(v, bool)]
    return max(min(limits) if limits else default, 0)


def _media_parts(body: dict) -> list[dict]:
    return [part for message in body.get("messages") or () if isinstance(message, dict)
            and isinstance(message.get("content"), list) for part in message["content"]
            if isinstance(part, dict) and part.get("type") in _MEDIA]


class Fake:
    """One instance: its role decides what a completion request gets."""

    def __init__(self, role: str, args: argparse.Namespace) -> None:
        self.role, self.args, self.url = role, args, ""
        self._ids = itertools.count()

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", lambda _: web.Response(status=200))
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.completion)
        app.router.add_post("/v1/completions", self.completion)
        return app

    async def models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{
            "id": "fake-model", "object": "model", "created": 0, "owned_by": "vllm",
            "root": "fake-model", "parent": None, "max_model_len": 4096}]})

    async def completion(self, request):
        from aiohttp import web

        request_id = request.headers.get("x-request-id") or str(next(self._ids))
        try:
            body = json.loads(await request.read())
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "request body must be a JSON object",
                                                "type": "BadRequestError", "param": None,
                                                "code": 400}}, status=400)
        chat = request.path == "/v1/chat/completions"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        headers = {"x-request-id": request_id}
        if self.role in ("encode", "prefill"):
            await asyncio.sleep(self.args.prefill_time)
            answer = (self._encoder(rid, body) if self.role == "encode"
                      else self._text(rid, body, chat, 1, request_id))
            return web.json_response(answer, headers=headers)
        tokens = _token_limit(body, self.args.tokens)
        if body.get("stream") is not True:
            await asyncio.sleep(self.args.token_interval * tokens)
            return web.json_response(self._text(rid, body, chat, tokens, request_id),
                                     headers=headers)
        return await self._stream(request, rid, body, chat, tokens, headers)

    async def _stream(self, request, rid: str, body: dict, chat: bool, tokens: int,
                      headers: dict):
        from aiohttp import web

        response = web.StreamResponse(headers={"content-type": "text/event-stream", **headers})
        await response.prepare(request)  # the head before the first token, as vLLM sends it
        base = json.dumps({"id": rid, "object": "chat.completion.chunk" if chat
                           else "text_completion", "created": int(time.time()),
                           "model": body.get("model", "fake-model")},
                          separators=(",", ":")).encode()[:-1]
        if chat:
            prefix = b"data: " + base + b',"choices":[{"index":0,"delta":{"content":'
            suffix = b'},"logprobs":null,"finish_reason":null}]}\n\n'
            last = b'},"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
        else:
            prefix = b"data: " + base + b',"choices":[{"index":0,"text":'
            suffix = b',"logprobs":null,"finish_reason":null}]}\n\n'
            last = b',"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
        words = itertools.cycle(_WORDS)
        for index in range(tokens):
            await asyncio.sleep(self.args.token_interval)  # this stream's own timer
            if index == 0 and chat:
                await response.write(b"data: " + base + b',"choices":[{"index":0,"delta":'
                                     b'{"role":"assistant","content":""},"logprobs":null,'
                                     b'"finish_reason":null}]}\n\n')
            await response.write(prefix + next(words) + (last if index == tokens - 1
                                                         else suffix))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _text(self, rid: str, body: dict, chat: bool, tokens: int, request_id: str) -> dict:
        words = itertools.cycle(_WORDS)
        text = "".join(json.loads(next(words)) for _ in range(tokens)).lstrip()
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "logprobs": None, "finish_reason": "length", "stop_reason": None} if chat
                  else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                        "stop_reason": None})
        answer = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                  "created": int(time.time()), "model": body.get("model", "fake-model"),
                  "choices": [choice], "usage": {"prompt_tokens": 8,
                                                 "completion_tokens": tokens,
                                                 "total_tokens": 8 + tokens}}
        params = body.get("kv_transfer_params")
        if self.role == "prefill" and isinstance(params, dict) and params.get("do_remote_decode"):
            port = int(self.url.rsplit(":", 1)[-1])
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [[1, 2, 3]], "remote_engine_id": f"aiohttp-prefill-{port}",
                "remote_request_id": request_id, "remote_host": "127.0.0.1",
                "remote_port": port + 1, "tp_size": 1}
        return answer

    def _encoder(self, rid: str, body: dict) -> dict:
        ec = {}
        for index, part in enumerate(_media_parts(body)):
            key = part.get("uuid") or hashlib.sha256(
                json.dumps(part, sort_keys=True).encode()).hexdigest()
            ec[key] = {"item_indices": [index], "metadata": {"image_grid_thw": [1, 4, 4]}}
        return {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", "fake-model"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": "length", "stop_reason": None}],
                "usage": {"prompt_tokens": len(ec), "completion_tokens": 0,
                          "total_tokens": len(ec)}, "ec_transfer_params": ec}


async def serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    runners = []
    decode_role = "decode" if args.prefills else "prefill_decode"
    for role, count, name in (("encode", args.encoders, "ENCODE"),
                              ("prefill", args.prefills, "PREFILL"),
                              (decode_role, args.decodes, "DECODE")):
        urls = []
        for _ in range(count):
            fake = Fake(role, args)
            runner = web.AppRunner(fake.app(), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, args.host, 0, backlog=4096)
            await site.start()
            runners.append(runner)
            port = runner.addresses[0][1]
            fake.url = f"http://{args.host}:{port}"
            urls.append(fake.url)
        if urls:
            print(f"EPD_{name}_URLS={','.join(urls)}", flush=True)
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/aiohttp_fake.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--encoders", type=int, default=0)
    p.add_argument("--prefills", type=int, default=1)
    p.add_argument("--decodes", type=int, default=1)
    p.add_argument("--token-interval", type=float, default=0.002)
    p.add_argument("--prefill-time", type=float, default=0.002)
    p.add_argument("--tokens", type=int, default=16)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    asyncio.run(serve(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
