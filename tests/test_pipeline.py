"""End to end through the real proxy (Hypercorn trio worker) and fake vLLM servers over sockets."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import httpx
import orjson
import trio
import trio.testing

from epd_trio import Instance
from epd_trio.testing import run_cluster

from helpers import CHAT, chat_body, image, url_uuid


async def test_epd_non_stream_hands_kv_params_to_decode(client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=3, prefills=2, prefill_dp=2, decodes=2, decode_dp=2) as c:
        body = chat_body(image(1), image(2), temperature=0)
        original = orjson.dumps(body)
        r = await client.post(c.proxy_url + CHAT, content=original,
                              headers={"x-request-id": "req-1"})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "req-1"
        uuids = [url_uuid(image(1)), url_uuid(image(2))]

        # Encoders: one item each (cursor 0 -> E0, E1), media only, derived ids, same uuids.
        enc = [e.requests() for e in c.encoders]
        assert [len(x) for x in enc] == [1, 1, 0]
        for k, (sub,) in enumerate(enc[:2]):
            assert sub.request_id == f"req-1-enc-{k}"
            assert sub.body["max_tokens"] == 1 and sub.body["stream"] is False
            (part,) = sub.body["messages"][0]["content"]
            assert part["type"] == "image_url" and part["uuid"] == uuids[k]

        (prefill,) = [r for p in c.prefills for r in p.requests()]
        assert prefill.request_id == "req-1" and prefill.rank == 0
        assert prefill.body["max_tokens"] == 1 and prefill.body["stream"] is False
        assert prefill.body["kv_transfer_params"]["do_remote_decode"] is True
        assert [p["uuid"] for p in prefill.body["messages"][0]["content"][:2]] == uuids

        (decode,) = [r for d in c.decodes for r in d.requests()]
        handle = orjson.loads(prefill.sent)["kv_transfer_params"]
        assert handle["do_remote_prefill"] is True
        assert decode.body["kv_transfer_params"] == handle
        assert decode.request_id == "req-1" and decode.rank == 0
        assert [p["uuid"] for p in decode.body["messages"][0]["content"][:2]] == uuids
        assert decode.body["max_tokens"] == 5 and decode.body["temperature"] == 0

        # The client gets exactly what decode sent.
        assert r.content == bytes(decode.sent)


async def test_epd_stream_passes_sse_bytes_through(client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=2, prefills=1, decodes=1) as c:
        async with client.stream("POST", c.proxy_url + CHAT,
                                 json=chat_body(image(7), stream=True,
                                                stream_options={"include_usage": True})) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
        (decode,) = c.decodes[0].requests()
        assert raw == bytes(decode.sent) and raw.endswith(b"data: [DONE]\n\n")
        assert decode.body["stream"] is True
        assert decode.body["stream_options"] == {"include_usage": True}
        (prefill,) = c.prefills[0].requests()
        assert prefill.body["stream"] is False and "stream_options" not in prefill.body
        assert decode.body["kv_transfer_params"]["remote_request_id"] == prefill.request_id


async def test_three_encoders_rotate_across_requests(client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=3, prefills=1, decodes=1) as c:
        order = []
        for n in range(6):
            r = await client.post(c.proxy_url + CHAT, json=chat_body(image(n)),
                                  headers={"x-request-id": f"r{n}"})
            assert r.status_code == 200
            (owner,) = [i for i, e in enumerate(c.encoders)
                        if any(x.request_id == f"r{n}-enc-0" for x in e.requests())]
            order.append(owner)
        assert order == [0, 1, 2, 0, 1, 2]


async def test_item_counts_continue_the_cursor(client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=3, decodes=1, encoder_max_batch=1) as c:
        per_request = []
        for n, count in enumerate([2, 1, 3, 1]):
            items = [image(10 * n + i) for i in range(count)]
            r = await client.post(c.proxy_url + CHAT, json=chat_body(*items),
                                  headers={"x-request-id": f"r{n}"})
            assert r.status_code == 200
            got = []
            for k in range(count):
                (owner,) = [i for i, e in enumerate(c.encoders)
                            if any(x.request_id == f"r{n}-enc-{k}" for x in e.requests())]
                got.append(owner)
            per_request.append(got)
        assert per_request == [[0, 1], [2], [0, 1, 2], [0]]


async def test_encoder_batching_groups_items_per_encoder(client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=2, decodes=1, encoder_max_batch=2) as c:
        items = [image(i) for i in range(5)]  # E0: 0, 2, 4  E1: 1, 3
        r = await client.post(c.proxy_url + CHAT, json=chat_body(*items))
        assert r.status_code == 200
        sizes = sorted(len(x.body["messages"][0]["content"]) for e in c.encoders
                       for x in e.requests())
        assert sizes == [1, 2, 2]
        e0_uuids = [p["uuid"] for x in c.encoders[0].requests()
                    for p in x.body["messages"][0]["content"]]
        assert sorted(e0_uuids) == sorted(url_uuid(items[i]) for i in (0, 2, 4))


async def test_two_instances_dp8_use_all_sixteen_slots(client: httpx.AsyncClient) -> None:
    async with run_cluster(prefills=2, prefill_dp=8, decodes=2, decode_dp=8) as c:
        for _ in range(16):
            r = await client.post(c.proxy_url + "/v1/completions",
                                  json={"model": "fake-model", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
        for fake in [*c.prefills, *c.decodes]:
            assert sorted(x.rank for x in fake.requests()) == list(range(8))


async def test_300_concurrent_single_image_requests_split_exactly(
    client: httpx.AsyncClient,
) -> None:
    async with run_cluster(encoders=3, decodes=2) as c:
        statuses: Counter[int] = Counter()

        async def one(n: int) -> None:
            r = await client.post(c.proxy_url + CHAT, json=chat_body(image(n)))
            statuses[r.status_code] += 1

        async with trio.open_nursery() as nursery:
            for n in range(300):
                nursery.start_soon(one, n)
        assert statuses == {200: 300}
        assert [len(e.requests()) for e in c.encoders] == [100, 100, 100]


async def test_failing_encoder_cancels_siblings_and_fails_once(
    client: httpx.AsyncClient,
) -> None:
    # One attempt per sub-request: the failure is final (failover is tested in test_faults.py).
    async with run_cluster(encoders=3, prefills=1, decodes=1, max_attempts=1) as c:
        e0, e1, e2 = c.encoders
        e0.behaviour.hang = True
        e2.behaviour.hang = True

        async def after_siblings_in_flight() -> None:
            await e0.wait_until(lambda: e0.in_flight == 1)
            await e2.wait_until(lambda: e2.in_flight == 1)

        e1.behaviour.gate = after_siblings_in_flight
        e1.behaviour.fail_status = 500
        with trio.fail_after(10):
            r = await client.post(c.proxy_url + CHAT,
                                  json=chat_body(image(0), image(1), image(2)))
            await e0.wait_until(lambda: e0.disconnects == 1)
            await e2.wait_until(lambda: e2.disconnects == 1)
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["stage"] == "encode" and error["instance"] == e1.url
        assert "items [1]" in error["message"] and "HTTP 500" in error["message"]
        assert e0.in_flight == e2.in_flight == 0
        assert c.prefills[0].requests() == [] and c.decodes[0].requests() == []


async def test_e_pd_layout_sends_uuids_to_the_combined_instance(
    client: httpx.AsyncClient,
) -> None:
    async with run_cluster(encoders=2, decodes=1) as c:
        r = await client.post(c.proxy_url + CHAT, json=chat_body(image(3)))
        assert r.status_code == 200
        (decode,) = c.decodes[0].requests()
        assert c.decodes[0].role == "prefill_decode"
        assert "kv_transfer_params" not in decode.body
        assert decode.body["messages"][0]["content"][0]["uuid"] == url_uuid(image(3))
        assert sum(len(e.requests()) for e in c.encoders) == 1


async def test_p_d_layout_text_and_completions(client: httpx.AsyncClient) -> None:
    async with run_cluster(prefills=1, decodes=1) as c:
        r = await client.post(c.proxy_url + CHAT, json={
            "model": "fake-model", "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200
        r = await client.post(c.proxy_url + "/v1/completions",
                              json={"model": "fake-model", "prompt": "once upon", "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        paths = [x.path for x in c.decodes[0].requests()]
        assert paths == [CHAT, "/v1/completions"]
        assert all("kv_transfer_params" in x.body for x in c.decodes[0].requests())


async def test_text_request_skips_the_encoders(client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=2, prefills=1, decodes=1) as c:
        r = await client.post(c.proxy_url + CHAT, json={
            "model": "fake-model", "messages": [{"role": "user", "content": "just text"}]})
        assert r.status_code == 200
        assert all(e.requests() == [] for e in c.encoders)
        assert len(c.prefills[0].requests()) == len(c.decodes[0].requests()) == 1


async def test_upstream_errors_name_stage_and_keep_client_errors(
    client: httpx.AsyncClient,
) -> None:
    async with run_cluster(encoders=1, prefills=1, decodes=1, decode_retries=0) as c:
        # A prompt the model rejects: vLLM's 400 reaches the client unchanged.
        c.prefills[0].behaviour.max_model_len = 3
        r = await client.post(c.proxy_url + CHAT, json=chat_body(text="far too many words here"))
        assert r.status_code == 400
        assert r.content == bytes(c.prefills[0].requests()[-1].sent)
        c.prefills[0].behaviour.max_model_len = 4096

        # An encoder 4xx keeps its status and names the stage.
        c.encoders[0].behaviour.fail_status, c.encoders[0].behaviour.fail_count = 422, 1
        r = await client.post(c.proxy_url + CHAT, json=chat_body(image(1)))
        assert r.status_code == 422 and r.json()["error"]["stage"] == "encode"

        # A decode 5xx becomes a 502 naming decode and the instance.
        c.decodes[0].behaviour.fail_status, c.decodes[0].behaviour.fail_count = 500, 1
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 502
        assert r.json()["error"]["stage"] == "decode"
        assert r.json()["error"]["instance"] == c.decodes[0].url

        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 200  # the injected failures were one-shot


async def test_unreachable_instance_is_a_502_naming_it(client: httpx.AsyncClient) -> None:
    async with run_cluster(prefills=1, decodes=1, health_interval=3600) as c:
        dead = c.prefills[0]
        dead.stop()  # it said what it serves, then died: nothing listens there any more
        await trio.testing.wait_all_tasks_blocked()
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["stage"] == "prefill" and error["instance"] == dead.url
        assert "ConnectRefused" in error["message"]
        assert c.decodes[0].requests() == []


async def test_a_stage_whose_instances_never_answered_is_a_503_naming_model_and_stage(
    client: httpx.AsyncClient,
) -> None:
    """An instance down since the proxy started never said what it serves: it is in no pool.
    The model still needs its stage (it was configured), so the request is refused before any
    leg, naming the model and the stage, with a Retry-After."""
    dead = Instance("http://127.0.0.1:1")  # nothing listens on port 1
    async with run_cluster(prefills=1, decodes=1, prefill_urls=(dead,)) as c:
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["code"] == "model_unavailable"
        assert error["message"] == "model 'fake-model' has no live prefill instance in its pool"
        assert c.decodes[0].requests() == []


async def test_broken_stream_ends_with_an_sse_error_event(client: httpx.AsyncClient) -> None:
    async with run_cluster(prefills=1, decodes=1) as c:
        c.decodes[0].behaviour.break_after = 3
        r = await client.post(c.proxy_url + CHAT, json=chat_body(stream=True))
        assert r.status_code == 200
        frames = [f for f in r.text.split("\n\n") if f]
        assert len(frames) == 4
        last = orjson.loads(frames[-1].removeprefix("data: "))
        assert last["error"]["stage"] == "decode" and last["error"]["type"] == "upstream_error"
        assert r.text.startswith(bytes(c.decodes[0].requests()[0].sent).decode())


async def test_models_and_health(client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=1, prefills=1, decodes=2) as c:
        r = await client.get(c.proxy_url + "/v1/models")
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "fake-model"
        r = await client.get(c.proxy_url + "/health")
        assert r.status_code == 200
        report = r.json()
        assert report["layout"] == "E+P+D" and report["status"] == "ok"
        assert [i["state"] for i in report["roles"]["decode"]] == ["healthy", "healthy"]


async def test_client_body_errors_are_openai_json(client: httpx.AsyncClient) -> None:
    async with run_cluster(decodes=1, max_body_bytes=10_000) as c:
        for method, path, content, status in [
            ("POST", CHAT, b"{oops", 400),
            ("POST", CHAT, b'{"model": "m", "messages": [], "stream": 1}', 400),
            ("POST", CHAT, b"x" * 20_000, 413),
            ("GET", CHAT, None, 405),
            ("GET", "/nowhere", None, 404),
        ]:
            r = await client.request(method, c.proxy_url + path, content=content)
            assert r.status_code == status, (path, r.text)
            error = r.json()["error"]
            assert set(error) >= {"message", "type", "code"} and error["code"] == status

        async def chunked_upload() -> AsyncIterator[bytes]:  # no content-length: counted as read
            for _ in range(3):
                yield b"x" * 4_000

        r = await client.post(c.proxy_url + CHAT, content=chunked_upload())
        assert r.status_code == 413 and "10000 bytes" in r.json()["error"]["message"]
        assert c.decodes[0].requests() == []
