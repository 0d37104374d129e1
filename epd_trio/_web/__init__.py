"""The web layer: HTTP requests in, the owner's answers out. No routing and no upstream call here.

Rule: it may import ``_core``, ``_admission``, ``_observe`` and the owner and pipeline
(``epd_trio._proxy``, ``epd_trio._pipeline``); nothing imports it but the composition root
(``epd_trio._app``) and the servers (``_serve``).

    asgi         per-request resource ownership around Quart, the keep-alive fix, the hot-path split
    endpoints    the two completion routes as plain ASGI: method, keys, body, then the pipeline
    client_gone  how a request learns that its client left, without a task per request
    direct_body  a relayed token written by the connection itself, not as an ASGI message
    drain        shutdown: new requests refused, those in flight given a grace period, then told
"""
