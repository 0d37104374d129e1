"""The real-vLLM session: one cluster for all ``vllm_e2e`` tests, and what they observed.

The cluster starts on the first test that needs it (provisioning the venv and models first if
this machine has none yet) and stops when the session ends, also when a test failed or the run
was interrupted (pytest runs session finalizers on Ctrl-C; a killed session's servers stop
themselves through their lifeline). A cluster already running under the same home (started with
``python -m tests.e2e_vllm.cluster start``) is used as it is and left running.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest

from epd_trio.testing.otlp_receiver import OtlpReceiver

from .cluster import Cluster, Server, recorded_cluster, start_cluster, start_kv_cluster
from .provision import Home
from real_servers import require_one_process
from session_notes import SessionNotes

NOTES = SessionNotes("observed on real vLLM", "vllm-e2e")
#: The suite's first tests, in this order, before any other (issue 30). In each, a fresh vLLM
#: server's first forward is one token long: a plain server's one-token prompt, then decode's
#: step after its first KV pull. On a CPU with AMX that is the forward that dies of SIGILL
#: when the AMX permission is missing (amx.py); any prefill-sized forward before it (every
#: other test asks decode directly) would hide the bug, since oneDNN asks on that path.
FIRST = ("test_a_one_token_prompt_as_a_plain_servers_first_request",
         "test_a_text_request_as_the_clusters_first_request_pulls_its_kv")
#: Tests that stop one of the session's servers on purpose: they run after every other test,
#: whatever file they are in, since bringing the server back costs a vLLM start-up.
STOPS_A_SERVER = ("test_encoder_stopped_fails_media_cleanly_and_text_still_works",
                  "test_a_restarted_prefill_leaves_the_index_with_nothing_of_its_old_cache")


#: Tests with a plain server of their own and no use for the cluster: before the cluster
#: starts, so no more than one engine busy-polls beside them on a small machine.
OWN_SERVER = ("test_priority_scheduling_serves_the_request_in_the_headroom_first",
              "test_two_real_models_each_reach_only_their_own_engine",
              "test_adapters_on_prefill_and_decode_and_embeddings_through_the_proxy")
#: The order of the suite's first tests.
EARLY = (FIRST[0], *OWN_SERVER, FIRST[1])


def run_order(name: str) -> int:
    """Where a test named ``name`` runs: ``EARLY`` in order, the rest, ``STOPS_A_SERVER``."""
    if name in EARLY:
        return EARLY.index(name)
    return len(EARLY) + (name in STOPS_A_SERVER)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: run_order(item.name))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def vllm_session(request: pytest.FixtureRequest) -> Iterator[tuple[Cluster, OtlpReceiver]]:
    """The cluster, and the OTLP receiver its servers export their traces to (listening
    before they start, so that no span of the session is dropped)."""
    require_one_process("real-vLLM suite")
    say = NOTES.say(request.config)
    home = Home.from_env()
    recorded = recorded_cluster(home)
    if recorded is not None and not recorded.healthy():
        say(f"using the cluster already running in {home.root} (left running)")
        with OtlpReceiver(port=recorded.traces_port or 0) as receiver:
            yield recorded, receiver
        return
    with OtlpReceiver() as receiver:
        cluster = start_cluster("epd", "vision", home=home, owned=True, log=say,
                                traces_port=receiver.port)
        say(cluster.describe().replace("\n", "\n[vllm-e2e] "))
        try:
            yield cluster, receiver
        finally:
            cluster.stop()
            say("cluster stopped")


@pytest.fixture(scope="session")
def vllm_cluster(vllm_session: tuple[Cluster, OtlpReceiver]) -> Cluster:
    return vllm_session[0]


@pytest.fixture
def vllm_spans(vllm_session: tuple[Cluster, OtlpReceiver]) -> OtlpReceiver:
    """What the cluster's servers exported of their traces (vLLM's ``llm_request`` spans)."""
    cluster, receiver = vllm_session
    assert cluster.traces_port == receiver.port, (
        f"the cluster running in {cluster.home.root} was started without traces: stop it "
        "(python -m tests.e2e_vllm.cluster stop) and start it again")
    return receiver


@pytest.fixture
def cluster(vllm_cluster: Cluster) -> Iterator[Cluster]:
    """The session's cluster, with any server an earlier test stopped on purpose started again.

    A server that died is not restarted: the test fails at set-up (or, for a death during the
    test, at tear-down) saying why, e.g. a SIGILL with the missing AMX permission named
    (issue 30), rather than every later test meeting a refused connection.
    """
    yield from _healthy(vllm_cluster, "a vLLM server of the session")


@pytest.fixture(scope="module")
def vllm_kv_servers(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Two prefills and a decode publishing their KV cache events (``start_kv_cluster``),
    started on the first test that needs them and stopped when its module ends. Beside the
    session's E/P/D cluster six engines busy-poll two cores and both sets time out, so CI runs
    their file in a session of its own (``.ci/run``), which never starts the E/P/D cluster.

    ``EPD_E2E_KV_SERVERS=FILE`` uses servers already running instead (FILE: a JSON object of
    ``Server`` records by name, as ``dataclasses.asdict`` writes them), left running: for
    working on the tests without paying their start-up at every run. The file is written back
    at the end (a test that restarted a server changed its pid).
    """
    say = NOTES.say(request.config)
    state = os.environ.get("EPD_E2E_KV_SERVERS")
    if state:
        records = json.loads(Path(state).read_text())
        servers = {name: Server(**record) for name, record in records.items()}
        yield Cluster(Home.from_env(), "kv", "text", servers, None, owned=False, recorded=False)
        Path(state).write_text(json.dumps({name: asdict(s) for name, s in servers.items()}))
        return
    kv = start_kv_cluster(log=say)
    try:
        yield kv
    finally:
        kv.stop()
        say("kv servers stopped")


@pytest.fixture
def kv_servers(vllm_kv_servers: Cluster) -> Iterator[Cluster]:
    """The session's KV-event servers, any one a test stopped or restarted healthy again (as
    ``cluster``): a test fails at set-up or tear-down naming a server that died."""
    yield from _healthy(vllm_kv_servers, "a KV-event vLLM server")


def _healthy(servers: Cluster, which: str) -> Iterator[Cluster]:
    """``servers`` for one test: any a test stopped on purpose started again, and the test
    failed at set-up or tear-down naming ``which`` server died (never restarted: its death is
    the finding)."""
    for name in sorted(servers.stopped):
        servers.restart(name)
    if deaths := servers.deaths():
        pytest.fail(f"{which} died before this test:\n" + "\n".join(deaths), pytrace=False)
    yield servers
    if deaths := servers.deaths():
        pytest.fail(f"{which} died during this test:\n" + "\n".join(deaths), pytrace=False)


@pytest.fixture
def say(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Progress lines shown live (a server started by a test itself takes a minute)."""
    return NOTES.say(request.config)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """A client with room for vLLM's slow moments: on a loaded 2-core machine a request was seen
    to wait up to ~47 s inside vLLM before its engine got it (docs/contributing/tests.md)."""
    async with httpx.AsyncClient(timeout=120.0, trust_env=False) as c:
        yield c


@pytest.fixture
def observe(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Record what a test saw on the real servers; printed in the session's summary."""
    return NOTES.recorder(request)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    NOTES.summary(terminalreporter)
