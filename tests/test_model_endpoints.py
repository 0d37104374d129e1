"""vLLM's other endpoints through the proxy (``_model_api``): each routed by its model to that
model's pool, to its decode (combined) instances, and relayed as the instance answered."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from epd_trio import Instance, Settings
from epd_trio._core.names import MODEL_ENDPOINTS
from epd_trio.testing import FakeVLLM, serve_proxy
from epd_trio.testing.fake_api import TASK_ENDPOINTS, form_of

from helpers import metric, poll_until, retries, server_process, start_fakes

#: A body for each JSON endpoint.
BODIES: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"input": ["alpha beta", "gamma"]},
    "/pooling": {"input": "alpha beta"},
    "/classify": {"input": ["good", "bad"]},
    "/score": {"text_1": "q", "text_2": ["a b", "c"]},
    "/v1/score": {"text_1": "q", "text_2": ["a b"]},
    "/rerank": {"query": "q", "documents": ["x y", "z"]},
    "/v1/rerank": {"query": "q", "documents": ["x"]},
    "/v2/rerank": {"query": "q", "documents": ["x", "y"]},
    "/tokenize": {"prompt": "one two three"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
ALL_TASKS = frozenset(TASK_ENDPOINTS)


def form(model: str | None, audio: bytes, **fields: str) -> tuple[bytes, str]:
    """A multipart body as a client sends it (a file, then text fields) and its type."""
    boundary = uuid.uuid4().hex
    parts = [b"--" + boundary.encode() + b'\r\nContent-Disposition: form-data; name="file"; '
             b'filename="speech.wav"\r\nContent-Type: audio/wav\r\n\r\n' + audio + b"\r\n"]
    for name, value in ({"model": model} if model else {}).items() | fields.items():
        parts.append(b"--" + boundary.encode() + f'\r\nContent-Disposition: form-data; '
                     f'name="{name}"\r\n\r\n{value}\r\n'.encode())
    return b"".join(parts) + b"--" + boundary.encode() + b"--\r\n", \
        f"multipart/form-data; boundary={boundary}"


async def two_models(nursery: trio.Nursery, **settings: Any) -> tuple[dict[str, list[FakeVLLM]],
                                                                        Settings]:
    """Model "E" (every task) and model "G" (generate) on two combined instances each."""
    fakes = {"E": [FakeVLLM("prefill_decode", model="E", tasks=ALL_TASKS) for _ in range(2)],
             "G": [FakeVLLM("prefill_decode", model="G") for _ in range(2)]}
    await start_fakes(nursery, *fakes["E"], *fakes["G"])
    urls = tuple(Instance(f.url) for group in fakes.values() for f in group)
    return fakes, Settings(decode_urls=urls, **settings)


async def test_every_endpoint_goes_to_its_models_pool_and_its_answer_is_relayed_as_sent(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    fakes, config = await two_models(nursery)
    async with serve_proxy(config) as (url, proxy):
        for path, body in BODIES.items():
            for _ in range(2):
                r = await client.post(url + path, json={"model": "E", **body})
                assert r.status_code == 200, (path, r.text)
                assert r.content in [bytes(f.requests(path)[-1].sent) for f in fakes["E"]
                                     if f.requests(path)]  # byte for byte
                assert r.headers["content-type"] == "application/json"
            # Round-robin over E's two instances; G's never asked.
            assert [len(f.requests(path)) for f in fakes["E"]] == [1, 1], path
        assert not any(f.requests() for f in fakes["G"])
        await trio.testing.wait_all_tasks_blocked()
        assert metric(proxy, "epd_trio_requests_total", endpoint="/v1/embeddings",
                      outcome="ok", model="E") == 2
        # A model without the task answers as vLLM does: relayed as it is.
        r = await client.post(url + "/v1/embeddings", json={"model": "G", "input": "x"})
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
        # A name nobody serves: vLLM's 404, from the proxy, before any leg.
        r = await client.post(url + "/v1/embeddings", json={"model": "nosuch", "input": "x"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        assert sum(len(f.requests("/v1/embeddings")) for f in fakes["G"]) == 1


@pytest.mark.parametrize("path", sorted(p for p, kind in MODEL_ENDPOINTS.items()
                                        if kind == "form"))
async def test_an_audio_form_goes_whole_to_its_models_instance_stream_too(
    client: httpx.AsyncClient, nursery: trio.Nursery, path: str,
) -> None:
    fakes, config = await two_models(nursery)
    async with serve_proxy(config) as (url, _proxy):
        audio = bytes(range(256)) * 64
        content, kind = form("E", audio, language="en")
        r = await client.post(url + path, content=content, headers={"content-type": kind})
        assert r.status_code == 200, r.text
        (served,) = [f for f in fakes["E"] if f.requests(path)]
        received = served.requests(path)[0]
        assert received.body == content  # the form as the client sent it
        assert form_of(received.body, received.headers["content-type"])["file"] == audio
        assert r.content == bytes(received.sent)
        content, kind = form("E", audio, stream="true")
        r = await client.post(url + path, content=content, headers={"content-type": kind})
        assert r.headers["content-type"] == "text/event-stream"
        assert r.text.endswith("data: [DONE]\n\n") and r.text.count("data: ") > 3
        r = await client.post(url + path, content=b"not a form",
                              headers={"content-type": "text/plain"})
        assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]


async def test_an_alias_names_its_target_in_a_json_body_and_in_a_form(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    fakes, config = await two_models(
        nursery, model_aliases={"speech": {"targets": ["E"]}})
    async with serve_proxy(config) as (url, _proxy):
        r = await client.post(url + "/v1/embeddings", json={"model": "speech", "input": "x"})
        assert r.status_code == 200 and r.json()["model"] == "E"
        content, kind = form("speech", b"\x00" * 100)
        r = await client.post(url + "/v1/audio/transcriptions", content=content,
                              headers={"content-type": kind})
        assert r.status_code == 200, r.text
        (received,) = [f.requests("/v1/audio/transcriptions")[0] for f in fakes["E"]
                       if f.requests("/v1/audio/transcriptions")]
        assert form_of(received.body, received.headers["content-type"])["model"] == b"E"


async def test_failover_before_the_first_byte_and_a_client_that_leaves(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    fakes, config = await two_models(nursery, health_interval=3600)
    async with serve_proxy(config) as (url, proxy):
        first, second = fakes["E"]
        first.behaviour.fail_status, first.behaviour.fail_count = 500, 1
        r = await client.post(url + "/v1/embeddings", json={"model": "E", "input": "x"})
        assert r.status_code == 200 and len(second.requests("/v1/embeddings")) == 1
        assert retries(proxy) == {"decode": 1}
        # The client leaves while the instance works: the leg is cancelled there too.
        second.behaviour.hang = first.behaviour.hang = True
        seen = {f.url: len(f.requests("/v1/embeddings")) for f in fakes["E"]}

        def reached() -> list[FakeVLLM]:
            return [f for f in fakes["E"] if len(f.requests("/v1/embeddings")) > seen[f.url]]

        async with trio.open_nursery() as requests:
            requests.start_soon(partial(client.post, url + "/v1/embeddings",
                                        json={"model": "E", "input": "x"}))
            # Polled: the request crosses two sockets, and the kernel may deliver it after
            # every task here has blocked (in_flight would not do: the failed request's
            # handler may still be finishing).
            await poll_until(lambda: bool(reached()), 10)
            requests.cancel_scope.cancel()
        (held,) = reached()
        with trio.fail_after(10):
            await held.wait_until(lambda: held.disconnects == 1)


def peak_rss(pid: int) -> int:
    """A process's peak resident memory so far, in bytes (``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def test_the_body_limit_and_a_20_mb_upload_held_once(
    client: httpx.AsyncClient, nursery: trio.Nursery,
    record_property: Callable[[str, object], None],
) -> None:
    """The audio form through ``epd-trio serve`` (a process of its own, so its memory is its
    own): over the body limit, a 413; 20 MB under it raise the proxy's peak memory by about
    the upload once, not twice (read into one buffer, the model field read where it is, the
    body written after its head without a copy)."""
    fakes, _ = await two_models(nursery)
    urls = [f.url for group in fakes.values() for f in group]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    command = [sys.executable, "-m", "epd_trio", "serve", "--port", "0", "--decode", *urls,
               "--max-body-bytes", str(21 * 1024 * 1024)]
    size = 20 * 1024 * 1024
    async with server_process(nursery, command, env) as served:
        big, kind = form("E", b"\x01" * (22 * 1024 * 1024))
        r = await client.post(served.url + "/v1/audio/transcriptions", content=big,
                              headers={"content-type": kind})
        assert r.status_code == 413
        upload, kind = form("E", b"\x02" * size)
        before = peak_rss(served.process.pid)
        r = await client.post(served.url + "/v1/audio/transcriptions", content=upload,
                              headers={"content-type": kind})
        after = peak_rss(served.process.pid)
        assert r.status_code == 200, r.text
        assert f"({size} bytes)" in r.json()["text"]
    grown = after - before
    record_property("observed", f"20 MB upload through epd-trio serve: its peak RSS "
                    f"{before / 2**20:.0f} -> {after / 2**20:.0f} MiB (+{grown / 2**20:.1f} MiB)")
    assert grown < 1.5 * size, grown  # held once (joined from chunks it was held twice)
