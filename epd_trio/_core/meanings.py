"""What each setting means, in one line, and the unit of its number: the one source of both.

``epd-trio serve --help`` prints these lines; ``docs/reference/settings.md`` opens each row's
meaning with the same words and goes on with the details and links (``tests/test_docs.py``
holds the page to that, and to naming the unit of every numeric setting). Why a table of its
own: a help line that only said ``EPD_X (default Y)`` told an operator nothing, and two
independently written descriptions drift apart.

``unit`` is what a number counts (``seconds``, ``bytes``, ``requests``...), and must be a word of
the line; ``metavar`` is what the flag takes, when more telling than its unit (``URL``,
``PATH``, ``HOST:PORT``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MEANINGS", "SERVE_OPTIONS", "Meaning"]


@dataclass(frozen=True, slots=True)
class Meaning:
    """One setting's line: its meaning, the unit of its number, the flag's metavar."""

    text: str
    unit: str | None = None
    metavar: str | None = None

    @property
    def shown_metavar(self) -> str | None:
        """The flag's metavar: the explicit one, else the unit's (``SECONDS``, ``N``)."""
        if self.metavar is not None:
            return self.metavar
        if self.unit == "seconds":
            return "SECONDS"
        if self.unit == "bytes":
            return "BYTES"
        if self.unit == "factor":
            return "FACTOR"
        if self.unit == "share":
            return "SHARE"
        if self.unit == "port":
            return "PORT"
        return "N" if self.unit is not None else None


_URLS = "URL[#dp=N]"

MEANINGS: dict[str, Meaning] = {
    "encode_urls": Meaning("encoder instances", metavar=_URLS),
    "prefill_urls": Meaning("prefill instances", metavar=_URLS),
    "decode_urls": Meaning("decode (or combined prefill-decode) instances", metavar=_URLS),
    "models": Meaning("a pool per model, as [models.NAME] tables in the config file or the "
                      "same tables as a JSON object here", metavar="JSON"),
    "model_aliases": Meaning("model aliases with weighted targets, as [aliases.NAME] tables in "
                             "the config file or the same tables as a JSON object here",
                             metavar="JSON"),
    "adapters": Meaning("LoRA adapters the proxy may load on demand, as [adapters.NAME] tables "
                        "in the config file or the same tables as a JSON object here",
                        metavar="JSON"),
    "lora_load": Meaning("load a configured adapter on demand on an instance of each role that "
                         "lacks one"),
    "alias_sticky_header": Meaning("the request header whose value keeps a client on one alias "
                                   "target", metavar="HEADER"),
    "models_interval": Meaning("seconds between two reads of every instance's /v1/models",
                               "seconds"),
    "encoder_max_batch": Meaning("max media items per encoder sub-request", "items"),
    "encode_policy": Meaning("how each media item's encoder is chosen"),
    "prefill_policy": Meaning("how the prefill (instance, DP rank) slot is chosen"),
    "decode_policy": Meaning("how the decode slot is chosen"),
    "size_tiebreak": Meaning("decode least_loaded and cache_aware: among slots with equally many "
                             "requests in flight, prefer the one with the fewest max_tokens in "
                             "flight"),
    "cache_balance_abs": Meaning("cache_aware: the preferred slot gives way when its in-flight "
                                 "requests exceed the least loaded candidate's by more than this "
                                 "many", "requests"),
    "cache_balance_rel": Meaning("cache_aware: ... and by more than this factor", "factor"),
    "cache_threshold": Meaning("cache_aware prefill/decode: the matched share (0 to 1) of a "
                               "prompt's first 4096 characters above which its prefix's slot is "
                               "preferred", "share"),
    "cache_size": Meaning("cache_aware: keys remembered per stage and worker process", "keys"),
    "kv_events_port": Meaning("precise_cache_aware and the prefill bypass: the port where an instance "
                              "publishes vLLM's KV cache events", "port"),
    "kv_events_replay_port": Meaning("... and the port of its replay socket (vLLM's "
                                     "replay_endpoint), offset alike", "port"),
    "kv_replay_timeout": Meaning("seconds a replay socket may stay silent before its answer "
                                 "counts as lost", "seconds"),
    "render_urls": Meaning("where precise_cache_aware renders a request into token ids",
                           metavar="URL"),
    "render_timeout": Meaning("seconds a render call may take", "seconds"),
    "pd_uncached_token_threshold": Meaning("skip the prefill leg when the chosen decode slot "
                                           "holds all but at most this many of the prompt's "
                                           "tokens in its KV cache", "tokens"),
    "kv_index_blocks": Meaning("blocks the KV index keeps per slot, oldest out first", "blocks"),
    "kv_block_size": Meaning("the engines' KV cache block size in tokens", "tokens"),
    "load_scrape_interval": Meaning("seconds between two scrapes of every instance's /metrics",
                                    "seconds"),
    "connect_timeout": Meaning("seconds: TCP connect to an instance", "seconds"),
    "encode_timeout": Meaning("seconds: one encoder sub-request, whole", "seconds"),
    "prefill_timeout": Meaning("seconds: the prefill call, whole", "seconds"),
    "decode_timeout": Meaning("seconds: decode until its first body bytes", "seconds"),
    "stream_idle_timeout": Meaning("seconds of silence allowed between two reads of a decode "
                                   "stream", "seconds"),
    "client_write_timeout": Meaning("seconds: a client that leaves sent data unread this long "
                                    "loses its request", "seconds"),
    "queue_timeout": Meaning("seconds a request may wait for a free upstream place", "seconds"),
    "upstream_keepalive": Meaning("seconds an idle upstream connection is kept for reuse",
                                  "seconds"),
    "max_connections": Meaning("upstream requests in flight per (instance, DP rank) slot",
                               "requests"),
    "max_inflight": Meaning("client requests in flight at once, streams included", "requests"),
    "tenants": Meaning("tenants, as [tenants.NAME] tables in the config file or the same "
                       "tables as a JSON object here"),
    "tenant_header": Meaning("the request header that names a tenant without keys when the "
                             "request presents no tenant's key", metavar="HEADER"),
    "priority_aging": Meaning("seconds of waiting in the admission queue that move a request up "
                              "one priority step", "seconds"),
    "priority_headroom": Meaning("places above EPD_MAX_INFLIGHT that only a request of a better "
                                 "priority band than one in flight may take", "places"),
    "shutdown_grace": Meaning("seconds the requests in flight get to end when epd-trio serve is "
                              "told to stop", "seconds"),
    "admission_timeout": Meaning("seconds a request over EPD_MAX_INFLIGHT waits for a place",
                                 "seconds"),
    "max_body_bytes": Meaning("largest client body in bytes", "bytes"),
    "body_timeout": Meaning("seconds a client has to send its whole body once its head is in",
                            "seconds"),
    "max_attempts": Meaning("attempts per encoder sub-request and per prefill call, each on a "
                            "different instance", "attempts"),
    "decode_retries": Meaning("extra decode attempts (on another decode slot, prefill re-run) "
                              "when decode fails before its first byte", "attempts"),
    "health_interval": Meaning("seconds between two /health probes of each instance",
                               "seconds"),
    "health_timeout": Meaning("seconds: one probe", "seconds"),
    "health_threshold": Meaning("consecutive failures (probes, or transport errors of live "
                                "requests) that take an instance out of rotation", "failures"),
    "instance_ttl": Meaning("seconds: a registered instance that is out of rotation "
                            "(failing its probes) and has not registered again for this long "
                            "is forgotten", "seconds"),
    "profile_timeout": Meaning("seconds: one /start_profile or /stop_profile call to an "
                               "instance", "seconds"),
    "admin_key": Meaning("the X-API-Key of the admin routes"),
    "api_keys": Meaning("client keys for the OpenAI routes"),
    "upstream_api_key": Meaning("sent as Authorization: Bearer <key> on every call to vLLM"),
    "metrics": Meaning("count for Prometheus and serve GET /metrics"),
    "request_log": Meaning("one structured INFO line per request"),
    "log_level": Meaning("level of the proxy's own log"),
    "log_format": Meaning("text (one readable line per event) or json (one JSON object per "
                          "line)"),
    "gc_threshold": Meaning("allocations between two young-generation garbage collections in a "
                            "serving process", "allocations"),
    "kv_connector": Meaning("how the KV cache moves from prefill to decode"),
    "moriio_registration": Meaning("host:port of the ZMQ ROUTER socket MoRIIO instances "
                                   "register with", metavar="HOST:PORT"),
    "moriio_ttl": Meaning("seconds a MoRIIO instance may stay silent", "seconds"),
    "ec_rewrite": Meaning("rewrite each media part the encoder reported metadata for into a "
                          "metadata-only *_embeds reference"),
    "dns_nameserver": Meaning("host[:port] of the DNS server that expands dns+/dnssrv+ URLs",
                              metavar="HOST[:PORT]"),
    "dns_interval": Meaning("seconds between two resolutions of each DNS name", "seconds"),
    "dns_timeout": Meaning("seconds one resolution may take", "seconds"),
    "service_discovery": Meaning("find instances by watching Kubernetes pods"),
    "encode_selector": Meaning("label selector of the encoder pods", metavar="KEY=VALUE"),
    "prefill_selector": Meaning("label selector of the prefill pods", metavar="KEY=VALUE"),
    "decode_selector": Meaning("label selector of the decode (or combined) pods",
                               metavar="KEY=VALUE"),
    "service_discovery_port": Meaning("the port of a discovered pod's vLLM server", "port"),
    "service_discovery_namespace": Meaning("the namespace watched", metavar="NAMESPACE"),
    "service_discovery_api": Meaning("the API server's base URL, reached without credentials",
                                     metavar="URL"),
    "service_discovery_kubeconfig": Meaning("a kubeconfig file to reach the API server with",
                                            metavar="PATH"),
    "service_discovery_context": Meaning("the kubeconfig context to use", metavar="NAME"),
    "state_url": Meaning("the Redis server several proxy replicas share their roster, loads "
                         "and (opt-in) cursor through", metavar="URL"),
    "state_prefix": Meaning("prefix of every key and channel in the store", metavar="PREFIX"),
    "replica_id": Meaning("this replica's name in the store and in GET /instances",
                          metavar="ID"),
    "global_cursor": Meaning("exact round-robin across replicas"),
    "global_cursor_timeout": Meaning("seconds a routing decision waits for the global cursor "
                                     "before it uses the replica's own", "seconds"),
    "state_limits_timeout": Meaning("seconds an admission waits for the tenants' shared "
                                    "buckets before it uses the replica's share", "seconds"),
    "state_resync_interval": Meaning("seconds between two full reads of the shared roster",
                                     "seconds"),
    "state_load_interval": Meaning("seconds between two publications of this replica's "
                                   "in-flight counts", "seconds"),
    "state_timeout": Meaning("seconds any one call to the store may take", "seconds"),
}

#: The serving options of ``epd-trio serve`` (no environment variable: they configure the
#: server, not the proxy), keyed by flag; the settings page's second table opens alike.
SERVE_OPTIONS: dict[str, Meaning] = {
    "--host": Meaning("address to listen on", metavar="HOST"),
    "--port": Meaning("port to listen on", "port"),
    "--workers": Meaning("worker processes, or auto: one per CPU of the cgroup's CPU limit "
                         "(a container's), rounded down, 1 without a limit", "processes",
                         metavar="N|auto"),
    "--backlog": Meaning("connections waiting to be accepted, the listen backlog",
                         "connections"),
    "--keep-alive": Meaning("idle seconds before a client's keep-alive connection is closed",
                            "seconds"),
    "--access-log": Meaning("one line per request on the proxy's log stream"),
    "--config": Meaning("a TOML file with the settings", metavar="PATH"),
}
