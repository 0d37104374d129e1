"""Health: the pure state machine, the background prober, and routing around the unhealthy."""

from __future__ import annotations

import httpx
import trio
import trio.testing

from epd_trio import Instance, Settings, SlotCursor
from epd_trio._core.health import InstanceState, Registry
from epd_trio.testing import FakeVLLM, run_cluster, serve_proxy

from helpers import CHAT, chat_body, image, retries, start_fakes


def test_threshold_evicts_and_one_success_restores() -> None:
    state = InstanceState(Instance("http://a:1"), "decode")
    assert state.live and not state.probed
    assert [state.record_failure(3) for _ in range(4)] == [False, False, True, False]
    assert not state.live and state.evictions == 1
    assert state.record_success() is True
    assert state.live and state.probed and state.consecutive_failures == 0
    state.record_failure(3)
    state.record_success()
    assert [state.record_failure(3) for _ in range(3)] == [False, False, True]


def test_a_failure_that_shows_the_instance_down_evicts_at_once() -> None:
    state = InstanceState(Instance("http://a:1"), "decode")
    assert state.record_failure(3) is False
    assert state.record_failure(3, down=True) is True
    assert not state.live and state.evictions == 1 and state.consecutive_failures == 2
    assert state.record_failure(3, down=True) is False  # already out: one eviction


def test_registry_panic_mode_and_readiness() -> None:
    a, b = Instance("http://a:1"), Instance("http://b:1")
    registry = Registry.from_stages({"encode": [], "decode": [a, b]}, threshold=1)
    assert registry.healthy() and not registry.ready()
    registry.failed(registry.state("decode", a.url))
    usable = registry.usable("decode")
    assert not usable(a) and usable(b) and registry.healthy()
    registry.failed(registry.state("decode", b.url))
    assert not registry.healthy()
    assert registry.usable("decode")(a)  # nobody live: try everyone rather than fail for sure
    registry.succeeded(registry.state("decode", b.url))
    assert registry.ready() and registry.healthy()


def test_readiness_waits_for_probes_at_start_only() -> None:
    """Once every stage has answered a probe, readiness is "every stage has an instance in
    rotation": a stage added later (an encoder registered) does not wait for its first probe,
    and a stage whose instances all left the rotation is not ready."""
    d, e = Instance("http://d:1"), Instance("http://e:1")
    registry = Registry.from_stages({"decode": [d]}, threshold=1)
    assert not registry.ready()
    registry.succeeded(registry.state("decode", d.url))
    registry.set_members({"encode": [e], "decode": [d]})
    assert registry.ready()
    registry.failed(registry.state("encode", e.url))
    assert not registry.ready()
    registry.succeeded(registry.state("encode", e.url))
    assert registry.ready()


def test_skipping_an_instance_keeps_the_order_of_the_others() -> None:
    a, b, c = (Instance(f"http://{n}:1", 2) for n in "abc")
    cursor = SlotCursor([a, b, c])
    got = [cursor.next(lambda i: i is not b) for _ in range(8)]
    assert got == [(a, 0), (c, 0), (a, 1), (c, 1)] * 2


async def test_prober_evicts_and_restores(client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=3, prefills=1, decodes=1, health_interval=0.05,
                           health_threshold=2) as c:
        e1 = c.encoders[1]
        changes: list[tuple[str, bool]] = []
        changed = trio.Event()

        def listen(state: InstanceState) -> None:
            changes.append((state.url, state.live))
            changed.set()

        c.proxy.registry.on_change.append(listen)
        e1.behaviour.healthy = False
        with trio.fail_after(10):
            await changed.wait()
        assert changes == [(e1.url, False)]
        r = await client.get(c.proxy_url + "/health")
        assert r.status_code == 200  # the role still has live encoders
        assert r.json()["status"] == "degraded"
        assert [s["state"] for s in r.json()["roles"]["encode"]] == [
            "healthy", "unhealthy", "healthy"]

        before = len(e1.requests())
        owners = []
        for n in range(4):
            r = await client.post(c.proxy_url + CHAT, json=chat_body(image(n)),
                                  headers={"x-request-id": f"r{n}"})
            assert r.status_code == 200
            owners += [i for i, e in enumerate(c.encoders)
                       if any(x.request_id == f"r{n}-enc-0" for x in e.requests())]
        assert owners == [0, 2, 0, 2] and len(e1.requests()) == before

        changed = trio.Event()
        e1.behaviour.healthy = True
        with trio.fail_after(10):
            await changed.wait()
        assert changes[-1] == (e1.url, True)


async def test_health_stays_200_and_says_unavailable_when_a_stage_has_no_live_instance(
    client: httpx.AsyncClient,
) -> None:
    async with run_cluster(prefills=1, decodes=1, health_interval=0.05,
                           health_threshold=1) as c:
        c.decodes[0].behaviour.healthy = False
        gone = trio.Event()
        c.proxy.registry.on_change.append(lambda s: gone.set())
        with trio.fail_after(10):
            await gone.wait()
        r = await client.get(c.proxy_url + "/health")
        assert r.status_code == 200 and r.json()["status"] == "unavailable"
        r = await client.get(c.proxy_url + "/ready")
        assert r.status_code == 503
        # Panic mode: requests are still tried (the instance may be fine; only /health says no).
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 200


async def test_ready_waits_for_one_probe_per_role(
    client: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    # The encoder fails its probes from the start: the proxy never saw it work.
    encoder, prefill, decode = (FakeVLLM("encode"), FakeVLLM("prefill"), FakeVLLM("decode"))
    encoder.behaviour.healthy = False
    await start_fakes(nursery, encoder, prefill, decode)
    settings = Settings(encode_urls=(Instance(encoder.url),), prefill_urls=(Instance(prefill.url),),
                        decode_urls=(Instance(decode.url),), health_interval=0.05)
    async with serve_proxy(settings) as (url, proxy):
        # Wait until the decode and prefill answered a probe: then only the encoder is missing.
        with trio.fail_after(10):
            for fake in (prefill, decode):
                await fake.wait_until(lambda f=fake: any(
                    r.path == "/health" and r.status == 200 for r in f.received))
        r = await client.get(url + "/ready")
        assert r.status_code == 503 and r.json()["ready"] is False, r.text
        ready = trio.Event()
        proxy.registry.on_change.append(lambda s: ready.set())
        encoder.behaviour.healthy = True
        with trio.fail_after(10):
            await encoder.wait_until(lambda: any(
                r.path == "/health" and r.status == 200 for r in encoder.received))
        await trio.testing.wait_all_tasks_blocked()
        r = await client.get(url + "/ready")
        assert r.status_code == 200 and r.json()["ready"] is True


async def test_live_transport_failures_count_as_failed_probes(
    client: httpx.AsyncClient,
) -> None:
    """A stream that breaks before its first byte (the server is up, the connection was
    accepted) counts as one failure: ``health_threshold`` of them take the instance out."""
    async with run_cluster(prefills=1, decodes=2, health_interval=3600,
                           health_threshold=2) as c:
        broken = c.decodes[0]
        state = c.proxy.registry.state("decode", broken.url)
        await trio.testing.wait_all_tasks_blocked()  # the first probe round is done
        broken.behaviour.break_after = 0
        for _ in range(6):
            r = await client.post(c.proxy_url + CHAT, json=chat_body(stream=True))
            assert r.status_code == 200  # each failure fails over to the other decode
            assert r.text.endswith("data: [DONE]\n\n")
        assert not state.live and state.errors == 2 and state.sent == 2


async def test_a_decode_whose_engine_died_is_evicted_at_its_first_refused_connection(
    client: httpx.AsyncClient,
) -> None:
    """Issue 30: a vLLM whose engine died (SIGILL on an AMX CPU without AMX permission) answers
    what it had in flight with a 500 ("EngineCore encountered an issue"), then exits. Nothing
    listens on its port any more, so a refused connection is certain: the first one, on a live
    request, takes it out of rotation. Waiting for ``health_threshold`` failures would send two
    more requests there, each costing a prefill re-run for its failover (the probes here are an
    hour apart, so only live requests can evict it)."""
    async with run_cluster(prefills=1, decodes=2, health_interval=3600) as c:
        assert c.settings.health_threshold == 3
        dead, other = c.decodes
        state = c.proxy.registry.state("decode", dead.url)
        await trio.testing.wait_all_tasks_blocked()  # the first probe round is done
        dead.behaviour.fail_status = 500  # its engine is gone: a 500 for what it had in flight
        while not dead.requests():  # the round-robin cursor starts anywhere
            r = await client.post(c.proxy_url + CHAT, json=chat_body())
            assert r.status_code == 200, r.text  # failed over to the other decode
        assert state.live and state.errors == 1  # a 500 alone is no proof the server is down
        dead.stop()  # then its API server exits: connections are refused
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(6):
            r = await client.post(c.proxy_url + CHAT, json=chat_body())
            assert r.status_code == 200, r.text
        assert not state.live and state.evictions == 1
        assert (state.sent, state.errors, state.consecutive_failures) == (2, 2, 1)
        assert len(other.requests()) == 7  # every request was answered by the other decode
        assert retries(c.proxy) == {"decode": 2}


async def test_idle_upstream_connections_close_on_the_keepalive_clock(
    client: httpx.AsyncClient,
) -> None:
    """Housekeeping runs on the keep-alive clock, not after each probe round: with a 600 s
    probe interval an idle connection still closes about one keep-alive after its request."""
    async with run_cluster(decodes=1, health_interval=600, upstream_keepalive=0.2) as c:
        assert (await client.post(c.proxy_url + CHAT, json=chat_body())).status_code == 200
        pool = c.proxy.client(c.proxy.roster.of("decode")[0])
        assert len(pool._idle) == 1  # kept for reuse after the request
        started = trio.current_time()
        with trio.fail_after(5):  # the keep-alive is wall-clock time: wait for it to pass
            while pool._idle:  # noqa: ASYNC110 (no event marks an idle close: poll)
                await trio.sleep(0.05)
        assert trio.current_time() - started >= 0.1
