"""``epd-trio serve``: the proxy on Hypercorn's trio worker, one or more processes, bounded shutdown.

Why not ``hypercorn.run``: four things it does not do. (1) Shutdown must be bounded and say
what it does: the app drains first (``_web/drain``: new requests refused, ``/ready`` 503, the
requests in flight given ``EPD_SHUTDOWN_GRACE`` seconds, then ended with a ``shutting_down``
error event), and only then is Hypercorn told to stop. Hypercorn's socket writes are shielded
and have no write timeout, so a client that stopped reading keeps a worker alive past any
timeout (seen: 10 s with a 2 s graceful timeout). Each worker here arms a watchdog thread when
shutdown starts and exits the process at grace + 4 s if the event loop has not finished by
then; the parent kills any worker still alive 1 s later.
(2) Workers must share their routing counters and roster (``_state/roster_store.SharedRoutingState``),
created here before spawning.
(3) Its parent reports exit status 0 when a worker dies at start-up; here a failed start is a
failed start. (4) Metrics must add up across workers: the parent gives them a private
prometheus_client multiprocess directory (``_observe/metrics.py``) and removes it at exit.

Layout: the parent binds the listening socket (so port 0 works and the URL is known before any
worker runs), spawns ``workers`` processes that each serve it, and waits for a signal or for a
worker to die. With one worker everything runs in the parent process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any

import trio
from hypercorn.config import Config, Sockets
from hypercorn.utils import wrap_app
from prometheus_client.multiprocess import mark_process_dead

from .._app import create_app
from .._core.config import Settings
from .._core.shared_state import worker_replica_id
from .._observe.metrics import MULTIPROC_ENV
from .._replicas.identity import default_replica_id
from .._state.roster_store import SharedRoutingState
from .._web.drain import Drain
from .logs import (
    ACCESS_LOGGER,
    SERVE_LOGGER,
    SERVER_LOGGER,
    AccessLogger,
    capture_process_output,
    configure_logging,
)
from .process import setup_serving_process
from .server import worker_serve  # Hypercorn's worker, our connection class (see _server)
from .serving import DEFAULT_BACKLOG, DEFAULT_KEEP_ALIVE, listening_sockets

#: Seconds past the shutdown grace after which a worker process exits no matter what.
WATCHDOG_MARGIN = 4.0
#: Exit status of a process whose shutdown had to be forced (in-flight work was cut).
FORCED_EXIT = 3
#: Hypercorn's own graceful timeout, once the app has drained: the other routes' requests
#: (health, metrics, admin) still running get this long.
HYPERCORN_GRACE = 1.0


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """How to serve (the proxy's own settings are in ``Settings``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    backlog: int = DEFAULT_BACKLOG
    keep_alive: float = DEFAULT_KEEP_ALIVE
    access_log: bool = False
    #: Why ``workers`` is what it is, said at start (``--workers auto``); None: it was given.
    workers_note: str | None = None


def hypercorn_config(options: ServeOptions) -> Config:
    config = Config()
    config.bind = [f"{options.host}:{options.port}"]
    config.backlog = options.backlog
    config.keep_alive_timeout = options.keep_alive
    config.graceful_timeout = HYPERCORN_GRACE
    # Hypercorn's lines go to loggers under epd_trio (one format, one stream: stderr), not to
    # handlers of its own on stdout (access) and stderr (the rest).
    config.accesslog = logging.getLogger(ACCESS_LOGGER) if options.access_log else None
    config.errorlog = logging.getLogger(SERVER_LOGGER)
    config.logger_class = AccessLogger
    config.worker_class = "trio"
    return config


def cannot_listen(host: str, port: int, exc: OSError) -> str:
    """The one line for a listening socket that could not be had: the address, the flags that
    chose it, and the system's reason (``[Errno 98] Address already in use`` alone names no
    address)."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    reason = exc.strerror or str(exc)
    return f"cannot listen on {address} (--host/--port): {reason}"


def _say(message: str, level: int = logging.INFO) -> None:
    """A lifecycle line of the serve command (``epd_trio.serve``: written at any log level)."""
    logging.getLogger(SERVE_LOGGER).log(level, "%s", message)


def _arm_watchdog(limit: float, who: str) -> None:
    """Exit this process after ``limit`` seconds, whatever the event loop is doing."""

    def expire() -> None:
        _say(f"{who}: shutdown still not finished after {limit:g} s "
             "(a client stopped reading?); exiting", logging.ERROR)
        os._exit(FORCED_EXIT)

    timer = threading.Timer(limit, expire)
    timer.daemon = True
    timer.start()


async def _serve(
    settings: Settings,
    shared: SharedRoutingState | None,
    config: Config,
    sockets: Sockets,
    stop: trio.Event,
    who: str,
    moriio_listener: bool = True,
    failures: list[str] | None = None,
) -> None:
    """Serve until ``stop``; a per-process task that dies (``_state/tasks.py``) is appended to
    ``failures`` and stops the process too, which then exits non-zero."""
    setup_serving_process(settings)
    capture_process_output(settings.log_level)

    def on_failure(reason: str) -> None:
        if failures is not None:
            failures.append(reason)
        stop.set()

    quart_app = create_app(settings, shared, moriio_listener=moriio_listener,
                           on_failure=on_failure)
    drain: Drain = quart_app.extensions["epd_trio.drain"]
    app = wrap_app(quart_app, config.wsgi_max_body_size, "asgi")

    async def shutdown_trigger() -> None:
        # Hypercorn stops accepting once this returns: the app drains first (``_web/drain``).
        await stop.wait()
        _arm_watchdog(settings.shutdown_grace + WATCHDOG_MARGIN, who)
        await drain.run()

    await worker_serve(app, config, sockets=sockets, shutdown_trigger=shutdown_trigger)


def _worker_main(
    settings: Settings,
    shared: SharedRoutingState | None,
    config: Config,
    sockets: Sockets,
    lifeline: Connection,
    index: int,
) -> None:
    """One worker process: serve until the parent closes ``lifeline`` (or dies), or SIGTERM.

    The lifeline is the read end of a pipe whose write end only the parent holds: end of file
    means "stop", and comes by itself when the parent is killed, so no worker outlives it.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which decides

    failures: list[str] = []

    async def main() -> None:
        stop = trio.Event()

        async def watch_parent() -> None:
            async with trio.lowlevel.FdStream(os.dup(lifeline.fileno())) as stream:
                while await stream.receive_some():
                    pass
            stop.set()

        async def watch_signals() -> None:
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    stop.set()
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_parent)
            nursery.start_soon(watch_signals)
            # One ZMQ port: worker 0 binds it; the shared roster carries what it hears.
            await _serve(settings, shared, config, sockets, stop, f"worker {index}",
                         moriio_listener=index == 0, failures=failures)
            nursery.cancel_scope.cancel()

    trio.run(main)
    if failures:
        sys.exit(1)  # the parent sees a worker that exited on its own, and stops


def serve(settings: Settings, options: ServeOptions) -> int:
    """Run until SIGINT/SIGTERM; returns the process exit status."""
    configure_logging(settings.log_level, settings.log_format)
    capture_process_output(settings.log_level)
    if options.workers_note is not None:
        _say(options.workers_note)
    config = hypercorn_config(options)
    # Listening before any worker runs: early connections wait in the backlog, not refused.
    try:
        sockets = listening_sockets(config, settings.client_write_timeout)
    except OSError as exc:  # taken, not ours, or no such address: the operator's to fix
        _say(cannot_listen(options.host, options.port, exc), logging.ERROR)
        return 2
    for sock in sockets.insecure_sockets:
        host, port = sock.getsockname()[:2]
        _say(f"proxy ({settings.layout}, {options.workers} worker"
             f"{'s' if options.workers != 1 else ''}) listening on http://{host}:{port}")
    if options.workers == 1:
        return _serve_in_process(settings, config, sockets)
    return _serve_workers(settings, options, config, sockets)


def _serve_in_process(settings: Settings, config: Config, sockets: Sockets) -> int:
    failures: list[str] = []

    async def main() -> None:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        _say(f"{signal.Signals(signum).name}: shutting down "
                             f"(shutdown grace {settings.shutdown_grace:g} s)")
                        stop.set()
                        return

            nursery.start_soon(on_signal)
            await _serve(settings, None, config, sockets, stop, "proxy", failures=failures)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return 1 if failures else 0


def cannot_make_metrics_dir(exc: OSError, tempdir: str | None) -> str:
    """The one line for a metrics directory that could not be made: where, why, and the fix
    (a read-only root file system without a writable ``/tmp`` is the usual cause).

    ``tempdir`` is the temporary directory Python's ``tempfile`` settled on
    (``tempfile.tempdir``), None when it found none writable. Why not name TMPDIR: tempfile
    takes TMPDIR only if it can write a file there, and otherwise falls back on its own (TEMP,
    TMP, ``/tmp``, ``/var/tmp``, ``/usr/tmp``, the working directory), so "under TMPDIR" would
    send the reader to a directory that was never used."""
    if tempdir is None:
        where = ("in a temporary directory, and found none writable (Python's tempfile tries "
                 "TMPDIR, TEMP and TMP when set, then /tmp, /var/tmp, /usr/tmp and the working "
                 "directory)")
    else:
        where = (f"under the temporary directory ({tempdir}) and cannot make one there: "
                 f"{exc.strerror or exc}")
    return (f"--workers N keeps its metrics in a directory of its own {where}. On a read-only "
            "root file system, mount a writable volume at /tmp or at TMPDIR "
            "(docs/how-to/kubernetes.md), or run with --no-metrics")


@contextmanager
def _metrics_dir(path: str | None) -> Iterator[str | None]:
    """``path`` (a fresh directory, or None: no metrics) as the workers'
    ``PROMETHEUS_MULTIPROC_DIR``, removed at exit.

    It goes into this process's environment before the workers are spawned, so each one starts
    with it and imports prometheus_client in multiprocess mode. Fresh, replacing any inherited
    value: files left by an earlier run would add their counts to this one's.
    """
    if path is None:
        yield None
        return
    previous = os.environ.get(MULTIPROC_ENV)
    os.environ[MULTIPROC_ENV] = path
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = previous
        shutil.rmtree(path, ignore_errors=True)


def _serve_workers(
    settings: Settings, options: ServeOptions, config: Config, sockets: Sockets
) -> int:
    try:
        fresh = tempfile.mkdtemp(prefix="epd-trio-metrics-") if settings.metrics else None
    except OSError as exc:
        _say(cannot_make_metrics_dir(exc, tempfile.tempdir), logging.ERROR)
        return 2
    with _metrics_dir(fresh) as metrics_dir:
        return _run_workers(settings, options, config, sockets, metrics_dir)


def _run_workers(
    settings: Settings, options: ServeOptions, config: Config, sockets: Sockets,
    metrics_dir: str | None,
) -> int:
    ctx = multiprocessing.get_context("spawn")

    def forget(process: multiprocessing.process.BaseProcess) -> None:
        """An exited worker's in-flight and health gauges no longer count (``live*`` modes)."""
        if metrics_dir is not None and process.pid is not None:
            mark_process_dead(process.pid, metrics_dir)

    # With a shared state store each worker is a replica of its own there, and the store, not
    # this memory, carries the roster, the loads and (opt-in) the cursor. Each replica needs
    # its own id: worker k of "base" is "base-w<k>" (``worker_replica_id``).
    shared = None if settings.state_url is not None else SharedRoutingState(ctx)
    base_id = settings.replica_id or default_replica_id()
    signalled: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        signalled.append(signum)  # only a flag: the loop below does the work

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    processes, lifelines = [], []
    for index in range(options.workers):
        read_end, write_end = ctx.Pipe(duplex=False)
        own = settings if shared is not None else replace(
            settings, replica_id=worker_replica_id(base_id, index))
        process = ctx.Process(
            target=_worker_main,
            kwargs={"settings": own, "shared": shared, "config": config,
                    "sockets": sockets, "lifeline": read_end, "index": index},
            name=f"epd-trio-worker-{index}",
        )
        process.start()
        read_end.close()  # the worker has its own copy; the write end stays only here
        processes.append(process)
        lifelines.append(write_end)
    status = 0
    # Wait for a signal, or for any worker to die on its own (then stop the others too).
    while not signalled:
        ready = wait([p.sentinel for p in processes], timeout=0.2)
        if ready and not signalled:
            dead = [p.name for p in processes if p.sentinel in ready]
            for process in processes:
                if process.sentinel in ready:
                    forget(process)
            _say(f"{', '.join(dead)} exited on its own; stopping", logging.ERROR)
            status = 1
            break
    if signalled:
        _say(f"{signal.Signals(signalled[0]).name}: shutting down "
             f"(shutdown grace {settings.shutdown_grace:g} s)")
    for lifeline in lifelines:
        lifeline.close()  # end of file on every worker's lifeline: stop
    # Each worker bounds itself (watchdog); this is the backstop for a worker that cannot.
    deadline = time.monotonic() + settings.shutdown_grace + WATCHDOG_MARGIN + 1.0
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
            status = status or FORCED_EXIT
        elif process.exitcode and not status:
            status = process.exitcode
        forget(process)
    for sock in sockets.insecure_sockets:
        sock.close()
    return status
