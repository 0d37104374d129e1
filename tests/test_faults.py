"""Failover, deadlines and broken upstreams, against fake vLLM servers over real sockets."""

from __future__ import annotations

from collections import Counter

import httpx
import orjson
import trio
import trio.testing

from epd_trio.testing import run_cluster

from helpers import CHAT, chat_body, image, retries


async def test_encoder_killed_mid_burst(client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=3, prefills=1, decodes=2, health_interval=3600,
                           health_threshold=2) as c:
        victim = c.encoders[1]
        for e in c.encoders:
            e.behaviour.latency = 0.01  # keep requests in flight when the kill comes
        state = c.proxy.registry.state("encode", victim.url)
        sent_at_eviction: list[int] = []
        c.proxy.registry.on_change.append(
            lambda s: sent_at_eviction.append(s.sent) if s is state and not s.live else None)
        outcomes: Counter[str] = Counter()
        errors: list[dict] = []

        async def one(n: int) -> None:
            with trio.move_on_after(60) as scope:
                r = await client.post(c.proxy_url + CHAT, json=chat_body(image(n)))
                if r.status_code == 200:
                    outcomes["ok"] += 1
                else:
                    errors.append(r.json())
                    outcomes["failed cleanly" if r.status_code >= 500 else "other"] += 1
            if scope.cancelled_caught:
                outcomes["hung"] += 1

        async with trio.open_nursery() as nursery:
            for n in range(200):
                nursery.start_soon(one, n)
            await victim.wait_until(lambda: len(victim.requests()) >= 20)
            victim.stop()
        assert outcomes["hung"] == 0 and outcomes["other"] == 0, (outcomes, errors)
        assert outcomes["ok"] + outcomes["failed cleanly"] == 200
        assert all(e["error"]["stage"] == "encode" for e in errors)
        assert not state.live and sent_at_eviction  # evicted by live transport failures
        assert retries(c.proxy)["encode"] >= 1
        # Evicted: the dead encoder gets nothing more.
        sent_after_burst = state.sent
        for n in range(200, 230):
            r = await client.post(c.proxy_url + CHAT, json=chat_body(image(n)))
            assert r.status_code == 200
        assert state.sent == sent_after_burst
        print(f"\nencoder kill mid-burst of 200: {dict(outcomes)}, "
              f"encode retries {retries(c.proxy)['encode']}")


async def test_decode_500_before_first_byte_succeeds_on_the_other(
    client: httpx.AsyncClient,
) -> None:
    async with run_cluster(prefills=1, decodes=2) as c:
        d0, d1 = c.decodes
        d0.behaviour.fail_status = 500
        for stream in (False, True):
            r = await client.post(c.proxy_url + CHAT, json=chat_body(stream=stream),
                                  headers={"x-request-id": f"s{stream}"})
            assert r.status_code == 200, r.text
        # Each request: d0 failed, prefill re-ran for the retry (its KV handle belonged to the
        # failed attempt), d1 answered.
        assert [x.request_id for x in d0.requests()] == ["sFalse", "sTrue"]
        assert [x.request_id for x in d1.requests()] == ["sFalse-retry1", "sTrue-retry1"]
        prefill_ids = [x.request_id for x in c.prefills[0].requests()]
        assert prefill_ids == ["sFalse", "sFalse-retry1", "sTrue", "sTrue-retry1"]
        retried = d1.requests()[0].body["kv_transfer_params"]["remote_request_id"]
        assert retried == "sFalse-retry1"
        assert retries(c.proxy) == {"decode": 2}


async def test_client_errors_are_never_retried(client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=2, prefills=2, decodes=2) as c:
        c.prefills[0].behaviour.fail_status = 422
        c.decodes[1].behaviour.fail_status = 400
        r = await client.post(c.proxy_url + CHAT, json=chat_body())  # P0 (fails), D0 not called
        assert r.status_code == 422
        assert len(c.prefills[1].requests()) == 0 and len(c.decodes[0].requests()) == 0
        r = await client.post(c.proxy_url + CHAT, json=chat_body())  # P1, then D1 (fails)
        assert r.status_code == 400
        assert len(c.decodes[0].requests()) == 0 and len(c.prefills[0].requests()) == 1
        assert retries(c.proxy) == {}


async def test_prefill_failures_are_not_retried_again_by_decode(
    client: httpx.AsyncClient,
) -> None:
    async with run_cluster(prefills=3, decodes=2, max_attempts=2, decode_retries=1) as c:
        for p in c.prefills:
            p.behaviour.fail_status = 503
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 502 and r.json()["error"]["stage"] == "prefill"
        assert sum(len(p.requests()) for p in c.prefills) == 2  # max_attempts, not 2 x 2
        assert all(d.requests() == [] for d in c.decodes)
        assert retries(c.proxy) == {"prefill": 1}


async def test_prefill_failover_to_the_next_instance(client: httpx.AsyncClient) -> None:
    async with run_cluster(prefills=2, decodes=1, prefill_timeout=0.5) as c:
        p0, p1 = c.prefills
        p0.behaviour.hang = True
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 200
        assert len(p0.requests()) == len(p1.requests()) == 1
        assert retries(c.proxy) == {"prefill": 1}
        assert p0.disconnects == 1  # the timed-out attempt was closed, so vLLM aborts it


async def test_hung_prefill_is_a_504_at_the_deadline(client: httpx.AsyncClient) -> None:
    async with run_cluster(prefills=1, decodes=1, prefill_timeout=0.3) as c:
        c.prefills[0].behaviour.hang = True
        with trio.fail_after(10):
            r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 504
        error = r.json()["error"]
        assert error["stage"] == "prefill" and error["instance"] == c.prefills[0].url
        assert error["type"] == "upstream_timeout" and "0.3 s" in error["message"]
        assert c.decodes[0].requests() == []


async def test_decode_first_byte_deadline(client: httpx.AsyncClient) -> None:
    async with run_cluster(decodes=1, decode_timeout=0.3) as c:
        c.decodes[0].behaviour.hang = True
        for stream in (False, True):
            r = await client.post(c.proxy_url + CHAT, json=chat_body(stream=stream))
            assert r.status_code == 504 and r.json()["error"]["stage"] == "decode"


async def test_stream_idle_gap_ends_with_an_sse_error(client: httpx.AsyncClient) -> None:
    async with run_cluster(prefills=1, decodes=2, stream_idle_timeout=0.3) as c:
        c.decodes[0].behaviour.chunk_delay = 3600
        r = await client.post(c.proxy_url + CHAT, json=chat_body(stream=True))
        assert r.status_code == 200
        frames = [f for f in r.text.split("\n\n") if f]
        assert len(frames) == 2  # the first chunk, then the error: no retry after a byte
        error = orjson.loads(frames[-1].removeprefix("data: "))["error"]
        assert error["stage"] == "decode" and error["type"] == "upstream_timeout"
        assert c.decodes[1].requests() == [] and retries(c.proxy) == {}
        await trio.testing.wait_all_tasks_blocked()
        assert c.decodes[0].disconnects == 1 and c.proxy.registry.in_flight() == 0


async def test_unreachable_prefill_fails_over(client: httpx.AsyncClient) -> None:
    async with run_cluster(prefills=2, decodes=1, health_interval=3600) as c:
        dying, live = c.prefills
        dying.stop()  # it said what it serves, then died: the first in the rotation
        await trio.testing.wait_all_tasks_blocked()
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 200 and len(live.requests()) == 1
        assert retries(c.proxy) == {"prefill": 1}
        assert c.proxy.registry.state("prefill", dying.url).errors == 1


async def test_decode_break_before_its_first_byte_is_retried(client: httpx.AsyncClient) -> None:
    # vLLM sends 200 headers at once; a decode that dies before generating anything must still
    # fail over, not reach the client as 200 + an error event.
    async with run_cluster(prefills=1, decodes=2) as c:
        c.decodes[0].behaviour.break_after = 0
        r = await client.post(c.proxy_url + CHAT, json=chat_body(stream=True))
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert "error" not in r.text
        assert len(c.decodes[1].requests()) == 1 and retries(c.proxy) == {"decode": 1}


async def test_decode_silent_after_its_headers_fails_over_at_the_deadline(
    client: httpx.AsyncClient,
) -> None:
    # Real vLLM's shape of a stuck KV pull: the stream's 200 headers arrive at once, then no
    # byte. The first-byte deadline still applies, and the request fails over before the client
    # was sent anything.
    async with run_cluster(prefills=1, decodes=2, decode_timeout=0.3) as c:
        c.decodes[0].behaviour.hang = True
        r = await client.post(c.proxy_url + CHAT, json=chat_body(stream=True))
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        (stuck,) = c.decodes[0].requests()
        assert stuck.status == 200 and stuck.sent == b""  # headers sent, body never started
        assert len(c.decodes[1].requests()) == 1 and retries(c.proxy) == {"decode": 1}
        await c.decodes[0].wait_until(lambda: c.decodes[0].disconnects == 1)


async def test_single_decode_with_dp_retries_on_another_rank(client: httpx.AsyncClient) -> None:
    async with run_cluster(prefills=1, decodes=1, decode_dp=2) as c:
        c.decodes[0].behaviour.fail_status, c.decodes[0].behaviour.fail_count = 500, 1
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 200
        assert [x.rank for x in c.decodes[0].requests()] == [0, 1]


async def test_long_prefill_outlives_the_stream_idle_timeout(client: httpx.AsyncClient) -> None:
    # The idle timeout bounds gaps between stream chunks, not a prefill or a non-stream answer.
    async with run_cluster(prefills=1, decodes=1, stream_idle_timeout=0.2) as c:
        c.prefills[0].behaviour.latency = 0.5
        c.decodes[0].behaviour.latency = 0.5
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 200 and retries(c.proxy) == {}


async def test_a_full_instance_queues_requests_in_the_proxy(client: httpx.AsyncClient) -> None:
    # EPD_MAX_CONNECTIONS caps requests in flight per slot; the next ones wait their turn in
    # the proxy (bounded by their stage deadline), not fail, and nothing is blamed on the instance.
    async with run_cluster(decodes=1, max_connections=1, health_interval=3600) as c:
        decode = c.decodes[0]
        decode.behaviour.chunk_delay = 3600  # one stream holds the only place
        first_byte, second = trio.Event(), []

        async def hold(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
            with trio.CancelScope() as scope:
                task_status.started(scope)
                async with client.stream("POST", c.proxy_url + CHAT,
                                         json=chat_body(stream=True)) as r:
                    async for _ in r.aiter_raw():
                        first_byte.set()

        async def queued() -> None:
            r = await client.post(c.proxy_url + CHAT, json=chat_body())
            second.append(r.status_code)

        async with trio.open_nursery() as nursery:
            holder = await nursery.start(hold)
            await first_byte.wait()
            nursery.start_soon(queued)
            limiter = c.proxy.client(c.settings.decode_urls[0]).limiter
            with trio.fail_after(10):
                while limiter.statistics().tasks_waiting != 1:
                    await trio.testing.wait_all_tasks_blocked(cushion=0.001)
            assert len(decode.requests()) == 1  # the second request waits in the proxy
            holder.cancel()  # the first stream ends: its place goes to the queued request
        assert second == [200] and len(decode.requests()) == 2
        state = c.proxy.registry.state("decode", decode.url)
        assert state.live and state.errors == 0 and retries(c.proxy) == {}


async def test_non_ascii_request_id_is_replaced(client: httpx.AsyncClient) -> None:
    async with run_cluster(decodes=1) as c:
        r = await client.post(c.proxy_url + CHAT, json=chat_body(),
                              headers={"x-request-id": "caf\u00e9".encode("latin-1")})
        assert r.status_code == 200
        assert r.headers["x-request-id"] != "café" and r.headers["x-request-id"].isascii()


async def test_a_queue_wait_past_its_limit_is_a_503_that_blames_nobody(
    client: httpx.AsyncClient,
) -> None:
    async with run_cluster(decodes=1, max_connections=1, queue_timeout=0.2,
                           health_interval=3600) as c:
        c.decodes[0].behaviour.chunk_delay = 3600  # one stream holds the only place
        first_byte = trio.Event()

        async def hold() -> None:
            async with client.stream("POST", c.proxy_url + CHAT,
                                     json=chat_body(stream=True)) as r:
                async for _ in r.aiter_raw():
                    first_byte.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold)
            await first_byte.wait()
            r = await client.post(c.proxy_url + CHAT, json=chat_body())
            assert r.status_code == 503 and r.json()["error"]["type"] == "proxy_overloaded"
            state = c.proxy.registry.state("decode", c.decodes[0].url)
            assert state.live and state.errors == 0 and retries(c.proxy) == {}
            nursery.cancel_scope.cancel()


async def test_a_single_decode_slot_is_retried_on_itself(client: httpx.AsyncClient) -> None:
    """No other decode slot exists: the only one is tried again (prefill re-run), as upstream's
    proxy does, within decode_retries; a second failure is the client's 502."""
    async with run_cluster(prefills=1, decodes=1, decode_retries=1) as c:
        (d0,) = c.decodes
        d0.behaviour.fail_status, d0.behaviour.fail_count = 500, 1
        r = await client.post(c.proxy_url + CHAT, json=chat_body(), headers={"x-request-id": "a"})
        assert r.status_code == 200, r.text
        assert [x.request_id for x in d0.requests()] == ["a", "a-retry1"]
        assert [x.request_id for x in c.prefills[0].requests()] == ["a", "a-retry1"]
        assert retries(c.proxy) == {"decode": 1}
        d0.behaviour.fail_status, d0.behaviour.fail_count = 500, 2
        r = await client.post(c.proxy_url + CHAT, json=chat_body(), headers={"x-request-id": "b"})
        assert r.status_code == 502 and r.json()["error"]["stage"] == "decode"
        assert [x.request_id for x in d0.requests()][2:] == ["b", "b-retry1"]  # no third try


async def test_a_retry_falls_back_to_an_untried_instance_out_of_rotation(
    client: httpx.AsyncClient,
) -> None:
    """P1 serves but is out of rotation (its probes fail); P0, in rotation, fails: the retry
    goes to P1 rather than failing for sure (the churn soak's two 502s)."""
    async with run_cluster(prefills=2, decodes=1, health_interval=0.05,
                           health_threshold=1) as c:
        p0, p1 = c.prefills
        p1.behaviour.healthy = False
        evicted = trio.Event()
        c.proxy.registry.on_change.append(lambda s: s.url == p1.url and evicted.set())
        with trio.fail_after(10):
            await evicted.wait()
        assert not c.proxy.registry.state("prefill", p1.url).live
        p0.behaviour.fail_status, p0.behaviour.fail_count = 500, 1
        r = await client.post(c.proxy_url + CHAT, json=chat_body(), headers={"x-request-id": "x"})
        assert r.status_code == 200, r.text
        assert [x.request_id for x in p0.requests()] == ["x"]
        assert [x.request_id for x in p1.requests()] == ["x"]
        assert retries(c.proxy) == {"prefill": 1}
