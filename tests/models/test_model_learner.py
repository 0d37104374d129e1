"""The learner's newcomers: an instance is asked when it joins, and again when it joins again."""

from __future__ import annotations

import orjson
import trio

from epd_trio._core.roster import Member, Roster, Served, parse_registration
from epd_trio._models.learner import ModelLearner

MODELS = orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})


def member(url: str) -> Member:
    return parse_registration(orjson.dumps({"role": "decode", "url": url}), 0.0)


async def test_an_instance_that_left_and_came_back_is_asked_again() -> None:
    """Its answer left with it; without it, the instance would serve nothing until the next
    round of everyone, up to ``EPD_MODELS_INTERVAL`` later."""
    a = member("http://a:1")
    roster = Roster(members=(a,))
    asked: list[str] = []
    waiting, go = trio.Event(), trio.Event()

    async def ask(m: Member) -> tuple[int, bytes]:
        asked.append(m.url)
        return 200, MODELS

    async def changed() -> None:  # the test says when the roster changed
        this_go = go
        waiting.set()
        await this_go.wait()

    def apply(answers: dict[str, Served]) -> None:
        pass

    learner = ModelLearner(ask=ask, roster=lambda: roster, apply=apply, changed=changed,
                           interval=3600.0, timeout=5.0, tables={})
    async with trio.open_nursery() as nursery:
        await nursery.start(learner.run)
        assert asked == ["http://a:1"]  # asked once before serving
        for members in ((), (a,)):  # it leaves; then it comes back
            await waiting.wait()  # the learner waits for a change
            roster = Roster(version=roster.version + 1, members=members)
            waiting, released = trio.Event(), go
            go = trio.Event()
            released.set()
        await waiting.wait()
        assert asked == ["http://a:1", "http://a:1"]
        nursery.cancel_scope.cancel()
