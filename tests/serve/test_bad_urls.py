"""Issue 31: a bad URL at start is one line naming the setting and exit 2, from the real
``epd-trio serve`` (the bulk of the values: tests/core/test_urls.py, in-process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SERVE = [sys.executable, "-m", "epd_trio", "serve", "--port", "0"]


@pytest.mark.parametrize("env, args, named", [
    # Once started, said "listening" and left every worker without a prober.
    ({"EPD_DECODE_URLS": "http://127.0.0.1:abc"}, [], "EPD_DECODE_URLS"),
    ({"EPD_DECODE_URLS": "http://127.0.0.1:1", "EPD_STATE_URL": "redis://u:secret@r:0"},
     [], "EPD_STATE_URL"),
    ({}, ["--decode", "http://127.0.0.1:1", "http://user:secret@127.0.0.1:99999"], "--decode"),
])
def test_a_bad_url_at_start_is_one_line_and_exit_2(env: dict[str, str], args: list[str],
                                                   named: str) -> None:
    result = subprocess.run([*SERVE, *args], env={**os.environ, **env}, capture_output=True,
                            text=True, timeout=20)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"epd-trio: configuration error: {named}"), result.stderr
    assert "secret" not in result.stderr and "Traceback" not in result.stderr
