"""The encoder-cache hand-off of vLLM's newest EPD proxy (pure): encoder answers -> consumer body.

An encoder answers each sub-request with ``ec_transfer_params``: a map from the engine's cache
key (``mm_hash``) to ``{"metadata": {field: values}, "item_indices": [...], ...connector
extras}``, where ``item_indices`` are positions within that sub-request. This module matches those
entries to the request's items, and builds what the consumer leg (prefill, or decode in E+PD)
gets: the connector handles as its ``ec_transfer_params``, and, unless turned off
(``EPD_EC_REWRITE``, upstream's ``--no-rewrite``), each media part the encoder reported metadata
for rewritten as a metadata-only ``*_embeds`` reference, so the consumer neither receives the
pixels nor re-runs the media processor. Items the encoder reported nothing for keep their raw
media (ECCPUConnector reports ``metadata: {}`` on purpose for an entry it did not cache).

Matching follows upstream (docs/contributing/upstream-notes/moriio-ec.md §3.3): in a sub-request
of several items every index must be an int in range and appear once; an item without an index
matches by its ``uuid`` as a key, or as the single entry of a one-item sub-request; with entries
reported, an item that matches none is an error. Those errors are 502s naming the ``encode``
stage and the encoder (upstream's name neither). Mooncake-style consumers also get
``ec_items``: one ``{"mm_hash", "transfer_id"}`` per item, the transfer ids the proxy put on the
encoder sub-requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import EncoderHandoffError

#: The ``*_embeds`` part type each media type becomes when rewritten.
EMBEDS_TYPE = {"image_url": "image_embeds", "audio_url": "audio_embeds",
               "input_audio": "audio_embeds", "video_url": "video_embeds"}
_AUDIO = frozenset({"audio_url", "input_audio"})


@dataclass(frozen=True, slots=True)
class EncodedItem:
    """What the encoder reported for one item."""

    #: The engine's cache key (may differ from the proxy's ``uuid``).
    engine_hash: str
    metadata: Mapping[str, Any]
    transfer_id: str | None = None


@dataclass(frozen=True, slots=True)
class Handoff:
    """The encode stage's result for the consumer leg."""

    #: By global item index; items the encoder reported nothing for are absent.
    items: Mapping[int, EncodedItem] = field(default_factory=dict)
    #: Every reported entry, whole, by engine hash: the connector's handles.
    handles: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EncoderReport:
    """One encoder sub-request's answer: its items (global indices) and its params."""

    instance: str
    item_indices: Sequence[int]
    params: Any


def match_reports(
    reports: Sequence[EncoderReport], uuids: Sequence[str],
    transfer_ids: Sequence[str] | None = None,
) -> Handoff:
    """Match every sub-request's entries to its items; ``EncoderHandoffError`` (502) when the
    encoder's indices are bad, duplicated or leave an item unmatched."""
    items: dict[int, EncodedItem] = {}
    handles: dict[str, Any] = {}
    for report in reports:
        params = report.params
        if params is None:
            continue
        if not isinstance(params, Mapping):
            raise _error(report, f"ec_transfer_params is a {type(params).__name__}, not a map")
        if not params:
            continue
        for key, entry in params.items():
            if not isinstance(key, str) or not isinstance(entry, Mapping):
                raise _error(report, f"ec_transfer_params entry {key!r} is not a map")
        local = _match_one(report, params, [uuids[i] for i in report.item_indices])
        for position, engine_hash in local.items():
            index = report.item_indices[position]
            metadata = params[engine_hash].get("metadata")
            items[index] = EncodedItem(
                engine_hash, metadata if isinstance(metadata, Mapping) else {},
                transfer_ids[index] if transfer_ids else None)
        handles.update(params)
    return Handoff(items, handles)


def _match_one(
    report: EncoderReport, params: Mapping[str, Mapping[str, Any]], uuids: Sequence[str]
) -> dict[int, str]:
    """Local position -> engine hash, for one sub-request of ``len(uuids)`` items."""
    count = len(uuids)
    found: dict[int, str] = {}
    if count > 1:
        for engine_hash, entry in params.items():
            indices = entry.get("item_indices", [])
            if not isinstance(indices, list):
                raise _error(report, f"item_indices of {engine_hash!r} is not a list")
            for position in indices:
                # ``type() is int``: a bool or a float is a garbled index, not a position.
                if type(position) is not int or not 0 <= position < count:
                    raise _error(report, f"invalid item index {position!r} for {count} items")
                if position in found:
                    raise _error(report, f"duplicate item index {position}")
                found[position] = engine_hash
    for position, own in enumerate(uuids):
        if position in found:
            continue
        if own in params:
            found[position] = own
        elif count == 1 and len(params) == 1:
            found[position] = next(iter(params))
        else:
            raise _error(report, f"the encoder's metadata cannot be matched to item {position} "
                                 f"(uuid {own})")
    return found


def _error(report: EncoderReport, problem: str) -> EncoderHandoffError:
    return EncoderHandoffError(f"items {list(report.item_indices)}: {problem}",
                               instance=report.instance)


def consumer_body(
    body: Mapping[str, Any], media: Sequence[tuple[int, int]], handoff: Handoff, *, rewrite: bool
) -> dict[str, Any]:
    """The consumer leg's body: ``body`` (items carrying their ``uuid``) with the parts the
    encoder reported metadata for rewritten (if ``rewrite``), and the handles as
    ``ec_transfer_params``. ``body`` itself is never changed (a retry starts from it again).

    Audio safety, as upstream: when the request has an audio item and some item cannot be
    rewritten, nothing is (an audio processor may consume other modalities' placeholders).
    """
    new = dict(body)
    if rewrite and handoff.items and _rewritable(body, media, handoff):
        messages = list(new["messages"])
        new["messages"] = messages
        copied: set[int] = set()
        for index, (m, p) in enumerate(media):
            item = handoff.items.get(index)
            if item is None or not item.metadata:
                continue
            if m not in copied:
                messages[m] = {**messages[m], "content": list(messages[m]["content"])}
                copied.add(m)
            part = messages[m]["content"][p]
            kind = EMBEDS_TYPE[part["type"]]
            messages[m]["content"][p] = {
                "type": kind, kind: {key: _flatten(value) for key, value in item.metadata.items()},
                "uuid": part["uuid"]}
    params: dict[str, Any] = dict(handoff.handles)
    ec_items = [{"mm_hash": item.engine_hash, "transfer_id": item.transfer_id}
                for _, item in sorted(handoff.items.items()) if item.transfer_id]
    if ec_items:
        params["ec_items"] = ec_items
    if params:
        new["ec_transfer_params"] = params
    return new


def _rewritable(body: Mapping[str, Any], media: Sequence[tuple[int, int]], handoff: Handoff) -> bool:
    kinds = [body["messages"][m]["content"][p]["type"] for m, p in media]
    if not _AUDIO.intersection(kinds):
        return True
    return all((item := handoff.items.get(i)) is not None and item.metadata
               for i in range(len(media)))


def _flatten(value: Any) -> Any:
    """One level: the encoder reports per-item grids as ``[[t, h, w]]``; a part wants
    ``[t, h, w]``."""
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return [x for v in value for x in v]
    return value


def encoder_transfer_params(consumer_zmq: str, transfer_ids: Sequence[str]) -> dict[str, Any]:
    """What an encoder sub-request carries for a push (Mooncake) consumer: where to push, and
    one transfer id per item, by position (the engine may rehash the uuids: no mm_hash here)."""
    return {"consumer_zmq": consumer_zmq,
            "ec_items": [{"transfer_id": tid} for tid in transfer_ids]}
