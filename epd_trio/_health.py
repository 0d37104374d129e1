"""Instance health and load bookkeeping (no I/O): who is live, who is busy, what failed.

Every configured instance has one ``InstanceState``, owned by the proxy's ``Registry``. Routing
reads ``live``; the background prober (``_prober.py``) and live requests write to it. An instance
leaves the rotation after ``threshold`` consecutive failures (failed probes, or transport failures
of live requests: a refused connection is the fastest possible signal that a server died) and
comes back after one success. Being pure data, the transitions are unit-tested without a clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ._routing import Instance

ROLE_NAMES = ("encode", "prefill", "decode")


@dataclass
class InstanceState:
    """Health and counters for one instance of one role."""

    instance: Instance
    role: str
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

    def record_failure(self, threshold: int) -> bool:
        """One failure; after ``threshold`` in a row, out of the rotation. True when evicted now."""
        self.consecutive_failures += 1
        if self.live and self.consecutive_failures >= threshold:
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
    """All instances by role, and the listeners told when one changes state."""

    threshold: int = 3
    roles: dict[str, list[InstanceState]] = field(default_factory=dict)
    on_change: list[Callable[[InstanceState], None]] = field(default_factory=list)

    @classmethod
    def from_roles(
        cls, roles: dict[str, Iterable[Instance]], threshold: int = 3
    ) -> Registry:
        registry = cls(threshold=threshold)
        for role, instances in roles.items():
            registry.roles[role] = [InstanceState(inst, role) for inst in instances]
        return registry

    def states(self) -> list[InstanceState]:
        return [state for states in self.roles.values() for state in states]

    def state(self, role: str, url: str) -> InstanceState:
        for state in self.roles.get(role, ()):
            if state.url == url:
                return state
        raise KeyError(f"no {role} instance {url}")

    def usable(self, role: str) -> Callable[[Instance], bool]:
        """A predicate for routing: may this instance of ``role`` get a request now?

        The live instances, or, when none of the role is live, all of them ("panic mode", as in
        Envoy): probes can be wrong (a partitioned prober, a too-strict threshold), and trying
        an instance that may be down beats failing every request of the role for sure.
        """
        live = {s.url for s in self.roles.get(role, ()) if s.live}
        if not live:
            return lambda inst: True
        return lambda inst: inst.url in live

    def succeeded(self, state: InstanceState) -> None:
        if state.record_success():
            self._changed(state)

    def failed(self, state: InstanceState) -> None:
        if state.record_failure(self.threshold):
            self._changed(state)

    def _changed(self, state: InstanceState) -> None:
        for listener in self.on_change:
            listener(state)

    def healthy(self) -> bool:
        """Every configured role has at least one live instance."""
        return all(any(s.live for s in states) for states in self.roles.values() if states)

    def ready(self) -> bool:
        """Every configured role has an instance that answered a probe."""
        return all(any(s.probed for s in states) for states in self.roles.values() if states)

    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.states())

    def report(self) -> dict[str, Any]:
        return {role: [s.report() for s in states]
                for role, states in self.roles.items() if states}
