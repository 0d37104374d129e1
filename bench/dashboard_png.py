"""A picture of the Grafana dashboard's main panels, from a real Prometheus, into a PNG.

    python -m bench.dashboard_png --out docs/images/dashboard.png        # about 90 s
    python -m bench.dashboard_png --duration 20 --out /tmp/dashboard.png

No Grafana server runs here, so this draws what the dashboard would show with matplotlib (the
``plots`` extra): it starts a fake cluster (an encoder, two prefills, two decodes) behind the
real proxy, a real ``prometheus`` (Debian's package) scraping it every second, drives a steady
mix of streamed and whole image requests for ``--duration`` seconds (one prefill starts failing
a third of the way in, and comes back at two thirds), then runs the panels' own queries from
``deploy/grafana/epd-trio.json`` as range queries (``$__rate_interval`` read as 15 s, ``$job``
as the scrape job) and plots each panel's series.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from epd_trio.testing import Behaviour
from epd_trio.testing.cluster import run_cluster
from epd_trio.testing.media import png_data_url
from epd_trio.testing.process import stop_process

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "epd-trio.json"
RULES = ROOT / "deploy" / "prometheus" / "epd-trio-alerts.yml"
RATE_INTERVAL = "15s"
#: The panels drawn, in this order (titles from the dashboard).
MAIN_PANELS = ("Requests by outcome", "Time to first token (streams)",
               "Latency per stage (p50 / p99)", "Calls per upstream", "Errors per upstream",
               "Health per upstream", "Retries by stage", "In flight per upstream",
               "End-to-end latency")

Series = list[tuple[str, list[float], list[float]]]


def panel_targets(titles: tuple[str, ...] = MAIN_PANELS) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(title, unit, [(query, legend format)]) of each panel named, as the dashboard has it."""
    board = json.loads(DASHBOARD.read_text())
    panels = {p["title"]: p for p in board["panels"] if p["type"] != "row"}
    out = []
    for title in titles:
        panel = panels[title]
        targets = [(t["expr"].replace("$__rate_interval", RATE_INTERVAL).replace("$job", ".+"),
                    t["legendFormat"]) for t in panel["targets"]]
        out.append((title, panel["fieldConfig"]["defaults"]["unit"], targets))
    return out


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's ``{{label}}`` legend format; upstream URLs shortened to their port."""
    text = fmt
    for key, value in labels.items():
        if key == "upstream":
            value = ":" + value.rsplit(":", 1)[-1]
        text = text.replace("{{" + key + "}}", value)
    return text


def series_of(result: list[dict[str, Any]], fmt: str, start: float) -> Series:
    """A range query's matrix as (legend, seconds since start, values), NaN points dropped."""
    out: Series = []
    for item in result:
        points = [(float(t) - start, float(v)) for t, v in item["values"]
                  if not math.isnan(float(v))]
        if points:
            out.append((legend(fmt, item["metric"]), [p[0] for p in points],
                        [p[1] for p in points]))
    return sorted(out)


def draw(panels: list[tuple[str, str, Series]], out: Path, subtitle: str) -> None:
    """The panels on a 3-column grid, dark like Grafana's default theme."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use("dark_background")
    rows = math.ceil(len(panels) / 3)
    fig, axes = plt.subplots(rows, 3, figsize=(16, 3.6 * rows), squeeze=False)
    scale = {"s": (1000.0, "ms"), "reqps": (1.0, "req/s"), "short": (1.0, "")}
    for ax, (title, unit, series) in zip(axes.flat, panels, strict=False):
        factor, label = scale.get(unit, (1.0, unit))
        for name, xs, ys in series:
            ax.plot(xs, [y * factor for y in ys], label=name, linewidth=1.2)
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.2)
        if series:
            ax.legend(fontsize=6, loc="upper left", ncol=2, framealpha=0.3)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds", fontsize=8)
    fig.suptitle(f"epd_trio dashboard (deploy/grafana/epd-trio.json): {subtitle}",
                 fontsize=11, x=0.01, ha="left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def run(args: argparse.Namespace) -> list[tuple[str, str, Series]]:
    import shutil
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("prometheus is not installed (apt-get install prometheus)")
    rng = random.Random(args.seed)
    async with run_cluster(encoders=1, prefills=2, decodes=2, decode_dp=2, health_interval=0.5,
                           health_threshold=2) as c:
        with tempfile.TemporaryDirectory(prefix="epd-dashboard-") as tmp:
            port = free_port()
            config = Path(tmp) / "prometheus.yml"
            config.write_text(
                "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                f'rule_files: ["{RULES}"]\n'
                "scrape_configs:\n  - job_name: epd-trio\n    static_configs: "
                f'[{{targets: ["{c.proxy_url.removeprefix("http://")}"]}}]\n')
            process = await trio.lowlevel.open_process(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                return await _drive_and_query(args, c, port, rng)
            finally:
                await stop_process(process, grace=10)


async def _drive_and_query(args: argparse.Namespace, c: Any, port: int,
                           rng: random.Random) -> list[tuple[str, str, Series]]:
    for fake in c.decodes:
        fake.behaviour = Behaviour(chunk_delay=0.02, tokens=24)
    failing = c.prefills[1]
    start = time.time()
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        async def one(n: int) -> None:
            body = {"model": "fake-model", "max_tokens": rng.choice((8, 16, 24)),
                    "stream": n % 3 != 0,
                    "messages": [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": png_data_url(n % 50)}},
                        {"type": "text", "text": "describe"}]}]}
            await client.post(c.proxy_url + "/v1/chat/completions", json=body)

        async with trio.open_nursery() as nursery:
            n = 0
            deadline = trio.current_time() + args.duration
            while trio.current_time() < deadline:
                elapsed = time.time() - start
                broken = args.duration / 3 < elapsed < 2 * args.duration / 3
                failing.behaviour = Behaviour(fail_status=500, healthy=False) if broken \
                    else Behaviour()
                # A load that rises and falls, so the panels have a shape.
                rate = 8 + 6 * math.sin(elapsed / args.duration * 2 * math.pi)
                nursery.start_soon(one, n)
                n += 1
                await trio.sleep(rng.expovariate(rate))
        await trio.sleep(2)  # the last scrape
        end = time.time()
        api = f"http://127.0.0.1:{port}/api/v1/query_range"
        panels = []
        for title, unit, targets in panel_targets():
            series: Series = []
            for expr, fmt in targets:
                r = await client.get(api, params={"query": expr, "start": start, "end": end,
                                                  "step": 1})
                r.raise_for_status()
                series += series_of(r.json()["data"]["result"], fmt, start)
            panels.append((title, unit, series))
    return panels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dashboard_png", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("dashboard.png"))
    p.add_argument("--duration", type=float, default=90.0, help="seconds of traffic")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    panels = trio.run(run, args)
    draw(panels, args.out, f"{args.duration:g} s of fake traffic, a prefill failing from "
         f"{args.duration / 3:g} to {2 * args.duration / 3:g} s")
    empty = [title for title, _, series in panels if not series]
    print(f"wrote {args.out} ({len(panels)} panels; without data: {empty or 'none'})")
    return 1 if empty else 0


if __name__ == "__main__":
    sys.exit(main())
