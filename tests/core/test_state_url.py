"""EPD_STATE_URL: every accepted form, every refusal, and a password that never shows."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import epd_trio.__main__ as epd_main
from epd_trio import ConfigError, settings_from
from epd_trio._core.state_url import StateURL, parse_state_url
from epd_trio._environment import load_settings

GOOD = [
    ("redis://localhost", StateURL("redis", host="localhost", port=6379)),
    ("redis://10.0.0.5:7000/3", StateURL("redis", host="10.0.0.5", port=7000, db=3)),
    ("redis://:s3cret@r:6379/0", StateURL("redis", host="r", port=6379, password="s3cret")),
    ("redis://app:p%40ss@r:1", StateURL("redis", host="r", port=1, username="app",
                                         password="p@ss")),
    ("rediss://r.example:6380", StateURL("rediss", host="r.example", port=6380)),
    ("redis://[::1]:6379", StateURL("redis", host="::1", port=6379)),
    ("unix:///run/redis/redis.sock", StateURL("unix", path="/run/redis/redis.sock")),
    ("unix://:pw@/run/r.sock?db=2", StateURL("unix", path="/run/r.sock", db=2, password="pw")),
    ("rediss://r:6380/1?ssl_ca_certs=/etc/ca.pem",
     StateURL("rediss", host="r", port=6380, db=1, ca_certs="/etc/ca.pem")),
    ("rediss://r?ssl_certfile=c.pem&ssl_keyfile=k.pem&ssl_ca_certs=/etc/ca",
     StateURL("rediss", host="r", port=6379, ca_certs="/etc/ca", certfile="c.pem",
              keyfile="k.pem")),
]


@pytest.mark.parametrize(("raw", "expected"), GOOD)
def test_accepted_forms(raw: str, expected: StateURL) -> None:
    assert parse_state_url(raw) == expected


BAD = [
    ("http://r:6379", "scheme must be one of"),
    ("r:6379", "scheme must be one of"),
    ("redis://", "needs a host"),
    ("redis://:pw@r:notaport", "not a URL"),
    ("redis://r:6379/zero", "database must be a number"),
    ("redis://r:6379?db=1", "not a query"),
    ("unix://host/path", "not a host"),
    ("unix://", "absolute socket path"),
    ("unix:///r.sock?timeout=1", "unknown query parameter"),
    ("redis://r#x", "fragment"),
    ("redis://r?ssl_ca_certs=/ca.pem", "TLS parameters need rediss://"),
    ("rediss://r?ssl_ca=/ca.pem", "unknown query parameter.*ssl_ca "),
    ("rediss://r?ssl_ca_certs=", "ssl_ca_certs needs one path"),
    ("rediss://r?ssl_ca_certs=/a&ssl_ca_certs=/b", "ssl_ca_certs needs one path"),
    ("rediss://r?ssl_certfile=/c.pem", "needs both ssl_certfile and ssl_keyfile"),
]


@pytest.mark.parametrize(("raw", "message"), BAD)
def test_refused_forms_say_why(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_state_url(raw)


def test_a_malformed_url_is_refused_at_start_naming_the_setting_not_the_password() -> None:
    with pytest.raises(ConfigError) as info:
        settings_from({"EPD_DECODE_URLS": "http://d:1", "EPD_STATE_URL": "redis://:hunter2@r:x"})
    assert str(info.value).startswith("EPD_STATE_URL: ")
    assert "hunter2" not in str(info.value)


def test_the_password_never_shows() -> None:
    settings = settings_from({"EPD_DECODE_URLS": "http://d:1",
                              "EPD_STATE_URL": "redis://app:hunter2@r:6379/1"})
    assert settings.state_url is not None
    assert "hunter2" not in repr(settings) and "hunter2" not in repr(settings.state_url)
    assert settings.state_url.redacted() == "redis://***@r:6379/1"  # the user too: userinfo
    assert parse_state_url("unix://:x@/s.sock?db=4").redacted() == "unix://***@/s.sock?db=4"
    assert parse_state_url("redis://[::1]").redacted() == "redis://[::1]:6379/0"
    assert parse_state_url("rediss://:pw@r?ssl_ca_certs=/ca.pem").redacted() == (
        "rediss://***@r:6379/0?ssl_ca_certs=/ca.pem")


def test_the_global_cursor_needs_a_state_store() -> None:
    with pytest.raises(ConfigError, match="EPD_GLOBAL_CURSOR: needs EPD_STATE_URL"):
        settings_from({"EPD_DECODE_URLS": "http://d:1", "EPD_GLOBAL_CURSOR": "true"})


def test_a_shared_roster_lets_a_replica_start_without_instances() -> None:
    settings = settings_from({"EPD_STATE_URL": "redis://r"})
    assert settings.decode_urls == () and settings.state_prefix == "epd:"


def test_tls_files_that_cannot_be_used_are_refused_at_start_naming_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """``epd-trio serve`` reads them once, before any worker (plain ``hypercorn``, which
    refuses them as it makes the app: ``tests/serve/test_hypercorn_cli.py``)."""
    def serve(*args: object) -> int:
        raise AssertionError("epd-trio serve started workers")

    monkeypatch.setattr(epd_main, "serve", serve)
    for name in [name for name in os.environ if name.startswith("EPD_")]:
        monkeypatch.delenv(name)
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("not a certificate\n")
    for query, message in (
        (f"ssl_ca_certs={tmp_path}/missing.pem", "ssl_ca_certs: cannot use .*missing.pem: No such"),
        (f"ssl_ca_certs={not_pem}", "ssl_ca_certs: cannot use .*ca.pem"),
        (f"ssl_certfile={not_pem}&ssl_keyfile={not_pem}", "ssl_certfile: cannot use"),
    ):
        monkeypatch.setenv("EPD_STATE_URL", f"rediss://:hunter2@r:6380/0?{query}")
        assert epd_main.main(["serve", "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert re.fullmatch(f"epd-trio: configuration error: EPD_STATE_URL: {message}.*\n", err)
        assert "hunter2" not in err
    with pytest.raises(ConfigError) as info:
        load_settings({"EPD_STATE_URL": "redis://:hunter2@r?ssl_ca_certs=/ca.pem"})
    assert str(info.value) == ("EPD_STATE_URL: ssl_ca_certs: TLS parameters need rediss://")
