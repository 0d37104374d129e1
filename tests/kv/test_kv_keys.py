"""Our block keys: vLLM's extra keys rebuilt for a request, chained keys, stable across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from kv_helpers import BLOCK, prompt

import epd_trio._kv.keys as keys_module
from epd_trio._kv.keys import (
    ROOT_KEY,
    MediaFeature,
    block_extra_keys,
    chain_keys,
    extras_digest,
    request_keys,
)

IMAGE = MediaFeature("img-a", offset=6, length=7)   # tokens 6..12: blocks [4,8), [8,12), [12,16)
IMAGE_2 = MediaFeature("img-b", offset=13, length=2)  # tokens 13..14: block [12,16)

EXTRA_KEYS = [
    # (block, request, extra keys), as vllm/v1/core/kv_cache_utils.py forms them
    ((0, 4), {}, None),
    ((0, 4), {"media": [IMAGE]}, None),
    ((4, 8), {"media": [IMAGE]}, (("img-a", 2),)),
    ((8, 12), {"media": [IMAGE]}, (("img-a", -2),)),
    ((12, 16), {"media": [IMAGE, IMAGE_2]}, (("img-a", -6), ("img-b", 1))),
    ((16, 20), {"media": [IMAGE, IMAGE_2]}, None),
    ((0, 4), {"lora_name": "sql"}, ("sql",)),
    ((0, 4), {"cache_salt": "tenant-1"}, ("tenant-1",)),
    ((4, 8), {"cache_salt": "tenant-1"}, None),                      # the first block only
    ((0, 4), {"cache_salt": ""}, None),                              # an empty salt is none
    ((4, 8), {"media": [IMAGE], "lora_name": "sql", "cache_salt": "s"}, ("sql", ("img-a", 2))),
    ((0, 8), {"media": [IMAGE], "lora_name": "sql", "cache_salt": "s"},
     ("sql", ("img-a", 6), "s")),                                   # LoRA, media, then salt
]


@pytest.mark.parametrize(("block", "request_", "extra"), EXTRA_KEYS)
def test_extra_keys_are_formed_as_vllm_forms_them(block: tuple[int, int], request_: dict[str, Any],
                                                  extra: Any) -> None:
    assert block_extra_keys(*block, **request_) == extra


def test_only_full_blocks_have_keys_and_a_longer_prompt_extends_the_chain() -> None:
    tokens = prompt(3, seed=1, extra_tokens=BLOCK - 1)
    keys = request_keys(tokens, BLOCK)
    assert len(keys) == 3
    assert request_keys(tokens + prompt(2, seed=2), BLOCK)[:3] == keys
    assert request_keys(tokens[:BLOCK - 1], BLOCK) == []
    assert keys == chain_keys(ROOT_KEY, tokens, BLOCK)


CHANGES = [
    # (what differs from the plain prompt, the first block whose key differs)
    ({"lora_name": "sql"}, 0),
    ({"cache_salt": "tenant-1"}, 0),
    ({"media": [IMAGE]}, 1),
    ({"media": [MediaFeature("img-a", offset=9, length=7)]}, 2),
]


@pytest.mark.parametrize(("request_", "first_different"), CHANGES)
def test_extra_keys_change_the_keys_from_the_block_they_touch(request_: dict[str, Any],
                                                              first_different: int) -> None:
    tokens = prompt(4, seed=3)
    plain, changed = request_keys(tokens, BLOCK), request_keys(tokens, BLOCK, **request_)
    assert plain[:first_different] == changed[:first_different]
    assert all(a != b for a, b in zip(plain[first_different:], changed[first_different:],
                                      strict=True))


def test_a_tuple_from_an_event_and_a_list_built_here_digest_alike() -> None:
    assert extras_digest(("sql", ("img-a", -2))) == extras_digest(["sql", ["img-a", -2]])
    assert extras_digest(None) == extras_digest(()) == 0
    assert extras_digest(("a",)) != extras_digest(("b",))


def test_request_keys_refuses_a_block_size_of_zero() -> None:
    with pytest.raises(ValueError, match="block_size"):
        request_keys([1, 2], 0)


def test_keys_are_the_same_in_another_process_with_another_hash_seed() -> None:
    """str and bytes hashes are salted per process; our keys must not be (a shared index)."""
    # keys.py alone (it imports only the standard library and msgpack), not the whole package.
    code = ("import importlib.util, json, sys; "
            "spec = importlib.util.spec_from_file_location('keys', sys.argv[1]); "
            "keys = sys.modules['keys'] = importlib.util.module_from_spec(spec); "
            "spec.loader.exec_module(keys); "
            "print(json.dumps(keys.request_keys(list(range(40)), 4, lora_name='sql', "
            "cache_salt='s', media=[keys.MediaFeature('img', 5, 9)])))")
    here = request_keys(list(range(40)), 4, lora_name="sql", cache_salt="s",
                        media=[MediaFeature("img", 5, 9)])
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code, keys_module.__file__], env=env,
                             capture_output=True, text=True, check=True).stdout
        assert json.loads(out) == here
