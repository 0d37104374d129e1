"""Profiling fan-out: every instance of every role, every result gathered, 404 = disabled."""

from __future__ import annotations

import httpx
import pytest
import trio

from epd_trio._upstream.profile import summarize
from epd_trio.testing import run_cluster

KEY = "admin-secret"


@pytest.mark.parametrize(
    "outcomes, status",
    [(["ok", "disabled"], 200), (["ok", "failed"], 502), (["disabled", "failed"], 502),
     (["disabled", "disabled"], 503), ([], 503)],
)
def test_summary_status(outcomes: list[str], status: int) -> None:
    report = summarize("start_profile", [{"status": o} for o in outcomes])
    assert report.status == status
    assert [report.body[k] for k in ("ok", "disabled", "failed")] == [
        outcomes.count(k) for k in ("ok", "disabled", "failed")]


async def test_profiling_reaches_every_instance(client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=1, prefills=1, decodes=2) as c:
        for fake in c.fakes[:-1]:
            fake.behaviour.profiler = True
        r = await client.post(c.proxy_url + "/start_profile")
        assert r.status_code == 200
        report = r.json()
        assert (report["action"], report["ok"], report["disabled"], report["failed"]) == (
            "start_profile", 3, 1, 0)
        assert [(i["role"], i["url"], i["status"]) for i in report["instances"]] == [
            ("encode", c.encoders[0].url, "ok"), ("prefill", c.prefills[0].url, "ok"),
            ("decode", c.decodes[0].url, "ok"), ("decode", c.decodes[1].url, "disabled")]
        assert [f.profiling for f in c.fakes] == [True, True, True, False]
        r = await client.post(c.proxy_url + "/stop_profile", json={})
        assert r.status_code == 200 and r.json()["ok"] == 3
        assert not any(f.profiling for f in c.fakes)
        r = await client.post(c.proxy_url + "/stop_profile", content=b"[1]")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


async def test_one_failure_does_not_cancel_the_others(client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=2, decodes=1) as c:
        broken, dead, slow = c.encoders[0], c.encoders[1], c.decodes[0]
        for fake in c.fakes:
            fake.behaviour.profiler = True
        broken.behaviour.fail_status = 500
        dead.stop()
        gate = trio.Event()
        slow.behaviour.gate = gate.wait
        replies: list[httpx.Response] = []

        async def profile() -> None:
            replies.append(await client.post(c.proxy_url + "/start_profile"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(profile)
            # The failure is in, the slow one still working: only now may it answer.
            await broken.wait_until(lambda: any(x.status == 500 for x in broken.received))
            await slow.wait_until(lambda: any(x.path == "/start_profile" for x in slow.received))
            gate.set()
        (r,) = replies
        assert r.status_code == 502
        by_url = {i["url"]: i for i in r.json()["instances"]}
        assert by_url[broken.url]["status"] == "failed" and by_url[broken.url]["http_status"] == 500
        assert by_url[dead.url]["status"] == "failed" and by_url[dead.url]["http_status"] is None
        assert "profile stage failed at " + dead.url in by_url[dead.url]["error"]
        assert by_url[slow.url]["status"] == "ok" and slow.profiling
        assert not any(x.disconnected for x in slow.received)


async def test_profiling_needs_the_admin_key_when_one_is_set(client: httpx.AsyncClient) -> None:
    async with run_cluster(decodes=1, admin_key=KEY) as c:
        r = await client.post(c.proxy_url + "/start_profile")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"
        # Nothing reached the instance but the proxy's own probes and model list.
        assert all(x.path in ("/health", "/v1/models") for x in c.decodes[0].received)
        r = await client.post(c.proxy_url + "/start_profile", headers={"x-api-key": KEY})
        assert r.status_code == 503  # profiling is not enabled on the only instance
        assert r.json()["instances"][0]["status"] == "disabled"
