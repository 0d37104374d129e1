"""Request validation and the body each stage sends.

The rules are docs/discussion/protocol.md's "Media items", "Prefill stage" and "Decode stage".

Rules: no I/O, no trio. The client's parsed body is never mutated: every leg's body is a new
top-level dict that shares the unchanged sub-objects with the original (large base64 media strings
are immutable ``str`` objects and are never copied). Only the fields the proxy reads are validated;
everything else passes through untouched to vLLM, which owns the rest of the schema.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from .errors import BadRequest
from .names import RequestKind

#: Content part types that are media items for the encode stage (each gets a ``uuid``).
MEDIA_TYPES = frozenset({"image_url", "audio_url", "input_audio", "video_url"})
#: Content part types passed through without encoding (text and precomputed embeddings).
PASSTHROUGH_TYPES = frozenset({"text", "refusal", "image_embeds"})
#: The field of each media part that holds its URL (``input_audio`` has none: it is inline data).
_URL_FIELD = {"image_url": "image_url", "audio_url": "audio_url", "video_url": "video_url"}

#: Fields copied from the client body into each encoder sub-request (they change how media is
#: processed, so the encoder must see them to produce the cache entry decode will look up).
ENCODER_PASSTHROUGH_FIELDS = ("mm_processor_kwargs", "media_io_kwargs", "priority", "session_id")

#: Body fields that steer a transfer: the proxy's alone (docs/discussion/protocol.md "The hand-off is the
#: proxy's"). A client that sends them could make an instance pull KV or encoder-cache entries
#: from an address it names (llm-d #242 was this class of bug), so they are dropped from the
#: client's body before any leg is built, in every layout and on both endpoints. Dropped, not
#: refused: the official clients never send them, and a client that replays a vLLM response's
#: fields must not be broken by the proxy for it.
PROXY_OWNED_FIELDS = ("kv_transfer_params", "ec_transfer_params")

#: The ``kv_transfer_params`` that asks a prefill instance to keep the KV for a remote decode.
PREFILL_KV_TRANSFER_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated client request: the original body plus where its media items are."""

    kind: RequestKind
    body: dict[str, Any]
    stream: bool
    #: (message index, content part index) of each media item, in order of appearance.
    media: tuple[tuple[int, int], ...]
    #: The ``PROXY_OWNED_FIELDS`` the client sent, removed from ``body``.
    dropped: tuple[str, ...] = ()


def json_object(raw: bytes, *, empty_ok: bool = False) -> dict[str, Any]:
    """A client body that must be a JSON object (``{}`` for an empty one, if ``empty_ok``);
    ``BadRequest`` (400) otherwise."""
    if empty_ok and not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(_not_json(raw, exc)) from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


@dataclass(frozen=True, slots=True)
class FormField:
    """A small text field of a multipart form: its value, and where its bytes are in the body
    (``start:end``), so it can be replaced without parsing the rest again."""

    value: str
    start: int
    end: int


#: The longest value read from a form field (a model name, a flag): files are skipped.
MAX_FORM_VALUE = 4096


def form_fields(raw: bytes, content_type: str | None,
                names: Collection[str]) -> dict[str, FormField]:
    """The text fields ``names`` of a ``multipart/form-data`` body (the first of each name).

    Read where they are, never copying the body: the parts are found with ``bytes.find``
    from delimiter to delimiter and a file part is only stepped over, so a 20 MB upload is
    held once, as it arrived. ``BadRequest`` (400) for a body that is not such a form."""
    boundary = _boundary(content_type)
    delimiter = b"--" + boundary
    found: dict[str, FormField] = {}
    position = raw.find(delimiter)
    if position < 0:
        raise BadRequest("the multipart body has no part (no boundary line)")
    while True:
        position += len(delimiter)
        if raw.startswith(b"--", position):
            return found  # the closing delimiter
        if not raw.startswith(b"\r\n", position):
            raise BadRequest("the multipart body is malformed (a boundary line not ended)")
        head_end = raw.find(b"\r\n\r\n", position + 2)
        following = raw.find(b"\r\n" + delimiter, head_end + 4) if head_end >= 0 else -1
        if head_end < 0 or following < 0:
            raise BadRequest("the multipart body is malformed (a part with no end)")
        name = _part_name(raw[position + 2:head_end])
        start = head_end + 4
        if (name in names and name not in found
                and following - start <= MAX_FORM_VALUE):
            try:
                value = raw[start:following].decode("utf-8")
            except UnicodeDecodeError:
                raise BadRequest(f"'{name}' is not UTF-8 text") from None
            found[name] = FormField(value, start, following)
        position = following + 2


def _boundary(content_type: str | None) -> bytes:
    kind, _, params = (content_type or "").partition(";")
    if kind.strip().lower() != "multipart/form-data":
        raise BadRequest("this endpoint takes a multipart/form-data body (content-type "
                         f"{kind.strip() or 'none'})")
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.lower() == "boundary" and value.strip('"'):
            boundary = value.strip('"')
            if len(boundary) <= 70 and boundary.isascii():
                return boundary.encode("ascii")
    raise BadRequest("the multipart content-type has no usable boundary")


def _part_name(head: bytes) -> str | None:
    """The ``name`` of a part's ``Content-Disposition: form-data; name="..."``."""
    for line in head.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() != b"content-disposition":
            continue
        for param in value.split(b";")[1:]:
            pkey, _, pvalue = param.strip().partition(b"=")
            if pkey.lower() == b"name":
                return pvalue.strip(b'"').decode("utf-8", "replace")
    return None


def with_form_field(raw: bytes, field: FormField, value: str) -> bytes:
    """``raw`` with ``field``'s value replaced (an alias's target in a form): one copy."""
    return b"".join((raw[:field.start], value.encode("utf-8"), raw[field.end:]))


def _not_json(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    """Why a body is not JSON, in the client's terms: orjson reports bytes that are not UTF-8
    as "str is not valid UTF-8: surrogates not allowed", which names neither the body nor the
    byte; the decode (on this error path only) does."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        return (f"request body is not valid UTF-8: byte 0x{raw[bad.start]:02x} at offset "
                f"{bad.start}")
    return f"request body is not valid JSON: {exc}"


def client_fields(body: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``body`` without the fields the proxy owns, and which it had; ``BadRequest`` for a
    ``model`` that is not a name (every endpoint's body, completions and the others)."""
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        # Absent is fine (the one model served is meant, as vLLM reads it: the model
        # registry decides); present, it must be a name.
        raise BadRequest("'model' must be a non-empty string")
    dropped = tuple(name for name in PROXY_OWNED_FIELDS if name in body)
    if dropped:
        body = {key: value for key, value in body.items() if key not in PROXY_OWNED_FIELDS}
    return body, dropped


def parse_request(raw: bytes, kind: RequestKind) -> ParsedRequest:
    """Parse and validate a client body; raise ``BadRequest`` with an OpenAI-style message."""
    body, dropped = client_fields(json_object(raw))
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    if kind == "chat":
        media = _find_media(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"))
        media = ()
    return ParsedRequest(kind=kind, body=body, stream=stream, media=media, dropped=dropped)


def _find_media(messages: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty array")
    found: list[tuple[int, int]] = []
    for m, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{m}] must be an object", param=f"messages[{m}]")
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{m}].role is required and must be a string",
                             param=f"messages[{m}].role")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise BadRequest(f"messages[{m}].content must be a string or an array of parts",
                             param=f"messages[{m}].content")
        for p, part in enumerate(content):
            where = f"messages[{m}].content[{p}]"
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise BadRequest(f"{where} must be an object with a string 'type'", param=where)
            kind = part["type"]
            if kind in MEDIA_TYPES:
                _check_media_part(part, where)
                found.append((m, p))
            elif kind not in PASSTHROUGH_TYPES:
                supported = ", ".join(sorted(MEDIA_TYPES | PASSTHROUGH_TYPES))
                raise BadRequest(f"{where}.type {kind!r} is not supported (supported: {supported})",
                                 param=f"{where}.type")
    return tuple(found)


def _check_media_part(part: Mapping[str, Any], where: str) -> None:
    kind = part["type"]
    if "uuid" in part and part["uuid"] is not None and (
        not isinstance(part["uuid"], str) or not part["uuid"]
    ):
        raise BadRequest(f"{where}.uuid must be a non-empty string", param=f"{where}.uuid")
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
            raise BadRequest(f"{where}.input_audio must be an object with string 'data'",
                             param=f"{where}.input_audio")
        return
    field = _URL_FIELD[kind]
    value = part.get(field)
    if not isinstance(value, dict) or not isinstance(value.get("url"), str) or not value["url"]:
        raise BadRequest(f"{where}.{field} must be an object with a non-empty string 'url'",
                         param=f"{where}.{field}")


def _check_prompt(prompt: Any) -> None:
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list)
        and bool(prompt)
        and (
            all(isinstance(x, str) for x in prompt)
            or all(isinstance(x, int) and not isinstance(x, bool) for x in prompt)
            or all(isinstance(x, list) and all(isinstance(t, int) for t in x) for x in prompt)
        )
    )
    if not ok:
        raise BadRequest(
            "'prompt' is required: a string, an array of strings, or token id array(s)"
        )


def item_uuid(part: Mapping[str, Any]) -> str:
    """The stable id of a media item: the client's ``uuid``, else a SHA-256 of its URL/data.

    Every instance keys its encoder cache by this id, so E, P and D must see the same value; a
    hash of the URL is stable across retries and never re-hashes decoded media.
    """
    own = part.get("uuid")
    if isinstance(own, str) and own:
        return own
    kind = part["type"]
    if kind == "input_audio":
        data = orjson.dumps(part["input_audio"], option=orjson.OPT_SORT_KEYS)
    else:
        data = part[_URL_FIELD[kind]]["url"].encode()
    return hashlib.sha256(data).hexdigest()


def with_item_uuids(request: ParsedRequest) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A copy of the body whose media parts carry their ``uuid``, and those parts in order.

    Only the containers on the path to a media part are copied; everything else is shared with
    the original body, which stays unchanged.
    """
    if not request.media:
        return request.body, []
    body = dict(request.body)
    messages = list(body["messages"])
    body["messages"] = messages
    copied: set[int] = set()
    items: list[dict[str, Any]] = []
    for m, p in request.media:
        if m not in copied:
            messages[m] = {**messages[m], "content": list(messages[m]["content"])}
            copied.add(m)
        part = messages[m]["content"][p]
        tagged = {**part, "uuid": item_uuid(part)}
        messages[m]["content"][p] = tagged
        items.append(tagged)
    return body, items


def build_encoder_body(body: Mapping[str, Any], items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One encoder sub-request: only the media items (no text), one generated token, no stream."""
    encoder_body: dict[str, Any] = {
        "model": body.get("model"),
        "messages": [{"role": "user", "content": list(items)}],
        "max_tokens": 1,
        "stream": False,
    }
    for field in ENCODER_PASSTHROUGH_FIELDS:
        if field in body:
            encoder_body[field] = body[field]
    return encoder_body


def build_prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg: compute the KV cache for one token and keep it for a remote decode."""
    prefill = {
        key: value
        for key, value in body.items()
        if key not in ("stream_options", "min_tokens", "min_completion_tokens")
    }
    prefill["stream"] = False
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return prefill


def build_decode_body(
    body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The decode leg after a prefill: the client's body plus the prefill's KV handle.

    Without a handle, decode recomputes the prefill itself: slower, but the answer is the same.
    Any ``kv_transfer_params`` in ``body`` are dropped (``parse_request`` already removed the
    client's; this keeps a caller that skipped it from forwarding a stale handle).
    """
    decode = {key: value for key, value in body.items() if key != "kv_transfer_params"}
    if kv_transfer_params is not None:
        decode["kv_transfer_params"] = kv_transfer_params
    return decode


def kv_transfer_params_of(prefill_response: bytes) -> dict[str, Any] | None:
    """The top-level ``kv_transfer_params`` object of a prefill response, if it has a non-empty
    one."""
    params = _top_level(prefill_response, "kv_transfer_params")
    # An empty handle is no handle: upstream leaves the key out of decode's body then.
    return params if isinstance(params, dict) and params else None


def ec_transfer_params_of(encoder_response: bytes) -> Any:
    """The top-level ``ec_transfer_params`` of an encoder answer, as sent (None when absent or the
    answer is not JSON, as upstream: the items then keep their raw media); its shape is checked
    where it is matched to the items (``ec_handoff.match_reports``)."""
    return _top_level(encoder_response, "ec_transfer_params")


def _top_level(response: bytes, key: str) -> Any:
    try:
        parsed = orjson.loads(response)
    except orjson.JSONDecodeError:
        return None
    return parsed.get(key) if isinstance(parsed, dict) else None


def upstream_headers(
    request_id: str, rank: int | None, authorization: str | None = None, *,
    content_type: str | None = None,
) -> dict[str, str]:
    """Headers for one upstream leg; the DP rank header only for a ``dp_size > 1`` instance.
    ``content_type``: the body's when it is not JSON (a multipart upload's, with its boundary)."""
    headers = {"content-type": content_type or "application/json", "x-request-id": request_id}
    if rank is not None:
        headers["x-data-parallel-rank"] = str(rank)
    if authorization:
        headers["authorization"] = authorization
    return headers


def new_request_id(client_value: str | None) -> str:
    """Keep the client's ``x-request-id`` (it ties our legs to their logs), else a fresh one."""
    value = (client_value or "").strip()
    # ASCII only: it goes into upstream headers, and an id that cannot be encoded must not be a 500.
    keep = value and len(value) <= 256 and value.isascii() and value.isprintable()
    return value if keep else uuid.uuid4().hex
