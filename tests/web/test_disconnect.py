"""A client that goes away cancels every upstream leg of its request, whatever the stage."""

from __future__ import annotations

import httpx
import pytest
import trio
import trio.testing

from epd_trio.testing import Cluster, FakeVLLM, run_cluster

from helpers import CHAT, chat_body, client_cancels, image, metric


def _stage_target(c: Cluster, stage: str) -> FakeVLLM:
    return {"encode": c.encoders[0], "prefill": c.prefills[0]}.get(stage, c.decodes[0])


@pytest.mark.parametrize("server", ["epd-trio serve", "plain hypercorn"])
@pytest.mark.parametrize("stage", ["encode", "prefill", "decode", "decode-stream"])
async def test_client_disconnect_cancels_the_upstream_leg(
    client: httpx.AsyncClient, stage: str, server: str
) -> None:
    """Under ``epd-trio serve`` the connection tells the request its client left; under plain
    Hypercorn the request's own watcher hears ``http.disconnect``: either way, at every stage."""
    plain = server == "plain hypercorn"
    async with run_cluster(encoders=1, prefills=1, decodes=1, plain_hypercorn=plain) as c:
        target = _stage_target(c, stage)
        stream = stage == "decode-stream"
        if stream:
            target.behaviour.chunk_delay = 3600  # first chunk, then silence
        else:
            target.behaviour.hang = True
        body = chat_body(image(1), stream=stream)
        first_byte = trio.Event()

        async def request(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
            with trio.CancelScope() as scope:
                task_status.started(scope)
                async with client.stream("POST", c.proxy_url + CHAT, json=body) as r:
                    async for _ in r.aiter_raw():
                        first_byte.set()

        async with trio.open_nursery() as nursery:
            scope = await nursery.start(request)
            with trio.fail_after(10):
                if stream:
                    await first_byte.wait()
                else:
                    await target.wait_until(lambda: target.in_flight == 1)
                scope.cancel()  # the client closes its connection
                await target.wait_until(lambda: target.disconnects == 1)
        await trio.testing.wait_all_tasks_blocked()
        assert target.in_flight == 0
        assert c.proxy.registry.in_flight() == 0
        assert client_cancels(c.proxy) == {stage.removesuffix("-stream"): 1}
        assert metric(c.proxy, "epd_trio_requests_total", endpoint=CHAT,
                                     outcome="cancelled") == 1
        later = [f for f in c.fakes if f is not target and f.requests()]
        order = [*c.encoders, *c.prefills, *c.decodes]
        assert all(order.index(f) < order.index(target) for f in later)  # no later stage ran
