"""The pure core: routing arithmetic, request rewriting, the roster, settings, errors, auth rules,
health state, failover rules and the request trace. Values in, values out.

Rule 1: nothing here does I/O or imports trio, httpcore or quart (``tests/test_layout.py``
enforces the imports). Time and randomness come in as arguments or defaults a caller can
replace, so every transition is tested with plain asserts.
Rule 2: a module here imports only the standard library, orjson, msgpack (pure data), and its
siblings.

    names         the vocabulary: stages, roles, request kinds and their paths
    errors        every exception the proxy raises, each knowing its status; ``error_reply``
    routing       instances, DP slots, the encoder assignment, rotation rebasing
    rewrite       parsing a client body and building each leg's body and headers
    roster        which instances exist (configured and registered), as immutable snapshots
    config        ``Settings``: every setting, its default, and how it is parsed
    meanings      what each setting means and its unit: ``serve --help`` and the settings page
    router_flags  vllm-router's and SGLang's flags: taken under their name, or refused and why
    auth          the client-key and admin-key checks
    health        per-instance health and load state, and the rotation rules
    failover      which failures are retried where, the fallback order, the leg-observer protocol
    policies      the routing policies per stage and their bounded affinity indexes
    engine_load   vLLM's load gauges, read from a /metrics page
    trace         what happened to one request: the record behind its metrics and log line
    tracing       OpenTelemetry: when it is on (the OTEL_* variables), W3C trace context, the
                  spans' attributes
    counters      what a routing counter is (the shared one lives in the shell)
    moriio        MoRIIO registration frames, its request id and both legs' kv_transfer_params
    ec_handoff    the encoder's ec_transfer_params matched to items; the consumer's body
    discovery     discovery's rules: DNS URLs and answers, Kubernetes pods, what joins and leaves
    kubeconfig    a kubeconfig's server, credentials and namespace
    urls          every URL checked where it enters (``check_base_url``); ``redact_url``
    state_url     the shared state store's URL and its options
    shared_state  what replicas share: instance records, announcements, the merge, load fields
    tenants       tenant tables, who a request is, its priority and its token reservation
    fair_queue    the admission queue: priority bands, aging, weighted turns inside a band
    token_bucket  a per-minute limit as a bucket holding one minute's worth
"""
