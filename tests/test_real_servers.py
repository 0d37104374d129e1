"""The missing-server rule: skip locally, fail in CI (tests/real_servers.py)."""

from __future__ import annotations

import pytest

from real_servers import require_binary


def test_a_present_binary_is_found() -> None:
    assert require_binary("sh").endswith("/sh")


def test_a_missing_binary_skips_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no-such-server-x is not installed"):
        require_binary("no-such-server-x")


def test_a_missing_binary_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="apt-get install"):
        require_binary("no-such-server-x")
