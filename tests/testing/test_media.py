"""The sample images: valid PNGs, distinct for every seed (the bench uses thousands)."""

from __future__ import annotations

import struct
import zlib

from epd_trio.testing.media import png_bytes, png_data_url


def test_every_seed_gives_a_distinct_image() -> None:
    # The old formula used the seed modulo 256: seeds 0 and 256 were the same image.
    assert len({png_data_url(seed=seed) for seed in range(2000)}) == 2000
    assert png_bytes(seed=7) == png_bytes(seed=7)


def test_the_png_is_well_formed() -> None:
    data = png_bytes(64, 48, seed=12345)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    offset, chunks = 8, {}
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset:offset + 4])
        kind, body = data[offset + 4:offset + 8], data[offset + 8:offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length:offset + 12 + length])
        assert crc == zlib.crc32(kind + body)
        chunks[kind] = body
        offset += 12 + length
    assert list(chunks) == [b"IHDR", b"IDAT", b"IEND"]
    assert struct.unpack(">II", chunks[b"IHDR"][:8]) == (64, 48)
    assert len(zlib.decompress(chunks[b"IDAT"])) == 48 * (1 + 64 * 3)  # filter byte + RGB rows
