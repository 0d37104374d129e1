"""The real servers some tests start themselves (Debian's redis-server, dnsmasq, prometheus), and
the container tools of the image's suite (podman, mmdebstrap).

Why one helper: the rule is the same for each. Locally, a test whose server is not installed
skips and names what is missing (``apt-get install ...``); in CI (``CI=true``, where ``.ci/run``
installs them) a missing server is a failure, so a green run can never hide a skipped suite.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, NoReturn

import pytest
import trustme

from epd_trio.testing import redis_server as testing_redis

#: Debian package of each binary the tests run.
PACKAGE_OF = {"redis-server": "redis-server", "dnsmasq": "dnsmasq",
              "prometheus": "prometheus", "promtool": "prometheus",
              "podman": "podman runc", "mmdebstrap": "mmdebstrap",
              "valgrind": "valgrind"}


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing(message: str) -> NoReturn:
    """Skip the calling test locally, fail it in CI (see the module docstring)."""
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def require_binary(name: str) -> str:
    """The path of ``name``; skips the calling test locally when it is missing, fails in CI."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is not None:
        return path
    missing(f"{name} is not installed (apt-get install {PACKAGE_OF.get(name, name)}); "
            ".ci/run installs it")


class RedisServer(testing_redis.RedisServer):
    """``epd_trio.testing.RedisServer`` under the missing-server rule above."""

    def __init__(self, port: int | None = None, **options: Any) -> None:
        super().__init__(port, binary=require_binary("redis-server"), **options)


def tls_redis_server(directory: Path, binary: str | None = None,
                     **options: Any) -> testing_redis.RedisServer:
    """A started ``redis-server`` that speaks TLS only, with a certificate for 127.0.0.1 and
    localhost signed by a private CA made here (``trustme``); its ``url`` is ``rediss://``
    with ``ssl_ca_certs`` naming that CA. A build of redis-server without TLS is a missing
    server (skipped locally, a failure in CI)."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    files = testing_redis.TLSFiles(cert=str(directory / "redis.crt"),
                                   key=str(directory / "redis.key"), ca=str(directory / "ca.crt"))
    cert.cert_chain_pems[0].write_to_path(files.cert)
    cert.private_key_pem.write_to_path(files.key)
    ca.cert_pem.write_to_path(files.ca)
    server = testing_redis.RedisServer(binary=binary or require_binary("redis-server"),
                                       tls=files, **options)
    try:
        return server.start()
    except RuntimeError as exc:
        if "tls-port" in str(exc) and "Bad directive" in str(exc):
            missing("redis-server was built without TLS (--tls-port); Debian's package has it")
        raise


def require_one_process(suite: str) -> None:
    """Fail a one-process suite's session fixture run by an xdist worker (an explicit ``-n``):
    each worker would start its own vLLM cluster or image build, in no particular order."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None:
        pytest.fail(f"the {suite} runs in one process, not in xdist worker {worker}: run it "
                    "without -n (tests/conftest.py gives it none) or with -n 0")


#: The suites whose servers belong to the session and whose tests run in an order (one vLLM
#: cluster, started once and stopped last; one image build): they run in one process.
ONE_PROCESS_SUITES = ("vllm_e2e", "container")


def one_process_suite(markexpr: str) -> str | None:
    """The one-process suite a ``-m`` expression selects (the main suite's own expression
    deselects both with ``not``), or None."""
    for marker in ONE_PROCESS_SUITES:
        if re.search(rf"(?<!not )\b{marker}\b", markexpr):
            return marker
    return None
