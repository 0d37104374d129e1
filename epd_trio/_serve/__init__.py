"""Processes and servers: ``epd-trio serve`` and its workers, Hypercorn, logging.

Rule: it may import anything below it (``_core``, ``_state``, ``_observe``, ``_web``,
``_replicas``) and the composition root (``epd_trio._app``); only ``__main__`` and the test
doubles import it.

    runner     ``epd-trio serve``: the workers, their shared memory, the bounded shutdown
    serving    an ASGI app served in-process on Hypercorn's trio worker (tests, demo, bench)
    server     the connection class ``epd-trio serve`` runs on Hypercorn's trio worker
    process    process-wide set-up: logging, the garbage collector, the fd limit; the CPU
               limit ``--workers auto`` follows, read from the cgroup's files
    cpu_quota  a cgroup's CPU quota from its files' text: what ``--workers auto`` starts (pure,
               the standard library only, like ``_core``: ``tests/test_layout.py``)
    logs       the log output: level, and text or JSON lines
"""
