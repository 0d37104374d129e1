"""The Grafana dashboard of epd_trio, generated from code so it cannot drift from the metrics.

    python deploy/grafana/dashboard.py > deploy/grafana/epd-trio.json     # regenerate
    python deploy/grafana/dashboard.py --check deploy/grafana/epd-trio.json

The checked-in JSON is this module's output (``tests/test_promtool.py`` regenerates it and
compares, lints it, and checks every metric a query names against a real scrape). Every query
filters on the ``$job`` variable and reads the ``$datasource`` variable, and every rate uses
``$__rate_interval``, so the dashboard works whatever the scrape job is called.

Rows: traffic and errors; time to first token and end-to-end latency; the latency of each stage
(encode / prefill / decode); per model (requests, time to first token, whether its pool is
complete, alias picks, names nobody serves); per upstream (vLLM instance): calls, errors, in flight, health;
failures by stage (evictions, retries, client cancellations, prefill answers without a KV
handle); admission refusals.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

UID = "epd-trio"
TITLE = "epd_trio"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
#: Grid: 24 columns; each panel is a third of a row unless it says otherwise.
WIDTH, HEIGHT = 8, 8
#: Outcomes that count as the proxy's failure (not the client's, not a client that left).
FAILED_OUTCOMES = "upstream_error|timeout|overloaded|no_instance|stream_error|internal_error"


def sel(name: str, *matchers: str) -> str:
    """``name{job=~"$job",...}``: every selector carries the job filter."""
    return name + "{" + ",".join(['job=~"$job"', *matchers]) + "}"


def rate(name: str, *matchers: str) -> str:
    return f"rate({sel(name, *matchers)}[{RATE}])"


def quantiles(name: str, by: str = "", *matchers: str) -> list[tuple[str, str]]:
    """p50 / p90 / p99 of a histogram (``by``: more grouping labels than ``le``)."""
    group = f"le, {by}" if by else "le"
    by_legend = " {{" + by + "}}" if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) ({rate(name + '_bucket', *matchers)}))",
             f"p{int(q * 100)}{by_legend}") for q in (0.5, 0.9, 0.99)]


class Layout:
    """Hands out panel ids and grid positions, row by row."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self._id = 0
        self._x = 0
        self._y = 0

    def _next_id(self) -> int:
        self._id += 1
        return self._id

    def row(self, title: str) -> None:
        if self._x:
            self._x, self._y = 0, self._y + HEIGHT
        self.panels.append({"type": "row", "title": title, "id": self._next_id(),
                            "collapsed": False, "gridPos": {"x": 0, "y": self._y, "w": 24, "h": 1},
                            "panels": []})
        self._y += 1

    def panel(self, title: str, targets: list[tuple[str, str]], *, unit: str = "short",
              description: str = "", width: int = WIDTH, stack: bool = False,
              max_value: float | None = None) -> None:
        if self._x + width > 24:
            self._x, self._y = 0, self._y + HEIGHT
        defaults: dict[str, Any] = {
            "unit": unit,
            "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stack else 0,
                       "stacking": {"mode": "normal" if stack else "none"}},
        }
        if max_value is not None:
            defaults["max"] = max_value
        self.panels.append({
            "type": "timeseries", "title": title, "description": description,
            "id": self._next_id(), "datasource": DATASOURCE,
            "gridPos": {"x": self._x, "y": self._y, "w": width, "h": HEIGHT},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr,
                         "legendFormat": legend, "range": True}
                        for i, (expr, legend) in enumerate(targets)],
        })
        self._x += width


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (schema 39)."""
    g = Layout()
    g.row("Traffic and errors")
    g.panel("Requests by outcome", [(
        f"sum by (outcome) ({rate('epd_trio_requests_total')})", "{{outcome}}")],
        unit="reqps", stack=True,
        description="Client requests per second, by outcome (docs/reference/metrics.md).")
    failed = rate("epd_trio_requests_total", f'outcome=~"{FAILED_OUTCOMES}"')
    g.panel("Error ratio (the proxy's failures)", [(
        # ``or vector(0)``: no failure at all is a ratio of 0, not an empty panel.
        f"(sum({failed}) or vector(0)) / sum({rate('epd_trio_requests_total')})",
        "failed / all")],
        unit="percentunit", max_value=1,
        description="5xx-class outcomes over all requests; client errors, tenants over their "
                    "own limits (rate_limited) and clients that left are not the proxy's "
                    "failures.")
    g.panel("Admission refusals", [(
        f"sum({rate('epd_trio_admission_refusals_total')})", "refused")], unit="reqps",
        description="Requests refused at EPD_MAX_INFLIGHT (503 with Retry-After).")
    g.row("Latency")
    g.panel("Time to first token (streams)",
            quantiles("epd_trio_time_to_first_byte_seconds", "", 'stream="true"'), unit="s",
            description="Body received to the first token relayed, at the proxy.")
    g.panel("End-to-end latency", quantiles("epd_trio_request_duration_seconds"), unit="s",
            description="Successful requests: body received to the last byte handed over.")
    g.panel("Latency per stage (p50 / p99)", [
        (expr, legend) for expr, legend in quantiles("epd_trio_stage_duration_seconds", "stage")
        if not legend.startswith("p90")], unit="s",
        description="Successful upstream calls by stage: encode, prefill, and decode until "
                    "its first bytes.")
    g.row("Models")
    named = 'model!=""'  # a request refused before its body was read has no model
    streams = 'stream="true"'
    g.panel("Requests per model", [(
        f"sum by (model) ({rate('epd_trio_requests_total', named)})", "{{model}}")],
        unit="reqps", stack=True,
        description="Client requests per second by the model pool they went to (an alias's "
                    "target; * is the any-name pool) (docs/how-to/models.md).")
    g.panel("Time to first token per model (p99)", [(
        "histogram_quantile(0.99, sum by (le, model) "
        f"({rate('epd_trio_time_to_first_byte_seconds_bucket', streams)}))",
        "{{model}}")], unit="s",
        description="Streams: body received to the first token relayed, per model pool.")
    g.panel("Pool complete per model", [(
        f"min by (model) ({sel('epd_trio_model_pool_complete')})", "{{model}}")],
        max_value=1,
        description="1 while every stage the model needs has a live instance (the minimum "
                    "over the proxy replicas and workers); 0: its requests get 503.")
    g.panel("Alias picks per target", [(
        f"sum by (alias, target) ({rate('epd_trio_alias_picks_total')})",
        "{{alias}} -> {{target}}")], unit="reqps", stack=True,
        description="Requests for an alias, by the target they went to: a canary's share.")
    g.panel("Names nobody serves", [(
        f"sum({rate('epd_trio_model_not_found_total')})", "404")], unit="reqps",
        description="Requests answered vLLM's 404 before any leg (no name label: clients "
                    "choose names).")
    g.row("Upstreams (vLLM instances)")
    g.panel("Calls per upstream", [(
        f"sum by (role, upstream) ({rate('epd_trio_upstream_requests_total')})",
        "{{role}} {{upstream}}")], unit="reqps")
    g.panel("Errors per upstream", [(
        f"sum by (role, upstream) ({rate('epd_trio_upstream_errors_total')})",
        "{{role}} {{upstream}}")], unit="reqps",
        description="Transport errors, timeouts, 5xx and broken streams (4xx not counted).")
    g.panel("In flight per upstream", [(
        f"sum by (role, upstream) ({sel('epd_trio_upstream_in_flight')})",
        "{{role}} {{upstream}}")])
    g.panel("Health per upstream", [(
        f"min by (role, upstream) ({sel('epd_trio_instance_healthy')})",
        "{{role}} {{upstream}}")], max_value=1,
        description="1 in rotation, 0 out (the minimum over the proxy replicas and workers).")
    g.panel("Evictions per upstream", [(
        f"sum by (role, upstream) (increase({sel('epd_trio_instance_evictions_total')}[{RATE}]))",
        "{{role}} {{upstream}}")],
        description="Times an instance left the rotation.")
    g.row("Failures by stage")
    g.panel("Retries by stage", [(
        f"sum by (stage) ({rate('epd_trio_retries_total')})", "{{stage}}")], unit="reqps",
        description="Failovers: attempts after the first, by the stage that failed.")
    g.panel("Client cancellations by stage", [(
        f"sum by (stage) ({rate('epd_trio_client_cancellations_total')})", "{{stage}}")],
        unit="reqps")
    g.panel("Prefill answers without a KV handle", [(
        f"sum({rate('epd_trio_prefill_kv_transfer_params_missing_total')})", "missing")],
        unit="reqps",
        description="Decode recomputed the prefill: check the KV connector.")
    g.row("Tenants (fair admission)")
    g.panel("Queue depth per tenant", [(
        f"sum by (tenant, priority) ({sel('epd_trio_tenant_queue_depth')})",
        "{{tenant}} (priority {{priority}})")],
        description="Requests waiting for an admission place (EPD_TENANTS; empty without).")
    g.panel("Admission wait per tenant (p99)", [(
        "histogram_quantile(0.99, sum by (le, tenant) "
        f"({rate('epd_trio_tenant_wait_seconds_bucket')}))", "{{tenant}}")], unit="s",
        description="Seconds an admitted request waited for its place.")
    g.panel("Admitted per tenant", [(
        f"sum by (tenant) ({rate('epd_trio_tenant_admitted_total')})", "{{tenant}}")],
        unit="reqps", stack=True)
    g.panel("Refused per tenant", [(
        f"sum by (tenant, reason) ({rate('epd_trio_tenant_rejected_total')})",
        "{{tenant}} {{reason}}")], unit="reqps",
        description="429 (reason: the limit's name) and 503 (deadline: no place in time).")
    g.panel("Started in headroom per tenant", [(
        f"sum by (tenant, priority) ({rate('epd_trio_tenant_headroom_admitted_total')})",
        "{{tenant}} (priority {{priority}})")], unit="reqps",
        description="Requests started above EPD_MAX_INFLIGHT in EPD_PRIORITY_HEADROOM: a band "
                    "better than one in flight. Steady use: the cap is too low for that band.")
    g.panel("Tokens settled per tenant", [(
        f"sum by (tenant) ({rate('epd_trio_tenant_tokens_settled_total')})", "{{tenant}}")],
        description="Tokens per second used by tenants with tokens_per_minute.")
    return {
        "uid": UID, "title": TITLE, "tags": ["epd_trio", "vllm"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Data source",
             "query": "prometheus", "current": {}, "hide": 0},
            {"type": "query", "name": "job", "label": "Job", "datasource": DATASOURCE,
             "query": {"query": "label_values(epd_trio_requests_total, job)",
                       "refId": "job"},
             "definition": "label_values(epd_trio_requests_total, job)",
             "includeAll": True, "multi": True, "allValue": ".+", "current": {}, "refresh": 2,
             "hide": 0},
        ]},
        "annotations": {"list": []},
        "panels": g.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", metavar="FILE", help="exit 1 unless FILE is the output")
    args = parser.parse_args(argv)
    if args.check:
        with open(args.check, encoding="utf-8") as f:
            same = f.read() == render()
        print(f"{args.check}: {'up to date' if same else 'stale: regenerate it'}",
              file=sys.stderr)
        return 0 if same else 1
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
