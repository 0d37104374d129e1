"""LoRA adapters and the other endpoints through the proxy, on real vLLM 0.32 servers (CPU).

Three servers of their own (``cluster.start_lora_cluster``): a prefill and a decode of the tiny
text model, NIXL between them, LoRA on and holding a tiny random adapter ``sql`` (PEFT's
format, written locally: ``make_tiny_lora.py``), runtime loading allowed; and the text model as
a pooling instance (``tiny-embed``). One proxy in front of all three, told nothing about the
adapters: it learns ``sql`` from the servers' ``/v1/models`` cards (``parent`` tiny), and loads
``sql2`` on demand (``[adapters."sql2"]``, ``EPD_LORA_LOAD``). Answers are compared with the
decode server's own (greedy, ``temperature`` 0), as in ``test_real_vllm``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from epd_trio import Instance, Settings
from epd_trio._core.config import parse_setting
from epd_trio.testing import serve_proxy

from .cluster import MODEL_NAME, POOLER_MODEL, start_lora_cluster
from .provision import Home, ensure_adapter
from .test_real_vllm import COMPLETIONS, metric, wait_metric

pytestmark = pytest.mark.vllm_e2e

Observe = Callable[[str], None]
PULLS = "vllm:nixl_xfer_time_seconds_count"


def prompt(model: str, text: str) -> dict[str, Any]:
    return {"model": model, "prompt": text, "max_tokens": 8, "temperature": 0}


async def test_adapters_on_prefill_and_decode_and_embeddings_through_the_proxy(
    client: httpx.AsyncClient, observe: Observe, say: Callable[[str], None],
) -> None:
    home = Home.from_env()
    sql = await trio.to_thread.run_sync(partial(ensure_adapter, home, "sql", 1, say))
    sql2 = await trio.to_thread.run_sync(partial(ensure_adapter, home, "sql2", 2, say))
    servers = await trio.to_thread.run_sync(partial(start_lora_cluster, sql, home, log=say))
    try:
        prefill, decode, pooler = (servers.url(name) for name in
                                   ("lora-prefill", "lora-decode", "pooler"))
        settings = Settings(
            prefill_urls=(Instance(prefill),), decode_urls=(Instance(decode), Instance(pooler)),
            adapters=parse_setting("adapters", {"sql2": {"base": MODEL_NAME,
                                                          "path": str(sql2)}}, "adapters"),
            lora_load=True)
        async with serve_proxy(settings) as (url, _proxy):
            listing = (await client.get(url + "/v1/models")).json()
            cards = {card["id"]: card for card in listing["data"]}
            assert cards["sql"]["parent"] == MODEL_NAME and cards["sql"]["root"] == str(sql)
            assert cards["sql2"]["parent"] == MODEL_NAME  # configured: loadable
            assert POOLER_MODEL in cards

            # 1. The adapter P -> D: the decode pulled the prefill's KV, and the answer is the
            # decode server's own for the adapter, which is not the base model's.
            pulls = await metric(client, decode, PULLS)
            body = prompt("sql", "Count on please: one two three four")
            proxied = await client.post(url + COMPLETIONS, json=body)
            assert proxied.status_code == 200, proxied.text
            await wait_metric(client, decode, PULLS, lambda v: v >= pulls + 1)
            direct = await client.post(decode + COMPLETIONS, json=body)
            base = await client.post(decode + COMPLETIONS, json={**body, "model": MODEL_NAME})
            text = proxied.json()["choices"][0]["text"]
            assert text == direct.json()["choices"][0]["text"]
            assert text != base.json()["choices"][0]["text"]
            assert proxied.json()["model"] == "sql"

            # 2. A second adapter, loaded through the proxy on both legs on demand.
            body = prompt("sql2", "Count on please: five six seven")
            started = trio.current_time()
            proxied = await client.post(url + COMPLETIONS, json=body)
            first = trio.current_time() - started
            assert proxied.status_code == 200, proxied.text
            started = trio.current_time()
            again = await client.post(url + COMPLETIONS, json=body)
            later = trio.current_time() - started
            assert again.json()["choices"] == proxied.json()["choices"]
            for server in (prefill, decode):
                names = [c["id"] for c in (await client.get(server + "/v1/models")).json()["data"]]
                assert "sql2" in names, (server, names)
            direct = await client.post(decode + COMPLETIONS, json=body)
            assert proxied.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]

            # 3. Embeddings of the pooling instance: the proxy's answer is the server's own.
            body = {"model": POOLER_MODEL, "input": ["hello world", "tiny models"]}
            proxied = await client.post(url + "/v1/embeddings", json=body)
            assert proxied.status_code == 200, proxied.text
            direct = await client.post(pooler + "/v1/embeddings", json=body)
            assert [d["embedding"] for d in proxied.json()["data"]] == [
                d["embedding"] for d in direct.json()["data"]]
            # A generate model asked for embeddings answers as vLLM does, relayed.
            wrong = await client.post(url + "/v1/embeddings",
                                      json={"model": MODEL_NAME, "input": "x"})
            own = await client.post(decode + "/v1/embeddings",
                                    json={"model": MODEL_NAME, "input": "x"})
            assert (wrong.status_code, wrong.content) == (own.status_code, own.content)
    finally:
        await trio.to_thread.run_sync(servers.stop)
    observe(f"adapter sql P -> D through the proxy = decode's own answer ({text!r}), != the "
            f"base's; sql2 loaded on demand on P and D by the proxy, = decode's own (its first "
            f"request {first:.2f} s with the loads, the next {later:.2f} s); "
            "/v1/embeddings of tiny-embed = the pooler's own; a generate model's embeddings "
            f"error relayed as vLLM's ({wrong.status_code})")
