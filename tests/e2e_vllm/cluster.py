"""Real vLLM servers (Encoder / Prefill / Decode) on CPU for the real-vLLM tests, and by hand.

    python -m tests.e2e_vllm.cluster start [--layout epd|pd] [--model vision|text]
    python -m tests.e2e_vllm.cluster status     # URLs + EPD_*_URLS lines; exit 0 when healthy
    python -m tests.e2e_vllm.cluster stop

Layouts: ``epd`` = encoder (``--mm-encoder-only``, encoder-cache producer) + prefill (encoder-cache
consumer, NIXL KV producer) + decode (NIXL KV consumer), vision model; ``pd`` = prefill + decode.
Every server listens on a free port picked at start (its NIXL side channel too), below the
kernel's ephemeral range so that no connection takes it while a test restarts the server
(``epd_trio.testing.ports``), and has its own temp dir; the encoder cache
(``ECExampleConnector``: one safetensors file per item ``uuid``) is a folder under ``run/``. A
server counts as started when ``/health`` answers 200 within ``EPD_E2E_START_TIMEOUT`` seconds
(default 240) while its process is alive; a failed start is retried once on fresh ports, then
reported with the servers' log tails.

Servers are stopped by PID (with their start time, against PID reuse): SIGTERM, then SIGKILL for
whatever is left of the process tree. A cluster started by a test session is also tied to that
process by a lifeline pipe (see vllm_cli.py): it stops itself if the session dies without
cleaning up. A cluster started with ``start`` here runs until ``stop``; a test session finding
it healthy uses it and leaves it running. Memory: about 2 GB per server. CPU: an idle vLLM
engine busy-polls a core, so stop the cluster when you are done.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from epd_trio.testing.ports import free_ports

from . import amx
from .processes import alive, start_ticks, stop_tree, tail, tree
from .provision import VLLM_CLI, Home, Log, ensure_model, ensure_venv

#: Where every server exports its traces (``--otlp-traces-endpoint``): OTLP over HTTP/protobuf
#: (vLLM 0.32 speaks gRPC unless told), in batches every 0.5 s. A test session listens on the
#: cluster's ``traces_port`` (``epd_trio.testing.otlp_receiver``); while nothing does, vLLM's
#: exporter drops its batches, which costs the servers nothing else.
TRACES_PATH = "/v1/traces"
TRACE_ENV = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "500"}

HOST = "127.0.0.1"
MODEL_NAME = "tiny"
#: The servers' context length: a prompt over it is a 400 (one of the tests). Long enough that a
#: full-length generation takes many seconds (about 300 tokens/s here), so an aborted stream is
#: told apart from a finished one.
MAX_MODEL_LEN = 4096
DEFAULT_START_TIMEOUT = 240.0
STOP_TIMEOUT = 30.0
#: Attempts at starting a cluster: a failed start (a port taken meanwhile, a slow machine) is
#: retried once on fresh ports before the servers' log tails are reported.
START_ATTEMPTS = 2
#: How long a prefill keeps a request's KV for decode to pull (vLLM's default: 30 s). On a loaded
#: 2-core machine a decode request was seen to take up to ~47 s to reach decode's engine (the
#: request sits in vLLM between its HTTP front end and its engine); past the lease, decode would
#: read blocks the prefill had already freed.
NIXL_EXTRA_CONFIG = {"kv_lease_duration": 120}
LAYOUTS = {"epd": ("encode", "prefill", "decode"), "pd": ("prefill", "decode")}


class ClusterError(RuntimeError):
    """The cluster could not be started (the message carries the servers' log tails)."""


@dataclass
class Server:
    """One vLLM server: its role, ports and, once launched, its process identity."""

    name: str
    port: int
    args: list[str]
    log: str
    tmpdir: str
    nixl_port: int | None = None
    #: Where it publishes its KV cache events and answers replays (``--kv-events-config``).
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    pid: int | None = None
    ticks: int | None = None
    #: Environment variables of its own (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``...).
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def alive(self) -> bool:
        return self.pid is not None and alive(self.pid, self.ticks)

    @property
    def kv_events(self) -> str:
        """The server's URL for the proxy, naming its KV event sockets in the fragment."""
        assert self.kv_events_port is not None, f"{self.name} publishes no KV events"
        return (f"{self.url}#kv_events=tcp://{HOST}:{self.kv_events_port}"
                f"&kv_events_replay=tcp://{HOST}:{self.kv_replay_port}")


@dataclass
class Cluster:
    """A running (or planned) set of servers under one home."""

    home: Home
    layout: str
    model: str
    servers: dict[str, Server]
    ec_dir: str | None
    #: Started by this process: lifeline attached, stopped when the owner is done with it.
    owned: bool = True
    #: The loopback port every server sends its traces to (None: a cluster recorded before
    #: the servers exported traces).
    traces_port: int | None = None
    #: Servers stopped on purpose (``stop([name])``), for ``restart`` to bring back.
    stopped: set[str] = field(default_factory=set)
    #: Recorded as the home's cluster (``cluster.json``); a ``start_single`` server is not, so
    #: it runs beside the cluster without replacing or stopping it.
    recorded: bool = True
    #: The lifeline pipe (write end kept here, read end inherited by each server).
    _lifeline: int | None = field(default=None, repr=False)
    _lifeline_read: int | None = field(default=None, repr=False)
    _children: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    def url(self, name: str) -> str:
        return self.servers[name].url

    def urls_env(self) -> dict[str, str]:
        """The proxy's ``EPD_*_URLS`` settings for this cluster."""
        return {f"EPD_{role.upper()}_URLS": self.url(role) if role in self.servers else ""
                for role in ("encode", "prefill", "decode")}

    def ec_file(self, item_uuid: str) -> Path:
        """Where the encoder's cache entry for the media item ``item_uuid`` is written."""
        if self.ec_dir is None:
            raise ValueError(f"the {self.layout} layout has no encoder cache")
        return Path(self.ec_dir) / item_uuid / "encoder_cache.safetensors"

    def clear_encoder_cache(self) -> None:
        """Forget every encoder-cache entry (a reused cluster keeps those of earlier sessions)."""
        if self.ec_dir is not None:
            shutil.rmtree(self.ec_dir, ignore_errors=True)
            Path(self.ec_dir).mkdir(parents=True)

    # -- processes ---------------------------------------------------------------------------
    def launch(self, name: str) -> None:
        """Start one server in the background, in its own session (its PID is its group)."""
        server = self.servers[name]
        shutil.rmtree(server.tmpdir, ignore_errors=True)
        env = self.home.server_env(Path(server.tmpdir))
        trace_args: list[str] = []
        if self.traces_port is not None:
            env.update(TRACE_ENV)
            trace_args = ["--otlp-traces-endpoint", f"http://{HOST}:{self.traces_port}{TRACES_PATH}"]
        if server.nixl_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(server.nixl_port)
        env.update(server.env)
        pass_fds: tuple[int, ...] = ()
        if self.owned:
            if self._lifeline_read is None:
                self._lifeline_read, self._lifeline = os.pipe()
            env["EPD_E2E_LIFELINE_FD"] = str(self._lifeline_read)
            pass_fds = (self._lifeline_read,)
        cmd = [str(self.home.python), str(VLLM_CLI), "serve", str(self.home.model(self.model)),
               "--host", HOST, "--port", str(server.port), "--served-model-name", MODEL_NAME,
               "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "bfloat16",
               "--max-num-seqs", "8", "--enforce-eager", "--distributed-executor-backend", "uni",
               "--enable-request-id-headers", *trace_args, *server.args]
        with open(server.log, "wb") as log:
            process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                       env=env, start_new_session=True, pass_fds=pass_fds)
        server.pid, server.ticks = process.pid, start_ticks(process.pid)
        self._children[name] = process

    def wait_ready(self, names: list[str], timeout: float) -> None:
        """Wait until every server in ``names`` answers ``/health`` with 200.

        Raises ``ClusterError`` as soon as one of them exits, or when ``timeout`` expires.
        Polling a real server is the only way to learn it is up (it prints no machine-readable
        readiness line); each look is bounded, and so is the whole wait.
        """
        deadline = time.monotonic() + timeout
        waiting = list(names)
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while waiting:
                for name in list(waiting):
                    server = self.servers[name]
                    if not server.alive():
                        raise ClusterError(f"{name} (pid {server.pid}) exited during start-up")
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(server.url + "/health").status_code == 200:
                            waiting.remove(name)
                if waiting and time.monotonic() > deadline:
                    raise ClusterError(f"not healthy after {timeout:g} s: {', '.join(waiting)}")
                if waiting:
                    time.sleep(0.5)

    def stop(self, names: list[str] | None = None) -> None:
        """Stop servers by PID (all by default), their whole process trees included."""
        for name in names or list(self.servers):
            server = self.servers[name]
            if server.pid is not None:
                killed = stop_tree(server.pid, server.ticks, timeout=STOP_TIMEOUT)
                if killed:
                    print(f"[vllm-e2e] {name}: SIGKILLed {killed} after {STOP_TIMEOUT:g} s",
                          file=sys.stderr)
            process = self._children.pop(name, None)
            if process is not None:
                process.wait()  # reap it
            server.pid = server.ticks = None
            if names is not None:
                self.stopped.add(name)
        if names is None:
            for fd in (self._lifeline, self._lifeline_read):
                if fd is not None:
                    os.close(fd)
            self._lifeline = self._lifeline_read = None
            if self.recorded:
                _state_path(self.home).unlink(missing_ok=True)
        else:
            self.save()

    def restart(self, name: str, timeout: float | None = None) -> None:
        """Start a stopped server again on its old ports (e.g. after a test stopped it)."""
        self.stop([name])
        self.launch(name)
        try:
            self.wait_ready([name], timeout or start_timeout())
        except ClusterError as exc:
            logs = self.log_tails([name])
            self.stop([name])
            raise ClusterError(f"restarting {name}: {exc}\n{logs}") from None
        self.stopped.discard(name)
        self.save()

    def healthy(self) -> list[str]:
        """The names of the servers that are not alive or do not answer ``/health`` with 200."""
        bad = []
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            for name, server in self.servers.items():
                try:
                    ok = server.alive() and client.get(server.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                if not ok:
                    bad.append(name)
        return bad

    def python_processes(self, name: str) -> list[tuple[int, str, bool]]:
        """The processes of server ``name`` that run the vLLM venv's Python (its API server, its
        spawned engine, ...): pid, command line, and whether the harness's ``.pth`` line ran in
        it (``epd_trio_amx_permission`` records each process it ran in, in the server's temp
        dir; it asks for AMX there unless ``EPD_E2E_AMX_PERMISSION=0``)."""
        server = self.servers[name]
        assert server.pid is not None, f"{name} is not running"
        ran = amx.records(Home.amx_records(Path(server.tmpdir)))
        python = os.path.realpath(self.home.python)
        found = []
        for pid in sorted(tree(server.pid)):
            try:
                exe = os.readlink(f"/proc/{pid}/exe")
                command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
            except OSError:
                continue  # gone meanwhile
            if exe == python:
                found.append((pid, command, pid in ran))
        return found

    def deaths(self) -> list[str]:
        """Why each server that died (not one stopped on purpose) is gone: a process of it
        killed by a signal (a SIGILL names the missing AMX permission, issue 30), or its engine
        gone while its API server still runs. Read from the logs, where faulthandler reports
        the signal (``Home.server_env``), and, for our own children, their exit status."""
        found = []
        for name, server in self.servers.items():
            if name in self.stopped:
                continue
            log = Path(server.log)
            child = self._children.get(name)
            returncode = child.poll() if child is not None else None
            if server.alive():
                text = tail(log, 400)
                if amx.fatal_signal(text) is None and amx.ENGINE_EXITED not in text:
                    continue
            found.append(amx.death_message(name, log, returncode))
        return found

    def keep_logs(self, label: str) -> str:
        """Rename the servers' logs to ``NAME.LABEL.log`` (a retry would overwrite them)."""
        for server in self.servers.values():
            path = Path(server.log)
            if path.exists():
                path.rename(path.with_suffix(f".{label}.log"))
        return str(self.home.run / f"*.{label}.log")

    def log_tails(self, names: list[str] | None = None, lines: int = 25) -> str:
        return "\n".join(f"--- {name} ({self.servers[name].log}), last {lines} lines:\n"
                         f"{tail(Path(self.servers[name].log), lines)}"
                         for name in names or list(self.servers))

    # -- state ---------------------------------------------------------------------------------
    def save(self) -> None:
        if not self.recorded:
            return
        state = {"layout": self.layout, "model": self.model, "ec_dir": self.ec_dir,
                 "traces_port": self.traces_port,
                 # A test session's cluster names its owner: another session must neither
                 # share it nor stop it (a cluster from ``cluster start`` has none: shared).
                 "owner_pid": os.getpid() if self.owned else None,
                 "servers": {name: asdict(s) for name, s in self.servers.items()}}
        _state_path(self.home).write_text(json.dumps(state, indent=2))

    def describe(self) -> str:
        ports = ", ".join(f"{n}={s.port}" + (f" (nixl {s.nixl_port})" if s.nixl_port else "")
                          for n, s in self.servers.items())
        lines = [f"# {self.layout} cluster, model tiny-{self.model} (served as {MODEL_NAME!r}), "
                 f"home {self.home.root}", f"# ports: {ports}"]
        if self.traces_port is not None:
            lines.append(f"# traces: OTLP/HTTP to http://{HOST}:{self.traces_port}{TRACES_PATH}")
        if self.ec_dir:
            lines.append(f"# encoder cache: {self.ec_dir}/<item uuid>/")
        lines += [f"{k}={v}" for k, v in self.urls_env().items()]
        return "\n".join(lines)


def start_timeout() -> float:
    return float(os.environ.get("EPD_E2E_START_TIMEOUT") or DEFAULT_START_TIMEOUT)


def _state_path(home: Home) -> Path:
    return home.run / "cluster.json"


@contextlib.contextmanager
def _locked(home: Home) -> Iterator[None]:
    """One start or stop at a time per home (a second one fails at once rather than racing)."""
    home.run.mkdir(parents=True, exist_ok=True)
    with open(home.run / "cluster.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ClusterError(f"another start or stop is in progress in {home.root}") from None
        yield


@contextlib.contextmanager
def _provisioning(home: Home) -> Iterator[None]:
    """Provisioning waits for another process provisioning the same home (blocking lock)."""
    home.root.mkdir(parents=True, exist_ok=True)
    with open(home.root / "provision.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _plan(home: Home, layout: str, model: str, *, owned: bool,
          traces_port: int | None = None) -> Cluster:
    """The servers of ``layout`` on free ports; ``traces_port`` where they send their traces
    (default: a free port too, for a receiver started later)."""
    roles = LAYOUTS[layout]
    # An HTTP port per server, a NIXL port for P and D, and the traces port.
    *ports, free_traces_port = free_ports(len(roles) + 3)
    traces_port = traces_port or free_traces_port
    nixl = dict(zip(("prefill", "decode"), ports[len(roles):], strict=True))
    run = home.run
    ec_dir = str(run / "ec-cache") if layout == "epd" else None
    mm = ["--limit-mm-per-prompt", '{"image": 2}'] if model == "vision" else []

    def connector(kind: str, role: str) -> list[str]:
        if kind == "ec":
            config = {"ec_connector": "ECExampleConnector", "ec_role": f"ec_{role}",
                      "ec_connector_extra_config": {"shared_storage_path": ec_dir}}
            return ["--ec-transfer-config", json.dumps(config)]
        config = {"kv_connector": "NixlConnector", "kv_role": f"kv_{role}", "kv_buffer_device": "cpu",
                  "kv_connector_extra_config": NIXL_EXTRA_CONFIG}
        return ["--kv-transfer-config", json.dumps(config)]

    args = {
        "encode": [*mm, "--mm-encoder-only", "--no-enable-prefix-caching", *connector("ec", "producer")],
        "prefill": [*mm, *(connector("ec", "consumer") if ec_dir else []), *connector("kv", "producer")],
        "decode": [*mm, *connector("kv", "consumer")],
    }
    servers = {
        role: Server(role, port, args[role], log=str(run / f"{role}.log"),
                     tmpdir=str(run / "tmp" / role), nixl_port=nixl.get(role))
        for role, port in zip(roles, ports, strict=False)
    }
    return Cluster(home, layout, model, servers, ec_dir, owned=owned, traces_port=traces_port)


def recorded_cluster(home: Home) -> Cluster | None:
    """The cluster recorded in ``home`` (started elsewhere: not owned here), if any."""
    try:
        state = json.loads(_state_path(home).read_text())
    except (OSError, ValueError):
        return None
    owner = state.get("owner_pid")
    if owner is not None and owner != os.getpid() and _pid_alive(owner):
        raise ClusterError(
            f"another test session (pid {owner}) is using the real-vLLM cluster in {home.root}; "
            "wait for it, or give this one its own EPD_E2E_HOME (and EPD_E2E_VENV to share the venv)")
    servers = {name: Server(**s) for name, s in state["servers"].items()}
    return Cluster(home, state["layout"], state["model"], servers, state["ec_dir"], owned=False,
                   traces_port=state.get("traces_port"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_cluster(layout: str = "epd", model: str = "vision", *, home: Home | None = None,
                  owned: bool = True, log: Log = print, traces_port: int | None = None) -> Cluster:
    """Provision (venv, model), start the servers, wait until healthy; retry once on failure.

    ``traces_port``: where the servers send their traces (a receiver already listening there).

    Raises ``ClusterError`` with the servers' log tails when both attempts fail, after stopping
    everything it started. ``owned`` ties the servers to this process (lifeline).
    """
    if layout == "epd" and model != "vision":
        raise ClusterError("the epd layout needs the vision model")
    home = home or Home.from_env()
    with _provisioning(home):  # two first runs must not pip-install into one venv at once
        ensure_venv(home, log)
        ensure_model(home, model, log)
    with _locked(home):
        recorded = recorded_cluster(home)
        if recorded is not None:
            if all(s.alive() for s in recorded.servers.values()):
                raise ClusterError(f"a cluster is already running in {home.root}: "
                                   "python -m tests.e2e_vllm.cluster stop")
            recorded.stop()  # a server of it died: stop what is left and forget it
        failures = []
        for attempt in range(1, START_ATTEMPTS + 1):
            cluster = _plan(home, layout, model, owned=owned, traces_port=traces_port)
            cluster.clear_encoder_cache()
            started = time.monotonic()
            try:
                for name in cluster.servers:
                    cluster.launch(name)
                cluster.save()
                cluster.wait_ready(list(cluster.servers), start_timeout())
            except (ClusterError, OSError) as exc:
                failures.append(f"attempt {attempt}: {exc}\n{cluster.log_tails()}")
                cluster.stop()
                kept = cluster.keep_logs(f"attempt{attempt}")
                if attempt < START_ATTEMPTS:
                    log(f"cluster start failed ({exc}); logs kept in {kept}; retrying once on "
                        "fresh ports")
                continue
            except BaseException:
                cluster.stop()
                raise
            log(f"{layout} cluster ready in {time.monotonic() - started:.0f} s")
            return cluster
    raise ClusterError("could not start the vLLM cluster:\n" + "\n".join(failures))


def start_single(home: Home | None = None, model: str = "vision", *, name: str = "single",
                 log: Log = print, args: Sequence[str] = ()) -> Cluster:
    """One plain vLLM server (no connector, no traces) on a free port, started and healthy;
    ``args`` go last on its command line, so they override the cluster's defaults.

    It runs beside the home's cluster: not recorded in ``cluster.json`` (``stop()`` leaves the
    cluster's record alone), its log is ``run/NAME.log``, and its lifeline ties it to this
    process. Raises ``ClusterError`` with its log tail when it does not start.
    """
    home = home or Home.from_env()
    with _provisioning(home):
        ensure_venv(home, log)
        ensure_model(home, model, log)
    home.run.mkdir(parents=True, exist_ok=True)
    (port,) = free_ports(1)
    server = Server(name, port, list(args), log=str(home.run / f"{name}.log"),
                    tmpdir=str(home.run / "tmp" / name))
    single = Cluster(home, "single", model, {name: server}, None, owned=True, recorded=False)
    try:
        single.launch(name)
        single.wait_ready([name], start_timeout())
    except ClusterError as exc:
        tails = single.log_tails()
        single.stop()
        raise ClusterError(f"{exc}\n{tails}") from None
    except BaseException:
        single.stop()
        raise
    return single


#: The KV block size of the ``kv`` servers: the CPU attention backend takes only multiples of 32.
KV_BLOCK_SIZE = 32
KV_SERVERS = ("prefill0", "prefill1", "decode")


def kv_events_args(port: int, replay_port: int) -> list[str]:
    """What a server needs to publish its KV cache events (and replay them) and to render."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv"}
    return ["--kv-events-config", json.dumps(config), "--enable-scale-out",
            "--block-size", str(KV_BLOCK_SIZE), "--enable-prompt-tokens-details"]


def start_kv_cluster(home: Home | None = None, *, log: Log = print) -> Cluster:
    """Two prefills (NIXL producers) and a decode (NIXL consumer) of the text model, each
    publishing its KV cache events (``kv_events_args``) on free ports: for precise_cache_aware.

    Like ``start_single`` it runs beside the home's cluster: not recorded (``cluster.json`` is
    left alone), logs ``run/kv-NAME.log``, tied to this process by its lifeline; a failed start
    is retried once on fresh ports. Raises ``ClusterError`` with the log tails.
    """

    def plan(home: Home, ports: Iterator[int]) -> dict[str, Server]:
        servers = {}
        for name in KV_SERVERS:
            port, nixl_port, events, replay = (next(ports) for _ in range(4))
            role = "consumer" if name == "decode" else "producer"
            args = [*_nixl(role), *kv_events_args(events, replay)]
            servers[name] = Server(name, port, args, log=str(home.run / f"kv-{name}.log"),
                                   tmpdir=str(home.run / "tmp" / f"kv-{name}"),
                                   nixl_port=nixl_port, kv_events_port=events,
                                   kv_replay_port=replay)
        return servers

    return _start_beside(home or Home.from_env(), "kv", 4 * len(KV_SERVERS), plan, log)


def _nixl(role: str) -> list[str]:
    """A NIXL KV connector of ``role`` (``producer``: a prefill; ``consumer``: a decode)."""
    config = {"kv_connector": "NixlConnector", "kv_role": f"kv_{role}",
              "kv_buffer_device": "cpu", "kv_connector_extra_config": NIXL_EXTRA_CONFIG}
    return ["--kv-transfer-config", json.dumps(config)]


#: The LoRA servers: a prefill and a decode holding adapter ``sql`` (P -> D over NIXL, and
#: runtime loading on), and the text model as a pooling (embedding) instance.
LORA_SERVERS = ("lora-prefill", "lora-decode", "pooler")
#: The name the pooling instance serves.
POOLER_MODEL = "tiny-embed"


def start_lora_cluster(adapter: Path, home: Home | None = None, *, log: Log = print) -> Cluster:
    """A prefill (NIXL producer) and a decode (NIXL consumer) of the text model with LoRA on,
    both holding ``adapter`` as ``sql`` and loading more at run time
    (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), and a pooling instance of the text model
    serving ``POOLER_MODEL`` (``--runner pooling --convert embed``). Beside the home's
    cluster, like ``start_kv_cluster``."""
    lora = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules",
            json.dumps({"name": "sql", "path": str(adapter), "base_model_name": MODEL_NAME})]
    runtime = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}

    def plan(home: Home, ports: Iterator[int]) -> dict[str, Server]:
        servers = {}
        for name in LORA_SERVERS:
            port, nixl_port = next(ports), next(ports)
            if name == "pooler":
                args = ["--runner", "pooling", "--convert", "embed", "--served-model-name",
                        POOLER_MODEL]
                servers[name] = Server(name, port, args, log=str(home.run / f"{name}.log"),
                                       tmpdir=str(home.run / "tmp" / name))
                continue
            role = "consumer" if name == "lora-decode" else "producer"
            servers[name] = Server(name, port, [*_nixl(role), *lora],
                                   log=str(home.run / f"{name}.log"),
                                   tmpdir=str(home.run / "tmp" / name), nixl_port=nixl_port,
                                   env=dict(runtime))
        return servers

    return _start_beside(home or Home.from_env(), "lora", 2 * len(LORA_SERVERS), plan, log)


def _start_beside(home: Home, label: str, ports_needed: int,
                  plan: Callable[[Home, Iterator[int]], dict[str, Server]], log: Log) -> Cluster:
    """Servers of the text model beside the home's cluster (``plan`` makes them on the free
    ports it is given), started and healthy: not recorded, tied to this process by its
    lifeline, a failed start retried once on fresh ports. ``ClusterError`` with the log
    tails."""
    with _provisioning(home):
        ensure_venv(home, log)
        ensure_model(home, "text", log)
    home.run.mkdir(parents=True, exist_ok=True)
    failures = []
    for attempt in range(1, START_ATTEMPTS + 1):
        servers = plan(home, iter(free_ports(ports_needed)))  # all distinct
        started_servers = Cluster(home, label, "text", servers, None, owned=True,
                                  recorded=False)
        started = time.monotonic()
        try:
            for name in servers:
                started_servers.launch(name)
            started_servers.wait_ready(list(servers), start_timeout())
        except (ClusterError, OSError) as exc:
            failures.append(f"attempt {attempt}: {exc}\n{started_servers.log_tails()}")
            started_servers.stop()
            kept = started_servers.keep_logs(f"attempt{attempt}")
            if attempt < START_ATTEMPTS:
                log(f"{label} cluster start failed ({exc}); logs kept in {kept}; retrying once")
            continue
        except BaseException:
            started_servers.stop()
            raise
        log(f"{label} cluster ({', '.join(servers)}) ready in "
            f"{time.monotonic() - started:.0f} s")
        return started_servers
    raise ClusterError(f"could not start the {label} cluster:\n" + "\n".join(failures))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e_vllm.cluster",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="provision if needed and start a cluster")
    start.add_argument("--layout", choices=sorted(LAYOUTS), default="epd")
    start.add_argument("--model", choices=("vision", "text"), default="vision")
    commands.add_parser("status", help="print the running cluster's URLs; exit 0 when healthy")
    commands.add_parser("stop", help="stop the running cluster")
    args = parser.parse_args(argv)
    home = Home.from_env()

    def say(message: str) -> None:
        print(f"[vllm-e2e] {message}", file=sys.stderr)

    try:
        if args.command == "start":
            cluster = start_cluster(args.layout, args.model, home=home, owned=False, log=say)
            print(cluster.describe())
            return 0
        cluster = recorded_cluster(home)
        if cluster is None:
            say(f"no cluster running in {home.root}")
            return 0 if args.command == "stop" else 3
        if args.command == "stop":
            with _locked(home):
                cluster.stop()
            say("stopped")
            return 0
        print(cluster.describe())
        bad = cluster.healthy()
    except (ClusterError, RuntimeError) as exc:
        say(str(exc))
        return 1
    if bad:
        say(f"unhealthy: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
