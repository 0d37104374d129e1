"""A real DNS server for the discovery tests: Debian's dnsmasq on a loopback port.

It serves A records from a hosts file the test rewrites (``set_hosts`` sends SIGHUP and waits
for dnsmasq's own "read FILE" log line, so the new records are served when it returns), SRV and
TXT records from its command line, and NXDOMAIN for every other name of ``zone`` (``--local``).
A name with only a TXT record exists but has no A or AAAA record: an empty answer that is not
NXDOMAIN (dnspython's ``NoAnswer``). ``pause``/``resume`` (SIGSTOP/SIGCONT) make it a resolver
that stops answering.

SRV records cannot change under a running dnsmasq (its man page: "SIGHUP does NOT re-read the
configuration file", and ``--srv-host`` is configuration), so ``set_srv`` restarts it on the
same port with the new records; queries asked meanwhile fail, as against a resolver restarting.
"""

from __future__ import annotations

import getpass
import signal
import subprocess
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from epd_trio.testing.ports import free_port

from real_servers import require_binary


class Dnsmasq:
    """One dnsmasq at a time on ``port``, its stderr read in ``nursery``."""

    def __init__(self, nursery: trio.Nursery, binary: str, hosts: Path, zone: str,
                 srv: Sequence[str], txt: Sequence[str]) -> None:
        self._nursery = nursery
        self._binary = binary
        self.hosts = hosts
        self.zone = zone
        self.srv = list(srv)
        self.txt = list(txt)
        self.port = 0
        self.process: trio.Process | None = None
        self.lines: list[str] = []
        self.ended = False
        self._line = trio.Event()

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        return [self._binary, "--keep-in-foreground", "--conf-file=/dev/null",
                f"--port={self.port}", "--listen-address=127.0.0.1", "--bind-interfaces",
                "--no-resolv", "--no-hosts", f"--addn-hosts={self.hosts}",
                f"--local=/{self.zone}/", "--cache-size=0", "--log-facility=-",
                f"--user={getpass.getuser()}", "--pid-file=",
                *(f"--srv-host={record}" for record in self.srv),
                *(f"--txt-record={name},present" for name in self.txt)]

    async def start(self) -> None:
        """Start dnsmasq on ``port`` and wait until it has read the hosts file."""
        process = await trio.lowlevel.open_process(self._command(), stderr=subprocess.PIPE)
        # From here on only this process's reader records lines (the last one's may still be
        # reading its end of file).
        self.process, self.lines, self.ended = process, [], False
        self._nursery.start_soon(self._read, process)
        await self.wait_line(f"read {self.hosts}")

    async def stop(self) -> None:
        process = self.process
        if process is None:
            return
        process.send_signal(signal.SIGCONT)
        if process.returncode is None:
            process.terminate()
        with trio.CancelScope(shield=True):
            await process.wait()
        self.process = None

    async def _read(self, process: trio.Process) -> None:
        assert process.stderr is not None
        buffer = b""
        async for chunk in process.stderr:
            buffer += chunk
            *done, buffer = buffer.split(b"\n")
            if process is self.process:
                self.lines += [line.decode(errors="replace") for line in done]
                self._signal()
        if process is self.process:
            self.ended = True  # dnsmasq exited (its stderr closed)
            self._signal()

    def _signal(self) -> None:
        self._line.set()
        self._line = trio.Event()

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
        assert self.process is not None
        self.process.send_signal(signal.SIGHUP)
        await self.wait_line(f"read {self.hosts}", mark)

    async def set_srv(self, records: Sequence[str]) -> None:
        """Serve exactly these SRV records from now on: dnsmasq restarted on the same port."""
        await self.stop()
        self.srv = list(records)
        await self.start()

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


@asynccontextmanager
async def dnsmasq(
    tmp_path: Path, hosts: Sequence[tuple[str, str]], *, zone: str = "test",
    srv: Sequence[str] = (), txt: Sequence[str] = (),
) -> AsyncIterator[Dnsmasq]:
    """Run dnsmasq for the block. ``srv``: ``--srv-host`` values (``_x._tcp.name,target,port``);
    ``txt``: names given a TXT record (they exist, with or without an address)."""
    binary = require_binary("dnsmasq")
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("".join(f"{address} {name}\n" for address, name in hosts))
    async with trio.open_nursery() as nursery:
        server = Dnsmasq(nursery, binary, hosts_file, zone, srv, txt)
        try:
            for attempt in range(3):  # the free port may be taken before dnsmasq binds it
                server.port = free_port(udp=True)  # dnsmasq listens on both
                try:
                    await server.start()
                    break
                except AssertionError:
                    if attempt == 2 or not any("in use" in line for line in server.lines):
                        raise
            yield server
        finally:
            await server.stop()
            nursery.cancel_scope.cancel()
