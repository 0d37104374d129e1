"""Instance health and load bookkeeping (no I/O): who is live, who is busy, what failed.

Every instance in the roster (``_roster.py``: configured or registered) has one
``InstanceState``, owned by the proxy's ``Registry``. Routing reads ``live``; the background
prober (``_upstream/prober.py``) and live requests write to it; ``set_members`` follows roster changes
and keeps the state (health, counters) of the instances that stay. An instance leaves the
rotation after ``threshold`` consecutive failures (failed probes, or transport failures of live
requests), or at once when a live request's connection is refused: nothing listens there, the
surest signal that a server died. It comes back after one success. Being pure data, the
transitions are unit-tested without a clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .routing import Instance


@dataclass
class InstanceState:
    """Health and counters for one instance of one stage."""

    instance: Instance
    stage: str
    #: In the rotation. Instances start live, so traffic flows before the first probe answers.
    live: bool = True
    #: Answered at least one probe successfully (readiness).
    probed: bool = False
    consecutive_failures: int = 0
    #: Upstream requests to this instance that are open right now.
    in_flight: int = 0
    #: Upstream requests sent to it, in total (all attempts, retries included).
    sent: int = 0
    #: Failed upstream requests (transport errors, timeouts, 5xx).
    errors: int = 0
    #: Times it left the rotation.
    evictions: int = 0
    #: When it last left the rotation (the registry's clock), while it is out.
    evicted_since: float | None = None

    @property
    def url(self) -> str:
        return self.instance.url

    def record_success(self) -> bool:
        """One success: back in the rotation. Returns True when that changed ``live``."""
        self.consecutive_failures = 0
        self.probed = True
        changed = not self.live
        self.live = True
        return changed

    def record_failure(self, threshold: int, *, down: bool = False) -> bool:
        """One failure; after ``threshold`` in a row, or at once when it shows the instance
        ``down`` (a refused connection: nothing listens), out of the rotation. True when
        evicted now."""
        self.consecutive_failures += 1
        if self.live and (down or self.consecutive_failures >= threshold):
            self.live = False
            self.evictions += 1
            return True
        return False

    def report(self) -> dict[str, Any]:
        return {
            "url": self.url, "dp_size": self.instance.dp_size,
            "state": "healthy" if self.live else "unhealthy", "probed": self.probed,
            "consecutive_failures": self.consecutive_failures, "in_flight": self.in_flight,
            "sent": self.sent, "errors": self.errors,
        }


@dataclass
class Registry:
    """All instances by stage, and the listeners told when one changes state.

    ``usable(stage)`` predicates read the live set of the stage when called, so a predicate made
    before a health or membership change still answers for the registry as it is now.
    """

    threshold: int = 3
    stages: dict[str, list[InstanceState]] = field(default_factory=dict)
    on_change: list[Callable[[InstanceState], None]] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic
    _index: dict[tuple[str, str], InstanceState] = field(default_factory=dict, repr=False)
    _live: dict[str, set[str]] = field(default_factory=dict, repr=False)
    #: Every stage has had an instance answer a probe once (``ready``'s start-up gate).
    _settled: bool = field(default=False, repr=False)

    @classmethod
    def from_stages(
        cls, stages: dict[str, Iterable[Instance]], threshold: int = 3
    ) -> Registry:
        registry = cls(threshold=threshold)
        registry.set_members({stage: list(instances) for stage, instances in stages.items()})
        return registry

    def set_members(self, stages: Mapping[str, Sequence[Instance]]) -> list[InstanceState]:
        """Follow a roster change: keep the states of instances that stay, add new ones.

        Returns the states of the instances that left (their in-flight requests finish; the
        proxy retires their upstream clients).
        """
        gone = dict(self._index)
        for stage, instances in stages.items():
            states = []
            for inst in instances:
                state = gone.pop((stage, inst.url), None)
                if state is None:
                    state = InstanceState(inst, stage)
                state.instance = inst  # its dp_size may have changed
                states.append(state)
            self.stages[stage] = states
        self._index = {(s.stage, s.url): s for states in self.stages.values() for s in states}
        for stage in self.stages:
            self._refresh_live(stage)
        return list(gone.values())

    def _refresh_live(self, stage: str) -> None:
        live = self._live.setdefault(stage, set())  # updated in place: predicates hold it
        live.clear()
        live.update(s.url for s in self.stages.get(stage, ()) if s.live)

    def states(self) -> list[InstanceState]:
        return [state for states in self.stages.values() for state in states]

    def state(self, stage: str, url: str) -> InstanceState:
        state = self._index.get((stage, url))
        if state is None:
            raise KeyError(f"no {stage} instance {url}")
        return state

    def state_for(self, stage: str, instance: Instance) -> InstanceState:
        """The state of ``instance``, or a detached one if it has just left the roster (a request
        that picked it before finishes there; its counts no longer matter)."""
        state = self._index.get((stage, instance.url))
        return state if state is not None else InstanceState(instance, stage)

    def has(self, stage: str) -> bool:
        return bool(self.stages.get(stage))

    def usable(self, stage: str) -> Callable[[Instance], bool]:
        """A predicate for routing: may this instance of ``stage`` get a request now?

        The live instances, or, when none of the stage is live, all of them ("panic mode", as in
        Envoy): probes can be wrong (a partitioned prober, a too-strict threshold), and trying
        an instance that may be down beats failing every request of the stage for sure.
        """
        live = self._live.setdefault(stage, set())
        return lambda inst: not live or inst.url in live

    def succeeded(self, state: InstanceState) -> None:
        if state.record_success():
            state.evicted_since = None
            self._changed(state)
        if not self._settled:
            self._settled = self._all_probed()

    def failed(self, state: InstanceState, *, down: bool = False) -> None:
        if state.record_failure(self.threshold, down=down):
            state.evicted_since = self.clock()
            self._changed(state)

    def _changed(self, state: InstanceState) -> None:
        if self._index.get((state.stage, state.url)) is not state:
            return  # it left the roster while a probe or request was under way
        self._refresh_live(state.stage)
        for listener in self.on_change:
            listener(state)

    def evicted(self) -> dict[str, float]:
        """The URLs out of rotation, and since when."""
        return {s.url: s.evicted_since for s in self.states()
                if not s.live and s.evicted_since is not None}

    def status(self) -> str:
        """The overall state for ``/health``: ``ok`` (every instance in rotation), ``degraded``
        (some out, but every stage still has a live one), ``unavailable`` (no decode-side
        instance, or a stage with none live: its requests run on panic mode, or fail)."""
        if not self.healthy():
            return "unavailable"
        return "ok" if all(s.live for s in self.states()) else "degraded"

    def healthy(self) -> bool:
        """There is a decode-side instance, and every stage has at least one live instance."""
        return self.has("decode") and all(
            any(s.live for s in states) for states in self.stages.values() if states)

    def ready(self) -> bool:
        """Whether every stage can serve now (``/ready``).

        At start, until every stage has had an instance answer a probe, so a new proxy gets
        no traffic before it has seen its instances work. From then on, ``healthy``: every
        stage has an instance in rotation. Not "probed" then: an instance registered later
        starts in rotation and serves at once, and gating readiness on its first probe pulled
        the proxy out of its Service for a health interval each time an encoder scaled up (and
        each worker, probing on its own clock, said something else meanwhile).
        """
        if not self._settled:
            self._settled = self._all_probed()
        return self._settled and self.healthy()

    def _all_probed(self) -> bool:
        return self.has("decode") and all(
            any(s.probed for s in states) for states in self.stages.values() if states)

    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.states())

    def report(self) -> dict[str, Any]:
        return {stage: [s.report() for s in states]
                for stage, states in self.stages.items() if states}
