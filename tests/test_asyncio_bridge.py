"""The asyncio bridge: asyncio code drives the encoder fan-out and the cursors over real sockets.

Each test starts fake encoders on Trio, then runs an asyncio "program" on trio-asyncio's loop
(what ``asyncio_bridge.run`` does for a real program); the program only uses asyncio and the
bridge, except where it waits for a fake's state (``until``), which runs on the Trio side.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio
import trio_asyncio

from epd_trio import BadRequest, Instance, Settings, UpstreamStatusError
from epd_trio.asyncio_bridge import AsyncioBridge, Encoded, run
from epd_trio.testing import FakeVLLM

from helpers import chat_body, image, start_fakes, url_uuid

PREFILLS = (Instance("http://p0:8000", 2), Instance("http://p1:8000", 2))
DECODES = (Instance("http://d0:8000", 2), Instance("http://d1:8000", 2))


async def start_encoders(nursery: trio.Nursery, count: int) -> list[FakeVLLM]:
    return await start_fakes(nursery, *(FakeVLLM("encode") for _ in range(count)))


def settings_for(encoders: list[FakeVLLM], **overrides: Any) -> Settings:
    return Settings(encode_urls=tuple(Instance(f.url) for f in encoders), prefill_urls=PREFILLS,
                    decode_urls=DECODES, **overrides)


async def run_asyncio(program: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
    """Run an asyncio coroutine function on a trio-asyncio loop, as ``asyncio_bridge.run`` does."""
    async with trio_asyncio.open_loop():
        with trio.fail_after(20):
            return await trio_asyncio.aio_as_trio(program)(*args)


def until(fake: FakeVLLM, predicate: Callable[[], bool]) -> Awaitable[None]:
    """From asyncio code: wait until ``predicate`` holds at ``fake`` (no sleeping)."""
    return trio_asyncio.trio_as_aio(fake.wait_until)(predicate)


def encoded_uuids(fake: FakeVLLM) -> list[str]:
    """The uuids of the items ``fake`` was asked to encode, in arrival order."""
    return [part["uuid"] for r in fake.requests()
            for part in r.body["messages"][0]["content"]]


async def test_asyncio_program_encodes_round_robin_across_calls(nursery: trio.Nursery) -> None:
    encoders = await start_encoders(nursery, 3)
    counts = [2, 1, 3, 1]
    bodies, n = [], 0
    for count in counts:
        bodies.append(chat_body(*(image(n + i) for i in range(count))))
        n += count

    async def program() -> tuple[list[Encoded], list[Any], list[Any], list[Instance]]:
        async with AsyncioBridge(settings_for(encoders)) as bridge:
            results = [await bridge.encode(body, request_id=f"req{k}")
                       for k, body in enumerate(bodies)]
            with pytest.raises(BadRequest, match="'messages' is required"):
                await bridge.encode({"model": "fake-model"})
            prefills = [bridge.next_prefill() for _ in range(5)]
            decodes = [bridge.next_decode() for _ in range(2)]
            assigned = await bridge.assign_encoders(2)
        return results, prefills, decodes, assigned

    results, prefills, decodes, assigned = await run_asyncio(program)

    # Item g (counting over all calls) went to encoder g % 3: the cursor persisted across calls.
    all_items = [image(g) for g in range(sum(counts))]
    for e, fake in enumerate(encoders):
        assert encoded_uuids(fake) == [url_uuid(p) for p in all_items[e::3]]
    first = results[0]
    assert [c.instance.url for c in first.calls] == [encoders[0].url, encoders[1].url]
    assert [c.item_indices for c in first.calls] == [(0,), (1,)]
    assert first.request_id == "req0"
    assert encoders[0].requests()[0].request_id == "req0-enc-0"
    # The returned body carries the uuids (for prefill/decode); the caller's body is untouched.
    assert [p["uuid"] for p in first.items] == [url_uuid(image(0)), url_uuid(image(1))]
    assert first.body["messages"][0]["content"][:2] == first.items
    assert "uuid" not in bodies[0]["messages"][0]["content"][0]
    # Flat interleaved DP slots, prefill and decode on their own counters.
    p0, p1 = PREFILLS
    assert prefills == [(p0, 0), (p1, 0), (p0, 1), (p1, 1), (p0, 0)]
    assert decodes == [(DECODES[0], 0), (DECODES[1], 0)]
    assert [e.url for e in assigned] == [encoders[1].url, encoders[2].url]  # 7 items so far


async def test_failing_encoder_cancels_siblings_and_raises_one_error(
    nursery: trio.Nursery,
) -> None:
    encoders = await start_encoders(nursery, 3)
    slow = [encoders[0], encoders[2]]
    for fake in slow:
        fake.behaviour.hang = True

    async def others_in_flight() -> None:  # fail only once both siblings are in flight
        for fake in slow:
            await fake.wait_until(lambda f=fake: f.in_flight == 1)

    encoders[1].behaviour.fail_status = 500
    encoders[1].behaviour.gate = others_in_flight

    async def program() -> UpstreamStatusError:
        async with AsyncioBridge(settings_for(encoders, max_attempts=1)) as bridge:
            with pytest.raises(UpstreamStatusError) as info:  # one error, not a group
                await bridge.encode(chat_body(image(0), image(1), image(2)))
        return info.value

    error = await run_asyncio(program)
    assert (error.stage, error.instance, error.status) == ("encode", encoders[1].url, 502)
    assert "items [1]" in error.message and "HTTP 500" in error.message
    with trio.fail_after(10):
        for fake in slow:
            await fake.wait_until(lambda f=fake: f.disconnects == 1)  # siblings were cancelled
    assert all(f.in_flight == 0 for f in encoders)


async def test_cancelling_the_asyncio_task_closes_the_upstream_requests(
    nursery: trio.Nursery,
) -> None:
    encoders = await start_encoders(nursery, 2)
    for fake in encoders:
        fake.behaviour.hang = True

    async def program() -> Encoded:
        async with AsyncioBridge(settings_for(encoders)) as bridge:
            task = asyncio.ensure_future(bridge.encode(chat_body(image(0), image(1))))
            for fake in encoders:
                await until(fake, lambda f=fake: f.in_flight == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for fake in encoders:  # the cancellation reached every upstream request
                await until(fake, lambda f=fake: f.disconnects == 1)
                fake.behaviour.hang = False
            return await bridge.encode(chat_body(image(2)))  # the bridge still works

    after = await run_asyncio(program)
    assert [c.instance.url for c in after.calls] == [encoders[0].url]  # cursor moved on by 2
    assert all(f.in_flight == 0 for f in encoders)


async def test_a_loop_trio_asyncio_does_not_drive_is_refused() -> None:
    async def program() -> None:
        async with AsyncioBridge(Settings(decode_urls=DECODES)):
            pass  # pragma: no cover

    def in_thread() -> None:
        with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
            runner.run(program())

    with pytest.raises(RuntimeError, match=r"needs trio-asyncio's loop.*asyncio_bridge\.run"):
        await trio.to_thread.run_sync(in_thread)


def test_run_returns_and_raises_like_asyncio_run() -> None:
    async def add(x: int, *, y: int) -> int:
        await asyncio.sleep(0)
        assert isinstance(asyncio.get_running_loop(), trio_asyncio.TrioEventLoop)
        return x + y

    async def fail() -> None:
        await asyncio.sleep(0)
        raise KeyError("boom")

    assert run(add, 1, y=2) == 3
    with pytest.raises(KeyError, match="boom"):  # the exception itself, not a group
        run(fail)


async def test_an_asyncio_program_started_with_run(nursery: trio.Nursery) -> None:
    encoders = await start_encoders(nursery, 2)
    urls = [image(n)["image_url"]["url"] for n in range(3)]
    env = {**os.environ, "EPD_ENCODE_URLS": ",".join(f.url for f in encoders),
           "EPD_DECODE_URLS": "http://d0:8000#dp=2"}
    program = Path(__file__).with_name("asyncio_program.py")
    with trio.fail_after(30):
        done = await trio.run_process([sys.executable, str(program), *urls], env=env,
                                      capture_stdout=True, stderr=subprocess.STDOUT, check=False)
    assert done.returncode == 0, done.stdout.decode()
    lines = [orjson.loads(line) for line in done.stdout.splitlines()]
    assert [line["encoder"] for line in lines] == [encoders[n % 2].url for n in range(3)]
    assert [line["uuid"] for line in lines] == [url_uuid(image(n)) for n in range(3)]
    assert [(line["decode"], line["rank"]) for line in lines] == [
        ("http://d0:8000", 0), ("http://d0:8000", 1), ("http://d0:8000", 0)]
    assert encoded_uuids(encoders[0]) == [url_uuid(image(0)), url_uuid(image(2))]


async def test_importing_after_anyio_asyncio_backend_warns() -> None:
    script = ("import warnings, anyio._backends._asyncio\n"
              "with warnings.catch_warnings(record=True) as seen:\n"
              "    warnings.simplefilter('always')\n"
              "    import epd_trio.asyncio_bridge\n"
              "print([str(w.message) for w in seen if w.category is RuntimeWarning])\n")
    with trio.fail_after(30):
        done = await trio.run_process([sys.executable, "-c", script], capture_stdout=True)
    assert b"anyio's asyncio backend was imported before trio-asyncio" in done.stdout


async def test_a_cancellation_during_a_shielded_trio_step_still_reaches_the_task(
    nursery: trio.Nursery,
) -> None:
    """trio-asyncio reports a cancelled task only if Trio raised Cancelled: a bridged call that
    finishes inside a shield (closing connections does) must not swallow the cancellation."""
    encoders = await start_encoders(nursery, 1)
    started, release = trio.Event(), trio.Event()

    async def shielded_step() -> str:
        with trio.CancelScope(shield=True):
            started.set()
            await release.wait()
        return "finished"

    async def program() -> None:
        async with AsyncioBridge(settings_for(encoders)) as bridge:
            task = asyncio.ensure_future(bridge._call(shielded_step))
            await trio_asyncio.trio_as_aio(started.wait)()
            task.cancel()
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task

    await run_asyncio(program)
