"""The docs stay true: reference tables checked against the code, examples run, links resolve.

What is checked, and against what:

- ``docs/reference/settings.md`` against ``epd_trio.Settings`` (every field, its ``EPD_*``
  variable as ``settings_from`` reads it, its default) and ``epd-trio serve --help`` (every flag);
- ``docs/reference/metrics.md`` against what a running proxy exports on ``/metrics`` (family
  names, types, labels);
- ``docs/reference/errors.md`` against ``epd_trio.ProxyError`` and its subclasses;
- every fenced ``python`` block of ``README.md`` and ``docs/`` runs in a subprocess and exits 0,
  unless a ``<!-- not-run: reason -->`` line precedes it (those are counted, never skipped
  silently);
- every Kubernetes manifest (``yaml`` block; only the Kubernetes, Discovery and Replicas pages
  have them) is a whole object the official ``kubernetes`` client's models take without
  losing a field; the replicas example registers through a Service that lists unready pods; the RBAC
  grants the proxy's service account what discovery needs, and the proxy's Deployment's
  arguments, after the image's entrypoint, parse with ``epd-trio serve``'s own parser into
  selectors that match the vLLM pods; the Kubernetes page's objects from
  ``deploy/kubernetes/epd-trio.yml`` are the file's;
- every relative link (and its ``#anchor``) resolves, and no two pages share a file name or a
  title;
- the README's two commands are the ones ``.ci/run`` and ``pyproject.toml`` provide.

The examples import only public names; the manifest check parses with the command line's parser
and the pod rules of ``_core/discovery``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kubernetes.client
import orjson
import pytest
import trio
import trio.testing
import yaml
from prometheus_client.parser import text_string_to_metric_families

import epd_trio
from epd_trio import Instance, ProxyError, Settings, load_settings, settings_from
from epd_trio.__main__ import build_parser, serve_flags
from epd_trio._core.discovery import Discovered, pod_endpoint
from epd_trio._core.meanings import MEANINGS, SERVE_OPTIONS
from epd_trio._core.router_flags import ALIASES, ALL_STAGES, IGNORED, REFUSED
from epd_trio._models.tables import parse_tables
from epd_trio.testing import run_cluster

from helpers import slug
from image_facts import MANIFESTS, containerfile_facts
from real_servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])

#: The README's two commands, exactly as a newcomer pastes them.
DEMO_COMMAND = 'python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/epd-trio demo'
TEST_COMMAND = ('python3 -m venv .venv && .venv/bin/pip install -q -e ".[test]" '
                '&& .venv/bin/python -m pytest')

#: Python blocks deliberately not run (they need something a fresh machine lacks). Raise this
#: only together with a ``<!-- not-run: reason -->`` line above the new block.
EXPECTED_NOT_RUN = 0
#: Languages a fenced block may have; a ``py`` block would otherwise escape the example runner.
FENCE_LANGUAGES = {"python", "bash", "json", "toml", "yaml", ""}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- Markdown, just enough of it -------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    not_run: str | None  # the reason, when marked


def fenced_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = re.match(r"^```(\S*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        assert i < len(lines), f"{rel(page)}:{start + 1}: unclosed code fence"
        previous = next((line for line in reversed(lines[:start]) if line.strip()), "")
        marker = re.match(r"^<!--\s*not-run:\s*(.*?)\s*-->$", previous.strip())
        blocks.append(Block(page, start + 1, opening.group(1), "\n".join(lines[start + 1:i]) + "\n",
                            marker.group(1) if marker else None))
        i += 1
    return blocks


def prose(page: Path) -> str:
    """The page without its fenced blocks (links and tables live in the prose)."""
    text = page.read_text()
    return re.sub(r"^```.*?^```\s*$", "", text, flags=re.M | re.S)


def table_rows(page: Path) -> list[list[str]]:
    """Every table body row of the page, as cells (header and separator rows left out)."""
    rows = []
    lines = prose(page).splitlines()
    for n, line in enumerate(lines):
        if not line.startswith("|") or re.match(r"^\|[\s|:-]+\|$", line):
            continue
        if n + 1 < len(lines) and re.match(r"^\|[\s|:-]+\|$", lines[n + 1]):
            continue  # a header row
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def anchors(page: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", prose(page), flags=re.M)}


# -- settings ------------------------------------------------------------------------------------

SETTINGS_PAGE = DOCS / "reference" / "settings.md"


def env_var(field: str) -> str:
    """The rule the ``Settings`` docstring states: field ``x`` is ``EPD_X``."""
    return "EPD_" + field.upper()


def rendered_default(value: Any) -> str:
    """A default as the settings page writes it."""
    if value is None or value == () or value == {}:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def default_of(field: dataclasses.Field[Any]) -> Any:
    """A field's default, made by its factory where it has one (the model tables: {})."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def sample_value(field: dataclasses.Field[Any]) -> str:
    """A raw environment value for ``field`` different from its default."""
    default = field.default
    if field.name.endswith("_urls"):
        return "http://sample:1#dp=2"
    special = {"dns_nameserver": "127.0.0.1:5353", "service_discovery_api": "http://127.0.0.1:8001",
               "state_url": "redis://sample:1/0", "tenants": '{"sample": {"priority": 1}}',
               "models": '{"sample": {"decode": ["http://sample:2"]}}',
               "model_aliases": '{"chat": {"targets": {"sample": 1}}}',
               "adapters": '{"sql": {"base": "sample", "path": "/a/sql"}}'}
    if field.name in special:
        return special[field.name]
    if default is None or default == ():
        return "sample-key"
    if isinstance(default, bool):
        return "false" if default else "true"
    if isinstance(default, float) and 0 < default < 1:
        return str(default / 2)  # a fraction (cache_threshold)
    if isinstance(default, int | float):
        return str(default + 1)
    samples = {"INFO": "DEBUG", "text": "json", "generic": "moriio",
               "0.0.0.0:36367": "127.0.0.1:36368", "round_robin": "least_loaded",
               "epd:": "fleet-b:"}
    assert default in samples, f"add a sample value for {field.name} to test_docs.sample_value"
    return samples[default]


def needs(field: str) -> dict[str, str]:
    """The other variables a sample value of ``field`` is valid only with."""
    if field == "service_discovery":
        return {"EPD_DECODE_SELECTOR": "app=sample"}
    if field == "global_cursor":
        return {"EPD_STATE_URL": "redis://sample:1/0"}
    if field.endswith("_selector"):
        return {"EPD_SERVICE_DISCOVERY": "true"}
    if field in ("service_discovery_kubeconfig", "service_discovery_context"):
        return {"EPD_SERVICE_DISCOVERY": "true", "EPD_DECODE_SELECTOR": "app=sample"}
    return {}


def documented_settings() -> dict[str, list[str]]:
    """The rows of the settings page whose first cell is an ``EPD_*`` variable."""
    rows = {}
    for cells in table_rows(SETTINGS_PAGE):
        name = code_spans(cells[0])
        if name and name[0].startswith("EPD_"):
            assert len(cells) == 4, f"settings row {cells[0]} has {len(cells)} cells, not 4"
            assert name[0] not in rows, f"{name[0]} is listed twice"
            rows[name[0]] = cells
    return rows


def serve_help() -> str:
    result = subprocess.run([sys.executable, "-m", "epd_trio", "serve", "--help"],
                            capture_output=True, text=True, check=True, env=clean_env())
    return result.stdout


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}


def test_settings_page_lists_every_setting_with_its_variable_and_default() -> None:
    rows = documented_settings()
    fields = dataclasses.fields(Settings)
    expected = {env_var(f.name) for f in fields} | {"EPD_CONFIG"}
    assert set(rows) == expected, (
        f"missing from the page: {sorted(expected - set(rows))}; "
        f"on the page but not settings: {sorted(set(rows) - expected)}")
    base = {"EPD_DECODE_URLS": "http://d0:1"}
    for field in fields:
        name = env_var(field.name)
        # The variable really is the one the code reads.
        value = getattr(settings_from({**base, **needs(field.name), name: sample_value(field)}),
                        field.name)
        default = default_of(field)
        assert value != default, f"{name} does not change Settings.{field.name}"
        default_cell = rows[name][2]
        shown = "none" if default_cell.startswith("none") else (code_spans(default_cell) or [""])[0]
        assert shown == rendered_default(default), (
            f"{name}: the page says the default is {default_cell!r}, the code "
            f"{rendered_default(field.default)!r}")
        meaning = MEANINGS[field.name]
        assert plain(rows[name][3]).startswith(meaning.text), (
            f"{name}: the page's meaning must open with serve --help's line "
            f"({meaning.text!r}, _core/meanings.py), then go on")
        if type(field.default) in (int, float):
            assert meaning.unit and meaning.unit in re.findall(r"\w+", meaning.text), (
                f"{name} is a number: its meaning must name its unit")


def plain(cell: str) -> str:
    """A table cell as words: links as their text, no code or bold marks."""
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", cell).replace("`", "").replace("**", "")


def test_settings_page_serving_options_open_with_their_help_line() -> None:
    rows = {code_spans(cells[0])[0]: cells for cells in table_rows(SETTINGS_PAGE)
            if code_spans(cells[0])}
    for flag, meaning in SERVE_OPTIONS.items():
        cells = rows["EPD_CONFIG" if flag == "--config" else flag]
        assert plain(cells[-1]).startswith(meaning.text), flag
        if meaning.unit:
            assert meaning.unit in re.findall(r"\w+", meaning.text), flag


def test_settings_page_maps_the_routers_flags_as_the_parser_does() -> None:
    """"Coming from vllm-router / SGLang": one row per accepted flag, naming ours, and one
    bullet per refused flag, giving the parser's own reason."""
    text = prose(SETTINGS_PAGE)
    section = text[text.index("## Coming from vllm-router / SGLang"):]
    section = section[:section.index("\n## ", 1)]
    mapped = {code_spans(cells[0])[0]: code_spans(cells[1]) for cells in table_rows(SETTINGS_PAGE)
              if cells and code_spans(cells[0]) and code_spans(cells[0])[0] in ALIASES}
    assert mapped == {theirs: [ours] for theirs, ours in ALIASES.items()}
    for flag in (ALL_STAGES, *IGNORED):
        assert f"`{flag}`" in section, flag
    bullets = dict(re.findall(r"^- `(--[\w-]+)`: (.*)$", section, flags=re.M))
    assert {flag: plain(why) for flag, why in bullets.items()} == REFUSED


def test_epd_config_names_a_settings_file(tmp_path: Path) -> None:
    config = tmp_path / "epd.toml"
    config.write_text('decode_urls = ["http://from-file:1#dp=2"]\nhealth_threshold = 7\n')
    settings = load_settings({"EPD_CONFIG": str(config)})
    assert settings.decode_urls == (Instance("http://from-file:1", 2),)
    assert settings.health_threshold == 7


def test_settings_page_flags_are_the_cli_flags() -> None:
    help_text = serve_help()
    cli_flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", help_text)) - {"--help"}
    rows = documented_settings()
    documented: set[str] = set()
    for name, cells in rows.items():
        flags = code_spans(cells[1])
        if cells[1] == "none":
            # A key: no flag at all (it would show in ps).
            field = name.removeprefix("EPD_").lower().replace("_", "-")
            assert f"--{field}" not in cli_flags, f"{name} has a flag but the page says none"
            continue
        assert flags and all(f.startswith("--") for f in flags), f"{name}: bad flag cell {cells[1]!r}"
        documented |= set(flags)
    serving = {code_spans(cells[0])[0].split()[0] for cells in table_rows(SETTINGS_PAGE)
               if code_spans(cells[0]) and code_spans(cells[0])[0].startswith("--")}
    documented |= serving
    assert documented == cli_flags, (
        f"in `epd-trio serve --help` but not on the page: {sorted(cli_flags - documented)}; "
        f"on the page but not a flag: {sorted(documented - cli_flags)}")


# -- metrics -------------------------------------------------------------------------------------

METRICS_PAGE = DOCS / "reference" / "metrics.md"
SAMPLE_SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}


def documented_metrics() -> dict[str, tuple[str, set[str]]]:
    metrics = {}
    for cells in table_rows(METRICS_PAGE):
        name = code_spans(cells[0])
        if name and name[0].startswith("epd_trio_"):
            metrics[name[0]] = (cells[1], set(code_spans(cells[2])))
    return metrics


#: The families only a replica with a shared state store exports (their own table).
STATE_METRICS = ("epd_trio_state_", "epd_trio_global_cursor_")
#: The KV index's families (only with precise_cache_aware or the prefill bypass on).
KV_METRICS = ("epd_trio_kv_", "epd_trio_prefill_bypassed")
#: Fair admission's families (only with tenants).
TENANT_METRICS = ("epd_trio_tenant_",)


async def test_metrics_page_lists_what_tenants_add(client: httpx.AsyncClient) -> None:
    async with run_cluster(decodes=1, tenant_header="x-tenant") as c:
        metrics = c.proxy.metrics  # a sample of each family, to read its labels from
        metrics.tenant_queued("default", 0, 1)
        metrics.tenant_admitted("default", 0, 0.5)
        metrics.tenant_rejected("default", 0, "deadline")
        metrics.tenant_headroom("default", 0)
        metrics.tenant_settled("default", 0, 10)
        text = (await client.get(c.proxy_url + "/metrics")).text
    check_family_rows(text, TENANT_METRICS)


async def test_metrics_page_lists_what_the_kv_index_adds(client: httpx.AsyncClient) -> None:
    async with run_cluster(prefills=1, decodes=1, prefill_policy="precise_cache_aware") as c:
        metrics = c.proxy.metrics  # a sample of each family, to read its labels from
        metrics.rendered("ok", 0.01)
        metrics.looked_up(2e-5)
        metrics.kv_decision("prefill", "exact", 64, 32)
        metrics.prefill_bypassed()
        metrics.kv_slots([("http://p0:8000", "", "exact", 3,
                           {"events": 1, "gaps": 0, "replays": 0})])
        text = (await client.get(c.proxy_url + "/metrics")).text
    check_family_rows(text, KV_METRICS)


def check_family_rows(text: str, prefixes: tuple[str, ...]) -> None:
    """The families of ``text`` under ``prefixes`` are exactly the page's, with its labels."""
    exported = {name: kind for name, kind in re.findall(r"^# TYPE (epd_trio_\w+) (\w+)$", text,
                                                        flags=re.M)
                if name.startswith(prefixes)}
    documented = {name: row for name, row in documented_metrics().items()
                  if name.startswith(prefixes)}
    assert set(documented) == set(exported)
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(set(sample.labels) - {"le"})
    for name, (kind, doc_labels) in documented.items():
        assert kind == exported[name]
        seen = [labels[name + suffix] for suffix in SAMPLE_SUFFIXES[kind] if name + suffix in labels]
        assert seen and seen[0] == doc_labels, (name, seen, doc_labels)


async def test_metrics_page_lists_what_a_replica_with_a_state_store_adds(
    client: httpx.AsyncClient, redis_server: RedisServer
) -> None:
    async with run_cluster(decodes=1, state_url=redis_server.url, state_prefix="docs:",
                           global_cursor=True) as c:
        assert c.proxy.state is not None
        with trio.fail_after(10):
            await c.proxy.state.roster_loaded.wait()
        c.proxy.metrics.global_cursor_fallback("decode")  # a sample to read the label from
        text = (await client.get(c.proxy_url + "/metrics")).text
    check_family_rows(text, STATE_METRICS)


async def test_metrics_page_lists_what_the_proxy_exports(client: httpx.AsyncClient) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo1"}}
    body = {"model": "fake-model", "max_tokens": 3,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}]}
    # Two encoders, the first one dead: the first request fails over (a retry, an upstream error)
    # and, at threshold 1, evicts it; so every family has a sample to read labels from.
    # An alias and a name nobody serves: the model families have samples too.
    async with run_cluster(encoders=2, prefills=1, prefill_dp=2, decodes=1, decode_dp=2,
                           health_threshold=1,
                           model_aliases={"chat": {"targets": {"fake-model": 1}}}) as c:
        c.encoders[0].stop()
        await trio.testing.wait_all_tasks_blocked()
        for stream in (False, True):
            r = await client.post(c.proxy_url + "/v1/chat/completions", json={**body, "stream": stream})
            assert r.status_code == 200, r.text
        for model, status in (("chat", 200), ("nosuch", 404)):
            r = await client.post(c.proxy_url + "/v1/chat/completions",
                                  json={**body, "model": model})
            assert r.status_code == status, r.text
        r = await client.post(c.proxy_url + "/v1/completions",
                              json={"model": "fake-model", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        await trio.testing.wait_all_tasks_blocked()
        text = (await client.get(c.proxy_url + "/metrics")).text
    types = dict(re.findall(r"^# TYPE (epd_trio_\w+) (\w+)$", text, flags=re.M))
    # prometheus-client adds a ``<name>_created`` gauge for counters and histograms.
    exported = {name: kind for name, kind in types.items()
                if not (name.endswith("_created") and kind == "gauge" and any(
                    other in types for other in (name[:-8], name[:-8] + "_total")))}
    documented = {name: row for name, row in documented_metrics().items()
                  if not name.startswith(STATE_METRICS + KV_METRICS + TENANT_METRICS)}
    assert set(documented) == set(exported), (
        f"exported but not on the page: {sorted(set(exported) - set(documented))}; "
        f"on the page but not exported: {sorted(set(documented) - set(exported))}")
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(set(sample.labels) - {"le"})
    for name, (kind, doc_labels) in documented.items():
        assert kind == exported[name], f"{name}: the page says {kind}, /metrics {exported[name]}"
        seen = [labels[name + suffix] for suffix in SAMPLE_SUFFIXES[kind] if name + suffix in labels]
        assert seen, f"{name} had no sample after the test's requests: extend them"
        assert seen[0] == doc_labels, f"{name}: the page lists {doc_labels}, /metrics has {seen[0]}"


# -- errors --------------------------------------------------------------------------------------

ERRORS_PAGE = DOCS / "reference" / "errors.md"


def proxy_errors() -> list[type[ProxyError]]:
    found, todo = [], [ProxyError]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("epd_trio"):
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_errors_page_lists_every_proxy_error_with_its_status_and_type() -> None:
    rows = {}
    for cells in table_rows(ERRORS_PAGE):
        name = code_spans(cells[0])
        if len(cells) == 5 and name and name[0][0].isupper():
            rows[name[0]] = cells
    classes = {cls.__name__: cls for cls in proxy_errors()}
    assert set(rows) == set(classes), (
        f"not on the page: {sorted(set(classes) - set(rows))}; "
        f"not an exception: {sorted(set(rows) - set(classes))}")
    for name, cls in classes.items():
        exception, status, kind, code, _ = rows[name]
        assert code_spans(status)[0] == str(cls.status), f"{name}: status"
        assert code_spans(kind) == [cls.type], f"{name}: type"
        assert (code_spans(code) or ["the status"])[0] == (cls.code or "the status"), f"{name}: code"
        assert ("*public*" in exception) == (name in epd_trio.__all__), f"{name}: public marker"


# -- examples ------------------------------------------------------------------------------------

ALL_BLOCKS = [block for page in PAGES for block in fenced_blocks(page)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.language == "python" and b.not_run is None]


def test_every_python_block_runs_or_says_why_not() -> None:
    odd = [(rel(b.page), b.line, b.language) for b in ALL_BLOCKS if b.language not in FENCE_LANGUAGES]
    assert not odd, f"a fenced block with another language would escape the example runner: {odd}"
    not_run = [b for b in ALL_BLOCKS if b.not_run is not None]
    for block in not_run:
        assert block.language == "python", f"{rel(block.page)}:{block.line}: not-run on a non-python block"
        assert block.not_run, f"{rel(block.page)}:{block.line}: not-run needs a reason"
    assert len(not_run) == EXPECTED_NOT_RUN, (
        "python blocks marked not-run: "
        + ", ".join(f"{rel(b.page)}:{b.line} ({b.not_run})" for b in not_run))
    assert len(PYTHON_BLOCKS) >= 10  # the README's and docs' examples are all collected
    markers = sum(len(re.findall(r"^<!--\s*not-run:", page.read_text(), flags=re.M)) for page in PAGES)
    assert markers == len(not_run), "a not-run marker that precedes no python block"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[f"{rel(b.page)}:{b.line}" for b in PYTHON_BLOCKS])
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block.code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, env=clean_env(), check=False)
    assert result.returncode == 0, (
        f"{rel(block.page)}:{block.line} exited {result.returncode}\n{result.stdout}{result.stderr}")


# -- Kubernetes manifests --------------------------------------------------------------------------

KUBERNETES_PAGES = [DOCS / "how-to" / page for page in ("kubernetes.md", "discovery.md", "replicas.md")]
#: Custom resources a page may show, which the ``kubernetes`` client has no model of: only
#: their metadata is checked (tests/observe/test_promtool.py checks the prometheus-operator objects
#: against the generator's output).
CUSTOM_RESOURCES = {("monitoring.coreos.com/v1", "PrometheusRule"),
                    ("monitoring.coreos.com/v1", "ServiceMonitor")}


def manifests(page: Path) -> list[tuple[Block, dict[str, Any]]]:
    """Every object of every ``yaml`` block of ``page``."""
    return [(block, document) for block in fenced_blocks(page) if block.language == "yaml"
            for document in yaml.safe_load_all(block.code) if document is not None]


def as_model(document: dict[str, Any], where: str) -> Any:
    """The ``kubernetes`` client's model of ``document``; anything the model does not know
    (a misspelt field) makes the round trip differ, and so fails."""
    api_version, kind = document.get("apiVersion", ""), document.get("kind", "")
    if (api_version, kind) in CUSTOM_RESOURCES:
        client = kubernetes.client.ApiClient()
        meta = client.deserialize(orjson.dumps(document["metadata"]).decode(), "V1ObjectMeta",
                                  "application/json")
        assert client.sanitize_for_serialization(meta) == document["metadata"], where
        return None
    version = api_version.rpartition("/")[2]
    name = version[:1].upper() + version[1:] + kind
    assert hasattr(kubernetes.client, name), f"{where}: no model {name} for {api_version} {kind}"
    client = kubernetes.client.ApiClient()
    model = client.deserialize(orjson.dumps(document).decode(), name, "application/json")
    assert client.sanitize_for_serialization(model) == document, (
        f"{where}: fields the {name} model does not have (misspelt?)")
    return model


def test_the_manifest_check_covers_every_page_with_yaml() -> None:
    with_yaml = [page for page in PAGES
                 if any(block.language == "yaml" for block in fenced_blocks(page))]
    assert sorted(map(rel, with_yaml)) == sorted(map(rel, KUBERNETES_PAGES))


@pytest.mark.parametrize("page", KUBERNETES_PAGES, ids=rel)
def test_every_manifest_is_a_kubernetes_object(page: Path) -> None:
    found = manifests(page)
    assert found, f"{rel(page)} has no yaml block"
    for block, document in found:
        assert {"apiVersion", "kind", "metadata"} <= document.keys(), (
            f"{rel(page)}:{block.line}: not a whole object (a fragment would escape this test)")
        as_model(document, f"{rel(page)}:{block.line} {document['kind']}")


def test_the_kubernetes_page_grants_what_discovery_needs_and_runs_it() -> None:
    """The RBAC lets the Deployment's service account watch pods; the proxy's arguments parse
    with ``epd-trio serve``'s own parser into selectors that match the vLLM pods' labels."""
    objects = {(doc["kind"], doc["metadata"]["name"]): as_model(doc, doc["kind"])
               for _block, doc in manifests(DOCS / "how-to" / "kubernetes.md")}
    role = objects["Role", "epd-trio-pod-reader"]
    binding = objects["RoleBinding", "epd-trio-pod-reader"]
    account = objects["ServiceAccount", "epd-trio"]
    proxy = objects["Deployment", "epd-trio"]
    decode = objects["Deployment", "vllm-decode"]
    assert any(rule.api_groups == [""] and "pods" in rule.resources
               and {"get", "list", "watch"} <= set(rule.verbs) for rule in role.rules)
    assert (binding.role_ref.kind, binding.role_ref.name) == ("Role", role.metadata.name)
    assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [
        ("ServiceAccount", account.metadata.name, account.metadata.namespace)]
    assert proxy.spec.template.spec.service_account_name == account.metadata.name
    namespaces = {o.metadata.namespace for o in (role, binding, account, proxy, decode)}
    assert namespaces == {"serving"}

    (container,) = proxy.spec.template.spec.containers
    assert container.command is None  # the image's entrypoint runs; the arguments follow it
    command = containerfile_facts().command
    assert command[:2] == ("epd-trio", "serve")
    args = build_parser().parse_args([*command[1:], *container.args])
    settings = settings_from({e.name: e.value for e in container.env or []},
                             flags=serve_flags(args))
    assert settings.service_discovery and settings.layout == "P+D"
    assert dict(settings.selectors()) == {"prefill": "app=vllm,role=prefill",
                                          "decode": "app=vllm,role=decode"}
    assert args.port == container.ports[0].container_port == settings.service_discovery_port
    assert container.readiness_probe.http_get.path == "/ready"
    assert container.liveness_probe.http_get.path == "/health"

    labels = decode.spec.template.metadata.labels
    selector = dict(settings.selectors())["decode"]
    assert all(labels.get(k) == v for k, v in (term.split("=") for term in selector.split(",")))
    assert pod_endpoint({"metadata": decode.spec.template.metadata.to_dict() | {"name": "d"},
                         "status": {"phase": "Running", "podIP": "10.0.0.1",
                                    "conditions": [{"type": "Ready", "status": "True"}]}},
                        settings.service_discovery_port, "decode") == Discovered(
        Instance("http://10.0.0.1:8000", 1))
    (vllm,) = decode.spec.template.spec.containers
    assert vllm.args[vllm.args.index("--port") + 1] == str(settings.service_discovery_port)
    assert vllm.readiness_probe.http_get.path == "/health"


def test_the_kubernetes_page_shows_the_manifest_files_objects_as_they_are() -> None:
    """The page shows objects of ``deploy/kubernetes/epd-trio.yml`` (checked against the
    image's facts by ``tests/container/test_manifests.py``): each is the file's, field for
    field, whatever its YAML style."""
    in_file = {(doc["kind"], doc["metadata"]["name"]): doc
               for doc in yaml.safe_load_all(MANIFESTS.read_text()) if doc is not None}
    shown = [doc for _block, doc in manifests(DOCS / "how-to" / "kubernetes.md")
             if (doc["kind"], doc["metadata"]["name"]) in in_file]
    assert {(doc["kind"], doc["metadata"]["name"]) for doc in shown} == {
        ("ServiceAccount", "epd-trio"), ("Role", "epd-trio-pod-reader"),
        ("RoleBinding", "epd-trio-pod-reader"), ("Deployment", "epd-trio")}
    for doc in shown:
        assert doc == in_file[doc["kind"], doc["metadata"]["name"]], doc["kind"]


# -- links and commands --------------------------------------------------------------------------

def test_the_replicas_example_registers_through_a_service_that_publishes_pods_not_ready() -> None:
    """The cold start: no pod is Ready before an instance registers, so registrations go
    through a Service that lists every pod, and the clients through one that does not."""
    objects = [doc for _block, doc in manifests(DOCS / "how-to" / "replicas.md")]
    services = {doc["metadata"]["name"]: doc["spec"] for doc in objects if doc["kind"] == "Service"}
    assert services["epd-proxy-register"].get("publishNotReadyAddresses") is True
    assert not services["epd-proxy"].get("publishNotReadyAddresses")
    sidecar = next(c for doc in objects if doc["kind"] == "Deployment"
                   for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == "register")
    assert "epd-proxy-register" in sidecar["args"][0] and "X-API-Key" in sidecar["args"][0]


def test_every_relative_link_resolves() -> None:
    broken = []
    checked = 0
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            checked += 1
            if not file.exists():
                broken.append(f"{rel(page)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{rel(page)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
    assert checked > 50


def test_no_two_pages_share_a_subject() -> None:
    """One subject, one page: two pages named alike (a performance page at the top of ``docs/``
    beside ``docs/discussion/performance.md``, issue 31) drift apart, and links pick one at random.
    A file name or a title used twice fails, naming both pages."""
    for key, what in ((lambda page: page.name, "file name"),
                      (lambda page: page.read_text().partition("\n")[0].strip(), "title")):
        seen: dict[str, Path] = {}
        for page in PAGES:
            other = seen.setdefault(key(page), page)
            assert other is page, f"{rel(other)} and {rel(page)} share a {what}: merge them"


def test_readme_commands_are_what_ci_and_the_package_run() -> None:
    readme = [b.code.strip() for b in fenced_blocks(ROOT / "README.md") if b.language == "bash"]
    assert readme[:2] == [DEMO_COMMAND, TEST_COMMAND], "the README's two commands changed"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any(line.startswith(TEST_COMMAND + " ") or line == TEST_COMMAND for line in ci), (
        ".ci/run no longer runs the README's test command verbatim")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["epd-trio"] == "epd_trio.__main__:main"
    # Every copy of the test command in the docs is the README's.
    for block in ALL_BLOCKS:
        if block.language == "bash" and 'install -q -e ".[test]"' in block.code:
            assert block.code.strip() == TEST_COMMAND, f"{rel(block.page)}:{block.line}"


def test_the_models_pages_tables_are_a_whole_configuration(tmp_path: Path) -> None:
    """The TOML example of docs/how-to/models.md, as a config file: three tables, read as the
    page says (the pinned instances by role, the pool's own settings and cap, the alias)."""
    page = DOCS / "how-to" / "models.md"
    (block,) = [b for b in fenced_blocks(page) if b.language == "toml"]
    config = tmp_path / "models.toml"
    config.write_text(block.code)
    settings = load_settings({"EPD_CONFIG": str(config)})
    tables = parse_tables(settings)
    assert sorted(tables.pools) == ["llama-v1", "qwen2-vl"]
    qwen = tables.pools["qwen2-vl"]
    assert qwen.specs["prefill"] == {"http://p0:8000"} and qwen.max_inflight == 256
    assert qwen.settings == {"prefill_policy": "cache_aware"}
    assert {i.url: i.dp_size for i in settings.listed("decode")} == {
        "http://d0:8000": 8, "http://d1:8000": 1, "http://d2:8000": 1}
    assert tables.aliases["chat"].targets == (("llama-v1", 90.0), ("qwen2-vl", 10.0))
    assert settings.layout == "E+P+D"
