"""Check against real vLLM that its ``llm_request`` spans nest under the proxy's leg spans.

    EPD_E2E_HOME=/tmp/vh-trace EPD_E2E_VENV=~/.cache/epd-trio-e2e/venv \\
        .venv/bin/python -m tests.e2e_vllm.check_trace_parent [--layout single|pd]

Run it by hand from the worktree, with the project's venv (``pip install -e ".[test]"``: the
proxy, httpx and ``opentelemetry-proto``); it is not part of the pytest suite. ``EPD_E2E_HOME``
must be a home no cluster runs in (a real-vLLM suite running on the machine uses the default
one); ``EPD_E2E_VENV`` reuses a ready vLLM venv without touching it (see provision.py).

What it does: starts the project's OTLP/HTTP receiver (``epd_trio.testing.otlp_receiver``),
then real vLLM servers on free ports with ``--otlp-traces-endpoint`` pointed at it
(``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``: vLLM 0.32 speaks gRPC by default) --
``single``: one plain server used as decode; ``pd``: a NIXL prefill + decode pair -- then
``epd-trio serve`` in front of them, and sends three chat requests:

1. tracing on (sampler ``always_on``), no client ``traceparent``, not streamed;
2. tracing on, a sampled client ``traceparent``, streamed;
3. tracing off at the proxy (a second proxy), a sampled client ``traceparent`` (forwarded as is).

It prints every trace's span tree and exits 0 only when: each request's proxy SERVER span is
there (in the client's trace, under the client's span, when one was sent), with one CLIENT span
per leg; each leg has exactly one vLLM ``llm_request`` span whose parent is that leg's CLIENT
span (request 3: the client's span, for every leg), in the same trace; and no ``llm_request``
span has any other parent. Exit 1 otherwise, 2 when the servers could not be started. Every
server it started is stopped either way (vLLM's too, through the harness's lifeline, if this
process dies).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from epd_trio.testing.otlp_receiver import TRACES_PATH, OtlpReceiver, ReceivedSpan

from .cluster import MODEL_NAME, Cluster, ClusterError, Server, _plan, recorded_cluster, start_timeout
from .processes import free_ports
from .provision import Home, ensure_model, ensure_venv

SERVICE = "epd-trio-trace-check"
VLLM_SPAN = "llm_request"
#: How long to wait for every span (vLLM's batch exporter is told to send every 0.5 s).
SPANS_TIMEOUT = 60.0


@dataclass(frozen=True)
class Sent:
    """One request this script sent: its id, and the client span it named (if any)."""

    request_id: str
    client: tuple[str, str] | None  # (trace id, span id)
    proxy_traced: bool


def say(message: str) -> None:
    print(f"[trace-check] {message}", file=sys.stderr, flush=True)


# -- the servers ----------------------------------------------------------------------------------
def plan(home: Home, layout: str, receiver: str) -> Cluster:
    """The vLLM servers, each exporting its traces to ``receiver`` over OTLP/HTTP."""
    traces = ["--otlp-traces-endpoint", receiver + TRACES_PATH]
    if layout == "pd":
        cluster = _plan(home, "pd", "text", owned=True)
        for server in cluster.servers.values():
            server.args += traces
        return cluster
    (port,) = free_ports(1)
    run = home.run
    decode = Server("decode", port, traces, log=str(run / "decode.log"),
                    tmpdir=str(run / "tmp" / "decode"))
    return Cluster(home, "single", "text", {"decode": decode}, None, owned=True)


@contextmanager
def vllm(home: Home, layout: str, receiver: str) -> Iterator[Cluster]:
    if recorded_cluster(home) is not None:
        raise ClusterError(f"a cluster is recorded in {home.root}: give this check an "
                           "EPD_E2E_HOME of its own (or, if that one is left over from a killed "
                           "run: python -m tests.e2e_vllm.cluster stop)")
    ensure_venv(home, say)
    ensure_model(home, "text", say)
    # vLLM reads these from its environment (server_env copies this process's).
    os.environ.update({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                       "OTEL_BSP_SCHEDULE_DELAY": "500"})
    cluster = plan(home, layout, receiver)
    started = time.monotonic()
    try:
        for name in cluster.servers:
            cluster.launch(name)
        cluster.save()
        try:
            cluster.wait_ready(list(cluster.servers), start_timeout())
        except ClusterError as exc:
            raise ClusterError(f"{exc}\n{cluster.log_tails()}") from None
        say(f"vLLM ({layout}) ready in {time.monotonic() - started:.0f} s: "
            + ", ".join(f"{n}={s.url}" for n, s in cluster.servers.items()))
        yield cluster
    finally:
        cluster.stop()
        say("vLLM stopped")


@contextmanager
def proxy(cluster: Cluster, env: dict[str, str]) -> Iterator[str]:
    """``epd-trio serve`` in front of ``cluster``; its URL. SIGTERM at the end (the flush)."""
    cmd = [sys.executable, "-m", "epd_trio", "serve", "--port", "0",
           "--decode", cluster.url("decode")]
    if "prefill" in cluster.servers:
        cmd += ["--prefill", cluster.url("prefill")]
    process = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        for line in process.stderr:
            found = re.search(r"listening on (http://\S+)", line)
            if found:
                break
        else:
            raise ClusterError(f"the proxy exited ({process.wait()}) before listening")
        # Keep reading its log (a full pipe would stall the proxy); shown if it fails.
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(process.stderr or ()), daemon=True)
        reader.start()
        yield found.group(1)
        process.send_signal(signal.SIGTERM)
        if process.wait(timeout=30) != 0:
            reader.join(5)
            raise ClusterError(f"the proxy exited with {process.returncode}:\n"
                               + "".join(lines[-25:]))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def send(url: str, sent: Sent, stream: bool) -> None:
    headers = {"x-request-id": sent.request_id}
    if sent.client:
        headers["traceparent"] = f"00-{sent.client[0]}-{sent.client[1]}-01"
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 8, "temperature": 0, "stream": stream}
    with httpx.Client(timeout=180, trust_env=False) as client:
        response = client.post(url + "/v1/chat/completions", json=body, headers=headers)
        if response.status_code != 200:
            raise ClusterError(f"{sent.request_id}: {response.status_code} {response.text[:300]}")
    say(f"{sent.request_id}: 200 ({'streamed' if stream else 'JSON'}"
        f"{', client traceparent' if sent.client else ''})")


# -- the check (no I/O) -------------------------------------------------------------------------
def is_vllm(span: ReceivedSpan) -> bool:
    return span.name == VLLM_SPAN


def is_proxy(span: ReceivedSpan) -> bool:
    return span.resource.get("service.name") == SERVICE


def problems(spans: list[ReceivedSpan], sent: list[Sent], legs: list[str]) -> list[str]:
    """What is wrong with the spans received for ``sent`` (empty: every span nests rightly)."""
    wrong: list[str] = []
    by_id = {(s.trace_id, s.span_id): s for s in spans}
    llm = [s for s in spans if is_vllm(s)]
    expected_parents: set[tuple[str, str]] = set()
    for request in sent:
        if not request.proxy_traced:
            assert request.client is not None
            trace_id, span_id = request.client
            children = [s for s in llm if s.trace_id == trace_id]
            if len(children) != len(legs) or any(s.parent_span_id != span_id for s in children):
                wrong.append(f"{request.request_id} (proxy tracing off): want {len(legs)} "
                             f"llm_request span(s) under the client's span {span_id}, got "
                             + (", ".join(f"parent {s.parent_span_id}" for s in children) or "none"))
            expected_parents.add((trace_id, span_id))
            continue
        servers = [s for s in spans if is_proxy(s) and s.kind == "SERVER"
                   and s.attributes.get("gen_ai.request.id") == request.request_id]
        if len(servers) != 1:
            wrong.append(f"{request.request_id}: {len(servers)} proxy SERVER spans, want 1")
            continue
        server = servers[0]
        if request.client and (server.trace_id, server.parent_span_id) != request.client:
            wrong.append(f"{request.request_id}: SERVER span in {server.trace_id} under "
                         f"{server.parent_span_id}, want the client's {request.client}")
        if not request.client and server.parent_span_id:
            wrong.append(f"{request.request_id}: SERVER span has a parent without a client span")
        clients = [s for s in spans if is_proxy(s) and s.kind == "CLIENT"
                   and (s.trace_id, s.parent_span_id) == (server.trace_id, server.span_id)]
        if sorted(s.name for s in clients) != sorted(legs):
            wrong.append(f"{request.request_id}: leg spans {sorted(s.name for s in clients)}, "
                         f"want {sorted(legs)}")
        for leg in clients:
            expected_parents.add((leg.trace_id, leg.span_id))
            children = [s for s in llm if (s.trace_id, s.parent_span_id)
                        == (leg.trace_id, leg.span_id)]
            if len(children) != 1:
                wrong.append(f"{request.request_id}: {len(children)} llm_request spans under the "
                             f"{leg.name} leg {leg.span_id}, want 1")
    for span in llm:
        if (span.trace_id, span.parent_span_id) not in expected_parents:
            parent = by_id.get((span.trace_id, span.parent_span_id))
            wrong.append(f"llm_request {span.span_id} (trace {span.trace_id}) has parent "
                         f"{span.parent_span_id or 'none'}"
                         + (f" ({parent.kind} {parent.name})" if parent else " (not received)")
                         + ", not a leg of a request sent here")
    return wrong


def tree(spans: list[ReceivedSpan]) -> list[str]:
    """Each trace's spans, indented under their parents (a parent not received: a root)."""
    lines: list[str] = []
    for trace_id in sorted({s.trace_id for s in spans}):
        members = sorted((s for s in spans if s.trace_id == trace_id), key=lambda s: s.start_ns)
        ids = {s.span_id for s in members}
        lines.append(f"trace {trace_id}")
        for root in (s for s in members if s.parent_span_id not in ids):
            _walk(root, members, 1, lines)
    return lines


def _walk(span: ReceivedSpan, members: list[ReceivedSpan], depth: int, lines: list[str]) -> None:
    who = "proxy" if is_proxy(span) else "vLLM" if is_vllm(span) else "?"
    request = span.attributes.get("gen_ai.request.id", "")
    lines.append(f"{'  ' * depth}{span.kind} {span.name} [{who}] span={span.span_id} "
                 f"parent={span.parent_span_id or '-'} {request}".rstrip())
    for child in members:
        if child.parent_span_id == span.span_id:
            _walk(child, members, depth + 1, lines)


def wanted(spans: list[ReceivedSpan], sent: list[Sent], legs: int) -> bool:
    traced = sum(r.proxy_traced for r in sent)
    return (sum(is_vllm(s) for s in spans) >= legs * len(sent)
            and sum(is_proxy(s) for s in spans) >= traced * (1 + legs))


# -- the run ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e_vllm.check_trace_parent",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=("single", "pd"), default="single")
    args = parser.parse_args(argv)
    legs = ["prefill", "decode"] if args.layout == "pd" else ["decode"]
    home = Home.from_env()
    tag = secrets.token_hex(3)
    sent = [Sent(f"trace-check-{tag}-1", None, True),
            Sent(f"trace-check-{tag}-2", (secrets.token_hex(16), secrets.token_hex(8)), True),
            Sent(f"trace-check-{tag}-3", (secrets.token_hex(16), secrets.token_hex(8)), False)]
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    with OtlpReceiver() as receiver:
        say(f"OTLP receiver on {receiver.endpoint}")
        try:
            with vllm(home, args.layout, receiver.endpoint) as cluster:
                traced = {**base_env, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                          "OTEL_TRACES_SAMPLER": "always_on", "OTEL_SERVICE_NAME": SERVICE,
                          "OTEL_BSP_SCHEDULE_DELAY": "500"}
                with proxy(cluster, traced) as url:
                    send(url, sent[0], stream=False)
                    send(url, sent[1], stream=True)
                with proxy(cluster, base_env) as url:
                    send(url, sent[2], stream=False)
                if not receiver.wait_for(lambda s: wanted(s, sent, len(legs)), SPANS_TIMEOUT):
                    say(f"not every span arrived within {SPANS_TIMEOUT:g} s")
        except ClusterError as exc:
            say(str(exc))
            return 2
        spans = list(receiver.spans)
    ours = {r.client[0] for r in sent if r.client} | {
        s.trace_id for s in spans if is_proxy(s)}
    shown = [s for s in spans if s.trace_id in ours or is_vllm(s)]
    print("\n".join(tree(shown)))
    others = Counter(s.name for s in spans if s not in shown)
    print(f"received {len(spans)} spans in {receiver.exports} exports "
          f"({receiver.rejected} rejected); not shown (no request's trace): "
          + (", ".join(f"{n} x{c}" for n, c in sorted(others.items())) or "none"))
    for span in (s for s in spans if is_vllm(s)):  # one is enough: they all carry the same keys
        print(f"vLLM's {VLLM_SPAN} attributes: {dict(sorted(span.attributes.items()))}")
        break
    wrong = problems(spans, sent, legs)
    for line in wrong:
        print(f"WRONG: {line}")
    if not wrong:
        print(f"OK: every llm_request span's parent is its proxy leg's CLIENT span "
              f"({', '.join(legs)}), in the same trace; with tracing off, the client's span")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

