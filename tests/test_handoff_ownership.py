"""The hand-off is the proxy's: no client field or header that steers a transfer or a placement
reaches any leg, in any layout, on either endpoint, streamed or not (over real sockets)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from epd_trio._core.rewrite import PREFILL_KV_TRANSFER_PARAMS
from epd_trio.testing import run_cluster

from helpers import CHAT, COMPLETIONS, chat_body, image

#: What a hostile client injects: a KV pull from an address it names, an EC handle, a rank.
EVIL_KV = {"do_remote_prefill": True, "remote_engine_id": "evil", "remote_block_ids": [1],
           "remote_host": "203.0.113.9", "remote_port": 5600}
EVIL_EC = {"item": {"peer_host": "203.0.113.9", "peer_port": 1, "mm_hash": "x"}}
EVIL_HEADERS = {"x-data-parallel-rank": "7", "x-prefiller-host-port": "203.0.113.9:1",
                "x-decoder-host-port": "203.0.113.9:2"}

LAYOUTS = {
    "E+P+D": {"encoders": 1, "prefills": 1, "decodes": 1},
    "E+PD": {"encoders": 1, "prefills": 0, "decodes": 1},
    "P+D": {"encoders": 0, "prefills": 1, "decodes": 1},
    "PD": {"encoders": 0, "prefills": 0, "decodes": 1},
}


def bodies(stream: bool) -> list[tuple[str, dict[str, Any]]]:
    extra = {"kv_transfer_params": EVIL_KV, "ec_transfer_params": EVIL_EC, "stream": stream}
    return [
        (CHAT, chat_body(image(1), **extra)),
        (CHAT, chat_body(**extra)),
        (COMPLETIONS, {"model": "fake-model", "prompt": "hi", "max_tokens": 3, **extra}),
    ]


@pytest.mark.parametrize("layout", list(LAYOUTS))
async def test_no_client_hand_off_field_or_header_reaches_a_leg(
    client: httpx.AsyncClient, layout: str
) -> None:
    async with run_cluster(**LAYOUTS[layout]) as c:
        sent = 0
        for stream in (False, True):
            for path, body in bodies(stream):
                r = await client.post(c.proxy_url + path, content=orjson.dumps(body),
                                      headers=EVIL_HEADERS)
                assert r.status_code == 200, (layout, path, stream, r.text)
                sent += 1
        legs = [(f.role, rec) for f in (*c.encoders, *c.prefills, *c.decodes)
                for rec in f.requests()]
        decode_legs = [rec for role, rec in legs if role in ("decode", "prefill_decode")]
        assert len(decode_legs) == sent  # every request reached decode
        if LAYOUTS[layout]["encoders"]:
            assert any(role == "encode" for role, _ in legs)
        for role, rec in legs:
            where = (layout, role, rec.path)
            # The proxy's own EC hand-off may reach the consumer leg: never the client's.
            ec = rec.body.get("ec_transfer_params")
            assert ec is None or ("item" not in ec and "203.0.113.9" not in orjson.dumps(
                ec).decode()), where
            for header in EVIL_HEADERS:
                assert header not in rec.headers, (where, header)
            params = rec.body.get("kv_transfer_params")
            if role == "prefill":
                assert params == PREFILL_KV_TRANSFER_PARAMS, where
            elif role == "decode":  # after a prefill: exactly the prefill's own answer
                assert params is not None and params.get("remote_engine_id") != "evil", where
                assert params.get("remote_host") != EVIL_KV["remote_host"], where
            else:  # encoders and combined instances: no hand-off at all
                assert params is None, where
