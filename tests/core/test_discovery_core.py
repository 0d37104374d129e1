"""Discovery's rules (pure): DNS URLs and answers, pod readiness, watch events, roster changes."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from epd_trio import Instance
from epd_trio.__main__ import build_parser, load_serve_settings, serve_flags
from epd_trio._core.config import ConfigError, Settings, settings_from
from epd_trio._core.discovery import (
    EMPTY_CONFIRMATIONS,
    Discovered,
    DnsName,
    DnsView,
    Empty,
    Failed,
    Found,
    PodView,
    WatchProtocolError,
    address_queries,
    backoff,
    dns_instances,
    ip_address_of,
    next_view,
    parse_dns_url,
    parse_selector,
    pod_endpoint,
    watch_event,
)
from epd_trio._core.roster import Member, Roster, register, replace_source, static_roster

ZERO = {"encode": 0, "prefill": 0, "decode": 0}


# -- URLs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, expected", [
    ("dns+http://vllm-decode.ns.svc:8000#dp=8",
     DnsName("dns+http://vllm-decode.ns.svc:8000#dp=8", "http", "vllm-decode.ns.svc", 8000, "",
             8)),
    ("dns+https://Decode.Example.:8443/v1base/",
     DnsName("dns+https://Decode.Example.:8443/v1base/", "https", "decode.example", 8443,
             "/v1base")),
    ("dns+http://decode", DnsName("dns+http://decode", "http", "decode", 80)),
    ("dnssrv+http://_http._tcp.vllm-decode.ns.svc#dp=2",
     DnsName("dnssrv+http://_http._tcp.vllm-decode.ns.svc#dp=2", "http",
             "_http._tcp.vllm-decode.ns.svc", None, "", 2, srv=True)),
])
def test_dns_urls(spec: str, expected: DnsName) -> None:
    assert parse_dns_url(spec) == expected


@pytest.mark.parametrize("spec, problem", [
    ("dns+http://10.0.0.1:8000", "names an address"),
    ("dns+http://[fd00::1]:8000", "names an address"),
    ("dnssrv+http://_http._tcp.x:8000", "gives its own ports"),
    ("dns+http://x:8000?a=1", "no query"),
    ("dns+http://x:8000#dp=0", "an integer from 1 to"),
    ("dns+http://x:99999", "bad port"),
    ("dns+ftp://x:1", "starts with"),
])
def test_bad_dns_urls(spec: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_dns_url(spec)


@pytest.mark.parametrize("host, address", [
    ("10.96.0.10", "10.96.0.10"), ("::1", "::1"), ("FD00:0:0::A", "fd00::a"),
    ("kube-dns", None), ("kube-dns.kube-system.svc.", None), ("10.96.0", None), ("", None),
    ("[::1]", None),  # brackets are the URL's, not the address's
])
def test_an_ip_address_is_told_from_a_name(host: str, address: str | None) -> None:
    assert ip_address_of(host) == address


def test_settings_take_dns_names_in_the_url_lists() -> None:
    settings = settings_from({"EPD_DECODE_URLS": "http://d0:8000#dp=2,dns+http://vllm-d:8000#dp=4",
                              "EPD_PREFILL_URLS": "dnssrv+http://_http._tcp.vllm-p"})
    assert settings.listed("decode") == (Instance("http://d0:8000", 2),)
    assert [(role, name.spec) for role, name in settings.dns_names()] == [
        ("prefill", "dnssrv+http://_http._tcp.vllm-p"), ("decode", "dns+http://vllm-d:8000#dp=4")]
    # A DNS name alone is a configured decode stage.
    assert settings_from({"EPD_DECODE_URLS": "dns+http://vllm-d:8000"}).layout == "PD"


@pytest.mark.parametrize("given, accepted", [
    ("10.96.0.10", True), ("[::1]:5353", True), ("127.0.0.1:5353", True),
    # A name: resolved once when discovery starts (tests/discovery/test_discovery_dns.py).
    ("kube-dns", True), ("kube-dns.kube-system.svc.cluster.local.:53", True),
    ("dns_server", False), ("bad name", False), ("-x.example", False), ("x.example:0", False),
    ("x.example:99999", False), ("x.example:port", False),
])
def test_the_dns_nameserver_is_an_address_or_a_host_name(given: str, accepted: bool) -> None:
    environ = {"EPD_DECODE_URLS": "http://d:1", "EPD_DNS_NAMESERVER": given}
    if accepted:
        assert settings_from(environ).dns_nameserver == given
    else:
        with pytest.raises(ConfigError, match=r"^EPD_DNS_NAMESERVER: "):
            settings_from(environ)


def test_selectors_take_vllm_routers_spelling() -> None:
    assert parse_selector("app=vllm role=decode") == "app=vllm,role=decode"
    assert parse_selector("app=vllm,tier!=canary,!legacy") == "app=vllm,tier!=canary,!legacy"
    with pytest.raises(ValueError, match="bad label selector"):
        parse_selector("env in (a,b)")
    settings = settings_from({"EPD_SERVICE_DISCOVERY": "true",
                              "EPD_DECODE_SELECTOR": "app=vllm role=decode",
                              "EPD_PREFILL_SELECTOR": "app=vllm,role=prefill"})
    assert settings.selectors() == [("prefill", "app=vllm,role=prefill"),
                                    ("decode", "app=vllm,role=decode")]
    assert settings.layout == "P+D"
    with pytest.raises(ConfigError, match="EPD_DECODE_SELECTOR: is used only with"):
        settings_from({"EPD_DECODE_SELECTOR": "app=x", "EPD_DECODE_URLS": "http://d:1"})
    with pytest.raises(ConfigError, match="needs at least one label selector"):
        settings_from({"EPD_SERVICE_DISCOVERY": "1", "EPD_DECODE_URLS": "http://d:1"})


# -- DNS answers ----------------------------------------------------------------------------------
def serve_settings(*argv: str) -> Settings:
    """The settings ``epd-trio serve ARGV`` would run with (no environment)."""
    return settings_from({}, flags=serve_flags(build_parser().parse_args(["serve", *argv])))


def test_vllm_routers_plain_selector_is_the_decode_selector() -> None:
    settings = serve_settings("--service-discovery", "--selector", "app=vllm", "role=pd")
    assert settings.selectors() == [("decode", "app=vllm,role=pd")]
    assert settings.layout == "PD"
    assert serve_settings("--service-discovery", "--decode-selector", "app=vllm").selectors() == [
        ("decode", "app=vllm")]
    for split in ("--prefill-selector", "--decode-selector"):
        with pytest.raises(ConfigError, match=f"^--selector: .*: give it or {split}, not both"):
            serve_settings("--service-discovery", "--selector", "app=vllm", split, "role=x")


def test_the_plain_selector_is_refused_beside_a_prefill_selector_from_anywhere(
    tmp_path: Path,
) -> None:
    """The flags alone would let a prefill selector from the environment or the config file
    through beside ``--selector``: a P/D split it says there is not."""
    args = build_parser().parse_args(["serve", "--service-discovery", "--selector", "app=vllm"])
    refused = "^--selector: .*: give it or EPD_PREFILL_SELECTOR .*, not both$"
    with pytest.raises(ConfigError, match=refused):
        load_serve_settings(args, {"EPD_PREFILL_SELECTOR": "app=vllm,role=prefill"})
    config = tmp_path / "epd.toml"
    config.write_text('prefill_selector = "app=vllm,role=prefill"\n')
    with pytest.raises(ConfigError, match=refused):
        load_serve_settings(args, {"EPD_CONFIG": str(config)})
    # A decode selector from there is only overridden, as by any flag; an encode one stays.
    settings = load_serve_settings(args, {"EPD_DECODE_SELECTOR": "app=old",
                                          "EPD_ENCODE_SELECTOR": "app=enc"})
    assert settings.selectors() == [("encode", "app=enc"), ("decode", "app=vllm")]


NAME = parse_dns_url("dns+http://vllm-d:8000#dp=2")
SRV = parse_dns_url("dnssrv+http://_http._tcp.vllm-d")


def a_round(view: DnsView, a: object, aaaa: object = Empty("no AAAA")) -> DnsView:
    return next_view(NAME, view, {("vllm-d", "A"): a, ("vllm-d", "AAAA"): aaaa})  # type: ignore[dict-item]


def test_records_replace_the_view_and_give_one_instance_per_address() -> None:
    view = a_round(DnsView(), Found(frozenset({"10.0.0.2", "10.0.0.1"})), Found(frozenset({"fd00::1"})))
    assert [d.instance for d in dns_instances(NAME, view)] == [
        Instance("http://10.0.0.1:8000", 2), Instance("http://10.0.0.2:8000", 2),
        Instance("http://[fd00::1]:8000", 2)]
    view = a_round(view, Found(frozenset({"10.0.0.3"})))
    assert view.endpoints == {("10.0.0.3", 8000)}


def test_a_failure_keeps_the_last_view() -> None:
    view = a_round(DnsView(), Found(frozenset({"10.0.0.1"})), Found(frozenset({"fd00::1"})))
    kept = a_round(view, Failed("timeout"), Failed("timeout"))
    assert kept.endpoints == view.endpoints and "timeout" in (kept.problem or "")
    # One family failing keeps that family's last records; the other's answer is taken.
    mixed = a_round(view, Found(frozenset({"10.0.0.9"})), Failed("SERVFAIL"))
    assert mixed.endpoints == {("10.0.0.9", 8000), ("fd00::1", 8000)}
    # Failing from the start: nothing known, nothing invented.
    assert a_round(DnsView(), Failed("timeout"), Empty("none")).endpoints == frozenset()


def test_an_empty_answer_empties_the_view_only_once_confirmed() -> None:
    view = a_round(DnsView(), Found(frozenset({"10.0.0.1"})))
    for round_number in range(1, EMPTY_CONFIRMATIONS + 1):
        view = a_round(view, Empty("NXDOMAIN"), Empty("NXDOMAIN"))
        assert view.endpoints == {("10.0.0.1", 8000)}, round_number
        assert "unconfirmed" in (view.problem or "")
    view = a_round(view, Empty("NXDOMAIN"), Empty("NXDOMAIN"))
    assert view.endpoints == frozenset() and view.problem is None
    # A failure between empty answers does not reset the count; records do.
    view = a_round(a_round(DnsView(), Found(frozenset({"10.0.0.1"}))), Empty("x"), Empty("x"))
    view = a_round(view, Failed("timeout"), Failed("timeout"))
    assert view.empty_rounds == 1
    assert a_round(view, Found(frozenset({"10.0.0.1"}))).empty_rounds == 0


def test_srv_gives_each_target_and_port_at_its_addresses() -> None:
    srv = Found(frozenset({("p0.vllm-d", 8001), ("p1.vllm-d", 8002)}))
    assert address_queries(SRV, srv) == [("p0.vllm-d", "A"), ("p0.vllm-d", "AAAA"),
                                        ("p1.vllm-d", "A"), ("p1.vllm-d", "AAAA")]
    answers = {("_http._tcp.vllm-d", "SRV"): srv,
               ("p0.vllm-d", "A"): Found(frozenset({"10.0.0.1"})), ("p0.vllm-d", "AAAA"): Empty("-"),
               ("p1.vllm-d", "A"): Found(frozenset({"10.0.0.2"})), ("p1.vllm-d", "AAAA"): Empty("-")}
    view = next_view(SRV, DnsView(), answers)
    assert [d.instance.url for d in dns_instances(SRV, view)] == ["http://10.0.0.1:8001",
                                                                  "http://10.0.0.2:8002"]
    # A target whose name vanished leaves; one whose lookup failed keeps its last addresses.
    gone = {**answers, ("p1.vllm-d", "A"): Empty("NXDOMAIN"), ("p0.vllm-d", "A"): Failed("t/o")}
    assert next_view(SRV, view, gone).endpoints == {("10.0.0.1", 8001)}
    # The SRV query failing keeps everything; no targets to ask then.
    assert address_queries(SRV, Failed("t/o")) == []
    assert next_view(SRV, view, {("_http._tcp.vllm-d", "SRV"): Failed("t/o")}).endpoints == \
        view.endpoints


# -- Kubernetes pods ----------------------------------------------------------------------------
def pod(name: str, ip: str | None = "10.1.0.5", *, phase: str = "Running", ready: str = "True",
        deleting: bool = False, **annotations: str) -> dict:
    return {"metadata": {"name": name, "uid": f"uid-{name}", "namespace": "ns",
                         "resourceVersion": "7", "annotations": annotations,
                         **({"deletionTimestamp": "2026-12-02T10:00:00Z"} if deleting else {})},
            "status": {"phase": phase, "podIP": ip,
                       "conditions": [{"type": "Ready", "status": ready}]}}


def test_a_pod_is_an_instance_when_running_ready_and_not_terminating() -> None:
    assert pod_endpoint(pod("d0"), 8000, "decode") == Discovered(Instance("http://10.1.0.5:8000"))
    assert "Pending" in pod_endpoint(pod("d0", phase="Pending"), 8000, "decode")  # type: ignore[operator]
    assert "not Ready" in pod_endpoint(pod("d0", ready="False"), 8000, "decode")  # type: ignore[operator]
    assert "terminating" in pod_endpoint(pod("d0", deleting=True), 8000, "decode")  # type: ignore[operator]
    assert "no IP" in pod_endpoint(pod("d0", ip=None), 8000, "decode")  # type: ignore[operator]


def test_pod_annotations_give_sizes_port_scheme_and_ec_addresses() -> None:
    found = pod_endpoint(pod("p0", "fd00::5", **{"epd-trio.io/dp-size": "2", "epd-trio.io/port": "9000",
                                                 "epd-trio.io/ec-zmq-addrs": "tcp://a:1, tcp://a:2"}),
                         8000, "prefill")
    assert found == Discovered(Instance("http://[fd00::5]:9000", 2), ("tcp://a:1", "tcp://a:2"))
    tls = pod_endpoint(pod("d", **{"epd-trio.io/scheme": "https"}), 8000, "decode")
    assert isinstance(tls, Discovered) and tls.instance.url == "https://10.1.0.5:8000"
    for bad, problem in [({"epd-trio.io/dp-size": "0"}, "dp-size"),
                         ({"epd-trio.io/ec-zmq-addrs": "tcp://a:1"}, "encoder-cache consumers")]:
        assert problem in pod_endpoint(pod("d", **bad), 8000, "decode")  # type: ignore[operator]


@pytest.mark.parametrize("ip, annotations", [
    ("10.1.0.5 ", {}), ("not-an-ip:1", {}), ("user:pw@10.1.0.5", {}),
    ("10.1.0.5", {"epd-trio.io/dp-size": "5000"}), ("10.1.0.5", {"epd-trio.io/port": "0"}),
    ("10.1.0.5", {"epd-trio.io/port": "\uff18"}),
])
def test_a_pod_that_is_no_usable_instance_is_skipped_with_a_reason(
    ip: str, annotations: dict[str, str]
) -> None:
    """Issue 31: the watch loop must survive what the API server feeds it: such a pod is a
    reason for the log (and no instance), never an exception in the loop."""
    problem = pod_endpoint(pod("d9", ip, **annotations), 8000, "decode")
    assert isinstance(problem, str) and problem.startswith("pod d9 skipped: ")
    assert "pw" not in problem


def line(type_: str, obj: dict) -> bytes:
    return orjson.dumps({"type": type_, "object": obj})


def test_the_view_folds_a_list_and_its_events() -> None:
    view = PodView.listed({"metadata": {"resourceVersion": "10"},
                           "items": [pod("d0", "10.1.0.1"), pod("d1", "10.1.0.2", ready="False")]})
    assert [d.instance.url for d in view.instances(8000, "decode")[0]] == ["http://10.1.0.1:8000"]
    view = view.apply(watch_event(line("MODIFIED", {**pod("d1", "10.1.0.2"),
                                                    "metadata": {**pod("d1")["metadata"],
                                                                 "resourceVersion": "11"}})))
    assert view.resource_version == "11" and len(view.instances(8000, "decode")[0]) == 2
    view = view.apply(watch_event(line("DELETED", pod("d0"))))
    assert [d.instance.url for d in view.instances(8000, "decode")[0]] == ["http://10.1.0.2:8000"]
    bookmark = view.apply(watch_event(line("BOOKMARK", {"kind": "Pod",
                                                        "metadata": {"resourceVersion": "42"}})))
    assert bookmark.resource_version == "42" and bookmark.pods == view.pods
    gone = watch_event(line("ERROR", {"kind": "Status", "code": 410, "reason": "Expired"}))
    assert gone.expired
    with pytest.raises(WatchProtocolError):
        watch_event(b"{not json")
    with pytest.raises(WatchProtocolError):
        watch_event(b'{"type": "ADDED"}')


def test_backoff_doubles_to_a_cap_with_jitter() -> None:
    assert [backoff(n, 1.0) for n in (1, 2, 3, 8, 20)] == [0.5, 1.0, 2.0, 30.0, 30.0]
    assert backoff(3, 0.0) == 1.0  # jitter never below half


# -- the roster -----------------------------------------------------------------------------------
def found(*urls: str) -> list[Discovered]:
    return [Discovered(Instance(url)) for url in urls]


def test_replace_source_joins_and_leaves_keeping_order_and_rotation() -> None:
    roster = static_roster([], [], [Instance("http://static:1")])
    roster, change = replace_source(roster, "dns+http://d:1", "decode", found("http://a:1", "http://b:1"),
                                    ZERO)
    assert change == (["http://a:1", "http://b:1"], [])
    assert [i.url for i in roster.of("decode")] == ["http://static:1", "http://a:1", "http://b:1"]
    assert all(m.source == "dns+http://d:1" for m in roster.members[1:])
    # The same answer again: nothing changes, not even the version (every round applies it).
    same, change = replace_source(roster, "dns+http://d:1", "decode", found("http://b:1", "http://a:1"),
                                  ZERO)
    assert same is roster and change == ([], [])
    # b leaves, c joins at the end; the rotation continues from the counter (decode at 4: slot
    # 4 % 3 = 1 is a, which stays next).
    new, change = replace_source(roster, "dns+http://d:1", "decode", found("http://a:1", "http://c:1"),
                                 {**ZERO, "decode": 4})
    assert change == (["http://c:1"], ["http://b:1"])
    assert [i.url for i in new.of("decode")] == ["http://static:1", "http://a:1", "http://c:1"]
    assert new.version == roster.version + 1
    k0, i0 = new.epochs["decode"]
    assert new.of("decode")[(i0 + 4 - k0) % 3].url == "http://a:1"
    # A URL another member holds stays that member's; an empty answer removes the source's own.
    new, change = replace_source(new, "dns+http://d:1", "decode", found("http://static:1"), ZERO)
    assert change == ([], ["http://a:1", "http://c:1"])
    assert [(m.url, m.static, m.source) for m in new.members] == [("http://static:1", True, None)]


def test_discovered_members_survive_serialization_and_registration() -> None:
    roster, _ = replace_source(Roster(), "kubernetes decode app=x", "decode",
                               [Discovered(Instance("http://10.0.0.1:8000", 4))], ZERO)
    assert Roster.from_bytes(roster.to_bytes()) == roster
    body = {"role": "decode", "url": "http://10.0.0.1:8000", "dp_size": 4}
    from epd_trio._core.roster import parse_registration
    refreshed, created = register(roster, parse_registration(orjson.dumps(body), 5.0), ZERO)
    assert not created and refreshed.members[0].source == "kubernetes decode app=x"


def test_registered_dns_names_are_roster_data() -> None:
    from epd_trio._core.errors import BadRequest, Conflict
    from epd_trio._core.roster import parse_name_registration, register_name, unregister_name

    assert parse_name_registration(orjson.dumps({"role": "decode", "url": "http://d:1"})) is None
    role, name = parse_name_registration(orjson.dumps(  # type: ignore[misc]
        {"role": "decode", "url": "dns+http://vllm-d:8000", "dp_size": 4}))
    assert (role, name.spec, name.dp_size) == ("decode", "dns+http://vllm-d:8000#dp=4", 4)
    with pytest.raises(BadRequest, match="role"):
        parse_name_registration(orjson.dumps({"role": "x", "url": "dns+http://vllm-d:1"}))
    roster, created = register_name(Roster(), "decode", name.spec)
    assert created and roster.version == 1 and roster.names == (("decode", name.spec),)
    assert register_name(roster, "decode", name.spec) == (roster, False)
    with pytest.raises(Conflict):
        register_name(roster, "prefill", name.spec)
    roster, _ = replace_source(roster, name.spec, "decode", found("http://a:1"), ZERO)
    assert Roster.from_bytes(roster.to_bytes()) == roster
    gone, removed = unregister_name(roster, name.spec, ZERO)
    assert removed and gone.names == () and gone.members == () and gone.version > roster.version
    assert unregister_name(gone, name.spec, ZERO) == (gone, False)


def test_discovered_members_stay_each_replicas_own_with_a_shared_roster() -> None:
    from epd_trio._core.shared_state import Record, merge, records_of

    roster = static_roster([], [], [Instance("http://static:1")])
    roster, _ = replace_source(roster, "dns+http://d:1", "decode", found("http://a:1"), ZERO)
    assert records_of(roster) == {}  # nothing of it goes to the store
    registered = Record(Member(Instance("http://r:1"), "decode", registered_at=5.0))
    merged, skipped = merge(roster, {"http://r:1": registered}, ZERO)
    assert not skipped
    assert [(m.url, m.source) for m in merged.members] == [
        ("http://static:1", None), ("http://a:1", "dns+http://d:1"), ("http://r:1", None)]


def test_the_hosts_file_answers_the_names_it_lists() -> None:
    from epd_trio._core.discovery import Empty, Found, hosts_file_answers
    text = ("127.0.0.1 localhost\n::1 localhost ip6-localhost  # both families\n"
            "# 10.0.0.9 commented\n10.0.0.5 vllm-a VLLM-B.local.\nnot-an-ip vllm-c\n\n"
            "fe80::1%eth0 vllm-c\n")
    assert hosts_file_answers(text, "localhost") == {
        ("localhost", "A"): Found(frozenset({"127.0.0.1"})),
        ("localhost", "AAAA"): Found(frozenset({"::1"}))}
    answers = hosts_file_answers(text, "vllm-b.local")
    assert answers[("vllm-b.local", "A")] == Found(frozenset({"10.0.0.5"}))
    assert isinstance(answers[("vllm-b.local", "AAAA")], Empty)
    assert hosts_file_answers(text, "vllm-c") == {}  # a bad line names nothing
    assert hosts_file_answers(text, "commented") == {}
    assert hosts_file_answers("", "localhost") == {}
