"""Several models behind one proxy, end to end over real sockets: each request reaches only its
own model's instances on every leg; each pool keeps its own cursors; the answers a client gets
for a name nobody serves, a pool missing a stage, a body without a model; aliases and canaries;
tenants' model lists; pools learned from the top-level lists and from registrations."""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Any

import httpx
import orjson
import trio
import trio.testing

from epd_trio import Instance, Settings
from epd_trio._core.config import parse_setting
from epd_trio.testing import FakeVLLM, Fleet, run_fleet, serve_proxy

from helpers import CHAT, chat_body, image, metric, poll_until, start_fakes

#: qwen: E -> P -> D; llama: P -> D; embed: decode alone.
THREE = {"qwen": (2, (2, 1), (2, 1)), "llama": (0, (1, 1), (2, 2)), "embed": (0, (0, 1), (2, 1))}


def body(model: str | None, *items: dict[str, Any], **extra: Any) -> dict[str, Any]:
    out = chat_body(*items, **extra)
    if model is None:
        del out["model"]
    else:
        out["model"] = model
    return out


def legs(fleet: Fleet) -> dict[str, Counter[str]]:
    """Which models each model's fakes were asked for, on every leg (the model a leg names)."""
    seen: dict[str, Counter[str]] = {}
    for model, roles in fleet.fakes.items():
        seen[model] = Counter(r.body["model"] for group in roles.values() for fake in group
                              for r in fake.requests())
    return seen


async def test_three_models_side_by_side_each_only_on_its_own_instances(
    client: httpx.AsyncClient,
) -> None:
    async with run_fleet(THREE) as fleet:
        for n in range(4):
            for model in THREE:
                r = await client.post(fleet.proxy_url + CHAT,
                                      json=body(model, image(n), stream=n % 2 == 1))
                assert r.status_code == 200, r.text
        assert legs(fleet) == {"qwen": Counter(qwen=4 * 3),  # one encode (one item), P, D each
                               "llama": Counter(llama=4 * 2), "embed": Counter(embed=4)}
        qwen, llama, embed = (fleet.fakes[m] for m in THREE)
        assert [len(f.requests()) for f in qwen["encode"]] == [2, 2]
        assert [len(f.requests()) for f in qwen["prefill"] + qwen["decode"]] == [2, 2, 2, 2]
        # llama's media goes to its prefill unencoded (its pool has no encoder).
        assert [len(f.requests()) for f in llama["prefill"]] == [4]
        # llama decodes: flat interleaved over (instance, rank): d0 r0, d1 r0, d0 r1, d1 r1.
        ranks = [(fleet.fakes["llama"]["decode"].index(f), r.rank)
                 for f in llama["decode"] for r in f.requests()]
        assert sorted(ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert [len(f.requests()) for f in embed["decode"]] == [2, 2]
        listing = (await client.get(fleet.proxy_url + "/v1/models")).json()
        assert [c["id"] for c in listing["data"]] == ["qwen", "llama", "embed"]
        assert {c["root"] for c in listing["data"]} == {"qwen", "llama", "embed"}


async def test_each_pool_keeps_its_own_encoder_cursor_under_interleaved_traffic(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """Seed 1 per model: A's single-image requests go round its three encoders in turn,
    whatever B sends between them. Here every instance serves both names: only the cursors
    tell the pools apart (production-stack #915: one counter shared by every model skewed
    each model's spread)."""
    encoders = [FakeVLLM("encode", served_names=("A", "B")) for _ in range(3)]
    decode = FakeVLLM("prefill_decode", served_names=("A", "B"))
    await start_fakes(nursery, *encoders, decode)
    settings = Settings(encode_urls=tuple(Instance(e.url) for e in encoders),
                        decode_urls=(Instance(decode.url),))
    sequence = "ABBABAABBBAA"
    async with serve_proxy(settings) as (url, _):
        for n, model in enumerate(sequence):
            r = await client.post(url + CHAT, json=body(model, image(n)),
                                  headers={"x-request-id": f"{n:03d}"})
            assert r.status_code == 200, r.text
    went = {req.request_id.split("-")[0]: index for index, e in enumerate(encoders)
            for req in e.requests() if req.request_id}
    for model in "AB":
        turns = [went[f"{n:03d}"] for n, m in enumerate(sequence) if m == model]
        first = turns[0]
        assert turns == [(first + k) % 3 for k in range(6)], (model, turns)


NOT_FOUND = {"error": {"message": "The model `nosuch` does not exist.", "type": "NotFoundError",
                       "param": "model", "code": 404}}


async def test_the_answers_404_400_and_503_each_before_any_leg(client: httpx.AsyncClient) -> None:
    # Three failed probes evict (0.15 s apart at least): a probe slowed by a busy machine does
    # not take out an instance of the pools that must stay complete.
    async with run_fleet(THREE, health_interval=0.05, health_threshold=3) as fleet:
        url = fleet.proxy_url + CHAT
        # A name nobody serves: vLLM's own 404, and no instance was asked anything.
        r = await client.post(url, json=body("nosuch", image(1)))
        assert r.status_code == 404 and r.json() == NOT_FOUND
        # No model among several: a 400 naming the field.
        r = await client.post(url, json=body(None))
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert "qwen" in r.json()["error"]["message"]
        assert all(not f.requests() for f in fleet.all())
        # llama's decodes go: its requests get a 503 naming the model and the stage.
        for fake in fleet.fakes["llama"]["decode"]:
            fake.behaviour.healthy = False
        gone = trio.Event()
        fleet.proxy.registry.on_change.append(lambda state: not any(
            fleet.proxy.registry.state("decode", f.url).live
            for f in fleet.fakes["llama"]["decode"]) and gone.set())
        with trio.fail_after(10):
            await gone.wait()
        r = await client.post(url, json=body("llama"))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["message"] == ("model 'llama' has no live decode instance in "
                                                "its pool")
        assert not any(f.requests() for f in fleet.fakes["llama"]["prefill"])
        # The other models serve on; /v1/models lists only what can serve now.
        assert (await client.post(url, json=body("embed"))).status_code == 200
        proxy = fleet.proxy
        await trio.testing.wait_all_tasks_blocked()  # counted once its reply went out
        assert metric(proxy, "epd_trio_model_not_found_total") == 1  # one count, no name
        assert metric(proxy, "epd_trio_requests_total", model="nosuch") == 0
        assert metric(proxy, "epd_trio_requests_total", outcome="no_instance",
                      model="llama") == 1
        assert metric(proxy, "epd_trio_requests_total", outcome="ok", model="embed") == 1
        assert {m: metric(proxy, "epd_trio_model_pool_complete", model=m) for m in THREE} == {
            "qwen": 1, "llama": 0, "embed": 1}
        listing = (await client.get(fleet.proxy_url + "/v1/models")).json()
        assert [c["id"] for c in listing["data"]] == ["qwen", "embed"]


async def test_one_model_a_body_without_model_goes_to_it_and_every_leg_names_it(
    client: httpx.AsyncClient,
) -> None:
    async with run_fleet({"solo": (1, (1, 1), (1, 1))}) as fleet:
        r = await client.post(fleet.proxy_url + CHAT, json=body(None, image(3)))
        assert r.status_code == 200, r.text
        assert {r.body["model"] for f in fleet.all() for r in f.requests()} == {"solo"}
        r = await client.post(fleet.proxy_url + CHAT, json=body("nosuch"))
        assert r.status_code == 404 and r.json() == NOT_FOUND


async def test_pools_learned_from_the_top_level_lists(client: httpx.AsyncClient) -> None:
    """No tables: every instance of the lists said what it serves, and that made the pools."""
    async with run_fleet(THREE, tables=False) as fleet:
        for model in THREE:
            for n in range(2):
                r = await client.post(fleet.proxy_url + CHAT, json=body(model, image(n)))
                assert r.status_code == 200, r.text
        assert legs(fleet) == {"qwen": Counter(qwen=6), "llama": Counter(llama=4),
                               "embed": Counter(embed=2)}


CANARY = {"targets": {"stable": 90, "canary": 10}}
TWO = {"stable": (0, (0, 1), (1, 1)), "canary": (0, (0, 1), (1, 1))}


async def send_all(client: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]],
                   headers: list[dict[str, str]] | None = None) -> list[httpx.Response]:
    """Every body sent, 16 at a time; the answers in order."""
    answers: list[httpx.Response | None] = [None] * len(bodies)
    limit = trio.CapacityLimiter(16)

    async def one(n: int) -> None:
        async with limit:
            answers[n] = await client.post(url + CHAT, json=bodies[n],
                                           headers=headers[n] if headers else None)

    async with trio.open_nursery() as nursery:
        for n in range(len(bodies)):
            nursery.start_soon(one, n)
    assert all(a is not None and a.status_code == 200 for a in answers), answers
    return answers  # type: ignore[return-value]


async def test_an_alias_splits_by_weight_exactly_and_each_leg_names_the_target(
    client: httpx.AsyncClient,
) -> None:
    async with run_fleet(TWO, model_aliases={"chat": CANARY}) as fleet:
        answers = await send_all(client, fleet.proxy_url, [body("chat") for _ in range(1000)])
        # The answer names the target, as vLLM writes it (its first served name).
        assert Counter(orjson.loads(a.content)["model"] for a in answers) == {
            "stable": 900, "canary": 100}
        assert legs(fleet) == {"stable": Counter(stable=900), "canary": Counter(canary=100)}
        await trio.testing.wait_all_tasks_blocked()  # counted once its reply went out
        assert {target: metric(fleet.proxy, "epd_trio_alias_picks_total", alias="chat",
                               target=target) for target in TWO} == {"stable": 900, "canary": 100}
        # The request metrics' model is the pool each went to: a bounded label.
        assert metric(fleet.proxy, "epd_trio_requests_total", model="canary") == 100
        listing = (await client.get(fleet.proxy_url + "/v1/models")).json()
        assert [c["id"] for c in listing["data"]] == ["stable", "canary", "chat"]


async def test_a_sticky_alias_keeps_each_session_on_one_target(client: httpx.AsyncClient) -> None:
    async with run_fleet(TWO, model_aliases={"chat": {**CANARY, "hidden": True}},
                         alias_sticky_header="x-session-id") as fleet:
        sessions = [f"user-{k}" for k in range(300)]
        headers = [{"x-session-id": s} for s in sessions for _ in range(3)]
        answers = await send_all(client, fleet.proxy_url, [body("chat")] * len(headers), headers)
        target: dict[str, set[str]] = {}
        for h, a in zip(headers, answers, strict=True):
            target.setdefault(h["x-session-id"], set()).add(orjson.loads(a.content)["model"])
        assert all(len(t) == 1 for t in target.values())  # no session flips
        canary = sum(t == {"canary"} for t in target.values())
        assert 15 <= canary <= 45, canary  # 10 % of 300 sessions, give or take the hash
        listing = (await client.get(fleet.proxy_url + "/v1/models")).json()
        assert "chat" not in [c["id"] for c in listing["data"]]  # hidden


async def test_a_tenants_model_list_hides_the_rest(client: httpx.AsyncClient) -> None:
    tenants = {"team": {"keys": ["team-key"], "models": ["chat"]},
               "ops": {"keys": ["ops-key"]}}
    async with run_fleet(TWO, model_aliases={"chat": CANARY}, tenants=tenants) as fleet:
        team, ops = ({"authorization": f"Bearer {k}"} for k in ("team-key", "ops-key"))
        url = fleet.proxy_url
        r = await client.post(url + CHAT, json=body("chat"), headers=team)
        assert r.status_code == 200
        r = await client.post(url + CHAT, json=body("stable"), headers=team)
        assert r.status_code == 404 and r.json()["error"]["message"] == (
            "The model `stable` does not exist.")
        assert (await client.post(url + CHAT, json=body("stable"), headers=ops)).status_code == 200
        seen = (await client.get(url + "/v1/models", headers=team)).json()
        assert [c["id"] for c in seen["data"]] == ["chat"]
        seen = (await client.get(url + "/v1/models", headers=ops)).json()
        assert [c["id"] for c in seen["data"]] == ["stable", "canary", "chat"]


async def test_a_models_own_cap_holds_it_alone(client: httpx.AsyncClient) -> None:
    """``max_inflight`` in a model's table: over it, that model's requests wait, then get a
    503 naming its limit; the other models go on meanwhile."""
    async with run_fleet(TWO, admission_timeout=0,
                         pool_settings={"stable": {"max_inflight": 1}}) as fleet:
        (held,) = fleet.fakes["stable"]["decode"]
        release = trio.Event()
        held.behaviour.gate = release.wait
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, fleet.proxy_url + CHAT, json=body("stable")))
            await held.wait_until(lambda: held.in_flight == 1)
            r = await client.post(fleet.proxy_url + CHAT, json=body("stable"))
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "model 'stable''s limit of 1 requests" in r.json()["error"]["message"]
            other = await client.post(fleet.proxy_url + CHAT, json=body("canary"))
            assert other.status_code == 200
            release.set()
        assert len(held.requests()) == 1


async def test_a_registered_instance_joins_the_pool_of_what_it_serves(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """An instance that registers is asked what it serves before its registration is
    answered: its model is routable at once, and only to it."""
    async with run_fleet({"A": (0, (0, 1), (1, 1))}, admin_key="k") as fleet:
        r = await client.post(fleet.proxy_url + CHAT, json=body("B"))
        assert r.status_code == 404  # nobody serves B yet
        (b,) = await start_fakes(nursery, FakeVLLM("prefill_decode", model="B"))
        r = await client.post(fleet.proxy_url + "/instances", headers={"x-api-key": "k"},
                              json={"role": "prefill_decode", "url": b.url})
        assert r.json() == {"registered": True}
        for model in "BAB":
            assert (await client.post(fleet.proxy_url + CHAT, json=body(model))).status_code == 200
        assert len(b.requests()) == 2 and legs(fleet)["A"] == Counter(A=1)
        listed = (await client.get(fleet.proxy_url + "/instances",
                                   headers={"x-api-key": "k"})).json()
        (entry,) = [e for e in listed["instances"]["prefill_decode"] if e["url"] == b.url]
        assert (entry["models"], entry["models_from"]) == (["B"], "/v1/models")


class Silent:
    """An instance that takes every connection and never answers: each request's path is
    recorded, then held until the test ends (a server hung, or behind a dead link)."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def serve(self, nursery: trio.Nursery) -> str:
        listeners = await nursery.start(partial(trio.serve_tcp, self._hold, 0, host="127.0.0.1"))
        return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"

    async def _hold(self, stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = await stream.receive_some()
            if not data:
                return
            head += data
        self.paths.append(head.split(b" ", 2)[1].decode())
        await trio.sleep_forever()


async def test_a_registration_does_not_wait_on_an_instance_that_never_answered(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """A registration asks the instance it names, and only that one: another that did not
    answer is the learner's to ask again at its next round, and would otherwise hold every
    registration for up to the probe timeout."""
    silent = Silent()
    silent_url = await silent.serve(nursery)
    (a, b) = await start_fakes(nursery, FakeVLLM("prefill_decode", model="A"),
                               FakeVLLM("prefill_decode", model="B"))
    config = Settings(decode_urls=(Instance(a.url), Instance(silent_url)), admin_key="k",
                      health_timeout=2.0, models_interval=3600.0)
    async with serve_proxy(config) as (url, _proxy):
        asked = silent.paths.count("/v1/models")  # once before serving, in vain
        r = await client.post(url + "/instances", headers={"x-api-key": "k"},
                              json={"role": "prefill_decode", "url": b.url})
        assert r.json() == {"registered": True}
        assert silent.paths.count("/v1/models") == asked  # not asked again for B's sake
        assert (await client.post(url + CHAT, json=body("B"))).status_code == 200  # B was asked
        assert len(b.requests()) == 1


async def test_an_instance_registered_again_after_it_left_is_asked_again(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """Its answer left with it (a vLLM restart: DELETE, then POST): the registration asks it
    again, so its models route as soon as the registration is answered."""
    admin = {"x-api-key": "k"}
    async with run_fleet({"A": (0, (0, 1), (1, 1))}, admin_key="k") as fleet:
        (b,) = await start_fakes(nursery, FakeVLLM("prefill_decode", model="B"))
        for _ in range(2):
            r = await client.post(fleet.proxy_url + "/instances", headers=admin,
                                  json={"role": "prefill_decode", "url": b.url})
            assert r.json() == {"registered": True}
            r = await client.post(fleet.proxy_url + CHAT, json=body("B"))
            assert r.status_code == 200, r.text
            r = await client.delete(fleet.proxy_url + "/instances", headers=admin,
                                    params={"url": b.url})
            assert r.json() == {"removed": True}
            r = await client.post(fleet.proxy_url + CHAT, json=body("B"))
            assert r.status_code == 404  # its name left with it
        assert len(b.requests()) == 2


def parse_file_tables(values: dict[str, Any]) -> dict[str, Any]:
    """Settings' values as a config file's (its tables parsed)."""
    return {key: parse_setting(key, value, key) for key, value in values.items()}


async def adapter_fleet(nursery: trio.Nursery, held_by: tuple[int, int] | None = (1, 2),
                        **settings: Any) -> Any:
    """Four prefill and four decode instances of model L; prefill ``held_by[0]`` and decode
    ``held_by[1]`` hold adapter ``sql``."""
    prefills = [FakeVLLM("prefill", model="L") for _ in range(4)]
    decodes = [FakeVLLM("decode", model="L") for _ in range(4)]
    if held_by is not None:
        prefills[held_by[0]].adapters["sql"] = "/adapters/sql"
        decodes[held_by[1]].adapters["sql"] = "/adapters/sql"
    await start_fakes(nursery, *prefills, *decodes)
    config = Settings(prefill_urls=tuple(Instance(f.url) for f in prefills),
                      decode_urls=tuple(Instance(f.url) for f in decodes), **settings)
    return prefills, decodes, config


async def test_an_adapter_request_reaches_a_holder_on_prefill_and_decode_both(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    prefills, decodes, config = await adapter_fleet(nursery)
    async with serve_proxy(config) as (url, _proxy):
        answers = await send_all(client, url, [body("sql", stream=n % 2 == 1)
                                               for n in range(200)])
        assert len(answers) == 200
        assert [len(f.requests()) for f in prefills] == [0, 200, 0, 0]
        assert [len(f.requests()) for f in decodes] == [0, 0, 200, 0]
        # The base model's requests still go round every instance.
        await send_all(client, url, [body("L") for _ in range(8)])
        assert [len(f.requests()) for f in decodes] == [2, 2, 202, 2]
        listing = (await client.get(url + "/v1/models")).json()
        assert [(c["id"], c["parent"]) for c in listing["data"]] == [("L", None), ("sql", "L")]
        # Its answers are the adapter's (the engine writes the adapter's name).
        r = await client.post(url + CHAT, json=body("sql"))
        assert r.json()["model"] == "sql"


async def test_an_adapter_no_live_decode_holds_is_a_503_naming_it_and_the_stage(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    # Three failed probes evict: one slowed by a busy machine does not take out a holder.
    prefills, decodes, config = await adapter_fleet(nursery, health_interval=0.05,
                                                    health_threshold=3)
    async with serve_proxy(config) as (url, proxy):
        decodes[2].behaviour.healthy = False
        gone = trio.Event()
        proxy.registry.on_change.append(lambda state: state.url == decodes[2].url
                                        and not state.live and gone.set())
        with trio.fail_after(10):
            await gone.wait()
        r = await client.post(url + CHAT, json=body("sql"))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "adapter_unavailable"
        assert r.json()["error"]["message"] == ("adapter 'sql' of model 'L' is held by no "
                                                "live decode instance")
        assert not any(f.requests() for f in prefills)


LOADABLE = {"adapters": {"sql-v2": {"base": "L", "path": "/adapters/sql-v2"}},
            "lora_load": True}


async def test_fifty_requests_for_an_adapter_nobody_holds_load_it_once_per_stage(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    prefills, decodes, config = await adapter_fleet(nursery, **parse_file_tables(LOADABLE))
    async with serve_proxy(config) as (url, proxy):
        listing = (await client.get(url + "/v1/models")).json()
        assert ("sql-v2", "L") in [(c["id"], c["parent"]) for c in listing["data"]]
        answers = await send_all(client, url, [body("sql-v2") for _ in range(50)])
        assert {orjson.loads(a.content)["model"] for a in answers} == {"sql-v2"}
        loads = [(f.role, f.loads) for f in prefills + decodes if f.loads]
        assert sorted(role for role, _ in loads) == ["decode", "prefill"]  # one each
        assert all(names == ["sql-v2"] for _, names in loads)
        holders = [f for f in prefills + decodes if f.loads]
        assert sum(len(f.requests(CHAT)) for f in holders) == 100  # every leg to them
        # Every worker routes to it now: the load is in the roster, like an answer.
        (entry,) = [e for e in proxy.instances()["instances"]["decode"]
                    if "sql-v2" in e.get("adapters", ())]
        (decode,) = [f for f in holders if f.role == "decode"]
        assert entry["url"] == decode.url


async def test_another_endpoint_loads_an_adapter_nobody_holds_on_its_decode_alone(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """vLLM's other endpoints take an adapter as a chat request does, loading included: on
    the one stage they use (decode), not on a prefill they never reach."""
    prefills, decodes, config = await adapter_fleet(nursery, **parse_file_tables(LOADABLE))
    async with serve_proxy(config) as (url, _proxy):
        r = await client.post(url + "/tokenize", json={"model": "sql-v2", "prompt": "hi"})
        assert r.status_code == 200, r.text
        (loaded,) = [f for f in decodes if f.loads]
        assert loaded.loads == ["sql-v2"] and len(loaded.requests("/tokenize")) == 1
        assert not any(f.loads or f.requests() for f in prefills)


async def test_a_failed_load_is_a_503_naming_the_instance_and_it_is_not_asked_again(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    _, decodes, config = await adapter_fleet(
        nursery, held_by=None, health_interval=3600, **parse_file_tables(LOADABLE))
    for fake in decodes:
        fake.lora_paths = frozenset()  # it finds no such path: vLLM's 404
    async with serve_proxy(config) as (url, _proxy):
        r = await client.post(url + CHAT, json=body("sql-v2"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "adapter_load_failed"
        message = r.json()["error"]["message"]
        (asked,) = [f for f in decodes if f.requests("/v1/load_lora_adapter")]
        assert message.startswith(f"loading adapter 'sql-v2' at decode instance {asked.url} "
                                  "failed:")
        assert "No adapter found for /adapters/sql-v2" in message  # vLLM's own words
        for _ in range(3):
            assert (await client.post(url + CHAT, json=body("sql-v2"))).status_code == 503
        # Each instance asked once: the one that failed is not asked again.
        assert [len(f.requests("/v1/load_lora_adapter")) for f in decodes] == [1, 1, 1, 1]
        assert not any(f.requests(CHAT) for f in decodes)


async def test_an_adapters_holders_running_it_are_preferred_when_loads_are_scraped(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """With the load scrape on, holders are ranked by vLLM's ``vllm:lora_requests_info``:
    the decode running the adapter takes its requests before one that would have to swap it
    in; the pool's policy still chooses among equals."""
    _, decodes, config = await adapter_fleet(nursery, load_scrape_interval=0.05)
    decodes[0].adapters["sql"] = "/adapters/sql"  # two decode holders now: 0 and 2
    decodes[0].lora_info = (("a", "b"), (), 2)  # full: it would have to swap sql in
    decodes[2].lora_info = (("sql",), (), 2)
    async with serve_proxy(config) as (url, proxy):
        # The scrape has no event to wait on: polled.
        await poll_until(lambda: len(proxy.loads.lora) == 2, 10)
        await send_all(client, url, [body("sql") for _ in range(6)])
        assert [len(f.requests(CHAT)) for f in decodes] == [0, 0, 6, 0]
        decodes[2].lora_info = (("x", "y"), (), 2)  # now the other one has room
        decodes[0].lora_info = (("a",), (), 2)
        # A scrape round may straddle the change: wait until both new states are read.
        def read(fake: FakeVLLM) -> set[str] | None:
            info = proxy.loads.lora.get(fake.url)  # absent for a round it did not answer
            return None if info is None else set(info.running)

        await poll_until(lambda: read(decodes[0]) == {"a"} and read(decodes[2]) == {"x", "y"}, 10)
        await send_all(client, url, [body("sql") for _ in range(4)])
        assert [len(f.requests(CHAT)) for f in decodes] == [4, 0, 6, 0]
