"""``python -m bench.burst``: its arithmetic, and one small real run end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import trio

from bench.burst import jain_index, percentile


@pytest.mark.parametrize(
    "values, q, expected",
    [([1.0], 99, 1.0), ([1.0, 2.0, 3.0, 4.0], 50, 2.0), ([float(i) for i in range(1, 101)], 99,
                                                          99.0), ([], 50, None)],
)
def test_percentile(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == expected


def test_jain_index() -> None:
    assert jain_index([10, 10, 10]) == 1.0
    assert jain_index([30, 0, 0]) == pytest.approx(1 / 3)
    assert jain_index([0, 0]) is None


async def test_burst_runs_on_the_embedded_cluster(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    with trio.fail_after(120):
        result = await trio.run_process(
            [sys.executable, "-m", "bench.burst", "--requests", "30", "--concurrency", "30",
             "--stream", "--images", "2", "--compare-direct", "--json", str(report_path),
             "--quiet"],
            capture_stdout=True, capture_stderr=True, check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "[proxy] ok 30/30 (100.0 %)" in out and "proxy CPU:" in out
    report = json.loads(report_path.read_text())
    assert report["proxy"]["ok"] == 30 and report["direct"]["ok"] == 30
    assert report["proxy"]["cpu_ms_per_request"] > 0
    encode = report["instances"]["encode"]
    assert [row["items"] for row in encode["instances"]] == [20, 20, 20]  # 60 items, 3 encoders
    assert encode["fairness"] == 1.0
    assert report["instances"]["decode"]["slots_covered"] == "4/4"
    assert len(report["results"]) == 30


async def test_metrics_cost_runs_every_mode() -> None:
    result = await trio.run_process(
        [sys.executable, "-m", "bench.metrics_cost", "--requests", "50", "--rounds", "1"],
        capture_stdout=True)
    lines = result.stdout.decode().splitlines()
    assert [line.split(":")[0].strip() for line in lines] == [
        "off", "one-process", "multiprocess"]
    assert all("us per streamed P->D request" in line for line in lines)
