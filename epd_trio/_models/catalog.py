"""A request's model name resolved, and the ``GET /v1/models`` listing, on the pools of now.

The order a name is looked up in, the first match wins: a pool of that name; an alias (its
target picked by ``choice``); a LoRA adapter (its base's pool, on the instances that hold it);
``ANY_POOL`` when some instance serves any name; else vLLM's own 404 (``ModelNotFound``),
before any leg runs. A tenant with a model list gets the same 404 for
a name outside it. A body without ``model`` goes to the one model served (vLLM's behaviour);
with several, it is a 400 naming ``model``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._core.errors import BadRequest, ModelNotFound, NoInstance
from .cards import card_json
from .pools import ANY_POOL, Pool
from .tables import AdapterTable, Alias


@dataclass(frozen=True, slots=True)
class AdapterOf:
    """A name that is a LoRA adapter of a pool's model: its requests go to that pool, on every
    leg but encode only to the instances that hold it."""

    name: str
    pool: Pool
    #: Its ``[adapters."X"]`` table, when the proxy may load it (None: only learned).
    table: AdapterTable | None = None


@dataclass(frozen=True, slots=True)
class Catalog:
    """The pools, aliases and adapters of one roster version (rebuilt when the roster
    changes)."""

    pools: Mapping[str, Pool]
    aliases: Mapping[str, Alias]
    #: Why a name no pool lists may still be served soon (no instance yet, or some that have
    #: not said what they serve): such a name gets that 503, not a 404 that may be false.
    pending: str | None = None
    #: The adapters a client may name: every one a pool's instances list, and the configured
    #: ones whose base has a pool (``adapters_of``).
    adapters: Mapping[str, AdapterOf] = field(default_factory=dict)
    #: Whether configured adapters not yet loaded anywhere are listed (``EPD_LORA_LOAD``).
    loadable: bool = False

    @property
    def models(self) -> list[str]:
        """The names of the pools a client may name (``ANY_POOL`` is not one)."""
        return [name for name in self.pools if name != ANY_POOL]

    def default(self) -> str:
        """The model a body without ``model`` goes to: the one base model served (or the
        any-name pool when no name is known); a 400 naming ``model`` when there are several."""
        names = self.models
        if len(names) == 1:
            return names[0]
        if not names and ANY_POOL in self.pools:
            return ANY_POOL
        if not names:
            raise NoInstance(self.pending or "no instance serves any model")
        shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        raise BadRequest(f"'model' is required: this proxy serves several models ({shown})")

    def find(self, name: str, allowed: Collection[str] | None = None) -> Pool | Alias | AdapterOf:
        """The pool or alias ``name`` leads to (see the module); ``ModelNotFound`` else."""
        if allowed is not None and name not in allowed:
            raise ModelNotFound(name)
        found: Pool | Alias | AdapterOf | None = (self.pools.get(name) if name != ANY_POOL
                                                  else None)
        if found is None:
            found = (self.aliases.get(name) or self.adapters.get(name)
                     or self.pools.get(ANY_POOL))
        if found is None:
            if self.pending is not None:
                raise NoInstance(f"no instance serves {name!r} yet: {self.pending}")
            raise ModelNotFound(name)
        return found

    def listing(self, servable: Callable[[Pool], bool],
                allowed: Collection[str] | None = None) -> dict[str, Any]:
        """``GET /v1/models``: each name a client may send and that can serve now, once, in
        vLLM's list shape: the models with a complete live pool (their instances' own card),
        then the aliases not hidden that have such a target."""
        data = []
        live: dict[str, Pool] = {}
        for name in self.models:
            pool = self.pools[name]
            if not servable(pool):
                continue
            live[name] = pool
            if allowed is None or name in allowed:
                data.append(card_json(pool.cards[0]) if pool.cards
                            else _plain_card(name, owned_by="vllm"))
        for name, adapter in self.adapters.items():
            if adapter.pool.model not in live or (allowed is not None and name not in allowed):
                continue
            if name in adapter.pool.adapters:
                data.append(card_json(adapter.pool.adapters[name][0]))
            elif self.loadable and adapter.table is not None:  # loaded on its first request
                data.append({**_plain_card(name, owned_by="vllm"), "root": adapter.table.path,
                             "parent": adapter.table.base})
        for name, alias in self.aliases.items():
            targets = [live[t] for t in alias.names if t in live]
            if alias.hidden or not targets or (allowed is not None and name not in allowed):
                continue
            lengths = [c.max_model_len for pool in targets for c in pool.cards[:1]
                       if c.max_model_len is not None]
            data.append({**_plain_card(name, owned_by="epd-trio"),
                         "max_model_len": min(lengths) if lengths else None})
        return {"object": "list", "data": data}


def adapters_of(pools: Mapping[str, Pool],
                tables: Mapping[str, AdapterTable]) -> dict[str, AdapterOf]:
    """Every adapter a client may name: those the pools' instances list (each in its base's
    pool), then the configured ones whose base has a pool; an adapter two bases list is the
    first pool's."""
    found: dict[str, AdapterOf] = {}
    for pool in pools.values():
        for name in pool.adapters:
            found.setdefault(name, AdapterOf(name, pool, tables.get(name)))
    for name, table in tables.items():
        if name not in found and table.base in pools:
            found[name] = AdapterOf(name, pools[table.base], table)
    return found


def _plain_card(name: str, *, owned_by: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": owned_by, "root": None,
            "parent": None, "max_model_len": None}
