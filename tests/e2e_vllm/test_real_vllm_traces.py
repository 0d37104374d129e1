"""Traces through real vLLM: each server's ``llm_request`` span nests under the proxy's leg span.

vLLM joins a trace when a request carries ``traceparent`` and the server runs with
``--otlp-traces-endpoint``: the session's servers all do, exporting to the session's OTLP
receiver (conftest). The proxy runs in-process with an in-memory exporter, so the test holds
both sides' spans and checks the join: each leg's CLIENT span (encode, prefill, decode) has
exactly one vLLM ``llm_request`` child, in the same trace; with tracing off at the proxy, the
client's own span is every leg's parent (the headers are forwarded as they came).
"""

from __future__ import annotations

import secrets
from typing import Any

import httpx
import pytest
import trio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from epd_trio import Instance, Settings
from epd_trio._observe.tracing import create_tracing
from epd_trio.testing import serve_proxy
from epd_trio.testing.otlp_receiver import OtlpReceiver, ReceivedSpan

from .cluster import Cluster
from .test_real_vllm import CHAT, chat, generated_text, image_part, salted

pytestmark = pytest.mark.vllm_e2e

VLLM_SPAN = "llm_request"
#: vLLM's batch exporter sends every 0.5 s (cluster.TRACE_ENV); allow a loaded machine more.
SPANS_DEADLINE = 60.0


def traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"


def proxy_spans(exporter: InMemorySpanExporter) -> list[ReceivedSpan]:
    """The proxy's finished spans, in the shape the receiver gives vLLM's."""
    spans = []
    for span in exporter.get_finished_spans():
        context, parent = span.get_span_context(), span.parent
        spans.append(ReceivedSpan(
            name=span.name, kind=span.kind.name, trace_id=f"{context.trace_id:032x}",
            span_id=f"{context.span_id:016x}",
            parent_span_id=f"{parent.span_id:016x}" if parent else "",
            start_ns=span.start_time or 0, end_ns=span.end_time or 0,
            status=span.status.status_code.name, attributes=dict(span.attributes or {})))
    return spans


def children(spans: list[ReceivedSpan], trace_id: str, span_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if (s.trace_id, s.parent_span_id) == (trace_id, span_id)]


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], request_id: str,
               parent: str | None = None) -> None:
    headers = {"x-request-id": request_id}
    if parent:
        headers["traceparent"] = parent
    response = await client.post(url + CHAT, json=salted(body), headers=headers)
    assert generated_text(response, bool(body.get("stream")))


async def test_vllms_request_spans_nest_under_the_proxys_leg_spans(
    cluster: Cluster, client: httpx.AsyncClient, vllm_spans: OtlpReceiver, observe: Any
) -> None:
    settings = Settings(encode_urls=(Instance(cluster.url("encode")),),
                        prefill_urls=(Instance(cluster.url("prefill")),),
                        decode_urls=(Instance(cluster.url("decode")),))
    tag = secrets.token_hex(3)
    image = chat(image_part(seed=7007), text="Describe it.", stream=True)
    text = chat(text="Say something.")
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    forwarded_trace, forwarded_span = secrets.token_hex(16), secrets.token_hex(8)
    # Traced at the proxy: an E -> P -> D stream without a client span, and P -> D text under
    # one. Then the proxy's tracing off: the client's span reaches every leg as it came.
    exporter = InMemorySpanExporter()
    tracing = create_tracing({}, exporter=exporter)
    async with serve_proxy(settings, tracing=tracing) as (url, _):
        await send(client, url, image, f"traces-{tag}-epd")
        await send(client, url, text, f"traces-{tag}-pd",
                   traceparent(client_trace, client_span))
    async with serve_proxy(settings) as (url, _):
        await send(client, url, chat(image_part(seed=7008), text="Describe it."),
                   f"traces-{tag}-off", traceparent(forwarded_trace, forwarded_span))
    ours = proxy_spans(exporter)
    servers = {s.attributes["gen_ai.request.id"]: s for s in ours if s.kind == "SERVER"}
    assert sorted(servers) == [f"traces-{tag}-epd", f"traces-{tag}-pd"]
    legs = {request_id: sorted(children(ours, server.trace_id, server.span_id),
                               key=lambda s: s.start_ns)
            for request_id, server in servers.items()}
    assert [s.name for s in legs[f"traces-{tag}-epd"]] == ["encode", "prefill", "decode"]
    assert [s.name for s in legs[f"traces-{tag}-pd"]] == ["prefill", "decode"]
    pd_server = servers[f"traces-{tag}-pd"]
    assert (pd_server.trace_id, pd_server.parent_span_id) == (client_trace, client_span)
    # Every vLLM span of these three requests' traces: one per leg, each under its own leg.
    traces = {s.trace_id for s in servers.values()} | {forwarded_trace}
    want = sum(len(v) for v in legs.values()) + 3

    def arrived(spans: list[ReceivedSpan]) -> bool:
        return sum(s.name == VLLM_SPAN and s.trace_id in traces for s in spans) >= want

    await trio.to_thread.run_sync(vllm_spans.wait_for, arrived, SPANS_DEADLINE)
    theirs = [s for s in vllm_spans.spans if s.name == VLLM_SPAN and s.trace_id in traces]
    for request_id, leg_spans in legs.items():
        for leg in leg_spans:
            under = children(theirs, leg.trace_id, leg.span_id)
            assert len(under) == 1, (request_id, leg.name, len(under))
    under_client = children(theirs, forwarded_trace, forwarded_span)
    assert len(under_client) == 3, [s.parent_span_id for s in theirs
                                    if s.trace_id == forwarded_trace]
    assert len(theirs) == want  # and no llm_request span of these traces elsewhere
    observe(f"{len(theirs)} llm_request spans, each under its leg's span: E->P->D stream "
            f"(encode, prefill, decode), P->D under a client span, and with the proxy's "
            f"tracing off, E->P->D under the client's span")
