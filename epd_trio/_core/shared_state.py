"""What several proxy replicas share through the state store, as values (pure).

The store (Redis, ``_replicas/sync.py``) holds, under one key prefix per fleet:

- one key per **registered instance** (``instance:<url>``: a JSON record, with a TTL), listed in
  a set (``instances``), and a short-lived **tombstone** (``gone:<url>``) for an instance that
  unregistered, so that a replica writing back what it knew after an outage cannot bring back
  an instance that said it was stopping;
- a **channel** (``roster``) on which every change is announced with its record (the fast path;
  a periodic full read catches what a disconnect lost);
- a **fleet marker** (``fleet``): a random token set once; when it is gone, the store lost its
  data (restarted empty), and every replica writes back what it knows;
- per replica, an expiring **hash of in-flight counts** (``load:<replica>``) and its name in a
  sorted set of live replicas (``replicas``, scored by the time of its last publication), and
  an expiring **owner** key (``owner:<replica>``) holding a random token of the process that
  uses that replica id: another token there means two live processes share one id;
- one **counter** per routing stage (``cursor:<stage>``) for the opt-in global cursor.

This module turns members into records and back, and a set of records into a roster: static
instances first, in configuration order, then the registered ones sorted by URL, so that every
replica orders the same instances the same way (the global cursor needs it). Anything a record
carries that this version cannot read is a ``MalformedEntry``: the caller skips and counts it.
Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import orjson

from .errors import BadRequest, Conflict
from .moriio import MoriioPeer
from .names import ROLES, STAGES
from .policies import SlotKey
from .roster import EVERY_FIELD, Member, Roster, changed_members, kv_endpoints, kv_fields, register
from .routing import Instance, slot_keys

#: The record layout this version writes; a record with another ``v`` is skipped, not guessed at.
RECORD_VERSION = 1
#: Between the parts of a load hash's field: stage, URL, rank. Never in a URL.
_SEP = "\x1f"


class MalformedEntry(ValueError):
    """An entry of the shared store this version cannot read (written by hand, or by another
    version): skipped and counted, never a crash."""


@dataclass(frozen=True, slots=True)
class StateKeys:
    """The names of every key and channel of one fleet (``EPD_STATE_PREFIX``)."""

    prefix: str = "epd:"

    @property
    def index(self) -> str:
        return self.prefix + "instances"

    @property
    def channel(self) -> str:
        return self.prefix + "roster"

    @property
    def fleet(self) -> str:
        return self.prefix + "fleet"

    @property
    def replicas(self) -> str:
        return self.prefix + "replicas"

    def instance(self, url: str) -> str:
        return self.prefix + "instance:" + url

    def tombstone(self, url: str) -> str:
        return self.prefix + "gone:" + url

    def load(self, replica: str) -> str:
        return self.prefix + "load:" + replica

    def owner(self, replica: str) -> str:
        return self.prefix + "owner:" + replica

    def cursor(self, stage: str, model: str) -> str:
        """The global cursor of one model's pool at one stage: namespaced by the model, so
        another model's traffic never moves it."""
        return self.prefix + "cursor:" + model + ":" + stage


def worker_replica_id(base: str, worker: int) -> str:
    """The replica id of worker ``worker`` of a multi-worker ``epd-trio serve`` whose id is
    ``base`` (``EPD_REPLICA_ID``, or the parent's host name and process id).

    Why every worker needs its own: with a state store each worker is a replica of the fleet.
    Two workers under one id would each take the other's announcements for its own (and ignore
    them), and overwrite one load hash, hiding each other's requests from the load-aware
    policies. The suffix keeps the operator's name readable and the siblings recognisable.
    """
    return f"{base}-w{worker}"


# -- instance records -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Record:
    """A registered instance as the store holds it: ``member.registered_at`` is wall-clock
    time (``time.time()``: replicas on several hosts share no monotonic clock)."""

    member: Member
    #: The MoRIIO transfer mode it registered with (None: not a MoRIIO instance).
    transfer_mode: str | None = None


def shared(member: Member) -> bool:
    """Whether a member belongs in the store: registered at least once. Static instances that
    never registered are each replica's own configuration, and so are discovered ones (each
    replica discovers on its own: ``Member.source``)."""
    if member.source is not None:
        return False
    return not member.static or member.registered_at > 0 or member.moriio is not None


def encode_record(record: Record) -> bytes:
    m = record.member
    return orjson.dumps({
        "v": RECORD_VERSION, "url": m.url, "role": m.role, "dp_size": m.instance.dp_size,
        "kv_events": kv_fields(m.instance),
        "ec_zmq_addrs": list(m.ec_zmq_addrs), "registered_at": m.registered_at,
        "moriio": None if m.moriio is None else
        [m.moriio.zmq_address, m.moriio.dp_size, m.moriio.tp_size],
        "transfer_mode": record.transfer_mode, "models": list(m.models),
    })


def decode_record(raw: bytes | str, *, url: str | None = None) -> Record:
    """The record ``raw`` holds (the entry of ``url``, when given); ``MalformedEntry`` says why
    it cannot be used."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise MalformedEntry("not JSON") from None
    if not isinstance(data, dict) or data.get("v") != RECORD_VERSION:
        raise MalformedEntry(f"not a version-{RECORD_VERSION} instance record")
    try:
        role, addrs, at = data["role"], data["ec_zmq_addrs"], data["registered_at"]
        if role not in ROLES:
            raise MalformedEntry(f"unknown role {role!r}")
        if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
            raise MalformedEntry("ec_zmq_addrs is not a list of strings")
        if isinstance(at, bool) or not isinstance(at, int | float):
            raise MalformedEntry("registered_at is not a number")
        peer = data["moriio"]
        mode = data["transfer_mode"]
        if peer is not None:
            address, dp, tp = peer
            if not isinstance(address, str) or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (dp, tp)):
                raise MalformedEntry("bad MoRIIO peer")
            if mode not in ("READ", "WRITE"):
                raise MalformedEntry(f"bad MoRIIO transfer mode {mode!r}")
            peer = MoriioPeer(address, dp, tp)
        instance = Instance(data["url"], data["dp_size"], kv_endpoints(data.get("kv_events")))
        models = data.get("models", [])  # a record written before names were declared has none
        if not isinstance(models, list) or not all(isinstance(n, str) for n in models):
            raise MalformedEntry("models is not a list of strings")
        member = Member(instance, role, ec_zmq_addrs=tuple(addrs),
                        registered_at=float(at), moriio=peer, models=tuple(models))
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, MalformedEntry):
            raise
        raise MalformedEntry(f"bad field: {exc}") from None
    if url is not None and member.url != url:
        raise MalformedEntry(f"the entry of {url} names {member.url}")
    return Record(member, mode if peer is not None else None)


# -- change announcements ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Announcement:
    """One message of the roster channel: ``put`` (with its record) or ``delete``."""

    op: str
    url: str
    #: The replica that made the change (it ignores its own announcements).
    origin: str
    record: Record | None = None


def encode_announcement(op: str, url: str, origin: str, record: bytes | None = None) -> bytes:
    return orjson.dumps({"op": op, "url": url, "origin": origin,
                         "record": None if record is None else record.decode()})


def decode_announcement(raw: bytes | str) -> Announcement:
    try:
        data = orjson.loads(raw)
        op, url, origin, record = data["op"], data["url"], data["origin"], data["record"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise MalformedEntry("not a roster announcement") from None
    if op not in ("put", "delete") or not isinstance(url, str) or not isinstance(origin, str):
        raise MalformedEntry("not a roster announcement")
    if op == "put":
        if not isinstance(record, str):
            raise MalformedEntry("a put announcement without its record")
        decoded = decode_record(record, url=url)
        return Announcement(op, url, origin, decoded)
    return Announcement(op, url, origin)


# -- records -> roster --------------------------------------------------------------------------------
def records_of(roster: Roster) -> dict[str, Record]:
    """The records of every shared member of ``roster`` (registration times as they are)."""
    return {m.url: Record(m, roster.transfer_mode if m.moriio is not None else None)
            for m in roster.members if shared(m)}


def merge(
    roster: Roster, records: Mapping[str, Record], counters: Mapping[str, int],
) -> tuple[Roster, list[tuple[str, str]]]:
    """The roster whose registered members are exactly ``records``; its static members stay
    as ``roster`` has them (they leave only by unregistering). Returns it and the records that
    could not join, each with why (a role clash with this replica's configuration, a mix of
    combined and separate instances, the other MoRIIO transfer mode).

    Records join in URL order, so every replica builds the same order from the same records.
    An unchanged routing view keeps the version (see ``roster._changed``).
    """
    view = Roster(members=tuple(m for m in roster.members
                                if m.static or m.source is not None),
                  transfer_mode=roster.transfer_mode)
    zero = dict.fromkeys(STAGES, 0)
    skipped: list[tuple[str, str]] = []
    for url in sorted(records):
        record = records[url]
        mode = record.transfer_mode
        if mode is not None and view.transfer_mode not in (None, mode):
            skipped.append((url, f"transfer mode {mode}, but this fleet's is "
                                 f"{view.transfer_mode}"))
            continue
        try:
            # The record is the whole member (a static one's MoRIIO peer included).
            view, _ = register(view, record.member, zero, carries=EVERY_FIELD)
        except (BadRequest, Conflict) as exc:
            skipped.append((url, exc.message))
            continue
        if mode is not None and view.transfer_mode is None:
            view = replace(view, transfer_mode=mode)
    return changed_members(roster, view.members, counters, view.transfer_mode), skipped


def reseeded(
    old: Roster, new: Roster, counters: Mapping[str, int], offset: Callable[[int], int],
    *, every_stage: bool = False,
) -> Roster:
    """``new`` with each stage whose slots changed (every stage: ``every_stage``) starting at
    ``offset(slot count)``.

    Why: replicas that see the same change at about the same time would otherwise all
    continue from the same place (or all restart at slot 0 when a stage had no instance), and
    send their next requests to the same instances in lockstep (grpc-java #4462, Envoy #3271).
    """
    if new.version == old.version and not every_stage:
        return new
    epochs = dict(new.epochs)
    for stage in STAGES:
        dp = stage != "encode"
        keys = slot_keys(new.of(stage), dp)
        if every_stage or keys != slot_keys(old.of(stage), dp):
            epochs[stage] = (counters[stage], offset(len(keys)) if keys else 0)
    return replace(new, epochs=epochs)


def to_local_time(wall: float, now_wall: float, now_local: float) -> float:
    """A wall-clock instant on this process's own clock (never in its future)."""
    return now_local - max(0.0, now_wall - wall)


# -- loads ------------------------------------------------------------------------------------------
#: A dead replica's counts stop counting within this many seconds (issue 19's promise).
DEAD_REPLICA_LIMIT = 5.0
#: A replica's counts expire this many load intervals after its last publication, or at
#: ``DEAD_REPLICA_LIMIT``, whichever comes first.
LOAD_EXPIRY_INTERVALS = 12
#: The longest load interval (``EPD_STATE_LOAD_INTERVAL``): at it, the capped expiry still
#: outlives five publications, so one late or lost publication never blanks a live replica.
MAX_LOAD_INTERVAL = 1.0


def load_expiry(interval: float) -> float:
    """Seconds a replica's published counts live after its last publication every
    ``interval`` seconds: many intervals (a replica whose loop lags a little keeps counting),
    never more than ``DEAD_REPLICA_LIMIT`` (a dead one stops counting by then)."""
    return min(LOAD_EXPIRY_INTERVALS * interval, DEAD_REPLICA_LIMIT)


def load_field(stage: str, key: SlotKey) -> str:
    url, rank = key
    return f"{stage}{_SEP}{url}{_SEP}{'' if rank is None else rank}"


def parse_load_field(raw: bytes | str) -> tuple[str, SlotKey]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    parts = text.split(_SEP)
    if len(parts) != 3 or not parts[0] or not parts[1] or not (parts[2] == "" or
                                                               parts[2].isdigit()):
        raise MalformedEntry("not a load field")
    return parts[0], (parts[1], int(parts[2]) if parts[2] else None)


def load_fields(counts: Iterable[tuple[str, SlotKey, int]]) -> dict[str, int]:
    """A replica's non-zero in-flight counts as the fields of its load hash."""
    return {load_field(stage, key): n for stage, key, n in counts if n > 0}


def sum_loads(
    hashes: Iterable[Mapping[Any, Any]],
) -> tuple[dict[tuple[str, SlotKey], int], int]:
    """The in-flight counts of several replicas added up, and how many fields were malformed.
    Negative or non-numeric counts are malformed: a replica never publishes them."""
    total: dict[tuple[str, SlotKey], int] = {}
    bad = 0
    for fields in hashes:
        for raw_field, raw_value in fields.items():
            try:
                where = parse_load_field(raw_field)
                value = int(raw_value)
            except (MalformedEntry, ValueError, UnicodeDecodeError):
                bad += 1
                continue
            if value < 0:
                bad += 1
                continue
            total[where] = total.get(where, 0) + value
    return total, bad
