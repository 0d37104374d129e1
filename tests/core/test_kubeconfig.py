"""A kubeconfig, as Kubernetes discovery reads it: the rules (pure, table-driven) and the shell
against the FAKE Kubernetes API (epd_trio/testing/kube_api.py) over TLS, with a CA and certificates
made for the test (trustme), a bearer token or a client certificate.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme
import yaml

from epd_trio._core.config import ConfigError, settings_from
from epd_trio._core.kubeconfig import (
    KubeconfigError,
    KubeTarget,
    Pem,
    kubeconfig_from_env,
    resolve_kubeconfig,
)
from epd_trio._discovery.k8s import KubernetesDiscovery
from epd_trio._discovery.kube_api import KubeApi, read_kubeconfig
from epd_trio._discovery.start import check_discovery
from epd_trio.testing.kube_api import FakeKubeApi, make_pod

DECODE = {"app": "vllm", "role": "decode"}
SELECTOR = "app=vllm,role=decode"


def kubeconfig(
    *, current: str | None = "dev", server: str = "https://10.0.0.1:6443",
    cluster: dict[str, Any] | None = None, user: dict[str, Any] | None = None,
    namespace: str | None = "serving",
) -> dict[str, Any]:
    """A kubeconfig with contexts ``dev`` (cluster ``c1``, user ``u1``) and ``ops`` (``c2``,
    ``u2``: a token, no namespace)."""
    dev: dict[str, Any] = {"cluster": "c1", "user": "u1"}
    if namespace:
        dev["namespace"] = namespace
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": current,
        "clusters": [{"name": "c1", "cluster": {"server": server, **(cluster or {})}},
                     {"name": "c2", "cluster": {"server": "https://ops.example:443/"}}],
        "users": [{"name": "u1", "user": user if user is not None else {"token": "tok-1"}},
                  {"name": "u2", "user": {"token": "tok-ops"}}],
        "contexts": [{"name": "dev", "context": dev},
                     {"name": "ops", "context": {"cluster": "c2", "user": "u2"}}],
    }


PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
B64 = base64.b64encode(PEM).decode()


@pytest.mark.parametrize("document, context, expected", [
    # The current context: its cluster's server and CA file (relative to the file's directory),
    # its user's token, its namespace.
    (kubeconfig(cluster={"certificate-authority": "ca.crt"}), None,
     KubeTarget(context="dev", server="https://10.0.0.1:6443", namespace="serving",
                ca=Pem(path="/home/me/.kube/ca.crt"), token="tok-1")),
    # A named context: no namespace there means "default"; the trailing slash goes.
    (kubeconfig(), "ops",
     KubeTarget(context="ops", server="https://ops.example:443", namespace="default",
                token="tok-ops")),
    # Inline data (base64) wins over the file, as client-go has it; an absolute path is kept.
    (kubeconfig(cluster={"certificate-authority-data": B64, "certificate-authority": "x"},
                user={"client-certificate-data": B64, "client-key": "/keys/u1.key"}), None,
     KubeTarget(context="dev", server="https://10.0.0.1:6443", namespace="serving",
                ca=Pem(data=PEM), client_cert=Pem(data=PEM), client_key=Pem(path="/keys/u1.key"))),
    # insecure-skip-tls-verify, and a token file (relative) beside a token.
    (kubeconfig(cluster={"insecure-skip-tls-verify": True},
                user={"token": "old", "tokenFile": "token"}), None,
     KubeTarget(context="dev", server="https://10.0.0.1:6443", namespace="serving",
                insecure=True, token="old", token_file="/home/me/.kube/token")),
    # No user at all (a plain-HTTP server, say): no credentials.
    ({"current-context": "x", "clusters": [{"name": "c", "cluster": {"server": "http://h:1"}}],
      "contexts": [{"name": "x", "context": {"cluster": "c"}}]}, None,
     KubeTarget(context="x", server="http://h:1", namespace="default")),
])
def test_a_kubeconfig_gives_the_server_its_credentials_and_namespace(
    document: dict[str, Any], context: str | None, expected: KubeTarget
) -> None:
    assert resolve_kubeconfig(document, directory="/home/me/.kube", context=context) == expected


@pytest.mark.parametrize("document, context, problem", [
    (kubeconfig(user={"exec": {"command": "aws", "args": ["eks", "get-token"]}}), None,
     "context 'dev': an exec credential plugin .* is not supported"),
    (kubeconfig(user={"auth-provider": {"name": "oidc"}}), None, "auth-provider plugin"),
    (kubeconfig(user={"username": "admin", "password": "x"}), None, "basic authentication"),
    (kubeconfig(user={"as": "someone", "token": "t"}), None, r"impersonation \(as\)"),
    (kubeconfig(cluster={"proxy-url": "http://proxy:3128"}), None, "proxy-url"),
    (kubeconfig(current=None), None, "no current-context"),
    (kubeconfig(), "prod", r"no context named 'prod' \(it has: dev, ops\)"),
    (kubeconfig(server=""), None, "cluster 'c1' has no server"),
    (kubeconfig(server="10.0.0.1:6443"), None, "not an http"),
    (kubeconfig(user={"client-certificate": "u.crt"}), None,
     r"user 'u1': client-key \(or client-key-data\) is missing"),
    (kubeconfig(user={"client-key-data": B64}), None, "client-certificate .* is missing"),
    (kubeconfig(cluster={"certificate-authority-data": "not base64!"}), None,
     "certificate-authority-data is not base64"),
    (kubeconfig(cluster={"certificate-authority": "ca", "insecure-skip-tls-verify": True}), None,
     "with insecure-skip-tls-verify"),
    (kubeconfig(cluster={"insecure-skip-tls-verify": "yes"}), None, "expected true or false"),
    ({"current-context": "dev", "contexts": [{"name": "dev", "context": {"cluster": "c1"}}]},
     None, r"no cluster named 'c1' \(it has: none\)"),
    (["not", "a", "mapping"], None, "not a kubeconfig"),
])
def test_what_a_kubeconfig_lacks_or_asks_for_is_named(
    document: Any, context: str | None, problem: str
) -> None:
    with pytest.raises(KubeconfigError, match=problem):
        resolve_kubeconfig(document, directory="/d", context=context)


def test_kubeconfig_env_takes_its_first_file() -> None:
    assert kubeconfig_from_env("/a/config:/b/config") == "/a/config"
    assert kubeconfig_from_env(":/b/config") == "/b/config"
    assert kubeconfig_from_env("") is None and kubeconfig_from_env(None) is None
    assert kubeconfig_from_env(r"C:\k;D:\k", ";") == r"C:\k"


def test_the_settings_for_a_kubeconfig() -> None:
    base = {"EPD_SERVICE_DISCOVERY": "true", "EPD_DECODE_SELECTOR": SELECTOR}
    settings = settings_from({**base, "EPD_SERVICE_DISCOVERY_KUBECONFIG": "/k/config",
                              "EPD_SERVICE_DISCOVERY_CONTEXT": "ops"})
    assert (settings.service_discovery_kubeconfig, settings.service_discovery_context) == (
        "/k/config", "ops")
    with pytest.raises(ConfigError, match="KUBECONFIG: is used only with EPD_SERVICE_DISCOVERY"):
        settings_from({"EPD_DECODE_URLS": "http://d:1", "EPD_SERVICE_DISCOVERY_KUBECONFIG": "k"})
    with pytest.raises(ConfigError, match="both say how to reach the API server"):
        settings_from({**base, "EPD_SERVICE_DISCOVERY_CONTEXT": "ops",
                       "EPD_SERVICE_DISCOVERY_API": "http://127.0.0.1:8001"})


# -- the shell: files, TLS, the fake API ----------------------------------------------------------
@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def server_context(ca: trustme.CA, *, client_ca: trustme.CA | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    if client_ca is not None:
        client_ca.configure_trust(context)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def write(path: Path, document: dict[str, Any], as_json: bool = False) -> Path:
    path.write_text(json.dumps(document) if as_json else yaml.safe_dump(document))
    return path


class Roster:
    def __init__(self) -> None:
        self.urls: list[str] = []

    def apply(self, source: str, role: str, found: Any) -> tuple[list[str], list[str]]:
        self.urls = [d.instance.url for d in found]
        return [], []


async def discover(nursery: trio.Nursery, api: KubeApi) -> tuple[KubernetesDiscovery, Roster]:
    roster = Roster()
    found = KubernetesDiscovery([("decode", SELECTOR)], roster.apply, api=api, port=8000,
                                jitter=lambda: 1.0)
    await nursery.start(found.run)
    return found, roster


async def test_a_kubeconfig_with_a_ca_file_and_a_token_over_tls(
    nursery: trio.Nursery, tmp_path: Path, ca: trustme.CA
) -> None:
    fake = FakeKubeApi(namespace="serving", ssl_context=server_context(ca), token="tok-1")
    await nursery.start(fake.serve)
    fake.put(make_pod("d0", "10.1.0.5", DECODE, namespace="serving"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    config = write(tmp_path / "config", kubeconfig(
        server=fake.url, cluster={"certificate-authority": "ca.crt"}))  # relative to the file
    found, roster = await discover(nursery, KubeApi(kubeconfig=str(config), environ={}))
    assert roster.urls == ["http://10.1.0.5:8000"]
    assert found.reconnects["decode"] == 0
    assert set(fake.authorization) == {"Bearer tok-1"}


async def test_a_token_file_is_read_at_every_connection(
    nursery: trio.Nursery, tmp_path: Path, ca: trustme.CA
) -> None:
    fake = FakeKubeApi(namespace="serving", ssl_context=server_context(ca), token="tok-1")
    await nursery.start(fake.serve)
    (tmp_path / "token").write_text("tok-1\n")
    config = write(tmp_path / "config", kubeconfig(server=fake.url, user={"tokenFile": "token"},
        cluster={"certificate-authority-data": base64.b64encode(ca.cert_pem.bytes()).decode()}))
    found, _roster = await discover(nursery, KubeApi(kubeconfig=str(config), environ={}))
    await fake.wait_until(lambda: fake.watching == 1)
    (tmp_path / "token").write_text("tok-2\n")  # rotated: the next call sends the new one
    fake.token = "tok-2"
    fake.drop_watches()
    await fake.wait_until(lambda: len(fake.watches()) == 2 and fake.watching == 1)
    assert fake.authorization[-1] == "Bearer tok-2"
    assert found.lists["decode"] == 1  # the watch resumed: no 401 in between


async def test_a_client_certificate_from_inline_data(
    nursery: trio.Nursery, tmp_path: Path, ca: trustme.CA
) -> None:
    client_ca = trustme.CA()
    fake = FakeKubeApi(namespace="serving", ssl_context=server_context(ca, client_ca=client_ca))
    await nursery.start(fake.serve)
    fake.put(make_pod("d0", "10.1.0.5", DECODE, namespace="serving"))
    client = client_ca.issue_cert("proxy@example")
    data = {"client-certificate-data": client.cert_chain_pems[0].bytes(),
            "client-key-data": client.private_key_pem.bytes()}
    user = {key: base64.b64encode(value).decode() for key, value in data.items()}
    document = kubeconfig(server=fake.url, user=user, cluster={
        "certificate-authority-data": base64.b64encode(ca.cert_pem.bytes()).decode()})
    config = write(tmp_path / "config.json", document, as_json=True)  # JSON: no PyYAML needed
    _found, roster = await discover(nursery, KubeApi(kubeconfig=str(config), environ={}))
    assert roster.urls == ["http://10.1.0.5:8000"]
    assert fake.client_certs and all(fake.client_certs)  # presented on every connection
    assert set(fake.authorization) == {None}  # and no token


async def test_a_server_the_ca_did_not_sign_is_refused(
    nursery: trio.Nursery, tmp_path: Path, ca: trustme.CA, autojump_clock: Any
) -> None:
    fake = FakeKubeApi(namespace="serving", ssl_context=server_context(trustme.CA()))
    await nursery.start(fake.serve)
    fake.put(make_pod("d0", "10.1.0.5", DECODE, namespace="serving"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    config = write(tmp_path / "config", kubeconfig(
        server=fake.url, cluster={"certificate-authority": "ca.crt"}))
    found, roster = await discover(nursery, KubeApi(kubeconfig=str(config), environ={}))
    await found.wait_until(lambda: found.reconnects["decode"] >= 2)
    assert roster.urls == [] and fake.requests == []
    # insecure-skip-tls-verify takes it as it is.
    write(config, kubeconfig(server=fake.url, cluster={"insecure-skip-tls-verify": True}))
    _found, roster = await discover(nursery, KubeApi(kubeconfig=str(config), environ={}))
    assert roster.urls == ["http://10.1.0.5:8000"]


def test_which_configuration_is_used(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("sa-token\n")
    (tmp_path / "ca.crt").write_bytes(trustme.CA().cert_pem.bytes())
    (tmp_path / "namespace").write_text("pods-ns\n")
    first = write(tmp_path / "first", kubeconfig(server="https://first:6443"))
    write(tmp_path / "second", kubeconfig(server="https://second:6443"))
    (tmp_path / "home" / ".kube").mkdir(parents=True)
    write(tmp_path / "home" / ".kube" / "config", kubeconfig(server="https://home:6443"))
    in_pod = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    kubeconfig_env = {"KUBECONFIG": f"{first}:{tmp_path / 'second'}"}

    def connect(**given: Any) -> tuple[str, str, str | None]:
        given.setdefault("environ", {})
        api = KubeApi(account_dir=tmp_path, home=tmp_path / "home", **given)
        connection = api.connect()
        return connection.base_url, connection.namespace, connection.token()

    # In a pod: the service account, even with a KUBECONFIG about.
    assert connect(environ={**in_pod, **kubeconfig_env}) == (
        "https://[fd00::1]:443", "pods-ns", "sa-token")
    (tmp_path / "token").write_text("sa-token-2")  # rotated by the kubelet: read afresh
    assert connect(environ=in_pod)[2] == "sa-token-2"
    # A kubeconfig or a context given: the kubeconfig, also in a pod.
    assert connect(environ=in_pod, kubeconfig=str(first)) == (
        "https://first:6443", "serving", "tok-1")
    assert connect(environ={**in_pod, **kubeconfig_env}, context="ops") == (
        "https://ops.example:443", "default", "tok-ops")
    # Outside a pod: KUBECONFIG's first file, else ~/.kube/config.
    assert connect(environ=kubeconfig_env)[0] == "https://first:6443"
    assert connect()[0] == "https://home:6443"
    # The namespace setting wins; an API URL takes no credentials.
    assert connect(kubeconfig=str(first), namespace="given")[1] == "given"
    assert connect(override="http://127.0.0.1:8001") == ("http://127.0.0.1:8001", "pods-ns", None)
    with pytest.raises(OSError, match=r"not in a pod .* and no kubeconfig"):
        KubeApi(account_dir=tmp_path, environ={}, home=tmp_path / "nowhere").connect()
    with pytest.raises(OSError, match="cannot read the cluster CA"):
        KubeApi(account_dir=tmp_path / "nowhere", environ=in_pod).connect()
    (tmp_path / "token").unlink()
    with pytest.raises(OSError, match="cannot read the service account token"):
        KubeApi(account_dir=tmp_path, environ=in_pod).connect()


def test_a_refused_kubeconfig_fails_start_up_naming_why(tmp_path: Path) -> None:
    config = write(tmp_path / "config", kubeconfig(
        user={"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "gke-auth"}}))
    with pytest.raises(OSError, match=f"kubeconfig {config}, context 'dev': an exec credential"):
        KubeApi(kubeconfig=str(config), environ={}).connect()
    write(config, kubeconfig(cluster={"certificate-authority": "missing.crt"}))
    with pytest.raises(OSError, match="cannot load the certificate authority"):
        KubeApi(kubeconfig=str(config), environ={}).connect()
    write(config, kubeconfig(user={"tokenFile": "missing"}))
    with pytest.raises(OSError, match="cannot read the token file of kubeconfig"):
        KubeApi(kubeconfig=str(config), environ={}).connect()
    with pytest.raises(OSError, match="cannot read kubeconfig"):
        KubeApi(kubeconfig=str(tmp_path / "absent"), environ={}).connect()


def test_a_yaml_kubeconfig_without_pyyaml_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    yaml_file = write(tmp_path / "config", kubeconfig())
    json_file = write(tmp_path / "config.json", kubeconfig(), as_json=True)
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml now fails
    with pytest.raises(OSError, match=r"needs PyYAML: pip install 'epd-trio\[kubeconfig\]'"):
        read_kubeconfig(yaml_file)
    assert read_kubeconfig(json_file) == kubeconfig()


def test_epd_trio_serve_refuses_an_exec_plugin_in_one_line_before_serving(tmp_path: Path) -> None:
    config = write(tmp_path / "config", kubeconfig(user={"exec": {"command": "aws"}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPD_", "KUBE"))}
    result = subprocess.run(
        [sys.executable, "-m", "epd_trio", "serve", "--port", "0", "--service-discovery",
         "--decode-selector", "app=vllm", "role=decode", "--service-discovery-kubeconfig",
         str(config)], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "epd-trio: configuration error: EPD_SERVICE_DISCOVERY_KUBECONFIG: Kubernetes discovery: "
        f"kubeconfig {config}, context 'dev': an exec credential plugin (the proxy runs no "
        "external command: give its user a token, tokenFile or client certificate) is not "
        "supported"]


def test_no_way_to_reach_the_api_server_is_a_configuration_error_before_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Blamed on the setting at fault: the kubeconfig or context given, else the switch that
    turned Kubernetes discovery on (no pod, no kubeconfig anywhere)."""
    for name in [n for n in os.environ if n.startswith(("EPD_", "KUBE"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    selector = {"EPD_SERVICE_DISCOVERY": "true", "EPD_DECODE_SELECTOR": "app=vllm"}
    with pytest.raises(ConfigError, match=r"^EPD_SERVICE_DISCOVERY: Kubernetes discovery: not "
                                          r"in a pod .* and no kubeconfig"):
        check_discovery(settings_from(selector))
    with pytest.raises(ConfigError, match=r"^EPD_SERVICE_DISCOVERY_CONTEXT: .*names a kubeconfig "
                                          r"context, but there is no kubeconfig"):
        check_discovery(settings_from({**selector, "EPD_SERVICE_DISCOVERY_CONTEXT": "dev"}))
    absent = tmp_path / "absent"
    with pytest.raises(ConfigError, match=r"^EPD_SERVICE_DISCOVERY_KUBECONFIG: .*cannot read "
                                          r"kubeconfig"):
        check_discovery(settings_from({**selector,
                                       "EPD_SERVICE_DISCOVERY_KUBECONFIG": str(absent)}))


def test_a_servers_user_and_password_are_never_shown(tmp_path: Path) -> None:
    """Issue 31: the start-up line shows where discovery connects; a kubeconfig server that
    carries userinfo is shown without it (and so is a refused one)."""
    config = write(tmp_path / "config", kubeconfig(server="http://admin:hunter2@10.0.0.1:8001"))
    connection = KubeApi(kubeconfig=str(config), environ={}).connect()
    assert connection.base_url == "http://admin:hunter2@10.0.0.1:8001"  # used as given
    assert "hunter2" not in connection.described and "admin" not in connection.described
    assert connection.described.startswith("http://***@10.0.0.1:8001")
    bad = write(tmp_path / "bad", kubeconfig(server="ftp://admin:hunter2@10.0.0.1"))
    with pytest.raises(OSError) as caught:
        KubeApi(kubeconfig=str(bad), environ={}).connect()
    assert "hunter2" not in str(caught.value)
