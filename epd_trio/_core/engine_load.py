"""What a vLLM instance says about its own load, read from its ``/metrics`` text.

vLLM (0.32, checked on the CPU build: docs/contributing/upstream-notes/routing-research.md 4.1) exports
per engine, that is per DP rank, with labels ``model_name`` and ``engine="0"``, ``"1"``...:
``vllm:num_requests_running`` (in the batch), ``vllm:num_requests_waiting`` (queued) and
``vllm:kv_cache_usage_perc`` (a fraction from 0 to 1, despite its name; vLLM up to 0.11 also
called it ``vllm:gpu_cache_usage_perc``, read as a fallback). Only these lines are parsed, by
hand: the core imports no Prometheus library, and the rest of a real ``/metrics`` page (hundreds
of histogram lines) is skipped by a prefix test.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
_NAMES = (RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD)
#: vLLM's gauge of the LoRA adapters an engine runs and queues: one series per state change,
#: its value the time of the change (the largest value is the newest).
LORA_INFO = "vllm:lora_requests_info"
_LABEL = re.compile(r'(?P<key>\w+)="(?P<value>[^"]*)"')
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_ENGINE = re.compile(r'(?:^|,)\s*engine="(?P<engine>[^"]*)"')


@dataclass(slots=True)
class EngineLoad:
    """One engine's (DP rank's) reported load."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0

    @property
    def requests(self) -> int:
        """Requests the engine holds, running or queued: what the policies compare."""
        return round(self.running + self.waiting)


def engine_loads(text: str) -> dict[str, EngineLoad]:
    """The load of each engine a ``/metrics`` page reports, by its ``engine`` label (``""`` when
    a series has none). Malformed values are skipped, never an error: a scrape is a hint."""
    loads: dict[str, EngineLoad] = {}
    for line in text.splitlines():
        if not line.startswith(_NAMES):
            continue
        match = _SAMPLE.match(line)
        if match is None or match["name"] not in _NAMES:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        if not math.isfinite(value):  # Prometheus text allows NaN and +Inf; round() does not
            continue
        engine = _ENGINE.search(match["labels"] or "")
        load = loads.setdefault(engine["engine"] if engine else "", EngineLoad())
        name = match["name"]
        if name == RUNNING:
            load.running += value
        elif name == WAITING:
            load.waiting += value
        elif name == KV_USAGE or not load.kv_usage:
            load.kv_usage = value
    return loads


def rank_loads(loads: dict[str, EngineLoad], dp_size: int) -> dict[int | None, int]:
    """Requests per routing rank of an instance with ``dp_size`` ranks: each engine's own when
    it has DP ranks (engines outside ``[0, dp_size)`` are ignored), the sum under rank None
    when it has one."""
    if dp_size == 1:
        return {None: sum(load.requests for load in loads.values())}
    ranks: dict[int | None, int] = {}
    for engine, load in loads.items():
        if engine.isdigit() and int(engine) < dp_size:
            ranks[int(engine)] = load.requests
    return ranks


@dataclass(frozen=True, slots=True)
class LoraState:
    """The LoRA adapters an instance runs and queues now, and how many it may hold at once."""

    running: frozenset[str]
    waiting: frozenset[str]
    max_lora: int


def lora_state(text: str) -> LoraState | None:
    """The newest ``vllm:lora_requests_info`` series of a ``/metrics`` page (its labels
    ``running_lora_adapters``, ``waiting_lora_adapters``, ``max_lora``), None without one."""
    newest: tuple[float, str] | None = None
    for line in text.splitlines():
        if not line.startswith(LORA_INFO):
            continue
        match = _SAMPLE.match(line)
        if match is None or match["name"] != LORA_INFO:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        if math.isfinite(value) and (newest is None or value > newest[0]):
            newest = (value, match["labels"] or "")
    if newest is None:
        return None
    labels = {m["key"]: m["value"] for m in _LABEL.finditer(newest[1])}

    def names(key: str) -> frozenset[str]:
        return frozenset(n.strip() for n in labels.get(key, "").split(",") if n.strip())

    raw_max = labels.get("max_lora", "")
    return LoraState(names("running_lora_adapters"), names("waiting_lora_adapters"),
                     int(raw_max) if raw_max.isdigit() else 0)


def adapter_ranks(adapter: str, holders: frozenset[str],
                  states: dict[str, LoraState]) -> list[frozenset[str]]:
    """An adapter's holders in the order to prefer them: those running it, then those with
    room for one more (running + waiting below ``max_lora``), then those queueing it, then the
    rest (no state read: the scrape is off, or failed there). Empty ranks left out; the
    pool's policy chooses within a rank."""
    ranks: list[set[str]] = [set(), set(), set(), set()]
    for url in holders:
        state = states.get(url)
        if state is None:
            ranks[3].add(url)
        elif adapter in state.running:
            ranks[0].add(url)
        elif len(state.running) + len(state.waiting) < state.max_lora:
            ranks[1].add(url)
        elif adapter in state.waiting:
            ranks[2].add(url)
        else:
            ranks[3].add(url)
    return [frozenset(rank) for rank in ranks if rank]
