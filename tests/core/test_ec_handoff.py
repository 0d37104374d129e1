"""The EC hand-off: encoder reports matched to items, the consumer leg's rewrite, push consumers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import orjson
import pytest
import trio

from epd_trio._core.ec_handoff import (
    EncodedItem,
    EncoderReport,
    Handoff,
    consumer_body,
    match_reports,
)
from epd_trio._core.errors import EncoderHandoffError
from epd_trio._core.rewrite import parse_request, with_item_uuids
from epd_trio.testing import Behaviour, FakeVLLM, run_cluster

from helpers import CHAT, chat_body, image, start_fakes, url_uuid

GRID = {"image_grid_thw": [[1, 2, 3]]}


def entry(*indices: int, **extra: Any) -> dict[str, Any]:
    return {"item_indices": list(indices), "metadata": GRID, **extra}


# -- matching (pure) -------------------------------------------------------------------------------
def test_entries_match_items_by_index_and_keep_the_whole_entry_as_the_handle() -> None:
    reports = [EncoderReport("http://e0", (0, 2), {"h-a": entry(1), "h-b": entry(0, peer_port=5)}),
               EncoderReport("http://e1", (1,), {"h-c": entry(0)})]
    handoff = match_reports(reports, ["u0", "u1", "u2"])
    assert {i: it.engine_hash for i, it in handoff.items.items()} == {0: "h-b", 1: "h-c", 2: "h-a"}
    assert handoff.handles["h-b"] == entry(0, peer_port=5)


def test_one_entry_with_two_indices_covers_two_identical_images() -> None:
    handoff = match_reports([EncoderReport("http://e0", (0, 1), {"same": entry(0, 1)})],
                            ["u", "u"])
    assert [handoff.items[i].engine_hash for i in (0, 1)] == ["same", "same"]


def test_without_indices_an_item_matches_by_uuid_or_as_the_single_entry() -> None:
    by_uuid = match_reports([EncoderReport("e", (0, 1), {"u1": {"metadata": GRID},
                                                         "u0": {"metadata": {}}})], ["u0", "u1"])
    assert by_uuid.items[1].engine_hash == "u1" and by_uuid.items[0].metadata == {}
    single = match_reports([EncoderReport("e", (0,), {"engine-hash": {"metadata": GRID,
                                                                      "item_indices": [7]}})],
                           ["u0"])
    assert single.items[0].engine_hash == "engine-hash"  # one item: its indices are ignored


@pytest.mark.parametrize("params", [None, {}])
def test_nothing_reported_matches_nothing(params: Any) -> None:
    assert match_reports([EncoderReport("e", (0, 1), params)], ["a", "b"]) == Handoff()


@pytest.mark.parametrize(("params", "problem"), [
    ({"h": entry(2)}, "invalid item index 2"),
    ({"h": entry(-1)}, "invalid item index -1"),
    ({"h": {"item_indices": [True], "metadata": GRID}}, "invalid item index True"),
    ({"h": {"item_indices": [0.0], "metadata": GRID}}, "invalid item index 0.0"),
    ({"h": {"item_indices": "0", "metadata": GRID}}, "not a list"),
    ({"h": entry(0), "g": entry(0)}, "duplicate item index 0"),
    ({"h": entry(0)}, "cannot be matched to item 1"),
    ({"h": "not a map"}, "not a map"),
    (["not", "a", "map"], "not a map"),
])
def test_bad_reports_are_a_502_naming_the_encode_stage_and_encoder(params: Any, problem: str) -> None:
    with pytest.raises(EncoderHandoffError, match=problem) as caught:
        match_reports([EncoderReport("http://e0:1", (3, 4), params)], ["a", "b", "c", "d", "e"])
    error = caught.value
    assert (error.status, error.stage, error.instance) == (502, "encode", "http://e0:1")
    assert "items [3, 4]" in error.message


# -- the consumer body (pure) --------------------------------------------------------------------
def parsed(*parts: dict[str, Any]) -> tuple[dict[str, Any], tuple[tuple[int, int], ...]]:
    request = parse_request(orjson.dumps(chat_body(*parts)), "chat")
    body, _ = with_item_uuids(request)
    return body, request.media


def test_the_rewrite_replaces_reported_parts_and_keeps_the_rest() -> None:
    body, media = parsed(image(0), image(1))
    handoff = Handoff({0: EncodedItem("h0", GRID, "t0")}, {"h0": entry(0)})
    new = consumer_body(body, media, handoff, rewrite=True)
    first, second, text = new["messages"][0]["content"]
    assert first == {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 3]},
                     "uuid": url_uuid(image(0))}
    assert second["type"] == "image_url" and second["uuid"] == url_uuid(image(1))  # raw: kept
    assert text == {"type": "text", "text": "describe"}
    assert new["ec_transfer_params"] == {"h0": entry(0),
                                         "ec_items": [{"mm_hash": "h0", "transfer_id": "t0"}]}
    assert body["messages"][0]["content"][0]["type"] == "image_url"  # the input is unchanged
    off = consumer_body(body, media, handoff, rewrite=False)
    assert off["messages"] == body["messages"] and off["ec_transfer_params"] == new["ec_transfer_params"]


def test_audio_with_an_unreported_item_rewrites_nothing() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    body, media = parsed(image(0), audio)
    partial = Handoff({0: EncodedItem("h0", GRID)}, {"h0": entry(0)})
    assert consumer_body(body, media, partial, rewrite=True)["messages"] == body["messages"]
    both = Handoff({0: EncodedItem("h0", GRID), 1: EncodedItem("h1", {"audio_num_tokens": [9]})})
    parts = consumer_body(body, media, both, rewrite=True)["messages"][0]["content"]
    assert parts[1]["type"] == "audio_embeds" and parts[1]["audio_embeds"] == {"audio_num_tokens": [9]}


def test_nothing_reported_leaves_the_body_without_ec_params() -> None:
    body, media = parsed(image(0))
    assert consumer_body(body, media, Handoff(), rewrite=True) == body


# -- through the proxy ---------------------------------------------------------------------------
def parts_of(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [p for m in body["messages"] for p in m["content"] if p["type"] != "text"]


async def test_e_p_d_prefill_consumes_the_rewrite_and_decode_gets_the_media(
    client: httpx.AsyncClient,
) -> None:
    async with run_cluster(encoders=1, prefills=1, decodes=1) as c:
        r = await client.post(c.proxy_url + CHAT, json=chat_body(image(0), image(1)))
        assert r.status_code == 200, r.text
        (prefill,), (decode,) = c.prefills[0].requests(), c.decodes[0].requests()
        uuids = [url_uuid(image(0)), url_uuid(image(1))]
        assert parts_of(prefill.body) == [
            {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": u}
            for u in uuids]
        assert set(prefill.body["ec_transfer_params"]) == set(uuids)
        assert "base64" not in orjson.dumps(prefill.body).decode()  # no pixels
        # Decode after a prefill is no encoder-cache consumer: the items, with their uuid.
        assert [p["type"] for p in parts_of(decode.body)] == ["image_url", "image_url"]
        assert [p["uuid"] for p in parts_of(decode.body)] == uuids
        assert "ec_transfer_params" not in decode.body


async def test_e_pd_rewrite_reaches_the_combined_instance_and_can_be_turned_off(
    client: httpx.AsyncClient,
) -> None:
    for rewrite in (True, False):
        async with run_cluster(encoders=1, decodes=1, ec_rewrite=rewrite) as c:
            r = await client.post(c.proxy_url + CHAT, json=chat_body(image(0), stream=True))
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            (leg,) = c.decodes[0].requests()
            (part,) = parts_of(leg.body)
            assert part["type"] == ("image_embeds" if rewrite else "image_url")
            assert list(leg.body["ec_transfer_params"]) == [url_uuid(image(0))]


async def test_items_the_encoder_reported_nothing_for_keep_their_media(
    client: httpx.AsyncClient,
) -> None:
    async with run_cluster(encoders=1, decodes=1) as c:
        # Like ECCPUConnector for an entry it did not cache: ``metadata: {}``.
        c.encoders[0].behaviour = Behaviour(ec_report=lambda parts: {
            p["uuid"]: {"item_indices": [i], "metadata": {} if i else {"image_grid_thw": [1, 2, 2]}}
            for i, p in enumerate(parts)})
        r = await client.post(c.proxy_url + CHAT, json=chat_body(image(0), image(1)))
        assert r.status_code == 200, r.text
        (leg,) = c.decodes[0].requests()
        assert [p["type"] for p in parts_of(leg.body)] == ["image_embeds", "image_url"]
        c.encoders[0].behaviour = Behaviour(ec_report=lambda parts: None)  # nothing at all
        r = await client.post(c.proxy_url + CHAT, json=chat_body(image(2)))
        assert r.status_code == 200
        last = c.decodes[0].requests()[-1]
        assert parts_of(last.body)[0]["type"] == "image_url"
        assert "ec_transfer_params" not in last.body


@pytest.mark.parametrize("report", [
    lambda parts: {p["uuid"]: {"item_indices": [5], "metadata": GRID} for p in parts},
    lambda parts: {"a": {"item_indices": [0]}, "b": {"item_indices": [0]}},
    lambda parts: {"a": {"item_indices": [0]}},
], ids=["out-of-range", "duplicate", "unmatched"])
async def test_bad_item_indices_are_a_502_naming_encode(
    client: httpx.AsyncClient, report: Any,
) -> None:
    async with run_cluster(encoders=1, prefills=1, decodes=1) as c:
        c.encoders[0].behaviour = Behaviour(ec_report=report)
        for stream in (False, True):
            r = await client.post(c.proxy_url + CHAT,
                                  json=chat_body(image(0), image(1), stream=stream))
            assert r.status_code == 502, r.text
            error = r.json()["error"]
            assert error["stage"] == "encode" and error["instance"] == c.encoders[0].url
        assert not c.prefills[0].requests() and not c.decodes[0].requests()


async def test_a_push_consumer_gets_its_ranks_address_and_a_retry_re_encodes(
    client: httpx.AsyncClient,
) -> None:
    async with run_cluster(encoders=1, decodes=0, admin_key="k") as c, trio.open_nursery() as nursery:
        pd = FakeVLLM(role="prefill_decode", dp_size=2)
        await start_fakes(nursery, pd)
        addrs = ["tcp://pd:14579", "tcp://pd:14580"]
        r = await client.post(c.proxy_url + "/instances", headers={"x-api-key": "k"}, json={
            "role": "prefill_decode", "url": pd.url, "dp_size": 2, "ec_zmq_addrs": addrs})
        assert r.status_code == 200, r.text
        pd.behaviour = Behaviour(fail_status=500, fail_count=1)  # the first attempt fails
        r = await client.post(c.proxy_url + CHAT, json=chat_body(image(0)))
        assert r.status_code == 200, r.text
        encodes, legs = c.encoders[0].requests(), pd.requests()
        assert len(encodes) == 2 and len(legs) == 2  # the retry encoded again
        for enc, leg in zip(encodes, legs, strict=True):
            pushed = enc.body["ec_transfer_params"]
            assert pushed["consumer_zmq"] == addrs[leg.rank]  # the rank the leg went to
            (item,) = pushed["ec_items"]
            assert leg.body["ec_transfer_params"]["ec_items"] == [
                {"mm_hash": url_uuid(image(0)), "transfer_id": item["transfer_id"]}]
        first, second = (e.body["ec_transfer_params"]["ec_items"][0]["transfer_id"]
                         for e in encodes)
        assert first != second and legs[0].rank != legs[1].rank
        nursery.cancel_scope.cancel()
