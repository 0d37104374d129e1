"""The real servers some tests start themselves (Debian's redis-server, dnsmasq, prometheus).

Why one helper: the rule is the same for each. Locally, a test whose server is not installed
skips and names what is missing (``apt-get install ...``); in CI (``CI=true``, where ``.ci/run``
installs them) a missing server is a failure, so a green run can never hide a skipped suite.
"""

from __future__ import annotations

import os
import shutil

import pytest

from epd_trio.testing import redis_server as testing_redis

#: Debian package of each binary the tests run.
PACKAGE_OF = {"redis-server": "redis-server", "dnsmasq": "dnsmasq",
              "prometheus": "prometheus", "promtool": "prometheus"}


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_binary(name: str) -> str:
    """The path of ``name``; skips the calling test locally when it is missing, fails in CI."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is not None:
        return path
    message = (f"{name} is not installed (apt-get install {PACKAGE_OF.get(name, name)}); "
               ".ci/run installs it")
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


class RedisServer(testing_redis.RedisServer):
    """``epd_trio.testing.RedisServer`` under the missing-server rule above."""

    def __init__(self, port: int | None = None) -> None:
        super().__init__(port, binary=require_binary("redis-server"))
