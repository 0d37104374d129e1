"""Instances found rather than listed: DNS names to expand, Kubernetes pods to watch (pure).

A plain P/D fleet scaled by an autoscaler registers nowhere, so the proxy has to find it. Two
sources, each run by its own loop in the shell (``_discovery/dns.py``, ``_discovery/k8s.py``);
what they *decide* is here, with no I/O and no clock, so the rules are tested with plain asserts:

- **DNS.** ``dns+http://name:port#dp=N`` (and ``dns+https://``) expands to one instance per A
  and AAAA record of ``name``; ``dnssrv+http://_service._proto.name#dp=N`` to one instance per
  SRV target and port, at each of the target's addresses. The prefixes are Thanos' and
  Cortex's (``dns+``, ``dnssrv+``), so an operator may know them already. Every round's answers
  go through ``next_view``: records replace the view; a query that failed (timeout, SERVFAIL,
  refused) keeps what it last answered, so a resolver that stops answering never empties the
  roster; only an authoritative empty answer (NXDOMAIN, or the name without records) empties
  it, and only once it has been confirmed ``EMPTY_CONFIRMATIONS`` more times in a row.
- **Kubernetes.** A pod is an instance while ``pod_endpoint`` says so (``Running``, ``Ready``,
  no ``deletionTimestamp``, an IP); its DP size and encoder-cache addresses come from the
  annotations named below. ``PodView`` folds a list and then the watch's events into the set of
  pods seen; ``watch_event`` reads one line of a watch stream.

Either way the result is a list of ``Discovered`` instances that replaces the source's members
in the roster (``_core/roster.replace_source``), which keeps the rotation where it stands.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import orjson

from .routing import MAX_DP_SIZE, Instance, split_dp_suffix
from .urls import check_base_url, echo

#: The URL prefixes that name a DNS name to expand: scheme -> (instance scheme, SRV form).
DNS_PREFIXES = {"dns+http": ("http", False), "dns+https": ("https", False),
                "dnssrv+http": ("http", True), "dnssrv+https": ("https", True)}
#: An authoritative empty answer empties the view once confirmed this many more times in a row
#: (so three rounds: a name briefly missing during a Service's re-creation is not a scale-down).
EMPTY_CONFIRMATIONS = 2


@dataclass(frozen=True, slots=True)
class Discovered:
    """One instance a discovery source found: its URL and sizes, as a registration would say."""

    instance: Instance
    ec_zmq_addrs: tuple[str, ...] = ()


# -- DNS names -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DnsName:
    """A ``dns+``/``dnssrv+`` URL: a name the proxy resolves, again and again, into instances."""

    #: As configured, ``#dp=N`` included: the name of the source in the roster and the logs.
    spec: str
    #: ``http`` or ``https``: the instances' scheme.
    scheme: str
    #: The name queried (the SRV name for the SRV form).
    host: str
    #: The instances' port (None for the SRV form: each record gives its own).
    port: int | None
    #: The instances' base path ("" for none).
    path: str = ""
    dp_size: int = 1
    srv: bool = False

    def instance(self, address: str, port: int) -> Instance:
        """The instance at ``address`` (an IP) and ``port``."""
        host = f"[{address}]" if ":" in address else address
        return Instance(f"{self.scheme}://{host}:{port}{self.path}", self.dp_size)


def ip_address_of(host: str) -> str | None:
    """``host`` as an IP address (in its canonical spelling), or None when it is a name to
    resolve: the one test of "is this an address" for DNS URLs, ``EPD_DNS_NAMESERVER`` and
    the resolver's configuration."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def is_dns_url(spec: str) -> bool:
    return spec.strip().lower().startswith(tuple(f"{prefix}://" for prefix in DNS_PREFIXES))


def parse_dns_url(spec: str) -> DnsName:
    """Parse a ``dns+``/``dnssrv+`` URL; ``ValueError`` says what is wrong."""
    written = spec.strip()
    url, dp_size = split_dp_suffix(written)
    prefix, _, rest = url.partition("://")
    prefix = prefix.lower()
    if prefix not in DNS_PREFIXES:
        raise ValueError(f"a DNS URL starts with {', '.join(p + '://' for p in DNS_PREFIXES)}: "
                         f"{spec!r}")
    scheme, srv = DNS_PREFIXES[prefix]
    check_base_url(f"{scheme}://{rest}")  # the checks of every instance URL, port and all
    parts = urlsplit(f"{scheme}://{rest}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"bad port in {spec!r}") from None
    host = parts.hostname
    if not host or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"a DNS URL is {prefix}://name{'' if srv else ':port'}[/path][#dp=N], "
                         f"with no query, user or other '#': {spec!r}")
    if ip_address_of(host) is not None:
        raise ValueError(f"{spec!r} names an address, not a name to resolve: write it as "
                         f"{scheme}://...")
    if srv and port is not None:
        raise ValueError(f"an SRV name gives its own ports: drop ':{port}' from {spec!r}")
    if not srv and port is None:
        port = 443 if scheme == "https" else 80
    if dp_size < 1:
        raise ValueError(f"bad '#dp=' suffix in {spec!r}: expected a positive integer")
    path = parts.path.rstrip("/")
    return DnsName(written, scheme, host.rstrip(".").lower(), port, path, dp_size, srv)


# -- DNS answers -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Found:
    """The query answered with records: addresses (A/AAAA), or ``(target, port)`` pairs (SRV)."""

    values: frozenset[Any]


@dataclass(frozen=True, slots=True)
class Empty:
    """An authoritative empty answer: the name does not exist (NXDOMAIN) or has no such record."""

    reason: str


@dataclass(frozen=True, slots=True)
class Failed:
    """No usable answer: a timeout, SERVFAIL, a refusal, no route to the resolver."""

    reason: str


Answer = Found | Empty | Failed
#: One query: ``(name, record type)``, the type being ``A``, ``AAAA`` or ``SRV``.
Query = tuple[str, str]
ADDRESS_TYPES = ("A", "AAAA")


@dataclass(frozen=True, slots=True)
class DnsView:
    """What one name has expanded to, and what the rules need to remember between rounds."""

    #: ``(address, port)`` of every instance the name gives now.
    endpoints: frozenset[tuple[str, int]] = frozenset()
    #: Consecutive rounds with an authoritative empty answer.
    empty_rounds: int = 0
    #: The last records each address query answered (a failed query falls back on them).
    last: Mapping[Query, frozenset[Any]] = field(default_factory=dict)
    #: Why the last round did not update the view (None when it did).
    problem: str | None = None


def address_queries(name: DnsName, srv_answer: Answer | None = None) -> list[Query]:
    """The address queries of a round: the name's own, or (SRV form) each target's from the
    round's SRV answer (none when it failed: the round then keeps the view)."""
    if not name.srv:
        return [(name.host, t) for t in ADDRESS_TYPES]
    targets = {target for target, _port in srv_answer.values} if isinstance(srv_answer, Found) else set()
    return [(target, t) for target in sorted(targets) for t in ADDRESS_TYPES]


#: Where the system names hosts before it asks DNS (``hosts: files dns`` in nsswitch.conf).
HOSTS_FILE = "/etc/hosts"


def hosts_file_answers(text: str, host: str) -> dict[Query, Answer]:
    """The A and AAAA answers a hosts file gives ``host``, or nothing when it does not name it.

    Why: dnspython asks DNS servers only, so ``dns+http://localhost:8000`` (or a name that
    Docker's ``extra_hosts`` put in ``/etc/hosts``) failed every round although every other
    program on the machine resolves it. As glibc does with ``files`` before ``dns``, a name
    the file lists is answered from the file alone; a family it does not list is empty."""
    wanted = host.rstrip(".").lower()
    found: dict[str, set[str]] = {"A": set(), "AAAA": set()}
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        # A scoped address (fe80::1%eth0) makes no URL: such a line names nothing here.
        address = ip_address_of(fields[0]) if len(fields) > 1 and "%" not in fields[0] else None
        if address is not None and wanted in (n.rstrip(".").lower() for n in fields[1:]):
            found["AAAA" if ":" in address else "A"].add(address)
    if not any(found.values()):
        return {}
    return {(host, rdtype): Found(frozenset(addresses)) if addresses
            else Empty(f"{host}: the hosts file lists no {rdtype} address")
            for rdtype, addresses in found.items()}


def next_view(
    name: DnsName, view: DnsView, answers: Mapping[Query, Answer],
    confirmations: int = EMPTY_CONFIRMATIONS,
) -> DnsView:
    """The view after one round of answers (``answers`` holds every query of the round: the
    SRV query first for the SRV form, then ``address_queries``).

    Records replace the view. A failed query keeps what it answered last; a round where nothing
    answered keeps the whole view. An authoritative empty answer empties the view once seen
    ``confirmations + 1`` rounds in a row.
    """
    last = dict(view.last)
    for query, answer in answers.items():
        if query[1] in ADDRESS_TYPES:
            if isinstance(answer, Found):
                last[query] = answer.values
            elif isinstance(answer, Empty):
                last.pop(query, None)
    if name.srv:
        srv = answers.get((name.host, "SRV"), Failed("not asked"))
        result = _srv_endpoints(srv, answers, view.last) if isinstance(srv, Found) else srv
    else:
        assert name.port is not None
        addresses = _addresses(name.host, answers, view.last)
        result = (Found(frozenset((a, name.port) for a in addresses.values))
                  if isinstance(addresses, Found) else addresses)
    failures = "; ".join(a.reason for a in answers.values() if isinstance(a, Failed)) or None
    if isinstance(result, Found):  # failed queries (if any) answered with their last records
        return DnsView(frozenset(result.values), 0, last, failures)
    if isinstance(result, Empty):
        rounds = view.empty_rounds + 1
        emptied = rounds > confirmations
        return DnsView(frozenset() if emptied else view.endpoints, rounds, last,
                       None if emptied else f"{result.reason} (unconfirmed, round {rounds})")
    return replace(view, last=last, problem=result.reason)


def _addresses(host: str, answers: Mapping[Query, Answer],
               last: Mapping[Query, frozenset[Any]]) -> Answer:
    """A host's addresses from its A and AAAA answers: a failed family keeps its last records."""
    found: set[str] = set()
    any_found, failures = False, []
    for rdtype in ADDRESS_TYPES:
        answer = answers.get((host, rdtype), Failed("not asked"))
        if isinstance(answer, Found):
            any_found = True
            found |= answer.values
        elif isinstance(answer, Failed):
            failures.append(f"{rdtype} {host}: {answer.reason}")
            found |= last.get((host, rdtype), frozenset())
    if any_found or found:
        return Found(frozenset(found))
    if failures:
        return Failed("; ".join(failures))
    return Empty(f"{host} has no A or AAAA record")


def _srv_endpoints(srv: Found, answers: Mapping[Query, Answer],
                   last: Mapping[Query, frozenset[Any]]) -> Answer:
    endpoints: set[tuple[str, int]] = set()
    failures: list[str] = []
    for target, port in sorted(srv.values):
        addresses = _addresses(target, answers, last)
        if isinstance(addresses, Found):
            endpoints |= {(address, port) for address in addresses.values}
        elif isinstance(addresses, Failed):
            failures.append(addresses.reason)
    if endpoints:
        return Found(frozenset(endpoints))
    if failures:
        return Failed("; ".join(failures))
    return Empty("no SRV target has an address")


def dns_instances(name: DnsName, view: DnsView) -> list[Discovered]:
    """The view's instances, in a stable order (by address, then port)."""
    ordered = sorted(view.endpoints, key=lambda e: (ipaddress.ip_address(e[0]).packed, e[1]))
    return [Discovered(name.instance(address, port)) for address, port in ordered]


# -- Kubernetes pods ------------------------------------------------------------------------------
#: The annotations a vLLM pod may carry (the docs name them).
DP_SIZE_ANNOTATION = "epd-trio.io/dp-size"
PORT_ANNOTATION = "epd-trio.io/port"
EC_ZMQ_ADDRS_ANNOTATION = "epd-trio.io/ec-zmq-addrs"
SCHEME_ANNOTATION = "epd-trio.io/scheme"

_SELECTOR_TERM = re.compile(r"^!?[A-Za-z0-9][-A-Za-z0-9_./]*((==?|!=)[-A-Za-z0-9_.]*)?$")


def parse_selector(raw: str) -> str:
    """A label selector as the API takes it: vllm-router writes ``app=x role=y`` (space
    separated), Kubernetes ``app=x,role=y``; both are accepted. Equality terms only
    (``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``): set terms (``k in (a,b)``) are refused."""
    terms = [term for term in re.split(r"[\s,]+", raw.strip()) if term]
    if not terms:
        raise ValueError("expected a label selector such as app=vllm-decode")
    for term in terms:
        if not _SELECTOR_TERM.match(term):
            raise ValueError(f"bad label selector term {term!r}: expected key=value, key!=value, "
                             "key or !key")
    return ",".join(terms)


def pod_endpoint(
    pod: Mapping[str, Any], port: int, role: str
) -> Discovered | str:
    """The instance a pod is, or why it is none now (a reason for the debug log).

    A pod is an instance when its phase is ``Running``, its ``Ready`` condition is ``True``, it
    has no ``deletionTimestamp`` (it is terminating: vLLM drains, new requests must go
    elsewhere) and it has an IP. Annotations: ``epd-trio.io/dp-size`` (its DP size, default 1),
    ``epd-trio.io/port`` (instead of the configured port), ``epd-trio.io/scheme`` (``https``),
    ``epd-trio.io/ec-zmq-addrs`` (comma-separated encoder-cache addresses, one per DP rank,
    prefill-side roles only).
    """
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = metadata.get("name", "?")
    if metadata.get("deletionTimestamp"):
        return f"pod {name} is terminating"
    if status.get("phase") != "Running":
        return f"pod {name} is {status.get('phase') or 'without a phase'}"
    conditions = status.get("conditions") or []
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
        return f"pod {name} is not Ready"
    ip = status.get("podIP")
    if not ip:
        return f"pod {name} has no IP yet"
    annotations = metadata.get("annotations") or {}
    try:
        return _annotated(annotations, ip, port, role)
    except ValueError as exc:
        return f"pod {name} skipped: {exc}"


def _annotated(annotations: Mapping[str, str], ip: str, port: int, role: str) -> Discovered:
    dp_size = _annotated_int(annotations, DP_SIZE_ANNOTATION, 1, 1, MAX_DP_SIZE)
    port = _annotated_int(annotations, PORT_ANNOTATION, port, 1, 65535)
    scheme = annotations.get(SCHEME_ANNOTATION, "http").strip().lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"{SCHEME_ANNOTATION} must be http or https, got {scheme!r}")
    addrs = tuple(a.strip() for a in annotations.get(EC_ZMQ_ADDRS_ANNOTATION, "").split(",")
                  if a.strip())
    if addrs and role not in ("prefill", "prefill_decode"):
        raise ValueError(f"{EC_ZMQ_ADDRS_ANNOTATION} is for encoder-cache consumers "
                         "(prefill) only")
    if addrs and len(addrs) != dp_size:
        raise ValueError(f"{EC_ZMQ_ADDRS_ANNOTATION} needs one address per DP rank: "
                         f"{len(addrs)} for dp-size {dp_size}")
    host = f"[{ip}]" if ":" in ip else ip
    return Discovered(Instance(f"{scheme}://{host}:{port}", dp_size), addrs)


def _annotated_int(annotations: Mapping[str, str], key: str, default: int, low: int,
                   high: int) -> int:
    raw = annotations.get(key)
    if raw is None:
        return default
    value = raw.strip()
    if not (value.isascii() and value.isdigit()) or not low <= int(value) <= high:
        raise ValueError(f"{key} must be an integer from {low} to {high}, got {echo(raw)}")
    return int(value)


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One line of a watch stream."""

    #: ``ADDED``, ``MODIFIED``, ``DELETED``, ``BOOKMARK`` or ``ERROR``.
    type: str
    object: Mapping[str, Any]

    @property
    def resource_version(self) -> str | None:
        return (self.object.get("metadata") or {}).get("resourceVersion")

    @property
    def expired(self) -> bool:
        """An ``ERROR`` whose status is 410 Gone: the version watched from is too old, the
        client must list again."""
        return self.type == "ERROR" and self.object.get("code") == 410


class WatchProtocolError(ValueError):
    """A watch line that is not a watch event (the shell reconnects)."""


def watch_event(line: bytes) -> WatchEvent:
    """Parse one watch line (``{"type": ..., "object": {...}}``)."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError:
        raise WatchProtocolError(f"a watch line that is not JSON: {line[:80]!r}") from None
    if (not isinstance(data, dict) or not isinstance(data.get("type"), str)
            or not isinstance(data.get("object"), dict)):
        raise WatchProtocolError(f"a watch line without type and object: {line[:80]!r}")
    return WatchEvent(data["type"], data["object"])


def _pod_key(pod: Mapping[str, Any]) -> str:
    metadata = pod.get("metadata") or {}
    return str(metadata.get("uid") or f"{metadata.get('namespace')}/{metadata.get('name')}")


@dataclass(frozen=True, slots=True)
class PodView:
    """The pods of one selector as last listed and watched, and where to watch from."""

    pods: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    resource_version: str | None = None

    @classmethod
    def listed(cls, pod_list: Mapping[str, Any]) -> PodView:
        """The view a list answer (``PodList``) gives; its ``resourceVersion`` is where the
        watch starts."""
        items = pod_list.get("items") or []
        return cls({_pod_key(p): p for p in items},
                   (pod_list.get("metadata") or {}).get("resourceVersion"))

    def merged(self, page: Mapping[str, Any]) -> PodView:
        """Add a further page of a chunked list (``continue``); its version is the list's."""
        more = PodView.listed(page)
        return PodView({**self.pods, **more.pods}, more.resource_version)

    def apply(self, event: WatchEvent) -> PodView:
        """The view after one watch event (``ERROR`` is the shell's to handle)."""
        version = event.resource_version or self.resource_version
        if event.type == "BOOKMARK":
            return PodView(self.pods, version)
        key = _pod_key(event.object)
        pods = dict(self.pods)
        if event.type == "DELETED":
            pods.pop(key, None)
        elif event.type in ("ADDED", "MODIFIED"):
            pods[key] = event.object
        else:
            return self
        return PodView(pods, version)

    def instances(self, port: int, role: str) -> tuple[list[Discovered], list[str]]:
        """The pods that are instances now (ordered by URL), and why the others are not."""
        found: dict[str, Discovered] = {}
        reasons = []
        for pod in self.pods.values():
            endpoint = pod_endpoint(pod, port, role)
            if isinstance(endpoint, str):
                reasons.append(endpoint)
            else:
                found.setdefault(endpoint.instance.url, endpoint)
        return [found[url] for url in sorted(found)], sorted(reasons)


def backoff(attempt: int, jitter: float, *, base: float = 0.5, cap: float = 30.0) -> float:
    """Seconds before reconnect number ``attempt`` (1, 2, ...): doubling from ``base`` up to
    ``cap``, scaled by ``jitter`` in [0.5, 1] so that replicas restarted together spread out."""
    return min(cap, base * 2 ** max(0, attempt - 1)) * min(1.0, max(0.5, jitter))

