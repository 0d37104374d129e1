"""CPU tracing adds to one request: ``python -m bench.tracing_cost``.

Replays, without HTTP, the accounting the pipeline does for one streamed P->D request
(``_accounting.RequestAccount``: begin, a prefill leg, a decode leg held open as a relayed
stream, first byte, finish: the same replay as ``bench.metrics_cost``), in each mode:

- ``off``: tracing off, the client sent no ``traceparent``;
- ``off+context``: tracing off, the client's ``traceparent`` / ``tracestate`` forwarded;
- ``on-unsampled``: tracing on with the default sampler's decision "no" (a root request under
  ``parentbased_traceidratio`` that lost the draw: ``always_off`` here, the same path);
- ``on-sampled``: every request sampled, exported by the real ``BatchSpanProcessor`` and
  OTLP/HTTP exporter to a receiver in the parent process (``epd_trio.testing.otlp_receiver``).

Each mode runs in a fresh interpreter; the figure is the process's CPU time (every thread: the
exporter's too, and the flush of the last batch) per request, the best of ``--rounds``. The
end-to-end ``bench.compare`` (peers ``epd_trio``, ``epd_trio+otel``, ``epd_trio@DIR``) gives the
same comparison through real sockets, with the spread of a shared machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

MODES = ("off", "off+context", "on-unsampled", "on-sampled")
CLIENT = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
          "tracestate": "vendor=abc"}


def measure(mode: str, requests: int, rounds: int, endpoint: str) -> float:
    """Microseconds of process CPU per request in this interpreter."""
    from epd_trio._core.health import Registry
    from epd_trio._core.routing import Instance
    from epd_trio._core.tracing import TracingSettings
    from epd_trio._observe.accounting import Accounting
    from epd_trio._observe.metrics import ProxyMetrics
    from epd_trio._observe.tracing import OtelTracing, Tracing

    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    tracing: Tracing = Tracing()
    if mode.startswith("on"):
        tracing = OtelTracing(TracingSettings(
            enabled=True, sampler="always_on" if mode == "on-sampled" else "always_off"))
    context = CLIENT if mode == "off+context" else {}
    prefill, decode = Instance("http://p0:8000", 2), Instance("http://d0:8000", 2)
    registry = Registry.from_stages({"prefill": [prefill], "decode": [decode]})
    accounting = Accounting(registry, ProxyMetrics(enabled=True), request_log=False,
                            tracing=tracing)

    def one_request() -> None:
        account = accounting.begin("/v1/chat/completions", "request-id", context)
        account.trace.stream = True
        account.trace.model = "model"
        with account.leg("prefill", (prefill, 1)) as leg:
            leg.traced({"x-request-id": "request-id"})
            leg.answered(200)
        with account.leg("decode", (decode, 0)) as leg:
            leg.traced({"x-request-id": "request-id"})
            leg.answered(200)
            release = leg.hold()
        account.replied()
        release()
        account.finish()

    flush = tracing.provider.force_flush if isinstance(tracing, OtelTracing) else None
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for n in range(requests):
            one_request()
            # A replay outruns the export thread and would overflow the SDK's queue (2048
            # spans, then dropped): export every 100 requests, and what is left at the end.
            if flush is not None and (n % 100 == 99 or n == requests - 1):
                flush()
        best = min(best, time.process_time() - started)
    if isinstance(tracing, OtelTracing):
        tracing.provider.shutdown()
    return best / requests * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:  # the child: one mode, in a fresh interpreter
        print(f"{measure(args.mode, args.requests, args.rounds, args.endpoint):.2f}")
        return 0
    from epd_trio.testing.otlp_receiver import OtlpReceiver

    results: dict[str, float] = {}
    with OtlpReceiver() as receiver:
        for mode in MODES:
            env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
            out = subprocess.run(
                [sys.executable, "-m", "bench.tracing_cost", "--mode", mode, "--requests",
                 str(args.requests), "--rounds", str(args.rounds), "--endpoint",
                 receiver.endpoint], env=env, check=True, capture_output=True, text=True)
            results[mode] = float(out.stdout)
        spans = len(receiver.spans)
    for mode, micros in results.items():
        added = "" if mode == "off" else f"  ({micros - results['off']:+.1f} us)"
        print(f"{mode:>13}: {micros:6.1f} us per streamed P->D request{added}")
    expected = 3 * args.requests * args.rounds
    print(f"spans received: {spans} (expected {expected})")
    return 0 if spans == expected else 1


if __name__ == "__main__":
    sys.exit(main())
