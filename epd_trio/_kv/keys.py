"""Our key for a KV cache block: the same function over an engine's events and over a request.

vLLM's own block hash cannot be recomputed outside the engine: it is seeded per process (random
unless PYTHONHASHSEED is set) and hashes a pickle or CBOR of Python objects. So the index keys
blocks by a chained hash of its own, computed from what both sides have: a block's token ids and
its *extra keys*, seeded by the parent block's key. An engine's ``BlockStored`` event carries
both (``token_ids``, ``extra_keys``); a request carries its token ids (vLLM's render endpoint)
and what vLLM forms the extra keys from. vLLM's ``generate_block_hash_extra_keys``
(``vllm/v1/core/kv_cache_utils.py``) gives a block, in this order: the LoRA name, then one
``(identifier, offset - block_start)`` pair per media item whose placeholder overlaps the block,
then the cache salt on the first block only, then prompt-embeds hashes (not supported on the
request side: such a request gets keys that match nothing, which only under-counts). A block
without any is None. ``block_extra_keys`` rebuilds that tuple for a request.

The key: ``hash((parent_key, tokens, extras))`` with the tokens a tuple of ints and ``extras``
0 or a blake2b digest (8 bytes, as an int) of the extra keys packed with msgpack, so a tuple
from an event and a list built here hash alike. CPython hashes ints and tuples of ints without
the per-process seed that salts str and bytes, so the key is the same in every process of the
same CPython (``KEY_SCHEME`` names it, for a future shared index to refuse mixing). blake2b over
every block's tokens would be stable across implementations too, but cost 4-5x the tuple hash
per 32-token block (timeit, struct-packed tokens, digest_size 8), and ingestion hashes every
stored block. Collisions: 64-bit keys (61 bits of the parent after
CPython's int reduction); a collision can only make a routing guess wrong, never a reply.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

#: Names the key function; a shared index must not mix keys of different schemes.
KEY_SCHEME = "cpython-tuple-hash+blake2b8-extras/1"
#: The parent key of a prompt's first block.
ROOT_KEY = 0


@dataclass(frozen=True, slots=True)
class MediaFeature:
    """One media item of a request as vLLM hashes it: its identifier (the mm hash, or the uuid
    the client gave) and the span of its placeholder tokens in the prompt."""

    identifier: str
    offset: int
    length: int


def extras_digest(extra: Any) -> int:
    """A block's extra keys as one stable int (0: none)."""
    if not extra:
        return 0
    return int.from_bytes(hashlib.blake2b(msgpack.packb(extra), digest_size=8).digest(), "big")


def chain_keys(parent_key: int, token_ids: Sequence[int], block_size: int,
               extra_keys: Sequence[Any] | None = None) -> list[int]:
    """The keys of the full blocks of ``token_ids`` chained after ``parent_key``; a partial last
    block has none (vLLM caches full blocks only). ``extra_keys[i]`` belongs to block i."""
    keys = []
    key = parent_key
    starts = range(0, len(token_ids) - block_size + 1, block_size)
    if not extra_keys:  # the common case, kept to one hash per block
        for start in starts:
            key = hash((key, tuple(token_ids[start:start + block_size]), 0))
            keys.append(key)
        return keys
    for index, start in enumerate(starts):
        extra = extra_keys[index] if index < len(extra_keys) else None
        key = hash((key, tuple(token_ids[start:start + block_size]), extras_digest(extra)))
        keys.append(key)
    return keys


def block_extra_keys(start: int, end: int, *, media: Sequence[MediaFeature] = (),
                     lora_name: str | None = None,
                     cache_salt: str | None = None) -> tuple[Any, ...] | None:
    """The extra keys vLLM hashes with the block of tokens ``[start, end)`` (None: none).

    ``media`` sorted by offset, as vLLM keeps them."""
    extra: list[Any] = [lora_name] if lora_name else []
    for item in media:
        if item.offset >= end:
            break
        if item.offset + item.length > start:
            extra.append((item.identifier, item.offset - start))
    if cache_salt and start == 0:
        extra.append(cache_salt)
    return tuple(extra) if extra else None


def request_keys(token_ids: Sequence[int], block_size: int, *, media: Sequence[MediaFeature] = (),
                 lora_name: str | None = None, cache_salt: str | None = None) -> list[int]:
    """The keys of a request's full blocks, as the index holds them for an engine that cached
    the same prompt. ``token_ids`` as vLLM's render endpoint returns them."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    ordered = sorted(media, key=lambda item: item.offset)
    extras = None
    if ordered or lora_name or cache_salt:
        extras = [block_extra_keys(start, start + block_size, media=ordered, lora_name=lora_name,
                                   cache_salt=cache_salt)
                  for start in range(0, len(token_ids) - block_size + 1, block_size)]
    return chain_keys(ROOT_KEY, token_ids, block_size, extras)
