"""An instance's ``GET /v1/models`` answer, read as what it serves.

vLLM lists one card per served name (``vllm serve --served-model-name a b``: two cards, each
with ``root`` the model path and ``parent`` None) and one per LoRA adapter (``parent`` its base
name). Every entry counts, not only the first: SGLang's gateway read only ``data[0]``, so a
second served name or an adapter was invisible (smg PR #756).

Three outcomes, never an "unknown" model: a model list (the cards), a 404 (the server has no
such route, as some OpenAI-compatible servers do: it serves any name in its role), or no
answer (refused, timed out, a 5xx, anything that is not a model list), which changes nothing:
an instance that never answered serves nothing until it does (sglang #37554 registered such a
worker under "unknown" for good), and one that answered before keeps its last answer (its
health is the prober's business, not this).
"""

from __future__ import annotations

from typing import Any

import orjson

from .._core.roster import Card, Served

#: The most cards one answer may hold: a bound on what a misbehaving server costs.
MAX_CARDS = 4096


class NoAnswer(ValueError):
    """The answer is not a model list (its reason, for the log line)."""


def served_from(status: int, content: bytes) -> Served:
    """What an instance serves, from its ``/v1/models`` status and body: its cards, or None
    (a 404: any name). ``NoAnswer`` says why anything else is no answer."""
    if status == 404:
        return None
    if status != 200:
        raise NoAnswer(f"HTTP {status}")
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        raise NoAnswer("not JSON") from None
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise NoAnswer("not a model list (no 'data' list)")
    if len(entries) > MAX_CARDS:
        raise NoAnswer(f"more than {MAX_CARDS} models")
    cards: dict[str, Card] = {}
    for entry in entries:
        card = _card(entry)
        if card is not None:
            cards.setdefault(card.id, card)
    return tuple(cards.values())


def _card(entry: Any) -> Card | None:
    """One entry as a card; None for an entry without a usable ``id`` (skipped, not fatal)."""
    if not isinstance(entry, dict):
        return None
    name = entry.get("id")
    if not isinstance(name, str) or not name or len(name) > 256:
        return None
    root, parent, length = entry.get("root"), entry.get("parent"), entry.get("max_model_len")
    return Card(name, root if isinstance(root, str) else None,
                parent if isinstance(parent, str) and parent else None,
                length if isinstance(length, int) and not isinstance(length, bool) else None)


def base_names(served: Served) -> tuple[str, ...]:
    """The served names of ``served``'s cards (adapters left out); () for any name."""
    return () if served is None else tuple(c.id for c in served if c.parent is None)


def card_json(card: Card, *, created: int = 0, owned_by: str = "vllm") -> dict[str, Any]:
    """A card as ``GET /v1/models`` lists it, with vLLM's fields."""
    return {"id": card.id, "object": "model", "created": created, "owned_by": owned_by,
            "root": card.root, "parent": card.parent, "max_model_len": card.max_model_len}
