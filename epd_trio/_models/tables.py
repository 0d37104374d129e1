"""The ``[models."X"]`` and ``[aliases."X"]`` tables, checked and typed.

``_core/config`` reads the tables' shape and their instance lists (the flags' URL syntax, so
``Settings.listed`` and ``dns_names`` include them); the rest of each table is checked here,
once, with a ``ConfigError`` naming the table and the key (``models."llama".prefill_policy:
expected one of ...``), at start-up like every other setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._core.config import TABLE_ROLES, ConfigError, Settings, parse_setting
from .._core.discovery import DnsName
from .._core.roster import Member
from .._core.routing import Instance

#: The routing settings a model table may set for its own pool (each parsed as the setting).
POOL_SETTINGS = ("encode_policy", "prefill_policy", "decode_policy", "cache_balance_abs",
                 "cache_balance_rel", "cache_threshold", "cache_size", "size_tiebreak",
                 "encoder_max_batch")
_POOL_KEYS = frozenset({*TABLE_ROLES, *POOL_SETTINGS, "max_inflight"})
_ALIAS_KEYS = frozenset({"targets", "hidden"})


@dataclass(frozen=True, slots=True)
class PoolTable:
    """One ``[models."X"]`` table: the instances it pins to ``X`` by role, its own routing
    settings, and its cap on requests in flight."""

    name: str
    #: By role: the URLs (and DNS names' specs) the table lists.
    specs: Mapping[str, frozenset[str]]
    #: The routing settings it sets, parsed (the pool's own, over the proxy's).
    settings: Mapping[str, Any]
    max_inflight: int | None = None

    def pins(self, member: Member) -> bool:
        """Whether the table lists ``member`` in its role: by URL, or by the DNS name or
        selector that found it."""
        specs = self.specs.get(member.stage, frozenset())
        return member.url in specs or (member.source is not None and member.source in specs)

    def roles(self) -> frozenset[str]:
        """The stages the table names instances for: the model needs each of them."""
        return frozenset(role for role, specs in self.specs.items() if specs)


@dataclass(frozen=True, slots=True)
class Alias:
    """One ``[aliases."X"]`` table: its targets with their weights, and whether
    ``GET /v1/models`` lists it."""

    name: str
    targets: tuple[tuple[str, float], ...]
    hidden: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.targets)

    @property
    def weights(self) -> tuple[float, ...]:
        return tuple(weight for _, weight in self.targets)


@dataclass(frozen=True, slots=True)
class AdapterTable:
    """One ``[adapters."X"]`` table: the model it adapts, and where an instance reads it."""

    name: str
    base: str
    path: str


@dataclass(frozen=True, slots=True)
class Tables:
    """Every model, alias and adapter table of a configuration."""

    pools: Mapping[str, PoolTable]
    aliases: Mapping[str, Alias]
    adapters: Mapping[str, AdapterTable] = field(default_factory=dict)


#: A target's weight's bounds: a share is relative; 0 is a target turned off (not listed).
MAX_WEIGHT = 1_000_000.0


def parse_tables(settings: Settings) -> Tables:
    """The typed tables of ``settings``; ``ConfigError`` names the first bad one."""
    pools = {name: _pool(name, table) for name, table in settings.models.items()}
    aliases = {name: _alias(name, table) for name, table in settings.model_aliases.items()}
    adapters = {name: _adapter(name, table) for name, table in settings.adapters.items()}
    for name in adapters:
        if name in pools or name in aliases:
            raise ConfigError(f'adapters."{name}"', "is also a model's or an alias's name")
    if settings.lora_load and not adapters:
        raise ConfigError("EPD_LORA_LOAD", "needs adapters to load (EPD_ADAPTERS: "
                          '[adapters."NAME"] tables with base and path)')
    for name, alias in aliases.items():
        if name in pools:
            raise ConfigError(f'aliases."{name}"', "is also a model table's name: a name is "
                              "either a model or an alias")
        for target in alias.names:
            if target in aliases:
                raise ConfigError(f'aliases."{name}".targets', f"{target!r} is an alias: a "
                                  "target must be a model name (no chains)")
    return Tables(pools, aliases, adapters)


def _pool(name: str, table: Mapping[str, Any]) -> PoolTable:
    where = f'models."{name}"'
    unknown = sorted(set(table) - _POOL_KEYS)
    if unknown:
        raise ConfigError(where, f"unknown key {unknown[0]!r} (known: "
                          f"{', '.join(sorted(_POOL_KEYS))})")
    specs = {}
    for role in TABLE_ROLES:
        items: tuple[Instance | DnsName, ...] = table.get(role, ())
        specs[role] = frozenset(i.url if isinstance(i, Instance) else i.spec for i in items)
    if not any(specs.values()):
        # A table that lists nothing would only restate what is learned: say so, rather
        # than accept a typo'd role name as a pool with no instance.
        raise ConfigError(where, "lists no instance (encode, prefill or decode)")
    settings = {key: parse_setting(key, table[key], f"{where}.{key}")
                for key in POOL_SETTINGS if key in table}
    cap = table.get("max_inflight")
    if cap is not None:
        cap = parse_setting("max_inflight", cap, f"{where}.max_inflight")
    return PoolTable(name, specs, settings, cap)


def _adapter(name: str, table: Mapping[str, Any]) -> AdapterTable:
    where = f'adapters."{name}"'
    unknown = sorted(set(table) - {"base", "path"})
    if unknown:
        raise ConfigError(where, f"unknown key {unknown[0]!r} (known: base, path)")
    values = []
    for key in ("base", "path"):
        value = table.get(key)
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{where}.{key}", f"expected a non-empty string, got {value!r}")
        values.append(value.strip())
    return AdapterTable(name, *values)


def _alias(name: str, table: Mapping[str, Any]) -> Alias:
    where = f'aliases."{name}"'
    unknown = sorted(set(table) - _ALIAS_KEYS)
    if unknown:
        raise ConfigError(where, f"unknown key {unknown[0]!r} (known: targets, hidden)")
    raw = table.get("targets")
    if isinstance(raw, list | tuple) and all(isinstance(t, str) for t in raw):
        raw = dict.fromkeys(raw, 1)  # a plain list: equal weights
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError(f"{where}.targets", "expected model names with their weights "
                          '({"llama-v1" = 90, "llama-v2" = 10}) or a list of names')
    targets = []
    for target, weight in raw.items():
        if (not isinstance(target, str) or not target or isinstance(weight, bool)
                or not isinstance(weight, int | float) or not 0 <= weight <= MAX_WEIGHT):
            raise ConfigError(f"{where}.targets", f"{target!r}: a weight is a number from 0 "
                              f"to {MAX_WEIGHT:g}, got {weight!r}")
        if weight > 0:
            targets.append((target, float(weight)))
    if not targets:
        raise ConfigError(f"{where}.targets", "every weight is 0: no target to send to")
    hidden = table.get("hidden", False)
    if not isinstance(hidden, bool):
        raise ConfigError(f"{where}.hidden", f"expected true or false, got {hidden!r}")
    return Alias(name, tuple(targets), hidden)
