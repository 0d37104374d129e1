"""The benches: their arithmetic, wire code and lean fake, and small real runs end to end."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
from pathlib import Path

import httpx
import orjson
import pytest
import trio
import trio.testing

from bench._callgrind import available as available_callgrind
from bench._callgrind import total as callgrind_total
from bench._load import Result, request_head
from bench._wire import ResponseReader, SSECounter, WireError
from bench.burst import jain_index, percentile
from bench.compare import Backends, peer_commands, rotated, round_ratios, span, summarize_run
from bench.compare import parse_args as compare_args
from bench.lean_fake import LeanFake, Stream, chunk

from real_servers import RedisServer, require_binary


@pytest.mark.parametrize(
    "values, q, expected",
    [([1.0], 99, 1.0), ([1.0, 2.0, 3.0, 4.0], 50, 2.0), ([float(i) for i in range(1, 101)], 99,
                                                          99.0), ([], 50, None)],
)
def test_percentile(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == expected


def test_jain_index() -> None:
    assert jain_index([10, 10, 10]) == 1.0
    assert jain_index([30, 0, 0]) == pytest.approx(1 / 3)
    assert jain_index([0, 0]) is None


async def test_burst_runs_on_the_embedded_cluster(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    with trio.fail_after(120):
        result = await trio.run_process(
            [sys.executable, "-m", "bench.burst", "--requests", "30", "--concurrency", "30",
             "--stream", "--images", "2", "--compare-direct", "--json", str(report_path),
             "--quiet"],
            capture_stdout=True, capture_stderr=True, check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "[proxy] ok 30/30 (100.0 %)" in out and "proxy CPU:" in out
    report = json.loads(report_path.read_text())
    assert report["proxy"]["ok"] == 30 and report["direct"]["ok"] == 30
    assert report["proxy"]["cpu_ms_per_request"] > 0
    encode = report["instances"]["encode"]
    assert [row["items"] for row in encode["instances"]] == [20, 20, 20]  # 60 items, 3 encoders
    assert encode["fairness"] == 1.0
    assert report["instances"]["decode"]["slots_covered"] == "4/4"
    assert len(report["results"]) == 30


async def test_metrics_cost_runs_every_mode() -> None:
    result = await trio.run_process(
        [sys.executable, "-m", "bench.metrics_cost", "--requests", "50", "--rounds", "1"],
        capture_stdout=True)
    lines = result.stdout.decode().splitlines()
    assert [line.split(":")[0].strip() for line in lines] == [
        "off", "one-process", "multiprocess"]
    assert all("us per streamed P->D request" in line for line in lines)


async def test_fairness_cost_measures_each_kind_of_admission() -> None:
    """``bench.fairness --cost``: the single cap, the fair gate local and with Redis."""
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, "-m", "bench.fairness", "--cost", "--cost-requests", "200"],
            capture_stdout=True, capture_stderr=True, check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    figures = re.findall(r"([\d.]+) µs", out)
    assert len(figures) == 4 and all(float(f) > 0 for f in figures), out


async def test_fairness_flood_runs_its_three_phases_in_small(tmp_path: Path) -> None:
    """``bench.fairness`` itself, one replica, fair mode, one second a phase: the lean fakes,
    a real ``epd-trio serve``, capacity, idle and flood each measured, its line printed and
    its JSON written (a figure that is missing or never measured fails here, not in a
    15-second run)."""
    report_path = tmp_path / "fairness.json"
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, "-m", "bench.fairness", "--duration", "1", "--replicas", "1",
             "--modes", "fair", "--capacity", "2", "--flood", "2", "--share", "0.5",
             "--decodes", "1", "--batch-max-tokens", "5-15", "--json", str(report_path)],
            capture_stdout=True, capture_stderr=True, check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert out.startswith("1 replica(s), fair: capacity "), out
    (run,) = json.loads(report_path.read_text())["results"]
    assert (run["mode"], run["replicas"]) == ("fair", 1)
    assert run["capacity_per_second"] > 0 and run["interactive_rate"] > 0
    flood = run["flood"]
    assert run["idle"]["ok"] and flood["interactive"]["ok"] and flood["batch"]["ok"], run
    assert run["interactive_refused"] == 0 and not flood["batch"]["refused"], run
    assert run["p99_ratio"] is not None and run["batch_share"] is not None


def test_fairness_batch_lengths_are_one_count_or_a_range() -> None:
    from bench.fairness import token_range

    assert token_range("10") == (10, 10)
    assert token_range("5-15") == (5, 15)
    for bad in ("0", "15-5", "0-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            token_range(bad)


def test_discovery_cost_measures_each_apply() -> None:
    from bench.discovery_cost import apply_cost

    costs = apply_cost(instances=8, repeat=2)
    assert list(costs) == ["unchanged, checked without the lock", "one replaced, local store",
                           "one replaced, shared store"]
    assert all(value > 0 for value in costs.values())


# -- bench._wire: the load generator's response reader, fed every possible cut -----------------
CHUNKED = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
           b"transfer-encoding: chunked\r\n\r\n"
           b"f\r\ndata: {\"a\":1}\n\n\r\n" b"F;ext=1\r\ndata: {\"b\":2}\n\n\r\n"
           b"e\r\ndata: [DONE]\n\n\r\n" b"0\r\n\r\n")


def _read_in_pieces(raw: bytes, size: int) -> tuple[ResponseReader, SSECounter, bytes]:
    reader, sse, body = ResponseReader(), SSECounter(), b""
    for i in range(0, len(raw), size):
        for piece in reader.feed(raw[i:i + size]):
            body += piece
            sse.feed(piece)
    return reader, sse, body


@pytest.mark.parametrize("size", [1, 2, 3, 7, 16, len(CHUNKED)])
def test_chunked_stream_read_in_any_pieces(size: int) -> None:
    reader, sse, body = _read_in_pieces(CHUNKED, size)
    assert reader.done and reader.status == 200 and reader.keep_alive
    assert body == b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    assert (sse.tokens, sse.errors, sse.done) == (2, 0, True)


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_content_length_body_and_connection_close(size: int) -> None:
    raw = b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"
    reader, _, body = _read_in_pieces(raw, size)
    assert (reader.done, reader.status, reader.keep_alive, body) == (True, 502, False, b"hello")


def test_reader_rejects_what_it_does_not_understand() -> None:
    with pytest.raises(WireError):
        ResponseReader().feed(b"HTTP/1.1 200 OK\r\n\r\nbody until close")
    with pytest.raises(WireError):
        ResponseReader().feed(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nab")
    with pytest.raises(WireError):
        ResponseReader().feed(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n")


def test_sse_counter_sees_error_events() -> None:
    sse = SSECounter()
    assert sse.feed(b'data: {"x": 1}\n\n: comment\n\ndata: {"error": {"message": "boom"}}') == 1
    assert sse.feed(b"\n\n") == 1
    assert (sse.tokens, sse.errors, sse.done) == (1, 1, False)


# -- bench.lean_fake: headers first, then one write per token, spaced in time ----------------------
def test_a_stream_step_is_one_write_per_token() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        stream = Stream(a, b"data: {", b"}\n\n", b',"end":1}\n\n', b"data: role\n\n", left=3)
        chunks = []
        for _ in range(3):
            stream.step()
            chunks.append(b.recv(65536))
        assert chunks[0] == chunk(b"data: role\n\n") + chunk(b'data: {" alpha"}\n\n')
        assert chunks[1] == chunk(b'data: {" bravo"}\n\n')
        assert chunks[2] == chunk(b'data: {" charlie","end":1}\n\n') + chunk(b"data: [DONE]\n\n")
        assert stream.left == 0 and not stream.backlog


async def test_the_lean_fake_sends_the_head_first_then_a_token_per_interval(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    fake = LeanFake("decode", token_interval=1.0)  # virtual seconds: autojump_clock
    url = await nursery.start(fake.serve)
    client = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
    body = orjson.dumps({"model": "m", "stream": True, "max_tokens": 3, "messages": []})
    t0 = trio.current_time()
    arrivals: list[tuple[float, bytes]] = []
    reader = ResponseReader()
    with trio.fail_after(30):
        for _ in range(2):  # the same keep-alive connection twice
            await client.send_all(request_head("POST", "/v1/chat/completions", "x", len(body))
                                  + body)
            reader = ResponseReader()
            while not reader.done:
                data = await client.receive_some(65536)
                reader.feed(data)
                arrivals.append((trio.current_time() - t0, data))
    await client.aclose()
    first = arrivals[:len(arrivals) // 2]
    # Head at once; then one read per engine step, 1 s apart: role + token, token, token + [DONE],
    # and the chunked terminator (a write of its own, read on its own or with [DONE]).
    assert first[0][0] == 0 and first[0][1].startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"data:" not in first[0][1]
    steps = [(t, d) for t, d in first[1:] if b"data:" in d]
    assert [t for t, _ in steps] == [1.0, 2.0, 3.0]
    assert [d.count(b"data:") for _, d in steps] == [2, 1, 2]
    assert reader.status == 200 and fake.answered == 2


async def test_the_lean_fake_paced_per_stream_times_each_stream_from_its_own_start(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    """``--pacing stream``: a stream started half an interval after another gets its tokens
    half an interval after the other's (the engine's grid would step both together)."""
    fake = LeanFake("decode", token_interval=1.0, pacing="stream")
    url = await nursery.start(fake.serve)
    port = int(url.rsplit(":", 1)[1])
    body = orjson.dumps({"model": "m", "stream": True, "max_tokens": 3, "messages": []})
    t0 = trio.current_time()
    arrivals: dict[str, list[float]] = {"a": [], "b": []}

    async def one(name: str, delay: float) -> None:
        await trio.sleep(delay)
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(request_head("POST", "/v1/chat/completions", "x", len(body))
                              + body)
        reader = ResponseReader()
        while not reader.done:
            data = await client.receive_some(65536)
            reader.feed(data)
            arrivals[name] += [trio.current_time() - t0] * data.count(b"data:")
        await client.aclose()

    with trio.fail_after(30):
        async with trio.open_nursery() as streams:
            streams.start_soon(one, "a", 0.0)
            streams.start_soon(one, "b", 0.5)
    # role + token, token, token + [DONE]: one read per step, each on the stream's own grid
    assert arrivals["a"] == [1.0, 1.0, 2.0, 3.0, 3.0]
    assert arrivals["b"] == [1.5, 1.5, 2.5, 3.5, 3.5]


def test_the_fakes_and_their_pacing_are_options_of_compare(tmp_path: Path) -> None:
    args = compare_args([])
    assert (args.fake, args.pacing) == ("lean", "engine")
    assert compare_args(["--pacing", "stream"]).pacing == "stream"
    python = Path(sys.executable)
    assert compare_args(["--fake", "aiohttp", "--fake-python", str(python)]).fake == "aiohttp"
    with pytest.raises(SystemExit):  # no Python with aiohttp: said before anything starts
        compare_args(["--fake", "aiohttp", "--fake-python", str(tmp_path / "none")])
    with pytest.raises(SystemExit):  # the aiohttp fake has one pacing only
        compare_args(["--fake", "aiohttp", "--fake-python", str(python), "--pacing", "stream"])
    plain = compare_args([])
    assert (plain.client, plain.token_interval) == ("epoll", 0.002)
    py = [f"--{o}-python={python}" for o in ("fake", "aiohttp")]
    lab = compare_args(["--lab", *py])
    assert (lab.fake, lab.client, lab.token_interval) == ("aiohttp", "aiohttp", 0.005)
    mixed = compare_args(["--lab", *py, "--client", "epoll", "--token-interval", "0.002"])
    assert (mixed.fake, mixed.client, mixed.token_interval) == ("aiohttp", "epoll", 0.002)


async def test_compare_starts_the_aiohttp_fake_under_the_python_it_names(
        tmp_path: Path) -> None:
    """``--fake aiohttp`` runs ``bench/aiohttp_fake.py`` under ``--fake-python`` with the lean
    fake's command line, and reads its URLs the same way. The project has no aiohttp, so the
    named "Python" here is a stand-in that records its arguments and serves a lean fake."""
    from bench.compare import start_backends, stop

    record = tmp_path / "argv"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\necho \"$@\" > {record}\nshift\n"
                      f"exec {sys.executable} -m bench.lean_fake \"$@\"\n")
    python.chmod(0o755)
    args = compare_args(["--fake", "aiohttp", "--fake-python", str(python),
                         "--token-interval", "0.005"])
    with trio.fail_after(30):
        process, backends, described = await start_backends(args)
        await stop(process)
    argv = record.read_text().split()
    assert argv[0].endswith("bench/aiohttp_fake.py")
    assert argv[argv.index("--token-interval") + 1] == "0.005" and "--pacing" not in argv
    assert len(backends.prefill) == 1 and len(backends.decode) == 1
    assert described == "1 prefill, 1 decode"


# -- bench.compare: its arithmetic and its choice of peers ----------------------------------------
def test_rotated_and_span() -> None:
    assert rotated([1, 2, 3], 0) == [1, 2, 3] and rotated([1, 2, 3], 4) == [2, 3, 1]
    assert span([2.0, None, 1.0]) == "1.00-2.00" and span([1.0, 1.001]) == "1.00"
    assert span([None]) == "-"


def test_round_ratios_pair_each_round() -> None:
    rounds = [{"epd_trio": {"x": 4.0}, "ref": {"x": 2.0}}, {"epd_trio": {"x": 3.0}},
              {"epd_trio": {"x": 6.0}, "ref": {"x": 2.0}}]
    assert round_ratios(rounds, "epd_trio", "ref", lambda r: r["x"]) == [2.0, 3.0]


def test_summarize_run_counts_tokens_per_proxy_wakeup() -> None:
    results = [Result(i, 0.0, 0.01, 0.001, 200, None, 100, 9, [0.002]) for i in range(4)]
    out = summarize_run(results, 1.0, requests=4, stream=True, max_tokens=8, proxy_cpu=0.01,
                        fakes_cpu=0.0, generator_cpu=0.0, proxy_wakeups=16)
    assert out["proxy_wakeups_per_request"] == 4 and out["tokens_per_proxy_wakeup"] == 2
    out = summarize_run(results, 1.0, requests=4, stream=False, max_tokens=8, proxy_cpu=None,
                        fakes_cpu=0.0, generator_cpu=0.0)
    assert out["proxy_wakeups_per_request"] is None and out["tokens_per_proxy_wakeup"] is None


def test_process_tree_wakeups_counts_a_thread_going_to_sleep() -> None:
    """A blocking wait is a voluntary context switch of the waiting thread, counted."""
    import select

    from bench.burst import process_tree_wakeups
    before = process_tree_wakeups(os.getpid())
    for _ in range(5):
        select.select([], [], [], 0.001)  # the thing measured: a thread that sleeps
    assert process_tree_wakeups(os.getpid()) >= before + 5


def test_summarize_run_per_request_and_per_token() -> None:
    results = [Result(i, 0.0, 0.010 * (i + 1), 0.001, 200, None, 100, 9, [0.002, 0.004])
               for i in range(4)] + [Result(4, 0.0, 1.0, None, None, "timeout")]
    out = summarize_run(results, 2.0, requests=5, stream=True, max_tokens=8, proxy_cpu=0.064,
                        fakes_cpu=0.005, generator_cpu=0.010)
    assert out["ok"] == 4 and out["failures"] == {"timeout": 1} and out["rps"] == 2.0
    assert out["proxy_cpu_ms_per_request"] == pytest.approx(64 / 5)
    assert out["proxy_cpu_us_per_token"] == pytest.approx(64_000 / 32)  # 4 ok x 8 tokens
    assert out["latency_ms"]["p50"] == pytest.approx(20.0)
    assert out["gap_ms"]["max"] == pytest.approx(4.0) and out["events_per_request"] == 9


def test_references_are_skipped_with_a_reason(tmp_path: Path) -> None:
    args = compare_args(["--peers", "epd_trio,vllm-router,vllm-epd-proxy,direct",
                         "--vllm-router", str(tmp_path / "none"),
                         "--epd-proxy", str(tmp_path / "none.py")])
    pd = Backends((), ("http://p",), ("http://d",))
    peers, skipped = peer_commands(args, pd)
    assert [p.name for p in peers] == ["epd_trio", "direct"]
    assert "vllm-router: skipped" in skipped[0] and "not found" in skipped[0]
    assert "vllm-epd-proxy: skipped" in skipped[1]
    assert peers[0].command is not None
    cmd = peers[0].command(8000)
    assert cmd[cmd.index("--prefill") + 1] == "http://p" and cmd[-1] == "http://d"
    _, skipped = peer_commands(args, Backends(("http://e",), ("http://p",), ("http://d",)))
    assert "no encoder stage" in skipped[0]


async def test_compare_runs_epd_trio_plain_hypercorn_and_direct_side_by_side(
        tmp_path: Path) -> None:
    report_path = tmp_path / "compare.json"
    # Pinned to the CPUs this test may use anyway: the pinning, and its sets in the report.
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    with trio.fail_after(120):
        result = await trio.run_process(
            [sys.executable, "-m", "bench.compare", "--peers", "epd_trio,hypercorn,direct",
             "--stream",
             "--requests", "20", "--concurrency", "4", "--max-tokens", "5", "--rounds", "1",
             "--warmup", "4", "--quiet", "--json", str(report_path),
             "--proxy-cpus", cpus, "--rest-cpus", cpus],
            capture_stdout=True, capture_stderr=True, check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "epd_trio / direct (per round):" in out
    report = json.loads(report_path.read_text())
    assert report["config"]["proxy_cpus"] == sorted(os.sched_getaffinity(0))
    (by_peer,) = report["rounds"]
    assert by_peer["epd_trio"]["ok"] == 20 and by_peer["direct"]["ok"] == 20
    assert by_peer["hypercorn"]["ok"] == 20
    for peer in ("epd_trio", "hypercorn"):
        assert by_peer[peer]["proxy_cpu_us_per_token"] > 0
        assert by_peer[peer]["events_per_request"] == 6
    # (6 events: the role chunk and 5 tokens)


async def test_compare_runs_the_pools_peer_and_embeddings_beside_chat(tmp_path: Path) -> None:
    """``epd_trio+pools`` routes by its tables beside two other models' pools; the
    ``/embeddings`` peers post embeddings, answered by the lean fakes' decode, and each gets
    its ratio to the same peer's chat."""
    report_path = tmp_path / "compare.json"
    with trio.fail_after(120):
        result = await trio.run_process(
            [sys.executable, "-m", "bench.compare", "--peers",
             "epd_trio,epd_trio+pools,epd_trio/embeddings,direct,direct/embeddings",
             "--requests", "20", "--concurrency", "4", "--max-tokens", "3", "--rounds", "1",
             "--warmup", "4", "--quiet", "--json", str(report_path)],
            capture_stdout=True, capture_stderr=True, check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "epd_trio/embeddings / epd_trio (per round): proxy CPU/request x" in out
    assert "epd_trio / epd_trio+pools (per round):" in out
    assert "epd_trio / epd_trio/embeddings" not in out
    (by_peer,) = json.loads(report_path.read_text())["rounds"]
    assert {name: run["ok"] for name, run in by_peer.items()} == dict.fromkeys(by_peer, 20)
    assert by_peer["epd_trio/embeddings"]["proxy_cpu_ms_per_request"] > 0


async def test_compare_counts_instructions_per_request_under_callgrind(tmp_path: Path) -> None:
    """``--instructions``: each epd_trio peer runs under callgrind, counted from after its
    warm-up to after its load; the other peers are measured as usual, without a count."""
    require_binary("valgrind")
    report_path = tmp_path / "compare.json"
    with trio.fail_after(240):
        result = await trio.run_process(
            [sys.executable, "-m", "bench.compare", "--instructions", "--peers",
             "epd_trio,epd_trio+pools,direct", "--requests", "8", "--concurrency", "1",
             "--max-tokens", "3", "--rounds", "1", "--warmup", "2", "--quiet",
             "--json", str(report_path)],
            capture_stdout=True, capture_stderr=True, check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    (by_peer,) = json.loads(report_path.read_text())["rounds"]
    counted = {name: run["proxy_instructions_per_request"] for name, run in by_peer.items()}
    # A request through the proxy is a few million instructions (2.6 on x86-64 at 16 tokens).
    assert all(10**5 < counted[name] < 10**8 for name in ("epd_trio", "epd_trio+pools"))
    assert counted["direct"] is None
    assert "proxy instructions per request (callgrind), millions:" in out
    assert re.search(r"epd_trio / epd_trio\+pools \(per round\):.* proxy instructions/request "
                     r"x\d\.\d{3}", out)


def test_a_callgrind_dump_is_read_from_its_summary() -> None:
    dump = "version: 1\ncmd: python\nevents: Ir\nfl=(1) x.c\n0 5\nsummary: 2605123\ntotals: 2605999\n"
    assert callgrind_total(dump) == 2605123
    assert callgrind_total("events: Ir\ntotals: 17\n") == 17
    with pytest.raises(ValueError, match="not a callgrind dump"):
        callgrind_total("hello")


def test_instructions_need_valgrind_and_one_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        compare_args(["--instructions", "--peers", "epd_trio:w2"])
    monkeypatch.setenv("PATH", "/nonexistent")
    assert available_callgrind() == ("valgrind and callgrind_control not found "
                                     "(apt-get install valgrind)")
    with pytest.raises(SystemExit):
        compare_args(["--instructions", "--peers", "epd_trio"])


def test_embeddings_peers_are_the_ones_that_route_them_and_never_stream(tmp_path: Path) -> None:
    args = compare_args(["--peers", "epd_trio/embeddings,vllm-router/embeddings,direct"])
    peers, skipped = peer_commands(args, Backends((), ("http://p",), ("http://d",)))
    assert [(p.name, p.path) for p in peers] == [
        ("epd_trio/embeddings", "/v1/embeddings"), ("direct", "/v1/chat/completions")]
    assert skipped == ["vllm-router/embeddings: skipped, only epd_trio, hypercorn and direct "
                       "are loaded with embeddings here"]
    with pytest.raises(SystemExit):
        compare_args(["--peers", "epd_trio/embeddings", "--stream"])


async def test_the_lean_fake_answers_embeddings_like_vllm() -> None:
    from bench.lean_fake import EMBEDDING_DIM
    fake = LeanFake("decode", prefill_time=0)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(fake.serve)
        async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
            ok = await client.post("/v1/embeddings", json={"model": "m", "input": ["a", "b"]})
            bad = await client.post("/v1/embeddings", json={"model": "m"})
            not_object = await client.post("/v1/embeddings", content=b"[1]")
        nursery.cancel_scope.cancel()
    answer = ok.json()
    assert ok.status_code == 200 and answer["object"] == "list" and answer["model"] == "m"
    assert [d["index"] for d in answer["data"]] == [0, 1]
    assert len(answer["data"][0]["embedding"]) == EMBEDDING_DIM
    assert answer["usage"]["prompt_tokens"] == 16
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    assert not_object.status_code == 400
    assert not_object.json()["error"]["message"] == "request body must be a JSON object"
    assert fake.answered == 1  # the two 400s are not counted as answered


def test_model_lookup_measures_each_case_and_each_finds_its_pool() -> None:
    from bench.model_lookup import cases, lookup_costs
    found = {name: lookup(proxy) for name, (proxy, lookup) in cases().items()}
    assert {name: (route.model, leg, adapter and adapter.name)
            for name, (route, leg, adapter) in found.items()} == {
        "one pool": ("bench", None, None), "three pools": ("bench", None, None),
        "alias": ("bench", "bench", None), "sticky alias": ("bench", "bench", None),
        "adapter": ("bench", None, "bench-sql")}
    costs = lookup_costs(50)
    assert set(costs) == set(found) and all(c > 0 for c in costs.values())


# -- bench.policies: its workload, its ideal, and a tiny real run ---------------------------------
def _policies_args(*extra: str) -> argparse.Namespace:
    from bench.policies import parse_args as policies_args
    return policies_args(["--duration", "4", "--prefixes", "2", "--prefix-share", "1",
                          "--image-share", "0", *extra])


def test_policies_workload_is_reproducible_and_its_ideal_counts_first_misses() -> None:
    from bench.policies import ideal_hit_rate, policy_sets, workload
    args = _policies_args()
    jobs = workload(args, rate=5.0)
    assert jobs == workload(args, rate=5.0) and len(jobs) > 5
    assert all(0 < job.at < 4 for job in jobs)
    # Two prefixes of 512 tokens: each misses once, then its 32 blocks always hit (the fake's
    # chat template adds 5 tokens: two roles, two ends, the generation prompt).
    per_prompt = 512 + args.question_words + 5
    expected = (len(jobs) - 2) * 512 / (len(jobs) * per_prompt)
    assert ideal_hit_rate(jobs) == pytest.approx(expected)
    assert policy_sets("round_robin,cache_aware/least_loaded/power_of_two/counts") == {
        "round_robin": ("round_robin", "round_robin", "round_robin", True),
        "cache_aware/least_loaded/power_of_two/counts": (
            "cache_aware", "least_loaded", "power_of_two", False)}


def test_the_pooled_reference_is_the_ideal_when_everything_fits_and_lru_when_not() -> None:
    from bench.policies import Job, ideal_hit_rate, pooled_hit_rate, workload
    jobs = workload(_policies_args(), rate=5.0)
    blocks = {block for job in jobs for block in job.prefill_blocks}
    assert pooled_hit_rate(jobs, len(blocks)) == pytest.approx(ideal_hit_rate(jobs))
    # Three prompts of 4 blocks (65 tokens), the second sharing two blocks with the first: an
    # LRU of 4 blocks keeps the second's, so the third, which starts like the first, misses.
    jobs = [Job(0.0, False, b"", chain, 4, 65) for chain in ((1, 2, 3, 4), (1, 2, 5, 6),
                                                             (3, 4, 7, 8))]
    assert pooled_hit_rate(jobs, 4) == pytest.approx(32 / 195)
    assert ideal_hit_rate(jobs) == pytest.approx(64 / 195)


def _best_pooled(jobs: list, blocks: int, *, prefix: bool) -> int:
    """Hit tokens of the best schedule of one cache of ``blocks`` blocks, by trying every
    content after every job (any subset of what it held and what the job carried): hits
    counted per block, or (``prefix``) only the leading ones, as vLLM does."""
    from itertools import combinations

    best = {frozenset(): 0}
    for job in jobs:
        limit = min(len(job.prefill_blocks), (job.prompt_tokens - 1) // 16)
        after: dict[frozenset, int] = {}
        for held, got in best.items():
            counted = job.prefill_blocks[:limit]
            if prefix:
                hit = next((i for i, b in enumerate(counted) if b not in held), len(counted))
            else:
                hit = sum(b in held for b in counted)
            pool = sorted(held | set(job.prefill_blocks))
            for size in range(min(blocks, len(pool)) + 1):
                for kept in combinations(pool, size):
                    state = frozenset(kept)
                    after[state] = max(after.get(state, -1), got + 16 * hit)
        best = after
    return max(best.values())


def _lru_ranks(jobs: list, places: tuple[int, ...], ranks: int, per_rank: int) -> int:
    """Hit tokens of ``jobs`` sent to ``places`` over LRU ranks of ``per_rank`` blocks, as
    the simulated engine keeps them."""
    from epd_trio.testing.prefix_cache import PrefixCache

    caches = [PrefixCache(block_size=16, capacity=per_rank) for _ in range(ranks)]
    for job, rank in zip(jobs, places, strict=True):
        caches[rank].admit(job.prefill_blocks, job.prompt_tokens, hit_limit=job.prompt_tokens - 1)
    return sum(cache.hits for cache in caches)


def test_the_bounded_ideal_keeps_what_will_be_needed_soonest() -> None:
    from bench.policies import Job, bounded_ideal_hit_rate, ideal_hit_rate, pooled_hit_rate
    # Two blocks in all. Block 1 is needed again by job 2, block 3 by job 3; block 2 never
    # counts (job 2 has 32 tokens: vLLM computes its last token, so its last block cannot hit).
    # Keeping 1 then 3 hits twice. LRU, evicting a job's tail before its head as vLLM does,
    # keeps 1 and 3 after job 1 (job 2 hits block 1), then 2 and 1: one hit.
    jobs = [Job(0.0, False, b"", chain, 4, tokens) for chain, tokens in (
        ((1, 2), 33), ((3,), 17), ((1, 2), 32), ((3,), 17))]
    assert bounded_ideal_hit_rate(jobs, 2) == pytest.approx(32 / 99) == ideal_hit_rate(jobs)
    assert pooled_hit_rate(jobs, 2) == pytest.approx(16 / 99)
    # One block: block 1 from job 0 to job 2 and block 3 from job 1 to job 3 overlap at job 1.
    assert bounded_ideal_hit_rate(jobs, 1) == pytest.approx(16 / 99)
    assert bounded_ideal_hit_rate(jobs, 0) == 0


@pytest.mark.parametrize("seed", range(12))
def test_the_bounded_ideal_is_the_best_schedule_and_no_routing_over_lru_ranks_passes_it(
    seed: int,
) -> None:
    """Against exhaustive search on small sequences drawn from a tiny prefix tree: equal to the
    best schedule counting hits block by block, at least the best counting leading blocks, and
    at least every placement of the jobs over two LRU ranks sharing the blocks."""
    import itertools
    import random

    from bench.policies import Job, bounded_ideal_hit_rate
    rng = random.Random(seed)
    paths = [(1, 2, 3), (1, 2, 4), (1, 5), (6, 7), (8,)]
    jobs = []
    for _ in range(6):
        chain = rng.choice(paths)[:rng.randint(1, 3)]
        jobs.append(Job(0.0, False, b"", chain, 4, 16 * len(chain) + rng.choice((0, 1))))
    total = sum(job.prompt_tokens for job in jobs)
    for blocks in (1, 2, 3, 4):
        bound = bounded_ideal_hit_rate(jobs, blocks) * total
        assert bound == pytest.approx(_best_pooled(jobs, blocks, prefix=False))
        assert bound >= _best_pooled(jobs, blocks, prefix=True)
    # Ranks of 3 blocks, as large as the longest prompt (as in the bench: a rank's cache keeps
    # a larger prompt's blocks whole, past its capacity).
    bound = bounded_ideal_hit_rate(jobs, 6) * total
    assert bound >= max(_lru_ranks(jobs, places, 2, 3)
                        for places in itertools.product((0, 1), repeat=len(jobs)))


def test_the_placed_ideal_routes_the_proxied_requests_for_the_direct_ones() -> None:
    import itertools

    from bench.policies import Job, ideal_hit_rate, placed_ideal_hit_rate

    def job(chain: tuple[int, ...], direct: int | None) -> Job:
        return Job(0.0, False, b"", chain, 4, 16 * len(chain) + 1, direct=direct)

    # A proxied prompt, then the same prompt sent directly to slot 1 and to slot 0: the proxied
    # one can warm only one of them. One cache over everything would have had both hit.
    jobs = [job((1,), None), job((1,), 1), job((1,), 0)]
    assert placed_ideal_hit_rate(jobs, 2) == pytest.approx(16 / 51)
    assert ideal_hit_rate(jobs) == pytest.approx(32 / 51)
    # Direct requests to one slot find each other; the proxied one goes where the blocks are.
    jobs = [job((1, 2), 0), job((1, 3), 0), job((1, 2), None), job((1, 2), 1)]
    assert placed_ideal_hit_rate(jobs, 2) == pytest.approx((16 + 32) / 132)
    # The best placement of the proxied job over two large ranks reaches it, and none passes.
    reached = []
    for (place,) in itertools.product((0, 1), repeat=1):
        chosen = tuple(place if j.direct is None else j.direct for j in jobs)
        reached.append(_lru_ranks(jobs, chosen, 2, 64))
    assert max(reached) == 48


async def test_policies_bench_runs_two_sets(tmp_path: Path) -> None:
    report_path = tmp_path / "policies.json"
    with trio.fail_after(120):
        result = await trio.run_process(
            [sys.executable, "-m", "bench.policies", "--duration", "2", "--load", "0.3",
             "--policies", "round_robin,round_robin/cache_aware/least_loaded",
             "--long-tokens", "32", "--decision-rounds", "50", "--json", str(report_path)],
            capture_stdout=True, capture_stderr=True, check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    report = json.loads(report_path.read_text())
    rows = report["rows"]
    assert 0 < report["pooled_lru_hit_rate"] <= report["ideal_hit_rate"]
    assert report["pooled_lru_hit_rate"] <= report["bounded_ideal_hit_rate"]
    assert report["placed_ideal_hit_rate"] is None  # no direct traffic
    assert "caches pooled as one LRU of 1024 blocks" in out  # 4 ranks x 256 blocks
    assert [row["policy"] for row in rows] == ["round_robin", "round_robin/cache_aware/least_loaded"]
    assert all(row["failed"] == 0 and row["requests"] > 0 for row in rows)
    assert all(0 <= row["hit_rate"] <= 1 for row in rows)
    assert "| round_robin | 30% " in out and "decision cost" in out


def test_policies_decision_costs_time_every_policy_on_the_pipelines_path() -> None:
    import math

    from bench.policies import decision_costs
    costs = decision_costs(50)
    assert list(costs) == ["round_robin", "least_loaded", "power_of_two", "cache_aware"]
    assert all(0 < cost < math.inf for cost in costs.values())


def test_policies_decisions_only_prints_the_costs(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.policies import main
    assert main(["--decisions-only", "--decision-rounds", "50"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("decision cost") and "cache_aware" in out and "|" not in out


def test_kv_index_bench_measures_a_decision_and_ingestion(
        capsys: pytest.CaptureFixture[str]) -> None:
    from bench.kv_index import main
    assert main(["--slots", "4", "--blocks", "2000", "--decisions", "300", "--batches", "200",
                 "--json"]) == 0
    parts = {line["part"]: line for line in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(parts) == {"reference", "ingestion", "decision"}
    ingestion, decision = parts["ingestion"], parts["decision"]
    # Every stored event was indexed: each batch continues a chain it stored, nothing evicted.
    assert ingestion["events"] == 800 and ingestion["orphans"] == 0
    assert ingestion["evictions"] == 0 and ingestion["blocks"] >= 800
    assert decision["decisions"] == 300 and decision["slots"] == 4
    # Half the requests repeat a stored chain: the policy sends those to a slot holding it.
    assert 100 < decision["chose_a_holder"] <= 300
    assert 0 < decision["match_p50_us"] <= decision["p50_us"] <= decision["p99_us"]
    assert decision["p99_us"] <= decision["with_keys_p99_us"]


async def test_slow_headers_runs_a_small_attack(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    with trio.fail_after(120):
        result = await trio.run_process(
            [sys.executable, "-m", "bench.slow_headers", "--connections", "40", "--interval",
             "0.2", "--keep-alive", "1", "--probe-interval", "0.1", "--settle", "2",
             "--json", str(report_path)],
            capture_stdout=True, capture_stderr=True, check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "verdict: the head is bounded and normal requests got in" in out
    report = json.loads(report_path.read_text())
    attack = report["attack"]
    assert attack["connected"] == attack["closed_by_proxy"] == 40
    assert 0.9 <= attack["held_seconds"]["p50"] <= attack["held_seconds"]["max"] < 10
    during = report["normal_requests"]["during_attack"]
    assert during["sent"] >= 1 and during["ok"] == during["sent"]
    assert report["proxy"]["rss_mib"]["peak"] >= report["proxy"]["rss_mib"]["before"] > 0


def test_worker_peers_and_cpu_pinning_parse() -> None:
    args = compare_args(["--peers", "epd_trio:w1,epd_trio:w2", "--proxy-cpus", "1",
                         "--rest-cpus", "0,2-3"])
    assert args.proxy_cpus == {1} and args.rest_cpus == {0, 2, 3}
    peers, skipped = peer_commands(args, Backends((), ("http://p",), ("http://d",)))
    assert skipped == [] and [p.name for p in peers] == ["epd_trio:w1", "epd_trio:w2"]
    workers = []
    for peer in peers:
        assert peer.command is not None
        cmd = peer.command(8000)
        workers.append(cmd[cmd.index("--workers") + 1])
    assert workers == ["1", "2"]


def test_otel_peers_get_tracing_switched_on_by_the_standard_variables(tmp_path: Path) -> None:
    checkout = tmp_path / "other"
    (checkout / "epd_trio").mkdir(parents=True)
    (checkout / "epd_trio" / "__init__.py").write_text("")
    args = compare_args(["--peers", f"epd_trio,epd_trio+otel,epd_trio+otel=0.1,"
                         f"epd_trio@{checkout}+otel", "--otlp-endpoint", "http://127.0.0.1:1"])
    peers, skipped = peer_commands(args, Backends((), ("http://p",), ("http://d",)))
    assert skipped == []
    plain, always, ratio, other = peers
    assert plain.env is None
    assert always.env == {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
                          "OTEL_TRACES_SAMPLER": "always_on"}
    assert ratio.env is not None and ratio.env["OTEL_TRACES_SAMPLER_ARG"] == "0.1"
    assert ratio.env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert other.cwd == str(checkout) and other.env == always.env


def test_tracing_cost_measures_every_mode_and_every_span_arrives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each mode's replay, in this process (the bench runs each in a fresh interpreter)."""
    from bench.tracing_cost import MODES, measure
    from epd_trio.testing.otlp_receiver import OtlpReceiver

    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        micros = {mode: measure(mode, 30, 1, receiver.endpoint) for mode in MODES}
        assert all(value > 0 for value in micros.values())
        assert receiver.wait_for(lambda spans: len(spans) >= 90, timeout=30)
    assert len(receiver.spans) == 90  # 3 per sampled request, none from the other modes


def test_the_dashboard_picture_draws_the_panels_queries(tmp_path: Path) -> None:
    from bench.dashboard_png import MAIN_PANELS, draw, legend, panel_targets, series_of

    panels = panel_targets()
    assert [title for title, _, _ in panels] == list(MAIN_PANELS)
    for _, _, targets in panels:  # the dashboard's own queries, variables filled in
        assert targets and all("$" not in expr for expr, _ in targets)
    assert legend("{{role}} {{upstream}}", {"role": "decode", "upstream": "http://h:8001"}) == \
        "decode :8001"
    matrix = [{"metric": {"stage": "decode"}, "values": [[100.0, "0.5"], [101.0, "NaN"],
                                                          [102.0, "0.7"]]},
              {"metric": {"stage": "encode"}, "values": [[101.0, "NaN"]]}]
    assert series_of(matrix, "{{stage}}", 100.0) == [("decode", [0.0, 2.0], [0.5, 0.7])]
    out = tmp_path / "dashboard.png"
    draw([(title, unit, series_of(matrix, "{{stage}}", 100.0)) for title, unit, _ in panels[:4]]
         + [("empty", "s", [])], out, "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


# -- bench.replicas and bench.policies --replicas: tiny real runs on a real redis-server ----------
async def test_replicas_bench_runs_every_mode_side_by_side(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    report_path = tmp_path / "replicas.json"
    with trio.fail_after(240):
        result = await trio.run_process(
            [sys.executable, "-m", "bench.replicas", "--rounds", "1", "--requests", "60",
             "--warmup", "6", "--concurrency", "6", "--registrations", "3",
             "--state-url", redis_server.url, "--json", str(report_path)],
            capture_stdout=True, capture_stderr=True, check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    (by_mode,) = json.loads(report_path.read_text())["rounds"]
    assert set(by_mode) == {"local", "shared", "global"}
    assert all(run["ok"] == 60 and run["proxy_cpu_ms_per_request"] > 0
               for run in by_mode.values())
    assert by_mode["shared"]["convergence_ms"]["max"] > 0
    assert "| global |" in out and "registration convergence" in out


async def test_policies_bench_runs_precise_with_replicas_direct_traffic_and_a_small_cache(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """precise_cache_aware beside cache_aware over fakes publishing KV events on ZMQ: 1 and 3
    replicas, a share of the requests straight to the prefill engines, the cache sized from the
    workload. Structure only: the figures of a 2 s run mean nothing."""
    report_path = tmp_path / "policies.json"
    with trio.fail_after(240):
        result = await trio.run_process(
            [sys.executable, "-m", "bench.policies", "--duration", "2", "--load", "0.3",
             "--policies", "cache_aware + least_loaded,precise_cache_aware + least_loaded",
             "--replicas", "1,3", "--state-url", redis_server.url, "--direct-share", "0.3",
             "--cache-share", "0.25", "--render-timeout", "5", "--long-tokens", "32",
             "--decision-rounds", "50", "--json", str(report_path)],
            capture_stdout=True, capture_stderr=True, check=False)
    out, err = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, out + err
    report = json.loads(report_path.read_text())
    rows = report["rows"]
    assert [row["policy"] for row in rows] == [
        "cache_aware + least_loaded", "cache_aware + least_loaded, 3 replicas",
        "precise_cache_aware + least_loaded", "precise_cache_aware + least_loaded, 3 replicas"]
    assert all(row["failed"] == 0 and row["requests"] > 0 and row["direct"] > 0
               and row["direct_failed"] == 0 for row in rows)
    assert all(0 <= row["hit_rate"] <= 1 and row["ttfb_p50"] <= row["ttfb_p99"] for row in rows)
    assert [row["kv"] is None for row in rows] == [True, True, False, False]
    # Every proxied request was rendered and chosen on an exact slot's index.
    assert all(row["kv"]["decisions_total"] == row["requests"] for row in rows[2:])
    assert all(0 <= row["proxied_hit_rate"] <= 1 for row in rows)
    assert 0 < report["ideal_hit_rate"] < 1 and 0 < report["proxied_ideal_hit_rate"] < 1
    assert 0 <= report["pooled_lru_hit_rate"] <= report["bounded_ideal_hit_rate"]
    assert report["bounded_ideal_hit_rate"] <= report["ideal_hit_rate"]
    assert 0 < report["placed_ideal_hit_rate"] <= report["ideal_hit_rate"]
    assert "no routing can pass" in out and "with the direct requests where they went" in out
    assert "proxied prefix hit (ideal" in out
    assert "more requests went straight to the prefill engines" in out
    assert "cache: " in err and "blocks per rank" in err


async def test_policies_bench_compares_replicas_with_and_without_placement(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    report_path = tmp_path / "policies.json"
    with trio.fail_after(180):
        result = await trio.run_process(
            [sys.executable, "-m", "bench.policies", "--duration", "2", "--load", "0.3",
             "--policies", "cache_aware + least_loaded", "--replicas", "1,3",
             "--compare-placement", "--state-url", redis_server.url, "--long-tokens", "32",
             "--decision-rounds", "50", "--json", str(report_path)],
            capture_stdout=True, capture_stderr=True, check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    labels = [row["policy"] for row in json.loads(report_path.read_text())["rows"]]
    assert labels == ["cache_aware + least_loaded", "cache_aware + least_loaded, 3 replicas",
                      "cache_aware + least_loaded, 3 replicas, no placement"]
