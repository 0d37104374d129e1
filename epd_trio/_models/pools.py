"""The pool of each model: which instances of each role serve it, derived from the roster.

A pool is not kept anywhere: it is a function of the roster (its members, what each said it
serves, and what each registration declared) and of the model tables, so every worker of
``epd-trio serve`` that holds the same roster routes over the same pools. The rules:

- a member serves the names its ``/v1/models`` listed (every entry's base name), else those its
  registration declared; one that answered 404 serves any name in its role; one that never
  answered serves nothing;
- a model's pool holds, in roster order, each member that serves its name; a model table pins
  its instances to it, and a pinned instance that does not list the name is left out (the
  learner logs it once);
- a member that serves any name is in every pool of its role, and in ``ANY_POOL``, which takes
  the names no pool lists;
- a model needs a stage when its pool has members there, when its table names instances for
  it, or (without a table) when some member of that stage has not answered yet: so a fleet
  whose encoders are still starting refuses media with a 503 naming the stage, as it did
  before pools, rather than send it to prefill unencoded.

Each pool has its own counters (its index in ``Roster.models`` names their slot) and epochs:
``with_pool_epochs`` computes them at every roster change, from the pool's own counter values,
the way ``_core/roster`` computes the roster's, so a pool's rotation continues where it stood
when an instance joins or leaves it, and every worker maps a counter value alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from .._core.names import STAGES
from .._core.roster import MAX_MODELS, Card, Member, Roster, Served
from .._core.routing import Epoch, Instance, rebase_epoch, slot_keys
from .cards import base_names
from .tables import PoolTable

#: The pool of the instances that serve any name (no ``/v1/models``), for the names no other
#: pool lists. Not a name a client can send as such: it is found only through the fallback.
ANY_POOL = "*"
#: A pool counter's value now: ``(model index, stage) -> value`` (no lock taken; the store's
#: change runs under it).
Peek = Callable[[int, str], int]


@dataclass(frozen=True, slots=True)
class Pool:
    """One model's instances by stage (roster order), and the stages the model needs."""

    model: str
    members: Mapping[str, tuple[Instance, ...]]
    needs: frozenset[str]
    #: The cards its instances list for it (the first one's, for ``GET /v1/models``).
    cards: tuple[Card, ...] = ()
    #: Its LoRA adapters (cards whose ``parent`` is this model): each one's card and the URLs
    #: of the pool's instances that hold it (an adapter request goes only to those).
    adapters: Mapping[str, tuple[Card, frozenset[str]]] = field(default_factory=dict)

    def of(self, stage: str) -> tuple[Instance, ...]:
        return self.members.get(stage, ())

    def holders(self, adapter: str) -> frozenset[str]:
        """The URLs of the pool's instances that hold ``adapter`` (none: an empty set)."""
        found = self.adapters.get(adapter)
        return frozenset() if found is None else found[1]


def names_of(member: Member, served: Mapping[str, Served]) -> tuple[str, ...] | None:
    """The base names ``member`` serves: its answer's, else its registration's; None for any
    name (a 404), () for none (it never answered and declared nothing)."""
    if member.url in served:
        cards = served[member.url]
        return None if cards is None else base_names(cards)
    return member.models


def pools_of(roster: Roster, tables: Mapping[str, PoolTable]) -> dict[str, Pool]:
    """Every model's pool (see the module), the tables' models first, then the learned ones
    in order of appearance, then ``ANY_POOL`` when some member serves any name."""
    names: dict[str, None] = dict.fromkeys(tables)
    served_by: list[tuple[Member, tuple[str, ...] | None]] = []
    unanswered: set[str] = set()
    for member in roster.members:
        found = names_of(member, roster.served)
        served_by.append((member, found))
        if found is None:
            continue
        if not found and member.url not in roster.served:
            unanswered.add(member.stage)
        names.update(dict.fromkeys(found))
    if any(found is None for _, found in served_by):
        names[ANY_POOL] = None
    pools = {}
    for model in names:
        table = tables.get(model)
        members: dict[str, list[Instance]] = {stage: [] for stage in STAGES}
        cards: list[Card] = []
        for member, found in served_by:
            if found is None or (model in found and (table is None or table.pins(member)
                                                     or not _pinned_elsewhere(member, tables))):
                if model == ANY_POOL and found is not None:
                    continue
                members[member.stage].append(member.instance)
                cards += [c for c in roster.served.get(member.url) or () if c.id == model]
        needs = {stage for stage, found_here in members.items() if found_here}
        needs |= table.roles() if table is not None else unanswered
        pools[model] = Pool(model, {s: tuple(m) for s, m in members.items()},
                            frozenset(needs), tuple(cards),
                            _adapters(model, members, roster.served))
    return pools


def _adapters(model: str, members: Mapping[str, list[Instance]],
              served: Mapping[str, Served]) -> dict[str, tuple[Card, frozenset[str]]]:
    """The LoRA adapters of ``model``'s pool: every card with ``parent`` == ``model`` that an
    instance of the pool lists, with the instances that list it (the first card kept)."""
    cards: dict[str, Card] = {}
    holders: dict[str, set[str]] = {}
    for instances in members.values():
        for instance in instances:
            for card in served.get(instance.url) or ():
                if card.parent == model:
                    cards.setdefault(card.id, card)
                    holders.setdefault(card.id, set()).add(instance.url)
    return {name: (card, frozenset(holders[name])) for name, card in cards.items()}


def _pinned_elsewhere(member: Member, tables: Mapping[str, PoolTable]) -> bool:
    """Whether some other table pins ``member``: an instance the operator placed in one
    model's table serves another name it lists only if that name's table pins it too, or has
    no table (then what it learned decides)."""
    return any(table.pins(member) for table in tables.values())


def with_pool_epochs(
    old: Roster, new: Roster, tables: Mapping[str, PoolTable], peek: Peek,
    offset: Callable[[int], int] | None = None,
) -> Roster:
    """``new`` with what the pools need: answers of members that left dropped, every pool's
    model given its counter slot (``Roster.models``, append-only, at most ``MAX_MODELS``), and
    each pool whose slots changed given the epoch that continues its rotation; its version
    bumped when a pool changed and nothing else bumped it (a new answer alone).

    One function for every store's changes (``_membership``, ``_replicas``): the pools are
    derived the same way everywhere. With ``offset`` (replicas sharing a store), a pool whose
    slots changed starts at ``offset(slot count)`` instead, as ``reseeded`` does for a stage:
    replicas that see one change at about the same time must not send their next requests to
    the same instances in lockstep (a pool that had none would otherwise start at slot 0 in
    every replica)."""
    urls = {m.url for m in new.members}
    served = new.served
    if any(url not in urls for url in served):
        served = {url: cards for url, cards in served.items() if url in urls}
        new = replace(new, served=served)
    before, after = pools_of(old, tables), pools_of(new, tables)
    models = list(new.models)
    models += [m for m in after if m not in new.models][:MAX_MODELS - len(models)]
    epochs: dict[tuple[str, str], Epoch] = dict(new.pool_epochs)
    changed = False
    for index, model in enumerate(models):
        pool, was = after.get(model), before.get(model)
        for stage in STAGES:
            dp = stage != "encode"
            now_keys = slot_keys(pool.of(stage) if pool else (), dp)
            old_keys = slot_keys(was.of(stage) if was else (), dp)
            if now_keys != old_keys:
                changed = True
                epochs[(model, stage)] = (
                    rebase_epoch(epochs.get((model, stage), (0, 0)), old_keys, now_keys,
                                 peek(index, stage)) if offset is None
                    else (peek(index, stage), offset(len(now_keys)) if now_keys else 0))
    moved = changed or new.served != old.served or tuple(models) != old.models
    if not moved and tuple(models) == new.models and epochs == new.pool_epochs:
        return new
    if moved and new.version == old.version:
        # An answer alone changed a pool (or a card): the workers must follow it too.
        new = replace(new, version=old.version + 1)
    return replace(new, models=tuple(models), pool_epochs=epochs)


def pending(roster: Roster) -> str | None:
    """Why names no pool lists may be served soon (``Catalog.pending``), or None: no instance
    at all yet, or none that has said what it serves (a proxy starting beside its engines).
    Once one has, a name nobody serves is vLLM's 404: an instance down for good must not
    turn every unknown name into a 503."""
    if not roster.of("decode"):
        return "no decode instance is configured or registered yet"
    if not roster.served and not any(m.models for m in roster.members):
        return (f"none of the {len(roster.members)} instance(s) has said what it serves yet "
                "(GET /v1/models)")
    return None


def reloaded_adapters(before: Mapping[str, Served],
                      after: Mapping[str, Served]) -> list[tuple[str, str]]:
    """``(URL, adapter)`` for each adapter an instance listed in one roster and not the same
    in the other: it appeared, went, or its ``root`` changed. Whatever the KV index holds of
    it there may be another adapter's blocks under the same name (vllm #42125): drop them."""
    found = []
    for url in before.keys() & after.keys():
        old = {c.id: c.root for c in before[url] or () if c.parent is not None}
        new = {c.id: c.root for c in after[url] or () if c.parent is not None}
        found += [(url, name) for name in sorted(old.keys() | new.keys())
                  if old.get(name, "\0") != new.get(name, "\0")]
    return found


def set_served(roster: Roster, answers: Mapping[str, Served]) -> Roster:
    """``roster`` with the instances' new answers (``_models/learner``); the same roster when
    nothing changed (the version moves in ``with_pool_epochs``, if a pool did)."""
    merged = dict(roster.served)
    known = {m.url for m in roster.members}
    for url, served in answers.items():
        if url in known:
            merged[url] = served
    if merged == roster.served:
        return roster
    return replace(roster, served=merged)


def unserved_pins(roster: Roster, tables: Mapping[str, PoolTable]) -> list[tuple[str, str]]:
    """``(model, URL)`` for each instance a table pins to a model its answer does not list:
    out of rotation for that model (one log line each, said by the learner)."""
    found = []
    for model, table in tables.items():
        for member in roster.members:
            names = names_of(member, roster.served)
            if (table.pins(member) and member.url in roster.served and names is not None
                    and model not in names):
                found.append((model, member.url))
    return found

