"""vllm-router's and SGLang's router flags, as ``epd-trio serve`` takes them or refuses them.

Someone coming from either router (vllm-router is a fork of SGLang's, and their flags mostly
agree) brings a command line. A flag whose meaning is the same here is accepted under its own
name (``ALIASES``: theirs -> ours); one that names what this proxy does another way, or not at
all, is refused with one line saying what to use instead (``REFUSED``), never silently
ignored. The flags both share with this proxy under the same name (``--decode``,
``--prefill-policy``, ``--cache-threshold``, the service discovery flags...) need neither.
Facts: vllm-router's ``src/main.rs`` (``CliArgs``) and SGLang's ``launch_router.py``
(``RouterArgs``). ``docs/reference/settings.md`` has the same table for readers
("Coming from vllm-router / SGLang"), checked against this one by ``tests/test_docs.py``.
"""

from __future__ import annotations

__all__ = ["ALIASES", "ALL_STAGES", "IGNORED", "REFUSED"]

#: Their flag -> ours, with the same meaning and unit.
ALIASES: dict[str, str] = {
    "--worker-urls": "--decode",  # workers that serve whole requests: the PD layout
    "--balance-abs-threshold": "--cache-balance-abs",
    "--balance-rel-threshold": "--cache-balance-rel",
    "--max-payload-size": "--max-body-bytes",
    "--max-concurrent-requests": "--max-inflight",
    "--health-check-interval-secs": "--health-interval",
    "--health-check-timeout-secs": "--health-timeout",
    "--health-failure-threshold": "--health-threshold",
}

#: Their ``--policy``: the policy of every stage whose own policy flag is not given.
ALL_STAGES = "--policy"

#: Their mode switches: here the layout follows from the instances given, so they change
#: nothing (accepted, so that their command line runs as it is).
IGNORED: dict[str, str] = {
    "--pd-disaggregation": "the layout follows from the instances given (--prefill, --decode)",
    "--vllm-pd-disaggregation": "the layout follows from the instances given (--prefill, "
                                "--decode)",
}

#: Their flags with no same-meaning flag here, and what to use instead.
REFUSED: dict[str, str] = {
    "--api-key": "keys have no flag here (a flag shows in ps listings): set "
                 "EPD_UPSTREAM_API_KEY, the key sent to the instances",
    "--request-timeout-secs": "there is no whole-request timeout here: each stage has its own "
                              "(--encode-timeout, --prefill-timeout, --decode-timeout, "
                              "--stream-idle-timeout)",
    "--prometheus-port": "metrics are served on the proxy's own port, at /metrics",
    "--prometheus-host": "metrics are served on the proxy's own port, at /metrics",
    "--intra-node-data-parallel-size": "give each instance's DP size in its URL: "
                                       "http://host:port#dp=N",
    "--dp-aware": "DP ranks are always routed: give each instance's DP size in its URL "
                  "(#dp=N)",
    "--retry-max-retries": "failover is --max-attempts (encode, prefill) and --decode-retries",
    "--retry-initial-backoff-ms": "failover moves to another instance at once, without backoff",
    "--retry-max-backoff-ms": "failover moves to another instance at once, without backoff",
    "--retry-backoff-multiplier": "failover moves to another instance at once, without backoff",
    "--retry-jitter-factor": "failover moves to another instance at once, without backoff",
    "--disable-retries": "use --max-attempts 1 --decode-retries 0",
    "--cb-failure-threshold": "an instance leaves the rotation after --health-threshold "
                              "failures",
    "--cb-success-threshold": "one successful probe brings an instance back",
    "--cb-timeout-duration-secs": "an instance out of rotation is probed every "
                                  "--health-interval seconds",
    "--cb-window-duration-secs": "failures count while consecutive (--health-threshold)",
    "--disable-circuit-breaker": "instances leave the rotation by health (--health-threshold)",
    "--health-success-threshold": "one successful probe brings an instance back",
    "--health-check-endpoint": "instances are probed at /health, as vLLM serves it",
    "--worker-startup-timeout-secs": "instances are probed from the start; none is waited for",
    "--worker-startup-check-interval": "instances are probed every --health-interval seconds",
    "--eviction-interval": "cache_aware's index is bounded by --cache-size, evicted as it fills",
    "--eviction-interval-secs": "cache_aware's index is bounded by --cache-size, evicted as it "
                                "fills",
    "--max-tree-size": "cache_aware's index is bounded by --cache-size",
    "--vllm-discovery-address": "instances register over HTTP (POST /instances, EPD_ADMIN_KEY) "
                                "or, for MoRIIO, at --moriio-registration",
    "--log-dir": "every line goes to stderr (--log-format json for a shipper)",
    "--request-id-headers": "the request id is the client's x-request-id",
    "--cors-allowed-origins": "no CORS: the proxy serves API clients, not browsers",
    "--backend": "the instances are vLLM's OpenAI-compatible servers",
    "--enable-igw": "several models need no mode here: a pool per model, learned from every "
                    "instance's /v1/models or set in [models.NAME] tables (--models)",
    "--model-path": "requests are routed without a tokenizer (precise_cache_aware asks vLLM to "
                    "render them: --render-urls)",
    "--tokenizer-path": "requests are routed without a tokenizer (precise_cache_aware asks vLLM "
                        "to render them: --render-urls)",
    "--history-backend": "no conversation history is kept",
    "--profile": "profiling is POST /start_profile and /stop_profile, fanned out",
    "--api-key-validation-urls": "client keys are EPD_API_KEYS",
}
