"""What several proxy replicas share through Redis (``EPD_STATE_URL``).

Rule: it may import ``_core``, ``_state`` (the roster store and loads it feeds) and
``_observe`` (its counts). The proxy works without it: each piece is made only with a state URL.

    sync         the link to the store: writes, announcements, resyncs, write-back, loads, cursor
    roster       a replica's view of the shared roster and the writes it owes the store
    cursor_link  the global cursor's lean connection (the one command on a request's path)
    limits       the tenants' per-minute buckets, one script per admission on a lean link
    tls          the TLS context of a ``rediss://`` URL, shared by both links
    identity     a replica's default id
"""
