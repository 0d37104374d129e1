"""A real ``redis-server`` on a loopback port, for tests and benchmarks (Debian's package).

Why here and not in the tests: ``bench.policies --replicas`` and ``bench.replicas`` need one
too. No persistence, so a restart comes back empty, as a Redis without persistence does.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from typing import Any


def free_port() -> int:
    """A loopback TCP port nobody listens on now (for servers that cannot take port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A real ``redis-server`` on a loopback port, with no persistence, started by a test.

    ``start`` returns once the server logs that it accepts connections (no polling), ``kill``
    stops it at once (SIGKILL: what a crash looks like), and ``start`` again brings it back
    empty on the same port, as a restarted Redis without persistence comes back.
    """

    def __init__(self, port: int | None = None, *, binary: str | None = None) -> None:
        found = binary or shutil.which("redis-server")
        if found is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.binary = found
        self.port = port or free_port()
        self.process: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        assert self.process is None
        process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--logfile", "",
             "--loglevel", "notice"],
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

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            if self.process.stdout is not None:
                self.process.stdout.close()
            self.process = None

    def command(self, *args: str) -> str:
        """One command through ``redis-cli`` (it comes with the server's package)."""
        cli = shutil.which("redis-cli")
        assert cli is not None, "redis-cli comes with redis-server"
        result = subprocess.run([cli, "-p", str(self.port), *args], capture_output=True,
                                text=True, check=True, timeout=10)
        return result.stdout.strip()


def _drain(stream: Any) -> None:
    for _ in stream:
        pass
