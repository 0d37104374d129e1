"""The missing-server rule: skip locally, fail in CI (tests/real_servers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from real_servers import one_process_suite, require_binary, require_one_process, tls_redis_server


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


@pytest.mark.parametrize(("ci", "outcome"), [("", pytest.skip.Exception),
                                             ("true", pytest.fail.Exception)])
def test_a_redis_server_without_tls_skips_locally_and_fails_in_ci(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ci: str, outcome: type[BaseException],
) -> None:
    """A build without TLS refuses ``--tls-port`` as redis-server 7 does (its own words)."""
    built_without = tmp_path / "redis-server"
    built_without.write_text("#!/bin/sh\necho '*** FATAL CONFIG FILE ERROR (Redis 7.0.15) ***'\n"
                             "echo \">>> 'tls-port \\\"1234\\\"'\"\n"
                             "echo 'Bad directive or wrong number of arguments'\nexit 1\n")
    built_without.chmod(0o755)
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="built without TLS"):
        tls_redis_server(tmp_path, binary=str(built_without))


@pytest.mark.parametrize(("markexpr", "suite"), [
    ("not vllm_e2e and not container", None),  # the main suite's own
    ("", None), ("vllm_e2e", "vllm_e2e"), ("container", "container"),
    ("vllm_e2e and not slow", "vllm_e2e"), ("not container and vllm_e2e", "vllm_e2e"),
])
def test_the_one_process_suites_are_told_from_the_mark_expression(
    markexpr: str, suite: str | None
) -> None:
    assert one_process_suite(markexpr) == suite


def test_a_one_process_suite_fails_in_an_xdist_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    with pytest.raises(pytest.fail.Exception, match="image's suite runs in one process, not "
                       "in xdist worker gw1"):
        require_one_process("image's suite")
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    require_one_process("image's suite")
