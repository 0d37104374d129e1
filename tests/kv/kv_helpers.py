"""Shared by the KV index tests: prompts, and the events an engine publishes for them."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from epd_trio._kv.keys import block_extra_keys
from epd_trio._kv.wire import BlockStored

BLOCK = 4  # small blocks keep the tables readable; the key function does not care


def prompt(blocks: int, seed: int, *, extra_tokens: int = 0) -> list[int]:
    """``blocks`` full blocks of tokens (plus a partial one of ``extra_tokens``), by seed."""
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(blocks * BLOCK + extra_tokens)]


def stored(tokens: Sequence[int], first_hash: int, *, parent: int | None = None, start: int = 0,
           block_size: int = BLOCK, extra_keys: Sequence[Any] | None = None,
           **fields: Any) -> BlockStored:
    """The BlockStored an engine publishes for the full blocks of ``tokens[start:]``, its vLLM
    hashes numbered from ``first_hash``."""
    body = tuple(tokens[start:start + (len(tokens) - start) // block_size * block_size])
    count = len(body) // block_size
    return BlockStored(tuple(range(first_hash, first_hash + count)), parent, body, block_size,
                       None if extra_keys is None else tuple(extra_keys),
                       fields.get("lora_name"), fields.get("medium", "GPU"),
                       fields.get("group_idx", 0))


def extras_for(tokens: Sequence[int], **request: Any) -> list[Any]:
    """The per-block extra keys vLLM publishes for a request (its media, LoRA name, salt)."""
    return [block_extra_keys(start, start + BLOCK, **request)
            for start in range(0, len(tokens) - BLOCK + 1, BLOCK)]

