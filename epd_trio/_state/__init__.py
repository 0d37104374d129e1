"""The routing state of one process, each piece owned by one object.

Rule: it may import ``_core`` only. Nothing here does network I/O; the shared-memory store of
several workers is the one thing outside the process.

    cursors        the routing counters and their policies (the encoder cursor's ``trio.Lock``)
    loads          requests in flight per stage and slot, the other replicas' counts, the scrape
    roster_store   where the roster lives: one process, or shared memory for ``--workers N``
    rate_buckets   the tenants' per-minute buckets in shared memory for ``--workers N``
    tenant_places  the tenants' requests in flight in shared memory for ``--workers N``
    tasks          the one policy of the per-process tasks: skip what they are fed, or die
                   loudly (``/health`` says so, the worker stops)
"""
