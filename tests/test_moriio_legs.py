"""MoRIIO legs end to end: registered fakes that check each leg as vLLM's connector reads it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from epd_trio.testing import Behaviour, Cluster, FakeVLLM, run_moriio_cluster
from epd_trio.testing.moriio import peer_addresses

from helpers import CHAT, chat_body, client_cancels, retries


@asynccontextmanager
async def moriio_cluster(mode: str, **layout: Any) -> AsyncIterator[Cluster]:
    """Fake prefill/decode instances speaking MoRIIO, registered over ZMQ with the proxy; the
    decodes have TP2, so each leg's remote sizes tell the two sides apart."""
    async with run_moriio_cluster(mode=mode, decode_tp=2, **layout) as cluster:  # type: ignore[arg-type]
        yield cluster


INJECTED = {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "evil.example",
                                   "remote_block_ids": [9], "transfer_id": "client"},
            "ec_transfer_params": {"consumer_zmq": "tcp://evil.example:1"}}
INJECTED_HEADERS = {"x-request-id": "client-7", "x-data-parallel-rank": "5",
                    "x-prefiller-host-port": "evil.example:1"}


def check_request_id(leg: Any, prefill: FakeVLLM, decode: FakeVLLM) -> None:
    assert prefill.moriio is not None and decode.moriio is not None
    assert peer_addresses(leg.request_id) == (prefill.moriio.zmq_address,
                                              decode.moriio.zmq_address)
    assert peer_addresses(f"chatcmpl-{leg.request_id}-0a1b2c3d") == peer_addresses(leg.request_id)


async def test_read_mode_runs_prefill_then_decode_with_the_handle(
    client: httpx.AsyncClient,
) -> None:
    async with moriio_cluster("READ", prefill_dp=2) as c:
        (prefill,), (decode,) = c.prefills, c.decodes
        for n, stream in enumerate((False, True)):
            r = await client.post(c.proxy_url + CHAT, json=chat_body(stream=stream, **INJECTED),
                                  headers=INJECTED_HEADERS)
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == "client-7"  # the client's id comes back
            if stream:
                assert r.text.endswith("data: [DONE]\n\n")
            p_leg, d_leg = prefill.requests()[n], decode.requests()[n]
            assert p_leg.request_id == d_leg.request_id
            check_request_id(p_leg, prefill, decode)
            sent = p_leg.body["kv_transfer_params"]
            assert sent == {"do_remote_decode": True, "do_remote_prefill": False,
                            "remote_engine_id": None, "remote_block_ids": None,
                            "transfer_id": sent["transfer_id"], "remote_dp_size": 1,
                            "remote_tp_size": 2}
            assert p_leg.body["stream"] is False and p_leg.body["max_tokens"] == 1
            assert "ec_transfer_params" not in p_leg.body
            assert p_leg.rank == n  # prefill is DP2: the flat rotation walks its ranks
            got = d_leg.body["kv_transfer_params"]
            assert got == {"do_remote_decode": False, "do_remote_prefill": True,
                           "remote_engine_id": "127.0.0.1:6300", "remote_block_ids": [1, 2, 3],
                           "transfer_id": sent["transfer_id"], "remote_dp_size": 2,
                           "remote_tp_size": 1, "remote_dp_rank": n}
            assert d_leg.rank is None and "x-prefiller-host-port" not in d_leg.headers
            assert "ec_transfer_params" not in d_leg.body
        assert prefill.requests()[0].body["kv_transfer_params"]["transfer_id"] != sent["transfer_id"]


async def test_write_mode_runs_both_legs_at_once(client: httpx.AsyncClient) -> None:
    release = trio.Event()
    async with moriio_cluster("WRITE", decode_dp=2) as c:
        (prefill,), (decode,) = c.prefills, c.decodes
        prefill.behaviour = Behaviour(gate=release.wait)
        async with trio.open_nursery() as nursery:
            replies: list[httpx.Response] = []

            async def call() -> None:
                replies.append(await client.post(c.proxy_url + CHAT, json=chat_body(stream=True)))

            nursery.start_soon(call)
            # Both in flight together: decode waits for the KV the held prefill will push.
            await decode.wait_until(lambda: decode.in_flight == 1)
            await prefill.wait_until(lambda: prefill.in_flight == 1)
            release.set()
        (r,) = replies
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        p_leg, d_leg = prefill.requests()[0], decode.requests()[0]
        check_request_id(p_leg, prefill, decode)
        assert p_leg.request_id == d_leg.request_id
        got = d_leg.body["kv_transfer_params"]
        assert got["remote_block_ids"] is None and got["remote_engine_id"] is None
        assert got["transfer_id"] == p_leg.body["kv_transfer_params"]["transfer_id"]
        assert "remote_dp_rank" not in got  # the prefill is not DP
        assert p_leg.body["kv_transfer_params"]["remote_dp_size"] == 2
        assert p_leg.rank is None and d_leg.rank == 0  # decode is DP2: its own rank header


async def test_a_write_prefill_failure_cancels_decode_and_fails_over(
    client: httpx.AsyncClient,
) -> None:
    async with moriio_cluster("WRITE", prefills=2) as c:
        (decode,) = c.decodes
        first = trio.Event()

        async def hold() -> None:
            await first.wait()

        for fake in c.prefills:  # the first attempt's prefill, whichever it is, fails
            fake.behaviour = Behaviour(fail_status=500, fail_count=1, gate=hold)
        async with trio.open_nursery() as nursery:
            replies: list[httpx.Response] = []

            async def call() -> None:
                replies.append(await client.post(c.proxy_url + CHAT, json=chat_body()))

            nursery.start_soon(call)
            await decode.wait_until(lambda: decode.in_flight == 1)
            for fake in c.prefills:  # the second attempt's prefill must not fail
                if not fake.requests():
                    fake.behaviour = Behaviour()
            first.set()
        (r,) = replies
        assert r.status_code == 200, r.text
        legs = decode.requests()
        assert len(legs) == 2 and legs[0].disconnected and not legs[1].disconnected
        used = [f for f in c.prefills if f.requests()]
        assert len(used) == 2  # the retry went to the other prefill
        # The prefill failed: a prefill failover, even though the whole attempt (decode too)
        # was re-run.
        assert retries(c.proxy) == {"prefill": 1}
        assert legs[0].request_id != legs[1].request_id


async def test_a_write_prefill_failure_with_nowhere_to_go_is_a_502_naming_prefill(
    client: httpx.AsyncClient,
) -> None:
    async with moriio_cluster("WRITE", decode_retries=0) as c:
        (prefill,), (decode,) = c.prefills, c.decodes
        prefill.behaviour = Behaviour(fail_status=500)
        r = await client.post(c.proxy_url + CHAT, json=chat_body(stream=True))
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["stage"] == "prefill" and error["instance"] == prefill.url
        await decode.wait_until(lambda: decode.disconnects == 1)  # not left waiting for KV


async def test_a_client_disconnect_during_write_cancels_both_legs() -> None:
    async with moriio_cluster("WRITE") as c:
        (prefill,), (decode,) = c.prefills, c.decodes
        prefill.behaviour = Behaviour(hang=True)
        async with httpx.AsyncClient(timeout=30, trust_env=False) as own, \
                trio.open_nursery() as nursery:

            async def call() -> None:
                await own.post(c.proxy_url + CHAT, json=chat_body(stream=True))

            nursery.start_soon(call)
            await decode.wait_until(lambda: decode.in_flight == 1)
            await prefill.wait_until(lambda: prefill.in_flight == 1)
            nursery.cancel_scope.cancel()  # the client goes away
        await prefill.wait_until(lambda: prefill.disconnects == 1)
        await decode.wait_until(lambda: decode.disconnects == 1)
        assert c.proxy.registry.in_flight() == 0
        assert client_cancels(c.proxy) == {"decode": 1}  # counted once, by the stage waited on


async def test_without_a_registered_prefill_moriio_answers_503(client: httpx.AsyncClient) -> None:
    async with moriio_cluster("READ", prefills=0) as c:
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 503 and "prefill" in r.json()["error"]["message"]
        assert not c.decodes[0].requests()


async def test_a_read_prefill_failure_fails_over_to_another_prefill_before_decode(
    client: httpx.AsyncClient,
) -> None:
    async with moriio_cluster("READ", prefills=2) as c:
        first, second = c.prefills

        def fails_once_and_spares(other: FakeVLLM) -> Behaviour:
            async def spare() -> None:
                other.behaviour = Behaviour()
            return Behaviour(fail_status=500, fail_count=1, gate=spare)

        # Whichever prefill the request reaches first fails, once; the other then answers.
        first.behaviour, second.behaviour = fails_once_and_spares(second), fails_once_and_spares(first)
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 200, r.text
        tried = [leg for fake in c.prefills for leg in fake.requests()]
        assert len(tried) == 2 and tried[0].request_id != tried[1].request_id
        (leg,) = c.decodes[0].requests()  # decode ran once, after the prefill that answered
        assert retries(c.proxy) == {"prefill": 1}
        answered = next(f for f in c.prefills if f.requests()[0].status == 200)
        check_request_id(leg, answered, c.decodes[0])
