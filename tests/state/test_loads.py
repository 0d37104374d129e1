"""The in-flight load table (``_state/loads``): per stage and slot, shared by worker processes."""

from __future__ import annotations

import multiprocessing

from epd_trio._state.loads import Loads, LocalLoadTable, SharedLoadTable

A, B = ("http://a:1", 0), ("http://a:1", 1)


def _add_in_child(table: SharedLoadTable) -> None:
    table.add("decode", A, 3)
    table.add("prefill", A, 1)


def test_a_worker_process_sees_the_others_counts() -> None:
    ctx = multiprocessing.get_context("spawn")
    table = SharedLoadTable(ctx, slots=64)
    table.add("decode", A, 2)
    child = ctx.Process(target=_add_in_child, args=(table,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert table.read("decode", [A, B]) == [5, 0]
    assert table.read("prefill", [A]) == [1]


def test_a_full_shared_table_counts_newcomers_locally() -> None:
    table = SharedLoadTable(slots=2)
    keys = [("http://a:1", r) for r in range(4)]
    for key in keys:
        table.add("decode", key, 1)
    assert table.read("decode", keys) == [1, 1, 1, 1]
    for key in keys:
        table.add("decode", key, -1)
    assert table.read("decode", keys) == [0, 0, 0, 0]


def test_the_scrape_raises_a_load_but_never_lowers_it() -> None:
    loads = Loads(LocalLoadTable())
    release = loads.take("decode", A, 4)
    loads.scraped = {("decode", A): 1, ("decode", B): 6}
    assert loads.read("decode", [A, B]) == [4, 6]
    release()
    assert loads.read("decode", [A, B]) == [1, 6]
    with loads.held("prefill", B):
        assert loads.read("prefill", [B]) == [1]
    assert loads.read("prefill", [B]) == [0]
