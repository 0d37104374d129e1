"""A real DNS server for the discovery tests: Debian's dnsmasq on a loopback port.

It serves A records from a hosts file the test rewrites (``set_hosts`` sends SIGHUP and waits
for dnsmasq's own "read FILE" log line, so the new records are served when it returns), SRV
records from its command line, and NXDOMAIN for every other name of ``zone`` (``--local``).
``pause``/``resume`` (SIGSTOP/SIGCONT) make it a resolver that stops answering.
"""

from __future__ import annotations

import getpass
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from real_servers import require_binary


def free_port() -> int:
    """A loopback port free for UDP and TCP now (dnsmasq listens on both)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = udp.getsockname()[1]
            with socket.socket() as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port


class Dnsmasq:
    def __init__(self, process: trio.Process, hosts: Path, port: int) -> None:
        self.process = process
        self.hosts = hosts
        self.port = port
        self.lines: list[str] = []
        self.ended = False
        self._line = trio.Event()

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _read(self) -> None:
        assert self.process.stderr is not None
        buffer = b""
        async for chunk in self.process.stderr:
            buffer += chunk
            *done, buffer = buffer.split(b"\n")
            self.lines += [line.decode(errors="replace") for line in done]
            self._line.set()
            self._line = trio.Event()
        self.ended = True  # dnsmasq exited (its stderr closed)
        self._line.set()

    async def wait_line(self, text: str, after: int = 0) -> None:
        """Wait for a log line containing ``text`` among the lines from index ``after`` on."""
        while not any(text in line for line in self.lines[after:]):
            if self.ended:
                raise AssertionError(f"dnsmasq exited: {self.lines[-5:]}")
            await self._line.wait()

    async def set_hosts(self, entries: Sequence[tuple[str, str]]) -> None:
        """Serve exactly these ``(address, name)`` A/AAAA records from now on."""
        mark = len(self.lines)
        self.hosts.write_text("".join(f"{address} {name}\n" for address, name in entries))
        self.process.send_signal(signal.SIGHUP)
        await self.wait_line(f"read {self.hosts}", mark)

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)


@asynccontextmanager
async def dnsmasq(
    tmp_path: Path, hosts: Sequence[tuple[str, str]], *, zone: str = "test",
    srv: Sequence[str] = (),
) -> AsyncIterator[Dnsmasq]:
    """Run dnsmasq for the block. ``srv``: ``--srv-host`` values (``_x._tcp.name,target,port``)."""
    binary = require_binary("dnsmasq")
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("".join(f"{address} {name}\n" for address, name in hosts))
    for attempt in range(3):  # the free port may be taken before dnsmasq binds it
        port = free_port()
        command = [binary, "--keep-in-foreground", "--conf-file=/dev/null", f"--port={port}",
                   "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv",
                   "--no-hosts", f"--addn-hosts={hosts_file}", f"--local=/{zone}/",
                   "--cache-size=0", "--log-facility=-", f"--user={getpass.getuser()}",
                   "--pid-file=", *(f"--srv-host={record}" for record in srv)]
        process = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE)
        server = Dnsmasq(process, hosts_file, port)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server._read)
                try:
                    await server.wait_line(f"read {hosts_file}")
                except AssertionError:
                    if attempt == 2 or not any("in use" in line for line in server.lines):
                        raise
                    nursery.cancel_scope.cancel()
                    continue
                try:
                    yield server
                finally:
                    nursery.cancel_scope.cancel()
                return
        finally:
            server.resume()
            if process.returncode is None:
                process.terminate()
            with trio.CancelScope(shield=True):
                await process.wait()
