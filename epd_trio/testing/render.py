"""The fake's tokenizer and chat template, and the render answers built on them (no I/O).

The prefix cache, the KV events and ``POST /v1/chat/completions/render`` must agree on every
token, as they do on vLLM (one tokenizer, one template), or a proxy indexing the events could
never match what render gives it. So this module is the one place a body becomes token ids:

- a word (``str.split``, as ``prompt_words`` splits) is one token, its id from CRC-32, so ids
  are the same in every process (Python's ``hash`` of a string is not);
- the chat template is ``<|role|> content <|end|>`` per message, then ``<|assistant|>`` (the
  generation prompt): two chats sharing leading messages share leading tokens;
- a media item is ``<|vision_start|>``, ``placeholder_tokens`` pads, ``<|vision_end|>``, like
  Qwen2-VL; its placeholder range covers the pads, its identifier is its ``uuid`` (or its
  content hash), as the encoder's ``ec_transfer_params`` key it. vLLM adds
  ``(identifier, offset of the item from the block's start)`` to the extra keys of each block
  the item overlaps (``_gen_mm_extra_hash_keys``), and ``cache_salt`` to the first block's.

The render JSON is vLLM's ``GenerateRequest`` (``vllm/entrypoints/serve/disagg/protocol.py``),
dumped with pydantic: chat answers one object, completions a list (one per prompt).
"""

from __future__ import annotations

import base64
import hashlib
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from .._kv.wire import ExtraKeys

#: Special token ids (below ``_WORD_BASE``, so a word never takes one).
SPECIAL = {"<|system|>": 1, "<|user|>": 2, "<|assistant|>": 3, "<|tool|>": 4, "<|developer|>": 5,
           "<|end|>": 6, "<|vision_start|>": 7, "<|vision_end|>": 8, "<|image_pad|>": 9,
           "<|audio_pad|>": 10, "<|video_pad|>": 11, "<|other|>": 12}
_WORD_BASE = 100
_VOCAB = 150_000
#: Pad tokens per media item: the default ``ec_report``'s Qwen2-VL grid [1, 4, 4], merged 2x2.
DEFAULT_PLACEHOLDER_TOKENS = 4
_MODALITY = {"image_url": "image", "audio_url": "audio", "input_audio": "audio",
             "video_url": "video"}
_PAD = {"image": "<|image_pad|>", "audio": "<|audio_pad|>", "video": "<|video_pad|>"}


def word_id(word: str) -> int:
    """A word's token id: the same in every process."""
    return _WORD_BASE + zlib.crc32(word.encode()) % _VOCAB


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One media item's place in the token ids."""

    modality: str
    identifier: str
    offset: int
    length: int


@dataclass(slots=True)
class Rendered:
    """A prompt as token ids, its media items and its cache salt."""

    token_ids: list[int]
    media: list[MediaItem] = field(default_factory=list)
    cache_salt: str | None = None

    def extra_keys(self, block_size: int) -> list[ExtraKeys]:
        """Each full block's extra keys, as vLLM's ``generate_block_hash_extra_keys`` forms
        them without LoRA or prompt embeddings: the media items the block overlaps as
        ``(identifier, item offset - block start)``, and the cache salt on the first block."""
        keys: list[ExtraKeys] = []
        for start in range(0, len(self.token_ids) - block_size + 1, block_size):
            end = start + block_size
            block: list[Any] = [(m.identifier, m.offset - start) for m in self.media
                                if m.offset < end and m.offset + m.length > start]
            if start == 0 and self.cache_salt:
                block.append(self.cache_salt)
            keys.append(tuple(block) if block else None)
        return keys


def item_identifier(part: Mapping[str, Any]) -> str:
    """A media part's identifier: its ``uuid``, else a hash of its content."""
    uuid = part.get("uuid")
    if uuid:
        return str(uuid)
    return hashlib.sha256(orjson.dumps(part, option=orjson.OPT_SORT_KEYS)).hexdigest()


def render_chat(body: Mapping[str, Any], *,
                placeholder_tokens: int = DEFAULT_PLACEHOLDER_TOKENS) -> Rendered:
    """A chat body through the template."""
    ids: list[int] = []
    media: list[MediaItem] = []
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        role = f"<|{message.get('role')}|>"
        ids.append(SPECIAL.get(role, SPECIAL["<|other|>"]))
        content = message.get("content")
        if isinstance(content, str):
            ids += [word_id(w) for w in content.split()]
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    continue
                kind = part.get("type")
                if kind == "text":
                    ids += [word_id(w) for w in str(part.get("text", "")).split()]
                elif kind in _MODALITY:
                    modality = _MODALITY[kind]
                    ids.append(SPECIAL["<|vision_start|>"])
                    media.append(MediaItem(modality, item_identifier(part), len(ids),
                                           placeholder_tokens))
                    ids += [SPECIAL[_PAD[modality]]] * placeholder_tokens
                    ids.append(SPECIAL["<|vision_end|>"])
        ids.append(SPECIAL["<|end|>"])
    if body.get("add_generation_prompt", True) and not body.get("continue_final_message"):
        ids.append(SPECIAL["<|assistant|>"])
    return Rendered(ids, media, _salt(body))


def render_prompts(body: Mapping[str, Any]) -> list[Rendered]:
    """A completions body's prompts (a string, a list of strings, token ids or lists of them)."""
    prompt = body.get("prompt")
    salt = _salt(body)
    if isinstance(prompt, str):
        return [Rendered([word_id(w) for w in prompt.split()], cache_salt=salt)]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [Rendered(list(prompt), cache_salt=salt)]
    if isinstance(prompt, list):
        return [r for p in prompt for r in render_prompts({**body, "prompt": p})]
    return []


def render_body(body: Mapping[str, Any], chat: bool, *,
                placeholder_tokens: int = DEFAULT_PLACEHOLDER_TOKENS) -> Rendered:
    """What the engine caches for one request (a multi-prompt completion: its first prompt)."""
    if chat:
        return render_chat(body, placeholder_tokens=placeholder_tokens)
    prompts = render_prompts(body)
    return prompts[0] if prompts else Rendered([])


def generate_request(rendered: Rendered, body: Mapping[str, Any], request_id: str,
                     model: str) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` for one rendered prompt, fields in declaration order."""
    return {
        "request_id": request_id,
        "token_ids": rendered.token_ids,
        "assistant_tokens_mask": None,
        "token_offsets": None,
        "features": _features(rendered.media),
        "sampling_params": sampling_params(body),
        "model": body.get("model", model),
        "stream": bool(body.get("stream", False)),
        "stream_options": body.get("stream_options"),
        "cache_salt": rendered.cache_salt,
        "priority": body.get("priority", 0),
        "kv_transfer_params": body.get("kv_transfer_params"),
    }


def sampling_params(body: Mapping[str, Any]) -> dict[str, Any]:
    """The commonly read subset of vLLM's ``SamplingParams``, from the body or vLLM's defaults
    (the real dump has more fields, all defaults here)."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stop = body.get("stop")
    return {
        "n": body.get("n", 1), "presence_penalty": body.get("presence_penalty", 0.0),
        "frequency_penalty": body.get("frequency_penalty", 0.0),
        "repetition_penalty": body.get("repetition_penalty", 1.0),
        "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
        "top_k": body.get("top_k", 0), "min_p": body.get("min_p", 0.0),
        "seed": body.get("seed"), "stop": [stop] if isinstance(stop, str) else (stop or []),
        "stop_token_ids": body.get("stop_token_ids") or [], "ignore_eos": body.get("ignore_eos", False),
        "max_tokens": max_tokens, "min_tokens": body.get("min_tokens", 0),
        "logprobs": body.get("logprobs") if not isinstance(body.get("logprobs"), bool) else None,
        "prompt_logprobs": body.get("prompt_logprobs"),
        "skip_special_tokens": body.get("skip_special_tokens", True),
        "spaces_between_special_tokens": body.get("spaces_between_special_tokens", True),
        "include_stop_str_in_output": body.get("include_stop_str_in_output", False),
    }


def _features(media: Sequence[MediaItem]) -> dict[str, Any] | None:
    """vLLM's ``MultiModalFeatures``, or None for a text-only prompt."""
    if not media:
        return None
    hashes: dict[str, list[str]] = {}
    places: dict[str, list[dict[str, int]]] = {}
    kwargs: dict[str, list[str | None]] = {}
    for item in media:
        hashes.setdefault(item.modality, []).append(item.identifier)
        places.setdefault(item.modality, []).append({"offset": item.offset, "length": item.length})
        # Real vLLM sends each item's processed tensors, base64-encoded; this stands in for them.
        kwargs.setdefault(item.modality, []).append(
            base64.b64encode(f"fake-mm-kwargs:{item.identifier}".encode()).decode())
    return {"mm_hashes": hashes, "mm_placeholders": places, "kwargs_data": kwargs}


def _salt(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None
