"""Several models behind one proxy, on real vLLM 0.32 servers (CPU): the pools come from what the
servers say at ``/v1/models``, and each request reaches only its own model's engine.

Two plain servers of their own (no connector), each under its own served names: the tiny text
model as ``tiny-text``, the tiny vision model as ``tiny-vision`` and ``tiny-vl`` (two names, one
engine). The proxy is given both in one list (``--decode``) and told nothing else about them
but an alias over the two models. Which engine served a request is read from each server's own
counter of finished requests (``vllm:request_success_total``): a request that reaches no engine
moves no counter. These run before the session's E/P/D cluster starts (conftest.OWN_SERVER), so
no more than two engines busy-poll beside them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from epd_trio import Instance, Settings
from epd_trio.testing import serve_proxy

from .cluster import Cluster, start_single
from .test_real_vllm import COMPLETIONS, metric, wait_metric

pytestmark = pytest.mark.vllm_e2e

Observe = Callable[[str], None]
FINISHED = "vllm:request_success_total"
#: What each server is started with: its model, and its served names (the first is the one
#: its answers carry).
SERVERS = {"text": ("text", ("tiny-text",)), "vision": ("vision", ("tiny-vision", "tiny-vl"))}


def prompt(model: str, text: str) -> dict[str, Any]:
    return {"model": model, "prompt": text, "max_tokens": 8, "temperature": 0}


async def start_both(say: Callable[[str], None]) -> dict[str, Cluster]:
    """The two servers, started at once (each a minute or less)."""
    started: dict[str, Cluster] = {}

    async def one(name: str) -> None:
        model, names = SERVERS[name]
        started[name] = await trio.to_thread.run_sync(partial(
            start_single, model=model, name=f"models-{name}", log=say,
            args=["--served-model-name", *names]))

    try:
        async with trio.open_nursery() as nursery:
            for name in SERVERS:
                nursery.start_soon(one, name)
    except BaseException:
        for server in started.values():
            await trio.to_thread.run_sync(server.stop)
        raise
    return started


async def test_two_real_models_each_reach_only_their_own_engine(
    client: httpx.AsyncClient, observe: Observe, say: Callable[[str], None],
) -> None:
    servers = await start_both(say)
    try:
        text, vision = (servers[name].url(f"models-{name}") for name in ("text", "vision"))
        settings = Settings(decode_urls=(Instance(text), Instance(vision)),
                            model_aliases={"tiny-any": {"targets": ["tiny-text", "tiny-vision"]}})
        async with serve_proxy(settings) as (url, _proxy):
            listing = (await client.get(url + "/v1/models")).json()
            # Every served name of every server, once, with the servers' own cards; then the
            # alias. The vision server's second name is a pool of its own (SGLang's gateway
            # read only the first entry).
            assert [card["id"] for card in listing["data"]] == [
                "tiny-text", "tiny-vision", "tiny-vl", "tiny-any"]
            cards = {card["id"]: card for card in listing["data"]}
            assert cards["tiny-text"]["root"].endswith("tiny-text-r1")
            assert cards["tiny-vl"]["root"] == cards["tiny-vision"]["root"]
            assert cards["tiny-text"]["max_model_len"] == 4096

            async def finished() -> dict[str, float]:
                return {name: await metric(client, server, FINISHED)
                        for name, server in (("text", text), ("vision", vision))}

            async def settled(expected: dict[str, float]) -> None:
                for name, server in (("text", text), ("vision", vision)):
                    await wait_metric(client, server, FINISHED,
                                      lambda v, n=expected[name]: v == n)

            counts = await finished()
            # Each model through the proxy: the same greedy answer as its engine's own, and
            # only its engine moved (its own direct request included: +2).
            for model, name, server in (("tiny-text", "text", text),
                                        ("tiny-vision", "vision", vision),
                                        ("tiny-vl", "vision", vision)):
                body = prompt(model, f"Count on for {model}: one two three")
                proxied = await client.post(url + COMPLETIONS, json=body)
                assert proxied.status_code == 200, proxied.text
                direct = await client.post(server + COMPLETIONS, json=body)
                assert direct.status_code == 200, direct.text
                assert proxied.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
                # The answer names the model as the engine writes it: its first served name.
                assert proxied.json()["model"] == SERVERS[name][1][0]
                counts[name] += 2
                await settled(counts)

            # A name nobody serves: vLLM's own 404, from the proxy, no engine touched.
            nosuch = await client.post(url + COMPLETIONS, json=prompt("nosuch", "hello"))
            assert nosuch.status_code == 404
            assert nosuch.json() == {"error": {
                "message": "The model `nosuch` does not exist.", "type": "NotFoundError",
                "param": "model", "code": 404}}
            # vLLM's own answer to it lists its names: the proxy's does not.
            own = await client.post(text + COMPLETIONS, json=prompt("nosuch", "hello"))
            assert own.status_code == 404 and "Valid" in own.json()["error"]["message"]
            await settled(counts)

            # The alias: exact turns, one request to each model in every two.
            answered = Counter()
            for n in range(4):
                r = await client.post(url + COMPLETIONS, json=prompt("tiny-any", f"alias {n}"))
                assert r.status_code == 200, r.text
                answered[r.json()["model"]] += 1
            assert answered == {"tiny-text": 2, "tiny-vision": 2}
            counts["text"] += 2
            counts["vision"] += 2
            await settled(counts)
    finally:
        for server in servers.values():
            await trio.to_thread.run_sync(server.stop)
    observe("two servers, tiny-text and tiny-vision (+ tiny-vl on the same engine): 4 names "
            "listed from their /v1/models; each model's requests moved only its own engine's "
            "counter, answers equal to the engine's own; nosuch: the proxy's 404, no engine "
            "touched; alias tiny-any: 2 + 2")
