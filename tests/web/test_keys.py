"""Client API keys on the OpenAI routes, and the key the proxy sends to vLLM (over real sockets)."""

from __future__ import annotations

import httpx

from epd_trio.testing import run_cluster

from helpers import CHAT, chat_body, image


async def test_client_keys_guard_the_openai_routes_only(client: httpx.AsyncClient) -> None:
    async with run_cluster(prefills=1, decodes=1, api_keys=("k1", "k2")) as c:
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "k1"},
                        {"authorization": "Basic azE6"}):
            for method, path, kwargs in (("POST", CHAT, {"json": chat_body()}),
                                         ("POST", "/v1/completions",
                                          {"json": {"model": "m", "prompt": "hi"}}),
                                         ("GET", "/v1/models", {})):
                r = await client.request(method, c.proxy_url + path, headers=headers, **kwargs)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["type"] == "invalid_request_error"
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"] == "Bearer"
        assert not c.decodes[0].requests() and not c.prefills[0].requests()

        r = await client.post(c.proxy_url + CHAT, json=chat_body(),
                              headers={"authorization": "Bearer k2"})
        assert r.status_code == 200
        r = await client.get(c.proxy_url + "/v1/models", headers={"authorization": "bearer k1"})
        assert r.status_code == 200
        # The client's key is the proxy's business: it does not travel upstream.
        assert all("authorization" not in x.headers for x in c.decodes[0].received)
        for path in ("/health", "/ready"):
            assert (await client.get(c.proxy_url + path)).status_code in (200, 503)


async def test_upstream_key_goes_on_every_call_to_vllm(client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=1, prefills=1, decodes=1, upstream_api_key="up-key",
                           health_interval=0.05) as c:
        for fake in c.fakes:
            fake.api_key = "up-key"  # like `vllm serve --api-key up-key`
            fake.behaviour.profiler = True
        r = await client.post(c.proxy_url + CHAT, json=chat_body(image(0)))
        assert r.status_code == 200
        assert (await client.get(c.proxy_url + "/v1/models")).status_code == 200
        assert (await client.post(c.proxy_url + "/start_profile")).json()["ok"] == 3
        for fake in c.fakes:
            await fake.wait_until(lambda f=fake: any(x.path == "/health" for x in f.received))
            paths = {x.path for x in fake.received}
            assert {"/health", "/start_profile"} <= paths and any(p.startswith("/v1/") for p in paths)
            assert all(x.headers.get("authorization") == "Bearer up-key" for x in fake.received)


async def test_without_the_upstream_key_vllm_refuses(client: httpx.AsyncClient) -> None:
    """vLLM's 401 refuses the proxy's key, not the client's: a 502 that says so, not a relay."""
    async with run_cluster(decodes=1) as c:
        c.decodes[0].api_key = "up-key"
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["stage"] == "decode" and error["instance"] == c.decodes[0].url
        assert "HTTP 401" in error["message"] and "EPD_UPSTREAM_API_KEY" in error["message"]
        assert len(c.decodes[0].requests()) == 1  # not retried: the key is the proxy's
