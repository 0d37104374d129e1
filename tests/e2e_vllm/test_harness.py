"""The real-vLLM harness itself, fast: a stand-in ``vllm`` package answers ``/health``.

These run in the main suite (no ``vllm_e2e`` marker): they check start-up, the retry and its
log tails, stopping by PID, restarting, and the lifeline, with a venv whose ``vllm`` is a tiny
HTTP server, so what the real suite relies on is proven without a multi-GB install. So are the
AMX permission's ``.pth`` line (it runs in a spawned child of the venv), the refusal of a user's
venv without it on an AMX CPU, the naming of a server that died of SIGILL, and the order that
makes a fresh server's first forward one token long (issue 30).
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

import httpx
import pytest

from . import amx
from .cluster import ClusterError, recorded_cluster, start_cluster, start_single
from .conftest import EARLY, FIRST
from .processes import alive, stop_tree
from .provision import (
    NIXL_PINS,
    STAMP,
    VLLM_PINS,
    Home,
    ProvisionError,
    ensure_amx_permission,
    site_packages,
)

ROOT = Path(__file__).resolve().parents[2]

FAKE_VLLM_MAIN = '''
import http.server, multiprocessing, os, signal, sys, threading

ENGINE_DEAD = (b'{"error": {"message": "EngineCore encountered an issue. See stack trace (above) '
               b'for the root cause.", "type": "InternalServerError", "code": 500}}')


def engine_step():
    os.kill(os.getpid(), signal.SIGILL)  # what an AMX instruction without the permission does


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

        def do_POST(self):
            # Like vLLM on an AMX CPU without AMX permission (issue 30): the engine, a spawned
            # process, dies of SIGILL; the request gets vLLM's 500; then the server exits.
            engine = multiprocessing.get_context("spawn").Process(target=engine_step)
            engine.start()
            engine.join()
            print("[shutdown] MPClient: engine core exited unexpectedly; starting cleanup",
                  flush=True)
            self.send_response(500)
            self.send_header("content-length", str(len(ENGINE_DEAD)))
            self.end_headers()
            self.wfile.write(ENGINE_DEAD)
            self.wfile.flush()
            threading.Thread(target=server.shutdown).start()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    server.serve_forever()
'''


def bare_venv(path: Path) -> Path:
    """A real venv of this Python (without pip); its site-packages."""
    venv.create(path, with_pip=False)
    (site,) = (path / "lib").glob("python3*/site-packages")
    return site


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Home]:
    """A home whose venv (a real one, without pip) holds the stand-in ``vllm`` package and, as
    a user's venv must on an AMX CPU, the AMX permission's ``.pth`` line."""
    env = tmp_path / "venv"
    site = bare_venv(env)
    amx.install(site)
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


# -- issue 30: AMX permission, SIGILL, and the one-token first forwards -----------------------------
def test_the_pth_line_runs_in_the_venvs_spawned_interpreters_too(tmp_path: Path) -> None:
    """What the harness writes into its venv: the request runs at the start of the venv's
    Python and of a child it spawns, as vLLM spawns its engine (the permission is per process
    and lost at exec). On a CPU with AMX the child then holds the permission; elsewhere Linux
    refuses the request, and nothing else changes."""
    home = Home(tmp_path, tmp_path / "venv", external_venv=False)
    bare_venv(home.venv)
    said: list[str] = []
    ensure_amx_permission(home, said.append)  # writes, then checks (raises if it did not run)
    site = site_packages(home)
    assert sorted(p.name for p in site.glob("epd_trio_amx*")) == [amx.PTH_NAME, f"{amx.MODULE}.py"]
    assert amx.install(site) == []  # a stamped venv: rewritten only when it changed
    seen = amx.report(home.python, home.server_env(tmp_path / "tmp"))
    parent, spawned = seen["parent"], seen["spawned"]
    assert parent["ran"] and spawned["ran"] and parent["pid"] != spawned["pid"]
    for state in (parent, spawned):
        if amx.cpu_has_amx():
            assert (state["result"], state["permitted"]) == (0, True)
        elif os.uname().machine == "x86_64":  # Linux refuses: no AMX on this CPU
            assert state["result"] == -1 and state["errno"] != 0 and not state["permitted"]
        else:
            assert state["result"] is None
    assert said == []


def test_the_switch_turns_the_request_off_to_reproduce_the_bug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``EPD_E2E_AMX_PERMISSION=0``: the module still loads but asks nothing, and the harness
    neither refuses the venv nor hides it, so the suite shows the SIGILL on an AMX CPU."""
    home = Home(tmp_path, tmp_path / "venv", external_venv=False)
    bare_venv(home.venv)
    monkeypatch.setenv(amx.SWITCH, "0")
    said: list[str] = []
    ensure_amx_permission(home, said.append, has_amx=True)
    assert len(said) == 1 and "will die of SIGILL" in said[0]
    seen = amx.report(home.python, home.server_env(tmp_path / "tmp"))
    assert all(s["ran"] and s["result"] is None and not s["permitted"] for s in seen.values())


def test_a_users_venv_without_the_permission_is_refused_on_an_amx_cpu(tmp_path: Path) -> None:
    """EPD_E2E_VENV is never modified: on a CPU with AMX, a venv whose spawned child lacks the
    permission would fail 13 of 15 tests with "EngineCore encountered an issue", so it is
    refused up front, with the files to add. Without AMX it is used, with a warning."""
    site = bare_venv(tmp_path / "venv")
    home = Home(tmp_path / "home", tmp_path / "venv", external_venv=True)
    with pytest.raises(ProvisionError) as refused:
        ensure_amx_permission(home, has_amx=True)
    message = str(refused.value)
    assert "has no AMX permission" in message and "SIGILL" in message
    assert amx.PTH_NAME in message and str(amx.MODULE_SOURCE) in message and str(site) in message
    said: list[str] = []
    ensure_amx_permission(home, said.append, has_amx=False)
    assert len(said) == 1 and "would die of SIGILL" in said[0]
    assert list(site.glob("*amx*")) == []  # checked, never written
    (site / "other.pth").write_text("import ctypes; ctypes.CDLL(None).syscall(158, 0x1023, 18)\n")
    said.clear()
    ensure_amx_permission(home, said.append, has_amx=False)  # another .pth asks: no warning
    assert said == []


def test_a_server_whose_engine_died_of_sigill_is_named_with_the_amx_permission(
    home: Home,
) -> None:
    """The stand-in's engine, a spawned process, dies of a real SIGILL at the first request, as
    vLLM's does without AMX permission; the server answers vLLM's 500 and exits. The harness
    reads faulthandler's report in the log (vLLM only says its engine "exited unexpectedly")."""
    single = start_single(home, log=lambda _: None)
    try:
        assert single.deaths() == []
        response = httpx.post(single.url("single") + "/v1/completions", json={"prompt": [1]},
                              timeout=60)
        assert response.status_code == 500 and "EngineCore encountered an issue" in response.text
        (death,) = single.deaths()
        assert death.startswith("single: a vLLM process died of SIGILL")
        log = Path(single.servers["single"].log)
        assert "Fatal Python error: Illegal instruction" in log.read_text()
        with_amx = amx.death_message("decode", log, has_amx=True)
        assert "ARCH_REQ_XCOMP_PERM" in with_amx and amx.PTH_NAME in with_amx
        assert "not the missing AMX permission" in amx.death_message("decode", log, has_amx=False)
        assert recorded_cluster(home) is None  # a single server is not the home's cluster
    finally:
        single.stop()


def test_each_python_process_of_a_server_records_its_request(
    home: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    """How the real suite checks that vLLM's spawned engine asked too: each process of the
    venv writes its outcome into its server's temp dir; one whose venv lacks the line does not."""
    single = start_single(home, log=lambda _: None)
    try:
        ((pid, command, ran),) = single.python_processes("single")
        assert pid == single.servers["single"].pid and "vllm_cli.py serve" in command and ran
    finally:
        single.stop()
    (site_packages(home) / amx.PTH_NAME).unlink()
    monkeypatch.setattr(amx, "cpu_has_amx", lambda: False)  # else the venv is refused (good)
    single = start_single(home, log=lambda _: None)
    try:
        ((_, _, ran),) = single.python_processes("single")
        assert not ran
    finally:
        single.stop()


def test_a_server_killed_by_a_signal_is_named_by_its_log_or_its_exit_status(home: Home) -> None:
    single = start_single(home, log=lambda _: None)
    try:
        server = single.servers["single"]
        assert server.pid is not None
        os.kill(server.pid, signal.SIGILL)  # faulthandler is on in every server: it reports it
        assert _wait_gone(server.pid, timeout=30)
        (death,) = single.deaths()
        assert "died of SIGILL" in death
        Path(server.log).write_text("")  # no report in the log: the exit status (-4) tells
        (death,) = single.deaths()
        assert "died of SIGILL" in death
    finally:
        single.stop()


def test_the_suite_starts_with_the_one_token_first_forwards() -> None:
    """The real suite's order (conftest.EARLY), as pytest collects it: the plain server's
    one-token prompt, the tests with a server of their own, then the cluster's first request
    (a P -> D pull, so decode's first forward is one token), before every test that would send
    decode a prefill first."""
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "vllm_e2e",
         "tests/e2e_vllm"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    names = [line.split("::")[-1] for line in collected.splitlines() if "::" in line]
    assert len(names) > len(EARLY) + 5
    assert tuple(names[:len(EARLY)]) == EARLY
    assert EARLY[0] == FIRST[0] and EARLY[-1] == FIRST[-1]
