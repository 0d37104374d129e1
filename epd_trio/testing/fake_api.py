"""The fake vLLM's other endpoints: embeddings, pooling, scores, reranking, tokenizing, audio.

As vLLM does, a server serves the endpoints of its tasks only (``FakeVLLM.tasks``: ``generate``
by default, as ``vllm serve``; ``embed``, ``score``, ``classify`` as ``--runner pooling``
gives them; ``transcription`` for a speech model) and answers FastAPI's
``404 {"detail": "Not Found"}`` on the others, and vLLM's own 404 for a model it does not serve.
Answers have vLLM's shape and ``usage``, deterministic in the input. A multipart body (the audio
endpoints) is read with the standard library's MIME parser, independent of the proxy's own
field reader, so a test through the proxy checks the form arrived whole.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from email import policy
from email.parser import BytesParser
from typing import Any

import orjson

#: The endpoints each task serves.
TASK_ENDPOINTS: dict[str, frozenset[str]] = {
    "generate": frozenset({"/tokenize", "/detokenize"}),
    "embed": frozenset({"/v1/embeddings", "/pooling", "/tokenize", "/detokenize"}),
    "score": frozenset({"/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"}),
    "classify": frozenset({"/classify"}),
    "transcription": frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"}),
}
#: Every endpoint some task serves (the rest of the fake handles chat and completions).
ENDPOINTS = frozenset().union(*TASK_ENDPOINTS.values())
_FORM = ("/v1/audio/transcriptions", "/v1/audio/translations")

Respond = Callable[..., Awaitable[None]]
Chunk = Callable[[bytes, bool], Awaitable[None]]


def form_of(body: bytes, content_type: str) -> dict[str, bytes]:
    """A multipart form's fields, by name (its file's bytes too), by the standard library."""
    message = BytesParser(policy=policy.default).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not message.is_multipart():
        raise ValueError("not a multipart body")
    fields = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        fields[str(name)] = part.get_payload(decode=True) or b""
    return fields


def _vector(text: str, size: int = 4) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [round(byte / 255, 4) for byte in digest[:size]]


def _tokens(text: str) -> list[int]:
    return [int.from_bytes(hashlib.sha256(word.encode()).digest()[:2], "big")
            for word in text.split()]


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v if isinstance(v, str) else orjson.dumps(v).decode() for v in value]
    return []


def json_answer(path: str, body: dict[str, Any], model: str) -> dict[str, Any]:
    """The JSON answer of a JSON endpoint, vLLM's shape, deterministic in its input."""
    if path == "/tokenize":
        tokens = _tokens(str(body.get("prompt") or body.get("messages") or ""))
        return {"count": len(tokens), "max_model_len": 4096, "tokens": tokens}
    if path == "/detokenize":
        return {"prompt": " ".join(f"t{t}" for t in body.get("tokens") or [])}
    if path in ("/v1/embeddings", "/pooling", "/classify"):
        inputs = _texts(body.get("input"))
        used = sum(len(t.split()) for t in inputs)
        if path == "/v1/embeddings":
            data: list[dict[str, Any]] = [{"object": "embedding", "index": i,
                                           "embedding": _vector(t)} for i, t in enumerate(inputs)]
        elif path == "/pooling":
            data = [{"object": "pooling", "index": i, "data": _vector(t)}
                    for i, t in enumerate(inputs)]
        else:
            data = [{"index": i, "label": "positive" if _vector(t)[0] > 0.5 else "negative",
                     "probs": _vector(t, 2), "num_classes": 2} for i, t in enumerate(inputs)]
        return {"id": f"{path.strip('/').replace('/', '-')}-1", "object": "list",
                "created": 0, "model": model, "data": data,
                "usage": {"prompt_tokens": used, "total_tokens": used, "completion_tokens": 0}}
    query = str(body.get("query") or body.get("text_1") or "")
    documents = _texts(body.get("documents") or body.get("text_2"))
    scores = [_vector(query + "|" + d, 1)[0] for d in documents]
    used = len(query.split()) * len(documents) + sum(len(d.split()) for d in documents)
    if path in ("/score", "/v1/score"):
        return {"id": "score-1", "object": "list", "created": 0, "model": model,
                "data": [{"index": i, "object": "score", "score": s}
                         for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": used, "total_tokens": used}}
    ranked = sorted(range(len(documents)), key=lambda i: -scores[i])
    return {"id": "rerank-1", "model": model, "usage": {"total_tokens": used},
            "results": [{"index": i, "document": {"text": documents[i]},
                         "relevance_score": scores[i]} for i in ranked]}


async def answer_form(path: str, fields: dict[str, bytes], model: str, respond: Respond,
                      chunk: Chunk, words: list[str]) -> None:
    """A transcription (translation): its text, or an SSE stream of it (``stream=true``)."""
    audio = fields.get("file", b"")
    text = " ".join(words) + f" ({len(audio)} bytes)"
    if fields.get("stream", b"").strip().lower() != b"true":
        await respond(200, orjson.dumps({"text": text, "usage": {
            "type": "duration", "seconds": max(1, len(audio) // 32000)}}))
        return
    await respond(200, b"", "text/event-stream", more=True)
    kind = "transcription" if path.endswith("transcriptions") else "translation"
    for piece in text.split(" "):
        event = {"id": f"{kind}-1", "object": f"{kind}.chunk", "created": 0, "model": model,
                 "choices": [{"delta": {"content": piece + " "}}]}
        await chunk(b"data: " + orjson.dumps(event) + b"\n\n", False)
    await chunk(b"data: [DONE]\n\n", True)


def is_form(path: str) -> bool:
    return path in _FORM
