"""Command line: ``epd-trio serve`` and ``epd-trio demo`` (or ``python -m epd_trio ...``).

``serve`` runs the proxy on Hypercorn's trio worker (``--workers N`` processes sharing their
routing counters), configured by flags, ``EPD_*`` environment variables or ``--config FILE``, in
that order of priority.

``demo`` starts an embedded fake fleet and the real proxy on a local port, prints a
ready-to-paste ``curl``, and serves until Ctrl-C: two models, each a pool learned from its
fakes' ``/v1/models`` (``fake-model``: 3 encoders, 2 prefill x DP2, 2 decode x DP2;
``fake-text``: 1 prefill, 1 decode x DP2) and an alias over both (``chat``, 3 to 1).
``demo --check`` instead sends a few requests through it, prints where each leg went, and exits
(non-zero if any request failed): a one-command smoke test of an installation. ``demo
--kv-connector moriio`` runs the first model's layout with MoRIIO fakes that register over ZMQ.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import json
import os
import shlex
import signal
import socket
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import httpx
import trio

from ._core.config import (
    FLAG_FIELDS,
    SETTING_CHOICES,
    SETTING_DEFAULTS,
    ConfigError,
    Settings,
    env_name,
    flag_name,
)
from ._core.meanings import MEANINGS, SERVE_OPTIONS, Meaning
from ._core.policies import POLICIES
from ._core.roster import layout_name
from ._core.router_flags import ALIASES, ALL_STAGES, IGNORED, REFUSED
from ._discovery.start import check_discovery
from ._environment import load_settings
from ._observe.tracing import check_tracing
from ._replicas.tls import tls_context
from ._serve.process import auto_workers
from ._serve.runner import (
    WATCHDOG_MARGIN,
    ServeOptions,
    cannot_listen,
    serve,
)
from ._serve.serving import DEFAULT_BACKLOG, DEFAULT_KEEP_ALIVE
from .testing.cluster import Fleet, Layout, run_fleet, run_moriio_cluster
from .testing.fake_vllm import FakeVLLM
from .testing.media import png_data_url

#: The highest TCP port.
MAX_PORT = 65535


#: The demo's fleet: its first model is the one the README's curl and the check's first
#: requests name (E+P+D); a second, text-only model has a pool of its own (P+D); an alias
#: splits between the two, 3 to 1.
DEMO_MODEL, TEXT_MODEL, DEMO_ALIAS = "fake-model", "fake-text", "chat"
DEMO_LAYOUTS: dict[str, Layout] = {DEMO_MODEL: (3, (2, 2), (2, 2)), TEXT_MODEL: (0, (1, 1), (1, 2))}
DEMO_ALIASES = {DEMO_ALIAS: {"targets": {DEMO_MODEL: 3, TEXT_MODEL: 1}}}


def _sample_body(seed: int, *, stream: bool, model: str = DEMO_MODEL) -> dict[str, object]:
    if model != DEMO_MODEL:  # the text model and the alias: a text prompt
        return {"model": model, "stream": stream, "max_tokens": 8,
                "messages": [{"role": "user", "content": f"Say something, number {seed}."}]}
    return {
        "model": model,
        "stream": stream,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_data_url(seed=seed)}},
            {"type": "text", "text": "What is in this image?"},
        ]}],
    }


def _curl(url: str) -> str:
    body = json.dumps(_sample_body(0, stream=True))
    return (f"curl -N {url}/v1/chat/completions -H 'content-type: application/json' "
            f"-d {shlex.quote(body)}")


def _describe(fleet: Fleet) -> str:
    def role(name: str, fakes: list[FakeVLLM]) -> str:
        urls = ", ".join(f.url for f in fakes)
        return f"    {name:<8} {len(fakes)} x DP{fakes[0].dp_size}: {urls}"

    s = fleet.settings
    roster = fleet.proxy.roster
    moriio = (f", MoRIIO {roster.transfer_mode} mode, registered over ZMQ on "
              f"{fleet.proxy.membership.moriio_endpoint}" if s.kv_connector == "moriio" else "")
    lines = [f"epd_trio demo: proxy on {fleet.proxy_url} (layout {layout_name(roster)}"
             f"{moriio}, fake vLLM backends; pools learned from their /v1/models)"]
    for model, roles in fleet.fakes.items():
        stages = "+".join(label for label, stage in (("E", "encode"), ("P", "prefill"),
                                                      ("D", "decode")) if roles[stage])
        lines.append(f"  model {model} ({stages})")
        lines += [role(stage, fakes) for stage, fakes in roles.items() if fakes]
    for alias, table in s.model_aliases.items():
        targets = ", ".join(f"{name} {weight}" for name, weight in table["targets"].items())
        lines.append(f"  alias {alias}: {targets}")
    return "\n".join(lines)


def _legs(fleet: Fleet, seen: list[int]) -> tuple[list[str], set[str]]:
    """The legs each fake received since ``seen`` (their request counts then), labelled by
    stage and index within their model (another model's with its name first), and the models
    that took them."""
    legs, models = [], set()
    before = iter(seen)
    first = next(iter(fleet.fakes))
    for model, roles in fleet.fakes.items():
        for label, fakes in (("E", roles["encode"]), ("P", roles["prefill"]),
                             ("D", roles["decode"])):
            for i, fake in enumerate(fakes):
                for rec in fake.requests()[next(before):]:
                    rank = "" if rec.rank is None else f" rank {rec.rank}"
                    legs.append(("" if model == first else f"{model} ") + f"{label}{i}{rank}")
                    models.add(model)
    return legs, models


async def _check(fleet: Fleet, count: int) -> bool:
    """``count`` requests for the first model, then two for each other one and four for each
    alias (its weighted turns), one at a time: where each went."""
    first, *others = fleet.fakes
    plan = [(n, first) for n in range(count)]
    plan += [(len(plan) + k, model) for model in others for k in range(2)]
    plan += [(len(plan) + k, alias) for alias in fleet.settings.model_aliases for k in range(4)]
    ok = True
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        for n, model in plan:
            stream = n % 2 == 1
            # One request at a time: its legs are what each fake received meanwhile (MoRIIO
            # legs carry the connector's request id, not the client's).
            seen = [len(fake.requests()) for fake in fleet.all()]
            r = await client.post(fleet.proxy_url + "/v1/chat/completions",
                                  json=_sample_body(n, stream=stream, model=model),
                                  headers={"x-request-id": f"demo-{n}"})
            legs, models = _legs(fleet, seen)
            good = r.status_code == 200 and (not stream or r.text.endswith("data: [DONE]\n\n"))
            ok &= good
            kind = "stream" if stream else "json"
            named = "" if model == first else (
                f", {model}" + (f" -> {', '.join(sorted(models))}"
                                if model in fleet.settings.model_aliases else ""))
            print(f"  request {n} ({kind}{named}): HTTP {r.status_code} via {' -> '.join(legs)}"
                  + ("" if good else f"  FAILED: {r.text[:200]}"))
    return ok


def _demo_port(args: argparse.Namespace) -> str | None:
    """Settle ``args.port`` before the demo starts: the asked port, or the next free one (said
    on stdout); else the one line saying why not."""
    if (problem := port_problem(args.port)) is not None:
        return problem
    try:
        port = free_demo_port(args.host, args.port)
    except OSError as exc:
        return cannot_listen(args.host, args.port, exc)
    if port is None:
        return (f"cannot listen on {args.host}:{args.port} (--host/--port) nor on the next "
                "ports: pick another with --port (0 = any free port)")
    if port != args.port:
        print(f"epd_trio demo: {args.host}:{args.port} is taken; using port {port} instead "
              "(--port chooses)", flush=True)
        args.port = port
    return None


async def _demo(args: argparse.Namespace) -> int:
    # The receiver stays open until the cluster has stopped, so a second Ctrl-C during the
    # (short) graceful shutdown is absorbed instead of turning into a traceback.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with _demo_fleet(args) as fleet:
            print(_describe(fleet), flush=True)
            if args.check:
                ok = await _check(fleet, args.check)
                print("demo check: " + ("all requests succeeded" if ok else "FAILED"))
                return 0 if ok else 1
            print("\nTry a multimodal streaming request (or name fake-text, or the alias chat, "
                  "in a text one):\n\n" + _curl(fleet.proxy_url)
                  + "\n\nCtrl-C stops the demo.", flush=True)
            async for _ in signals:
                break
    print("epd_trio demo: stopped")
    return 0


@asynccontextmanager
async def _demo_fleet(args: argparse.Namespace) -> AsyncIterator[Fleet]:
    """The demo's fakes and proxy: two models and an alias (``DEMO_LAYOUTS``), their pools
    learned from the fakes' ``/v1/models``; with MoRIIO, its one model's fakes registering
    over ZMQ."""
    if args.kv_connector == "moriio":
        async with run_moriio_cluster(mode=args.moriio_mode, encoders=3, prefills=2,
                                      prefill_dp=2, decodes=2, decode_dp=2, host=args.host,
                                      proxy_port=args.port) as c:
            yield Fleet({DEMO_MODEL: {"encode": c.encoders, "prefill": c.prefills,
                                      "decode": c.decodes}}, c.settings, c.proxy_url, c.proxy)
        return
    async with run_fleet(DEMO_LAYOUTS, tables=False, host=args.host, proxy_port=args.port,
                         model_aliases=DEMO_ALIASES) as fleet:
        yield fleet


def port_problem(port: int) -> str | None:
    """Why ``--port`` cannot be listened on, or None (``bind`` says only ``OverflowError``)."""
    if 0 <= port <= MAX_PORT:
        return None
    return f"--port {port}: not a TCP port (0 to {MAX_PORT}; 0 = any free port)"


def free_demo_port(host: str, port: int, tries: int = 100) -> int | None:
    """``port``, or the first of the next ``tries`` ports that ``host`` can listen on (None if
    none can; a failure other than a taken port is raised): the demo's default 8000 is
    vLLM's own, so often taken on a machine running it. The check binds and closes; another
    process may still take the port before the demo does (then ``main`` says so in one line)."""
    if port == 0:
        return 0
    for candidate in range(port, min(port + tries, MAX_PORT + 1)):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Hypercorn binds
            try:
                probe.bind((host, candidate))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise  # not a taken port (no such address...): no other port helps
                continue
        return candidate
    return None


class _Parser(argparse.ArgumentParser):
    """A parser that refuses what it does not know itself, with its own usage and the closest
    flag it has: argparse would hand an unknown flag of ``serve`` up to the top-level parser,
    whose usage says nothing about ``serve``'s flags."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            flag = next((a for a in extras if a.startswith("-")), extras[0])
            close = difflib.get_close_matches(flag.split("=", 1)[0],
                                              sorted(self._option_string_actions), n=1)
            self.error(f"unrecognized argument: {flag}"
                       + (f" (did you mean {close[0]}?)" if close else ""))
        return namespace, extras


class _Refused(argparse.Action):
    """A flag of vllm-router or SGLang's router with no same-meaning flag here."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string} is a vllm-router / SGLang router flag with no "
                     f"equivalent here: {REFUSED[option_string or '']} (the table 'Coming from "
                     "vllm-router / SGLang' in docs/reference/settings.md)")


def _version() -> str:
    try:
        return version("epd-trio")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _shown(value: Any) -> str:
    if value is None or value == ():
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _help(meaning: Meaning, where: str, default: Any, extra: str = "") -> str:
    """A flag's help line: its meaning (``_core/meanings``), where else it is set, its default."""
    return f"{meaning.text} ({where}default {_shown(default)}{extra})"


def _add_serve(commands: Any) -> None:
    serve = commands.add_parser(
        "serve", help="run the proxy (Hypercorn trio worker)", allow_abbrev=False,
        description="Run the proxy. Every setting can also come from its EPD_* environment "
                    "variable or the --config TOML file; a flag wins. Keys (EPD_ADMIN_KEY, "
                    "EPD_API_KEYS, EPD_UPSTREAM_API_KEY) have no flag: set them in the "
                    "environment or the config file, so they stay out of ps listings. "
                    "vllm-router's and SGLang's flags with the same meaning are accepted "
                    "(docs/reference/settings.md, 'Coming from vllm-router / SGLang').")
    serve.add_argument("--version", action="version", version=f"epd-trio {_version()}")
    options = {"--host": "127.0.0.1", "--port": 8000, "--workers": 1,
               "--backlog": DEFAULT_BACKLOG, "--keep-alive": DEFAULT_KEEP_ALIVE}
    kinds = {"--host": str, "--port": int, "--workers": workers_option, "--backlog": int}
    for flag, default in options.items():
        meaning = SERVE_OPTIONS[flag]
        extra = {"--port": "; 0 = any free port, printed"}.get(flag, "")
        serve.add_argument(flag, type=kinds.get(flag, float), default=default,
                           metavar=meaning.shown_metavar, help=_help(meaning, "", default, extra))
    serve.add_argument("--access-log", action="store_true",
                       help=f"{SERVE_OPTIONS['--access-log'].text} (default off)")
    serve.add_argument("--config", metavar=SERVE_OPTIONS["--config"].shown_metavar,
                       help=f"{SERVE_OPTIONS['--config'].text} (EPD_CONFIG; default none)")
    aliases: dict[str, list[str]] = {}
    for theirs, ours in ALIASES.items():
        aliases.setdefault(ours, []).append(theirs)
    for field in FLAG_FIELDS:
        env, meaning = env_name(field), MEANINGS[field]
        flags = [flag_name(field), *aliases.get(flag_name(field), [])]
        where = f"{env}; "
        if field.endswith("_urls"):
            serve.add_argument(*flags, dest=field, nargs="+", action="extend",
                               metavar=meaning.shown_metavar,
                               help=_help(meaning, where, None))
        elif field.endswith("_selector"):
            # vllm-router's spelling: --decode-selector app=vllm role=decode
            serve.add_argument(*flags, dest=field, nargs="+", action="extend",
                               metavar=meaning.shown_metavar, help=_help(meaning, where, None))
            if field == "decode_selector":
                serve.add_argument("--selector", dest="selector", nargs="+", action="extend",
                                   metavar="KEY=VALUE", help="vllm-router's --selector (a fleet "
                                   "without a prefill/decode split): --decode-selector")
        elif field == "shutdown_grace":  # Hypercorn's --graceful-timeout is its other name
            serve.add_argument(*flags, "--graceful-timeout", dest=field,
                               metavar=meaning.shown_metavar,
                               help=_help(meaning, where, SETTING_DEFAULTS[field],
                                          f"; the process exits within this + "
                                          f"{WATCHDOG_MARGIN + 1:g} s; --graceful-timeout is "
                                          "Hypercorn's name for it"))
        elif isinstance(SETTING_DEFAULTS[field], bool):
            serve.add_argument(*flags, dest=field, action=argparse.BooleanOptionalAction,
                               default=None,
                               help=_help(meaning, where, SETTING_DEFAULTS[field]))
        else:
            choices = SETTING_CHOICES.get(field)
            serve.add_argument(*flags, dest=field,
                               metavar="{" + ",".join(choices) + "}" if choices
                               else meaning.shown_metavar or "VALUE",
                               help=_help(meaning, where, SETTING_DEFAULTS[field]))
    serve.add_argument(ALL_STAGES, dest="policy", choices=POLICIES, metavar="{"
                       + ",".join(POLICIES) + "}",
                       help="vllm-router's and SGLang's --policy: the policy of every stage "
                            "whose own policy flag is not given")
    for flag, why in IGNORED.items():
        serve.add_argument(flag, action="store_true", dest="ignored_mode",
                           help=f"vllm-router's mode switch, accepted: {why}")
    for flag in REFUSED:
        serve.add_argument(flag, action=_Refused, nargs="*", help=argparse.SUPPRESS)


#: ``--workers auto``: as many workers as the CPUs of the process's cgroup quota.
AUTO_WORKERS = "auto"


def workers_option(text: str) -> int | str:
    """``--workers``: a count, or ``auto`` (resolved at start from the cgroup's CPU limit:
    ``_serve/cpu_quota``, ``_serve/process.auto_workers``)."""
    if text == AUTO_WORKERS:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a number of workers nor {AUTO_WORKERS}") from None


def serve_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The settings ``epd-trio serve``'s flags give (None: not given), for ``settings_from``.

    vllm-router's ``--selector`` selects the pods of a fleet without a prefill/decode split,
    each serving whole requests: here, the decode (combined) role's ``--decode-selector``.
    vllm-router takes it or the two split selectors, never both; so does this.
    """
    flags = {field: getattr(args, field) for field in FLAG_FIELDS}
    policy = getattr(args, "policy", None)
    if policy is not None:  # vllm-router's --policy: each stage's own flag wins
        for stage in ("encode", "prefill", "decode"):
            field = f"{stage}_policy"
            if flags[field] is None and policy in SETTING_CHOICES[field]:
                flags[field] = policy
    selector = getattr(args, "selector", None)
    if selector:
        given = [flag_name(f) for f in ("prefill_selector", "decode_selector") if flags[f]]
        if given:
            raise ConfigError("--selector", "is vllm-router's selector of a fleet without a "
                              "prefill/decode split (--decode-selector here): give it or "
                              f"{given[0]}, not both")
        flags["decode_selector"] = selector
    return flags


def load_serve_settings(args: argparse.Namespace,
                        environ: Mapping[str, str] | None = None) -> Settings:
    """The settings ``epd-trio serve`` runs with: the config file, the environment (``environ``,
    else ``os.environ``) and the flags merged (``load_settings``).

    ``--selector``'s rule is checked again on the merged result: ``serve_flags`` sees only the
    flags, and a prefill selector from the environment or the file beside ``--selector`` would
    silently make the P/D split ``--selector`` says there is not. A decode selector from there
    is only overridden by it, as by any flag."""
    settings = load_settings(environ, flags=serve_flags(args), config_path=args.config)
    if getattr(args, "selector", None) and settings.prefill_selector:
        raise ConfigError("--selector", "is vllm-router's selector of a fleet without a "
                          "prefill/decode split (--decode-selector here): give it or "
                          f"{env_name('prefill_selector')} (set in the environment or the "
                          "config file), not both")
    return settings


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = load_serve_settings(args)
        check_tracing(os.environ)  # before any worker: a missing SDK is one line, not N
        check_discovery(settings)  # the same for a missing or refused kubeconfig
        if settings.state_url is not None:
            tls_context(settings.state_url)  # and for a rediss:// URL's unusable TLS files
    except ConfigError as exc:
        print(f"epd-trio: configuration error: {exc}", file=sys.stderr)
        return 2
    if (problem := port_problem(args.port)) is not None:
        print(f"epd-trio: {problem}", file=sys.stderr)
        return 2
    workers, workers_note = (auto_workers() if args.workers == AUTO_WORKERS
                             else (args.workers, None))
    options = ServeOptions(host=args.host, port=args.port, workers=workers,
                           backlog=args.backlog, keep_alive=args.keep_alive,
                           access_log=args.access_log, workers_note=workers_note)
    if options.workers < 1:
        print("epd-trio: --workers must be at least 1", file=sys.stderr)
        return 2
    return serve(settings, options)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if (problem := _demo_port(args)) is not None:
            print(f"epd-trio: {problem}", file=sys.stderr)
            return 2
        return trio.run(_demo, args)
    except OSError as exc:
        print(f"epd-trio: {exc}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:
        # The demo's servers start in nurseries: a port taken after ``_demo_port`` looked
        # (another process was quicker) comes out wrapped. One line, like serve's.
        bind = _bind_error(group)
        if bind is None:
            raise
        print(f"epd-trio: {cannot_listen(args.host, args.port, bind)}", file=sys.stderr)
        return 2


def _bind_error(group: BaseExceptionGroup) -> OSError | None:
    """The first ``OSError`` in ``group`` if every leaf is one (else None: not ours to word)."""
    matched, rest = group.split(OSError)
    if matched is None or rest is not None:
        return None
    while isinstance(matched, BaseExceptionGroup):
        matched = matched.exceptions[0]
    return matched if isinstance(matched, OSError) else None


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``epd-trio`` (the tests parse the docs' manifests with it)."""
    parser = _Parser(prog="epd-trio", description=__doc__, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"epd-trio {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_serve(commands)
    demo = commands.add_parser("demo", help="run the proxy on an embedded fake EPD cluster",
                               allow_abbrev=False)
    demo.add_argument("--host", default="127.0.0.1", metavar="HOST",
                      help="address to listen on (default 127.0.0.1)")
    demo.add_argument("--port", type=int, default=8000, metavar="PORT",
                      help="port to listen on; 0 = any free port (default 8000)")
    demo.add_argument("--check", type=int, nargs="?", const=6, default=0, metavar="N",
                      help="send N requests (default 6), print their routes and exit")
    demo.add_argument("--kv-connector", choices=("generic", "moriio"), default="generic",
                      help="moriio: prefill and decode fakes speak vLLM's MoRIIO connector and "
                           "register over ZMQ (default generic)")
    demo.add_argument("--moriio-mode", choices=("READ", "WRITE"), default="READ",
                      help="the MoRIIO transfer mode of the fakes (default READ)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
