"""How fast a client disconnect reaches the upstream instance, per pipeline stage.

    python -m bench.cancel_latency [--reps 20]

For each stage (encoder fan-out, prefill, decode non-stream, decode stream) the stage's fake
instance holds the request; the client then closes its connection, and the time until the fake
sees its own connection from the proxy close is recorded (fake, proxy on Hypercorn's trio worker
and client share one process and one clock). Reports median / p90 / max in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics

import httpx
import trio

from epd_trio.testing import run_cluster
from epd_trio.testing.media import png_data_url

STAGES = ("encode", "prefill", "decode", "decode-stream")


async def _request(client: httpx.AsyncClient, url: str, body: dict, first_byte: trio.Event) -> None:
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for _ in r.aiter_raw():
            first_byte.set()


async def measure(stage: str, reps: int) -> list[float]:
    samples = []
    async with run_cluster(encoders=1, prefills=1, decodes=1, health_interval=3600) as c, \
            httpx.AsyncClient(trust_env=False, timeout=30) as client:
        target = {"encode": c.encoders[0], "prefill": c.prefills[0]}.get(stage, c.decodes[0])
        stream = stage == "decode-stream"
        if stream:
            target.behaviour.chunk_delay = 3600
        else:
            target.behaviour.hang = True
        for n in range(reps):
            body = {"model": "fake-model", "stream": stream, "messages": [{"role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": png_data_url(seed=n)}},
                                {"type": "text", "text": "hi"}]}]}
            first_byte = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_request, client, c.proxy_url, body, first_byte)
                with trio.fail_after(10):
                    if stream:
                        await first_byte.wait()
                    else:
                        await target.wait_until(lambda: target.in_flight == 1)
                cancelled_at = trio.current_time()
                nursery.cancel_scope.cancel()
            with trio.fail_after(10):
                await target.wait_until(lambda: target.in_flight == 0)
            record = target.requests()[-1]
            assert record.disconnected_at is not None, "the upstream leg was not cancelled"
            samples.append((record.disconnected_at - cancelled_at) * 1000)
    return samples


async def main(reps: int) -> None:
    print(f"client disconnect -> upstream connection closed ({reps} runs per stage)")
    print(f"{'stage':<14} {'median ms':>10} {'p90 ms':>8} {'max ms':>8}")
    for stage in STAGES:
        samples = sorted(await measure(stage, reps))
        p90 = samples[min(len(samples) - 1, int(len(samples) * 0.9))]
        print(f"{stage:<14} {statistics.median(samples):>10.2f} {p90:>8.2f} {samples[-1]:>8.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20)
    trio.run(main, parser.parse_args().reps)
