"""A real Prometheus scraping a live epd_trio: the dashboard's queries and the alert rules on
real data (Debian's ``prometheus``; one server for this module, on a loopback port).

One test, on purpose: Prometheus's first sample arrives 5-6 s after it starts
(/work/shared/STACK-NOTES.md), so it is started once, scrapes every second, and every check
runs on the same data: each panel's query returns a value above 0 where the traffic produces
one, every rule evaluates without error, and the no-healthy-instance alert is silent, then
fires once the decode instances are killed. Prometheus loads a copy of the shipped rules with
every ``for:`` at 0 s, so "fires" needs no minute of waiting (the ``for:`` durations themselves
are checked by ``promtool test rules``, tests/observe/test_promtool.py). Waiting is polling
Prometheus's HTTP API (its scrape clock is its own), bounded by a deadline.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from epd_trio._core.tenants import Tenant
from epd_trio.testing import Behaviour
from epd_trio.testing.cluster import run_cluster
from epd_trio.testing.ports import free_port
from epd_trio.testing.process import stop_process

from helpers import CHAT, chat_body, hold_admission_places, image
from real_servers import require_binary

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "epd-trio-alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "epd-trio.json"
#: Grafana's ``$__rate_interval`` for a 1 s scrape is at least 4 scrapes; 15 s leaves margin.
RATE_INTERVAL = "15s"
#: Panels whose query may rightly read 0 on this traffic, and why only their data is checked.
ZERO_IS_FINE = {
    # A gauge read at the scrape's instant: the trickle's requests take milliseconds, so
    # between them every upstream has 0 in flight; the series per upstream must exist.
    "In flight per upstream",
    # The trickle's requests never wait for a place (refused at once at the cap): the queue is
    # empty at every scrape; the series per tenant must exist.
    "Queue depth per tenant",
    # 1 or 0 by the pool's health at the scrape (the checks below kill the decodes at the end):
    # the series per model must exist.
    "Pool complete per model",
}


def rules_without_for(into: Path) -> Path:
    """The shipped rules with every ``for:`` at 0 s (an alert fires at its first true
    evaluation): the same expressions, labels and annotations, derived, not copied."""
    text, count = re.subn(r"^(\s+)for: \S+$", r"\1for: 0s", RULES.read_text(),
                          flags=re.MULTILINE)
    assert count >= 1  # EpdTrioNoHealthyInstance has one, of 1m
    into.write_text(text)
    return into


def panel_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"].replace("$__rate_interval", RATE_INTERVAL)
             .replace("$job", "epd-trio"))
            for p in board["panels"] for t in p.get("targets", [])]


async def poll(check: Callable[[], Awaitable[Any]], what: str, limit: float = 30.0) -> Any:
    """``check()`` until it returns something true (Prometheus's clock, not ours)."""
    with trio.move_on_after(limit):
        while True:
            result = await check()
            if result:
                return result
            await trio.sleep(0.25)
    raise AssertionError(f"Prometheus: no {what} within {limit:g} s")


def since(stamp: str) -> float:
    """Seconds since the epoch of one of Prometheus's RFC 3339 times (nanoseconds cut)."""
    return datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", stamp)).timestamp()


async def test_a_real_prometheus_scrapes_the_proxy_with_the_rules(tmp_path: Path) -> None:
    binary = require_binary("prometheus")
    # The admission cap at 2, refusing at once: two requests that never finish sending their
    # body hold both places (tests/helpers.hold_admission_places).
    # Fair admission on, so the Tenants row's panels have data too: every request in the
    # default tenant (a token limit never reached, band 1) but one an interactive tenant (band
    # 0, by header) sends at the cap, which starts in the one place of headroom.
    async with run_cluster(encoders=1, prefills=2, decodes=2, health_interval=0.2,
                           health_threshold=1, max_inflight=2, admission_timeout=0,
                           tenants=(Tenant("default", priority=1, tokens_per_minute=10**9),
                                    Tenant("interactive", priority=0)),
                           tenant_header="x-tenant", priority_headroom=1,
                           model_aliases={"chat": {"targets": {"fake-model": 1}}}) as c:
        # Fails every call it gets (a 500 does not evict): failovers and errors keep coming,
        # their rates stay above 0. The traffic also fails its probes now and then (below).
        failing = c.prefills[1]
        failing.behaviour = Behaviour(fail_status=500)
        failing_state = c.proxy.registry.state("prefill", failing.url)
        (encoder,) = c.encoders
        port = free_port()
        rules_file = rules_without_for(tmp_path / "rules.yml")
        (tmp_path / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{rules_file}"]
scrape_configs:
  - job_name: epd-trio
    static_configs: [{{targets: ["{c.proxy_url.removeprefix("http://")}"]}}]
""")
        process = await trio.lowlevel.open_process(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        api = f"http://127.0.0.1:{port}/api/v1"
        try:
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client, \
                    trio.open_nursery() as nursery:

                async def client_leaves_during_encode(n: int) -> None:
                    """A request whose client leaves while the encoder holds it: a client
                    cancellation (the trickle is sequential: nothing else is at the encoder)."""
                    encoder.behaviour.hang = True
                    gone = encoder.disconnects
                    async with trio.open_nursery() as request:
                        request.start_soon(partial(client.post, c.proxy_url + CHAT,
                                                   json=chat_body(image(n))))
                        await encoder.wait_until(lambda: encoder.in_flight == 1)
                        request.cancel_scope.cancel()
                    await encoder.wait_until(lambda: encoder.disconnects > gone)
                    encoder.behaviour.hang = False

                async def refused_at_the_cap(n: int) -> None:
                    """Requests until one is refused at the admission cap, while two others
                    hold its places; then one of a better band, started in the headroom."""
                    async with hold_admission_places(c.proxy_url, 2):
                        for _ in range(100):  # until the proxy has read both held headers
                            r = await client.post(c.proxy_url + CHAT, json=chat_body(image(n)))
                            if r.status_code == 503:
                                assert r.json()["error"]["type"] == "proxy_overloaded", r.text
                                r = await client.post(c.proxy_url + CHAT,
                                                      json=chat_body(image(n)),
                                                      headers={"x-tenant": "interactive"})
                                # Admitted: not refused at the cap. Once the checks below
                                # have killed the decodes it fails after admission (a 502,
                                # or a 503 naming no instance).
                                assert r.status_code == 200 or (
                                    r.json()["error"].get("code") != "proxy_at_capacity"), r.text
                                return
                    raise AssertionError("no request refused at the admission cap")

                async def evicted_and_back() -> None:
                    """The failing prefill fails its probes until it leaves the rotation,
                    then passes them until it is back: an eviction."""
                    for healthy in (False, True):
                        changed = trio.Event()

                        def seen(state: Any, healthy: bool = healthy,
                                 changed: trio.Event = changed) -> None:
                            if state is failing_state and state.live is healthy:
                                changed.set()

                        c.proxy.registry.on_change.append(seen)
                        failing.behaviour.healthy = healthy
                        try:
                            if failing_state.live is not healthy:
                                await changed.wait()
                        finally:
                            c.proxy.registry.on_change.remove(seen)

                async def traffic() -> None:
                    n = 0
                    while True:  # a steady trickle, until the checks are done
                        n += 1
                        # One prefill answer in three without a KV handle (as a prefill
                        # without a KV connector answers), the rest with one.
                        c.prefills[0].role = "prefill_decode" if n % 3 == 0 else "prefill"
                        if n % 20 == 0:
                            await client_leaves_during_encode(n)
                        elif n % 20 == 10:
                            await refused_at_the_cap(n)
                        elif n % 20 == 15:
                            await evicted_and_back()
                        elif n % 20 in (5, 7):  # an alias pick; a name nobody serves (404)
                            await client.post(c.proxy_url + CHAT, json={
                                **chat_body(), "model": "chat" if n % 20 == 5 else "nosuch"})
                        else:
                            await client.post(c.proxy_url + CHAT,
                                              json=chat_body(image(n), stream=bool(n % 2)))
                        await trio.sleep(0.05)

                nursery.start_soon(traffic)

                async def ready() -> bool:
                    try:
                        r = await client.get(f"http://127.0.0.1:{port}/-/ready")
                    except httpx.ConnectError:  # not listening yet
                        return False
                    return r.status_code == 200

                await poll(ready, "readiness")

                async def query(expr: str) -> list[dict[str, Any]]:
                    r = await client.get(api + "/query", params={"query": expr})
                    body = r.json()
                    assert body["status"] == "success", body
                    return body["data"]["result"]

                async def has_rates() -> bool:  # two scrapes with traffic between them
                    found = await query(f"rate(epd_trio_requests_total[{RATE_INTERVAL}]) > 0")
                    return bool(found)

                await poll(has_rates, "request rate", limit=40)
                with_data = time.time()
                for title, expr in panel_queries():

                    async def answered(expr: str = expr, title: str = title) -> list[Any]:
                        found = [float(s["value"][1]) for s in await query(expr)]
                        found = [v for v in found if not math.isnan(v)]
                        return found if title in ZERO_IS_FINE else [v for v in found if v > 0]

                    await poll(answered, f"value for {title!r}: {expr}")
                # Every rule evaluates cleanly, on the scraped data, with no ``for:``.

                async def rules() -> list[dict[str, Any]]:
                    r = await client.get(api + "/rules")
                    found = [rule for group in r.json()["data"]["groups"]
                             for rule in group["rules"]]
                    evaluated = [rule for rule in found  # "0001-...": never yet
                                 if not rule.get("lastEvaluation", "0001").startswith("0001")
                                 and since(rule["lastEvaluation"]) > with_data]
                    return found if found and len(evaluated) == len(found) else []

                found = await poll(rules, "rules evaluated on data")
                assert {rule["name"] for rule in found} >= {"EpdTrioNoHealthyInstance"}
                for rule in found:
                    assert rule["health"] == "ok", rule
                    assert rule["duration"] == 0, rule  # the copy without ``for:`` is loaded
                # Every instance of every role healthy, or (the failing prefill) not the only
                # one of its role: the alert is silent, neither pending nor firing.
                (no_healthy,) = [r for r in found if r["name"] == "EpdTrioNoHealthyInstance"]
                assert no_healthy["state"] == "inactive" and no_healthy["alerts"] == [], (
                    no_healthy)
                # The failing prefill shows: its errors, an eviction, a failover.
                errors = await query('sum by (upstream) (epd_trio_upstream_errors_total) > 0')
                assert {s["metric"]["upstream"] for s in errors} == {failing.url}
                # Kill every decode instance: the no-healthy-instance alert fires for decode.
                for decode in c.decodes:
                    decode.stop()

                async def decode_alert() -> list[dict[str, Any]]:
                    r = await client.get(api + "/alerts")
                    return [a for a in r.json()["data"]["alerts"]
                            if a["labels"]["alertname"] == "EpdTrioNoHealthyInstance"
                            and a["state"] == "firing"]

                (alert,) = await poll(decode_alert, "firing EpdTrioNoHealthyInstance alert")
                assert alert["labels"]["role"] == "decode"
                assert alert["labels"]["severity"] == "critical"
                nursery.cancel_scope.cancel()
        finally:
            await stop_process(process, grace=10)
