"""The one place the upstream HTTP client library is chosen (the rest imports ``httpx`` from here).

httpx 0.28's connection pool assigns queued requests to connections in O(n^2) (encode/httpx#3215,
encode/httpcore PR #1035, both open): measured here it was the proxy's largest CPU cost under
concurrency. ``httpx2`` is the maintained fork with those fixes merged and the same API; switching
back is this one import.
"""

import httpx2 as httpx

#: The client class to pass to the library functions (``run_encoder_fanout``): errors are mapped
#: from this library's exceptions, so a client from another copy of httpx would not be.
UpstreamClient = httpx.AsyncClient

__all__ = ["UpstreamClient", "httpx"]
