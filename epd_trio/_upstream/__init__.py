"""Every call the proxy makes to a vLLM instance: legs, probes, scrapes, profiling, and their pool.

Rule: it may import ``_core`` and ``_state`` (the cursors and loads a leg holds); the one place
a transport error becomes an ``UpstreamError`` is ``legs``.

    h1            one HTTP/1.1 client connection: a socket and an llhttp parser
    pool          the per-instance pools of ``h1`` connections, with their limits and idle stacks
    legs          one call per leg (``post_json``, ``open_stream``), the encoder fan-out, the relay
    fanout        N jobs in one nursery: every result in order, or the first failure
    prober        the health probes, one task per process
    load_scraper  the optional ``/metrics`` scrape of every instance's running and waiting requests
    profile       ``/start_profile`` and ``/stop_profile`` fanned out to every instance
    reply         what the request path hands the web layer: a status, headers, bytes or a relay
"""
