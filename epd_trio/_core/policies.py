"""Routing policies per stage: which slot, among the usable ones, serves the next request.

Rule: the shell hands a policy the candidate slots **in round-robin rotation order** (the
cursor's position first) and each one's load; the policy returns an index into that list. So
every policy inherits the rotation as its tie-break, and under uniform load ``least_loaded`` is
exactly ``round_robin`` (as vLLM's own DP load balancer rotates its scan start). Health,
failover exclusions and membership changes are the shell's: they only change the candidate
list, never the policy's arithmetic.

- ``round_robin``: the first candidate (loads are not even read).
- ``least_loaded``: the first candidate with the smallest load. The load is the proxy's own
  count of requests in flight on the slot; a request's size is deliberately not weighed in
  (on an engine limited by ``max_num_seqs`` a running request costs one batch place whatever
  its ``max_tokens``, README "Choosing a policy").
- ``power_of_two``: two candidates, the rotation's next slot and a random other one; the less
  loaded wins (the rotation's on a tie). With many proxies that each see only their own
  counts, it does not herd onto the one slot that looks idle to all of them, at the cost of a
  worse choice now and then.
- ``cache_aware``: affinity. Prefill and decode: the slot that last served the longest prefix
  of this prompt (``PrefixIndex``). Encode: the encoder that last encoded this item's
  ``uuid``. The affinity holds unless that slot is overloaded relative to the least loaded
  candidate (``Balance``, SGLang's absolute and relative thresholds, judged per request for
  the preferred slot, not fleet-wide: docs/contributing/upstream-notes/routing-research.md 1.4); a
  miss or an overload goes to ``least_loaded``. Memory is bounded: LRU maps with a size cap.
- ``precise_cache_aware`` (prefill and decode): what the engines say they hold, not a guess.
  The shell hands it a ``CachedPrefix``: the tokens of this prompt each slot holds in full
  blocks, read from the KV index that vLLM's KV cache events feed (a slot whose index is not
  exact holds nothing there). The slot holding the longest prefix wins, unless overloaded by
  the same ``Balance`` rule as ``cache_aware``; a miss goes to ``least_loaded``. Without a
  ``CachedPrefix`` (no tokens: the render call failed or was too slow) it is ``cache_aware``.

No I/O and no trio here; randomness comes from a ``random.Random`` the caller owns.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The policies, in the order the docs list them; ``round_robin`` is the default of every stage.
POLICIES = ("round_robin", "least_loaded", "power_of_two", "cache_aware", "precise_cache_aware")
DEFAULT_POLICY = "round_robin"
#: The encode stage's policies: an encoder holds media, not a prompt's KV blocks.
ENCODE_POLICIES = POLICIES[:-1]

#: A slot's identity across roster changes: its instance URL and DP rank (None: no DP).
SlotKey = tuple[str, int | None]

#: Characters per prefix block: a prompt is matched block by block from its start. Coarser
#: blocks cost less per decision (a hash, a lookup and an update each), finer ones tell apart
#: prompts that diverge earlier; 512 keeps a decision within its budget (README).
PREFIX_BLOCK_CHARS = 512
#: Blocks considered per prompt (8 x 512 = the first 4096 characters). Bounds the per-request
#: cost whatever the prompt's length; prompts that agree on their first 4 KiB share a slot.
PREFIX_MAX_BLOCKS = 8
#: The work in flight per candidate slot, or a function that reads it (on a tie only).
Sizes = Sequence[int] | Callable[[], Sequence[int]]
#: Slots remembered per key: a prefix served by several slots (after an overload diverted it)
#: keeps them all, so affinity spreads a hot prefix instead of flapping between two slots.
OWNERS_PER_KEY = 4


def least_loaded(loads: Sequence[int], sizes: Sizes | None = None) -> int:
    """Index of the smallest load; among equals the smallest ``size`` (the work outstanding
    there, e.g. the ``max_tokens`` in flight), then the first in rotation order.

    ``sizes`` may be a function giving them: it is called only when the smallest load is tied
    (reading the sizes is a table read per slot, a decision's largest cost after hashing)."""
    lowest = min(loads)
    first = loads.index(lowest)
    if sizes is None or loads.count(lowest) == 1:
        return first
    if callable(sizes):
        sizes = sizes()
    best, smallest = first, sizes[first]
    for index in range(first + 1, len(loads)):
        if loads[index] == lowest and sizes[index] < smallest:
            best, smallest = index, sizes[index]
    return best


def power_of_two(loads: Sequence[int], rng: random.Random) -> int:
    """Two distinct candidates, the rotation's next one and a random other; the less loaded wins,
    the rotation's on a tie (so under uniform load it is round-robin, like ``least_loaded``)."""
    n = len(loads)
    if n == 1:
        return 0
    other = 1 + rng.randrange(n - 1)
    return other if loads[other] < loads[0] else 0


@dataclass(frozen=True, slots=True)
class Balance:
    """When affinity gives way to load: the preferred slot is overloaded if its load exceeds
    the least loaded candidate's by more than ``abs_threshold`` **and** by more than the factor
    ``rel_threshold``.

    Why both (SGLang's ``--balance-abs-threshold`` / ``--balance-rel-threshold``, 64 and 1.5
    there): the absolute margin keeps small gaps at low load (1 against 0 is infinitely
    relative) from breaking affinity, and the relative one keeps large absolute gaps at high
    load (1000 against 940) from doing so. SGLang's 64 is sized for GPU engines batching
    hundreds of sequences; the proxy's default is smaller (see ``Settings``), and both are
    settings.
    """

    abs_threshold: int = 8
    rel_threshold: float = 1.5

    def overloaded(self, load: int, lowest: int) -> bool:
        return load - lowest > self.abs_threshold and load > lowest * self.rel_threshold


class AffinityIndex:
    """A bounded LRU map: key -> the slots that served it, most recent first.

    At most ``capacity`` keys (the least recently used one goes first) and ``OWNERS_PER_KEY``
    slots per key, so memory is bounded whatever the traffic. Slots that left the roster are
    not purged: they are simply never candidates, and age out.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1: {capacity}")
        self.capacity = capacity
        self._owners: OrderedDict[Hashable, tuple[SlotKey, ...]] = OrderedDict()
        #: Keys each slot holds: how much of the index (so, roughly, of the engines' caches)
        #: each slot already carries; ``cache_aware`` sends a miss to the emptier of two equally
        #: loaded slots, so new prefixes spread over the slots instead of following the rotation.
        self.held: dict[SlotKey, int] = {}

    def __len__(self) -> int:
        return len(self._owners)

    def owners(self, key: Hashable) -> tuple[SlotKey, ...]:
        """The slots that served ``key`` (most recent first), touching it; () if unknown."""
        found = self._owners.get(key)
        if found is None:
            return ()
        self._owners.move_to_end(key)
        return found

    def peek(self, key: Hashable) -> tuple[SlotKey, ...]:
        """``owners`` without touching the LRU order."""
        return self._owners.get(key, ())

    def record(self, key: Hashable, slot: SlotKey) -> None:
        """``slot`` served ``key`` now."""
        owners = self._owners
        previous = owners.get(key)
        if previous is not None and previous[0] == slot:  # the common case: the same slot
            owners.move_to_end(key)
            return
        previous = owners.pop(key, ())
        held = self.held
        if slot not in previous:
            held[slot] = held.get(slot, 0) + 1
            if len(previous) >= OWNERS_PER_KEY:
                self._drop(previous[-1])
        owners[key] = (slot, *(s for s in previous if s != slot))[:OWNERS_PER_KEY]
        if len(owners) > self.capacity:
            for gone in owners.popitem(last=False)[1]:
                self._drop(gone)

    def _drop(self, slot: SlotKey) -> None:
        left = self.held[slot] - 1
        if left:
            self.held[slot] = left
        else:
            del self.held[slot]


@dataclass(frozen=True, slots=True)
class PrefixHint:
    """A prompt, as the prefix index sees it: its chained block hashes and its length.

    Computed once per request (failover retries reuse it). ``blocks[i]`` identifies the first
    ``(i + 1) * PREFIX_BLOCK_CHARS`` characters, so two prompts share ``blocks[:k]`` exactly when
    they share that many leading blocks.
    """

    blocks: tuple[int, ...]
    chars: int
    #: The first block's text: its ``stable_hash`` (``blocks`` use Python's salted ``hash``)
    #: is where replicas that never saw the prompt agree to send it; hashed only then.
    head: str = ""


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """What the engines hold of one prompt: its length in tokens and, per slot whose index is
    exact, the tokens of its leading full blocks there (slots holding none are absent)."""

    prompt_tokens: int
    held: Mapping[SlotKey, int]

    @classmethod
    def reusable(cls, prompt_tokens: int, matched: Mapping[SlotKey, int],
                 block_size: int) -> CachedPrefix:
        """What each slot will reuse of its ``matched`` tokens: a vLLM engine computes at
        least the prompt's last token to get its logits, so it reuses no more than the full
        blocks before that token. A prompt of exactly N cached blocks reuses N - 1; counting
        N would skip a prefill leg whose last block decode then computes anyway."""
        cap = (prompt_tokens - 1) // block_size * block_size if prompt_tokens else 0
        held = {slot: min(tokens, cap) for slot, tokens in matched.items() if min(tokens, cap)}
        return cls(prompt_tokens, held)

    def uncached(self, slot: SlotKey) -> int:
        """The prompt's tokens ``slot`` would have to compute (the prefill bypass reads it)."""
        return self.prompt_tokens - self.held.get(slot, 0)


def longest_held(keys: Sequence[SlotKey], loads: Sequence[int], cached: CachedPrefix,
                 balance: Balance) -> int:
    """``precise_cache_aware``'s preference: the index of the candidate holding the longest
    prefix (the least loaded among equals, then rotation order), or -1 for a miss or when
    that slot is overloaded against the least loaded candidate."""
    held = cached.held
    best, best_tokens = -1, 0
    for index, key in enumerate(keys):
        tokens = held.get(key, 0)
        if tokens > best_tokens or (tokens == best_tokens and tokens
                                    and loads[index] < loads[best]):
            best, best_tokens = index, tokens
    if best < 0 or balance.overloaded(loads[best], min(loads)):
        return -1
    return best


def prefix_hint(text: str) -> PrefixHint:
    """The hint of a prompt's text (only its first ``PREFIX_MAX_BLOCKS`` blocks are read).

    Python's ``hash`` is salted per process, which is fine: the index lives in one process.
    A trailing partial block counts too, so a short prompt still has an identity.
    """
    limit = PREFIX_BLOCK_CHARS * PREFIX_MAX_BLOCKS
    if len(text) > limit:
        text = text[:limit]
    blocks = []
    chained = 0
    for start in range(0, len(text), PREFIX_BLOCK_CHARS):
        chained = hash((chained, text[start:start + PREFIX_BLOCK_CHARS]))
        blocks.append(chained)
    chars = len(text)
    return PrefixHint(tuple(blocks), chars, text[:PREFIX_BLOCK_CHARS])


_MASK64 = (1 << 64) - 1


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text`` that every process computes alike."""
    digest = hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix(x: int) -> int:
    """SplitMix64's finaliser: spreads ``x`` over 64 bits (cheap, stable)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def rendezvous(marks: Sequence[int], anchor: int) -> int:
    """The index of the highest-random-weight slot for ``anchor`` (rendezvous hashing).

    Every replica computes the same winner from the same slots, whatever their order; when a
    slot leaves, only the keys it won move. ``marks`` are the slots' stable hashes."""
    best, best_score = 0, -1
    for index, mark in enumerate(marks):
        score = _mix(mark ^ anchor)
        if score > best_score:
            best, best_score = index, score
    return best


def prompt_text(body: Mapping[str, Any]) -> str:
    """The text a prompt's prefix cache is keyed on: the chat messages in order (role and text;
    a media part by its ``uuid``), or a completion's ``prompt``.

    Not the engine's tokens (the proxy does not tokenize, as SGLang's HTTP router matches
    characters), but two prompts that share a leading text share its tokens too.
    """
    prompt = body.get("prompt")
    if prompt is not None and "messages" not in body:
        return prompt if isinstance(prompt, str) else repr(prompt)
    pieces: list[str] = []
    for message in body.get("messages") or ():
        if not isinstance(message, dict):
            continue
        pieces.append(f"\x00{message.get('role')}\x00")
        content = message.get("content")
        if isinstance(content, str):
            pieces.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    text = part.get("text")
                    pieces.append(text if isinstance(text, str) else f"\x01{part.get('uuid')}\x01")
    return "".join(pieces)


class PrefixIndex:
    """Which slot served which prompt prefix (bounded: ``capacity`` blocks in all)."""

    def __init__(self, capacity: int) -> None:
        self._index = AffinityIndex(capacity)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def held(self) -> dict[SlotKey, int]:
        """Blocks each slot holds (see ``AffinityIndex.held``)."""
        return self._index.held

    def match(
        self, hint: PrefixHint, candidates: Container[SlotKey]
    ) -> tuple[tuple[SlotKey, ...], int]:
        """The candidate slots holding the longest known prefix of ``hint``, and its length in
        characters (``((), 0)`` when none does).

        Walks from the first block while blocks are known, remembering the deepest one with a
        candidate owner (a deeper block may belong only to a slot that is out of rotation).
        """
        best: tuple[SlotKey, ...] = ()
        depth = 0
        # ``peek``, inlined: the LRU order is refreshed by ``record``, which follows.
        peek = self._index._owners.get
        for i, block in enumerate(hint.blocks):
            owners = peek(block)
            if not owners:
                break
            for slot in owners:
                if slot in candidates:
                    best, depth = owners, i + 1
                    break
        best = tuple(s for s in best if s in candidates)
        return best, min(depth * PREFIX_BLOCK_CHARS, hint.chars)

    def record(self, hint: PrefixHint, slot: SlotKey) -> None:
        index = self._index
        owners = index._owners
        for block in hint.blocks:
            # Inlined common case (the block's last owner is this slot again): one dict lookup
            # and an LRU touch per block, without a call (a decision records up to 8 blocks).
            previous = owners.get(block)
            if previous is not None and previous[0] == slot:
                owners.move_to_end(block)
            else:
                index.record(block, slot)


@dataclass(slots=True)
class StagePolicy:
    """One stage's policy and the state it keeps (the affinity index, the random source).

    Owned by the stage's cursor, which calls ``choose`` once per decision with the candidates
    in rotation order; ``cache_aware`` also learns from each decision (the chosen slot now holds
    the prompt, or the item, even when the load diverted it from the preferred one, as
    SGLang's tree does).
    """

    name: str = DEFAULT_POLICY
    balance: Balance = Balance()
    #: ``cache_aware``: the matched share of a prompt above which its prefix slot is preferred.
    cache_threshold: float = 0.3
    #: ``cache_aware``: keys the affinity index keeps (prefix blocks, or media uuids).
    cache_size: int = 65_536
    rng: random.Random | None = None
    #: ``cache_aware`` with several replicas (``EPD_STATE_URL``): a prompt or item that this
    #: replica has not seen goes where rendezvous hashing of its first block (its uuid) puts
    #: it, as on every other replica, instead of to the least loaded slot; so the replicas'
    #: affinities agree without sharing a table, and the hit rate does not fall with their
    #: number. Still within ``balance``.
    placement: bool = False
    _prefixes: PrefixIndex | None = None
    _media: AffinityIndex | None = None
    _marks: dict[SlotKey, int] | None = None

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown policy {self.name!r}: expected one of {', '.join(POLICIES)}")
        if self.rng is None:
            self.rng = random.Random()
        self._prefixes = PrefixIndex(self.cache_size)
        self._media = AffinityIndex(self.cache_size)
        self._marks = {}

    @property
    def reads_loads(self) -> bool:
        """Whether ``choose`` needs the loads (round-robin does not: it costs nothing more)."""
        return self.name != "round_robin"

    def choose(
        self, keys: Sequence[SlotKey], loads: Sequence[int],
        hint: PrefixHint | CachedPrefix | str | None = None, sizes: Sizes | None = None,
    ) -> int:
        """The index (into ``keys``, in rotation order) of the slot to use.

        ``hint`` is the request's ``PrefixHint`` (prefill, decode), what the engines hold of it
        (``CachedPrefix``, for ``precise_cache_aware``) or the item's ``uuid`` (encode);
        without one, ``cache_aware`` is ``least_loaded``. ``sizes`` (the work in
        flight per slot, or a function reading it when needed) break ``least_loaded``'s ties,
        and only those.
        """
        name = self.name
        if name == "round_robin" or len(keys) == 1:
            chosen = 0
        elif name == "least_loaded":
            chosen = least_loaded(loads, sizes)
        elif name == "power_of_two":
            assert self.rng is not None
            chosen = power_of_two(loads, self.rng)
        elif name == "precise_cache_aware" and isinstance(hint, CachedPrefix):
            chosen = longest_held(keys, loads, hint, self.balance)
            if chosen < 0:
                chosen = least_loaded(loads, sizes)
        else:  # cache_aware, and precise_cache_aware without the engines' word (no tokens)
            chosen = self._affine(keys, loads, hint, sizes)
        return chosen

    def _affine(
        self, keys: Sequence[SlotKey], loads: Sequence[int], hint: PrefixHint | str | None,
        sizes: Sizes | None,
    ) -> int:
        assert self._prefixes is not None and self._media is not None
        present = set(keys)
        preferred: tuple[SlotKey, ...] = ()
        if isinstance(hint, PrefixHint) and hint.chars:
            owners, matched = self._prefixes.match(hint, present)
            if matched > self.cache_threshold * hint.chars:
                preferred = owners
        elif isinstance(hint, str):
            preferred = tuple(s for s in self._media.owners(hint) if s in present)
        chosen = -1
        if preferred:
            # The least loaded of the slots that hold it (most recent first among equals).
            index = keys.index
            best = min((index(s) for s in preferred), key=loads.__getitem__)
            if not self.balance.overloaded(loads[best], min(loads)):
                chosen = best
        elif self.placement and hint:
            best = rendezvous(self._marks_of(keys), stable_hash(
                hint.head if isinstance(hint, PrefixHint) else hint))
            if not self.balance.overloaded(loads[best], min(loads)):
                chosen = best
        if chosen < 0:  # a miss, or an overload
            if sizes is None:  # among equally loaded slots, the one holding the least
                held = (self._prefixes if isinstance(hint, PrefixHint) else self._media).held
                sizes = lambda: [held.get(key, 0) for key in keys]  # noqa: E731
            chosen = least_loaded(loads, sizes)
        if isinstance(hint, PrefixHint):
            self._prefixes.record(hint, keys[chosen])
        elif isinstance(hint, str):
            self._media.record(hint, keys[chosen])
        return chosen


    def _marks_of(self, keys: Sequence[SlotKey]) -> list[int]:
        """The slots' stable hashes (computed once per slot ever seen: a roster's worth)."""
        assert self._marks is not None
        marks = self._marks
        found = []
        for key in keys:
            mark = marks.get(key)
            if mark is None:
                mark = marks[key] = stable_hash(f"{key[0]}\n{key[1]}")
            found.append(mark)
        return found


def rotation(length: int, start: int) -> list[int]:
    """The indices ``0..length-1`` in rotation order from ``start`` (the cursor's position)."""
    start %= length
    return [*range(start, length), *range(start)]
