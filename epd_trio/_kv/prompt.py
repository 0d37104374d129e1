"""A request as the KV index sees it: its token ids and media, read from vLLM's render answer.

The index holds token ids; a request holds text and media. vLLM converts one into the other
itself (``POST /v1/chat/completions/render`` and ``/v1/completions/render``, served by ``vllm
serve --enable-scale-out`` or a GPU-less ``vllm launch render``), with the same chat template
and tokenizer its engine uses, so the proxy never tokenizes and never disagrees with the engine.

The answer is a ``GenerateRequest`` (a list of them for ``/v1/completions/render``, one per
prompt): ``token_ids``, and ``features`` (null for text) with ``mm_hashes`` and
``mm_placeholders`` per modality, which give each media block its extra keys
(``keys.block_extra_keys``). A completions request with several prompts is not routed on its
cache (the legs carry all its prompts; no one slot holds them all): ``None``.

Pure: values in, values out. A malformed answer raises ``UnusableRender``: the caller falls back to
``cache_aware`` for that request, never fails it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .keys import MediaFeature, request_keys


class UnusableRender(ValueError):
    """A render answer this module cannot read (the request is routed without the index)."""


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """One prompt as vLLM renders it: its token ids and its media items in prompt order."""

    token_ids: Sequence[int]
    media: tuple[MediaFeature, ...] = ()

    def keys(self, block_size: int, *, cache_salt: str | None = None,
             lora_name: str | None = None) -> list[int]:
        """The index keys of the prompt's full blocks (``keys.request_keys``); ``lora_name``:
        the LoRA adapter the request runs, the first of every block's extra keys in vLLM."""
        return request_keys(self.token_ids, block_size, media=self.media, cache_salt=cache_salt,
                            lora_name=lora_name)


def rendered_prompt(answer: Any) -> RenderedPrompt | None:
    """The prompt of a render answer; None when it renders several prompts."""
    if isinstance(answer, list):
        if len(answer) != 1:
            return None
        answer = answer[0]
    if not isinstance(answer, Mapping):
        raise UnusableRender("a render answer is a GenerateRequest object")
    tokens = answer.get("token_ids")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise UnusableRender("a render answer's 'token_ids' is a list of integers")
    return RenderedPrompt(tokens, _media(answer.get("features")))


def _media(features: Any) -> tuple[MediaFeature, ...]:
    """Every media item of ``features``: the n-th hash of a modality with its n-th placeholder."""
    if features is None:
        return ()
    if not isinstance(features, Mapping):
        raise UnusableRender("a render answer's 'features' is an object or null")
    hashes, places = features.get("mm_hashes") or {}, features.get("mm_placeholders") or {}
    if not isinstance(hashes, Mapping) or not isinstance(places, Mapping):
        raise UnusableRender("'mm_hashes' and 'mm_placeholders' are objects keyed by modality")
    found = []
    for modality, ids in hashes.items():
        spans = places.get(modality)
        if not isinstance(ids, list) or not isinstance(spans, list) or len(ids) != len(spans):
            raise UnusableRender(f"{modality!r}: one placeholder per media hash")
        for identifier, span in zip(ids, spans, strict=True):
            offset = span.get("offset") if isinstance(span, Mapping) else None
            length = span.get("length") if isinstance(span, Mapping) else None
            if not (isinstance(identifier, str) and isinstance(offset, int)
                    and isinstance(length, int) and offset >= 0 and length > 0):
                raise UnusableRender(f"{modality!r}: a media hash is a string, its placeholder "
                                 "an offset and a positive length")
            found.append(MediaFeature(identifier, offset, length))
    return tuple(sorted(found, key=lambda item: item.offset))
