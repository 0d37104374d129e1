"""CPU the metrics hooks add to one request: ``python -m bench.metrics_cost``.

Replays, without any I/O, the accounting the pipeline does for one streamed P->D request
(``_accounting.RequestAccount``: request begin, a prefill leg, a decode leg held open as a
relayed stream, first byte, finish) and reports the best per-request time of several rounds, for metrics off
(the trace alone), on in one process, and on in prometheus-client's multiprocess mode (what
``epd-trio serve --workers N`` uses). Each mode runs in a fresh interpreter, because
prometheus-client picks its value storage at import time.

The end-to-end bench (``bench.burst`` with ``EPD_METRICS=true`` / ``false``) cannot resolve a
difference this small on a shared machine: its run-to-run spread is about 0.1 ms.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import timeit

MODES = ("off", "one-process", "multiprocess")


def measure(mode: str, requests: int, rounds: int) -> float:
    """Microseconds per request in this interpreter (``mode`` must match how it was started)."""
    from epd_trio._core.health import Registry
    from epd_trio._core.routing import Instance
    from epd_trio._observe.accounting import Accounting
    from epd_trio._observe.metrics import ProxyMetrics

    prefill, decode = Instance("http://p0:8000", 2), Instance("http://d0:8000", 2)
    registry = Registry.from_stages({"prefill": [prefill], "decode": [decode]})
    accounting = Accounting(registry, ProxyMetrics(enabled=mode != "off"), request_log=False)

    def one_request() -> None:
        account = accounting.begin("/v1/chat/completions", "request-id")
        account.trace.stream = True
        with account.leg("prefill", (prefill, 1)):
            pass
        with account.leg("decode", (decode, 0)) as leg:
            release = leg.hold()
        account.replied()
        release()
        account.finish()

    best = min(timeit.repeat(one_request, number=requests, repeat=rounds))
    return best / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:  # the child: one mode, in a fresh interpreter
        print(f"{measure(args.mode, args.requests, args.rounds):.2f}")
        return
    results = {}
    for mode in MODES:
        env = dict(os.environ)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        with tempfile.TemporaryDirectory() as directory:
            if mode == "multiprocess":
                env["PROMETHEUS_MULTIPROC_DIR"] = directory
            out = subprocess.run(
                [sys.executable, "-m", "bench.metrics_cost", "--mode", mode,
                 "--requests", str(args.requests), "--rounds", str(args.rounds)],
                env=env, check=True, capture_output=True, text=True)
        results[mode] = float(out.stdout)
    for mode, micros in results.items():
        added = "" if mode == "off" else f"  (+{micros - results['off']:.1f} us for the metrics)"
        print(f"{mode:>12}: {micros:6.1f} us per streamed P->D request{added}")


if __name__ == "__main__":
    main()
