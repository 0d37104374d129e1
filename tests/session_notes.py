"""What a suite of real components observed, and its progress said live: shared by the suites
whose sessions are slow and whose figures matter (the image's, ``tests/container``; real vLLM,
``tests/e2e_vllm``).

Why: a build that takes a minute, or a vLLM start-up, looks like a hang under pytest's capture
unless it says what it is doing; and the sizes and timings a run measured (the image's size,
a drain's timings, vLLM's answers) belong in its report, not only in a passing assert. Each
suite's conftest makes one ``SessionNotes`` and hands it its fixtures and hook:

    NOTES = SessionNotes("observed on the image", "container")

    @pytest.fixture
    def observe(request): return NOTES.recorder(request)

    def pytest_terminal_summary(terminalreporter): NOTES.summary(terminalreporter)
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest


class SessionNotes:
    """Lines a session's tests recorded (printed in one section at the end), and live
    progress lines tagged with the suite's name."""

    def __init__(self, section: str, tag: str) -> None:
        #: The summary section's title, and the tag of live lines (``[tag] message``).
        self.section, self.tag = section, tag
        self._key = pytest.StashKey[list[str]]()

    def lines(self, config: pytest.Config) -> list[str]:
        """What was recorded so far in this session (the list itself: append to add)."""
        return config.stash.setdefault(self._key, [])

    def say(self, config: pytest.Config) -> Callable[[str], None]:
        """A progress line shown at once, past pytest's capture (to stderr)."""
        capture = config.pluginmanager.getplugin("capturemanager")

        def say(message: str) -> None:
            with capture.global_and_fixture_disabled():
                print(f"\n[{self.tag}] {message}", file=sys.stderr, flush=True)

        return say

    def recorder(self, request: pytest.FixtureRequest) -> Callable[[str], None]:
        """A test's ``observe``: each line recorded under the test's name."""
        lines = self.lines(request.config)

        def record(line: str) -> None:
            lines.append(f"{request.node.name}: {line}")

        return record

    def summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        """The ``pytest_terminal_summary`` hook's body: the section, if anything was recorded."""
        lines = self.lines(terminalreporter.config)
        if lines:
            terminalreporter.section(self.section)
            for line in lines:
                terminalreporter.write_line(line)
