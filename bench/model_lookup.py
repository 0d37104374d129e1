"""What finding a request's pool costs: ``python -m bench.model_lookup``.

Issue 41 asks that routing by model make no request dearer, and that the lookup be one
dictionary read. End to end (``bench.compare --peers epd_trio,epd_trio+pools``) the answer is
lost in the spread of a shared 2-core machine (a round's proxy CPU per request moves by 10 to
30 % from one round to the next), so this measures the lookup itself, in this process: the
``ModelPools.resolve`` every request calls, on a ``Proxy`` built from ``Settings`` (not
started: the instances' ``/v1/models`` answers are given, as a learner round writes them), for

- ``one pool``: one model learned from its instances (the default deployment);
- ``three pools``: the same name among three models' tables (``bench.compare``'s ``+pools``);
- ``alias``: an alias with weighted targets (90/10), exact turns;
- ``sticky alias``: the same alias with a session key (a weighted hash per request);
- ``adapter``: a LoRA adapter of the model, held on both legs.

Each figure is the best of 5 equal chunks of ``--rounds`` calls (on a shared machine the
others' load only ever adds to a chunk's time), in microseconds per request.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from typing import Any

from epd_trio import Proxy, Settings
from epd_trio._core.roster import Card
from epd_trio._core.routing import Instance

PREFILLS = tuple(Instance(f"http://p{k}:8000") for k in range(2))
DECODES = tuple(Instance(f"http://d{k}:8000") for k in range(2))


def _proxy(**tables: Any) -> Proxy:
    """A proxy of ``PREFILLS`` and ``DECODES`` serving ``bench`` (and an adapter of it,
    ``bench-sql``), with ``tables`` as its settings' model tables."""
    proxy = Proxy(Settings(prefill_urls=PREFILLS, decode_urls=DECODES, **tables),
                  moriio_listener=False)
    cards = (Card("bench"), Card("bench-sql", parent="bench"))
    proxy.membership.learned({inst.url: cards for inst in PREFILLS + DECODES})
    proxy.sync()
    return proxy


def cases() -> dict[str, tuple[Proxy, Callable[[Proxy], object]]]:
    """Each case's proxy and its one request's lookup."""
    others = {m: {"prefill": [Instance(f"http://{m}:8000")],
                  "decode": [Instance(f"http://{m}:8001")]} for m in ("pool-b", "pool-c")}
    three = {"bench": {"prefill": list(PREFILLS), "decode": list(DECODES)}, **others}
    alias = {"chat": {"targets": {"bench": 90, "bench-sql": 10}}}
    one, pools, aliased = _proxy(), _proxy(models=three), _proxy(model_aliases=alias)
    return {
        "one pool": (one, lambda p: p.models.resolve("bench")),
        "three pools": (pools, lambda p: p.models.resolve("bench")),
        "alias": (aliased, lambda p: p.models.resolve("chat")),
        "sticky alias": (aliased, lambda p: p.models.resolve("chat", session="user-42")),
        "adapter": (one, lambda p: p.models.resolve("bench-sql")),
    }


def lookup_costs(rounds: int) -> dict[str, float]:
    """Microseconds per lookup of each case, the best of 5 chunks."""
    clock = time.perf_counter
    costs = {}
    for name, (proxy, lookup) in cases().items():
        chunk = max(rounds // 5, 1)
        best = math.inf
        for _ in range(5):
            started = clock()
            for _ in range(chunk):
                lookup(proxy)
            best = min(best, (clock() - started) / chunk)
        costs[name] = best * 1e6
    return costs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.model_lookup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200_000, help="lookups per case")
    args = parser.parse_args(argv)
    for name, micros in lookup_costs(args.rounds).items():
        print(f"{name:>13}: {micros:6.2f} us per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
