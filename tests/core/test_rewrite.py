"""Validation and per-leg bodies (pure): uuids, encoder/prefill/decode bodies, no mutation."""

import copy
import hashlib

import orjson
import pytest

from epd_trio import BadRequest, build_encoder_body, build_prefill_body, item_uuid, parse_request
from epd_trio._core.rewrite import (
    PREFILL_KV_TRANSFER_PARAMS,
    build_decode_body,
    kv_transfer_params_of,
    upstream_headers,
    with_item_uuids,
)

IMAGE = "data:image/png;base64," + "A" * 1000


def chat(*content: dict, **extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": list(content)}], **extra}


def test_uuid_is_client_value_or_sha256_of_url_or_canonical_audio_json() -> None:
    assert item_uuid({"type": "image_url", "image_url": {"url": IMAGE}, "uuid": "mine"}) == "mine"
    assert item_uuid({"type": "image_url", "image_url": {"url": IMAGE}}) == hashlib.sha256(
        IMAGE.encode()).hexdigest()
    a = {"type": "input_audio", "input_audio": {"data": "xx", "format": "wav"}}
    b = {"type": "input_audio", "input_audio": {"format": "wav", "data": "xx"}}
    assert item_uuid(a) == item_uuid(b) == hashlib.sha256(
        b'{"data":"xx","format":"wav"}').hexdigest()


def test_items_are_found_in_order_and_tagged_without_mutating_the_client_body() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": IMAGE}},
                {"type": "audio_url", "audio_url": {"url": "http://x/a.wav"}, "uuid": "aud"},
            ]},
            {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "http://v"}}]},
        ],
        "mm_processor_kwargs": {"fps": 2},
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 3,
        "max_completion_tokens": 50,
    }
    before = copy.deepcopy(body)
    request = parse_request(orjson.dumps(body), "chat")
    assert request.media == ((1, 1), (1, 2), (2, 0))
    assert request.stream is True
    tagged, items = with_item_uuids(request)
    assert [i["uuid"] for i in items] == [item_uuid(body["messages"][1]["content"][1]), "aud",
                                           item_uuid(body["messages"][2]["content"][0])]
    # The large URL string is shared, not copied.
    assert tagged["messages"][1]["content"][1]["image_url"]["url"] is request.body[
        "messages"][1]["content"][1]["image_url"]["url"]

    encoder = build_encoder_body(tagged, items[:2])
    assert encoder == {"model": "m", "messages": [{"role": "user", "content": items[:2]}],
                       "max_tokens": 1, "stream": False, "mm_processor_kwargs": {"fps": 2}}

    prefill = build_prefill_body(tagged)
    assert prefill["stream"] is False and prefill["max_tokens"] == 1
    assert prefill["max_completion_tokens"] == 1
    assert "stream_options" not in prefill and "min_tokens" not in prefill
    assert prefill["kv_transfer_params"] == dict(PREFILL_KV_TRANSFER_PARAMS)
    assert prefill["messages"][1]["content"][2]["uuid"] == "aud"

    handle = {"do_remote_prefill": True, "remote_block_ids": [1]}
    decode = build_decode_body(tagged, handle)
    assert decode["kv_transfer_params"] is handle and decode["stream"] is True
    assert decode["stream_options"] == {"include_usage": True}
    assert "kv_transfer_params" not in build_decode_body(tagged, None)
    stale = {**tagged, "kv_transfer_params": {"remote_engine_id": "old"}}
    assert "kv_transfer_params" not in build_decode_body(stale, None)

    assert request.body == before  # nothing above touched the client's body


def test_text_only_body_is_passed_as_is() -> None:
    request = parse_request(b'{"model":"m","messages":[{"role":"user","content":"hi"}]}', "chat")
    body, items = with_item_uuids(request)
    assert body is request.body and items == []


@pytest.mark.parametrize(
    "raw, kind, fragment",
    [
        (b"{nope", "chat", "not valid JSON"),
        (b"[1, 2]", "chat", "JSON object"),
        (b'{"model": "", "messages": []}', "chat", "'model'"),
        (b'{"model": 3, "messages": []}', "chat", "'model'"),
        (b'{"model": "m"}', "chat", "'messages'"),
        (b'{"model": "m", "messages": []}', "chat", "'messages'"),
        (b'{"model": "m", "messages": ["x"]}', "chat", "messages[0] must be an object"),
        (b'{"model": "m", "messages": [{"content": "x"}]}', "chat", "role"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "chat", "content"),
        (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "pdf"}]}]}', "chat",
         "not supported"),
        (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
         "chat", "image_url must be an object"),
        (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", '
         b'"image_url": {"url": "u"}, "uuid": 7}]}]}', "chat", "uuid"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
         "chat", "'stream'"),
        (b'{"model": "m"}', "completions", "'prompt'"),
        (b'{"model": "m", "prompt": [true]}', "completions", "'prompt'"),
        (b'{"model": "m", "prompt": {}}', "completions", "'prompt'"),
    ],
)
def test_bad_input_is_a_bad_request(raw: bytes, kind: str, fragment: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_request(raw, kind)  # type: ignore[arg-type]
    assert fragment in info.value.message
    error = orjson.loads(info.value.body())["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400


@pytest.mark.parametrize(("raw", "kind", "param"), [
    (b'{"model": null, "messages": []}', "chat", "messages"),  # no model: the registry's call
    (b'{"model": 3, "messages": []}', "chat", "model"),
    (b'{"model": "m"}', "chat", "messages"),
    (b'{"model": "m", "messages": ["x"]}', "chat", "messages[0]"),
    (b'{"model": "m", "messages": [{"content": "x"}]}', "chat", "messages[0].role"),
    (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "chat",
     "messages[0].content"),
    (b'{"model": "m", "messages": [{"role": "user", "content": ["x"]}]}', "chat",
     "messages[0].content[0]"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "pdf"}]}]}', "chat",
     "messages[0].content[0].type"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
     "chat", "messages[0].content[0].image_url"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}',
     "chat", "messages[0].content[0].input_audio"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", '
     b'"image_url": {"url": "u"}, "uuid": 7}]}]}', "chat", "messages[0].content[0].uuid"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
     "chat", "stream"),
    (b'{"model": "m"}', "completions", "prompt"),
    (b"{nope", "chat", None),  # the body as a whole: no field to name
    (b"[1]", "chat", None),
])
def test_bad_input_names_its_param(raw: bytes, kind: str, param: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        parse_request(raw, kind)  # type: ignore[arg-type]
    assert orjson.loads(info.value.body())["error"]["param"] == param


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"model": "\xff"}', "byte 0xff at offset 11"),
    (b"\xff", "byte 0xff at offset 0"),
    (b'{"model": "\xc3"}', "byte 0xc3 at offset 11"),
])
def test_a_body_that_is_not_utf8_says_so(raw: bytes, message: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_request(raw, "chat")
    assert info.value.message == f"request body is not valid UTF-8: {message}"
    assert "surrogates" not in info.value.message


@pytest.mark.parametrize("prompt", ["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompts_accepted(prompt: object) -> None:
    request = parse_request(orjson.dumps({"model": "m", "prompt": prompt}), "completions")
    assert request.media == () and request.stream is False


def test_kv_transfer_params_extraction() -> None:
    assert kv_transfer_params_of(b'{"kv_transfer_params": {"a": 1}}') == {"a": 1}
    assert kv_transfer_params_of(b'{"kv_transfer_params": null}') is None
    assert kv_transfer_params_of(b'{}') is None
    assert kv_transfer_params_of(b"not json") is None


def test_upstream_headers() -> None:
    assert upstream_headers("r1", None) == {"content-type": "application/json",
                                            "x-request-id": "r1"}
    assert upstream_headers("r1", 3, "Bearer k")["x-data-parallel-rank"] == "3"
    assert upstream_headers("r1", 0)["x-data-parallel-rank"] == "0"


def test_the_clients_hand_off_fields_are_dropped_at_parse_time() -> None:
    raw = orjson.dumps({"model": "m", "prompt": "x", "kv_transfer_params": {"remote_host": "h"},
                        "ec_transfer_params": {"a": {}}, "temperature": 0})
    request = parse_request(raw, "completions")
    assert request.dropped == ("kv_transfer_params", "ec_transfer_params")
    assert request.body == {"model": "m", "prompt": "x", "temperature": 0}
    assert parse_request(b'{"model": "m", "prompt": "x"}', "completions").dropped == ()


def test_an_empty_kv_handle_is_no_handle() -> None:
    assert kv_transfer_params_of(b'{"kv_transfer_params": {}}') is None


def test_encoder_legs_carry_the_media_processing_fields_and_the_session() -> None:
    """As upstream's EPD proxy: mm_processor_kwargs, media_io_kwargs, priority, session_id."""
    part = {"type": "image_url", "image_url": {"url": "data:x"}, "uuid": "u"}
    body = {"model": "m", "messages": [], "mm_processor_kwargs": {"a": 1},
            "media_io_kwargs": {"b": 2}, "priority": 3, "session_id": "s-1", "temperature": 0}
    encoder = build_encoder_body(body, [part])
    assert {k: encoder[k] for k in ("mm_processor_kwargs", "media_io_kwargs", "priority",
                                    "session_id")} == {"mm_processor_kwargs": {"a": 1},
                                                       "media_io_kwargs": {"b": 2},
                                                       "priority": 3, "session_id": "s-1"}
    assert "temperature" not in encoder
