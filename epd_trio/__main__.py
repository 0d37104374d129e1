"""Command line: ``epd-trio serve`` and ``epd-trio demo`` (or ``python -m epd_trio ...``).

``serve`` runs the proxy on Hypercorn's trio worker (``--workers N`` processes sharing their
routing counters), configured by flags, ``EPD_*`` environment variables or ``--config FILE``, in
that order of priority.

``demo`` starts an embedded fake cluster (3 encoders, 2 prefill x DP2, 2 decode x DP2) and the
real proxy on a local port, prints a ready-to-paste ``curl``, and serves until Ctrl-C.
``demo --check`` instead sends a few requests through it, prints where each leg went, and exits
(non-zero if any request failed): a one-command smoke test of an installation. ``demo
--kv-connector moriio`` runs the same layout with MoRIIO fakes that register over ZMQ.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shlex
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from functools import partial
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
from ._core.roster import layout_name
from ._discovery.start import check_discovery
from ._environment import load_settings
from ._observe.tracing import check_tracing
from ._replicas.tls import tls_context
from ._serve.runner import (
    WATCHDOG_MARGIN,
    ServeOptions,
    cannot_listen,
    serve,
)
from ._serve.serving import DEFAULT_BACKLOG, DEFAULT_KEEP_ALIVE
from .testing.cluster import Cluster, run_cluster, run_moriio_cluster
from .testing.media import png_data_url

#: The highest TCP port.
MAX_PORT = 65535


def _sample_body(seed: int, *, stream: bool) -> dict[str, object]:
    return {
        "model": "fake-model",
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


def _describe(cluster: Cluster) -> str:
    def role(name: str, fakes: list, dp: int) -> str:
        urls = ", ".join(f.url for f in fakes)
        return f"  {name:<8} {len(fakes)} x DP{dp}: {urls}"

    s = cluster.settings
    moriio = (f", MoRIIO {cluster.proxy.roster.transfer_mode} mode, registered over ZMQ on "
              f"{cluster.proxy.membership.moriio_endpoint}" if s.kv_connector == "moriio" else "")
    return "\n".join([
        f"epd_trio demo: proxy on {cluster.proxy_url} (layout {layout_name(cluster.proxy.roster)}"
        f"{moriio}, fake vLLM backends)",
        role("encode", cluster.encoders, 1),
        role("prefill", cluster.prefills, cluster.prefills[0].dp_size),
        role("decode", cluster.decodes, cluster.decodes[0].dp_size),
    ])


async def _check(cluster: Cluster, count: int) -> bool:
    ok = True
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        for n in range(count):
            stream = n % 2 == 1
            rid = f"demo-{n}"
            # One request at a time: its legs are what each fake received meanwhile (MoRIIO
            # legs carry the connector's request id, not the client's).
            seen = [len(fake.requests()) for fake in cluster.fakes]
            r = await client.post(cluster.proxy_url + "/v1/chat/completions",
                                  json=_sample_body(n, stream=stream),
                                  headers={"x-request-id": rid})
            legs = []
            before = iter(seen)
            for label, fakes in (("E", cluster.encoders), ("P", cluster.prefills),
                                 ("D", cluster.decodes)):
                for i, fake in enumerate(fakes):
                    for rec in fake.requests()[next(before):]:
                        rank = "" if rec.rank is None else f" rank {rec.rank}"
                        legs.append(f"{label}{i}{rank}")
            good = r.status_code == 200 and (not stream or r.text.endswith("data: [DONE]\n\n"))
            ok &= good
            kind = "stream" if stream else "json"
            print(f"  request {n} ({kind}): HTTP {r.status_code} via {' -> '.join(legs)}"
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
        layout = {"encoders": 3, "prefills": 2, "prefill_dp": 2, "decodes": 2, "decode_dp": 2,
                  "host": args.host, "proxy_port": args.port}
        cluster_of = (partial(run_moriio_cluster, mode=args.moriio_mode)
                      if args.kv_connector == "moriio" else run_cluster)
        async with cluster_of(**layout) as cluster:
            print(_describe(cluster), flush=True)
            if args.check:
                ok = await _check(cluster, args.check)
                print("demo check: " + ("all requests succeeded" if ok else "FAILED"))
                return 0 if ok else 1
            print("\nTry a multimodal streaming request:\n\n" + _curl(cluster.proxy_url)
                  + "\n\nCtrl-C stops the demo.", flush=True)
            async for _ in signals:
                break
    print("epd_trio demo: stopped")
    return 0


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


def _add_serve(commands: Any) -> None:
    serve = commands.add_parser(
        "serve", help="run the proxy (Hypercorn trio worker)",
        description="Run the proxy. Every setting can also come from its EPD_* environment "
                    "variable or the --config TOML file; a flag wins. Keys (EPD_ADMIN_KEY, "
                    "EPD_API_KEYS, EPD_UPSTREAM_API_KEY) have no flag: set them in the "
                    "environment or the config file, so they stay out of ps listings.")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 = any free port (printed)")
    serve.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    serve.add_argument("--backlog", type=int, default=DEFAULT_BACKLOG,
                       help=f"listen backlog (default {DEFAULT_BACKLOG})")
    serve.add_argument("--keep-alive", type=float, default=DEFAULT_KEEP_ALIVE,
                       help=f"idle keep-alive seconds (default {DEFAULT_KEEP_ALIVE:g})")
    serve.add_argument("--access-log", action="store_true", help="log every request (off)")
    serve.add_argument("--config", metavar="FILE", help="TOML file of settings (EPD_CONFIG)")
    for field in FLAG_FIELDS:
        env = env_name(field)
        if field.endswith("_urls"):
            serve.add_argument(flag_name(field), dest=field, nargs="+", action="extend",
                               metavar="URL[#dp=N]", help=f"{field.removesuffix('_urls')} "
                               f"instances ({env})")
        elif field.endswith("_selector"):
            # vllm-router's spelling: --decode-selector app=vllm role=decode
            serve.add_argument(flag_name(field), dest=field, nargs="+", action="extend",
                               metavar="KEY=VALUE", help=f"{field.removesuffix('_selector')} "
                               f"pods' labels ({env})")
            if field == "decode_selector":
                serve.add_argument("--selector", dest="selector", nargs="+", action="extend",
                                   metavar="KEY=VALUE", help="vllm-router's --selector (a fleet "
                                   "without a prefill/decode split): --decode-selector")
        elif field == "shutdown_grace":
            help_ = (f"seconds requests in flight get at shutdown before they are ended with a "
                     f"shutting_down error ({env}, default {SETTING_DEFAULTS[field]:g}; the "
                     f"process exits within this + {WATCHDOG_MARGIN + 1:g} s)")
            serve.add_argument(flag_name(field), "--graceful-timeout", dest=field,
                               metavar="SECONDS", help=help_ + "; --graceful-timeout is "
                               "Hypercorn's name for it")
        elif isinstance(SETTING_DEFAULTS[field], bool):
            serve.add_argument(flag_name(field), dest=field, action=argparse.BooleanOptionalAction,
                               default=None, help=f"{env} (default {SETTING_DEFAULTS[field]})")
        else:
            default = SETTING_DEFAULTS[field]
            choices = SETTING_CHOICES.get(field)
            serve.add_argument(flag_name(field), dest=field,
                               metavar="{" + ",".join(choices) + "}" if choices else "N",
                               help=f"{env} (default {default})")


def serve_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The settings ``epd-trio serve``'s flags give (None: not given), for ``settings_from``.

    vllm-router's ``--selector`` selects the pods of a fleet without a prefill/decode split,
    each serving whole requests: here, the decode (combined) role's ``--decode-selector``.
    vllm-router takes it or the two split selectors, never both; so does this.
    """
    flags = {field: getattr(args, field) for field in FLAG_FIELDS}
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
    options = ServeOptions(host=args.host, port=args.port, workers=args.workers,
                           backlog=args.backlog, keep_alive=args.keep_alive,
                           access_log=args.access_log)
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
    parser = argparse.ArgumentParser(prog="epd-trio", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve(commands)
    demo = commands.add_parser("demo", help="run the proxy on an embedded fake EPD cluster")
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--port", type=int, default=8000, help="proxy port (0 = any free port)")
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
