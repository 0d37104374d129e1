"""Routing arithmetic: which encoder gets which item, which (instance, DP rank) slot gets a request.

Rule: nothing here does I/O or imports trio; every function takes values and returns values, so
the properties the upstream proxies got wrong (docs/discussion/protocol.md "Encoder assignment",
"DP routing") are checked by plain table-driven tests. The objects that *own* the counters live
in ``_state/cursors.py``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from .urls import check_base_url, check_host, echo

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

#: Where a rotation stands: ``(k0, i0)`` means counter value ``k0`` maps to slot index ``i0``, so
#: counter value ``k`` maps to slot ``(i0 + k - k0) % len(slots)``. ``(0, 0)`` is plain modulo.
Epoch = tuple[int, int]

#: The keys an instance URL's fragment may carry (``http://p0:8000#dp=2&kv_events=tcp://p0:5557``).
FRAGMENT_KEYS = ("dp", "kv_events", "kv_events_replay")
#: The most data-parallel ranks one instance may declare: far above any real deployment, low
#: enough that a typo (``100000``) cannot build a slot list of that size in every worker.
MAX_DP_SIZE = 1024


@dataclass(frozen=True, slots=True)
class KvEventEndpoints:
    """Where an instance's engines publish their KV cache events (``--kv-events-config``).

    Rank ``r`` of a DP instance publishes on ``port + r``, as vLLM offsets it, and so does its
    replay socket; ``replay`` is None where none is configured (a gap is then never filled)."""

    publish: str
    replay: str | None = None

    def for_rank(self, rank: int | None) -> KvEventEndpoints:
        """The endpoints of one DP rank's engine (rank None: a DP-1 instance, offset 0)."""
        offset = rank or 0
        return KvEventEndpoints(_offset(self.publish, offset),
                                None if self.replay is None else _offset(self.replay, offset))


@dataclass(frozen=True, slots=True)
class Instance:
    """One vLLM server: its base URL and how many data-parallel ranks it serves.

    ``dp_size > 1`` means the server runs DP engines internally and takes the rank to use from the
    ``X-data-parallel-rank`` header; a rank outside ``[0, dp_size)`` is an HTTP 400 there.
    """

    url: str
    dp_size: int = 1
    #: Where its engines publish vLLM's KV cache events, when it says so itself (its URL's
    #: ``#kv_events=``, its registration). Not part of its identity: the same server is the
    #: same instance whichever endpoint it names.
    kv_events: KvEventEndpoints | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        url = check_base_url(self.url)
        if (isinstance(self.dp_size, bool) or not isinstance(self.dp_size, int)
                or not 1 <= self.dp_size <= MAX_DP_SIZE):
            raise ValueError(f"dp_size must be an integer from 1 to {MAX_DP_SIZE}: "
                             f"{self.dp_size!r}")
        # One spelling per server: trailing slashes would make "the same URL" two instances.
        object.__setattr__(self, "url", url)


def parse_instance(spec: str) -> Instance:
    """Parse ``http://host:port`` with an optional fragment (the config file/env syntax):
    ``#dp=N``, and the KV event endpoints ``parse_instance_spec`` returns too."""
    return parse_instance_spec(spec)[0]


def parse_instance_spec(spec: str) -> tuple[Instance, KvEventEndpoints | None]:
    """An instance URL with its fragment: the instance, and its KV event endpoints if named.

    The fragment is ``&``-separated ``key=value`` pairs in any order (``FRAGMENT_KEYS``); an
    unknown or repeated key is refused by name, so a typo never silently turns a feature off.
    ``kv_events_replay`` without ``kv_events`` is refused: a replay socket alone feeds nothing.
    """
    url, fields = split_fragment(spec)
    publish, replay = fields.get("kv_events"), fields.get("kv_events_replay")
    if replay is not None and publish is None:
        raise ValueError(f"'kv_events_replay' needs 'kv_events' beside it: {spec.strip()!r}")
    kv = None if publish is None else KvEventEndpoints(publish, replay)
    return Instance(url, int(fields.get("dp", 1)), kv), kv


def split_fragment(spec: str) -> tuple[str, dict[str, str]]:
    """``"url#dp=2&kv_events=tcp://h:5557"`` -> ``("url", {"dp": "2", "kv_events": ...})``,
    every value checked (``dp`` a positive integer, an endpoint ``tcp://host:port``); no
    fragment means no fields. ``ValueError`` names the key at fault."""
    spec = spec.strip()
    url, sep, fragment = spec.partition("#")
    fields: dict[str, str] = {}
    if not sep:
        return spec, fields
    for pair in fragment.split("&"):
        key, eq, value = pair.strip().partition("=")
        key, value = key.strip(), value.strip()
        if key not in FRAGMENT_KEYS:
            raise ValueError(f"unknown key {key!r} in the '#' part of {spec!r}: expected "
                             f"{', '.join(FRAGMENT_KEYS)}")
        if key in fields:
            raise ValueError(f"{key!r} given twice in {spec!r}")
        if key == "dp":
            if not eq or not value.isascii() or not value.isdigit() or not (
                    1 <= int(value) <= MAX_DP_SIZE):
                raise ValueError(f"bad '#dp=' in {echo(spec)}: expected an integer from 1 to "
                                 f"{MAX_DP_SIZE}")
        else:
            check_zmq_endpoint(value, key)
        fields[key] = value
    return url.strip(), fields


def split_dp_suffix(spec: str) -> tuple[str, int]:
    """``"url#dp=N"`` -> ``("url", N)``; no suffix means ``dp_size`` 1."""
    url, fields = split_fragment(spec)
    return url, int(fields.get("dp", 1))


def check_zmq_endpoint(value: str, name: str) -> str:
    """A ZMQ endpoint the proxy connects to: ``tcp://host:port``; ``ValueError`` names it."""
    scheme, sep, rest = value.partition("://")
    host, colon, port = rest.rpartition(":")
    if (scheme != "tcp" or not sep or not colon or not host or host == "*" or not port.isascii()
            or not port.isdigit() or not 1 <= int(port) <= 65535):
        raise ValueError(f"{name!r} must be tcp://host:port (a port 1-65535): {echo(value)}")
    try:
        check_host(host, value)
    except ValueError as exc:
        raise ValueError(f"{name!r}: {exc}") from None
    return value


def _offset(endpoint: str, offset: int) -> str:
    host, _, port = endpoint.rpartition(":")
    moved = int(port) + offset
    if moved > 65535:
        raise ValueError(f"{endpoint} offset by DP rank {offset} is past port 65535")
    return f"{host}:{moved}"


def encoder_rr_assignment(
    urls: Sequence[T], start: int, count: int
) -> tuple[list[T], int]:
    """Assign ``count`` media items to encoders round-robin, continuing from a global ``start``.

    Item ``i`` goes to ``urls[(start + i) % len(urls)]`` and the next request starts at
    ``(start + count) % len(urls)``. Continuing from a persistent cursor (instead of restarting at
    encoder 0 for every request, as upstream did) is what spreads single-image traffic evenly.
    """
    n = len(urls)
    if n == 0:
        raise ValueError("no encoder to assign items to")
    if count < 0:
        raise ValueError(f"count must be >= 0: {count}")
    start %= n
    return [urls[(start + i) % n] for i in range(count)], (start + count) % n


def dp_slots(instances: Sequence[Instance]) -> list[tuple[int, int | None]]:
    """Every ``(instance_index, dp_rank)`` slot, in flat interleaved order.

    The list is built rank by rank: ``inst0_r0, inst1_r0, ..., inst0_r1, inst1_r1, ...``, so that
    consecutive requests land on different instances first, and an instance with a smaller
    ``dp_size`` simply drops out of the higher ranks (never an out-of-range rank). The rank is
    ``None`` for an instance with ``dp_size == 1``: such a server must not get the header.
    """
    if not instances:
        return []
    max_dp = max(inst.dp_size for inst in instances)
    return [
        (index, rank if inst.dp_size > 1 else None)
        for rank in range(max_dp)
        for index, inst in enumerate(instances)
        if rank < inst.dp_size
    ]


def flat_interleaved_dp_route(
    request_number: int, instances: Sequence[Instance]
) -> tuple[int, int | None]:
    """The slot for request number ``request_number`` (counting from 1, as upstream does).

    With ``n`` instances of equal ``dp`` this equals ``slot = (k - 1) % (n * dp)``,
    ``instance = slot % n``, ``rank = slot // n``: one counter walks all ``n * dp`` slots, so two
    instances with DP8 use all 16 slots (upstream's aliasing left half the ranks idle).
    """
    if request_number < 1:
        raise ValueError(f"request numbers start at 1: {request_number}")
    slots = dp_slots(instances)
    if not slots:
        raise ValueError("no instance to route to")
    return slots[(request_number - 1) % len(slots)]


def group_by_target(
    targets: Sequence[T], max_batch: int
) -> list[tuple[T, list[int]]]:
    """Group item indices by their assigned target, in order of first appearance.

    Items on the same encoder may share one sub-request; ``max_batch`` caps a group's size
    (0 = no cap, 1 = one item per sub-request). Groups keep the items' original order so the
    derived request ids (``-enc-k``) are stable for a given assignment.
    """
    if max_batch < 0:
        raise ValueError(f"max_batch must be >= 0: {max_batch}")
    open_groups: dict[T, list[int]] = {}
    groups: list[tuple[T, list[int]]] = []
    for index, target in enumerate(targets):
        group = open_groups.get(target)
        if group is None or (max_batch and len(group) >= max_batch):
            group = []
            open_groups[target] = group
            groups.append((target, group))
        group.append(index)
    return groups


def slot_keys(instances: Sequence[Instance], dp: bool) -> list[tuple[str, int | None]]:
    """The identity of each routing slot, by URL: what stays "the same slot" across a change.

    ``dp=False`` (encoders): one slot per instance, in order. ``dp=True`` (prefill/decode): the
    ``dp_slots`` order with each instance index replaced by its URL.
    """
    if not dp:
        return [(inst.url, None) for inst in instances]
    return [(instances[index].url, rank) for index, rank in dp_slots(instances)]


def rebase_position(old: Sequence[K], new: Sequence[K], position: int) -> int:
    """Where a round-robin over ``old``, about to serve ``old[position % len(old)]``, goes on in ``new``.

    The next slot is the first one at or after that position (cyclically, in ``old``'s order)
    that is still in ``new``, and the rotation continues from its index there. So when
    instances come and go, no surviving slot is skipped or served twice in a row, and the
    rotation does not restart at slot 0 (which would hot-spot the first instance after every
    registration); added slots are served when the rotation reaches their place. With nothing
    surviving (or nothing before), the rotation starts at 0.
    """
    if not old or not new:
        return 0
    index = {key: i for i, key in enumerate(new)}
    for step in range(len(old)):
        found = index.get(old[(position + step) % len(old)])
        if found is not None:
            return found
    return 0


def rebase_epoch(epoch: Epoch, old: Sequence[K], new: Sequence[K], counter: int) -> Epoch:
    """The epoch that continues ``epoch``'s rotation over ``old`` in ``new``, from counter value
    ``counter`` on (the next request's number): see ``rebase_position``."""
    k0, i0 = epoch
    position = (i0 + counter - k0) % len(old) if old else 0
    return counter, rebase_position(old, new, position)
