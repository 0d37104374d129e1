"""The discovery sources a proxy runs, from its settings (DNS names, Kubernetes selectors).

Each source has ``run(task_status=...)``: it finds its instances once, reports started, then
follows them until cancelled, handing each whole answer to ``apply(source, role, instances)``
(``Membership.discovered``). The membership starts them in the proxy's background nursery, in
the one process of ``epd-trio serve --workers N`` that runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import trio

from .._core.config import ConfigError, Settings, env_name
from .dns import Apply, DnsDiscovery, check_nameserver
from .k8s import KubernetesDiscovery
from .kube_api import kube_api


class Source(Protocol):
    async def run(self, task_status: trio.TaskStatus[Any] = ...) -> None: ...


def discovery_sources(
    settings: Settings, apply: Apply, *, registered: Callable[[], Sequence[tuple[str, str]]],
    apply_registered: Apply,
) -> list[Source]:
    """The sources ``settings`` ask for. DNS runs also when instances may register (an admin
    key): a registration may name a DNS name (``registered``, ``apply_registered``)."""
    sources: list[Source] = []
    if settings.dns_names() or settings.admin_key:
        sources.append(DnsDiscovery(settings.dns_names(), apply,
                                    nameserver=settings.dns_nameserver,
                                    interval=settings.dns_interval,
                                    timeout=settings.dns_timeout, registered=registered,
                                    apply_registered=apply_registered))
    if settings.selectors():
        sources.append(KubernetesDiscovery(
            settings.selectors(), apply, api=kube_api(settings),
            port=settings.service_discovery_port))
    return sources


def check_discovery(settings: Settings) -> None:
    """What discovery needs from outside, checked before any worker starts: how Kubernetes
    discovery reaches the API server (no pod and no kubeconfig, a refused kubeconfig such as an
    exec plugin, an unreadable CA) and a DNS server given by a name that does not resolve are
    a ``ConfigError`` naming the setting at fault (``epd-trio serve`` shows it in one line and
    exits 2, as for any other setting). Each process that discovers checks again when it
    starts (there, an ``OSError``)."""
    if settings.selectors():
        try:
            kube_api(settings).connect()
        except OSError as exc:
            raise ConfigError(_kube_setting(settings), str(exc)) from None
    if settings.dns_names() or settings.admin_key:
        check_nameserver(settings.dns_nameserver)


def _kube_setting(settings: Settings) -> str:
    """The setting a failure to reach the API server is blamed on: the kubeconfig or the
    context it names when given, else the switch that asked for Kubernetes discovery."""
    for field in ("service_discovery_kubeconfig", "service_discovery_context"):
        if getattr(settings, field):
            return env_name(field)
    return env_name("service_discovery")
