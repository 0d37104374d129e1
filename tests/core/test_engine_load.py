"""Reading vLLM's load gauges from a ``/metrics`` page (``_core/engine_load.py``)."""

from __future__ import annotations

from epd_trio._core.engine_load import (
    LoraState,
    adapter_ranks,
    engine_loads,
    lora_state,
    rank_loads,
)

#: The shape vLLM 0.32 writes (label order and the HELP/TYPE lines as prometheus_client does).
PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.125
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="tiny"} 4.0
"""


def test_the_three_gauges_per_engine() -> None:
    loads = engine_loads(PAGE)
    assert set(loads) == {"0", "1"}
    assert (loads["0"].running, loads["0"].waiting, loads["0"].kv_usage) == (3, 2, 0.5)
    assert loads["1"].requests == 1
    assert rank_loads(loads, 2) == {0: 5, 1: 1}
    assert rank_loads(loads, 1) == {None: 6}  # one rank routed: the instance's total
    assert rank_loads(loads, 1) != rank_loads(loads, 2)


def test_old_names_unlabelled_series_and_garbage() -> None:
    page = ("vllm:num_requests_running{model_name=\"m\"} 4\n"
            "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.25\n"
            "vllm:num_requests_waiting{model_name=\"m\"} NaNx\n"
            "vllm:num_requests_waiting garbage line\n")
    loads = engine_loads(page)
    assert (loads[""].running, loads[""].waiting, loads[""].kv_usage) == (4, 0, 0.25)
    assert rank_loads(loads, 2) == {}  # no engine label: nothing to say per rank
    assert engine_loads("") == {}


def test_values_that_are_no_count_are_skipped() -> None:
    """Issue 31: the load scraper must survive what an instance feeds it. Prometheus text
    allows ``NaN`` and ``+Inf``; ``round()`` of them raised, and the scraper task died."""
    page = ('vllm:num_requests_running{engine="0"} NaN\n'
            'vllm:num_requests_waiting{engine="0"} +Inf\n'
            'vllm:num_requests_running{engine="1"} -Inf\n'
            'vllm:num_requests_running{engine="1"} 2\n'
            'vllm:kv_cache_usage_perc{engine="0"} nan\n')
    loads = engine_loads(page)
    assert rank_loads(loads, 2) == {1: 2}  # engine 0 said nothing usable
    assert rank_loads(loads, 1) == {None: 2}


LORA_PAGE = """# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="x"} 1.7000002e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""} 1.7000001e9
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""


def test_the_newest_lora_series_says_what_runs_and_waits() -> None:
    state = lora_state(LORA_PAGE)
    assert state == LoraState(frozenset({"sql", "chat"}), frozenset({"x"}), 2)
    assert lora_state("vllm:num_requests_running 1.0\n") is None
    assert lora_state('vllm:lora_requests_info{max_lora="4"} 1.0\n') == LoraState(
        frozenset(), frozenset(), 4)


def test_an_adapters_holders_are_ranked_running_room_waiting_rest() -> None:
    states = {"http://run:1": LoraState(frozenset({"sql"}), frozenset(), 2),
              "http://room:1": LoraState(frozenset({"a"}), frozenset(), 2),
              "http://wait:1": LoraState(frozenset({"a", "b"}), frozenset({"sql"}), 2),
              "http://full:1": LoraState(frozenset({"a", "b"}), frozenset(), 2)}
    holders = frozenset({*states, "http://unknown:1"})
    assert adapter_ranks("sql", holders, states) == [
        frozenset({"http://run:1"}), frozenset({"http://room:1"}),
        frozenset({"http://wait:1"}), frozenset({"http://full:1", "http://unknown:1"})]
    assert adapter_ranks("sql", frozenset({"http://full:1"}), states) == [
        frozenset({"http://full:1"})]
