"""Settings parsing: environment, TOML file, and one clear error naming the variable."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from epd_trio import ConfigError, Instance, load_settings, settings_from


def test_environment_settings() -> None:
    s = settings_from({
        "EPD_ENCODE_URLS": "http://e0:1, http://e1:1/",
        "EPD_PREFILL_URLS": "http://p0:1#dp=2",
        "EPD_DECODE_URLS": "http://d0:1#dp=4,http://d1:1#dp=4",
        "EPD_ENCODER_MAX_BATCH": "2",
        "EPD_PREFILL_TIMEOUT": "12.5",
        "UNRELATED": "x",
    })
    assert s.encode_urls == (Instance("http://e0:1"), Instance("http://e1:1"))
    assert s.prefill_urls == (Instance("http://p0:1", 2),)
    assert s.decode_urls == (Instance("http://d0:1", 4), Instance("http://d1:1", 4))
    assert s.encoder_max_batch == 2 and s.prefill_timeout == 12.5
    assert s.layout == "E+P+D"


def test_layouts() -> None:
    assert settings_from({"EPD_DECODE_URLS": "http://d:1"}).layout == "PD"
    assert settings_from({"EPD_DECODE_URLS": "http://d:1", "EPD_ENCODE_URLS": "http://e:1"}
                         ).layout == "E+PD"
    assert settings_from({"EPD_DECODE_URLS": "http://d:1", "EPD_PREFILL_URLS": "http://p:1"}
                         ).layout == "P+D"


@pytest.mark.parametrize(
    "env, variable",
    [
        ({}, "EPD_DECODE_URLS"),
        ({"EPD_DECODE_URLS": " , "}, "EPD_DECODE_URLS"),
        ({"EPD_DECODE_URLS": "d0:8000"}, "EPD_DECODE_URLS"),
        ({"EPD_DECODE_URLS": "http://d:1#dp=zero"}, "EPD_DECODE_URLS"),
        ({"EPD_DECODE_URLS": "http://d:1,http://d:1/"}, "EPD_DECODE_URLS"),
        ({"EPD_DECODE_URLS": "http://d:1", "EPD_ENCODER_MAX_BATCH": "-1"},
         "EPD_ENCODER_MAX_BATCH"),
        ({"EPD_DECODE_URLS": "http://d:1", "EPD_CONNECT_TIMEOUT": "inf"}, "EPD_CONNECT_TIMEOUT"),
        ({"EPD_DECODE_URLS": "http://d:1", "EPD_DECODE_TIMEOUT": "0"}, "EPD_DECODE_TIMEOUT"),
        ({"EPD_DECODE_URLS": "http://d:1", "EPD_MAX_BODY_BYTES": "lots"}, "EPD_MAX_BODY_BYTES"),
        ({"EPD_DECODE_URLS": "http://d:1", "EPD_METRICS": "maybe"}, "EPD_METRICS"),
        ({"EPD_DECODE_URLS": "http://d:1", "EPD_LOG_LEVEL": "loud"}, "EPD_LOG_LEVEL"),
        ({"EPD_DECODE_URLS": "http://d:1", "EPD_LOG_FORMAT": "xml"}, "EPD_LOG_FORMAT"),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from(env)
    assert info.value.variable == variable
    assert str(info.value).startswith(variable + ":")
    assert "\n" not in str(info.value)


def test_config_file_with_environment_override(tmp_path: Path) -> None:
    path = tmp_path / "epd.toml"
    path.write_text(
        'decode_urls = ["http://d0:1#dp=2", "http://d1:1#dp=2"]\n'
        'encode_urls = "http://e0:1"\n'
        "encoder_max_batch = 3\n"
        "stream_idle_timeout = 30\n"
    )
    s = load_settings({"EPD_CONFIG": str(path), "EPD_ENCODER_MAX_BATCH": "1"})
    assert s.decode_urls == (Instance("http://d0:1", 2), Instance("http://d1:1", 2))
    assert s.encode_urls == (Instance("http://e0:1"),)
    assert s.encoder_max_batch == 1 and s.stream_idle_timeout == 30.0


@pytest.mark.parametrize(
    "content, fragment",
    [("decode_urls = [", "not valid TOML"), ('decode_url = "http://d:1"', "unknown setting")],
)
def test_bad_config_file(tmp_path: Path, content: str, fragment: str) -> None:
    path = tmp_path / "epd.toml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=fragment):
        load_settings({"EPD_CONFIG": str(path)})


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="EPD_CONFIG: cannot read"):
        load_settings({"EPD_CONFIG": str(tmp_path / "absent.toml")})


def test_observability_settings() -> None:
    s = settings_from({"EPD_DECODE_URLS": "http://d:1"})
    assert (s.metrics, s.request_log, s.log_level, s.log_format) == (True, False, "INFO", "text")
    s = settings_from({"EPD_DECODE_URLS": "http://d:1", "EPD_METRICS": "off",
                       "EPD_REQUEST_LOG": "Yes", "EPD_LOG_LEVEL": "debug",
                       "EPD_LOG_FORMAT": " JSON "})
    assert (s.metrics, s.request_log, s.log_level, s.log_format) == (False, True, "DEBUG", "json")
    s = settings_from({}, {"decode_urls": "http://d:1", "request_log": True, "metrics": False},
                      flags={"metrics": True, "request_log": None})
    assert s.metrics is True and s.request_log is True  # a flag wins; None = not given


@pytest.mark.parametrize(("value", "expected"), [(None, 10_000), ("12345", 12_345), ("0", 700)])
def test_the_served_app_tunes_the_garbage_collector(value: str | None, expected: int) -> None:
    """``epd_trio.app`` (the hypercorn entry point) sets the young-generation threshold."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env["EPD_DECODE_URLS"] = "http://127.0.0.1:9"
    if value is not None:
        env["EPD_GC_THRESHOLD"] = value
    out = subprocess.run(
        [sys.executable, "-c", "import gc, epd_trio.app; print(gc.get_threshold()[0])"],
        env=env, capture_output=True, text=True, check=True, timeout=60)
    assert int(out.stdout) == expected


@pytest.mark.parametrize(("env", "expected"), [
    ({}, 4.0),
    ({"EPD_UPSTREAM_KEEPALIVE": "2.5"}, 2.5),
    ({"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "5"}, 4.0),  # vLLM's default: ours stays below it
    ({"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "2"}, 1.6),  # an operator lowered vLLM's: so is ours
    ({"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "2", "EPD_UPSTREAM_KEEPALIVE": "3"}, 3.0),  # ours wins
])
def test_upstream_keepalive_stays_below_vllms(env: dict[str, str], expected: float) -> None:
    settings = settings_from({"EPD_DECODE_URLS": "http://d:1", **env})
    assert settings.upstream_keepalive == pytest.approx(expected)


@pytest.mark.parametrize("variable", ["EPD_UPSTREAM_KEEPALIVE", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"])
@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_a_keepalive_that_is_not_positive_is_refused_naming_it(variable: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from({"EPD_DECODE_URLS": "http://d:1", variable: value})
    assert str(info.value).startswith(f"{variable}:")


async def test_the_upstream_pools_use_the_keepalive_setting() -> None:
    from epd_trio import Proxy, Settings
    proxy = Proxy(Settings(decode_urls=(Instance("http://d:1"),), upstream_keepalive=1.5))
    await proxy.start()
    try:
        assert proxy._upstream is not None and proxy._upstream._keepalive_expiry == 1.5
    finally:
        await proxy.aclose()


def test_unknown_epd_variables_are_named_with_the_closest_known_one() -> None:
    from epd_trio._core.config import unknown_settings
    environ = {"EPD_PREFIL_URLS": "http://p:1", "EPD_DECODE_POLICE": "least_loaded",
               "EPD_DECODE_URLS": "http://d:1", "EPD_CONFIG": "", "EPD_BENCH_EPD_PROXY": "x",
               "EPD_E2E_HOME": "/tmp", "EPD_VLLM_HOME": "/tmp", "VLLM_X": "1"}
    assert unknown_settings(environ) == [("EPD_DECODE_POLICE", "EPD_DECODE_POLICY"),
                                         ("EPD_PREFIL_URLS", "EPD_PREFILL_URLS")]


def test_the_start_up_warns_about_unknown_settings(caplog: pytest.LogCaptureFixture) -> None:
    settings = load_settings({"EPD_DECODE_URLS": "http://d:1", "EPD_PREFIL_URLS": "http://p:1"})
    assert settings.prefill_urls == ()  # ignored, as before, but no longer silently
    (record,) = [r for r in caplog.records if "EPD_PREFIL_URLS" in r.getMessage()]
    assert record.levelname == "WARNING" and "did you mean EPD_PREFILL_URLS?" in record.getMessage()


@pytest.mark.parametrize(("raw", "expected"), [("0", 0.0), ("0.0", 0.0), (0, 0.0), ("0.5", 0.5)])
def test_the_admission_timeout_may_be_zero(raw: object, expected: float) -> None:
    assert settings_from({"EPD_DECODE_URLS": "http://d:1"},
                         {"admission_timeout": raw}).admission_timeout == expected


@pytest.mark.parametrize("raw", ["-1", "soon", "inf", False, True])
def test_a_bad_admission_timeout_is_refused(raw: object) -> None:
    with pytest.raises(ConfigError):
        settings_from({"EPD_DECODE_URLS": "http://d:1"}, {"admission_timeout": raw})


@pytest.mark.parametrize(("raw", "accepted"), [("0.05", True), ("0.25", True), ("1", True),
                                               ("1.5", False), ("60", False)])
def test_a_load_interval_that_would_break_the_5_s_promise_is_refused_naming_it(
    raw: str, accepted: bool,
) -> None:
    env = {"EPD_STATE_URL": "redis://r", "EPD_STATE_LOAD_INTERVAL": raw}
    if accepted:
        assert settings_from(env).state_load_interval == float(raw)
        return
    with pytest.raises(ConfigError, match=r"^EPD_STATE_LOAD_INTERVAL: at most 1 s: .*within 5 s"):
        settings_from(env)
