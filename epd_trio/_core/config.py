"""Settings: parsed once at start-up from the environment (and optionally a TOML file).

Rules: parsing is pure (a mapping in, a frozen ``Settings`` out, or one ``ConfigError`` that names
the variable); the only I/O is ``load_settings`` reading the ``EPD_CONFIG`` file. Every timeout
has a finite default sized for real models (long prompts, long generations), because one hung
backend must never hold a request forever.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import orjson

from .discovery import DnsName, ip_address_of, is_dns_url, parse_dns_url, parse_selector
from .policies import DEFAULT_POLICY, ENCODE_POLICIES, POLICIES
from .routing import Instance, parse_instance
from .shared_state import DEAD_REPLICA_LIMIT, MAX_LOAD_INTERVAL
from .state_url import StateURL, parse_state_url
from .tenants import Tenant, parse_tenants
from .urls import check_base_url, check_host, echo, redact_url

ENV_PREFIX = "EPD_"


class ConfigError(ValueError):
    """A setting is missing or malformed; ``str()`` is the one line shown at start-up: one
    line whatever the value held, never a URL's user or password (``redact_url``), and cut
    at ``MAX_LINE`` characters (a value of megabytes must not become a line of megabytes)."""

    #: The longest line shown; the start names the setting and the problem.
    MAX_LINE = 300

    def __init__(self, variable: str, problem: str) -> None:
        line = redact_url(" ".join(f"{variable}: {problem}".splitlines()))
        super().__init__(line if len(line) <= self.MAX_LINE else line[:self.MAX_LINE] + "...")
        self.variable = variable


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Everything the proxy is configured with. Field ``x`` is ``EPD_X`` in the environment."""

    #: Encoder instances (empty: media goes straight to prefill/decode). Each is a URL, or a
    #: DNS name to expand (``dns+http://name:port``, ``dnssrv+http://_srv._tcp.name``).
    encode_urls: tuple[Instance | DnsName, ...] = ()
    #: Prefill instances (empty: decode does the whole request, the E+PD / PD layouts).
    prefill_urls: tuple[Instance | DnsName, ...] = ()
    #: Decode (or combined prefill-decode) instances. Required unless instances may register
    #: themselves (``admin_key`` set) or are discovered: then the proxy may start with none.
    decode_urls: tuple[Instance | DnsName, ...] = ()
    #: A pool per model (``[models."NAME"]`` tables in the config file, or the same tables as a
    #: JSON object): each names its instances by role (``encode``, ``prefill``, ``decode``, in
    #: the flags' URL syntax, parsed here) and may set its own routing settings and
    #: ``max_inflight`` (checked by ``_models/tables``). Empty: pools are learned from every
    #: instance's ``/v1/models``.
    models: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Model aliases (``[aliases."NAME"]`` tables, or JSON): ``targets`` (name -> weight) and
    #: ``hidden`` (checked by ``_models/tables``). A request for an alias goes to one target.
    model_aliases: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: LoRA adapters the proxy may load (``[adapters."NAME"]`` tables, or JSON): ``base`` (the
    #: model it adapts) and ``path`` (where the instances read it), checked by
    #: ``_models/tables``. Known by name even where no instance holds them yet.
    adapters: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Load a configured adapter (``adapters``) on an instance of each role that lacks one,
    #: on demand (``POST /v1/load_lora_adapter``; vLLM needs
    #: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``). Off: such a request gets a 503 naming the
    #: adapter and the role.
    lora_load: bool = False
    #: The header whose value keeps a client on one alias target (``x-session-id``): the same
    #: value always gets the same target, by a hash weighted like the targets. None: each
    #: request is picked on its own, in exact weighted turns.
    alias_sticky_header: str | None = None
    #: Seconds between two reads of every instance's ``GET /v1/models`` (what it serves); an
    #: instance is also asked as soon as it joins.
    models_interval: float = 10.0
    #: Max media items per encoder sub-request (0 = no cap, 1 = one item per sub-request).
    encoder_max_batch: int = 0
    #: How the encode stage picks an encoder per media item (``_core/policies.py``):
    #: ``round_robin`` (the global cursor), ``least_loaded``, ``power_of_two``, ``cache_aware``.
    encode_policy: str = DEFAULT_POLICY
    #: How the prefill stage picks an (instance, DP rank) slot (the same four policies).
    prefill_policy: str = DEFAULT_POLICY
    #: How the decode stage picks an (instance, DP rank) slot (the same four policies).
    decode_policy: str = DEFAULT_POLICY
    #: ``least_loaded`` and ``cache_aware`` on decode: among slots with equally many requests
    #: in flight, prefer the one with the fewest ``max_tokens`` in flight (a request without
    #: ``max_tokens`` counts 0). Only a tie-break: the count stays the signal (README).
    size_tiebreak: bool = True
    #: ``cache_aware``: the preferred slot gives way when its in-flight count exceeds the least
    #: loaded candidate's by more than this many requests (and by ``cache_balance_rel``).
    #: SGLang's 64 suits engines batching hundreds; 8 suits a ``--max-num-seqs`` of tens.
    cache_balance_abs: int = 8
    #: ``cache_aware``: ... and by more than this factor (SGLang's default, 1.5).
    cache_balance_rel: float = 1.5
    #: ``cache_aware``: the share of a prompt's first 4096 characters that must match a known
    #: prefix for its slot to be preferred (SGLang's ``--cache-threshold``, 0.3).
    cache_threshold: float = 0.3
    #: ``cache_aware``: keys remembered per stage and worker (512-character prompt blocks, or
    #: media uuids), least recently used first out; a few MiB at the default.
    cache_size: int = 65_536
    #: ``precise_cache_aware`` and the prefill bypass: where an instance that names no KV event
    #: endpoint of its own (its URL's ``#kv_events=``, its registration's
    #: ``kv_events_endpoint``) publishes vLLM's KV cache events: its own host at this port, DP
    #: rank r at port + r, as vLLM offsets it. 0: such instances publish nothing the proxy reads.
    kv_events_port: int = 0
    #: ... and its replay socket (vLLM's ``replay_endpoint``), offset alike, where the publisher
    #: comes from ``kv_events_port``; 0: none, so events lost are never asked again (the slot is
    #: rebuilt from new events instead).
    kv_events_replay_port: int = 0
    #: Seconds a replay socket may stay silent before its answer counts as lost. Until an
    #: engine's replay first answers (or a batch arrives live), the ask is repeated, each wait
    #: twice the last, up to a minute: a proxy started beside a busy engine still gets exact.
    kv_replay_timeout: float = 2.0
    #: Where ``precise_cache_aware`` renders a request into its token ids (vLLM's
    #: ``/v1/chat/completions/render``: ``vllm serve --enable-scale-out`` or ``vllm launch
    #: render``). Empty: on the instances of the stage being routed.
    render_urls: tuple[Instance, ...] = ()
    #: Seconds a render call may take; slower (or failed) renders route that request by
    #: ``cache_aware`` instead, never fail it.
    render_timeout: float = 0.5
    #: Skip the prefill leg when the chosen decode slot already holds all but at most this many
    #: of the prompt's tokens in its KV cache (vllm-router's ``pd_uncached_token_threshold``);
    #: decode is then chosen first. 0: off.
    pd_uncached_token_threshold: int = 0
    #: Blocks the KV index keeps per slot, oldest out first (about 100 bytes each).
    kv_index_blocks: int = 1_000_000
    #: The engines' KV cache block size in tokens (``vllm serve --block-size``): the index keys
    #: a prompt by its full blocks of this size, and skips events of another size.
    kv_block_size: int = 16
    #: Seconds between two scrapes of each instance's ``/metrics`` for its running and waiting
    #: requests (load other proxies and clients create); 0 = off, the proxy's own counts only.
    load_scrape_interval: float = 0.0
    #: Seconds to establish a TCP connection to an instance.
    connect_timeout: float = 10.0
    #: Seconds for the whole encoder stage of one request.
    encode_timeout: float = 300.0
    #: Seconds for a prefill call (long prompts on a loaded instance take minutes).
    prefill_timeout: float = 600.0
    #: Seconds until decode's first body bytes (a non-stream decode: until its whole body).
    decode_timeout: float = 600.0
    #: Seconds of silence allowed between two reads of a decode stream (the first included).
    stream_idle_timeout: float = 300.0
    #: Seconds a client may leave sent data unread before its request is released and (with
    #: ``epd-trio serve``) its connection cut: a stalled client must not pin a vLLM generation.
    client_write_timeout: float = 60.0
    #: Seconds a request may wait in the proxy for a free upstream place before it gets a 503.
    queue_timeout: float = 30.0
    #: Seconds an idle upstream connection is kept for reuse. It must stay below vLLM's own
    #: keep-alive (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s by default): a request written to a
    #: connection the server is closing fails unread. Unset, it is 4 s, or 80 % of
    #: ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` when that is set lower (operators set it once for the
    #: whole deployment).
    upstream_keepalive: float = 4.0
    #: Upstream requests in flight per (instance, DP rank) slot; more wait in the proxy's queue.
    #: Size it like vLLM's ``--max-num-seqs``: more connections than the engine batches only
    #: cost the proxy CPU (docs/discussion/performance.md).
    max_connections: int = 256
    #: Client requests in flight at once (streams included); more wait ``admission_timeout``
    #: for a place, then get a 503 with ``Retry-After``. It bounds the proxy's memory under a
    #: flood; sized for a large cluster.
    max_inflight: int = 10_000
    #: Seconds a request over ``max_inflight`` waits for a place (0: refused at once).
    admission_timeout: float = 1.0
    #: Largest client body accepted, in bytes (base64 media makes bodies big).
    max_body_bytes: int = 64 * 1024 * 1024
    #: Seconds a client has to send its whole body once its head is in; slower gets a 408.
    #: Hypercorn bounds the head (``--keep-alive``), nothing bounds the body, and a request
    #: holds its admission place while its body arrives: without this, clients trickling
    #: bodies would hold every place of ``max_inflight`` for ever.
    body_timeout: float = 60.0
    #: Seconds the requests in flight get to end when ``epd-trio serve`` is told to stop
    #: (SIGTERM); what still runs then is ended with a ``shutting_down`` error (a stream: as
    #: its last SSE event). New requests are refused from the start of the drain.
    shutdown_grace: float = 10.0
    #: Attempts per encoder sub-request and per prefill call (each on a different instance).
    max_attempts: int = 2
    #: Extra decode attempts (each re-runs prefill) when decode fails before its first byte.
    decode_retries: int = 1
    #: Seconds between two health probes of an instance.
    health_interval: float = 5.0
    #: Seconds a health probe may take.
    health_timeout: float = 2.0
    #: Consecutive failures (probes or live transport errors) that take an instance out; a
    #: live request's refused connection (nothing listens) takes it out at once.
    health_threshold: int = 3
    #: Seconds a registered instance that is out of rotation and has stopped registering is
    #: kept before it is forgotten (vLLM re-registers every 30 s: this is 10 missed rounds).
    instance_ttl: float = 300.0
    #: Seconds a ``/start_profile`` or ``/stop_profile`` call to one instance may take (stopping
    #: writes the traces out: minutes on a big model).
    profile_timeout: float = 1800.0
    #: The ``X-API-Key`` of the admin routes (``/instances``, profiling). None: registration is
    #: off (403) and profiling is open.
    admin_key: str | None = field(default=None, repr=False)
    #: Keys clients must send as ``Authorization: Bearer <key>`` on the OpenAI routes (empty: no
    #: client authentication).
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    #: Tenants (``_core/tenants.py``): ``[tenants.NAME]`` tables in the config file, or the same
    #: tables as a JSON object. Each names its keys (they join ``api_keys``), its priority
    #: band, its weight in the band and its own limits. None: one ``default`` tenant, no limit.
    tenants: tuple[Tenant, ...] = field(default=(), repr=False)
    #: The header naming a request's tenant when it presents no tenant's key (None: only
    #: keys name tenants).
    tenant_header: str | None = None
    #: Seconds of waiting that move a queued request up one priority step
    #: (``_core/fair_queue.py``; 0: strict bands, a lower one may starve).
    priority_aging: float = 0.5
    #: Places above ``max_inflight`` that only a band better than one in flight may take, so
    #: that the engines' priority scheduling holds it (``_admission/fair.py``; 0: none).
    priority_headroom: int = 0
    #: The key sent upstream as ``Authorization: Bearer <key>`` on every call to vLLM (its
    #: ``--api-key``), probes and profiling included.
    upstream_api_key: str | None = field(default=None, repr=False)
    #: Count requests for Prometheus and serve ``GET /metrics`` (off: no metrics, a 404 there).
    metrics: bool = True
    #: One structured INFO line per request (id, layout, instances, ranks, timings, outcome).
    request_log: bool = False
    #: Level of the proxy's own log (the ``epd_trio`` loggers).
    log_level: str = "INFO"
    #: ``text`` (one human-readable line per event) or ``json`` (one JSON object per line).
    log_format: str = "text"
    #: Allocations between two young-generation garbage collections in a serving process (0:
    #: Python's default, 700). Python's default made the collector about 10 % of the proxy's CPU
    #: (docs/discussion/performance.md); the proxy's garbage is short-lived, so collecting less often
    #: costs little memory.
    gc_threshold: int = 10_000
    #: How the KV cache moves from prefill to decode: ``generic`` (the NIXL-style
    #: ``kv_transfer_params`` hand-off) or ``moriio`` (vLLM's MoRIIO connector: instances
    #: register over ZMQ, the request id names both peers, READ or WRITE transfer mode).
    kv_connector: str = "generic"
    #: ``host:port`` of the ZMQ ROUTER socket MoRIIO instances register with (their
    #: ``proxy_ip``/``proxy_ping_port``; vLLM's toy proxy hard-codes port 36367).
    moriio_registration: str = "0.0.0.0:36367"
    #: Seconds a MoRIIO instance may stay silent (it re-registers every 3 s) before it leaves
    #: the rotation.
    moriio_ttl: float = 10.0
    #: Rewrite each media part the encoder reported metadata for into a metadata-only
    #: ``*_embeds`` reference on the consumer legs (the instance then neither receives the pixels
    #: nor re-runs the media processor); off: the raw media is sent (upstream's ``--no-rewrite``).
    ec_rewrite: bool = True
    #: ``host[:port]`` of the DNS server that expands ``dns+``/``dnssrv+`` URLs: an address, or
    #: a name resolved once when discovery starts (None: the system's resolver,
    #: ``/etc/resolv.conf``, search domains included).
    dns_nameserver: str | None = None
    #: Seconds between two resolutions of each DNS name.
    dns_interval: float = 5.0
    #: Seconds one resolution may take (its queries and their retries); past it, the round
    #: counts as a failure and the last answer stays.
    dns_timeout: float = 2.0
    #: Find instances by watching Kubernetes pods (with the ``*_selector`` settings), as
    #: vllm-router's ``--service-discovery``.
    service_discovery: bool = False
    #: Label selector of the encoder pods (``app=vllm-encode``; ``k=v`` terms, space or comma
    #: separated).
    encode_selector: str | None = None
    #: Label selector of the prefill pods (vllm-router's ``--prefill-selector``).
    prefill_selector: str | None = None
    #: Label selector of the decode (or combined) pods (vllm-router's ``--decode-selector``).
    decode_selector: str | None = None
    #: The port of a discovered pod's vLLM server (the ``epd-trio.io/port`` annotation wins).
    service_discovery_port: int = 8000
    #: The namespace watched (None: the service account's own namespace).
    service_discovery_namespace: str | None = None
    #: The API server's base URL, reached without credentials (a ``kubectl proxy`` URL). None:
    #: in-cluster (the service account), else a kubeconfig.
    service_discovery_api: str | None = None
    #: A kubeconfig file to reach the API server with (None: in a pod, the service account;
    #: outside one, the first file of ``KUBECONFIG``, else ``~/.kube/config``).
    service_discovery_kubeconfig: str | None = None
    #: The kubeconfig context to use (None: its ``current-context``); set, a kubeconfig is
    #: read also in a pod.
    service_discovery_context: str | None = None

    #: Where several proxy replicas share their roster, loads and cursors: a Redis server,
    #: ``redis://[:password@]host:port[/db]``, ``rediss://...`` (TLS) or ``unix:///path``
    #: (docs/how-to/replicas.md). Unset: each ``epd-trio serve`` process tree shares nothing
    #: beyond its own workers.
    state_url: StateURL | None = field(default=None, repr=False)
    #: Prefix of every Redis key and channel, so that several fleets can share one Redis.
    state_prefix: str = "epd:"
    #: This replica's name in the shared state and in ``GET /instances`` (unset: the host name
    #: and the process id). Worker k of ``epd-trio serve --workers N`` is ``<id>-w<k>``: every
    #: worker is a replica, and two processes under one id would hide each other's loads.
    replica_id: str | None = None
    #: Exact round-robin across replicas: one Redis increment per routing decision (needs
    #: ``state_url``). Off: each replica keeps its own cursors, seeded at a random offset.
    global_cursor: bool = False
    #: Seconds a routing decision waits for the global cursor before it falls back to the
    #: replica's own cursor (counted in ``epd_trio_global_cursor_fallbacks_total``).
    global_cursor_timeout: float = 0.05
    #: Seconds an admission waits for the tenants' shared buckets (one script) before it
    #: decides on this replica's share of the limit (counted in
    #: ``epd_trio_state_local_limits_total``). Short: it is on the request's path.
    state_limits_timeout: float = 0.1
    #: Seconds between two full reads of the shared roster (pub/sub is the fast path; this
    #: catches what a disconnect lost, and TTL expiries).
    state_resync_interval: float = 2.0
    #: Seconds between two publications of this replica's in-flight counts (and reads of the
    #: others'); a replica's counts expire 12 intervals after its last one (3 s at 0.25), 5 s
    #: at most, so a dead replica stops counting within 5 s. At most 1 s.
    state_load_interval: float = 0.25
    #: Seconds any one call to the state store may take (none of them is on a request's path,
    #: except the opt-in global cursor, which has its own timeout).
    state_timeout: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.state_url, str):  # Settings(state_url="redis://...") from Python
            object.__setattr__(self, "state_url", _parse("state_url", self.state_url,
                                                         env_name("state_url")))
        selectors = {role: getattr(self, f"{role}_selector") for role in ("encode", "prefill",
                                                                          "decode")}
        if self.service_discovery and not any(selectors.values()):
            raise ConfigError(env_name("service_discovery"), "needs at least one label selector ("
                              f"{env_name('decode_selector')}, ...)")
        if not self.service_discovery and any(selectors.values()):
            given = next(role for role, sel in selectors.items() if sel)
            raise ConfigError(env_name(f"{given}_selector"), "is used only with "
                              f"{env_name('service_discovery')}=true")
        for name in ("service_discovery_kubeconfig", "service_discovery_context"):
            if getattr(self, name) is not None and not self.service_discovery:
                raise ConfigError(env_name(name), "is used only with "
                                  f"{env_name('service_discovery')}=true")
            if getattr(self, name) is not None and self.service_discovery_api is not None:
                raise ConfigError(env_name(name), f"and {env_name('service_discovery_api')} "
                                  "both say how to reach the API server: set one")
        if (not self.decode_urls and not self.admin_key and self.kv_connector != "moriio"
                and self.state_url is None and not self.decode_selector
                and not self.table_urls("decode")):
            raise ConfigError(env_name("decode_urls"), "is required (at least one decode URL), "
                              f"unless instances register themselves ({env_name('admin_key')}, "
                              f"{env_name('kv_connector')}=moriio, or a shared roster in "
                              f"{env_name('state_url')}), are discovered "
                              f"({env_name('decode_selector')}) or named in a model table "
                              f"({env_name('models')})")
        if self.state_load_interval > MAX_LOAD_INTERVAL:
            raise ConfigError(env_name("state_load_interval"), f"at most {MAX_LOAD_INTERVAL:g} s: "
                              f"a dead replica's counts stop counting within "
                              f"{DEAD_REPLICA_LIMIT:g} s, and a live one's must outlive several "
                              f"publications; got {self.state_load_interval:g}")
        if self.global_cursor and self.state_url is None:
            raise ConfigError(env_name("global_cursor"), f"needs {env_name('state_url')}: the "
                              "global cursor lives in the shared state store")

    @property
    def layout(self) -> str:
        """The configured EPD layout: ``E+P+D``, ``E+PD``, ``P+D``, ``PD``, or ``none`` (no
        decode instance configured: everything registers)."""
        def has(role: str) -> bool:
            return bool(self.urls(role) or getattr(self, f"{role}_selector"))

        if not has("decode"):
            return "none"
        serving = "P+D" if has("prefill") else "PD"
        return f"E+{serving}" if has("encode") else serving

    def table_urls(self, role: str) -> tuple[Instance | DnsName, ...]:
        """The URLs of ``role`` the model tables name, each once, in table order."""
        found: dict[str, Instance | DnsName] = {}
        for table in self.models.values():
            for item in table.get(role, ()):
                found.setdefault(_spec_of(item), item)
        return tuple(found.values())

    def urls(self, role: str) -> tuple[Instance | DnsName, ...]:
        """Every URL of ``role``: the top-level list's, then the model tables' (each once)."""
        if role not in ("encode", "prefill", "decode"):
            return ()  # ``render``: a list of its own, no table names one
        listed = getattr(self, f"{role}_urls")
        known = {_spec_of(item) for item in listed}
        return (*listed, *(item for item in self.table_urls(role)
                           if _spec_of(item) not in known))

    def listed(self, role: str) -> tuple[Instance, ...]:
        """The instances of ``role`` (``encode``, ``prefill``, ``decode``, ``render``) given by
        URL, the model tables' included."""
        items = self.urls(role) if role != "render" else self.render_urls
        return tuple(i for i in items if isinstance(i, Instance))

    def dns_names(self) -> list[tuple[str, DnsName]]:
        """Every ``(role, DNS name)`` to expand, the model tables' included."""
        return [(role, name) for role in ("encode", "prefill", "decode")
                for name in self.urls(role) if isinstance(name, DnsName)]

    def selectors(self) -> list[tuple[str, str]]:
        """Every ``(role, label selector)`` to watch (with ``service_discovery``)."""
        if not self.service_discovery:
            return []
        return [(role, selector) for role in ("encode", "prefill", "decode")
                if (selector := getattr(self, f"{role}_selector"))]


#: vLLM's server keep-alive, read so the proxy's idle upstream connections expire before it.
VLLM_KEEPALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _spec_of(item: Instance | DnsName) -> str:
    return item.url if isinstance(item, Instance) else item.spec


#: The roles a model table names instances for.
TABLE_ROLES = ("encode", "prefill", "decode")


def _tables(raw: Any) -> dict[str, dict[str, Any]]:
    """Tables by name (a config file's ``[x."NAME"]``, or the same as a JSON object): their
    shape only; what each key means is checked by the room that reads them (``_models``)."""
    if isinstance(raw, str):
        try:
            raw = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"expected a JSON object of tables: {exc}") from None
    if not isinstance(raw, Mapping):  # a ValueError: settings_from makes it a ConfigError
        raise ValueError("expected tables, one per name ({\"name\": {...}})")  # noqa: TRY004
    out = {}
    for name, table in raw.items():
        if not isinstance(name, str) or not name.strip() or len(name) > 256:
            raise ValueError(f"a table's name must be a non-empty string: {echo(name)}")
        if not isinstance(table, Mapping):
            raise ValueError(f"{name!r}: expected a table, got {type(table).__name__}")  # noqa: TRY004
        out[name] = dict(table)
    return out


def _model_tables(raw: Any) -> dict[str, dict[str, Any]]:
    """The model tables, their instance lists parsed (the flags' URL syntax)."""
    tables = _tables(raw)
    for name, table in tables.items():
        for role in TABLE_ROLES:
            if role in table:
                try:
                    table[role] = _instances(table[role])
                except ValueError as exc:
                    raise ValueError(f"{name!r}.{role}: {exc}") from None
    return tables


def _instances(raw: Any) -> tuple[Instance | DnsName, ...]:
    items = raw if isinstance(raw, list | tuple) else [raw]
    if not all(isinstance(item, str) for item in items):
        raise ValueError("expected URLs (a comma-separated string or a list of strings)")
    # Commas or whitespace, as the flags take them (``--decode http://a:1 http://b:2``): a URL
    # never holds either, so a list written like the flag must not become one bad URL.
    items = [part for item in items for part in re.split(r"[\s,]+", item)]
    parsed = tuple(parse_dns_url(item) if is_dns_url(item) else parse_instance(item)
                   for item in items if item.strip())
    urls = [inst.url if isinstance(inst, Instance) else inst.spec for inst in parsed]
    duplicates = sorted({url for url in urls if urls.count(url) > 1})
    if duplicates:
        raise ValueError(f"URL listed twice: {', '.join(duplicates)}")
    return parsed


def _plain_instances(raw: Any) -> tuple[Instance, ...]:
    """URLs of instances named one by one (no DNS name to expand)."""
    parsed = _instances(raw)
    if any(not isinstance(item, Instance) for item in parsed):
        raise ValueError("expected http:// or https:// URLs (DNS names are not expanded here)")
    return parsed  # type: ignore[return-value]


def _non_negative_int(raw: Any) -> int:
    value = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
    if value is None and isinstance(raw, str) and raw.strip().isdigit():
        value = int(raw.strip())
    if value is None or value < 0:
        raise ValueError(f"expected a non-negative integer, got {raw!r}")
    return value


def _positive_int(raw: Any) -> int:
    value = _non_negative_int(raw)
    if value == 0:
        raise ValueError("expected a positive integer, got 0")
    return value


def _secret(raw: Any) -> str:
    """A key: printable ASCII without spaces (it travels in an HTTP header)."""
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError("expected a non-empty key")
    value = raw.strip()
    if not (value.isascii() and value.isprintable()) or any(c.isspace() for c in value):
        raise ValueError("a key must be printable ASCII without spaces")
    return value


def _secrets(raw: Any) -> tuple[str, ...]:
    items = raw if isinstance(raw, list | tuple) else [raw]
    if not all(isinstance(item, str) for item in items):
        raise ValueError("expected keys (a comma-separated string or a list of strings)")
    keys = tuple(_secret(part) for item in items for part in item.split(",") if part.strip())
    if not keys:
        raise ValueError("expected at least one key")
    return keys
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    value = str(raw).strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(f"expected true or false, got {raw!r}")


def _choice(options: tuple[str, ...], *, upper: bool = False) -> Callable[[Any], str]:
    def parse(raw: Any) -> str:
        value = str(raw).strip()
        value = value.upper() if upper else value.lower()
        if value not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {raw!r}")
        return value
    return parse


#: Settings whose value is one of a few words (shown by ``epd-trio serve --help``).
SETTING_CHOICES: dict[str, tuple[str, ...]] = {
    "log_level": ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    "log_format": ("text", "json"),
    "kv_connector": ("generic", "moriio"),
    "encode_policy": ENCODE_POLICIES,
    "prefill_policy": POLICIES,
    "decode_policy": POLICIES,
}


def _seconds(raw: Any, *, zero_ok: bool = False) -> float:
    try:
        value = float(raw) if not isinstance(raw, bool) else math.nan
    except (TypeError, ValueError):
        value = math.nan
    if not (0 <= value < math.inf) or (value == 0 and not zero_ok):
        kind = "non-negative" if zero_ok else "positive"
        raise ValueError(f"expected a {kind}, finite number of seconds, got {raw!r}")
    return value


def _non_negative_seconds(raw: Any) -> float:
    return _seconds(raw, zero_ok=True)


def _bind_address(raw: Any) -> str:
    """``host:port`` to bind a socket on (port 0: any free port, for tests; peers need a fixed one)."""
    value = str(raw).strip()
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected host:port with a port in 0..65535, got {echo(raw)}")
    if host != "*":
        check_host(host, value)
    return value


def _state_url(raw: Any) -> StateURL:
    if isinstance(raw, StateURL):
        return raw
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError("expected a redis://, rediss:// or unix:// URL")
    return parse_state_url(raw)


def _key_prefix(raw: Any) -> str:
    """A Redis key prefix or replica id: printable ASCII, no spaces (they appear in keys)."""
    value = str(raw).strip()
    if not value or not (value.isascii() and value.isprintable()) or " " in value:
        raise ValueError(f"expected printable ASCII without spaces, got {raw!r}")
    return value


def _number(raw: Any, low: float, high: float) -> float:
    try:
        value = float(raw) if not isinstance(raw, bool) else math.nan
    except (TypeError, ValueError):
        value = math.nan
    if not low <= value <= high:
        raise ValueError(f"expected a number from {low:g} to {high:g}, got {raw!r}")
    return value


def _fraction(raw: Any) -> float:
    return _number(raw, 0.0, 1.0)


def _factor(raw: Any) -> float:
    return _number(raw, 1.0, 1e6)


def _nameserver(raw: Any) -> str:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``: a DNS server's address, or a host
    name (resolved once when discovery starts)."""
    value = str(raw).strip()
    host, port = split_host_port(value, 53)
    if ip_address_of(host) is None and not _HOST_NAME.fullmatch(host):
        raise ValueError(f"expected an IP address or a host name, with an optional :port, "
                         f"got {echo(raw)}")
    if not 0 < port < 65536:
        raise ValueError(f"expected a port in 1..65535, got {echo(raw)}")
    return value


_HOST_NAME = re.compile(r"(?=.{1,253}\.?$)([A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?\.)*"
                        r"[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?\.?")


def split_host_port(value: str, default_port: int) -> tuple[str, int]:
    """``host[:port]`` (IPv6 in brackets when a port follows) -> ``(host, port)``."""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest.removeprefix(":")
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
    else:
        host, port = value, ""
    if port and not (port.isascii() and port.isdigit()):
        raise ValueError(f"bad port in {echo(value)}")
    return host, int(port) if port else default_port


def _selector(raw: Any) -> str:
    items = raw if isinstance(raw, list | tuple) else [raw]
    return parse_selector(" ".join(str(item) for item in items))


def _port(raw: Any) -> int:
    value = _positive_int(raw)
    if value > 65535:
        raise ValueError(f"expected a port in 1..65535, got {raw!r}")
    return value


def _optional_port(raw: Any) -> int:
    value = _non_negative_int(raw)
    if value > 65535:
        raise ValueError(f"expected a port in 1..65535 (0: none), got {raw!r}")
    return value


def _name(raw: Any) -> str:
    value = str(raw).strip()
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", value) or len(value) > 63:
        raise ValueError(f"expected a Kubernetes namespace name, got {raw!r}")
    return value


def _text(raw: Any) -> str:
    value = str(raw).strip()
    if not value:
        raise ValueError("expected a non-empty value")
    return value


def _header_name(raw: Any) -> str:
    """An HTTP header's name (a token), lowercased as ASGI delivers it."""
    value = str(raw).strip().lower()
    if not re.fullmatch(r"[a-z0-9!#$%&'*+.^_`|~-]+", value):
        raise ValueError(f"expected an HTTP header name, got {raw!r}")
    return value


def _api_url(raw: Any) -> str:
    return check_base_url(raw.strip() if isinstance(raw, str) else raw,
                          what="the API server's URL")


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "encode_urls": _instances,
    "prefill_urls": _instances,
    "decode_urls": _instances,
    "models": _model_tables,
    "model_aliases": _tables,
    "adapters": _tables,
    "lora_load": _bool,
    "alias_sticky_header": _header_name,
    "models_interval": _seconds,
    "encoder_max_batch": _non_negative_int,
    "encode_policy": _choice(ENCODE_POLICIES),
    "prefill_policy": _choice(POLICIES),
    "decode_policy": _choice(POLICIES),
    "size_tiebreak": _bool,
    "cache_balance_abs": _non_negative_int,
    "cache_balance_rel": _factor,
    "cache_threshold": _fraction,
    "cache_size": _positive_int,
    "kv_events_port": _optional_port,
    "kv_events_replay_port": _optional_port,
    "kv_replay_timeout": _seconds,
    "render_urls": _plain_instances,
    "render_timeout": _seconds,
    "pd_uncached_token_threshold": _non_negative_int,
    "kv_index_blocks": _positive_int,
    "kv_block_size": _positive_int,
    "load_scrape_interval": _non_negative_seconds,
    "connect_timeout": _seconds,
    "encode_timeout": _seconds,
    "prefill_timeout": _seconds,
    "decode_timeout": _seconds,
    "stream_idle_timeout": _seconds,
    "client_write_timeout": _seconds,
    "queue_timeout": _seconds,
    "upstream_keepalive": _seconds,
    "max_connections": _positive_int,
    "max_inflight": _positive_int,
    "admission_timeout": _non_negative_seconds,
    "max_body_bytes": _positive_int,
    "body_timeout": _seconds,
    "shutdown_grace": _non_negative_seconds,
    "max_attempts": _positive_int,
    "decode_retries": _non_negative_int,
    "health_interval": _seconds,
    "health_timeout": _seconds,
    "health_threshold": _positive_int,
    "instance_ttl": _seconds,
    "profile_timeout": _seconds,
    "admin_key": _secret,
    "api_keys": _secrets,
    "tenants": parse_tenants,
    "tenant_header": _header_name,
    "priority_aging": _non_negative_seconds,
    "priority_headroom": _non_negative_int,
    "upstream_api_key": _secret,
    "metrics": _bool,
    "request_log": _bool,
    "log_level": _choice(SETTING_CHOICES["log_level"], upper=True),
    "log_format": _choice(SETTING_CHOICES["log_format"]),
    "gc_threshold": _non_negative_int,
    "kv_connector": _choice(SETTING_CHOICES["kv_connector"]),
    "moriio_registration": _bind_address,
    "moriio_ttl": _seconds,
    "ec_rewrite": _bool,
    "dns_nameserver": _nameserver,
    "dns_interval": _seconds,
    "dns_timeout": _seconds,
    "service_discovery": _bool,
    "encode_selector": _selector,
    "prefill_selector": _selector,
    "decode_selector": _selector,
    "service_discovery_port": _port,
    "service_discovery_namespace": _name,
    "service_discovery_api": _api_url,
    "service_discovery_kubeconfig": _text,
    "service_discovery_context": _text,
    "state_url": _state_url,
    "state_prefix": _key_prefix,
    "replica_id": _key_prefix,
    "global_cursor": _bool,
    "global_cursor_timeout": _seconds,
    "state_limits_timeout": _seconds,
    "state_resync_interval": _seconds,
    "state_load_interval": _seconds,
    "state_timeout": _seconds,
}
assert set(_PARSERS) == {f.name for f in fields(Settings)}


#: Prefixes of ``EPD_*`` variables that belong to the project's tools, not to the proxy (the
#: benchmark, the real-vLLM test harness, ``shared/vllm-cpu``): never reported as unknown.
FOREIGN_ENV_PREFIXES = ("EPD_BENCH_", "EPD_E2E_", "EPD_VLLM_")


def unknown_settings(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """The ``EPD_*`` variables that name no setting, each with the closest known name (or None).

    Why: an unknown variable is ignored, so a typo (``EPD_PREFIL_URLS``) or a setting this
    version does not have (``EPD_RATE_LIMIT``) would start the proxy as if nothing had been
    said. vLLM warns about unknown ``VLLM_*`` variables the same way.
    """
    known = {env_name(name) for name in _PARSERS} | {ENV_PREFIX + "CONFIG"}
    found = []
    for name in sorted(environ):
        if (name.startswith(ENV_PREFIX) and name not in known
                and not name.startswith(FOREIGN_ENV_PREFIXES)):
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.85)
            found.append((name, close[0] if close else None))
    return found


#: The URL lists whose flag is the role's name (``--decode``); other lists keep theirs whole.
ROLE_URL_FIELDS = frozenset({"encode_urls", "prefill_urls", "decode_urls"})


def flag_name(field: str) -> str:
    """The command-line flag of a setting (``--decode`` for the URL lists, else ``--field``)."""
    if field in ROLE_URL_FIELDS:
        return "--" + field.removesuffix("_urls")
    return "--" + field.replace("_", "-")


SETTING_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Settings))
#: Keys: set through the environment or the config file only. A command-line flag would put
#: them in every ``ps`` listing and shell history.
SECRET_FIELDS = frozenset({"admin_key", "api_keys", "upstream_api_key", "tenants"})
FLAG_FIELDS: tuple[str, ...] = tuple(f for f in SETTING_FIELDS if f not in SECRET_FIELDS)
SETTING_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(Settings)}


#: Config-file tables read under a shorter name than their setting (``[aliases."chat"]``).
FILE_TABLE_NAMES = {"aliases": "model_aliases"}


def settings_from(
    environ: Mapping[str, str],
    file_values: Mapping[str, Any] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    """Build ``Settings`` from command-line flags, the environment and a config file.

    Priority: a flag (``flags`` maps field names to raw values; ``None`` = not given) wins over
    an environment variable, which wins over the file. The file uses the field names
    (``decode_urls = ["http://d0:8000#dp=2"]``). Unknown file keys are an error (a typo must not
    be silently ignored); unknown ``EPD_`` variables are left alone (other tools share the prefix).
    """
    values: dict[str, Any] = {}
    for key, raw in (file_values or {}).items():
        key = FILE_TABLE_NAMES.get(key, key)
        if key not in _PARSERS:
            raise ConfigError(f"config file key {key!r}", "unknown setting")
        values[key] = _parse(key, raw, f"{key} (config file)")
    for key in _PARSERS:
        name = env_name(key)
        if name in environ and environ[name].strip():
            values[key] = _parse(key, environ[name], name)
    for key, raw in (flags or {}).items():
        if raw is not None:
            values[key] = _parse(key, raw, flag_name(key))
    if "upstream_keepalive" not in values and environ.get(VLLM_KEEPALIVE_ENV, "").strip():
        vllm_keepalive = _parse("upstream_keepalive", environ[VLLM_KEEPALIVE_ENV],
                                VLLM_KEEPALIVE_ENV)
        values["upstream_keepalive"] = min(SETTING_DEFAULTS["upstream_keepalive"],
                                           0.8 * vllm_keepalive)
    try:
        return Settings(**values)
    except ConfigError as exc:
        if flags is not None and exc.variable == env_name("decode_urls"):
            raise ConfigError(f"{flag_name('decode_urls')} / {exc.variable}",
                              str(exc).split(": ", 1)[1]) from None
        raise


def parse_setting(key: str, raw: Any, where: str) -> Any:
    """One setting's value parsed as ``settings_from`` parses it (a model table's own routing
    settings reuse it); ``ConfigError`` names ``where``."""
    return _parse(key, raw, where)


def _parse(key: str, raw: Any, where: str) -> Any:
    try:
        return _PARSERS[key](raw)
    except ValueError as exc:
        raise ConfigError(where, str(exc)) from None
