"""The per-process tasks' one policy (issue 31): a task that dies after it started is logged
at CRITICAL, named on ``/health`` and ``/ready``, and stops the worker; a start-up failure
stays one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from epd_trio._state.tasks import Supervisor, TaskDied, named
from epd_trio.testing import run_cluster


async def _dies_after_start(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    await trio.lowlevel.checkpoint()
    raise KeyError("a bug")


async def test_a_task_that_dies_is_named_logged_and_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reported: list[str] = []
    supervisor = Supervisor(reported.append)

    async def start(nursery: trio.Nursery) -> None:
        await nursery.start(named("prober", _dies_after_start))
        nursery.start_soon(trio.sleep_forever)  # a sibling: cancelled, not reported

    async with trio.open_nursery() as outer:
        await outer.start(supervisor.run, start)
    assert supervisor.failure == "the prober task died: KeyError: 'a bug'"
    assert reported == [supervisor.failure]
    record = next(r for r in caplog.records if r.levelname == "CRITICAL")
    assert "the prober task died" in record.getMessage() and record.exc_info is not None


async def test_a_start_up_failure_stays_a_start_up_failure() -> None:
    async def fails_before_started(*, task_status: Any) -> None:
        raise OSError("address in use")

    async def start(nursery: trio.Nursery) -> None:
        await nursery.start(named("MoRIIO listener", fails_before_started))

    supervisor = Supervisor()
    async with trio.open_nursery() as outer:
        with pytest.raises(OSError, match="address in use"):  # itself, not in a group
            await outer.start(supervisor.run, start)
    assert supervisor.failure is None


async def test_named_wraps_only_what_escapes_after_the_start() -> None:
    with pytest.raises(TaskDied, match="the housekeeping task died: KeyError"):
        await named("housekeeping", _dies_after_start)()


async def test_health_and_ready_never_say_ok_over_a_dead_task(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 31: the prober died in every worker and ``/health`` said ``"status": "ok"``."""
    died = trio.Event()

    async def prober(*args: Any, **kwargs: Any) -> None:
        await trio.lowlevel.checkpoint()
        died.set()
        raise ValueError("Port could not be cast to integer value as 'abc'")

    monkeypatch.setattr("epd_trio._proxy.run_prober", prober)
    async with run_cluster(decodes=1) as c:
        with trio.fail_after(10):
            await died.wait()
        health = (await client.get(c.proxy_url + "/health")).json()
        assert health["status"] == "failed" and health["ready"] is False
        assert health["failure"] == ("the prober task died: ValueError: Port could not be cast "
                                     "to integer value as 'abc'")
        ready = await client.get(c.proxy_url + "/ready")
        assert ready.status_code == 503 and "the prober task died" in ready.text


#: Loaded by every Python process of the test (a spawned worker too, which re-imports all).
DIES = """
import trio
import epd_trio._proxy as proxy
async def prober(*args, **kwargs):
    await trio.sleep(0.2)
    raise ValueError("the prober's bug")
proxy.run_prober = prober
"""


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_stops_loudly_when_a_task_dies(workers: str, tmp_path: Path) -> None:
    """The real ``epd-trio serve`` (one worker in the parent, or two spawned): the worker
    stops, the CRITICAL line names the task, and the exit status is not 0, so the process's own
    supervisor restarts it."""
    (tmp_path / "sitecustomize.py").write_text(DIES)
    env = {**os.environ, "EPD_DECODE_URLS": "http://127.0.0.1:9",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "epd_trio", "serve", "--port", "0",
                             "--workers", workers], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1, result.stderr
    assert "the prober task died: ValueError: the prober's bug" in result.stderr


@pytest.mark.parametrize("spelling", [
    "http://127.0.0.1:{port}/", "http://localhost:{port}", "http://127.0.0.1:{port}#dp=1024",
    " http://127.0.0.1:{port} ,", "dns+http://localhost:{port}",
])
async def test_no_accepted_spelling_starts_a_proxy_with_a_dead_task(
    nursery: trio.Nursery, spelling: str,
) -> None:
    """Issue 31's fuzz, from the other side: what the settings accept (odd but valid
    spellings) starts a proxy whose every task runs: probes arrive, ``/health`` is ok."""
    from epd_trio._core.config import settings_from
    from epd_trio.testing import FakeVLLM, serve_proxy

    fake = FakeVLLM("decode")
    url = await nursery.start(fake.serve)
    port = int(url.rsplit(":", 1)[1])
    settings = settings_from({"EPD_DECODE_URLS": spelling.format(port=port),
                              "EPD_HEALTH_INTERVAL": "0.05", "EPD_LOAD_SCRAPE_INTERVAL": "0.05"})
    async with serve_proxy(settings) as (_url, proxy):
        with trio.fail_after(10):
            await fake.wait_until(lambda: len(fake.requests("/health")) >= 2
                                  and len(fake.requests("/metrics")) >= 2)
        health = proxy.health()
        # "degraded" where /etc/hosts also names localhost ::1, which the fake does not serve.
        assert health["status"] in ("ok", "degraded") and proxy.tasks.failure is None, health
