"""The load as an OpenAI SDK program sends it: ``bench.compare --client openai``.

Why: the OpenAI Python SDK (on httpx) is the client most users of a vLLM endpoint run, and it
writes a request's head and body as two sends, parses every SSE chunk into a model object, and
keeps its connections in httpx's pool. This is a plain ``openai.AsyncOpenAI`` on asyncio's
default loop, as an application would use it: ``concurrency`` tasks, each calling
``chat.completions.create`` with its next body when the previous answer is complete (so each
keeps a pooled connection alive), no retries (a retry would hide a failure).

It runs as a separate process under a Python that has the SDK (``--openai-python``; by default
``~/.cache/epd-refs/openai-venv``, which ``bench/install_references.sh`` makes): the SDK is no
dependency of epd_trio. Standard library and openai only. Input: one request body per line in
``--bodies`` (its fields become the call's arguments). Output on stdout: one JSON object,
``{"cpu": seconds, "results": [...]}``, each result with the fields of ``bench._load.Result``;
``cpu`` is this process's CPU during the load only (its start-up and imports excluded).
``size`` is 0: the SDK hands over parsed objects, not bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


async def _one(client, body: dict, index: int, record_gaps: bool) -> dict:
    import openai

    t0 = time.monotonic()
    ttfb = None
    status = None
    events = 0
    stream = bool(body.get("stream"))
    gaps: list[float] | None = [] if stream and record_gaps else None
    last = None
    error = None
    try:
        if stream:
            answer = await client.chat.completions.create(**body)
            status = answer.response.status_code
            async for _chunk in answer:
                now = time.monotonic()
                if ttfb is None:
                    ttfb = now - t0
                events += 1
                if gaps is not None:
                    if last is not None:
                        gaps.append(now - last)
                    last = now
        else:
            await client.chat.completions.create(**body)
            status = 200
            ttfb = time.monotonic() - t0
    except openai.APIStatusError as exc:
        status, error = exc.status_code, f"HTTP {exc.status_code}"
    except openai.APITimeoutError:
        error = "timeout"
    except openai.APIConnectionError as exc:
        error = "connection refused" if "refused" in str(exc.__cause__).lower() else \
            "connection reset"
    except openai.APIError as exc:  # an error event inside the stream
        error = f"error event in stream: {exc.message[:80]}"
    return {"index": index, "started": t0, "latency": time.monotonic() - t0, "ttfb": ttfb,
            "status": status, "error": error, "size": 0, "events": events, "gaps": gaps}


async def _run(args: argparse.Namespace, bodies: list[dict]) -> list[dict]:
    import openai

    results: list[dict] = []
    next_index = iter(range(len(bodies)))
    async with openai.AsyncOpenAI(base_url=f"http://{args.host}:{args.port}/v1",
                                  api_key="unused", max_retries=0,
                                  timeout=args.timeout) as client:

        async def worker() -> None:
            for index in next_index:
                results.append(await _one(client, bodies[index], index, args.record_gaps))

        await asyncio.gather(*(worker() for _ in range(min(args.concurrency, len(bodies)))))
    return sorted(results, key=lambda r: r["index"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/_openai_load.py")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--path", default="/v1/chat/completions",
                   help="only the chat endpoint: the SDK names its own paths")
    p.add_argument("--bodies", required=True, help="a file with one request body per line")
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--stream", action="store_true", help="(each body says so itself)")
    p.add_argument("--record-gaps", action="store_true")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    if args.path != "/v1/chat/completions":
        p.error("--path: the OpenAI client loads /v1/chat/completions only")
    with open(args.bodies, "rb") as f:
        bodies = [json.loads(line) for line in f.read().splitlines()]
    cpu0 = _cpu()
    results = asyncio.run(_run(args, bodies))
    json.dump({"cpu": _cpu() - cpu0, "results": results}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
