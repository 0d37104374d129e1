"""A real Prometheus scraping a live epd_trio: the dashboard's queries and the alert rules on
real data (Debian's ``prometheus``; one server for this module, on a loopback port).

One test, on purpose: Prometheus's first sample arrives 5-6 s after it starts
(/work/shared/STACK-NOTES.md), so it is started once, scrapes every second, and every check
runs on the same data: each panel's query returns data where the traffic produces it, every
rule evaluates without error, and the no-healthy-instance alert goes pending once the decode
instances are killed. Waiting is polling Prometheus's HTTP API (its scrape clock is its own),
bounded by a deadline.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import trio

from epd_trio.testing import Behaviour
from epd_trio.testing.cluster import run_cluster
from epd_trio.testing.process import stop_process

from helpers import CHAT, chat_body, image
from real_servers import require_binary

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "epd-trio-alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "epd-trio.json"
#: Grafana's ``$__rate_interval`` for a 1 s scrape is at least 4 scrapes; 15 s leaves margin.
RATE_INTERVAL = "15s"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


async def test_a_real_prometheus_scrapes_the_proxy_with_the_rules(tmp_path: Path) -> None:
    binary = require_binary("prometheus")
    async with run_cluster(encoders=1, prefills=2, decodes=2, health_interval=0.2,
                           health_threshold=1) as c:
        failing = c.prefills[1]

        async def fail_probes_too() -> None:  # after its first request: then it is evicted
            failing.behaviour.healthy = False

        failing.behaviour = Behaviour(fail_status=500, gate=fail_probes_too)
        port = free_port()
        (tmp_path / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{RULES}"]
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

                async def traffic() -> None:
                    n = 0
                    while True:  # a steady trickle, until the checks are done
                        n += 1
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
                for title, expr in panel_queries():

                    async def answered(expr: str = expr) -> list[dict[str, Any]]:
                        found = await query(expr)
                        return [s for s in found if not math.isnan(float(s["value"][1]))]

                    await poll(answered, f"data for {title!r}: {expr}")
                # Every rule evaluates cleanly.

                async def rules() -> list[dict[str, Any]]:
                    r = await client.get(api + "/rules")
                    found = [rule for group in r.json()["data"]["groups"]
                             for rule in group["rules"]]
                    evaluated = [rule for rule in found  # "0001-...": never yet
                                 if not rule.get("lastEvaluation", "0001").startswith("0001")]
                    return found if found and len(evaluated) == len(found) else []

                found = await poll(rules, "evaluated rules")
                assert {rule["name"] for rule in found} >= {"EpdTrioNoHealthyInstance"}
                for rule in found:
                    assert rule["health"] == "ok", rule
                # The failing prefill shows: its errors, an eviction, a failover.
                errors = await query('sum by (upstream) (epd_trio_upstream_errors_total) > 0')
                assert {s["metric"]["upstream"] for s in errors} == {failing.url}
                # Kill every decode instance: the no-healthy-instance alert goes pending
                # (it fires after its ``for: 1m``, which promtool's unit tests check).
                for decode in c.decodes:
                    decode.stop()

                async def decode_alert() -> list[dict[str, Any]]:
                    r = await client.get(api + "/alerts")
                    return [a for a in r.json()["data"]["alerts"]
                            if a["labels"]["alertname"] == "EpdTrioNoHealthyInstance"]

                (alert,) = await poll(decode_alert, "EpdTrioNoHealthyInstance alert")
                assert alert["labels"]["role"] == "decode" and alert["state"] in (
                    "pending", "firing")
                assert alert["labels"]["severity"] == "critical"
                nursery.cancel_scope.cancel()
        finally:
            await stop_process(process, grace=10)
