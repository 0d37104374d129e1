"""The shell of the model registry: every instance asked what it serves (``GET /v1/models``).

Each instance is asked once when it joins (however it joined: listed, registered, discovered,
MoRIIO) and every ``EPD_MODELS_INTERVAL`` seconds after, all of them at once with a bounded
concurrency and ``EPD_HEALTH_TIMEOUT`` each. Every round's answers are applied in one roster
change (``apply``): a pool changes when an instance's answer does, not at every round. One
process asks for those that share a roster (the one that runs discovery); the others see the
answers in the roster they pull.

Resource handling: ``run`` owns one nursery per round; nothing outlives it. Error handling: an
instance that does not answer keeps what it said last (``cards``); each change of what an
instance serves, or of whether it answers, is one log line, not one per round.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from .._core.errors import UpstreamError
from .._core.roster import Member, Roster, Served
from .cards import NoAnswer, base_names, served_from
from .pools import unserved_pins
from .tables import PoolTable

log = logging.getLogger("epd_trio")

#: The call to one instance: its ``/v1/models`` status and body (``UpstreamError`` for no
#: HTTP answer at all).
Ask = Callable[[Member], Awaitable[tuple[int, bytes]]]
#: Instances asked at once in a round: a fleet of hundreds is asked in a few waves.
CONCURRENCY = 32


class ModelLearner:
    """Asks the roster's instances what they serve and applies the answers (see the module)."""

    def __init__(
        self, *, ask: Ask, roster: Callable[[], Roster],
        apply: Callable[[Mapping[str, Served]], None],
        changed: Callable[[], Awaitable[None]], interval: float, timeout: float,
        tables: Mapping[str, PoolTable],
    ) -> None:
        self._ask = ask
        self._roster = roster
        self._apply = apply
        self._changed = changed
        self._interval = interval
        self._timeout = timeout
        self._tables = tables
        self._limiter = trio.CapacityLimiter(CONCURRENCY)
        #: What each instance said last, as logged (a change of it is one line).
        self._said: dict[str, str] = {}
        self._pins: set[tuple[str, str]] = set()
        #: Instances asked since they joined (a join is asked at once, not at the next round).
        self._asked: set[str] = set()
        #: Rounds done (tests wait on it).
        self.rounds = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Ask every instance once, report started, then ask the newcomers at each roster
        change and everyone every interval, until cancelled."""
        await self.round()
        task_status.started()
        while True:
            deadline = trio.current_time() + self._interval
            with trio.move_on_at(deadline):
                while True:
                    # Newcomers first, then wait: one that joined during a round was not
                    # waited for (its change woke nobody), and must not wait an interval.
                    newcomers = self._newcomers()
                    if newcomers:
                        await self.round(newcomers)
                    else:
                        await self._changed()
            await self.round()

    def _newcomers(self) -> list[Member]:
        """The instances not asked since they joined. An instance that left is forgotten here
        too, so that it is asked again when it comes back (its answer left with it)."""
        members = self._roster().members
        self._asked &= {m.url for m in members}
        return [m for m in members if m.url not in self._asked]

    async def round(self, members: list[Member] | None = None) -> None:
        """Ask ``members`` (default: every instance) at once; apply what they answered."""
        roster = self._roster()
        targets = list(roster.members) if members is None else members
        self._asked = {m.url for m in roster.members} & (self._asked | {m.url for m in targets})
        answers: dict[str, Served] = {}

        async def one(member: Member) -> None:
            async with self._limiter:
                served = await self._one(member)
            if served is not _NO_ANSWER:
                answers[member.url] = served  # type: ignore[assignment]

        async with trio.open_nursery() as nursery:
            for member in targets:
                nursery.start_soon(one, member)
        if answers:
            self._apply(answers)
        self._say_pins()
        self.rounds += 1

    async def _one(self, member: Member) -> Served | object:
        why = None
        with trio.move_on_after(self._timeout) as scope:
            try:
                status, content = await self._ask(member)
                served = served_from(status, content)
            except (UpstreamError, NoAnswer) as exc:
                why = str(exc)
        if scope.cancelled_caught:
            why = f"no answer within {self._timeout:g} s"
        if why is not None:
            self._say(member, "no", f"{member.role} instance {member.url} did not say what it "
                      f"serves (GET /v1/models: {why})" + (
                          "; it keeps its last answer" if member.url in self._roster().served
                          else "; it serves no model until it answers"), logging.WARNING)
            return _NO_ANSWER
        if served is None:
            self._say(member, "any", f"{member.role} instance {member.url} has no /v1/models "
                      "route (404): it serves any model name in its role", logging.INFO)
        else:
            names = ", ".join(base_names(served)) or "nothing"
            adapters = [c.id for c in served if c.parent is not None]
            self._say(member, names + "|" + ",".join(adapters),
                      f"{member.role} instance {member.url} serves {names}" + (
                          f" (adapters: {', '.join(adapters)})" if adapters else ""), logging.INFO)
        return served

    def _say(self, member: Member, what: str, line: str, level: int) -> None:
        if self._said.get(member.url) != what:
            self._said[member.url] = what
            log.log(level, "%s", line)

    def _say_pins(self) -> None:
        roster = self._roster()
        pins = set(unserved_pins(roster, self._tables))
        for model, url in sorted(pins - self._pins):
            names = ", ".join(base_names(roster.served.get(url))) or "nothing"
            log.warning("instance %s is listed in [models.%s] but serves %s, not %s: out of "
                        "rotation for %s", url, model, names, model, model)
        self._pins = pins


_NO_ANSWER: Any = object()
