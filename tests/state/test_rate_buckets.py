"""The tenants' per-minute buckets shared by the workers of ``epd-trio serve --workers N``:
two views of one table (what two spawned workers get) grant a limit once between them, and
the real ``--workers 2`` does too."""

from __future__ import annotations

import os
import sys
from contextlib import AsyncExitStack

import httpx
import orjson
import trio

from epd_trio._admission.fair import FairAdmission
from epd_trio._core.tenants import TenantTable, parse_tenants
from epd_trio._state.roster_store import SharedRoutingState
from epd_trio.testing import FakeVLLM

from helpers import CHAT, chat_body, second_view, server_process, start_fakes

TABLES = {"team": {"keys": ["sk-team"], "requests_per_minute": 10,
                   "tokens_per_minute": 600}}
TEAM = {"authorization": "Bearer sk-team"}


def worker_gate(state: SharedRoutingState) -> FairAdmission:
    return FairAdmission(max_inflight=100, timeout=1.0, table=TenantTable(parse_tenants(TABLES)),
                         aging=0.5, shared=state.buckets)


async def test_two_workers_grant_a_limit_once_between_them() -> None:
    state = SharedRoutingState()
    gates = [worker_gate(state), worker_gate(second_view(state))]
    admitted = refused = 0
    async with AsyncExitStack() as resources:
        for n in range(20):
            gate = gates[n % 2]
            ticket = await gate.enter(gate.tenant_of([(b"authorization", b"Bearer sk-team")]),
                                      resources)
            try:
                await ticket.admitted({"model": "m", "prompt": "hi", "max_tokens": 10})
                admitted += 1
            except Exception:
                refused += 1
    assert (admitted, refused) == (10, 10)


async def test_a_settlement_in_one_worker_is_seen_by_the_other() -> None:
    state = SharedRoutingState()
    first, second = worker_gate(state), worker_gate(second_view(state))
    body = {"model": "m", "prompt": "x" * 40, "max_tokens": 490}  # 500 of 600 reserved
    async with AsyncExitStack() as resources:
        ticket = await first.enter(first.tenant_of([(b"authorization", b"Bearer sk-team")]),
                                   resources)
        await ticket.admitted(body)
        ticket.answered(b'{"usage": {"prompt_tokens": 10, "completion_tokens": 5}}')
    async with AsyncExitStack() as resources:  # settled: 585 left, so 500 more fit
        ticket = await second.enter(second.tenant_of([(b"authorization", b"Bearer sk-team")]),
                                    resources)
        await ticket.admitted(body)


async def test_epd_trio_serve_with_two_workers_grants_a_limit_once(
    nursery: trio.Nursery,
) -> None:
    (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env.update({"EPD_DECODE_URLS": decode.url, "EPD_TENANTS": orjson.dumps(TABLES).decode()})
    command = [sys.executable, "-m", "epd_trio", "serve", "--port", "0", "--workers", "2"]
    async with server_process(nursery, command, env, limit=60) as served:
        statuses = []
        started = trio.current_time()
        for _ in range(20):  # a fresh connection each: either worker may take it
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                r = await client.post(served.url + CHAT, json=chat_body(), headers=TEAM)
                statuses.append(r.status_code)
        took = trio.current_time() - started
    # The bucket refills one request every 6 s: a loaded machine that took longer than that
    # for the 20 may see one granted per 6 s more. Two workers with a bucket each would grant
    # all 20 (10 each), which only a run of a minute or more could not tell apart.
    refilled = int(took * TABLES["team"]["requests_per_minute"] / 60)
    assert refilled < 10, f"20 requests took {took:.0f} s: too slow to tell one bucket from two"
    granted = statuses.count(200)
    assert 10 <= granted <= 10 + refilled, (took, statuses)
    assert statuses.count(429) == 20 - granted, statuses
