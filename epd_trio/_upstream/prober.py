"""The background health prober: one task per proxy, owned by the app's lifespan nursery.

Each instance is probed on its own schedule: its next ``GET /health`` is due ``interval`` seconds
after its previous one ended. Why not rounds: a round waits for its slowest probe, so one hung
instance (answering nothing until ``probe_timeout``) paced every verdict, and a restarted
instance came back in rotation only at the round after the hung one's timeout (the churn soak:
1.5 s rounds while one decode was stopped). Any failure counts: refused, timed out, or a non-2xx
answer; results go to the ``Registry``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from .._core.errors import UpstreamError
from .._core.health import InstanceState, Registry
from .legs import get
from .pool import UpstreamClient

log = logging.getLogger("epd_trio")

#: One probe of one instance: returns when it answered, raises ``UpstreamError`` when it failed.
Check = Callable[[InstanceState], Awaitable[object]]


def health_check(client: UpstreamClient, probe_timeout: float) -> Check:
    """``GET /health`` through ``client``, within ``probe_timeout`` seconds."""

    async def check(state: InstanceState) -> object:
        return await get(client.pool(state.instance), state.stage, state.instance, "/health",
                         probe_timeout)

    return check


async def run_prober(
    check: Check,
    registry: Registry,
    *,
    interval: float,
    before_round: Callable[[], None] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Probe forever (until cancelled); every instance's first probe starts at once.

    ``before_round`` runs each time the schedule is looked at (the proxy syncs its roster
    there, so instances registered through another worker get probed within ``interval``).
    The probes run in this task's nursery, so cancelling it cancels them.
    """
    probing: set[tuple[str, str]] = set()
    due: dict[tuple[str, str], float] = {}

    async def probe(state: InstanceState, key: tuple[str, str]) -> None:
        try:
            await check(state)
        except UpstreamError:
            registry.failed(state)
        except Exception:
            # What one instance feeds its probe must not stop the probing of every instance
            # (issue 31: one bad port killed the prober of every worker). It counts as a
            # failure of that instance, and the log says why, with the traceback.
            log.exception("health probe of %s %s failed unexpectedly; counted as a failure",
                          state.stage, state.url)
            registry.failed(state)
        else:
            registry.succeeded(state)
        finally:
            probing.discard(key)
            due[key] = trio.current_time() + interval

    task_status.started()
    async with trio.open_nursery() as nursery:
        while True:
            if before_round is not None:
                before_round()
            now = trio.current_time()
            states = {(s.stage, s.url): s for s in registry.states()}
            for key in [key for key in due if key not in states]:
                del due[key]  # it left the roster
            for key, state in states.items():
                if key not in probing and due.get(key, now) <= now:
                    probing.add(key)
                    due.pop(key, None)
                    nursery.start_soon(probe, state, key)
            # A probe that ends after this point is due more than ``interval`` from now, so
            # waking at the earliest known due time (or ``interval``) never misses one.
            await trio.sleep_until(min([now + interval, *due.values()]))
