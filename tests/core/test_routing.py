"""The routing properties upstream's own tests assert, plus unequal DP sizes (pure functions)."""

import re
from collections import Counter

import pytest

from epd_trio import (
    Instance,
    dp_slots,
    encoder_rr_assignment,
    flat_interleaved_dp_route,
    group_by_target,
    parse_instance,
)
from epd_trio._core.routing import KvEventEndpoints, parse_instance_spec


@pytest.mark.parametrize("n_encoders", [1, 2, 3, 5])
def test_single_item_requests_hit_every_encoder_equally(n_encoders: int) -> None:
    urls = [f"E{i}" for i in range(n_encoders)]
    start, hits = 0, Counter[str]()
    for _ in range(3 * n_encoders):
        assigned, start = encoder_rr_assignment(urls, start, 1)
        hits.update(assigned)
    assert hits == {url: 3 for url in urls}


def test_three_encoders_single_items_rotate() -> None:
    start, seen = 0, []
    for _ in range(6):
        assigned, start = encoder_rr_assignment(["E0", "E1", "E2"], start, 1)
        seen += assigned
    assert seen == ["E0", "E1", "E2", "E0", "E1", "E2"]


def test_item_counts_continue_from_the_cursor() -> None:
    start, per_request = 0, []
    for count in [2, 1, 3, 1]:
        assigned, start = encoder_rr_assignment(["E0", "E1", "E2"], start, count)
        per_request.append(assigned)
    assert per_request == [["E0", "E1"], ["E2"], ["E0", "E1", "E2"], ["E0"]]
    assert start == 1


def test_encoder_assignment_edge_cases() -> None:
    assert encoder_rr_assignment(["E0", "E1"], 7, 0) == ([], 1)
    assert encoder_rr_assignment(["E0", "E1"], 1, 3) == (["E1", "E0", "E1"], 0)
    with pytest.raises(ValueError):
        encoder_rr_assignment([], 0, 1)


def _instances(*dp: int) -> list[Instance]:
    return [Instance(f"http://i{i}:8000", d) for i, d in enumerate(dp)]


@pytest.mark.parametrize(
    "n, dp", [(1, 1), (2, 1), (4, 1), (1, 8), (2, 8), (3, 8)]
)
def test_dp_shapes_cover_every_slot_uniformly(n: int, dp: int) -> None:
    instances = _instances(*[dp] * n)
    slots = n * dp
    hits = Counter(flat_interleaved_dp_route(k, instances) for k in range(1, 3 * slots + 1))
    expected_rank = (lambda r: r) if dp > 1 else (lambda r: None)
    assert hits == {(i, expected_rank(r)): 3 for i in range(n) for r in range(dp)}


@pytest.mark.parametrize("n, dp", [(2, 8), (3, 4), (4, 2)])
def test_matches_the_closed_formula_for_equal_sizes(n: int, dp: int) -> None:
    instances = _instances(*[dp] * n)
    for k in range(1, 5 * n * dp):
        slot = (k - 1) % (n * dp)
        assert flat_interleaved_dp_route(k, instances) == (slot % n, slot // n)


def test_two_instances_dp8_get_all_ranks_in_16_requests() -> None:
    instances = _instances(8, 8)
    routes = [flat_interleaved_dp_route(k, instances) for k in range(1, 17)]
    assert routes[:4] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for index in (0, 1):
        assert sorted(rank for i, rank in routes if i == index) == list(range(8))


def test_unequal_dp_sizes_never_emit_out_of_range_ranks() -> None:
    instances = _instances(4, 1, 2)
    slots = dp_slots(instances)
    assert slots == [(0, 0), (1, None), (2, 0), (0, 1), (2, 1), (0, 2), (0, 3)]
    hits = Counter(flat_interleaved_dp_route(k, instances) for k in range(1, 7 * 10 + 1))
    assert set(hits.values()) == {10}
    for index, rank in hits:
        dp = instances[index].dp_size
        assert (rank is None) if dp == 1 else 0 <= rank < dp


def test_route_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        flat_interleaved_dp_route(0, _instances(1))
    with pytest.raises(ValueError):
        flat_interleaved_dp_route(1, [])


@pytest.mark.parametrize(
    "targets, cap, expected",
    [
        (["A", "B", "A", "C", "A"], 0, [("A", [0, 2, 4]), ("B", [1]), ("C", [3])]),
        (["A", "B", "A", "C", "A"], 1, [("A", [0]), ("B", [1]), ("A", [2]), ("C", [3]),
                                        ("A", [4])]),
        (["A", "A", "A", "B", "A"], 2, [("A", [0, 1]), ("A", [2, 4]), ("B", [3])]),
        ([], 0, []),
    ],
)
def test_group_by_target(targets: list[str], cap: int, expected: list) -> None:
    assert group_by_target(targets, cap) == expected


@pytest.mark.parametrize(
    "spec, url, dp",
    [
        ("http://a:1", "http://a:1", 1),
        (" http://a:1/ #dp=8", "http://a:1", 8),
        ("https://h/x/#dp=2", "https://h/x", 2),
    ],
)
def test_parse_instance(spec: str, url: str, dp: int) -> None:
    assert parse_instance(spec) == Instance(url, dp)


@pytest.mark.parametrize("spec", ["a:1", "http://a:1#dp=0", "http://a:1#dp=x", "http://a#dp=-1",
                                  "http://a:1#dp", "http://a:1?x=1", "http://:1", "http://"])
def test_parse_instance_rejects(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_instance(spec)


@pytest.mark.parametrize(
    "spec, dp, kv",
    [
        ("http://p0:8000#kv_events=tcp://p0:5557", 1, KvEventEndpoints("tcp://p0:5557")),
        ("http://p0:8000#dp=2&kv_events=tcp://p0:5557", 2, KvEventEndpoints("tcp://p0:5557")),
        # any order, spaces around the pairs, a replay socket beside the publisher
        ("http://p0:8000# kv_events_replay=tcp://p0:5600 & kv_events=tcp://p0:5557&dp=4", 4,
         KvEventEndpoints("tcp://p0:5557", "tcp://p0:5600")),
        ("http://p0:8000", 1, None),
        ("http://p0:8000#dp=3", 3, None),
    ],
)
def test_parse_instance_spec_reads_every_fragment_key(
    spec: str, dp: int, kv: KvEventEndpoints | None
) -> None:
    assert parse_instance_spec(spec) == (Instance("http://p0:8000", dp), kv)
    assert parse_instance(spec) == Instance("http://p0:8000", dp)


@pytest.mark.parametrize(
    "spec, named",
    [
        ("http://a:1#dq=2", "'dq'"),  # a typo is refused by name, never ignored
        ("http://a:1#dp=2&dp=3", "'dp' given twice"),
        ("http://a:1#kv_events=udp://a:5", "'kv_events'"),
        ("http://a:1#kv_events=tcp://a:70000", "'kv_events'"),
        ("http://a:1#kv_events=tcp://*:5557", "'kv_events'"),  # vLLM's bind form, not an address
        ("http://a:1#kv_events=tcp://a", "'kv_events'"),
        ("http://a:1#kv_events_replay=tcp://a:5", "needs 'kv_events'"),
        ("http://a:1#dp=2&", "''"),
    ],
)
def test_parse_instance_spec_names_the_key_at_fault(spec: str, named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        parse_instance_spec(spec)


def test_kv_event_endpoints_are_offset_per_rank_as_vllm_does() -> None:
    kv = KvEventEndpoints("tcp://p0:5557", "tcp://p0:5600")
    assert kv.for_rank(None) == kv.for_rank(0) == kv
    assert kv.for_rank(3) == KvEventEndpoints("tcp://p0:5560", "tcp://p0:5603")
    assert KvEventEndpoints("tcp://h:5557").for_rank(2) == KvEventEndpoints("tcp://h:5559")
    assert parse_instance_spec("http://[::1]:8000#kv_events=tcp://[::1]:5557")[1] == \
        KvEventEndpoints("tcp://[::1]:5557")
    assert KvEventEndpoints("tcp://[::1]:5557").for_rank(1).publish == "tcp://[::1]:5558"
    with pytest.raises(ValueError, match="past port 65535"):
        KvEventEndpoints("tcp://h:65535").for_rank(1)
