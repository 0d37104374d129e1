"""``GET /metrics``: what the proxy counts, checked against what the fake instances saw."""

from __future__ import annotations

import logging
from collections import Counter

import httpx
import pytest
import trio
import trio.testing

from epd_trio import Instance
from epd_trio._core.health import InstanceState, Registry
from epd_trio._observe.accounting import Accounting
from epd_trio._observe.metrics import ProxyMetrics
from epd_trio.testing import FakeVLLM, run_cluster

from helpers import CHAT, COMPLETIONS, chat_body, image, retries, scrape

KEY = "admin-secret"
ADMIN = {"x-api-key": KEY}


async def settled() -> None:
    """Let the proxy finish its requests: they are counted as their resources close, just after
    the last byte was sent (so possibly after the client has read it)."""
    await trio.testing.wait_all_tasks_blocked()


async def test_requests_stages_instances_items_and_ranks(client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=2, prefills=1, prefill_dp=2, decodes=2, decode_dp=2) as c:
        for n in range(4):
            r = await client.post(c.proxy_url + CHAT, json=chat_body(image(n), stream=n % 2 == 1))
            assert r.status_code == 200
        r = await client.post(c.proxy_url + CHAT, content=b"{not json")
        assert r.status_code == 400
        r = await client.post(c.proxy_url + COMPLETIONS,
                              json={"model": "fake-model", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200
        await settled()
        m = await scrape(client, c.proxy_url)
        model = "fake-model"  # the pool each request went to (none for a body not read)
        assert m.get("epd_trio_requests_total", endpoint=CHAT, outcome="ok", model=model) == 4
        assert m.get("epd_trio_requests_total", endpoint=CHAT, outcome="client_error",
                     model="") == 1
        assert m.get("epd_trio_requests_total", endpoint=COMPLETIONS, outcome="ok",
                     model=model) == 1
        for stream in ("true", "false"):
            for name in ("time_to_first_byte", "request_duration"):
                assert m.get(f"epd_trio_{name}_seconds_count", endpoint=CHAT, stream=stream,
                             model=model) == 2
        assert m.by("epd_trio_stage_duration_seconds_count", "stage") == {
            "encode": 4, "prefill": 5, "decode": 5}
        # Per instance: exactly what each instance received, rank by rank.
        for role, fakes in (("encode", c.encoders), ("prefill", c.prefills),
                            ("decode", c.decodes)):
            for fake in fakes:
                labels = {"role": role, "upstream": fake.url}
                assert m.get("epd_trio_upstream_requests_total", **labels) == len(fake.requests())
                ranks = Counter(str(x.rank) for x in fake.requests() if x.rank is not None)
                assert m.by("epd_trio_dp_rank_requests_total", "rank", **labels) == ranks
                assert m.get("epd_trio_upstream_in_flight", **labels) == 0
                assert m.get("epd_trio_instance_healthy", **labels) == 1
        assert set(m.by("epd_trio_dp_rank_requests_total", "rank", role="prefill")) == {"0", "1"}
        assert m.by("epd_trio_encoder_items_total", "upstream") == {
            e.url: e.stats()["items"] for e in c.encoders} == {e.url: 2 for e in c.encoders}
        for quiet in ("upstream_errors", "retries", "client_cancellations",
                      "prefill_kv_transfer_params_missing", "instance_evictions"):
            assert m.sum(f"epd_trio_{quiet}_total") == 0


async def test_failovers_errors_broken_streams_and_missing_kv(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="epd_trio")
    async with run_cluster(prefills=1, decodes=2) as c:
        d0, d1 = c.decodes
        d0.behaviour.fail_status = 500
        r = await client.post(c.proxy_url + CHAT, json=chat_body())  # d0 fails, d1 answers
        assert r.status_code == 200
        d1.behaviour.fail_status = 500
        r = await client.post(c.proxy_url + CHAT, json=chat_body(),
                              headers={"x-request-id": "both-down"})
        assert r.status_code == 502
        d0.behaviour.fail_status = d1.behaviour.fail_status = None
        d0.behaviour.break_after = d1.behaviour.break_after = 1
        r = await client.post(c.proxy_url + CHAT, json=chat_body(stream=True),
                              headers={"x-request-id": "broken"})
        assert r.status_code == 200 and '"error"' in r.text
        d0.behaviour.break_after = d1.behaviour.break_after = None
        c.prefills[0].role = "prefill_decode"  # answers without kv_transfer_params
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 200
        await settled()
        m = await scrape(client, c.proxy_url)
        assert m.by("epd_trio_requests_total", "outcome") == {
            "ok": 2, "upstream_error": 1, "stream_error": 1}
        assert m.by("epd_trio_retries_total", "stage") == {"decode": 2}
        assert retries(c.proxy) == {"decode": 2}
        for fake in c.decodes:
            state = c.proxy.registry.state("decode", fake.url)
            assert m.get("epd_trio_upstream_errors_total", role="decode",
                         upstream=fake.url) == state.errors
        assert m.sum("epd_trio_upstream_errors_total") == 4  # 1 + 2 + the broken stream
        assert m.get("epd_trio_prefill_kv_transfer_params_missing_total") == 1
        assert m.get("epd_trio_request_duration_seconds_count", endpoint=CHAT,
                     stream="false", model="fake-model") == 2  # only successes are timed
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum(w.startswith("retrying decode after failure") for w in warnings) == 2
    assert any(w.startswith("request both-down failed: decode stage failed") for w in warnings)
    assert any(w.startswith("request broken: stream broke after its first byte")
               for w in warnings)


async def test_health_gauge_and_evictions_follow_the_prober(client: httpx.AsyncClient) -> None:
    async with run_cluster(prefills=1, decodes=2, health_interval=0.05,
                           health_threshold=1) as c:
        d1 = c.decodes[1]
        labels = {"role": "decode", "upstream": d1.url}

        def listen(_: object) -> None:
            changed.set()

        c.proxy.registry.on_change.append(listen)
        for healthy in (False, True):  # out of rotation, then back
            changed = trio.Event()
            d1.behaviour.healthy = healthy
            with trio.fail_after(10):
                await changed.wait()
            m = await scrape(client, c.proxy_url)
            assert m.get("epd_trio_instance_healthy", **labels) == int(healthy)
            assert m.get("epd_trio_instance_evictions_total", **labels) == 1
            assert m.get("epd_trio_instance_healthy", role="decode",
                         upstream=c.decodes[0].url) == 1


async def test_two_apps_in_one_process_count_separately(client: httpx.AsyncClient) -> None:
    async with run_cluster(decodes=1) as a, run_cluster(decodes=1) as b:
        for _ in range(3):
            assert (await client.post(a.proxy_url + CHAT, json=chat_body())).status_code == 200
        assert (await client.post(b.proxy_url + CHAT, json=chat_body())).status_code == 200
        await settled()
        ma, mb = await scrape(client, a.proxy_url), await scrape(client, b.proxy_url)
        assert ma.by("epd_trio_requests_total", "outcome") == {"ok": 3}
        assert mb.by("epd_trio_requests_total", "outcome") == {"ok": 1}
        assert ma.by("epd_trio_upstream_requests_total", "upstream") == {a.decodes[0].url: 3}


async def test_metrics_can_be_turned_off(client: httpx.AsyncClient) -> None:
    async with run_cluster(prefills=1, decodes=1, metrics=False) as c:
        r = await client.post(c.proxy_url + CHAT, json=chat_body(stream=True))
        assert r.status_code == 200
        r = await client.get(c.proxy_url + "/metrics")
        assert r.status_code == 404 and "EPD_METRICS" in r.json()["error"]["message"]
        assert retries(c.proxy) == {}


async def test_registered_instances_appear_and_leave(
    client: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    async with run_cluster(decodes=0, admin_key=KEY) as c:
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 503  # nothing registered yet
        decode = FakeVLLM("prefill_decode", dp_size=2)
        await nursery.start(decode.serve)
        r = await client.post(c.proxy_url + "/instances", headers=ADMIN, json={
            "role": "prefill_decode", "url": decode.url, "dp_size": 2})
        assert r.status_code == 200
        labels = {"role": "decode", "upstream": decode.url}
        m = await scrape(client, c.proxy_url, ADMIN)
        assert m.get("epd_trio_instance_healthy", **labels) == 1  # shown before any request
        assert m.get("epd_trio_upstream_requests_total", **labels) == 0
        for _ in range(2):
            assert (await client.post(c.proxy_url + CHAT, json=chat_body())).status_code == 200
        await settled()
        m = await scrape(client, c.proxy_url, ADMIN)
        assert m.get("epd_trio_upstream_requests_total", **labels) == 2
        assert m.by("epd_trio_dp_rank_requests_total", "rank", **labels) == {"0": 1, "1": 1}
        assert m.by("epd_trio_requests_total", "outcome") == {"ok": 2, "no_instance": 1}
        r = await client.delete(c.proxy_url + "/instances", headers=ADMIN,
                                params={"url": decode.url})
        assert r.json() == {"removed": True}
        m = await scrape(client, c.proxy_url, ADMIN)
        assert not [s for s in m.samples if s[1].get("upstream") == decode.url]


async def test_metrics_route_needs_the_admin_key_once_one_is_set(
    client: httpx.AsyncClient,
) -> None:
    async with run_cluster(decodes=1) as open_proxy:
        assert (await client.get(open_proxy.proxy_url + "/metrics")).status_code == 200
    async with run_cluster(decodes=1, admin_key=KEY, api_keys=("client-key",)) as c:
        r = await client.get(c.proxy_url + "/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"
        r = await client.get(c.proxy_url + "/metrics", headers={"x-api-key": "wrong"})
        assert r.status_code == 401
        r = await client.get(c.proxy_url + "/metrics",
                             headers={"authorization": "Bearer client-key"})
        assert r.status_code == 401  # a client key is not the admin key
        await scrape(client, c.proxy_url, {"authorization": f"Bearer {KEY}"})  # Prometheus' way
        # A client request without its key: refused before the pipeline, and still counted.
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 401
        m = await scrape(client, c.proxy_url, ADMIN)
        assert m.by("epd_trio_requests_total", "outcome", endpoint=CHAT) == {"client_error": 1}


def test_an_instance_that_registers_again_gets_its_health_series_back() -> None:
    """A request still running on an instance that left re-creates its children; registering
    again must still count as joining (its health gauge set)."""
    instance = Instance("http://127.0.0.1:9001")
    metrics = ProxyMetrics(instances=[InstanceState(instance, "decode")])
    labels = {"role": "decode", "upstream": instance.url}
    assert metrics.registry.get_sample_value("epd_trio_instance_healthy", labels) == 1.0
    metrics.set_members([])  # unregistered while a stream on it waits for its first bytes
    assert metrics.registry.get_sample_value("epd_trio_instance_healthy", labels) is None
    gauge = metrics.instance("decode", instance.url).in_flight  # the first bytes arrive after all
    gauge.inc()
    metrics.set_members([InstanceState(instance, "decode")])  # it restarts and registers again
    assert metrics.registry.get_sample_value("epd_trio_instance_healthy", labels) == 1.0
    gauge.dec()
    metrics.set_members([])
    assert metrics.registry.get_sample_value("epd_trio_upstream_in_flight", labels) is None


async def test_no_created_series_are_exported(client: httpx.AsyncClient) -> None:
    async with run_cluster(decodes=1) as c:
        assert (await client.post(c.proxy_url + CHAT, json=chat_body())).status_code == 200
        text = (await client.get(c.proxy_url + "/metrics")).text
        assert "epd_trio_requests_total" in text and "_created" not in text


async def test_a_cancellation_counts_at_the_stage_of_the_last_leg_opened_not_a_leg_beside(
) -> None:
    """The account records the request's stage as each leg opens; a leg beside the one the
    client waits on (MoRIIO WRITE's prefill, beside its decode) leaves it alone."""
    prefill, decode = Instance("http://p:1"), Instance("http://d:1")
    registry = Registry.from_stages({"prefill": [prefill], "decode": [decode]})
    metrics = ProxyMetrics()
    account = Accounting(registry, metrics, request_log=False).begin(COMPLETIONS, "r1")
    assert account.stage == "encode"  # the first stage, until a leg opens
    with account.leg("prefill", (prefill, None)):
        assert account.stage == "prefill"
    with account.leg("decode", (decode, None)), account.leg("prefill", (prefill, None),
                                                            beside=True):
        assert account.stage == "decode"
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled as exc:
            account.failed(exc)
            raise
    cancels = {stage: metrics.registry.get_sample_value(
        "epd_trio_client_cancellations_total", {"stage": stage}) for stage in ("prefill", "decode")}
    assert cancels == {"prefill": 0.0, "decode": 1.0}
    assert account.trace.cancelled_stage == "decode"
