"""The load as an OpenAI SDK program sends it: ``bench.compare --client openai``.

Why: the OpenAI Python SDK (on httpx) is the client most users of a vLLM endpoint run, and it
writes a request's head and body as two sends, parses every SSE chunk into a model object, and
keeps its connections in httpx's pool. This is a plain ``openai.AsyncOpenAI`` on asyncio's
default loop, as an application would use it: ``concurrency`` tasks, each calling
``chat.completions.create`` with its next body when the previous answer is complete (so each
keeps a pooled connection alive), no retries (a retry would hide a failure).

It runs as a separate process under a Python that has the SDK (``--openai-python``; by default
``~/.cache/epd-refs/openai-venv``, which ``bench/install_references.sh`` makes): the SDK is no
dependency of epd_trio. Standard library, openai and ``_client_process`` (its neighbour) only.
Input: one request body per line in ``--bodies`` (its fields become the call's arguments).
Output on stdout: one JSON object, ``{"cpu": seconds, "results": [...]}``, each result with the
fields of ``bench._load.Result``; ``cpu`` is this process's CPU during the load only (its
start-up and imports excluded).
``size`` is 0: the SDK hands over parsed objects, not bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from _client_process import parse_args, read_bodies, report, run_workers


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

    async with openai.AsyncOpenAI(base_url=f"http://{args.host}:{args.port}/v1",
                                  api_key="unused", max_retries=0,
                                  timeout=args.timeout) as client:
        return await run_workers(
            lambda index: _one(client, bodies[index], index, args.record_gaps),
            len(bodies), args.concurrency)


def main(argv: list[str] | None = None) -> int:
    # The SDK names its own path, and each body says whether it streams: --path must be the
    # chat endpoint, and --stream is taken from the bodies.
    args = parse_args("python bench/_openai_load.py", argv)
    if args.path != "/v1/chat/completions":
        sys.exit("--path: the OpenAI client loads /v1/chat/completions only")
    bodies = [json.loads(line) for line in read_bodies(args.bodies)]
    return report(lambda: _run(args, bodies))


if __name__ == "__main__":
    sys.exit(main())
