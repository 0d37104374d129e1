"""Ports for restartable test servers come from outside the kernel's ephemeral range."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from epd_trio.testing import ports


def test_the_range_read_is_the_kernels_and_a_missing_file_gives_linuxs_default(
        tmp_path: Path) -> None:
    written = tmp_path / "range"
    written.write_text("40000\t50000\n")
    assert ports.ephemeral_range(written) == (40000, 50000)
    assert ports.ephemeral_range(tmp_path / "absent") == (32768, 60999)
    written.write_text("garbage\n")
    assert ports.ephemeral_range(written) == (32768, 60999)


def test_candidates_are_the_larger_side_of_the_ephemeral_range_or_none() -> None:
    assert ports.candidates((32768, 60999)) == range(ports.LOWEST, 32768)
    assert ports.candidates((21000, 40000)) == range(40001, 65536)
    assert ports.candidates((ports.LOWEST + 10, 65000)) is None


def test_picked_ports_are_distinct_free_and_outside_the_ephemeral_range() -> None:
    low, high = ports.ephemeral_range()
    picked = ports.free_ports(20, rng=random.Random(7))
    assert len(set(picked)) == 20
    pool = ports.candidates((low, high))
    assert pool is not None, "this machine's ephemeral range leaves no room: the test says so"
    assert all(port in pool for port in picked)
    for port in picked:  # free now: a server can listen on each
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_never_picked() -> None:
    first = ports.free_ports(1, rng=random.Random(11))[0]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first))
        taken.listen()
        again = ports.free_ports(3, rng=random.Random(11))  # the same draws start with `first`
    assert first not in again and len(again) == 3


def test_a_udp_port_is_free_for_udp_and_tcp_alike() -> None:
    port = ports.free_port(udp=True)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, socket.socket() as tcp:
        udp.bind(("127.0.0.1", port))
        tcp.bind(("127.0.0.1", port))


def test_a_machine_with_no_free_candidate_gets_a_clear_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_bound", lambda port, host, udp: [])
    monkeypatch.setattr(ports, "TRIES", 50)
    with pytest.raises(OSError, match="no 1 free ports found in 50 tries"):
        ports.free_ports(1)
