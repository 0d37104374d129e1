"""DNS discovery: each ``dns+``/``dnssrv+`` name re-resolved every ``EPD_DNS_INTERVAL``, on trio.

One task per name, in one nursery owned by the proxy's background work. A round asks the
queries (A and AAAA of the name, or its SRV record and then each target's A and AAAA), turns
every reply into an ``Answer`` (records, an authoritative empty answer, or a failure) and hands
them to ``_core/discovery.next_view``, which decides; the view's instances then replace the
name's members in the roster (``apply``: ``_core/roster.replace_source`` behind the proxy's
roster store). The rules (a failure keeps the last view; an empty answer empties it once
confirmed) are the core's.

Why dnspython: a maintained resolver with an asynchronous API that runs on trio itself (its
trio ``asyncbackend``, named on every query: no thread, no asyncio), with the system's
``/etc/resolv.conf`` (search domains and ``ndots``, as ``vllm-decode.ns.svc`` needs inside
Kubernetes) or a given server and port. No cache: every round asks the server, so a record
that vanished is seen at the next round, not after its TTL. dnspython reads no hosts file, so
each round reads ``/etc/hosts`` first, as the system's resolver does (``hosts: files dns``): a
name it lists (``localhost``) is answered from it alone (``hosts_file_answers``).

Failure: a resolver that cannot be configured (no ``/etc/resolv.conf``, an
``EPD_DNS_NAMESERVER`` name that does not resolve) fails start-up with an ``OSError``;
everything after start-up is logged and retried at the next round.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence

import dns.asyncbackend
import dns.asyncresolver
import dns.exception
import dns.resolver
import trio

from .._core.config import ConfigError, env_name, split_host_port
from .._core.discovery import (
    HOSTS_FILE,
    Answer,
    Discovered,
    DnsName,
    DnsView,
    Empty,
    Failed,
    Found,
    Query,
    address_queries,
    dns_instances,
    hosts_file_answers,
    ip_address_of,
    next_view,
    parse_dns_url,
)

log = logging.getLogger("epd_trio.discovery")

#: ``apply(source, role, instances) -> (joined URLs, left URLs)``.
Apply = Callable[[str, str, Sequence[Discovered]], tuple[list[str], list[str]]]


async def make_resolver(nameserver: str | None, query_timeout: float) -> dns.asyncresolver.Resolver:
    """The system's resolver, or one asking only ``nameserver`` (``host[:port]``; a host name
    is resolved here, once, through the system's resolver: ``nameserver_addresses``)."""
    if nameserver is None:
        return system_resolver(query_timeout)
    host, port = split_host_port(nameserver, 53)
    resolver = dns.asyncresolver.Resolver(configure=False)
    try:
        resolver.nameservers = await trio.to_thread.run_sync(
            nameserver_addresses, host, port, abandon_on_cancel=True)
    except OSError as exc:
        raise OSError(f"DNS discovery: {env_name('dns_nameserver')} {exc}") from None
    resolver.port = port
    return _tuned(resolver, query_timeout)


def system_resolver(query_timeout: float) -> dns.asyncresolver.Resolver:
    """The resolver of ``/etc/resolv.conf``; ``OSError`` when there is none. Synchronous: it
    reads a local file and asks no server."""
    try:
        resolver = dns.asyncresolver.Resolver()
    except dns.resolver.NoResolverConfiguration as exc:
        raise OSError(f"DNS discovery: no system resolver configured ({exc}); set "
                      "EPD_DNS_NAMESERVER") from None
    return _tuned(resolver, query_timeout)


def _tuned(resolver: dns.asyncresolver.Resolver,
           query_timeout: float) -> dns.asyncresolver.Resolver:
    resolver.timeout = query_timeout
    resolver.lifetime = query_timeout
    resolver.cache = None
    return resolver


def nameserver_addresses(host: str, port: int) -> list[str]:
    """The addresses of the DNS server ``host``: itself when it is one, else what the system's
    resolver answers for the name now (every address, in its order; a server that moves is
    seen at the next start); ``OSError`` when it does not resolve. Blocking: ``epd-trio
    serve`` checks it before any worker (``check_nameserver``), ``make_resolver`` runs it in
    a thread."""
    address = ip_address_of(host)
    if address is not None:
        return [address]
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise OSError(_unresolved(host, exc)) from None
    return list(dict.fromkeys(str(info[4][0]) for info in found))


def check_nameserver(nameserver: str | None) -> None:
    """``nameserver_addresses``, for ``epd-trio serve`` before any worker starts: a name that
    does not resolve is a ``ConfigError`` naming ``EPD_DNS_NAMESERVER``."""
    if nameserver is not None:
        try:
            nameserver_addresses(*split_host_port(nameserver, 53))
        except OSError as exc:
            raise ConfigError(env_name("dns_nameserver"), str(exc)) from None


def _unresolved(host: str, exc: Exception) -> str:
    return f"{host} does not resolve ({exc}); name the DNS server by its address"


def trio_backend() -> dns.asyncbackend.Backend:
    """dnspython's trio backend, given to every query: without it dnspython picks a backend by
    sniffing the running library, and a wrong guess would only show as failed rounds (which
    keep the last view: silent). Raises if dnspython cannot run on trio."""
    return dns.asyncbackend.get_backend("trio")


async def ask(resolver: dns.asyncresolver.Resolver, query: Query, *, search: bool) -> Answer:
    """One query as an ``Answer``, on trio's backend; never raises for a DNS outcome."""
    qname, rdtype = query
    try:
        reply = await resolver.resolve(qname if search else qname + ".", rdtype, search=search,
                                       backend=trio_backend())
    except dns.resolver.NXDOMAIN:
        return Empty(f"{qname}: no such name (NXDOMAIN)")
    except dns.resolver.NoAnswer:
        return Empty(f"{qname}: no {rdtype} record")
    except dns.resolver.LifetimeTimeout:
        return Failed(f"{rdtype} {qname}: no answer within {resolver.lifetime:g} s")
    except dns.resolver.NoNameservers as exc:
        return Failed(f"{rdtype} {qname}: every server failed ({exc})")
    except (dns.exception.DNSException, OSError) as exc:
        return Failed(f"{rdtype} {qname}: {type(exc).__name__}: {exc}")
    if rdtype == "SRV":
        records = [(r.target.to_text(omit_final_dot=True).lower(), r.port)
                   for r in reply if r.target.to_text() != "."]
        for target, port in records:
            if not 1 <= port <= 65535:  # port 0 is legal DNS, but no instance's port
                log.warning("SRV %s: record %s port %d skipped: not a port from 1 to 65535",
                            qname, target, port)
        return Found(frozenset((t, p) for t, p in records if 1 <= p <= 65535))
    return Found(frozenset(r.address for r in reply))


class DnsDiscovery:
    """The DNS names of the settings, and those registered since, each resolved in its own
    task until cancelled.

    ``run`` resolves every configured name once before it reports started, so a proxy serves
    with its discovered instances from its first request (a name whose first round fails starts
    empty and is retried every interval). Then, every interval, it follows the names registered
    through ``POST /instances`` (``registered()``: the roster's ``names``): a new one gets its
    task, an unregistered one's task is cancelled (the roster change already took its
    instances away). ``apply_registered`` applies a registered name's answer only while the
    name is still registered, so a round finishing after a ``DELETE`` brings nothing back.
    """

    def __init__(
        self, names: Sequence[tuple[str, DnsName]], apply: Apply, *,
        nameserver: str | None, interval: float, timeout: float,
        registered: Callable[[], Sequence[tuple[str, str]]] = tuple,
        apply_registered: Apply | None = None, hosts_file: str | None = HOSTS_FILE,
    ) -> None:
        self._names = list(names)
        #: Read at every round, before DNS is asked (``hosts_file_answers``); None: never.
        self._hosts_file = hosts_file
        self._apply = apply
        self._registered = registered
        self._apply_registered = apply_registered or apply
        self._resolver: dns.asyncresolver.Resolver | None = None
        self._nameserver = nameserver
        self._interval = interval
        self._timeout = timeout
        #: The current view of each name (by its spec), for ``GET /instances`` and the tests.
        self.views: dict[str, DnsView] = {name.spec: DnsView() for _role, name in self._names}
        #: Rounds completed, all names together.
        self.rounds = 0
        self._round_done = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, re-checked after every round and every name that
        stopped being resolved (tests sync on it)."""
        while not predicate():
            await self._round_done.wait()

    def resolver(self) -> dns.asyncresolver.Resolver:
        """The one resolver of every name, kept. One asking ``EPD_DNS_NAMESERVER`` is made by
        ``run`` before it reports started (a server given by name is resolved there, once, and
        no name's task can race to resolve it too). The system's is made at the first name (a
        proxy that only might get names registered needs no ``/etc/resolv.conf`` until one
        is), synchronously: no checkpoint between the test and the set, so two names arriving
        at once share it."""
        if self._resolver is None:
            assert self._nameserver is None, "run() makes the resolver of a named server"
            self._resolver = system_resolver(self._timeout)
        return self._resolver

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self._names or self._nameserver is not None:
            # No resolver (configuration): start-up fails, naming why.
            self._resolver = await make_resolver(self._nameserver, self._timeout)
        if self._names:
            log.info("DNS discovery of %s through %s, every %g s",
                     ", ".join(name.spec for _role, name in self._names),
                     self._nameserver or "the system resolver", self._interval)
            async with trio.open_nursery() as first:
                for role, name in self._names:
                    first.start_soon(self._round, role, name, self._apply)
        task_status.started()
        configured = {(role, name.spec) for role, name in self._names}
        running: dict[tuple[str, str], trio.CancelScope] = {}
        async with trio.open_nursery() as nursery:
            for role, name in self._names:
                nursery.start_soon(self._loop, trio.CancelScope(), role, name, self._apply, False)
            while True:
                wanted = {key for key in self._registered() if key not in configured}
                for role, spec in wanted - running.keys():
                    name = parse_dns_url(spec)
                    log.info("DNS name %s registered as %s: resolving it every %g s", spec,
                                role, self._interval)
                    self.views[spec] = DnsView()
                    running[(role, spec)] = scope = trio.CancelScope()
                    nursery.start_soon(self._loop, scope, role, name, self._apply_registered,
                                       True)
                for key in running.keys() - wanted:
                    running.pop(key).cancel()
                    self.views.pop(key[1], None)
                    log.info("DNS name %s unregistered", key[1])
                    self._signal()
                await trio.sleep(self._interval)

    async def _loop(self, scope: trio.CancelScope, role: str, name: DnsName, apply: Apply,
                    now: bool) -> None:
        with scope:
            if now:
                await self._round(role, name, apply)
            while True:
                await trio.sleep(self._interval)
                await self._round(role, name, apply)

    async def _round(self, role: str, name: DnsName, apply: Apply) -> None:
        """One round for ``name``. Never raises (but Cancelled): a name that cannot be resolved
        or applied is logged and tried again at the next round, its last view kept."""
        try:
            await self._resolve(role, name, apply)
        except Exception as exc:
            log.warning("DNS %s: round failed (%s: %s); keeping its last answer", name.spec,
                        type(exc).__name__, exc)
        self.rounds += 1
        self._signal()

    async def _resolve(self, role: str, name: DnsName, apply: Apply) -> None:
        resolver = self.resolver()
        view = self.views[name.spec]
        answers: dict[Query, Answer] = {}
        srv = None
        if name.srv:
            srv = answers[(name.host, "SRV")] = await ask(resolver, (name.host, "SRV"),
                                                          search=True)
        queries = address_queries(name, srv)
        results: list[Answer | None] = [None] * len(queries)
        hosts = await self._read_hosts()

        async def one(index: int, query: Query) -> None:
            local = hosts_file_answers(hosts, query[0]).get(query)
            # SRV targets are absolute names: no search domains for them.
            results[index] = local if local is not None else await ask(
                resolver, query, search=not name.srv)

        async with trio.open_nursery() as nursery:
            for index, query in enumerate(queries):
                nursery.start_soon(one, index, query)
        answers.update((q, a) for q, a in zip(queries, results, strict=True) if a is not None)
        new = next_view(name, view, answers)
        self._report(name, view, new)
        self.views[name.spec] = new
        joined, left = apply(name.spec, role, dns_instances(name, new))
        for url in joined:
            log.info("%s instance %s joined (DNS %s)", role, url, name.spec)
        for url in left:
            log.info("%s instance %s left (DNS %s no longer lists it)", role, url, name.spec)

    async def _read_hosts(self) -> str:
        """The hosts file now (a missing or unreadable one names nothing)."""
        if self._hosts_file is None:
            return ""
        try:
            return await trio.Path(self._hosts_file).read_text(errors="replace")
        except OSError:
            return ""

    def _signal(self) -> None:
        self._round_done.set()
        self._round_done = trio.Event()

    def _report(self, name: DnsName, old: DnsView, new: DnsView) -> None:
        if new.problem and new.problem != old.problem:
            log.warning("DNS %s: %s; keeping its last answer (%d instances)", name.spec,
                        new.problem, len(new.endpoints))
        elif old.problem and not new.problem:
            log.info("DNS %s answers again (%d instances)", name.spec, len(new.endpoints))
