"""The one policy of every per-process task (prober, discovery, state link, MoRIIO listener,
load scraper, KV subscriber, housekeeping, stalled-send watchdog).

Why: these tasks live in the app's lifespan nursery. When one raised, Hypercorn logged a
"Lifespan" error, the nursery cancelled its siblings, and the worker went on serving with no
prober: requests went to dead instances and ``/health`` said "ok" (issue 31). The policy:

- each task survives what it is *fed* (a bad record, frame or answer is logged and skipped, in
  the task itself: that is a task's own business);
- what still escapes a task after it started is a bug or a broken dependency, which no retry
  here would mend. It is logged at CRITICAL with its traceback, the process says so on
  ``/health`` (``"status": "failed"``, the task named) and ``/ready`` (503), and the worker is
  stopped so that its supervisor (``epd-trio serve``, then systemd or Kubernetes) restarts it;
- a failure *before* a task reports started stays a start-up failure: it propagates as it was.

``named`` marks a task with its name; ``Supervisor`` owns the nursery they all run in.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger("epd_trio")


class TaskDied(Exception):
    """A per-process task ended with an exception after it had started."""

    def __init__(self, name: str, cause: BaseException) -> None:
        super().__init__(f"the {name} task died: {describe(cause)}")
        self.name = name


def describe(exc: BaseException) -> str:
    """One line for an exception, a group flattened to its first leaf (a nursery wraps what
    its child raised; the reader wants the child's error, not the wrapping)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, TaskDied):
        return str(exc)
    text = str(exc).replace("\n", " ")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def named(name: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``fn`` as a task of ``name``: an exception it raises after it started (for a task
    started with ``nursery.start``: after ``task_status.started``) becomes ``TaskDied``."""

    async def run(*args: Any, task_status: Any = None, **kwargs: Any) -> Any:
        status = None if task_status is None else _Status(task_status)
        if status is not None:
            kwargs["task_status"] = status
        try:
            return await fn(*args, **kwargs)
        except Exception as exc:
            # start_soon: running is started; nursery.start: once ``started`` was called.
            if (status is not None and not status.called) or isinstance(exc, TaskDied):
                raise
            raise TaskDied(name, exc) from exc

    return run


class _Status:
    """A task status that remembers whether the task reported started."""

    def __init__(self, outer: Any) -> None:
        self._outer = outer
        self.called = False

    def started(self, value: Any = None) -> None:
        self.called = True
        self._outer.started(value)


class Supervisor:
    """The owner of the per-process tasks' nursery, and of the verdict when one dies.

    ``failure`` is None while every task runs, else the line that says which one died and
    why (``/health`` and ``/ready`` show it). ``on_failure`` is how the process is stopped
    (``epd-trio serve`` stops the worker and exits non-zero); without it, the process keeps
    serving and says it has failed, which a test or an embedding application can read."""

    def __init__(self, on_failure: Callable[[str], None] | None = None) -> None:
        self.failure: str | None = None
        self._on_failure = on_failure

    async def run(
        self, start: Callable[[trio.Nursery], Awaitable[None]],
        task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the tasks ``start`` starts in one nursery, until cancelled or one dies.

        A failure of ``start`` itself is a start-up failure and propagates."""
        started = False
        try:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    await start(nursery)
                    started = True
                    task_status.started(scope)
        except Exception as exc:
            if not started:
                # As it was raised, not wrapped by this nursery: callers (and ``epd-trio
                # serve``'s one-line start-up errors) match the exception itself.
                leaf: BaseException = exc
                while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
                    leaf = leaf.exceptions[0]
                raise leaf from leaf.__cause__
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """Record, log loudly and report a task's death (once: the first one is the cause)."""
        if self.failure is not None:
            return
        self.failure = describe(exc)
        log.critical("%s; stopping this worker (its supervisor restarts it)", self.failure,
                     exc_info=exc)
        if self._on_failure is not None:
            self._on_failure(self.failure)
