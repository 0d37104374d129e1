"""The production entry point: ``hypercorn --worker-class trio epd_trio.app:app`` in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from epd_trio.testing import FakeVLLM
from epd_trio.testing.process import read_url, stop_process

from helpers import chat_body, image, start_fakes

HYPERCORN = [sys.executable, "-m", "hypercorn", "--worker-class", "trio", "epd_trio.app:app"]


def _env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    return {**env, **settings}


# Hypercorn's multi-process runner (the default, one worker process) reports exit code 0 when
# its worker exits early (hypercorn/run.py joins the workers twice and keeps the second, empty
# result); with ``--workers 0`` the app runs in the main process and the exit code is ours.
@pytest.mark.parametrize("workers, exit_code", [([], None), (["--workers", "0"], 2)])
async def test_missing_setting_fails_with_one_line(
    workers: list[str], exit_code: int | None
) -> None:
    with trio.fail_after(60):
        result = await trio.run_process(
            [*HYPERCORN, "--bind", "127.0.0.1:0", *workers], env=_env(EPD_ENCODER_MAX_BATCH="2"),
            capture_stdout=True, capture_stderr=True, check=False,
        )
    assert result.stderr.decode().strip().splitlines() == [
        "epd_trio: configuration error: EPD_DECODE_URLS: is required (at least one decode URL), "
        "unless instances register themselves (EPD_ADMIN_KEY, EPD_KV_CONNECTOR=moriio, or a shared "
        "roster in EPD_STATE_URL), are discovered (EPD_DECODE_SELECTOR) or named in a model "
        "table (EPD_MODELS)"
    ]
    if exit_code is not None:
        assert result.returncode == exit_code


async def test_malformed_setting_names_the_variable() -> None:
    with trio.fail_after(60):
        result = await trio.run_process(
            [*HYPERCORN, "--bind", "127.0.0.1:0", "--workers", "0"],
            env=_env(EPD_DECODE_URLS="http://127.0.0.1:9", EPD_PREFILL_TIMEOUT="soon"),
            capture_stdout=True, capture_stderr=True, check=False,
        )
    assert result.returncode == 2
    (line,) = result.stderr.decode().strip().splitlines()
    assert line.startswith("epd_trio: configuration error: EPD_PREFILL_TIMEOUT:")


async def test_unusable_state_store_tls_files_fail_with_one_line(tmp_path: Path) -> None:
    """A ``rediss://`` URL's CA that cannot be read: refused as the app is made (its state
    link builds the TLS context), with one line naming the setting, before the server binds."""
    missing = tmp_path / "missing.pem"
    with trio.fail_after(60):
        result = await trio.run_process(
            [*HYPERCORN, "--bind", "127.0.0.1:0", "--workers", "0"],
            env=_env(EPD_STATE_URL=f"rediss://:hunter2@r:6380/0?ssl_ca_certs={missing}"),
            capture_stdout=True, capture_stderr=True, check=False,
        )
    assert result.returncode == 2
    assert result.stderr.decode().strip().splitlines() == [
        f"epd_trio: configuration error: EPD_STATE_URL: ssl_ca_certs: cannot use {missing}: "
        "No such file or directory"]


async def test_serves_an_epd_request_under_hypercorn(nursery: trio.Nursery) -> None:
    encoder, prefill, decode = FakeVLLM("encode"), FakeVLLM("prefill"), FakeVLLM("decode", 2)
    await start_fakes(nursery, encoder, prefill, decode)
    process = await trio.lowlevel.open_process(
        [*HYPERCORN, "--bind", "127.0.0.1:0"],
        env=_env(EPD_ENCODE_URLS=encoder.url, EPD_PREFILL_URLS=prefill.url,
                 EPD_DECODE_URLS=f"{decode.url}#dp=2"),
        stderr=subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        url = await read_url(process.stderr, rb"Running on (http://\S+)")
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            for _ in range(2):
                r = await client.post(url + "/v1/chat/completions", json=chat_body(image(1)))
                assert r.status_code == 200, r.text
        assert len(encoder.requests()) == 2 and len(prefill.requests()) == 2
        assert sorted(x.rank for x in decode.requests()) == [0, 1]
    finally:
        await stop_process(process)
