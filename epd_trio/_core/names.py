"""The proxy's vocabulary: one constant per fact, so a name means one thing everywhere.

A **stage** is a step of a request (encode, prefill, decode); it routes over the instances of
the same name. A **role** is what an instance was configured or registered as: a stage's name,
or ``prefill_decode`` for a combined instance, which serves the decode stage of a layout without
prefill. A **request kind** is which OpenAI endpoint a client called.
"""

from __future__ import annotations

from typing import Literal, get_args

#: A stage's name: a plain string (a metrics label, a log field, a span attribute as it is),
#: which a type checker holds to these three.
Stage = Literal["encode", "prefill", "decode"]
#: The stages of a request, in order; each has its own cursor, health view and metrics.
STAGES: tuple[Stage, ...] = get_args(Stage)
#: The roles an instance may be configured or registered with.
ROLES = (*STAGES, "prefill_decode")
#: The stage each role serves.
STAGE_OF_ROLE = {"encode": "encode", "prefill": "prefill", "decode": "decode",
                 "prefill_decode": "decode"}

RequestKind = Literal["chat", "completions"]
#: The client-facing path of each request kind (the same path on every upstream leg).
PATH_OF_KIND: dict[RequestKind, str] = {"chat": "/v1/chat/completions",
                                        "completions": "/v1/completions"}
#: Its inverse: the request kind a path is.
KIND_OF_PATH: dict[str, RequestKind] = {path: kind for kind, path in PATH_OF_KIND.items()}
#: The path of the chat endpoint (encoder legs always use it).
CHAT_PATH = PATH_OF_KIND["chat"]

#: vLLM's other endpoints a model serves (pooling, scoring, tokenizing, audio), each routed by
#: its ``model`` to that model's pool, to its decode (combined) instances, on the same path,
#: and relayed as the instance answers; with how its body comes: a JSON object, or a
#: multipart form whose ``model`` is a field (the audio uploads).
MODEL_ENDPOINTS: dict[str, str] = {
    "/v1/embeddings": "json", "/pooling": "json", "/classify": "json", "/score": "json",
    "/v1/score": "json", "/rerank": "json", "/v1/rerank": "json", "/v2/rerank": "json",
    "/tokenize": "json", "/detokenize": "json",
    "/v1/audio/transcriptions": "form", "/v1/audio/translations": "form",
}
