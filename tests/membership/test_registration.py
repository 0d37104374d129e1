"""Instance self-registration over real sockets: admin key, bodies, listing, rotation, lifecycle."""

from __future__ import annotations

from typing import Any

import httpx
import trio

from epd_trio import Instance
from epd_trio.testing import Cluster, FakeVLLM, run_cluster
from epd_trio.testing.fake_vllm import Role

from helpers import CHAT, chat_body, image, start_fakes

KEY = "admin-secret"
ADMIN = {"x-api-key": KEY}


def registration(role: str, fake: FakeVLLM, **extra: Any) -> dict[str, Any]:
    return {"role": role, "url": fake.url, **extra}


async def register_new(
    client: httpx.AsyncClient, c: Cluster, nursery: trio.Nursery, role: Role
) -> FakeVLLM:
    """Start a fake instance and register it (as vLLM would itself)."""
    fake = FakeVLLM(role)
    await start_fakes(nursery, fake)
    r = await client.post(c.proxy_url + "/instances", headers=ADMIN, json=registration(role, fake))
    assert r.status_code == 200 and r.json() == {"registered": True}
    return fake


def assert_openai_error(r: httpx.Response, status: int, type_: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == type_ and isinstance(error["message"], str) and error["message"]
    return error


async def wait_ready(client: httpx.AsyncClient, c: Cluster, fake: FakeVLLM) -> None:
    """Until /ready says 200, re-asked after each request ``fake`` receives (no sleeps)."""
    with trio.fail_after(10):
        while (await client.get(c.proxy_url + "/ready")).status_code != 200:
            seen = len(fake.received)
            await fake.wait_until(lambda: len(fake.received) > seen)  # noqa: B023


async def test_zero_static_instances_until_one_registers(
    client: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    async with run_cluster(decodes=0, admin_key=KEY, health_interval=0.05) as c:
        assert (await client.get(c.proxy_url + "/ready")).status_code == 503
        health = await client.get(c.proxy_url + "/health")
        # Liveness: the process serves, so 200, saying nothing is there yet (a 503 here would
        # restart-loop a proxy whose instances only self-register).
        assert health.status_code == 200 and health.json()["layout"] == "none"
        assert health.json()["status"] == "unavailable"
        error = assert_openai_error(await client.post(c.proxy_url + CHAT, json=chat_body()),
                                    503, "service_unavailable")
        assert error["code"] == "no_instance" and "no decode instance" in error["message"]
        assert (await client.get(c.proxy_url + "/v1/models")).status_code == 503

        pd = await register_new(client, c, nursery, "prefill_decode")
        r = await client.post(c.proxy_url + "/instances", headers=ADMIN,
                              json=registration("prefill_decode", pd))
        assert r.status_code == 200 and r.json() == {"registered": False}

        r = await client.post(c.proxy_url + CHAT, json=chat_body(image(0)))
        assert r.status_code == 200 and len(pd.requests()) == 1
        await wait_ready(client, c, pd)
        health = await client.get(c.proxy_url + "/health")
        assert health.status_code == 200 and health.json()["layout"] == "PD"
        assert health.json()["status"] == "ok"


async def test_registering_an_encoder_keeps_a_ready_proxy_ready(
    client: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    """Issue 31: once every role has served, a newly registered instance (here the first
    encoder, not yet probed: its probes fail, below the threshold) leaves ``/ready`` at 200;
    it used to answer 503 until the newcomer's first successful probe. ``/health`` and
    ``/ready`` name a combined instance ``prefill_decode``, as ``/instances`` does."""
    async with run_cluster(decodes=0, admin_key=KEY, health_interval=3600) as c:
        pd = await register_new(client, c, nursery, "prefill_decode")
        assert (await client.post(c.proxy_url + CHAT, json=chat_body())).status_code == 200
        await wait_ready(client, c, pd)
        encoder = FakeVLLM("encode")
        encoder.behaviour.healthy = False  # never probed successfully
        await start_fakes(nursery, encoder)
        r = await client.post(c.proxy_url + "/instances", headers=ADMIN,
                              json=registration("encode", encoder))
        assert r.status_code == 200
        ready = await client.get(c.proxy_url + "/ready")
        assert ready.status_code == 200, ready.text
        assert set(ready.json()["roles"]) == {"encode", "prefill_decode"}
        health = (await client.get(c.proxy_url + "/health")).json()
        assert health["layout"] == "E+PD" and health["ready"] is True
        assert [e["url"] for e in health["roles"]["prefill_decode"]] == [pd.url]
        assert [e["probed"] for e in health["roles"]["encode"]] == [False]
        r = await client.post(c.proxy_url + CHAT, json=chat_body(image(0)))
        assert r.status_code == 200 and len(encoder.requests()) == 1


async def test_admin_routes_are_off_without_a_key_and_need_the_right_one(
    client: httpx.AsyncClient,
) -> None:
    calls = [("POST", {"json": {"role": "encode", "url": "http://e:1"}}), ("GET", {}),
             ("DELETE", {"params": {"url": "http://e:1"}})]
    async with run_cluster(decodes=1) as c:
        for method, kwargs in calls:
            r = await client.request(method, c.proxy_url + "/instances", headers=ADMIN, **kwargs)
            assert assert_openai_error(r, 403, "permission_error")["code"] == "admin_disabled"
    async with run_cluster(decodes=1, admin_key=KEY) as c:
        for method, kwargs in calls:
            for headers in ({}, {"x-api-key": "wrong"}, {"x-api-key": KEY + "x"}):
                r = await client.request(method, c.proxy_url + "/instances", headers=headers,
                                         **kwargs)
                error = assert_openai_error(r, 401, "invalid_request_error")
                assert error["code"] == "invalid_admin_key"
        assert (await client.get(c.proxy_url + "/instances", headers=ADMIN)).status_code == 200
        # The client API routes do not take the admin key as a bearer token or otherwise.
        assert (await client.post(c.proxy_url + CHAT, json=chat_body())).status_code == 200


async def test_bad_registrations_are_openai_errors(client: httpx.AsyncClient) -> None:
    async with run_cluster(prefills=1, decodes=1, admin_key=KEY) as c:
        url = c.proxy_url + "/instances"
        version = (await client.get(url, headers=ADMIN)).json()["version"]

        async def post(content: bytes | None = None, **body: Any) -> httpx.Response:
            if content is not None:
                return await client.post(url, headers=ADMIN, content=content)
            return await client.post(url, headers=ADMIN, json=body)

        assert_openai_error(await post(b"{"), 400, "invalid_request_error")
        assert_openai_error(await post(role="encode"), 400, "invalid_request_error")
        assert_openai_error(await post(role="encode", url="http://e:1", dp_size=0), 400,
                            "invalid_request_error")
        mix = assert_openai_error(await post(role="prefill_decode", url="http://pd:1"), 400,
                                  "invalid_request_error")
        assert "cannot mix" in mix["message"] and c.prefills[0].url in mix["message"]
        role_change = await post(role="encode", url=c.prefills[0].url)
        assert "already known as prefill" in assert_openai_error(role_change, 409,
                                                                 "conflict_error")["message"]
        r = await client.delete(url, headers=ADMIN)
        assert "'url' is required" in assert_openai_error(r, 400, "invalid_request_error")["message"]
        r = await client.get(url, headers=ADMIN)
        assert r.json()["version"] == version  # nothing above changed the roster


async def test_malformed_registrations_are_400s_naming_the_field(
    client: httpx.AsyncClient
) -> None:
    """Issue 31: ``"url": "http://127.0.0.1:99999"`` answered ``{"registered": true}`` and
    killed the prober of every worker; a URL's user and password reached clients. Each value
    of the fuzz table is a 400 naming its field, and the proxy still routes and probes."""
    from core.test_urls import BAD_URLS

    async with run_cluster(decodes=1, admin_key=KEY, health_interval=0.05) as c:
        url = c.proxy_url + "/instances"
        version = (await client.get(url, headers=ADMIN)).json()["version"]
        for bad in BAD_URLS:
            for role in ("encode", "decode"):
                r = await client.post(url, headers=ADMIN, json={"role": role, "url": bad})
                error = assert_openai_error(r, 400, "invalid_request_error")
                assert error["message"].startswith("'url': "), error["message"]
                assert "secret" not in r.text
        for dp_size in (0, 1025, 100000):
            r = await client.post(url, headers=ADMIN,
                                  json={"role": "decode", "url": "http://d:1", "dp_size": dp_size})
            error = assert_openai_error(r, 400, "invalid_request_error")
            assert error["message"].startswith("'dp_size' must be an integer from 1 to 1024")
        r = await client.delete(url, headers=ADMIN, params={"url": "http://u:secret@d:1"})
        assert "secret" not in assert_openai_error(r, 400, "invalid_request_error")["message"]
        listed = (await client.get(url, headers=ADMIN)).json()
        assert listed["version"] == version and "secret" not in str(listed)
        assert (await client.post(c.proxy_url + CHAT, json=chat_body())).status_code == 200
        seen = len(c.decodes[0].received)  # its prober is alive: it still asks /health
        with trio.fail_after(10):
            await c.decodes[0].wait_until(lambda: len(c.decodes[0].received) > seen + 1)


async def test_instances_lists_static_and_registered_and_delete_removes(
    client: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    async with run_cluster(encoders=1, decodes=1, admin_key=KEY) as c:
        before = (await client.get(c.proxy_url + "/instances", headers=ADMIN)).json()["version"]
        extra = await register_new(client, c, nursery, "encode")
        listing = (await client.get(c.proxy_url + "/instances", headers=ADMIN)).json()
        # Two versions: the registration, then what the instance said it serves.
        assert listing["layout"] == "E+PD" and listing["version"] == before + 2
        assert [(e["models"], e["models_from"]) for e in listing["instances"]["encode"]] == [
            (["fake-model"], "/v1/models")] * 2
        encoders = listing["instances"]["encode"]
        assert [(e["url"], e["source"], e["state"]) for e in encoders] == [
            (c.encoders[0].url, "static", "healthy"), (extra.url, "registered", "healthy")]
        assert encoders[1]["registered_seconds_ago"] >= 0 and encoders[1]["ec_zmq_addrs"] == []
        assert [d["url"] for d in listing["instances"]["decode"]] == [c.decodes[0].url]
        assert listing["instances"]["prefill"] == listing["instances"]["prefill_decode"] == []

        r = await client.delete(c.proxy_url + "/instances", headers=ADMIN,
                                params={"url": extra.url + "/"})
        assert r.json() == {"removed": True}
        r = await client.delete(c.proxy_url + "/instances", headers=ADMIN,
                                params={"url": extra.url})
        assert r.json() == {"removed": False}
        # vLLM's registrar sends its registration body with the DELETE instead of a query.
        r = await client.request("DELETE", c.proxy_url + "/instances", headers=ADMIN,
                                 json=registration("encode", c.encoders[0]))
        assert r.json() == {"removed": True}
        listing = (await client.get(c.proxy_url + "/instances", headers=ADMIN)).json()
        assert listing["instances"]["encode"] == [] and listing["layout"] == "PD"
        # Without encoders, media goes straight to decode.
        r = await client.post(c.proxy_url + CHAT, json=chat_body(image(1)))
        assert r.status_code == 200 and len(c.encoders[0].requests()) == 0


async def test_a_registration_continues_the_encoder_rotation(
    client: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    async with run_cluster(encoders=2, decodes=1, admin_key=KEY) as c:
        late = FakeVLLM("encode")
        await start_fakes(nursery, late)
        encoders = [*c.encoders, late]

        async def owners(first: int, count: int) -> list[int]:
            out = []
            for n in range(first, first + count):
                r = await client.post(c.proxy_url + CHAT, json=chat_body(image(n)),
                                      headers={"x-request-id": f"r{n}"})
                assert r.status_code == 200
                out += [i for i, e in enumerate(encoders)
                        if any(x.request_id == f"r{n}-enc-0" for x in e.requests())]
            return out

        assert await owners(0, 3) == [0, 1, 0]
        await client.post(c.proxy_url + "/instances", headers=ADMIN,
                          json=registration("encode", late))
        # Encoder 1 was next and stays next (no reset to 0); the newcomer follows it.
        assert await owners(3, 5) == [1, 2, 0, 1, 2]
        await client.delete(c.proxy_url + "/instances", headers=ADMIN, params={"url": late.url})
        assert await owners(8, 3) == [0, 1, 0]


async def test_a_removed_instance_keeps_its_client_until_its_requests_end(
    client: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    async with run_cluster(decodes=0, admin_key=KEY, health_interval=3600) as c:
        pd = await register_new(client, c, nursery, "prefill_decode")
        gate = trio.Event()
        pd.behaviour.gate = gate.wait
        statuses: list[int] = []

        async def one() -> None:
            statuses.append((await client.post(c.proxy_url + CHAT, json=chat_body())).status_code)

        async with trio.open_nursery() as requests:
            requests.start_soon(one)
            await pd.wait_until(lambda: pd.in_flight == 1)
            upstream = c.proxy.client(Instance(pd.url))
            r = await client.delete(c.proxy_url + "/instances", headers=ADMIN,
                                    params={"url": pd.url})
            assert r.json() == {"removed": True}
            assert await c.proxy.reap_clients() == 0 and not upstream.is_closed
            gate.set()
        assert statuses == [200]  # the request routed there before the removal finished there
        assert await c.proxy.reap_clients() == 1 and upstream.is_closed
        assert (await client.post(c.proxy_url + CHAT, json=chat_body())).status_code == 503


async def test_a_silent_evicted_instance_is_forgotten_after_the_ttl(
    client: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    # The default threshold: a stopped server refuses, which evicts at once, while one slow
    # probe of a busy machine does not.
    async with run_cluster(encoders=1, decodes=1, admin_key=KEY, health_interval=0.05,
                           instance_ttl=0.3) as c:
        gone = await register_new(client, c, nursery, "encode")
        for n in range(2):  # one image request each: both encoders now have a client
            assert (await client.post(c.proxy_url + CHAT, json=chat_body(image(n)))).status_code == 200
        assert len(gone.requests()) == 1
        upstream = c.proxy.client(Instance(gone.url))
        gone.stop()
        c.encoders[0].stop()  # a static one, down as long: never forgotten
        with trio.fail_after(20):
            await c.proxy.wait_roster(lambda roster: roster.find(gone.url) is None)
        assert [i.url for i in c.proxy.roster.of("encode")] == [c.encoders[0].url]
        assert upstream.is_closed  # the same housekeeping round closed its client
        listing = (await client.get(c.proxy_url + "/instances", headers=ADMIN)).json()
        assert [(e["url"], e["state"]) for e in listing["instances"]["encode"]] == [
            (c.encoders[0].url, "unhealthy")]
