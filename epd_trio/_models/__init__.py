"""The model registry: which instances serve which model, and which pool a request goes to.

A fleet serves several models; each has its own pool: the instances of each role that serve its
name, with their own cursors and counters (``_model_pools`` holds those). What belongs here: the
rules that say who serves what and where a name leads, and the two shells that ask the
instances (what they serve; to load an adapter). What does not: the cursors, the pipeline, the
web answers (they import from here).

    cards     an instance's ``GET /v1/models`` answer read: its cards, "any name" (no such
              route), or no answer
    tables    the ``[models."X"]`` and ``[aliases."X"]`` tables checked and typed
    pools     the pool of each model, derived from the roster (members and what they serve)
              and the tables; each pool's epochs, computed at a change like the roster's
    choice    an alias's target: exact weighted turns, or a weighted hash of a session key
    catalog   a name resolved (a pool, an alias's target, "any name", vLLM's 404, the 400 of
              a missing name) and the ``GET /v1/models`` listing
    learner   a shell: every instance asked when it joins and every ``EPD_MODELS_INTERVAL``
    loading   a shell: LoRA adapters loaded on demand, one load per adapter and stage at a time

Rule: cards, tables, pools, choice and catalog are pure (values in, values out; no trio, no
sockets, no clock): they import only the standard library, orjson and ``epd_trio._core``. Only
the shells import trio, and each is handed its one call to an instance (I/O passed in).
``tests/models/test_models_layout.py`` enforces it. Like ``_kv``, this ``__init__`` imports
nothing, so importing a pure module loads no shell.
"""
