"""Property: whatever a client sends, the proxy answers with JSON, and never with a 5xx."""

from __future__ import annotations

import httpx
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd_trio import BadRequest, parse_request
from epd_trio.testing import run_cluster

json_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
                | st.floats(allow_nan=False) | st.text())
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12,
)
parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "audio_url", "input_audio", "video_url",
                              "pdf", ""]) | json_values},
    optional={"text": json_values, "image_url": json_values | st.fixed_dictionaries(
        {"url": json_values}), "uuid": json_values, "input_audio": json_values},
)
messages = st.lists(
    st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system"]) | json_values,
                                        "content": st.text() | st.lists(parts, max_size=3)
                                        | json_values}),
    max_size=3,
) | json_values
bodies = st.fixed_dictionaries(
    {},
    optional={"model": st.just("fake-model") | json_values, "messages": messages,
              "prompt": json_values, "stream": st.booleans() | json_values,
              "max_tokens": st.integers(1, 4) | json_values},
) | json_values
raw_bodies = bodies.map(orjson.dumps) | st.binary(max_size=64)


@given(raw=raw_bodies, kind=st.sampled_from(["chat", "completions"]))
# No deadline: on a shared, loaded machine one example can exceed the default 200 ms; speed is
# not what this test checks.
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_parse_request_only_ever_raises_bad_request(raw: bytes, kind: str) -> None:
    try:
        parse_request(raw, kind)  # type: ignore[arg-type]
    except BadRequest as exc:
        assert orjson.loads(exc.body())["error"]["code"] == 400


@given(raw=raw_bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
async def test_proxy_answers_malformed_bodies_with_4xx_json(raw: bytes, path: str) -> None:
    async with (run_cluster(encoders=1, prefills=1, decodes=1) as c,
                httpx.AsyncClient(trust_env=False, timeout=30) as client):
        r = await client.post(c.proxy_url + path, content=raw,
                              headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["code"] == r.status_code
