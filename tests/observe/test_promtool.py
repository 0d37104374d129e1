"""The metrics, the alert rules and the dashboard, checked with Prometheus's own tools.

``promtool check metrics`` lints a live scrape of ``epd-trio serve`` (one worker, and two: the
multiprocess merge writes its own exposition); ``promtool check rules`` and ``promtool test
rules`` check ``deploy/prometheus/epd-trio-alerts.yml`` and its unit tests (a firing and a
silent case per alert); the dashboard is regenerated and linted against a real scrape. The
tools come from Debian's ``prometheus`` package (``tests/real_servers.require_binary``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio
import yaml

from epd_trio.testing import FakeVLLM
from epd_trio.testing.process import read_url

from helpers import CHAT, chat_body, image, slug, start_fakes
from real_servers import require_binary

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "epd-trio-alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "epd-trio-alerts.test.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "epd-trio.json"


@asynccontextmanager
async def serving(*args: str) -> AsyncIterator[str]:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "epd_trio", "serve", "--port", "0", *args], stderr=subprocess.PIPE)
    try:
        assert process.stderr is not None
        yield await read_url(process.stderr, rb"listening on (http://\S+)")
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def live_scrape(nursery: trio.Nursery, workers: int) -> str:
    """A scrape of ``epd-trio serve --workers N`` after traffic through every stage, a failing
    prefill (a failover, an error, an eviction), a bad request, a name nobody serves and an
    alias."""
    encoder, decode = FakeVLLM("encode"), FakeVLLM("decode", dp_size=2)
    good, bad = FakeVLLM("prefill"), FakeVLLM("prefill")
    await start_fakes(nursery, encoder, good, bad, decode)
    async with serving("--workers", str(workers), "--encode", encoder.url, "--prefill", good.url,
                       bad.url, "--decode", f"{decode.url}#dp=2", "--health-threshold",
                       "1", "--model-aliases", '{"chat": {"targets": ["fake-model"]}}') as url:
        # It said what it serves, then died: it refuses connections, and the first call to it
        # evicts it (threshold 1).
        bad.stop()
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            r = await client.post(url + CHAT, json={**chat_body(), "model": "chat"})
            assert r.status_code == 200, r.text
            r = await client.post(url + CHAT, json={**chat_body(), "model": "nosuch"})
            assert r.status_code == 404, r.text
        for n in range(8):
            # A fresh connection per request, so every worker gets some.
            async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
                r = await client.post(url + CHAT, json=chat_body(image(n), stream=bool(n % 2)))
                assert r.status_code == 200, r.text
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            assert (await client.post(url + CHAT, content=b"{")).status_code == 400
            text = (await client.get(url + "/metrics")).text
    assert "epd_trio_retries_total" in text
    return text


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_binary("promtool"), *args], input=stdin,
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_live_scrape_passes_promtool_check_metrics(nursery: trio.Nursery,
                                                           workers: int) -> None:
    require_binary("promtool")
    text = await live_scrape(nursery, workers)
    done = promtool("check", "metrics", stdin=text)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (
        done.stdout + done.stderr)
    # No label of ours that a real scrape would rename (``instance`` -> ``exported_instance``).
    labels = set(re.findall(r'[{,]([a-z_]+)="', text))
    assert "upstream" in labels and not labels & {"instance", "job"}
    assert "_created" not in text


# -- the alert rules --------------------------------------------------------------------------------
def alert_names() -> list[str]:
    return re.findall(r"^\s+- alert: (\w+)$", RULES.read_text(), flags=re.MULTILINE)


def test_the_alert_rules_pass_promtool_check_rules() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in done.stdout


def test_the_alert_rules_pass_their_unit_tests() -> None:
    done = promtool("test", "rules", str(RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def runbook_base() -> str:
    """The one base every ``runbook_url`` starts with (the rules file's ``# runbook base:``)."""
    (base,) = re.findall(r"^# runbook base: (\S+)$", RULES.read_text(), flags=re.MULTILINE)
    return base


def test_every_alert_has_a_firing_and_a_silent_case_a_severity_and_a_runbook() -> None:
    text = RULE_TESTS.read_text()
    firing = set(re.findall(r"alertname: (\w+)\n\s+exp_alerts:\n\s+- exp_labels", text))
    silent = set(re.findall(r"alertname: (\w+)\n\s+exp_alerts: \[\]", text))
    names = alert_names()
    assert len(names) == 12 and set(names) == firing == silent
    rules = RULES.read_text()
    runbook = (ROOT / "docs" / "how-to" / "observability.md").read_text()
    for name in names:
        block = rules.split(f"- alert: {name}\n", 1)[1].split("- alert:", 1)[0]
        assert re.search(r"severity: (critical|warning)\n", block), name
        assert "summary:" in block and "description:" in block, name
        assert f'runbook_url: "{runbook_base()}#{slug(name)}"' in block, name
        assert f"### {name}\n" in runbook, name


def test_every_runbook_url_is_absolute_from_the_one_base_and_names_a_runbook_section() -> None:
    """Alertmanager and Grafana show a ``runbook_url`` as a link: a path relative to this
    repository leads nowhere there. One base, which an operator points at their copy of the
    docs; the anchors are the observability page's sections."""
    base = runbook_base()
    assert base.startswith("https://") and "#" not in base
    page = (ROOT / "docs" / "how-to" / "observability.md").read_text()
    sections = {slug(h) for h in re.findall(r"^#{2,6}\s+(.*)$", page, flags=re.MULTILINE)}
    for path in (RULES, RULE_TESTS, KUBERNETES):  # the unit tests expect the same URLs
        urls = re.findall(r"runbook_url: (.*)$", path.read_text(), flags=re.MULTILINE)
        assert len(urls) == len(alert_names()), path
        for url in urls:
            url = url.strip('"')
            assert url.startswith(base + "#"), (path, url)
            assert url.removeprefix(base + "#") in sections, (path, url)


# -- the dashboard ----------------------------------------------------------------------------------
def load_generator() -> object:
    import importlib.util
    spec = importlib.util.spec_from_file_location("epd_dashboard", DEPLOY / "grafana" / "dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def targets() -> list[dict[str, object]]:
    board = json.loads(DASHBOARD.read_text())
    return [t for p in board["panels"] for t in p.get("targets", [])]


def test_the_checked_in_dashboard_is_the_generators_output() -> None:
    generator = load_generator()
    assert DASHBOARD.read_text() == generator.render()  # type: ignore[attr-defined]
    done = subprocess.run([sys.executable, str(DEPLOY / "grafana" / "dashboard.py"), "--check",
                           str(DASHBOARD)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_dashboard_lint() -> None:
    board = json.loads(DASHBOARD.read_text())
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in board["templating"]["list"]}
    assert names == {"datasource", "job"}
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        covered = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                   for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = str(target["expr"])
            assert target["datasource"] == panel["datasource"], panel["title"]
            # Every selector filters on the job; every rate/increase window is Grafana's.
            selectors = re.findall(r"epd_trio_\w+(\{[^}]*\})?", expr)
            assert selectors and all('job=~"$job"' in s for s in selectors), expr
            windows = re.findall(r"\[([^\]]+)\]", expr)
            assert all(w == "$__rate_interval" for w in windows), expr
            assert ("rate(" in expr or "increase(" in expr) == bool(windows), expr
            # A legend names only labels the query keeps.
            kept = {label.strip() for group in re.findall(r"by \(([^)]*)\)", expr)
                    for label in group.split(",")}
            assert set(re.findall(r"\{\{(\w+)\}\}", str(target["legendFormat"]))) <= kept, (
                target["legendFormat"], expr)
            assert not set("{}") & set(re.sub(r"\{\{\w+\}\}", "", str(target["legendFormat"])))
    # The panels the observability how-to promises.
    titles = {p["title"] for p in panels}
    for wanted in ("Requests by outcome", "Time to first token (streams)", "End-to-end latency",
                   "Latency per stage (p50 / p99)", "Calls per upstream", "Errors per upstream",
                   "In flight per upstream", "Health per upstream", "Evictions per upstream",
                   "Retries by stage", "Client cancellations by stage", "Admission refusals"):
        assert wanted in titles


async def test_every_metric_the_dashboard_and_the_alerts_query_is_in_a_real_scrape(
    nursery: trio.Nursery,
) -> None:
    # No Prometheus tool here: the scrape is epd-trio serve's, in front of fakes.
    text = await live_scrape(nursery, 1)
    exported = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines()
                if line and not line.startswith("#")}
    queried = {name for t in targets() for name in re.findall(r"epd_trio_\w+", str(t["expr"]))}
    queried |= set(re.findall(r"epd_trio_\w+", RULES.read_text()))
    assert len(queried) >= 12
    # Exported only by a replica with a state store: tests/test_docs.py checks those against a
    # real redis-server (test_metrics_page_lists_what_a_replica_with_a_state_store_adds).
    state_only = {"epd_trio_state_backend_up"}
    # Exported only with tenants: test_docs's test_metrics_page_lists_what_tenants_add.
    tenant_only = {name for name in queried if name.startswith("epd_trio_tenant_")}
    assert len(tenant_only) >= 5
    assert queried - state_only - tenant_only <= exported, (
        queried - state_only - tenant_only - exported)


def test_the_metric_check_runs_where_prometheus_is_not_installed() -> None:
    """It needs no promtool, so a machine without Debian's prometheus still runs it: here, in
    CI mode (where a required binary that is missing fails the test) with a PATH that has no
    promtool on it."""
    name = "test_every_metric_the_dashboard_and_the_alerts_query_is_in_a_real_scrape"
    bin_dir = Path(sys.executable).parent
    assert shutil.which("promtool", path=str(bin_dir)) is None
    done = subprocess.run(
        [sys.executable, "-m", "pytest", f"tests/observe/test_promtool.py::{name}", "-q",
         "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PATH": str(bin_dir), "CI": "true"})
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr


# -- the Kubernetes objects -------------------------------------------------------------------------
KUBERNETES = DEPLOY / "kubernetes" / "epd-trio-observability.yml"


def test_the_kubernetes_objects_are_generated_and_carry_the_checked_files(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(DEPLOY / "kubernetes" / "generate.py"), "--check",
                           str(KUBERNETES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    text = KUBERNETES.read_text()
    config_map, rule, monitor = text.split("\n---\n")
    assert [o["kind"] for o in yaml.safe_load_all(text)] == [
        "ConfigMap", "PrometheusRule", "ServiceMonitor"]
    dashboard = config_map.split("  epd-trio.json: |\n", 1)[1]
    assert json.loads(dashboard) == json.loads(DASHBOARD.read_text())
    assert "kind: PrometheusRule" in rule
    # The ServiceMonitor scrapes /metrics under the job name the rules select.
    scrape = yaml.safe_load(monitor)
    assert scrape["apiVersion"] == "monitoring.coreos.com/v1"
    assert scrape["spec"]["selector"]["matchLabels"]
    (endpoint,) = scrape["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"]
    (job,) = set(re.findall(r'job="([^"]+)"', RULES.read_text()))
    assert endpoint["relabelings"] == [
        {"action": "replace", "targetLabel": "job", "replacement": job}]
    assert job == yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"][0]["job_name"]
    # The Kubernetes how-to shows it as generated.
    page = (ROOT / "docs" / "how-to" / "kubernetes.md").read_text()
    shown = page.split("\n---\napiVersion: monitoring.coreos.com/v1\nkind: ServiceMonitor\n", 1)[1]
    assert "kind: ServiceMonitor\n" + shown.split("```", 1)[0] == monitor.split("\n", 1)[1]
    groups = "\n".join(line[2:] for line in rule.split("spec:\n", 1)[1].splitlines())
    (tmp_path / "rules.yml").write_text(groups + "\n")
    checked = promtool("check", "rules", str(tmp_path / "rules.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in checked.stdout
