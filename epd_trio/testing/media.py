"""Small, valid, distinct PNG images as data URLs (for the demo, the bench and tests)."""

from __future__ import annotations

import base64
import hashlib
import struct
import zlib


def png_bytes(width: int = 8, height: int = 8, seed: int = 0) -> bytes:
    """A valid RGB PNG whose pixels depend on all of ``seed`` (every seed: a distinct uuid).

    The seed is hashed into the pixel values, so seeds far apart (a bench's thousands of
    images, a test's random one) never repeat an image, and a real encoder never finds one in
    its cache.
    """

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    noise = hashlib.sha256(str(seed).encode()).digest()
    rows = b"".join(
        b"\x00" + bytes((x * 31 + y * 17 + c * 85 + noise[(x + 3 * y + c) % len(noise)]) % 256
                        for x in range(width) for c in range(3))
        for y in range(height)
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def png_data_url(width: int = 8, height: int = 8, seed: int = 0) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(width, height, seed)).decode()
