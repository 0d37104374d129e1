"""Each model's routing state in this process, and the pool a request's model name leads to.

The model registry (``_models``) says which instances serve which name; this object owns what
routing a model needs on top of that: one ``ModelRoute`` per pool, each with its own encoder
cursor and prefill and decode slot cursors on its own counters (``Roster.models`` gives the
slot, shared by the workers of ``epd-trio serve``; ``EPD_GLOBAL_CURSOR`` takes a Redis key per
model), its own policies (a model table may set them), and its own cap on requests in flight.
So seed 1's global encoder cursor and seed 2's flat interleaved counters hold per model, and
another model's traffic never moves them (production-stack #915: one counter shared by every
model skewed each model's spread). The loads stay per slot, shared by every pool an instance
is in: an instance serving two names is one engine, and its load counts once.

It follows the roster like the rest of the request path (``follow``, from ``Proxy.sync``), and
resolves each request's name with one dictionary read on the common path (``resolve``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import replace
from functools import partial
from typing import Any

from ._admission.gate import Admission
from ._core.config import Settings
from ._core.counters import PoolCounters
from ._core.errors import ModelUnavailable, NoInstance
from ._core.health import Registry
from ._core.policies import Balance, StagePolicy
from ._core.roster import Roster
from ._models.catalog import AdapterOf, Catalog, adapters_of
from ._models.choice import WeightedTurns, sticky_choice
from ._models.pools import ANY_POOL, Pool, pending, pools_of
from ._models.tables import Alias, Tables
from ._state.cursors import EncoderCursor, Follow, SlotCursor
from ._state.loads import DECODE_TOKENS, Loads

log = logging.getLogger("epd_trio")

#: The global cursor of a model's pool at a stage: its position for ``n`` slots, or None.
TakeGlobal = Callable[[str, str, int], Awaitable[int | None]]


class ModelRoute:
    """One model's pool and what routes over it: its cursors, policies and cap."""

    __slots__ = ("admission", "decodes", "encoders", "hinted", "max_batch", "model", "pool",
                 "precise", "prefills", "settings")

    def __init__(self, model: str, settings: Settings, *, encoders: EncoderCursor,
                 prefills: SlotCursor, decodes: SlotCursor, admission: Admission | None,
                 kv: bool) -> None:
        self.model = model
        #: The proxy's settings with the model table's own routing settings over them.
        self.settings = settings
        self.encoders, self.prefills, self.decodes = encoders, prefills, decodes
        self.admission = admission
        self.pool = Pool(model, {}, frozenset())
        policies = {"prefill": settings.prefill_policy, "decode": settings.decode_policy}
        #: The stages routed on the KV index, and whether a policy wants a prompt hint.
        self.precise = frozenset(stage for stage, name in policies.items()
                                 if name == "precise_cache_aware" and kv)
        self.hinted = bool(self.precise) or "cache_aware" in policies.values()
        self.max_batch = settings.encoder_max_batch

    def needs(self, stage: str) -> bool:
        """Whether a request of this model has a ``stage`` leg (see ``_models/pools``)."""
        return stage in self.pool.needs


class ModelPools:
    """The routes of every model pool of this process (see the module)."""

    def __init__(
        self, settings: Settings, tables: Tables, counters: PoolCounters, *, loads: Loads,
        registry: Registry, follow: Follow | None = None, take: TakeGlobal | None = None,
        kv: bool = False,
    ) -> None:
        self._settings = settings
        self._tables = tables
        self._counters = counters
        self._loads = loads
        self._registry = registry
        self._follow = follow
        self._take = take
        self._kv = kv
        #: Every model's route, kept across roster versions (its cursors stand where they were).
        self._routes: dict[str, ModelRoute] = {}
        #: The routes a client may name (``ANY_POOL``'s is ``any_route``), for this roster.
        self.by_name: dict[str, ModelRoute] = {}
        self.any_route: ModelRoute | None = None
        self.catalog = Catalog({}, tables.aliases)
        self._turns = {name: WeightedTurns(alias.weights) for name, alias in tables.aliases.items()}
        #: Each alias pick, by ``(alias, target)`` (the metrics' feed reads it).
        self.on_pick: Callable[[str, str], None] | None = None
        self._full_logged = False

    # -- following the roster ------------------------------------------------------------------
    def follow(self, roster: Roster) -> None:
        """A new roster version: each pool's instance lists and epochs, in one step."""
        pools = pools_of(roster, self._tables.pools)
        version = roster.version
        by_name: dict[str, ModelRoute] = {}
        epochs = roster.pool_epochs
        for index, model in enumerate(roster.models):
            pool = pools.get(model)
            if pool is None:
                continue
            route = self._routes.get(model)
            if route is None:
                route = self._routes[model] = self._route(model, index)
            route.pool = pool
            for stage, cursor in (("encode", route.encoders), ("prefill", route.prefills),
                                  ("decode", route.decodes)):
                cursor.update(pool.of(stage), epochs.get((model, stage), (0, 0)), version)
            by_name[model] = route
        if len(by_name) < len(pools) and not self._full_logged:
            self._full_logged = True
            log.error("more model names than the %d counter slots: %s get no pool",
                      len(roster.models), ", ".join(m for m in pools if m not in by_name))
        self.any_route = by_name.pop(ANY_POOL, None)
        self.by_name = by_name
        named = {m: r.pool for m, r in by_name.items()}
        self.catalog = Catalog(
            named | ({ANY_POOL: self.any_route.pool} if self.any_route is not None else {}),
            self._tables.aliases, pending(roster),
            adapters_of(named, self._tables.adapters), self._settings.lora_load)

    def _route(self, model: str, index: int) -> ModelRoute:
        table = self._tables.pools.get(model)
        settings = (self._settings if table is None or not table.settings
                    else replace(self._settings, **table.settings))
        take = self._take
        counters, loads, follow = self._counters, self._loads, self._follow

        def cursor_args(stage: str) -> dict[str, Any]:
            return {"counter": counters.counter(index, stage),
                    "policy": stage_policy(settings, stage),
                    "loads": partial(loads.read, stage), "follow": follow,
                    "global_cursor": None if take is None else partial(take, model, stage)}

        admission = None
        if table is not None and table.max_inflight is not None:
            admission = Admission(table.max_inflight, settings.admission_timeout,
                                  limit=f"model {model!r}'s limit of {{cap}} requests "
                                  "(its table's max_inflight)")
        return ModelRoute(
            model, settings, encoders=EncoderCursor((), **cursor_args("encode")),
            prefills=SlotCursor((), **cursor_args("prefill")),
            decodes=SlotCursor((), **cursor_args("decode"),
                               sizes=(partial(loads.read, DECODE_TOKENS)
                                      if settings.size_tiebreak else None)),
            admission=admission, kv=self._kv)

    # -- one request ---------------------------------------------------------------------------
    def resolve(self, name: str | None, *, session: str | None = None,
                allowed: Collection[str] | None = None,
                ) -> tuple[ModelRoute, str | None, AdapterOf | None]:
        """The route of the pool ``name`` leads to, the name every leg must carry instead of
        the client's, if any (an alias's target; the one model, for a body without
        ``model``), and the LoRA adapter the request names, if it does (its legs then go only
        to the instances that hold it); ``ModelNotFound`` (vLLM's 404), a 400 for a missing
        name among several models. ``session``: the sticky header's value."""
        if allowed is None and name is not None:
            route = self.by_name.get(name)
            if route is not None:
                return route, None, None  # the common path: one dictionary read
        asked = name
        if name is None:
            name = self.catalog.default()
            if allowed is not None and name not in allowed:
                name = next((m for m in self.catalog.models if m in allowed), name)
        found = self.catalog.find(name, allowed)
        adapter: AdapterOf | None = None
        if isinstance(found, Alias):
            name = self._pick(found, session)
            adapter = self.catalog.adapters.get(name) if name not in self.by_name else None
            pool_name = name if adapter is None else adapter.pool.model
        elif isinstance(found, AdapterOf):
            adapter, pool_name = found, found.pool.model
        else:
            pool_name = found.model
        route = self.by_name.get(pool_name) or self.any_route
        if route is None:  # a table's model whose counters had no slot (logged)
            raise NoInstance(f"model {pool_name!r} has no routing state (too many models)")
        leg = name if adapter is not None else pool_name
        return route, (None if leg in (asked, ANY_POOL) else leg), adapter

    def _pick(self, alias: Alias, session: str | None) -> str:
        """An alias's target among those that can serve now (``_models/choice``)."""
        eligible = [self._servable(target) for target in alias.names]
        if session is not None:
            index = sticky_choice(session, alias.names, alias.weights, eligible)
        else:
            index = self._turns[alias.name].next(eligible)
        if index is None:
            raise ModelUnavailable(alias.name, "decode", what="alias")
        target = alias.names[index]
        if self.on_pick is not None:
            self.on_pick(alias.name, target)
        return target

    def _servable(self, name: str) -> bool:
        """Whether a model or adapter name can serve now (an alias's target): its pool is
        complete, and an adapter is held on a live instance of each stage it needs (or may
        be loaded)."""
        route = self.by_name.get(name)
        if route is not None:
            return self.complete(route.pool)
        adapter = self.catalog.adapters.get(name)
        if adapter is None or not self.complete(adapter.pool):
            return False
        return (self._settings.lora_load and adapter.table is not None) or all(
            self.holds(adapter.pool, adapter.name, stage) for stage in ("prefill", "decode")
            if stage in adapter.pool.needs)

    def holds(self, pool: Pool, adapter: str, stage: str) -> bool:
        """Whether a live instance of ``stage`` in ``pool`` holds ``adapter``."""
        holders, usable = pool.holders(adapter), self._registry.usable(stage)
        return any(inst.url in holders and usable(inst) for inst in pool.of(stage))

    def live(self, pool: Pool, stage: str) -> bool:
        """Whether ``pool`` has a live instance of ``stage`` now."""
        usable = self._registry.usable(stage)
        return any(usable(inst) for inst in pool.of(stage))

    def complete(self, pool: Pool) -> bool:
        """Whether every stage ``pool`` needs has a live instance now (what ``GET /v1/models``
        lists and ``epd_trio_model_pool_complete`` reports)."""
        return all(self.live(pool, stage) for stage in pool.needs)

    def listing(self, allowed: Collection[str] | None = None) -> dict[str, Any]:
        """``GET /v1/models`` from what the instances said (no call made)."""
        return self.catalog.listing(self.complete, allowed)


def stage_policy(settings: Settings, stage: str) -> StagePolicy:
    """The policy ``settings`` give ``stage`` (``EPD_<STAGE>_POLICY`` and the cache knobs);
    with a shared state store, ``cache_aware`` places what it has not seen alike on every
    replica (``StagePolicy.placement``)."""
    return StagePolicy(getattr(settings, f"{stage}_policy"),
                       Balance(settings.cache_balance_abs, settings.cache_balance_rel),
                       cache_threshold=settings.cache_threshold, cache_size=settings.cache_size,
                       placement=settings.state_url is not None)
