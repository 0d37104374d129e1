"""``epd-trio serve``'s command line explains itself (issue 31, item 9): every flag says what it
means and its unit, typos and abbreviations are refused with ``serve``'s usage and the closest
flag, and a vllm-router / SGLang router command line is taken where its flags mean the same
thing, refused where they do not. In-process: the parser is ``build_parser()``."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from epd_trio import Settings
from epd_trio.__main__ import build_parser, serve_flags
from epd_trio._core.config import FLAG_FIELDS, flag_name
from epd_trio._core.meanings import MEANINGS, SERVE_OPTIONS
from epd_trio._core.router_flags import ALIASES, IGNORED, REFUSED


def serve_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def serve_actions() -> dict[str, argparse.Action]:
    return {flag: action for action in serve_parser()._actions for flag in action.option_strings}


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Parse ``argv``; it must exit 2. Returns what was printed on stderr."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


NUMERIC = {f.name for f in dataclasses.fields(Settings)
           if type(f.default) in (int, float)}


def test_every_setting_flag_says_its_meaning_unit_and_variable() -> None:
    actions = serve_actions()
    for field in FLAG_FIELDS:
        action, meaning = actions[flag_name(field)], MEANINGS[field]
        assert action.help is not None and action.help.startswith(meaning.text), field
        assert f"EPD_{field.upper()}" in action.help and "default " in action.help
        if field in NUMERIC:
            assert meaning.unit is not None and meaning.unit in re.findall(r"\w+", meaning.text), (
                f"{field} is a number: its line must say what it counts")
            assert action.metavar in {"N", "SECONDS", "BYTES", "FACTOR", "SHARE", "PORT"}, field


@pytest.mark.parametrize(("flag", "metavar"), [
    ("--state-url", "URL"), ("--service-discovery-kubeconfig", "PATH"),
    ("--moriio-registration", "HOST:PORT"), ("--replica-id", "ID"),
    ("--connect-timeout", "SECONDS"), ("--max-body-bytes", "BYTES"), ("--render-urls", "URL"),
    ("--host", "HOST"), ("--port", "PORT"), ("--config", "PATH"), ("--workers", "N|auto"),
])
def test_metavars_say_what_a_flag_takes(flag: str, metavar: str) -> None:
    assert serve_actions()[flag].metavar == metavar


def test_serving_options_show_their_meaning_and_default() -> None:
    actions = serve_actions()
    for flag, meaning in SERVE_OPTIONS.items():
        assert actions[flag].help.startswith(meaning.text), flag  # type: ignore[union-attr]
    assert "(default 127.0.0.1)" in actions["--host"].help  # type: ignore[operator]
    assert "default 8000" in actions["--port"].help  # type: ignore[operator]


@pytest.mark.parametrize("argv", [["--version"], ["serve", "--version"]])
def test_version(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 0
    assert re.fullmatch(r"epd-trio \S+\n", capsys.readouterr().out)


def test_an_unknown_flag_gets_serves_usage_and_a_suggestion(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = refused(["serve", "--decode-timout", "5"], capsys)
    assert err.startswith("usage: epd-trio serve ")
    assert err.rstrip().endswith("epd-trio serve: error: unrecognized argument: --decode-timout "
                                 "(did you mean --decode-timeout?)")


@pytest.mark.parametrize("argv", [["serve", "--decode-time", "5"], ["serve", "--work", "2"],
                                  ["demo", "--che"]])
def test_abbreviations_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert "unrecognized argument: " + argv[1] in refused(argv, capsys)


def test_a_vllm_router_command_line_is_taken() -> None:
    args = build_parser().parse_args([
        "serve", "--vllm-pd-disaggregation", "--worker-urls", "http://w0:8000",
        "--policy", "least_loaded", "--decode-policy", "cache_aware",
        "--balance-abs-threshold", "16", "--balance-rel-threshold", "2",
        "--max-payload-size", "1024", "--max-concurrent-requests", "50",
        "--health-check-interval-secs", "7", "--health-check-timeout-secs", "3",
        "--health-failure-threshold", "4"])
    flags = serve_flags(args)
    assert flags["decode_urls"] == ["http://w0:8000"]
    # --policy: every stage whose own flag is not given.
    assert (flags["encode_policy"], flags["prefill_policy"], flags["decode_policy"]) == (
        "least_loaded", "least_loaded", "cache_aware")
    assert (flags["cache_balance_abs"], flags["cache_balance_rel"], flags["max_body_bytes"],
            flags["max_inflight"], flags["health_interval"], flags["health_timeout"],
            flags["health_threshold"]) == ("16", "2", "1024", "50", "7", "3", "4")


def test_every_alias_is_a_flag_of_the_same_setting() -> None:
    actions = serve_actions()
    for theirs, ours in ALIASES.items():
        assert actions[theirs] is actions[ours], theirs
    for flag in IGNORED:
        assert flag in actions


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_their_other_flags_are_refused_pointing_at_the_table(
    flag: str, capsys: pytest.CaptureFixture[str],
) -> None:
    err = refused(["serve", flag, "1"], capsys)
    assert f"error: {flag} is a vllm-router / SGLang router flag" in err
    assert REFUSED[flag] in err and "Coming from vllm-router / SGLang" in err
    # Refused, so not offered: the help lists what the proxy takes.
    assert not re.search(rf"{flag}(?![\w-])", serve_parser().format_help())


def test_a_policy_they_have_and_we_do_not_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert "invalid choice: 'consistent_hash'" in refused(
        ["serve", "--policy", "consistent_hash"], capsys)


@pytest.mark.parametrize(("argv", "workers"), [
    ([], 1),
    (["--workers", "3"], 3),
    (["--workers", "auto"], "auto"),
    # The image's entrypoint says --workers auto; a pod's or `run`'s own flag comes after it
    # and wins (deploy/container/Containerfile relies on this).
    (["--workers", "auto", "--workers", "3"], 3),
    (["--host", "0.0.0.0", "--host", "127.0.0.1"], 1),
])
def test_workers_is_a_count_or_auto_and_the_last_flag_wins(argv: list[str],
                                                          workers: int | str) -> None:
    args = build_parser().parse_args(["serve", *argv])
    assert args.workers == workers
    if "--host" in argv:
        assert args.host == "127.0.0.1"


def test_workers_that_is_neither_a_count_nor_auto_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = refused(["serve", "--workers", "many"], capsys)
    assert "argument --workers: 'many' is neither a number of workers nor auto" in err
