"""A kubeconfig, read as kubectl reads it: which server, which CA, which credentials, which namespace.

Pure: the parsed document (a mapping, from YAML or JSON) and the file's directory in, one
``KubeTarget`` out, or one ``KubeconfigError`` naming what is missing or refused. Reading the
files (the kubeconfig itself, a CA, a token file, a client key) is the shell's
(``_discovery/kube_api``).

What is taken, as kubectl takes it:

- the context: ``current-context``, or the one named (``EPD_SERVICE_DISCOVERY_CONTEXT``);
- its cluster's ``server``, ``certificate-authority`` (a file, relative to the kubeconfig's
  directory) or ``certificate-authority-data`` (base64 PEM), ``insecure-skip-tls-verify``;
- its user's ``token`` or ``tokenFile`` (re-read at every connection, and preferred to
  ``token`` when both are given, as client-go does), ``client-certificate`` /
  ``client-key`` (files) or their ``-data`` (base64 PEM);
- its ``namespace`` (``default`` when it has none).

What is refused, with an error naming it (silently ignoring it would talk to the API server
with other credentials than the user's): ``exec`` and ``auth-provider`` plugins (the proxy
runs no external command: give the proxy a token or a client certificate instead),
``username``/``password``, impersonation (``as``, ``as-groups``, ...), ``proxy-url`` and
``tls-server-name``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from .urls import echo

#: Where kubectl looks when ``KUBECONFIG`` is unset (under the home directory).
DEFAULT_KUBECONFIG = ".kube/config"

#: User fields that ask for something the proxy does not do, and what to do instead.
REFUSED_USER_FIELDS = {
    "exec": "an exec credential plugin (the proxy runs no external command: give its user a "
            "token, tokenFile or client certificate)",
    "auth-provider": "an auth-provider plugin (the proxy runs none: give its user a token, "
                     "tokenFile or client certificate)",
    "username": "basic authentication (username/password; use a token or a client certificate)",
    "password": "basic authentication (username/password; use a token or a client certificate)",
    "as": "impersonation (as)",
    "as-uid": "impersonation (as-uid)",
    "as-groups": "impersonation (as-groups)",
    "as-user-extra": "impersonation (as-user-extra)",
}
REFUSED_CLUSTER_FIELDS = {
    "proxy-url": "an HTTP proxy (proxy-url)",
    "tls-server-name": "a TLS server name other than the server's host (tls-server-name)",
}


class KubeconfigError(ValueError):
    """The kubeconfig cannot be used; ``str()`` names the file's part that is at fault."""


@dataclass(frozen=True, slots=True)
class Pem:
    """PEM material given as a file (``path``) or inline (``data``, decoded from base64)."""

    path: str | None = None
    data: bytes | None = None


@dataclass(frozen=True, slots=True)
class KubeTarget:
    """Everything needed to talk to the API server of one kubeconfig context."""

    context: str
    server: str
    namespace: str
    #: The CA that signed the server's certificate (None: the system's trust store).
    ca: Pem | None = None
    insecure: bool = False
    token: str | None = None
    #: A file holding the token, read at every connection (it may be rotated).
    token_file: str | None = None
    client_cert: Pem | None = None
    client_key: Pem | None = None


def kubeconfig_from_env(value: str | None, separator: str = ":") -> str | None:
    """The file ``KUBECONFIG`` names: its first non-empty entry. kubectl merges every file of
    the list; the proxy reads the first only (the docs say so)."""
    for entry in (value or "").split(separator):
        if entry.strip():
            return entry.strip()
    return None


def resolve_kubeconfig(
    document: Any, *, directory: str, context: str | None = None, source: str = "kubeconfig"
) -> KubeTarget:
    """The target of ``context`` (None: ``current-context``) in ``document``.

    ``directory`` is the kubeconfig's own: relative file names in it are relative to it, as
    kubectl has them. ``source`` names the file in the errors.
    """
    if not isinstance(document, Mapping):
        raise KubeconfigError(f"{source}: not a kubeconfig (expected a mapping at the top)")
    name = context or document.get("current-context")
    if not name:
        raise KubeconfigError(f"{source}: no current-context, and no context named "
                              "(EPD_SERVICE_DISCOVERY_CONTEXT)")
    where = f"{source}, context {name!r}"
    ctx = _named(document, "contexts", "context", name, source)
    cluster_name, user_name = ctx.get("cluster"), ctx.get("user")
    if not cluster_name:
        raise KubeconfigError(f"{where}: names no cluster")
    cluster = _named(document, "clusters", "cluster", cluster_name, source)
    user = _named(document, "users", "user", user_name, source) if user_name else {}
    for fields, part in ((REFUSED_CLUSTER_FIELDS, cluster), (REFUSED_USER_FIELDS, user)):
        for field, what in fields.items():
            if part.get(field) not in (None, "", [], {}):
                raise KubeconfigError(f"{where}: {what} is not supported")
    server = str(cluster.get("server") or "").strip().rstrip("/")
    if not server:
        raise KubeconfigError(f"{where}: cluster {cluster_name!r} has no server")
    if not server.startswith(("https://", "http://")):
        raise KubeconfigError(f"{where}: server {echo(server)} is not an http(s):// URL")
    ca = _pem(cluster, "certificate-authority", directory, f"{where}, cluster {cluster_name!r}")
    insecure = _flag(cluster.get("insecure-skip-tls-verify"), f"{where}: insecure-skip-tls-verify")
    if ca is not None and insecure:
        raise KubeconfigError(f"{where}: a certificate authority with insecure-skip-tls-verify "
                              "(kubectl refuses the pair too)")
    user_where = f"{where}, user {user_name!r}"
    cert = _pem(user, "client-certificate", directory, user_where)
    key = _pem(user, "client-key", directory, user_where)
    if (cert is None) != (key is None):
        missing = "client-key" if key is None else "client-certificate"
        raise KubeconfigError(f"{user_where}: {missing} (or {missing}-data) is missing")
    token = str(user.get("token") or "").strip() or None
    token_file = user.get("tokenFile") or None
    if token_file is not None:
        token_file = _relative(str(token_file), directory)
    namespace = str(ctx.get("namespace") or "").strip() or "default"
    return KubeTarget(context=str(name), server=server, namespace=namespace, ca=ca,
                      insecure=insecure, token=token, token_file=token_file,
                      client_cert=cert, client_key=key)


def _named(document: Mapping[str, Any], key: str, inner: str, name: str,
           source: str) -> Mapping[str, Any]:
    """The ``inner`` mapping of the entry called ``name`` in the list ``document[key]``."""
    entries = document.get(key) or []
    if not isinstance(entries, list):
        raise KubeconfigError(f"{source}: {key} is not a list")
    for entry in entries:
        if isinstance(entry, Mapping) and entry.get("name") == name:
            body = entry.get(inner) or {}
            if not isinstance(body, Mapping):
                raise KubeconfigError(f"{source}: {inner} {name!r} is not a mapping")
            return body
    known = sorted(str(e.get("name")) for e in entries if isinstance(e, Mapping))
    raise KubeconfigError(f"{source}: no {inner} named {name!r} (it has: "
                          f"{', '.join(known) or 'none'})")


def _pem(part: Mapping[str, Any], field: str, directory: str, where: str) -> Pem | None:
    path, data = part.get(field), part.get(f"{field}-data")
    if data:  # kubectl: the -data form wins over the file
        try:
            return Pem(data=base64.b64decode(str(data), validate=True))
        except (binascii.Error, ValueError):
            raise KubeconfigError(f"{where}: {field}-data is not base64") from None
    if path:
        return Pem(path=_relative(str(path), directory))
    return None


def _relative(path: str, directory: str) -> str:
    return path if PurePath(path).is_absolute() else str(PurePath(directory) / path)


def _flag(value: Any, where: str) -> bool:
    if value in (None, False, "false", "False"):
        return False
    if value in (True, "true", "True"):
        return True
    raise KubeconfigError(f"{where}: expected true or false, got {value!r}")
