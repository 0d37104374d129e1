"""Every URL-bearing setting and registration field, fed malformed values (issue 31).

The settings parser is tested in-process for the bulk: ``serve`` prints exactly the
``ConfigError`` it raises and exits 2 (tests/serve/test_bad_urls.py runs a few through the real
process). Each refusal must be a ``ConfigError`` (never another exception: that would be a
traceback), one line, not too long to read, naming the setting, and never repeating a password.
"""

from __future__ import annotations

import pytest

from epd_trio import ConfigError, Instance, settings_from
from epd_trio._core.errors import BadRequest
from epd_trio._core.roster import parse_registration
from epd_trio._core.urls import check_base_url, redact_url

#: Malformed values for any URL: bad ports, schemes, userinfo, fragments, queries, spaces,
#: control characters, unicode, lengths.
BAD_URLS = [
    "http://127.0.0.1:abc", "http://127.0.0.1:99999", "http://127.0.0.1:-1", "http://127.0.0.1:0",
    "http://127.0.0.1:", "http://127.0.0.1:\uff11\uff12", "http://127.0.0.1:80:81",
    "ftp://127.0.0.1:1", "127.0.0.1:8000", "http:/127.0.0.1:1", "//127.0.0.1:1", "http://",
    "http://:80", "http://user:secret@127.0.0.1:1", "http://secret@127.0.0.1:1",
    "http://127.0.0.1:1#frag", "http://127.0.0.1:1?q=1", "http://127.0.0.1:1/?x",
    "http://a b:1", "http://a:1/p q", "http://a:1\x00", "http://a\t:1",
    "http://hé.example:1", "http://\u202eevil:1", "http://a..b:1", "http://-a:1",
    "http://[::1:80", "http://[zz::1]:80", "http://" + "a" * 3000 + ":1",
    "http://" + ("a" * 64) + ":1",
]
#: Each URL-bearing setting, with a value of the kind it takes beside the bad ones.
URL_SETTINGS = ["EPD_ENCODE_URLS", "EPD_PREFILL_URLS", "EPD_DECODE_URLS", "EPD_RENDER_URLS",
                "EPD_SERVICE_DISCOVERY_API"]
BAD_OTHER = {
    "EPD_STATE_URL": ["redis://u:secret@h:abc", "redis://:secret@h:99999", "redis://:secret@h:0",
                      "rediss://u:secret@h:1#x", "http://h:1", "redis://", "redis://h :1"],
    "EPD_DNS_NAMESERVER": ["h:abc", "h:0", "h:99999", "[::1]:x", "a b", "hé:53",
                           "u:secret@h:53", "a" * 300],
    "EPD_MORIIO_REGISTRATION": ["h:abc", "h:99999", "h:-1", "h", "a b:1", "hé:1",
                                "u:secret@h:1", "h:\uff11"],
}


def _refused(environ: dict[str, str], variable: str) -> str:
    with pytest.raises(ConfigError) as caught:
        settings_from({"EPD_DECODE_URLS": "http://d:1", **environ})
    message = str(caught.value)
    assert message.startswith(variable), message
    assert "\n" not in message and len(message) < 400, message
    assert "secret" not in message, message
    return message


@pytest.mark.parametrize("variable", URL_SETTINGS)
@pytest.mark.parametrize("value", BAD_URLS)
def test_every_url_setting_refuses_every_malformed_value_in_one_line(variable: str,
                                                                     value: str) -> None:
    _refused({variable: value}, variable)


@pytest.mark.parametrize("variable, value",
                         [(v, bad) for v, values in BAD_OTHER.items() for bad in values])
def test_other_address_settings_refuse_malformed_values(variable: str, value: str) -> None:
    _refused({variable: value}, variable)


@pytest.mark.parametrize("value", BAD_URLS)
def test_the_config_file_and_flags_refuse_them_by_name(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^decode_urls \(config file\)"):
        settings_from({}, {"decode_urls": [value]})
    with pytest.raises(ConfigError, match=r"^--decode"):
        settings_from({}, flags={"decode_urls": ["http://d:1", value]})


@pytest.mark.parametrize("value", ["dns+http://x:abc", "dns+http://x:0", "dns+http://u:secret@x:1",
                                   "dns+http://x y:1", "dnssrv+http://_x._tcp.hé"])
def test_dns_urls_are_checked_as_instance_urls(value: str) -> None:
    assert "secret" not in _refused({"EPD_DECODE_URLS": value}, "EPD_DECODE_URLS")


def test_the_list_variables_take_what_the_flags_take() -> None:
    """``EPD_DECODE_URLS='http://a:1 http://b:2'``, written like ``--decode a b``, once made one
    URL with a space in it that killed the prober."""
    expected = (Instance("http://a:1"), Instance("http://b:2#dp=2".split("#")[0], 2))
    for written in ("http://a:1 http://b:2#dp=2", "http://a:1,http://b:2#dp=2",
                    " http://a:1 ,\n http://b:2#dp=2 "):
        assert settings_from({"EPD_DECODE_URLS": written}).decode_urls == expected
    flags = settings_from({}, flags={"decode_urls": ["http://a:1", "http://b:2#dp=2"]})
    assert flags.decode_urls == expected


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://vllm.example:443/v1/",
                                 "http://[::1]:8000", "http://d0", "http://my_service.ns.svc:80",
                                 "http://xn--h-bga.example:1"])
def test_good_urls_pass_spelled_one_way(url: str) -> None:
    assert check_base_url(url) == url.rstrip("/")


@pytest.mark.parametrize("value", BAD_URLS)
def test_registrations_are_refused_with_a_400_naming_the_field(value: str) -> None:
    import orjson
    body = orjson.dumps({"role": "decode", "url": value})
    with pytest.raises(BadRequest) as caught:
        parse_registration(body, 0.0)
    assert caught.value.message.startswith("'url': "), caught.value.message
    assert "secret" not in caught.value.message


@pytest.mark.parametrize("dp_size", [0, -1, 1025, 100000, 10**30, "2", 2.0, True, None])
def test_dp_size_is_bounded_at_registration(dp_size: object) -> None:
    import json

    import orjson
    body = json.dumps({"role": "decode", "url": "http://d:1", "dp_size": dp_size}).encode()
    with pytest.raises(BadRequest, match="'dp_size' must be an integer from 1 to 1024"):
        parse_registration(body, 0.0)
    assert parse_registration(orjson.dumps({"role": "decode", "url": "http://d:1",
                                            "dp_size": 1024}), 0.0).instance.dp_size == 1024


@pytest.mark.parametrize("value, shown", [
    ("redis://u:pw@h:1/0", "redis://***@h:1/0"),
    ("http://u@h", "http://***@h"),
    ("see https://a:b@h/x and grpc://k@otel:4317", "see https://***@h/x and grpc://***@otel:4317"),
    ("http://h:1/a@b", "http://h:1/a@b"),  # an '@' in the path is no userinfo
    ("no url here", "no url here"),
    ("got 'u:pw@h:53'", "got '***@h:53'"),
    ("u:pw@h:53", "***@h:53"),
])
def test_redact_url_hides_the_userinfo_of_every_url(value: str, shown: str) -> None:
    assert redact_url(value) == shown


def test_no_configuration_error_shows_a_password_or_a_second_line() -> None:
    """The last net under every parser: ``ConfigError`` itself redacts and joins lines."""
    error = ConfigError("EPD_X", "cannot reach redis://app:secret@r:1\nsecond line")
    assert str(error) == "EPD_X: cannot reach redis://***@r:1 second line"


#: Malformed ZMQ endpoints (``#kv_events=`` in a URL, ``kv_events_endpoint`` in a
#: registration): the KV subscriber connects to them.
BAD_ENDPOINTS = ["tcp://h:abc", "tcp://h:0", "tcp://h:99999", "tcp://h:-1", "tcp://h:\uff11",
                 "tcp://*:5557", "ipc:///x", "tcp://a b:1", "tcp://u:secret@h:1", "tcp://h\u00e9:1",
                 "tcp://:1", "h:1", "tcp://" + "a" * 300 + ":1"]


@pytest.mark.parametrize("value", BAD_ENDPOINTS)
def test_kv_event_endpoints_are_refused_in_urls_and_registrations(value: str) -> None:
    import orjson
    _refused({"EPD_DECODE_URLS": f"http://d:1#kv_events={value}"}, "EPD_DECODE_URLS")
    for field in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        extra = {} if field == "kv_events_endpoint" else {"kv_events_endpoint": "tcp://d:1"}
        body = orjson.dumps({"role": "decode", "url": "http://d:1", field: value, **extra})
        with pytest.raises(BadRequest) as caught:
            parse_registration(body, 0.0)
        assert caught.value.message.startswith(f"'{field}'"), caught.value.message
        assert "secret" not in caught.value.message


@pytest.mark.parametrize("value", ["dns+http://x:abc", "dns+http://x:0", "dns+http://u:secret@x:1",
                                   "dns+http://x y:1", "dns+http://x:1#dp=100000",
                                   "dnssrv+http://_x._tcp.x:1"])
def test_dns_names_registered_are_refused_naming_the_field(value: str) -> None:
    import orjson

    from epd_trio._core.roster import parse_name_registration
    with pytest.raises(BadRequest) as caught:
        parse_name_registration(orjson.dumps({"role": "decode", "url": value}))
    assert caught.value.message.startswith("'url': ") and "secret" not in caught.value.message


@pytest.mark.parametrize("fragment", ["#dp=0", "#dp=1025", "#dp=\uff12", "#dp=", "#dq=2",
                                      "#dp=2&dp=3", "#kv_events_replay=tcp://h:1"])
def test_a_bad_fragment_is_refused(fragment: str) -> None:
    _refused({"EPD_PREFILL_URLS": f"http://p:1{fragment}"}, "EPD_PREFILL_URLS")


@pytest.mark.parametrize("variable", ["EPD_HEALTH_TIMEOUT", "EPD_DECODE_POLICY", "EPD_METRICS",
                                      "EPD_STATE_PREFIX", "EPD_SERVICE_DISCOVERY_NAMESPACE"])
def test_a_huge_value_of_any_setting_is_still_one_short_line(variable: str) -> None:
    message = _refused({variable: "x y" * 100_000}, variable)  # a space: no value takes it
    assert len(message) <= ConfigError.MAX_LINE + 3
