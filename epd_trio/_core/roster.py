"""The instance roster: which instances exist, by role, static and self-registered alike (pure).

vLLM instances started with a proxy URL register themselves (``POST /instances`` every 30 s,
``DELETE /instances`` when they stop; docs/discussion/protocol.md "Instance registration"). The statically
configured instances and the registered ones live in one ``Roster``, an immutable snapshot that
routing reads: each change makes a new roster with a higher ``version``, and with a new
``Epoch`` per routing role, so that the round-robin continues where it stood instead of
restarting at instance 0 (``_routing.rebase_position``). The epochs are computed here, once,
from the routing counters' values at the moment of the change, and travel with the roster:
every worker process of ``epd-trio serve`` then maps the same counter value to the same slot.

Nothing here does I/O or reads a clock: callers pass ``now`` (``time.monotonic()``, which is
shared by the processes of one machine) and the counters' values. Where the roster is kept
(one process, or shared memory for several) is ``_state/roster_store.py``'s business.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from .discovery import Discovered, DnsName, is_dns_url, parse_dns_url
from .errors import BadRequest, Conflict, RegistrationRefused
from .moriio import MoriioPeer, MoriioRegistration
from .names import ROLES, STAGE_OF_ROLE, STAGES
from .rewrite import json_object
from .routing import (
    MAX_DP_SIZE,
    Epoch,
    Instance,
    KvEventEndpoints,
    check_zmq_endpoint,
    rebase_epoch,
    slot_keys,
)
from .urls import echo

#: The most model names the roster keeps a counter slot for (``Roster.models``): far above any
#: fleet, low enough that the per-model counters fit one small shared-memory area.
MAX_MODELS = 256


@dataclass(frozen=True, slots=True)
class Card:
    """One entry of an instance's ``GET /v1/models``, as vLLM writes it: a served name
    (``parent`` None) or a LoRA adapter of one (``parent`` its base name)."""

    id: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


#: What one instance serves, as it last said: its cards, or None when it has no
#: ``/v1/models`` route at all (a 404: it serves any name in its role). An instance that never
#: answered has no entry in ``Roster.served``, and serves nothing.
Served = tuple[Card, ...] | None


@dataclass(frozen=True, slots=True)
class Member:
    """One instance in the roster."""

    instance: Instance
    #: As configured or registered: ``encode``, ``prefill``, ``decode`` or ``prefill_decode``.
    role: str
    #: From the configuration (never forgotten for silence) rather than registered.
    static: bool = False
    #: Encoder-cache receive addresses (Mooncake EC consumers), kept and listed, not used here.
    ec_zmq_addrs: tuple[str, ...] = ()
    #: ``time.monotonic()`` of the last registration (0 for static instances).
    registered_at: float = 0.0
    #: Registered over ZMQ by vLLM's MoRIIO connector: its address and parallel sizes.
    moriio: MoriioPeer | None = None
    #: Found by a discovery source (``_core/discovery``), named here: the ``dns+``/``dnssrv+``
    #: URL, or ``kubernetes <role> <selector>``. Like a static instance, it belongs to each
    #: replica of the proxy (each discovers on its own) and is never forgotten for silence: it
    #: leaves when its source stops listing it (``replace_source``).
    source: str | None = None
    #: The served names its registration declared (``"models": [...]``): what it serves until
    #: its own ``/v1/models`` answers, which wins.
    models: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return self.instance.url

    @property
    def stage(self) -> str:
        """The stage it serves."""
        return STAGE_OF_ROLE[self.role]


@dataclass(frozen=True, slots=True)
class Roster:
    """An immutable snapshot of every instance, with the routing epochs that go with it."""

    version: int = 0
    #: Static instances first (in configuration order), then registered ones in order of arrival.
    members: tuple[Member, ...] = ()
    epochs: Mapping[str, Epoch] = field(default_factory=lambda: dict.fromkeys(STAGES, (0, 0)))
    #: The MoRIIO transfer mode the first MoRIIO registration fixed (``READ``/``WRITE``), for the
    #: life of the proxy: prefill and decode must agree on it, so an instance with the other
    #: mode is refused.
    transfer_mode: str | None = None
    #: DNS names registered through ``POST /instances`` (``(role, dns+ URL)``), in order: the
    #: process that discovers resolves them like the configured ones (``_discovery/dns``).
    names: tuple[tuple[str, str], ...] = ()
    #: What each instance serves, by URL, as its ``/v1/models`` last answered
    #: (``_models/learner``); no entry: it has not answered yet, and serves nothing.
    served: Mapping[str, Served] = field(default_factory=dict)
    #: Every model name a pool was ever made for, in order of appearance: a model's index
    #: here is its routing counters' slot, the same in every worker (``_models/pools``).
    models: tuple[str, ...] = ()
    #: Each pool's epochs, by ``(model, stage)``: like ``epochs``, computed once at a change
    #: from that pool's own counters, so every worker maps a counter value alike.
    pool_epochs: Mapping[tuple[str, str], Epoch] = field(default_factory=dict)

    def of(self, stage: str) -> tuple[Instance, ...]:
        """The instances serving ``stage``, in routing order."""
        return tuple(m.instance for m in self.members if m.stage == stage)

    def find(self, url: str) -> Member | None:
        for member in self.members:
            if member.url == url:
                return member
        return None

    def moriio_peer(self, url: str) -> MoriioPeer | None:
        member = self.find(url)
        return None if member is None else member.moriio

    def to_bytes(self) -> bytes:
        return orjson.dumps({
            "version": self.version,
            "epochs": {role: list(epoch) for role, epoch in self.epochs.items()},
            "transfer_mode": self.transfer_mode,
            "names": [list(name) for name in self.names],
            "members": [
                {"url": m.url, "dp_size": m.instance.dp_size, "kv_events": kv_fields(m.instance),
                 "role": m.role, "static": m.static,
                 "ec_zmq_addrs": list(m.ec_zmq_addrs), "registered_at": m.registered_at,
                 "moriio": None if m.moriio is None else
                 [m.moriio.zmq_address, m.moriio.dp_size, m.moriio.tp_size],
                 "source": m.source, "models": list(m.models)}
                for m in self.members
            ],
            "served": {url: None if cards is None else
                       [[c.id, c.root, c.parent, c.max_model_len] for c in cards]
                       for url, cards in self.served.items()},
            "models": list(self.models),
            "pool_epochs": [[model, stage, *epoch]
                            for (model, stage), epoch in self.pool_epochs.items()],
        })

    @classmethod
    def from_bytes(cls, raw: bytes) -> Roster:
        data = orjson.loads(raw)
        return cls(
            version=data["version"],
            epochs={role: (k0, i0) for role, (k0, i0) in data["epochs"].items()},
            transfer_mode=data["transfer_mode"],
            names=tuple((role, spec) for role, spec in data.get("names", ())),
            members=tuple(
                Member(Instance(m["url"], m["dp_size"], kv_endpoints(m.get("kv_events"))),
                       m["role"], m["static"],
                       tuple(m["ec_zmq_addrs"]), m["registered_at"],
                       None if m["moriio"] is None else MoriioPeer(*m["moriio"]),
                       m.get("source"), tuple(m.get("models", ())))
                for m in data["members"]
            ),
            served={url: None if cards is None else tuple(Card(*card) for card in cards)
                    for url, cards in data.get("served", {}).items()},
            models=tuple(data.get("models", ())),
            pool_epochs={(model, stage): (k0, i0)
                         for model, stage, k0, i0 in data.get("pool_epochs", ())},
        )


def static_roster(
    encode: Iterable[Instance], prefill: Iterable[Instance], decode: Iterable[Instance]
) -> Roster:
    """Version 0: the configured instances (each worker process builds the same one)."""
    members = [Member(inst, role, static=True)
               for role, instances in (("encode", encode), ("prefill", prefill),
                                       ("decode", decode))
               for inst in instances]
    return Roster(members=tuple(members))


def layout_name(roster: Roster) -> str:
    """``E+P+D``, ``E+PD``, ``P+D``, ``PD``, or ``none`` while there is no decode-side instance."""
    if not roster.of("decode"):
        return "none"
    serving = "P+D" if roster.of("prefill") else "PD"
    return f"E+{serving}" if roster.of("encode") else serving


# -- registration bodies ------------------------------------------------------------------------
def parse_registration(raw: bytes, now: float) -> Member:
    """A ``POST /instances`` body as a ``Member``; ``BadRequest`` (400) says what is wrong.

    ``{"role": "encode"|"prefill"|"decode"|"prefill_decode", "url": "http://host:port",
    "dp_size": N (default 1), "ec_zmq_addrs": [...] (default []), "kv_events_endpoint":
    "tcp://host:port" and "kv_events_replay_endpoint" (both optional), "models": [...] (the
    served names, until its own ``/v1/models`` answers)}``. Other fields are ignored
    (a newer vLLM may send more). As vLLM's own proxy does, encoder-cache addresses are accepted
    only from EC consumers (``prefill``, ``prefill_decode``), one per DP rank.
    """
    body = json_object(raw)
    role, dp_size = _role_and_dp_size(body)
    instance = parse_instance_url(body.get("url"), dp_size)
    addrs = body.get("ec_zmq_addrs", [])
    if addrs is None:
        addrs = []
    if not isinstance(addrs, list) or not all(isinstance(a, str) and a for a in addrs):
        raise BadRequest("'ec_zmq_addrs' must be a list of address strings")
    if addrs and role not in ("prefill", "prefill_decode"):
        raise BadRequest("only encoder-cache consumers (prefill, prefill_decode) take "
                         "'ec_zmq_addrs'")
    if addrs and len(addrs) != dp_size:
        raise BadRequest(f"'ec_zmq_addrs' must hold one address per DP rank: {len(addrs)} "
                         f"given for dp_size {dp_size}")
    kv = _registered_kv_events(body)
    if kv is not None:
        instance = Instance(instance.url, instance.dp_size, kv)
    return Member(instance, role, ec_zmq_addrs=tuple(addrs), registered_at=now,
                  models=_declared_models(body.get("models")))


#: The most names a registration may declare (``"models"``): a bound on what one body costs.
MAX_DECLARED_MODELS = 64


def _declared_models(raw: Any) -> tuple[str, ...]:
    """A registration's ``models``: the served names it declares (its ``/v1/models`` wins once
    it answers); ``BadRequest`` names what is wrong."""
    if raw is None:
        return ()
    if (not isinstance(raw, list) or len(raw) > MAX_DECLARED_MODELS
            or not all(isinstance(name, str) and 0 < len(name) <= 256 for name in raw)):
        raise BadRequest(f"'models' must be a list of at most {MAX_DECLARED_MODELS} model names")
    return tuple(dict.fromkeys(raw))


def _registered_kv_events(body: Mapping[str, Any]) -> KvEventEndpoints | None:
    """A registration's ``kv_events_endpoint`` (and ``kv_events_replay_endpoint``): where its
    engines publish vLLM's KV cache events; ``BadRequest`` names a bad field."""
    found = {}
    for field_name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        value = body.get(field_name)
        if value is None:
            continue
        try:
            found[field_name] = check_zmq_endpoint(value if isinstance(value, str) else repr(value),
                                                   field_name)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    if not found:
        return None
    if "kv_events_endpoint" not in found:
        raise BadRequest("'kv_events_replay_endpoint' needs 'kv_events_endpoint' beside it")
    return KvEventEndpoints(found["kv_events_endpoint"], found.get("kv_events_replay_endpoint"))


def kv_fields(instance: Instance) -> list[str | None] | None:
    """An instance's KV event endpoints as stored (roster bytes, the shared records)."""
    kv = instance.kv_events
    return None if kv is None else [kv.publish, kv.replay]


def kv_endpoints(stored: Any) -> KvEventEndpoints | None:
    """``kv_fields`` read back; anything else is None (an older record has none)."""
    if (isinstance(stored, list) and len(stored) == 2 and isinstance(stored[0], str)
            and (stored[1] is None or isinstance(stored[1], str))):
        return KvEventEndpoints(stored[0], stored[1])
    return None


def _role_and_dp_size(body: Mapping[str, Any]) -> tuple[str, int]:
    """A registration body's ``role`` and ``dp_size`` (default 1), checked alike on both
    kinds of registration; ``BadRequest`` (400) says what is wrong."""
    role = body.get("role")
    if role not in ROLES:
        raise BadRequest(f"'role' must be one of {', '.join(ROLES)}: got {role!r}")
    dp_size = body.get("dp_size", 1)
    if (isinstance(dp_size, bool) or not isinstance(dp_size, int)
            or not 1 <= dp_size <= MAX_DP_SIZE):
        raise BadRequest(f"'dp_size' must be an integer from 1 to {MAX_DP_SIZE}: "
                         f"got {echo(dp_size)}")
    return role, dp_size


def parse_name_registration(raw: bytes) -> tuple[str, DnsName] | None:
    """A ``POST /instances`` body naming a DNS name (``"url": "dns+http://..."``) as
    ``(role, name)``; None for any other body (``parse_registration`` reads those). A
    ``dp_size`` in the body applies to the name's instances unless its URL has ``#dp=``."""
    body = json_object(raw)
    url = body.get("url")
    if not isinstance(url, str) or not is_dns_url(url):
        return None
    role, dp_size = _role_and_dp_size(body)
    spec = url.strip()
    if dp_size > 1 and "#dp=" not in spec:
        spec = f"{spec}#dp={dp_size}"
    try:
        return role, parse_dns_url(spec)
    except ValueError as exc:
        raise BadRequest(f"'url': {exc}") from None


def register_name(roster: Roster, role: str, spec: str) -> tuple[Roster, bool]:
    """Add a registered DNS name; ``(new roster, whether it was new)``. The same name with
    another role is a ``Conflict`` (409)."""
    for known_role, known in roster.names:
        if known == spec:
            if known_role != role:
                raise Conflict(f"{spec} is already registered as {known_role}; unregister it "
                               f"before registering it as {role}")
            return roster, False
    return replace(roster, version=roster.version + 1,
                   names=(*roster.names, (role, spec))), True


def unregister_name(
    roster: Roster, spec: str, counters: Mapping[str, int]
) -> tuple[Roster, bool]:
    """Remove a registered DNS name and the instances it gave; ``(new roster, whether it was
    there)``."""
    names = tuple(n for n in roster.names if n[1] != spec)
    if len(names) == len(roster.names):
        return roster, False
    members = tuple(m for m in roster.members if m.source != spec)
    changed = _changed(roster, members, counters)
    return replace(changed, version=max(changed.version, roster.version + 1), names=names), True


def parse_instance_url(url: Any, dp_size: int = 1) -> Instance:
    """An instance URL from a request (``url`` field or query parameter); 400 when unusable."""
    if not isinstance(url, str) or not url.strip():
        raise BadRequest("'url' is required: the instance's base URL (http://host:port)")
    try:
        return Instance(url.strip(), dp_size)
    except ValueError as exc:
        raise BadRequest(f"'url': {exc}") from None


# -- changes --------------------------------------------------------------------------------------
#: The ``Member`` fields each registration path carries. A refresh of a known URL replaces
#: these (and the registration time) and keeps every other field as it was: vLLM's HTTP
#: registrar (``POST /instances``) says nothing about a MoRIIO peer, and a MoRIIO heartbeat
#: says nothing about encoder-cache addresses, so neither may erase what the other registered.
HTTP_FIELDS = frozenset({"instance", "role", "ec_zmq_addrs", "models"})
MORIIO_FIELDS = frozenset({"instance", "role", "moriio"})
#: A whole member, as the shared store records it (``shared_state.merge``).
EVERY_FIELD = HTTP_FIELDS | MORIIO_FIELDS


def register(
    roster: Roster, member: Member, counters: Mapping[str, int], *,
    carries: frozenset[str] = HTTP_FIELDS,
) -> tuple[Roster, bool]:
    """Add ``member``, or refresh it if its URL is known; ``(new roster, whether it was new)``.

    A known URL with another role is a ``Conflict`` (409: unregister it first). Mixing a combined
    ``prefill_decode`` instance with separate prefill/decode instances is a ``BadRequest`` (400):
    the proxy could not tell whether a request needs a prefill leg. (Static decode instances with
    no static prefill are compatible with both: such a configuration means either.)

    A refresh keeps the member's place, its static flag, and (for routing) its health; a refresh
    that changes nothing but the time keeps the version, so the worker processes do not re-sync
    every heartbeat. It changes only what its path ``carries`` (``HTTP_FIELDS``,
    ``MORIIO_FIELDS``): an instance may register over both paths at once (vLLM's HTTP
    registrar and its MoRIIO heartbeat), and a refresh over one must not lose what the other
    registered. Either path's registration time counts for both, so such an instance stays
    while either path still beats.
    """
    known = roster.find(member.url)
    if known is not None:
        # A static instance registering is welcome (it may also say it is a combined one);
        # otherwise the role it registered with is the one it keeps.
        if known.role != member.role and not (known.static and known.stage == member.stage):
            raise Conflict(f"{member.url} is already known as {known.role}; unregister it "
                           f"(DELETE /instances?url=...) before registering it as {member.role}")
        _check_mix(roster, member)
        if member.instance.kv_events is None and known.instance.kv_events is not None:
            # A registration that names no KV event endpoint keeps the one configured.
            member = replace(member, instance=known.instance)
        refreshed = replace(known, registered_at=member.registered_at,
                            **{name: getattr(member, name) for name in carries})
        members = tuple(refreshed if m is known else m for m in roster.members)
        return _changed(roster, members, counters), False
    _check_mix(roster, member)
    return _changed(roster, (*roster.members, member), counters), True


def _check_mix(roster: Roster, member: Member) -> None:
    others = [m for m in roster.members if m.url != member.url]
    if member.role == "prefill_decode":
        clash = [m for m in others if m.role == "prefill" or (m.role == "decode" and not m.static)]
    elif member.role in ("prefill", "decode"):
        clash = [m for m in others if m.role == "prefill_decode"]
    else:
        return
    if clash:
        listed = ", ".join(f"{m.role} {m.url}" for m in clash[:3])
        raise BadRequest(f"cannot mix combined prefill_decode instances with separate prefill/"
                         f"decode instances: registering {member.role} {member.url}, but the "
                         f"proxy has {listed}")


#: MoRIIO instances the roster takes at most: a flood of valid-looking registrations, each naming
#: a new address, must cost bounded memory (the silent ones leave after ``EPD_MORIIO_TTL``).
MAX_MORIIO_INSTANCES = 1024


def register_moriio(
    roster: Roster, registration: MoriioRegistration, counters: Mapping[str, int], now: float,
    limit: int = MAX_MORIIO_INSTANCES,
) -> tuple[Roster, bool]:
    """Add or refresh a MoRIIO instance; ``(new roster, whether it was new)``.

    The first MoRIIO registration fixes the roster's transfer mode; one with the other mode is
    a ``RegistrationRefused`` (as upstream, which logs it at error level and skips it), as is a
    role change or a mix with combined instances. A heartbeat that changes nothing but the time
    keeps the roster's version (``register``).
    """
    mode = roster.transfer_mode
    if mode is not None and registration.transfer_mode != mode:
        raise RegistrationRefused(f"transfer mode {registration.transfer_mode}, but the proxy's "
                                  f"is {mode} (fixed by the first registration)")
    if (roster.find(registration.instance.url) is None
            and sum(m.moriio is not None for m in roster.members) >= limit):
        raise RegistrationRefused(f"the roster already holds {limit} MoRIIO instances")
    member = Member(registration.instance, registration.role, registered_at=now,
                    moriio=registration.peer)
    try:
        new, created = register(roster, member, counters, carries=MORIIO_FIELDS)
    except (BadRequest, Conflict) as exc:
        raise RegistrationRefused(exc.message) from None
    if mode is None:
        new = replace(new, transfer_mode=registration.transfer_mode)
    return new, created


def silent_moriio(roster: Roster, now: float, ttl: float) -> list[str]:
    """MoRIIO instances that have not re-registered for ``ttl`` seconds (they beat every 3 s)."""
    return [m.url for m in roster.members
            if m.moriio is not None and not m.static and now - m.registered_at >= ttl]


def unregister(roster: Roster, url: str, counters: Mapping[str, int]) -> tuple[Roster, bool]:
    """Remove the instance at ``url`` (static ones too: an instance that says it is stopping
    must get no more requests); ``(new roster, whether it was there)``."""
    members = tuple(m for m in roster.members if m.url != url)
    if len(members) == len(roster.members):
        return roster, False
    return _changed(roster, members, counters), True


def expired(
    roster: Roster, evicted_since: Mapping[str, float], now: float, ttl: float
) -> list[str]:
    """Registered instances to forget: out of rotation *and* silent for ``ttl`` seconds.

    ``evicted_since`` maps the URLs that are out of rotation (failed their probes) to when they
    left it. An instance that keeps registering, or that answers its probes, is kept; static
    instances are never forgotten.
    """
    return [m.url for m in roster.members
            if not m.static and m.source is None and m.url in evicted_since
            and now - max(m.registered_at, evicted_since[m.url]) >= ttl]


def forget(roster: Roster, urls: Sequence[str], counters: Mapping[str, int]) -> Roster:
    gone = set(urls)
    members = tuple(m for m in roster.members if m.url not in gone)
    return roster if len(members) == len(roster.members) else _changed(roster, members, counters)


def replace_source(
    roster: Roster, source: str, role: str, discovered: Sequence[Discovered],
    counters: Mapping[str, int],
) -> tuple[Roster, tuple[list[str], list[str]]]:
    """Make ``discovered`` the members of ``source`` (a discovery source serving ``role``);
    ``(new roster, (URLs that joined, URLs that left))``.

    Idempotent: the same list again changes nothing (no new version), so every round of a
    discovery loop can apply its whole answer, and a second process applying the same answer is
    harmless. The members that stay keep their place, newcomers join at the end in the given
    order, and the epochs continue each rotation (``_changed``), as for registrations. A URL
    another member already holds (listed, registered, or another source's) stays that member's.
    """
    mine = {m.url: m for m in roster.members if m.source == source and m.role == role}
    others = {m.url for m in roster.members if m.url not in mine}
    wanted: dict[str, Discovered] = {}
    for found in discovered:
        if found.instance.url not in others:
            wanted.setdefault(found.instance.url, found)
    joined = [url for url in wanted if url not in mine]
    left = [url for url in mine if url not in wanted]
    resized = {url for url, found in wanted.items() if url in mine and (
        mine[url].instance != found.instance or mine[url].ec_zmq_addrs != found.ec_zmq_addrs)}
    if not joined and not left and not resized:
        return roster, ([], [])  # the common case, every round: checked without copying
    members: list[Member] = []
    for member in roster.members:
        if member.url not in mine:
            members.append(member)
        elif member.url in resized:
            found = wanted[member.url]
            members.append(replace(member, instance=found.instance,
                                   ec_zmq_addrs=found.ec_zmq_addrs))
        elif member.url in wanted:
            members.append(member)
    members += [Member(wanted[url].instance, role, ec_zmq_addrs=wanted[url].ec_zmq_addrs,
                       source=source) for url in joined]
    return _changed(roster, tuple(members), counters), (joined, left)


def _routing_view(members: Sequence[Member]) -> list[tuple[Any, ...]]:
    return [(m.role, m.url, m.instance.dp_size, m.ec_zmq_addrs, m.moriio, m.models)
            for m in members]


def _changed(
    roster: Roster, members: tuple[Member, ...], counters: Mapping[str, int]
) -> Roster:
    return changed_members(roster, members, counters, roster.transfer_mode)


def changed_members(
    roster: Roster, members: tuple[Member, ...], counters: Mapping[str, int],
    transfer_mode: str | None,
) -> Roster:
    """The roster with ``members``: a new version, and epochs that continue each rotation."""
    if _routing_view(members) == _routing_view(roster.members):
        # Only registration times changed (or the transfer mode, which no rotation reads).
        return replace(roster, members=members, transfer_mode=transfer_mode)
    new = Roster(members=members, transfer_mode=transfer_mode)
    epochs = dict(roster.epochs)
    for stage in STAGES:
        dp = stage != "encode"
        old_keys, new_keys = slot_keys(roster.of(stage), dp), slot_keys(new.of(stage), dp)
        if old_keys != new_keys:
            epochs[stage] = rebase_epoch(roster.epochs[stage], old_keys, new_keys, counters[stage])
    return replace(roster, version=roster.version + 1, members=members, epochs=epochs,
                   transfer_mode=transfer_mode)
