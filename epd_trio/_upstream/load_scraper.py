"""The optional ``/metrics`` scrape: every instance's own count of running and waiting requests.

Why: the proxy's in-flight counts are exact for the requests it sent, but blind to what other
proxies and clients send the same engines. With ``EPD_LOAD_SCRAPE_INTERVAL`` > 0, this task
reads every instance's ``/metrics`` once per interval, all instances at once in one nursery,
each bounded by ``EPD_HEALTH_TIMEOUT`` (``deadline``), and replaces ``Loads.scraped`` whole with what
answered. An instance that does not answer, or answers without the gauges, simply has no
scraped load this round (its own counts still apply): a scrape is a hint, never a verdict, so
it feeds neither health nor errors. Each worker process scrapes on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import trio

from .._core.engine_load import LoraState, engine_loads, lora_state, rank_loads
from .._core.errors import ProxyError
from .._core.policies import SlotKey
from .._core.routing import Instance
from .._state.loads import Loads
from .legs import get
from .pool import UpstreamPool

log = logging.getLogger("epd_trio")

#: The instances to scrape now: (stage, instance) pairs.
Targets = Callable[[], Iterable[tuple[str, Instance]]]


async def scrape_once(
    targets: Iterable[tuple[str, Instance]], pool_for: Callable[[Instance], UpstreamPool],
    deadline: float, lora: dict[str, LoraState] | None = None,
) -> dict[tuple[str, SlotKey], int]:
    """One round: each target's requests per slot, from whichever targets answered; and,
    into ``lora`` when given, each one's LoRA adapters (``vllm:lora_requests_info``)."""
    scraped: dict[tuple[str, SlotKey], int] = {}

    async def scrape(stage: str, instance: Instance) -> None:
        try:
            answer = await get(pool_for(instance), stage, instance, "/metrics", deadline)
        except ProxyError as exc:
            log.debug("load scrape of %s failed: %s", instance.url, exc)
            return
        text = answer.content.decode("utf-8", "replace")
        if lora is not None and (state := lora_state(text)) is not None:
            lora[instance.url] = state
        per_rank = rank_loads(engine_loads(text), instance.dp_size)
        for rank, requests in per_rank.items():
            scraped[stage, (instance.url, rank)] = requests

    async with trio.open_nursery() as nursery:
        for stage, instance in targets:
            nursery.start_soon(scrape, stage, instance)
    return scraped


async def run_load_scraper(
    targets: Targets, pool_for: Callable[[Instance], UpstreamPool], loads: Loads, *,
    interval: float, deadline: float,
) -> None:
    """Scrape every ``interval`` seconds until cancelled (the proxy's background nursery owns
    this task). A round that overruns the interval starts the next one at once."""
    while True:
        started = trio.current_time()
        lora: dict[str, LoraState] = {}
        loads.scraped = await scrape_once(list(targets()), pool_for, deadline, lora)
        loads.lora = lora
        await trio.sleep_until(started + interval)
