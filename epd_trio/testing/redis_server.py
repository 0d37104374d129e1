"""A real ``redis-server`` on a loopback port, for tests and benchmarks (Debian's package).

Why here and not in the tests: ``bench.policies --replicas`` and ``bench.replicas`` need one
too. No persistence, so a restart comes back empty, as a Redis without persistence does.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

from .ports import free_port


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files of a TLS server: its certificate, its key, and the CA that signed it."""

    cert: str
    key: str
    ca: str


class RedisServer:
    """A real ``redis-server`` on a loopback port, with no persistence, started by a test.

    ``start`` returns once the server logs that it accepts connections (no polling), ``kill``
    stops it at once (SIGKILL: what a crash looks like), and ``start`` again brings it back
    empty on the same port, as a restarted Redis without persistence comes back. ``pause``
    and ``resume`` freeze and thaw it (SIGSTOP, SIGCONT): unreachable, its data kept.
    """

    def __init__(self, port: int | None = None, *, binary: str | None = None,
                 password: str | None = None, unix_socket: str | None = None,
                 tls: TLSFiles | None = None) -> None:
        """``password``: clients must authenticate (``--requirepass``); ``unix_socket``: it
        also listens on that socket path (``unix_url``); ``tls``: it speaks TLS only, on
        ``port`` (``url`` is then ``rediss://``, trusting ``tls.ca``)."""
        self.password = password
        self.unix_socket = unix_socket
        self.tls = tls
        found = binary or shutil.which("redis-server")
        if found is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.binary = found
        self.port = port or free_port()
        self.process: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls is not None:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.ca}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        assert self.unix_socket is not None
        auth = f":{self.password}@" if self.password else ""
        return f"unix://{auth}{self.unix_socket}"

    def start(self, timeout: float = 10.0) -> RedisServer:
        assert self.process is None
        ports = ["--port", str(self.port)]
        if self.tls is not None:
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file",
                     self.tls.cert, "--tls-key-file", self.tls.key, "--tls-ca-cert-file",
                     self.tls.ca, "--tls-auth-clients", "no"]
        process = subprocess.Popen(
            [self.binary, *ports, "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--logfile", "",
             "--loglevel", "notice",
             *(["--requirepass", self.password] if self.password else []),
             *(["--unixsocket", self.unix_socket] if self.unix_socket else [])],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.process = process
        deadline = time.monotonic() + timeout
        assert process.stdout is not None
        seen = []
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            seen.append(line)
            if "Ready to accept connections" in line:
                # Keep draining its log so that the server never blocks on a full pipe.
                threading.Thread(target=_drain, args=(process.stdout,), daemon=True).start()
                return self
        self.kill()
        raise RuntimeError(f"redis-server did not start on port {self.port}: {''.join(seen)}")

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.kill()

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            if self.process.stdout is not None:
                self.process.stdout.close()
            self.process = None

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open and every command waits, as
        with a server that hangs or a network that drops packets. ``resume`` thaws it with
        its data."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def command(self, *args: str) -> str:
        """One command through ``redis-cli`` (it comes with the server's package)."""
        cli = shutil.which("redis-cli")
        assert cli is not None, "redis-cli comes with redis-server"
        auth = ["--no-auth-warning", "-a", self.password] if self.password else []
        if self.tls is not None:
            auth += ["--tls", "--cacert", self.tls.ca]
        result = subprocess.run([cli, "-p", str(self.port), *auth, *args], capture_output=True,
                                text=True, check=True, timeout=10)
        return result.stdout.strip()


def _drain(stream: Any) -> None:
    for _ in stream:
        pass
