"""How Kubernetes discovery reaches the API server: in-cluster, a kubeconfig, or a given URL.

Chosen once, when discovery starts (``KubeApi.connect``), in this order:

1. ``EPD_SERVICE_DISCOVERY_API``: that URL, no credentials (``kubectl proxy``, the tests' fake);
2. ``EPD_SERVICE_DISCOVERY_KUBECONFIG`` (or ``EPD_SERVICE_DISCOVERY_CONTEXT``): a kubeconfig;
3. in a pod (``KUBERNETES_SERVICE_HOST``/``_PORT`` set): the service account's token (re-read
   at every connection: the kubelet rotates it), CA and namespace;
4. outside a pod: the kubeconfig ``KUBECONFIG`` names (its first file), else ``~/.kube/config``.

The kubeconfig's rules are pure (``_core/kubeconfig``); this module reads the files. A kubeconfig
in JSON (``kubectl config view --raw --flatten -o json``) needs nothing more; one in YAML needs
PyYAML (the ``kubeconfig`` extra), imported only then: the proxy in a pod, the common case,
has no use for it.

Failure: anything missing, unreadable or refused is an ``OSError`` at start-up whose message
names the file, the context and the part at fault.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from .._core.config import Settings
from .._core.kubeconfig import (
    DEFAULT_KUBECONFIG,
    KubeconfigError,
    KubeTarget,
    Pem,
    kubeconfig_from_env,
    resolve_kubeconfig,
)
from .._core.urls import redact_url

#: Where Kubernetes mounts a pod's service account.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True, slots=True)
class KubeConnection:
    """The API server as discovery talks to it."""

    base_url: str
    namespace: str
    verify: ssl.SSLContext | bool
    #: The bearer token for the next request (None: none is sent); may read a file.
    token: Callable[[], str | None]
    #: For the start-up log line: where this came from.
    described: str


@dataclass(frozen=True, slots=True)
class KubeApi:
    """The settings that say how to reach the API server (read when discovery starts)."""

    #: ``EPD_SERVICE_DISCOVERY_API``, or None.
    override: str | None = None
    #: ``EPD_SERVICE_DISCOVERY_NAMESPACE``: wins over the service account's and the context's.
    namespace: str | None = None
    kubeconfig: str | None = None
    context: str | None = None
    account_dir: Path = SERVICE_ACCOUNT_DIR
    environ: Mapping[str, str] | None = None
    home: Path | None = None

    def connect(self) -> KubeConnection:
        env = os.environ if self.environ is None else self.environ
        if self.override:
            return KubeConnection(self.override, self.namespace or self._account_namespace(), True,
                                  _fixed(None), f"{self.override} (no credentials)")
        if self.kubeconfig or self.context:
            return self._from_kubeconfig(self.kubeconfig or self._default_kubeconfig(env))
        if env.get("KUBERNETES_SERVICE_HOST") and env.get("KUBERNETES_SERVICE_PORT"):
            return self._in_cluster(env)
        path = self._default_kubeconfig(env)
        if path is None:
            raise OSError("Kubernetes discovery: not in a pod (KUBERNETES_SERVICE_HOST/PORT "
                          "are not set) and no kubeconfig (KUBECONFIG unset, no "
                          f"~/{DEFAULT_KUBECONFIG}); set EPD_SERVICE_DISCOVERY_KUBECONFIG "
                          "or EPD_SERVICE_DISCOVERY_API")
        return self._from_kubeconfig(path)

    def _default_kubeconfig(self, env: Mapping[str, str]) -> str | None:
        named = kubeconfig_from_env(env.get("KUBECONFIG"), os.pathsep)
        if named:
            return named
        home = self.home if self.home is not None else Path(env.get("HOME") or Path.home())
        default = home / DEFAULT_KUBECONFIG
        return str(default) if default.is_file() else None

    def _in_cluster(self, env: Mapping[str, str]) -> KubeConnection:
        host, port = env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]
        base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        ca = self.account_dir / "ca.crt"
        try:
            verify = ssl.create_default_context(cafile=str(ca))
        except OSError as exc:
            raise OSError(f"Kubernetes discovery: cannot read the cluster CA {ca} "
                          f"({exc})") from None
        token = _token_file(self.account_dir / "token", "the service account token")
        return KubeConnection(base, self.namespace or self._account_namespace(), verify, token,
                              f"{base} (in-cluster service account)")

    def _account_namespace(self) -> str:
        try:
            return (self.account_dir / "namespace").read_text().strip() or "default"
        except OSError:
            return "default"

    def _from_kubeconfig(self, path: str | None) -> KubeConnection:
        if path is None:
            raise OSError("Kubernetes discovery: EPD_SERVICE_DISCOVERY_CONTEXT names a "
                          "kubeconfig context, but there is no kubeconfig (KUBECONFIG unset, "
                          f"no ~/{DEFAULT_KUBECONFIG}, no EPD_SERVICE_DISCOVERY_KUBECONFIG)")
        file = Path(path).expanduser()
        try:
            target = resolve_kubeconfig(read_kubeconfig(file), directory=str(file.parent),
                                        context=self.context, source=f"kubeconfig {file}")
        except KubeconfigError as exc:
            raise OSError(f"Kubernetes discovery: {exc}") from None
        where = f"kubeconfig {file}, context {target.context!r}"
        verify = _tls_context(target, where) if target.server.startswith("https://") else True
        token: Callable[[], str | None]
        if target.token_file is not None:
            token = _token_file(Path(target.token_file), f"the token file of {where}")
        else:
            token = _fixed(target.token)
        return KubeConnection(target.server, self.namespace or target.namespace, verify, token,
                              f"{redact_url(target.server)} ({where})")


def kube_api(settings: Settings) -> KubeApi:
    return KubeApi(settings.service_discovery_api, settings.service_discovery_namespace,
                   settings.service_discovery_kubeconfig, settings.service_discovery_context)


def read_kubeconfig(path: Path) -> Any:
    """The kubeconfig's document: JSON as it is, YAML through PyYAML (imported only here)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise OSError(f"Kubernetes discovery: cannot read kubeconfig {path} ({exc})") from None
    if text.lstrip().startswith("{"):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise OSError(f"Kubernetes discovery: kubeconfig {path} is not valid JSON "
                          f"({exc})") from None
    try:
        import yaml
    except ImportError:
        raise OSError(f"Kubernetes discovery: kubeconfig {path} is YAML, which needs PyYAML: "
                      "pip install 'epd-trio[kubeconfig]' (or give the proxy the JSON form, "
                      "kubectl config view --raw --flatten -o json)") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise OSError(f"Kubernetes discovery: kubeconfig {path} is not valid YAML "
                      f"({exc})") from None


def _fixed(token: str | None) -> Callable[[], str | None]:
    return lambda: token


def _token_file(path: Path, what: str) -> Callable[[], str | None]:
    """The token of a file re-read at every connection (the kubelet rotates a service
    account's); read once now as well, so a missing or unreadable one fails start-up."""
    _read_token(path, what)
    return partial(_read_token, path, what)


def _read_token(path: Path, what: str) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError as exc:
        raise OSError(f"Kubernetes discovery: cannot read {what} ({exc})") from None


def _tls_context(target: KubeTarget, where: str) -> ssl.SSLContext:
    """The TLS context for the server: its CA (or the system's), and the client certificate."""
    if target.insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        try:
            if target.ca is None:
                context = ssl.create_default_context()
            elif target.ca.data is not None:
                context = ssl.create_default_context(cadata=target.ca.data.decode("ascii"))
            else:
                context = ssl.create_default_context(cafile=target.ca.path)
        except (OSError, ssl.SSLError, UnicodeDecodeError) as exc:
            raise OSError(f"Kubernetes discovery: {where}: cannot load the certificate "
                          f"authority ({exc})") from None
    if target.client_cert is not None and target.client_key is not None:
        try:
            _load_client_certificate(context, target.client_cert, target.client_key)
        except (OSError, ssl.SSLError) as exc:
            raise OSError(f"Kubernetes discovery: {where}: cannot load the client certificate "
                          f"and key ({exc})") from None
    return context


def _load_client_certificate(context: ssl.SSLContext, cert: Pem, key: Pem) -> None:
    """``load_cert_chain`` takes files only: inline data goes through a private temporary
    directory (mode 0700), removed as soon as the context holds the key."""
    with contextlib.ExitStack() as stack:
        paths = []
        for pem in (cert, key):
            if pem.path is not None:
                paths.append(pem.path)
                continue
            assert pem.data is not None
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="epd-kube-"))
            file = Path(directory) / "pem"
            file.touch(mode=0o600)
            file.write_bytes(pem.data)
            paths.append(str(file))
        context.load_cert_chain(paths[0], paths[1])
