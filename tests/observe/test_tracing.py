"""OpenTelemetry traces: the settings, the trace context, and the span tree through every leg.

Three ways (docs/how-to/observability.md): the pure rules (``_core/tracing``) with plain
asserts; the proxy in front of fakes that record the ``traceparent`` each leg received, with
the SDK's in-memory exporter (the tree, the attributes, the parents, a failover, a
cancellation, a client gone mid-stream); and ``epd-trio serve --workers 2`` exporting over the
real OTLP/HTTP exporter to a receiver built on ``opentelemetry-proto``
(``epd_trio.testing.otlp_receiver``), every span there after SIGTERM.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from opentelemetry.propagate import extract
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from epd_trio._core.config import ConfigError
from epd_trio._core.trace import Attempt, AttemptNumbers, RequestTrace
from epd_trio._core.tracing import (
    DEFAULT_RATIO,
    TracingSettings,
    client_context,
    format_traceparent,
    leg_outcome,
    parse_traceparent,
    tracing_settings,
    usage_of,
)
from epd_trio._observe.tracing import OtelTracing, Tracing, create_tracing
from epd_trio.testing import Behaviour
from epd_trio.testing.cluster import run_cluster, run_moriio_cluster
from epd_trio.testing.otlp_receiver import OtlpReceiver
from epd_trio.testing.process import read_url

from helpers import CHAT, chat_body, image

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "tracestate": "vendor=abc,other=1"}
ADMIN = {"x-api-key": "admin-secret"}
ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}


# -- the settings ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("env", "expected"), [
    ({}, (False, "", "")),
    ({"OTEL_SERVICE_NAME": "x"}, (False, "", "")),  # no endpoint: off
    (ENDPOINT, (True, "parentbased_traceidratio", "http://127.0.0.1:4318/v1/traces")),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:9/t", **ENDPOINT},
     (True, "parentbased_traceidratio", "http://c:9/t")),  # the traces one wins
    ({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}, (False, "", "")),  # disabled wins
    ({**ENDPOINT, "OTEL_SDK_DISABLED": "TRUE"}, (False, "", "")),
    ({**ENDPOINT, "OTEL_SDK_DISABLED": "false"}, (True, "parentbased_traceidratio", "")),
    ({**ENDPOINT, "OTEL_TRACES_SAMPLER": "always_on"}, (True, "always_on", "")),
])
def test_tracing_is_switched_by_the_standard_variables(
    env: dict[str, str], expected: tuple[bool, str, str]
) -> None:
    settings = tracing_settings(env)
    enabled, sampler, endpoint = expected
    assert settings.enabled is enabled
    if enabled:
        assert settings.sampler == sampler
        if endpoint:
            assert settings.endpoint == endpoint


def test_sampler_ratio_and_service_name() -> None:
    assert tracing_settings(ENDPOINT).ratio == DEFAULT_RATIO  # our default: parent-based 10 %
    assert tracing_settings({**ENDPOINT, "OTEL_TRACES_SAMPLER_ARG": "0.25"}).ratio == 0.25
    # The specification's default ratio for a sampler named without an argument is 1.0.
    assert tracing_settings({**ENDPOINT, "OTEL_TRACES_SAMPLER": "traceidratio"}).ratio == 1.0
    assert tracing_settings(ENDPOINT).service_name == "epd-trio"
    assert tracing_settings({**ENDPOINT, "OTEL_SERVICE_NAME": "edge"}).service_name == "edge"


@pytest.mark.parametrize(("env", "variable"), [
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
    ({"OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_TRACES_SAMPLER_ARG": "1.5"}, "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
    ({"OTEL_SDK_DISABLED": "yes"}, "OTEL_SDK_DISABLED"),
])
def test_a_bad_variable_is_a_start_up_error(env: dict[str, str], variable: str) -> None:
    with pytest.raises(ConfigError) as caught:
        tracing_settings({**ENDPOINT, **env})
    assert caught.value.variable == variable


@pytest.mark.parametrize("value", ["http://collector:abc/v1/traces", "http://collector:0",
                                   "collector:4318", "http://u:hunter2@collector:99999",
                                   "http://coll ector:4318", "http://collector:4318#x"])
def test_a_malformed_otlp_endpoint_is_a_start_up_error_without_its_password(value: str) -> None:
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        with pytest.raises(ConfigError) as caught:
            tracing_settings({variable: value})
        assert caught.value.variable == variable and "hunter2" not in str(caught.value)


def test_the_otlp_endpoint_is_logged_without_its_user_and_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "epd_trio")
    tracing = create_tracing(
        {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://u:hunter2@127.0.0.1:9/v1/traces"})
    try:
        assert "OTLP/HTTP to http://***@127.0.0.1:9/v1/traces" in caplog.text
        assert "hunter2" not in caplog.text
    finally:
        tracing.provider.shutdown()  # type: ignore[attr-defined]


def test_tracing_without_the_sdk_is_a_clear_start_up_error() -> None:
    """Both entry points, in a process where the SDK cannot be imported."""
    hide = "import sys; sys.modules['opentelemetry.sdk'] = None; "
    env = {**os.environ, **ENDPOINT, "EPD_DECODE_URLS": "http://127.0.0.1:9"}
    for code in (hide + "from epd_trio._observe.tracing import create_tracing; import os; "
                 "create_tracing(os.environ)",
                 hide + "import epd_trio.app"):
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode != 0
        assert "configuration error" in done.stderr or "TracingUnavailable" in done.stderr
        assert "pip install 'epd-trio[otel]'" in done.stderr, done.stderr
    serve = subprocess.run(
        [sys.executable, "-c", hide + "from epd_trio.__main__ import main; raise SystemExit("
         "main(['serve', '--port', '0', '--decode', 'http://127.0.0.1:9']))"],
        env=env, capture_output=True, text=True, timeout=60)
    assert serve.returncode == 2
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in serve.stderr
    assert "pip install 'epd-trio[otel]'" in serve.stderr


def test_off_by_default() -> None:
    assert type(create_tracing({})) is Tracing
    assert isinstance(create_tracing(ENDPOINT), OtelTracing)


#: Run in a fresh interpreter: the app module built from the environment, then a proxy in
#: front of a fake decode serving a request that carries a client ``traceparent``; prints the
#: OpenTelemetry modules loaded by then.
NO_OTEL_SCRIPT = """
import sys

import httpx
import trio

import epd_trio.__main__
import epd_trio.app
from epd_trio.testing import run_cluster

async def one_request():
    async with run_cluster(prefills=1, decodes=1) as c, httpx.AsyncClient(trust_env=False) as client:
        r = await client.post(c.proxy_url + "/v1/chat/completions", headers={"traceparent": sys.argv[1]},
                              json={"model": "fake-model", "max_tokens": 2, "stream": True,
                                    "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\\n\\n"), r.text
        assert c.decodes[0].requests()[0].headers["traceparent"] == sys.argv[1]

trio.run(one_request)
print(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"))
"""


@pytest.mark.parametrize("switch", [{}, {**ENDPOINT, "OTEL_SDK_DISABLED": "true"}])
def test_tracing_off_never_imports_opentelemetry(switch: dict[str, str]) -> None:
    """The SDK is an optional extra, and this venv has it: a top-level import of it anywhere
    on the serving path would go unnoticed by every other test, and cost each proxy start-up
    (and break one installed without the extra). Here nothing of it may be loaded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({**switch, "EPD_DECODE_URLS": "http://127.0.0.1:9"})
    done = subprocess.run([sys.executable, "-c", NO_OTEL_SCRIPT, CLIENT["traceparent"]],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


# -- the trace context ----------------------------------------------------------------------------
@pytest.mark.parametrize("value", [
    None, "", "garbage", f"00-{TRACE_ID}-{CLIENT_SPAN}",  # too short
    f"00-{'0' * 32}-{CLIENT_SPAN}-01", f"00-{TRACE_ID}-{'0' * 16}-01",  # zero ids
    f"ff-{TRACE_ID}-{CLIENT_SPAN}-01",  # version ff
    f"00-{TRACE_ID}-{CLIENT_SPAN}-01-extra",  # version 00 with more
    f"00-{TRACE_ID.upper()}-{CLIENT_SPAN}-01",  # upper case hex
])
def test_an_invalid_traceparent_is_not_forwarded(value: str | None) -> None:
    assert parse_traceparent(value) is None
    assert client_context(value, "a=b") == {}


def test_a_valid_traceparent_is_forwarded_with_its_tracestate() -> None:
    assert parse_traceparent(CLIENT["traceparent"]) == (int(TRACE_ID, 16), int(CLIENT_SPAN, 16), 1)
    assert client_context(CLIENT["traceparent"], CLIENT["tracestate"]) == CLIENT
    assert client_context(CLIENT["traceparent"], None) == {"traceparent": CLIENT["traceparent"]}
    # A later version is read as version 00 (the W3C rule), and re-formatted so.
    later = f"01-{TRACE_ID}-{CLIENT_SPAN}-01-more"
    assert client_context(later, "")["traceparent"] == CLIENT["traceparent"]
    assert "tracestate" not in client_context(CLIENT["traceparent"], "x" * 20000)


def test_our_traceparent_is_what_the_w3c_propagator_reads() -> None:
    header = format_traceparent(int(TRACE_ID, 16), int(CLIENT_SPAN, 16), 1)
    context = get_current_span(extract({"traceparent": header})).get_span_context()
    assert (context.trace_id, context.span_id, int(context.trace_flags)) == (
        int(TRACE_ID, 16), int(CLIENT_SPAN, 16), 1)
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, extract({"traceparent": header}))
    assert carrier["traceparent"] == header


@pytest.mark.parametrize(("data", "expected"), [
    (b'{"id": "x", "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}',
     (7, 3)),
    (b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}\n\n'
     b"data: [DONE]\n\n", (4, 2)),
    (b'ens": 1}}\n\ndata: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6}}'
     b"\n\n", (5, 6)),
    (b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n', None),
    (b'{"usage": null}', None),
    (b'data: {"usage": {"prompt_tokens": 1', None),  # cut: no usage, no error
])
def test_usage_from_a_json_answer_or_a_stream_tail(data: bytes,
                                                   expected: tuple[int, int] | None) -> None:
    assert usage_of(data) == expected


def test_a_leg_outcome_names_a_client_gone() -> None:
    trace = RequestTrace("r", CHAT, 0.0)
    cancelled, failed = Attempt("decode", "u", None, 0.0), Attempt("prefill", "u", None, 0.0)
    cancelled.outcome, failed.outcome = "cancelled", "error"
    assert leg_outcome(cancelled, trace) == "cancelled"  # a sibling failed
    trace.cancelled_stage = "decode"
    assert leg_outcome(cancelled, trace) == "client_gone"
    assert leg_outcome(failed, trace) == "error"


# -- through the proxy ----------------------------------------------------------------------------
def tree(exporter: InMemorySpanExporter) -> tuple[Any, list[Any]]:
    """The one SERVER span and its CLIENT spans (in start order)."""
    spans = exporter.get_finished_spans()
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    legs = sorted((s for s in spans if s.kind is SpanKind.CLIENT), key=lambda s: s.start_time)
    assert len(spans) == 1 + len(legs)
    return server, legs


def header_ids(received: Any) -> tuple[str, str, str]:
    version, trace_id, span_id, flags = received.headers["traceparent"].split("-")
    assert version == "00"
    return trace_id, span_id, flags


def in_memory() -> tuple[OtelTracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing = create_tracing({}, exporter=exporter)
    assert isinstance(tracing, OtelTracing)
    return tracing, exporter


async def test_tracing_off_forwards_the_client_context_to_every_leg(
    client: httpx.AsyncClient,
) -> None:
    async with run_cluster(encoders=2, prefills=1, decodes=1) as c:
        r = await client.post(c.proxy_url + CHAT, json=chat_body(image(1), image(2)),
                              headers=CLIENT)
        assert r.status_code == 200
        legs = [leg for fake in c.fakes for leg in fake.requests()]
        assert len(legs) == 4  # two encoders, prefill, decode
        for leg in legs:
            assert leg.headers["traceparent"] == CLIENT["traceparent"]
            assert leg.headers["tracestate"] == CLIENT["tracestate"]
        # Without one (or with a malformed one), no leg gets a trace header.
        await client.post(c.proxy_url + CHAT, json=chat_body(),
                          headers={"traceparent": "nonsense", "tracestate": "a=b"})
        await client.post(c.proxy_url + CHAT, json=chat_body())
        for fake in (c.prefills[0], c.decodes[0]):
            for leg in fake.requests()[1:]:
                assert "traceparent" not in leg.headers and "tracestate" not in leg.headers


#: Seconds between two tokens of a fake decode whose stream's end must show in its span.
TOKEN_GAP = 0.05


def first_byte_ns(server: Any) -> int:
    """When the proxy had the reply's first bytes, on the spans' clock."""
    return server.start_time + int(server.attributes["gen_ai.latency.time_to_first_token"] * 1e9)


def assert_ends_with_its_stream(decode: Any, server: Any, gaps: int) -> None:
    """The decode span lasted until its stream was over, not only until its first bytes.

    The fake waited ``TOKEN_GAP`` before each of ``gaps`` frames after its first, so the last
    of them reached the proxy at least ``gaps * TOKEN_GAP`` after the request arrived. These
    lower bounds need no tolerance: a span's times are the proxy's ``perf_counter``, which
    ``trio.sleep`` waits on, and a loaded machine only makes them later. Ended at the first
    bytes, the span would end before the reply's first bytes. The upper bound is structural,
    not a duration (a busy CI machine can stall any step): the span is released with the
    request's resources, so it ends within the SERVER span."""
    assert decode.end_time >= server.start_time + int(gaps * TOKEN_GAP * 1e9)
    assert decode.end_time > first_byte_ns(server) + int(gaps * TOKEN_GAP * 1e9) // 2
    assert decode.end_time <= server.end_time


async def test_the_span_tree_of_an_epd_request(client: httpx.AsyncClient) -> None:
    tracing, exporter = in_memory()
    async with run_cluster(encoders=2, prefills=1, decodes=1, decode_dp=2, tracing=tracing) as c:
        # Tokens spaced out: the stream's end is well after its first byte.
        c.decodes[0].behaviour = Behaviour(chunk_delay=TOKEN_GAP)
        body = chat_body(image(1), image(2), stream=True,
                         stream_options={"include_usage": True})
        r = await client.post(c.proxy_url + CHAT, json=body,
                              headers={**CLIENT, "x-request-id": "req-1"})
        assert r.status_code == 200
        await trio.testing.wait_all_tasks_blocked()
        server, legs = tree(exporter)
        # The SERVER span continues the client's trace, under the client's span.
        assert server.name == "POST /v1/chat/completions"
        assert f"{server.context.trace_id:032x}" == TRACE_ID
        assert f"{server.parent.span_id:016x}" == CLIENT_SPAN and server.parent.is_remote
        assert str(server.context.trace_state) == str(server.parent.trace_state)
        a = server.attributes
        assert a["http.route"] == CHAT and a["http.response.status_code"] == 200
        assert a["gen_ai.request.model"] == "fake-model"
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.id"] == "req-1"
        assert 0 < a["gen_ai.latency.time_to_first_token"] < 10
        sent = usage_of(bytes(c.decodes[0].requests()[0].sent))  # what decode reported
        assert sent is not None and sent[1] == 5
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == sent
        assert "error.type" not in a and server.status.status_code is StatusCode.UNSET
        # A CLIENT span per leg, every one a child of the SERVER span, in the same trace.
        assert [leg.name for leg in legs] == ["encode", "encode", "prefill", "decode"]
        for leg in legs:
            assert leg.parent.span_id == server.context.span_id
            assert leg.context.trace_id == server.context.trace_id
            assert leg.attributes["epd_trio.outcome"] == "ok"
            assert leg.attributes["epd_trio.attempt"] == 1
            assert leg.attributes["http.request.resend_count"] == 0
            assert leg.attributes["http.response.status_code"] == 200
            assert server.start_time <= leg.start_time <= leg.end_time <= server.end_time
        encoders = [leg for leg in legs if leg.name == "encode"]
        assert {leg.attributes["epd_trio.upstream"] for leg in encoders} == {
            f.url for f in c.encoders}
        # Each fake saw a traceparent naming its own leg's span (vLLM's llm_request nests
        # under it), with the client's tracestate.
        seen = {header_ids(leg)[1]: fake for fake in c.fakes for leg in fake.requests()}
        assert len(seen) == 4
        for leg in legs:
            fake = seen[f"{leg.context.span_id:016x}"]
            assert leg.attributes["epd_trio.upstream"] == fake.url
            (received,) = [x for x in fake.requests()
                           if header_ids(x)[1] == f"{leg.context.span_id:016x}"]
            assert header_ids(received)[0] == TRACE_ID and header_ids(received)[2] == "01"
            assert received.headers["tracestate"] == CLIENT["tracestate"]
        decode = legs[-1]
        assert decode.attributes["epd_trio.dp_rank"] in (0, 1)
        assert decode.attributes["epd_trio.stage"] == "decode"
        assert decode.attributes["url.full"] == c.decodes[0].url + CHAT
        assert decode.attributes["server.address"] == "127.0.0.1"
        assert decode.attributes["server.port"] == int(c.decodes[0].url.rsplit(":", 1)[1])
        # The decode span lasts until the stream ended, not only until its first byte: the
        # role chunk, 5 words, the finish chunk, the usage and [DONE], spaced by TOKEN_GAP.
        assert_ends_with_its_stream(decode, server, gaps=8)
        # A new trace when the client sends none: legs still name their own spans.
        exporter.clear()
        await client.post(c.proxy_url + "/v1/completions",
                          json={"model": "fake-model", "prompt": "hi", "max_tokens": 3})
        await trio.testing.wait_all_tasks_blocked()
        server, legs = tree(exporter)
        assert server.parent is None and server.attributes["gen_ai.operation.name"] == \
            "text_completion"
        assert server.attributes["gen_ai.usage.output_tokens"] == 3  # a JSON answer's usage
        assert [leg.name for leg in legs] == ["prefill", "decode"]


async def test_a_failover_shows_as_two_attempts(client: httpx.AsyncClient) -> None:
    tracing, exporter = in_memory()
    async with run_cluster(prefills=2, decodes=1, tracing=tracing) as c:
        def clears(other: Any) -> Any:
            async def gate() -> None:
                other.behaviour = Behaviour()
            return gate

        # Whichever prefill comes first fails once, and clears the other's failure.
        one, two = c.prefills
        one.behaviour = Behaviour(fail_status=503, fail_count=1, gate=clears(two))
        two.behaviour = Behaviour(fail_status=503, fail_count=1, gate=clears(one))
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 200
        await trio.testing.wait_all_tasks_blocked()
        server, legs = tree(exporter)
        first, second, decode = legs
        assert (first.name, second.name, decode.name) == ("prefill", "prefill", "decode")
        assert first.attributes["epd_trio.outcome"] == "error"
        assert first.attributes["http.response.status_code"] == 503
        assert first.attributes["error.type"] == "503"
        assert first.status.status_code is StatusCode.ERROR
        assert second.attributes["epd_trio.attempt"] == 2
        assert second.attributes["http.request.resend_count"] == 1
        assert second.attributes["epd_trio.outcome"] == "ok"
        assert first.attributes["epd_trio.upstream"] != second.attributes["epd_trio.upstream"]
        assert server.attributes["epd_trio.retries"] == 1


def test_attempt_numbers_count_the_tries_of_each_stage() -> None:
    """A leg's number is how many times its stage was tried for the request (see
    ``AttemptNumbers``): the encoder sub-requests sent together are one try."""
    numbers = AttemptNumbers()
    assert [numbers.take("encode"), numbers.take("encode")] == [1, 1]  # two sub-requests
    numbers.failed_over("encode", 1)  # the second failed over
    assert numbers.take("encode") == 2
    numbers.encoded()
    assert [numbers.take("prefill"), numbers.take("prefill")] == [1, 2]  # a prefill failover
    numbers.failed_over("prefill", 2)  # changes nothing: one call per try
    assert numbers.take("decode") == 1
    # A decode retry re-runs the request: encode and prefill are tried once more each.
    assert [numbers.take("encode"), numbers.take("encode")] == [3, 3]
    numbers.encoded()
    assert [numbers.take("prefill"), numbers.take("decode")] == [3, 2]


def numbered(legs: list[Any]) -> dict[str, list[tuple[int, int, str]]]:
    """Per stage, each leg's (attempt, resend count, outcome), in start order."""
    by_stage: dict[str, list[tuple[int, int, str]]] = {}
    for leg in legs:
        a = leg.attributes
        by_stage.setdefault(leg.name, []).append(
            (a["epd_trio.attempt"], a["http.request.resend_count"], a["epd_trio.outcome"]))
    return by_stage


def fails_once_then_clears(fakes: list[Any]) -> None:
    """Whichever of ``fakes`` is called first answers 503 once, and clears the others."""
    def clears(others: list[Any]) -> Any:
        async def gate() -> None:
            for other in others:
                other.behaviour = Behaviour()
        return gate

    for fake in fakes:
        fake.behaviour = Behaviour(fail_status=503, fail_count=1,
                                   gate=clears([f for f in fakes if f is not fake]))


async def test_a_decode_retry_numbers_the_re_run_prefill_and_encoders_as_their_next_try(
    client: httpx.AsyncClient,
) -> None:
    tracing, exporter = in_memory()
    async with run_cluster(encoders=2, prefills=1, decodes=2, tracing=tracing) as c:
        fails_once_then_clears(c.decodes)
        r = await client.post(c.proxy_url + CHAT, json=chat_body(image(1), image(2)))
        assert r.status_code == 200
        await trio.testing.wait_all_tasks_blocked()
        server, legs = tree(exporter)
        assert numbered(legs) == {
            "encode": [(1, 0, "ok"), (1, 0, "ok"), (2, 1, "ok"), (2, 1, "ok")],
            "prefill": [(1, 0, "ok"), (2, 1, "ok")],
            "decode": [(1, 0, "error"), (2, 1, "ok")],
        }
        assert server.attributes["epd_trio.retries"] == 1


async def test_a_moriio_write_prefill_failover_numbers_the_re_run_decode_as_attempt_2(
    client: httpx.AsyncClient,
) -> None:
    tracing, exporter = in_memory()
    async with run_moriio_cluster(mode="WRITE", prefills=2, tracing=tracing) as c:
        fails_once_then_clears(c.prefills)
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 200, r.text
        await trio.testing.wait_all_tasks_blocked()
        server, legs = tree(exporter)
        # The two legs of an attempt run at once; the failed prefill cancelled its decode.
        assert numbered(legs) == {"prefill": [(1, 0, "error"), (2, 1, "ok")],
                                  "decode": [(1, 0, "cancelled"), (2, 1, "ok")]}
        assert server.attributes["epd_trio.retries"] == 1


async def test_a_failed_encoder_cancels_its_sibling_and_fails_the_request(
    client: httpx.AsyncClient,
) -> None:
    tracing, exporter = in_memory()
    async with run_cluster(encoders=2, decodes=1, max_attempts=1, tracing=tracing) as c:
        failing, hung = c.encoders
        failing.behaviour = Behaviour(fail_status=500)
        hung.behaviour = Behaviour(hang=True)

        async def hung_is_in() -> None:
            await hung.wait_until(lambda: hung.in_flight == 1)
            failing.behaviour = Behaviour(fail_status=500)

        failing.behaviour = Behaviour(fail_status=500, gate=hung_is_in)
        r = await client.post(c.proxy_url + CHAT, json=chat_body(image(1), image(2)))
        assert r.status_code == 502
        await hung.wait_until(lambda: hung.disconnects == 1)
        await trio.testing.wait_all_tasks_blocked()
        server, legs = tree(exporter)
        outcomes = {leg.attributes["epd_trio.upstream"]: leg.attributes["epd_trio.outcome"]
                    for leg in legs}
        assert outcomes == {failing.url: "error", hung.url: "cancelled"}
        assert server.attributes["error.type"] == "upstream_error"
        assert server.attributes["http.response.status_code"] == 502
        assert server.status.status_code is StatusCode.ERROR


async def test_a_client_gone_mid_stream_ends_the_decode_span_as_client_gone(
    client: httpx.AsyncClient,
) -> None:
    tracing, exporter = in_memory()
    async with run_cluster(prefills=1, decodes=1, tracing=tracing) as c:
        (decode,) = c.decodes
        # Tokens spaced out; the client leaves after the second, long before the last.
        decode.behaviour = Behaviour(chunk_delay=TOKEN_GAP, tokens=10**6)
        second_token = trio.Event()

        async def request(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
            with trio.CancelScope() as scope:
                task_status.started(scope)
                async with client.stream("POST", c.proxy_url + CHAT,
                                         json=chat_body(stream=True, max_tokens=10**6)) as r:
                    events = 0
                    async for chunk in r.aiter_raw():
                        events += chunk.count(b"data: ")
                        if events >= 2:
                            second_token.set()

        async with trio.open_nursery() as nursery:
            scope = await nursery.start(request)
            with trio.fail_after(10):
                await second_token.wait()
                scope.cancel()
                await decode.wait_until(lambda: decode.disconnects == 1)
        await trio.testing.wait_all_tasks_blocked()
        server, legs = tree(exporter)
        prefill, decode_span = legs
        assert prefill.attributes["epd_trio.outcome"] == "ok"
        assert decode_span.attributes["epd_trio.outcome"] == "client_gone"
        assert server.attributes["epd_trio.outcome"] == "cancelled"
        assert server.attributes["epd_trio.cancelled_stage"] == "decode"
        assert "gen_ai.latency.time_to_first_token" in server.attributes
        # The span lasts until the client left (after the second frame), not its first byte.
        assert_ends_with_its_stream(decode_span, server, gaps=1)


async def test_a_stream_broken_mid_way_ends_the_decode_span_when_it_broke(
    client: httpx.AsyncClient,
) -> None:
    tracing, exporter = in_memory()
    async with run_cluster(prefills=1, decodes=1, tracing=tracing) as c:
        c.decodes[0].behaviour = Behaviour(chunk_delay=TOKEN_GAP, break_after=4)
        r = await client.post(c.proxy_url + CHAT, json=chat_body(stream=True))
        assert r.status_code == 200 and b'"error"' in r.content
        await trio.testing.wait_all_tasks_blocked()
        server, (prefill, decode) = tree(exporter)
        assert prefill.attributes["epd_trio.outcome"] == "ok"
        assert decode.attributes["epd_trio.outcome"] == "stream_error"
        assert decode.status.status_code is StatusCode.ERROR
        assert server.attributes["epd_trio.outcome"] == "stream_error"
        # Frames 0 to 3 were sent, the last of them 3 gaps after the first; then it broke.
        assert_ends_with_its_stream(decode, server, gaps=3)


async def test_an_unsampled_request_records_nothing_and_forwards_its_context(
    client: httpx.AsyncClient,
) -> None:
    exporter = InMemorySpanExporter()
    tracing = OtelTracing(TracingSettings(enabled=True, sampler="parentbased_always_off"),
                          exporter)
    async with run_cluster(prefills=1, decodes=1, tracing=tracing) as c:
        unsampled = f"00-{TRACE_ID}-{CLIENT_SPAN}-00"
        await client.post(c.proxy_url + CHAT, json=chat_body(), headers={"traceparent": unsampled})
        # A sampled parent is followed even though roots are not sampled (parent-based).
        await client.post(c.proxy_url + CHAT, json=chat_body(), headers=CLIENT)
        await trio.testing.wait_all_tasks_blocked()
        spans = exporter.get_finished_spans()
        assert len(spans) == 3 and all(f"{s.context.trace_id:032x}" == TRACE_ID for s in spans)
        first, second = c.decodes[0].requests()
        trace_id, span_id, flags = header_ids(first)
        assert (trace_id, flags) == (TRACE_ID, "00") and span_id != CLIENT_SPAN
        assert header_ids(second)[2] == "01"


# -- end to end: the real exporter, two workers, SIGTERM ------------------------------------------
async def test_serve_with_two_workers_exports_every_span_by_sigterm() -> None:
    with OtlpReceiver() as receiver:
        async with run_cluster(prefills=1, decodes=1) as c:
            env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                   "OTEL_TRACES_SAMPLER": "always_on", "OTEL_SERVICE_NAME": "epd-e2e",
                   # The batch queue waits 5 s by default: here only the shutdown sends it.
                   "OTEL_BSP_SCHEDULE_DELAY": "600000", "EPD_ADMIN_KEY": ADMIN["x-api-key"]}
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "epd_trio", "serve", "--port", "0", "--workers", "2",
                 "--prefill", c.prefills[0].url, "--decode", c.decodes[0].url],
                env=env, stderr=subprocess.PIPE)
            try:
                assert process.stderr is not None
                url = await read_url(process.stderr, rb"listening on (http://\S+)")
                pids: set[int] = set()  # the workers that served a traced request

                async def one(i: int) -> None:
                    # A fresh connection per request, so both workers accept some of them. The
                    # same connection then asks which worker it is on (the kernel picks the
                    # worker per connection, so a fixed count could all land on one).
                    limits = httpx.Limits(max_connections=1)
                    async with httpx.AsyncClient(trust_env=False, timeout=30,
                                                 limits=limits) as client:
                        r = await client.post(
                            url + CHAT, json=chat_body(stream=bool(i % 2)),
                            headers={"traceparent": f"00-{i + 1:032x}-{CLIENT_SPAN}-01"})
                        assert r.status_code == 200
                        pids.add((await client.get(url + "/instances",
                                                   headers=ADMIN)).json()["worker_pid"])

                requests = 0
                with trio.fail_after(60):  # at least 24 requests, and both workers served some
                    while requests < 24 or len(pids) < 2:
                        async with trio.open_nursery() as nursery:
                            for i in range(requests, requests + 8):
                                nursery.start_soon(one, i)
                        requests += 8
                assert receiver.spans == []  # nothing exported yet: the flush is the shutdown's
                process.send_signal(signal.SIGTERM)
                with trio.fail_after(30):
                    assert await process.wait() == 0
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
    servers = [s for s in receiver.spans if s.kind == "SERVER"]
    assert sorted(int(s.trace_id, 16) for s in servers) == list(range(1, requests + 1))
    assert len(receiver.spans) == 3 * requests and receiver.rejected == 0
    assert {s.resource["service.name"] for s in receiver.spans} == {"epd-e2e"}
    # A provider per worker; and each worker's spans were all there by SIGTERM.
    assert {s.resource["process.pid"] for s in receiver.spans} == pids
    by_id = {s.span_id: s for s in receiver.spans}
    for span in receiver.spans:
        if span.kind == "CLIENT":
            assert by_id[span.parent_span_id].kind == "SERVER"
            assert span.trace_id == by_id[span.parent_span_id].trace_id
        else:
            assert span.parent_span_id == CLIENT_SPAN
    # Each leg's traceparent named its own span, as exported.
    for fake in (c.prefills[0], c.decodes[0]):
        for received in fake.requests():
            trace_id, span_id, _ = header_ids(received)
            assert by_id[span_id].trace_id == trace_id and by_id[span_id].kind == "CLIENT"
            assert by_id[span_id].name == fake.role


def test_the_settings_page_lists_every_variable_tracing_reads() -> None:
    from pathlib import Path

    import epd_trio._core.tracing as module
    read = set(re.findall(r'"(OTEL_[A-Z_]+)"', Path(module.__file__).read_text()))
    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "settings.md")
    section = page.read_text().split("## OpenTelemetry tracing", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(OTEL_[A-Z_]+)`", section))
    assert len(read) == 8 and read <= listed, read - listed


async def test_the_shutdown_flush_is_bounded_when_the_collector_hangs(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    import threading

    from epd_trio._core.tracing import SHUTDOWN_FLUSH_TIMEOUT

    release = threading.Event()

    class Hanging(InMemorySpanExporter):
        def shutdown(self) -> None:  # a collector that never answers the last export
            release.wait(60)

    tracing = OtelTracing(TracingSettings(enabled=True, sampler="always_on"), Hanging())
    started = trio.current_time()
    await tracing.aclose()
    assert trio.current_time() - started == pytest.approx(SHUTDOWN_FLUSH_TIMEOUT)
    assert "not exported within" in caplog.text
    release.set()
