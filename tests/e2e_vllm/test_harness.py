"""The real-vLLM harness itself, fast: a stand-in ``vllm`` package answers ``/health``.

These run in the main suite (no ``vllm_e2e`` marker): they check start-up, the retry and its
log tails, stopping by PID, restarting, and the lifeline, with a venv whose ``vllm`` is a tiny
HTTP server, so what the real suite relies on is proven without a multi-GB install.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from .cluster import ClusterError, recorded_cluster, start_cluster
from .processes import alive, stop_tree
from .provision import NIXL_PINS, STAMP, VLLM_PINS, Home

ROOT = Path(__file__).resolve().parents[2]

FAKE_VLLM_MAIN = '''
import http.server, os, sys

def main():
    args = sys.argv[1:]  # serve MODEL --host H --port P ...
    model, port = args[1], int(args[args.index("--port") + 1])
    if os.path.exists(os.path.join(model, "crash")):
        print("stand-in vllm: the model failed to load", flush=True)
        return 3

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Home]:
    """A home whose venv (a real one, without pip) holds the stand-in ``vllm`` package."""
    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    (site,) = (env / "lib").glob("python3*/site-packages")
    cli = site / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for package in (site / "vllm", site / "vllm" / "entrypoints", cli):
        (package / "__init__.py").write_text("")
    (cli / "main.py").write_text(FAKE_VLLM_MAIN)
    (env / STAMP).write_text(" ".join([*VLLM_PINS, *NIXL_PINS]))
    home = Home.from_env({"EPD_E2E_HOME": str(tmp_path / "home"), "EPD_E2E_VENV": str(env)})
    home.model("vision").mkdir(parents=True)
    (home.model("vision") / "config.json").write_text("{}")
    yield home
    cluster = recorded_cluster(home)
    if cluster is not None:
        cluster.stop()


def _wait_gone(pid: int, timeout: float) -> bool:
    """Wait (event-driven: a pidfd turns readable at exit) until ``pid`` exits."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def test_start_waits_for_health_and_stop_ends_every_server(home: Home) -> None:
    said: list[str] = []
    cluster = start_cluster(home=home, log=said.append)
    try:
        assert list(cluster.servers) == ["encode", "prefill", "decode"]
        assert cluster.healthy() == []
        ports = [s.port for s in cluster.servers.values()]
        ports += [s.nixl_port for s in cluster.servers.values() if s.nixl_port]
        assert len(set(ports)) == 5  # an HTTP port per server, a NIXL port for P and D
        assert recorded_cluster(home) is not None
        assert any("cluster ready" in line for line in said)
        pids = [s.pid for s in cluster.servers.values()]
    finally:
        cluster.stop()
    assert pids and not any(alive(pid) for pid in pids if pid)
    assert recorded_cluster(home) is None


def test_a_failed_start_is_retried_once_then_reported_with_log_tails(home: Home) -> None:
    (home.model("vision") / "crash").touch()
    said: list[str] = []
    with pytest.raises(ClusterError) as failed:
        start_cluster(home=home, log=said.append)
    message = str(failed.value)
    assert "attempt 1:" in message and "attempt 2:" in message and "attempt 3" not in message
    # Each attempt stops at the first server that exits, with every server's log tail.
    attempts = message.split("attempt 2:")
    for attempt in attempts:
        assert "exited during start-up" in attempt
        assert "stand-in vllm: the model failed to load" in attempt
        assert all(f"--- {name} (" in attempt for name in ("encode", "prefill", "decode"))
    assert sum("retrying once" in line for line in said) == 1
    assert sorted(p.name for p in home.run.glob("*.attempt*.log")) == [
        f"{name}.attempt{n}.log" for name in ("decode", "encode", "prefill") for n in (1, 2)]
    assert recorded_cluster(home) is None


def test_a_stopped_server_restarts_on_its_port(home: Home) -> None:
    cluster = start_cluster(home=home, log=lambda _: None)
    try:
        port, old_pid = cluster.servers["encode"].port, cluster.servers["encode"].pid
        cluster.stop(["encode"])
        assert cluster.stopped == {"encode"} and cluster.healthy() == ["encode"]
        cluster.restart("encode")
        assert cluster.stopped == set() and cluster.healthy() == []
        assert cluster.servers["encode"].port == port and cluster.servers["encode"].pid != old_pid
    finally:
        cluster.stop()


def test_servers_stop_themselves_when_their_owner_is_killed(home: Home) -> None:
    owner_code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.e2e_vllm.cluster import start_cluster\n"
        "from tests.e2e_vllm.provision import Home\n"
        "cluster = start_cluster(home=Home.from_env(), log=lambda _: None)\n"
        "print(json.dumps([s.pid for s in cluster.servers.values()]), flush=True)\n"
        "sys.stdin.read()  # until killed\n"
    )
    env = {**os.environ, "EPD_E2E_HOME": str(home.root), "EPD_E2E_VENV": str(home.venv)}
    with subprocess.Popen([sys.executable, "-c", owner_code], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, env=env, cwd=ROOT) as owner:
        try:
            assert owner.stdout is not None
            pids = json.loads(owner.stdout.readline())
            assert all(alive(pid) for pid in pids)
            owner.kill()  # no clean-up runs: only the lifeline pipe's end of file tells them
            owner.wait()
            assert all(_wait_gone(pid, timeout=30) for pid in pids)
        finally:
            owner.kill()


def test_stop_tree_kills_what_ignores_sigterm() -> None:
    # A shell that ignores SIGTERM, with a child: both must be gone afterwards.
    script = "trap '' TERM; sleep 60 & echo started; wait"
    with subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE,
                          start_new_session=True) as shell:
        try:
            assert shell.stdout is not None and shell.stdout.readline() == b"started\n"
            killed = stop_tree(shell.pid, timeout=0.5)
            assert shell.pid in killed and len(killed) == 2  # the shell and its sleep
            shell.wait(timeout=10)
            assert not any(alive(pid) for pid in killed)
            assert stop_tree(shell.pid) == []  # gone: nothing is signalled any more
        finally:
            if shell.poll() is None:
                os.killpg(shell.pid, signal.SIGKILL)


def test_a_cluster_owned_by_another_live_session_is_neither_shared_nor_stopped(
    home: Home,
) -> None:
    cluster = start_cluster("epd", "vision", home=home, owned=True, log=lambda _: None)
    try:
        state_path = home.run / "cluster.json"
        state = json.loads(state_path.read_text())
        assert state["owner_pid"] == os.getpid()
        other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                 stdin=subprocess.PIPE)
        try:  # as if another pytest session (alive) had started it
            state_path.write_text(json.dumps({**state, "owner_pid": other.pid}))
            with pytest.raises(ClusterError, match=f"another test session \\(pid {other.pid}\\)"):
                recorded_cluster(home)
            with pytest.raises(ClusterError, match="another test session"):
                start_cluster("epd", "vision", home=home, owned=True, log=lambda _: None)
            assert all(server.alive() for server in cluster.servers.values())
        finally:
            other.stdin.close()  # type: ignore[union-attr]
            other.wait(timeout=30)
        state_path.write_text(json.dumps(state))
    finally:
        cluster.stop()
