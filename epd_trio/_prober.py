"""The background health prober: one task per proxy, owned by the app's lifespan nursery.

Every ``interval`` seconds it probes every instance's ``GET /health`` concurrently (one nursery
per round, so a slow instance delays nobody else's verdict) and feeds the results to the
``Registry``. Any failure counts: refused, timed out, or a non-2xx answer.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import trio

from ._core.errors import UpstreamError
from ._core.health import InstanceState, Registry
from ._fanout import fan_out
from ._http import UpstreamClient
from ._upstream import get


async def probe_once(client: UpstreamClient, registry: Registry, probe_timeout: float) -> None:
    """One probe of every instance (returns when all have answered or timed out)."""

    async def probe(state: InstanceState) -> None:
        try:
            await get(client.pool(state.instance), state.stage, state.instance, "/health", probe_timeout)
        except UpstreamError:
            registry.failed(state)
        else:
            registry.succeeded(state)

    await fan_out([partial(probe, state) for state in registry.states()])


async def run_prober(
    client: UpstreamClient,
    registry: Registry,
    *,
    interval: float,
    probe_timeout: float,
    before_round: Callable[[], None] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Probe forever (until cancelled); the first round starts at once.

    ``before_round`` runs before each round (the proxy syncs its roster there, so instances
    registered through another worker get probed).
    """
    task_status.started()
    while True:
        if before_round is not None:
            before_round()
        await probe_once(client, registry, probe_timeout)
        await trio.sleep(interval)
