"""An asyncio program using the bridge, as a service would (run by tests/test_asyncio_bridge.py).

Configured like the proxy (``EPD_ENCODE_URLS``, ``EPD_DECODE_URLS``, ...). For each image URL
given on the command line it encodes one single-image request and picks the decode slot, then
prints one JSON line per request: the encoder used, the item's uuid and the decode slot.
"""

from __future__ import annotations

import asyncio
import sys

import orjson

from epd_trio import load_settings
from epd_trio.asyncio_bridge import AsyncioBridge, run


async def main(image_urls: list[str]) -> None:
    async with AsyncioBridge(load_settings()) as bridge:
        for url in image_urls:
            body = {"model": "fake-model", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "describe"}]}]}
            encoded = await bridge.encode(body)
            decode, rank = bridge.next_decode()
            await asyncio.sleep(0)  # plain asyncio code runs alongside
            print(orjson.dumps({
                "encoder": encoded.calls[0].instance.url, "uuid": encoded.items[0]["uuid"],
                "decode": decode.url, "rank": rank}).decode(), flush=True)


if __name__ == "__main__":
    run(main, sys.argv[1:])
