"""Fixtures shared by the integration tests (real sockets on 127.0.0.1), and how the suites are
spread over processes (pytest-xdist)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from real_servers import RedisServer, one_process_suite


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=30.0, limits=limits, trust_env=False) as c:
        yield c


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the session (each test uses its own key prefix)."""
    with RedisServer() as server:
        yield server


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` (the main suite's default, pyproject.toml): no worker for a one-process
    suite, so that ``python -m pytest -m vllm_e2e`` starts one cluster, in its order; the
    machine's cores otherwise (xdist's own count, capped by ``--maxprocesses``)."""
    return 0 if one_process_suite(config.option.markexpr or "") else None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The figures tests recorded (``record_property("observed", ...)``), at the end of the
    run: printed by a test they would be lost in an xdist worker's capture."""
    lines = [f"{report.nodeid}: {value}" for report in terminalreporter.getreports("passed")
             if report.when == "call"
             for name, value in report.user_properties if name == "observed"]
    if lines:
        terminalreporter.section("observed")
        for line in lines:
            terminalreporter.line(line)
