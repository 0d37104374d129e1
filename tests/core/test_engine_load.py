"""Reading vLLM's load gauges from a ``/metrics`` page (``_core/engine_load.py``)."""

from __future__ import annotations

from epd_trio._core.engine_load import engine_loads, rank_loads

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
