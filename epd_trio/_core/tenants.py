"""Tenants: who a request is, what it may ask of the proxy, and what it costs in tokens.

Why tables and not flags: a tenant is a bundle (its keys, its band, its share, its limits), and
operators write it once in the config file (``[tenants.NAME]``) or as the same tables in JSON
(``EPD_TENANTS``). A request's tenant is the one whose key it presents, else the one a header
names (``EPD_TENANT_HEADER``), else ``default`` (which takes a table like any other). A table
that does not parse stops start-up with one line naming it (``tenants.batch: weight ...``).

Priorities follow vLLM: a lower number is served first, 0 by default. A client may lower its
own priority with the body's ``priority`` (a larger number), never raise it above its
tenant's (the hand-off rule: what steers placement is the proxy's). The effective priority is
what every leg sends as vLLM's ``priority`` (dropped when 0: vLLM documents any other value as
an error on an engine without ``--scheduling-policy priority``).

Tokens: a request reserves its prompt estimate (about four characters a token) plus its
``max_tokens`` (or ``DEFAULT_MAX_TOKENS``) at admission, and settles on what it used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from .errors import BadRequest

#: The tenant of a request that names no known one.
DEFAULT_TENANT = "default"
#: The limits a table may set, by their setting names (also the names a 429 gives).
LIMIT_NAMES = ("max_inflight", "requests_per_minute", "tokens_per_minute")
#: Tokens reserved for the answer of a request that sets no ``max_tokens``.
DEFAULT_MAX_TOKENS = 1024
#: Characters per prompt token in the estimate (OpenAI's rule of thumb for English text).
CHARS_PER_TOKEN = 4
#: Tokens counted per media item in the estimate (an image is some hundreds of tokens).
TOKENS_PER_MEDIA_ITEM = 256
#: A weight's bounds: a share is relative, and an extreme ratio only costs turns of the queue.
MIN_WEIGHT, MAX_WEIGHT = 0.01, 1000.0
_KEYS = frozenset({"keys", "priority", "weight", "models", *LIMIT_NAMES})


@dataclass(frozen=True, slots=True)
class Tenant:
    """One table: a name, its keys, its band and share, and its limits (None: no limit)."""

    name: str
    keys: tuple[str, ...] = ()
    priority: int = 0
    weight: float = 1.0
    max_inflight: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    #: The model names (aliases included) it may use; None: any. A name outside it is
    #: answered as a model that does not exist.
    models: frozenset[str] | None = None

    def limit(self, name: str) -> int | None:
        return getattr(self, name)  # type: ignore[no-any-return]


def parse_tenants(raw: Any) -> tuple[Tenant, ...]:
    """The tenants of a config file's ``tenants`` tables, or of ``EPD_TENANTS`` (the same
    tables as a JSON object); ``ValueError`` with one line naming the bad table."""
    if isinstance(raw, str):
        try:
            raw = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"expected a JSON object of tables: {exc}") from None
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError("expected tables, one per tenant ({\"name\": {\"keys\": [...]}})")
    tenants = tuple(_tenant(str(name), table) for name, table in raw.items())
    owner: dict[str, str] = {}
    for tenant in tenants:
        for key in tenant.keys:
            if key in owner:
                raise ValueError(f"tenants.{tenant.name}: key {_masked(key)} also belongs to "
                                 f"tenants.{owner[key]}")
            owner[key] = tenant.name
    return tenants


def _tenant(name: str, table: Any) -> Tenant:
    where = f"tenants.{name}"
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"{where}: a tenant's name is letters, digits, '-' and '_'")
    if not isinstance(table, Mapping):
        raise ValueError(  # noqa: TRY004 (ConfigError is a ValueError)
            f"{where}: expected a table, got {type(table).__name__}")
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_KEYS))})")
    keys = table.get("keys", [])
    if isinstance(keys, str):
        keys = [keys]
    if not isinstance(keys, list) or not all(
            isinstance(k, str) and k and k.isascii() and k.isprintable() and " " not in k
            for k in keys):
        raise ValueError(f"{where}: keys must be a list of non-empty printable ASCII keys")
    priority = table.get("priority", 0)
    if not _is_int(priority):
        raise ValueError(f"{where}: priority must be an integer, got {priority!r}")
    weight = table.get("weight", 1)
    if (not isinstance(weight, int | float) or isinstance(weight, bool)
            or not MIN_WEIGHT <= weight <= MAX_WEIGHT):
        raise ValueError(f"{where}: weight must be a number from {MIN_WEIGHT:g} to "
                         f"{MAX_WEIGHT:g}, got {weight!r}")
    limits = {}
    for limit in LIMIT_NAMES:
        value = table.get(limit)
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"{where}: {limit} must be a positive integer, got {value!r}")
        limits[limit] = value
    models = table.get("models")
    if models is not None and (not isinstance(models, list) or not all(
            isinstance(m, str) and m for m in models)):
        raise ValueError(f"{where}: models must be a list of model names")
    return Tenant(name=name, keys=tuple(keys), priority=priority, weight=float(weight),
                  models=None if models is None else frozenset(models), **limits)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _masked(key: str) -> str:
    return key[:4] + "..." if len(key) > 8 else "..."


class TenantTable:
    """The tenants, looked up by key or by name; ``default`` is always there."""

    def __init__(self, tenants: tuple[Tenant, ...] = ()) -> None:
        self.by_name = {t.name: t for t in tenants}
        self.by_name.setdefault(DEFAULT_TENANT, Tenant(DEFAULT_TENANT))
        self.by_key = {key: t for t in tenants for key in t.keys}

    @property
    def keys(self) -> tuple[str, ...]:
        """Every tenant's keys: they join ``EPD_API_KEYS``."""
        return tuple(self.by_key)

    def resolve(self, api_key: str | None, named: str | None) -> Tenant:
        """The tenant whose key the request presents, else the one its header names, else
        ``default``. A tenant with keys is reached by its keys only: a header naming it is
        ignored, or any client of a plain ``EPD_API_KEYS`` key could take its band and spend
        its limits."""
        if api_key is not None:
            tenant = self.by_key.get(api_key)
            if tenant is not None:
                return tenant
        if named is not None:
            tenant = self.by_name.get(named.strip())
            if tenant is not None and not tenant.keys:
                return tenant
        return self.by_name[DEFAULT_TENANT]


def effective_priority(tenant: Tenant, body: Mapping[str, Any]) -> int:
    """The priority a request runs at: its tenant's, or the body's when that is lower (a
    larger number); a body asking for a higher one gets its tenant's."""
    asked = body.get("priority")
    if asked is None:
        return tenant.priority
    if not _is_int(asked):
        raise BadRequest("'priority' must be an integer")
    return max(tenant.priority, asked)


def with_priority(body: dict[str, Any], priority: int) -> dict[str, Any]:
    """``body`` carrying ``priority`` as every leg sends it: the field set, or left out when it
    is 0 (vLLM's default, and the only value vLLM documents for an engine without priority
    scheduling)."""
    if body.get("priority") == priority and priority != 0:
        return body
    out = {k: v for k, v in body.items() if k != "priority"}
    if priority:
        out["priority"] = priority
    return out


def prompt_estimate(body: Mapping[str, Any]) -> int:
    """The prompt's tokens, estimated from its text (and its media items) without a tokenizer."""
    chars, items = 0, 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for part in content:
                    if not isinstance(part, Mapping):
                        continue
                    if isinstance(part.get("text"), str):
                        chars += len(part["text"])
                    else:
                        items += 1
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        for entry in prompt:
            if isinstance(entry, str):
                chars += len(entry)
            elif isinstance(entry, list):
                chars += CHARS_PER_TOKEN * len(entry)  # token ids
            else:
                chars += CHARS_PER_TOKEN  # one token id of a flat list
    return math.ceil(chars / CHARS_PER_TOKEN) + TOKENS_PER_MEDIA_ITEM * items


def token_reservation(body: Mapping[str, Any]) -> int:
    """What a request reserves at admission: its prompt estimate plus its answer's bound."""
    answer = body.get("max_completion_tokens", body.get("max_tokens"))
    if not _is_int(answer) or answer < 0:
        answer = DEFAULT_MAX_TOKENS
    n = body.get("n", 1)
    return prompt_estimate(body) + answer * (n if _is_int(n) and n > 0 else 1)


def tokens_used(reserved_prompt: int, usage: tuple[int, int] | None, events: int) -> int:
    """What a finished request settles: its reported ``usage`` (prompt plus completion), else
    its prompt estimate plus the stream events it relayed (vLLM sends one per token), which is
    also what a cancelled request used."""
    if usage is not None:
        return usage[0] + usage[1]
    return reserved_prompt + events
