"""KV-cache-aware routing data: which prefill/decode slot already holds a prompt's prefix.

vLLM engines publish KV cache events (blocks stored, removed, all cleared) on one ZMQ PUB socket
per DP rank; this package follows them per slot (an (instance URL, DP rank) pair) and answers,
for a request's token ids, how many leading tokens each slot holds. What belongs here: the event
wire format, our block keys, the index, the per-slot sequence rules, and the sockets that feed
them. What does not: the routing policy that uses the answer, the roster, the render call that
gives a request's token ids (they live with the proxy and import from here).

    wire        frames <-> typed events (both vLLM shapes); the replay socket's frames;
                ``MalformedKvMessage``
    keys        our chained block key, one function for events and requests (``request_keys``)
    index       ``KvIndex``: per-slot blocks, key -> slot bitmask, longest-prefix ``match``,
                speculation, cap, trust states (EXACT / DEGRADED / FALLBACK), per-slot stats
    feed        ``Feed``: one slot's sequence numbers -> apply / skip / replay / reset steps
    prompt      a request's token ids and media, read from vLLM's render answer
    subscriber  the shell: one SUB (+ replay DEALER) per slot on the trio loop via ``zmq.FD``,
                and ``KvEvents``, the owner that reconciles subscribers with the slots

Rule: wire, keys, index, feed and prompt are pure (sans-I/O, time passed in as ``now``): they import
only the standard library, msgpack, each other and ``epd_trio._core``; never trio, zmq, httpx or
socket. Only subscriber imports trio and zmq. ``tests/kv/test_kv_layout.py``
enforces it. This ``__init__`` imports nothing, so importing a pure module does not load the
shell's libraries. The other side, a vLLM-like publisher for the fake vLLM and the tests, is a
test double: ``epd_trio.testing.kv_publisher``.
"""
