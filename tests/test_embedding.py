"""The library path: another trio service using the encoder fan-out without the web app."""

import orjson
import pytest
import trio

from epd_trio import (
    EncoderCursor,
    Instance,
    UpstreamClient,
    UpstreamStatusError,
    parse_request,
    run_encoder_fanout,
    with_item_uuids,
)
from epd_trio.testing import FakeVLLM

from helpers import chat_body, image, start_fakes, url_uuid


async def test_run_encoder_fanout_directly(nursery: trio.Nursery) -> None:
    fakes = await start_fakes(nursery, FakeVLLM("encode"), FakeVLLM("encode"))
    cursor = EncoderCursor([Instance(f.url) for f in fakes])
    raw = orjson.dumps(chat_body(image(1), image(2), image(3), mm_processor_kwargs={"x": 1}))
    body, items = with_item_uuids(parse_request(raw, "chat"))
    async with UpstreamClient() as client:
        calls = await run_encoder_fanout(client, cursor, body=body, items=items,
                                         request_id="lib", max_batch=1)
        assert [(c.index, c.instance.url, c.item_indices) for c in calls] == [
            (0, fakes[0].url, (0,)), (1, fakes[1].url, (1,)), (2, fakes[0].url, (2,))]
        assert body["messages"][0]["content"][0]["uuid"] == url_uuid(image(1))
        sent = {r.request_id: r.body for f in fakes for r in f.requests()}
        assert set(sent) == {"lib-enc-0", "lib-enc-1", "lib-enc-2"}
        assert all(b["mm_processor_kwargs"] == {"x": 1} for b in sent.values())

        fakes[1].behaviour.fail_status = 400
        with pytest.raises(UpstreamStatusError) as info:
            await run_encoder_fanout(client, cursor, body=body, items=items, request_id="x")
        assert info.value.status == 400 and info.value.stage == "encode"
        assert info.value.instance == fakes[1].url
