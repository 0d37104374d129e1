"""bench.compare's clients: the epoll generator's one send or two, and the client option."""

from __future__ import annotations

import http.server
import socket
import sys
import threading
from pathlib import Path

import pytest

from bench import _epoll_load
from bench.compare import parse_args as compare_args


@pytest.mark.parametrize("split", [False, True], ids=["one send", "split"])
def test_epoll_client_writes_head_and_body_as_asked(split: bool, monkeypatch) -> None:
    """``--client split`` writes each request as httpx does: the head, then the body."""
    class Answer(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    writes: list[bytes] = []
    connect = socket.create_connection

    class Recording(socket.socket):
        def sendall(self, data, *args):  # type: ignore[no-untyped-def]
            writes.append(bytes(data))
            return super().sendall(data, *args)

    def recording_connection(address, *args):  # type: ignore[no-untyped-def]
        sock = connect(address, *args)
        return Recording(fileno=sock.detach())

    monkeypatch.setattr(_epoll_load.socket, "create_connection", recording_connection)
    try:
        results = _epoll_load.run_load_epoll(
            "127.0.0.1", server.server_address[1], "/v1/chat/completions",
            lambda i: b'{"n": %d}' % i, requests=3, concurrency=1, stream=False,
            request_timeout=10, split_head=split)
    finally:
        server.shutdown()
        server.server_close()
    assert [r.error for r in results] == [None] * 3
    if split:
        assert len(writes) == 6
        assert all(w.endswith(b"\r\n\r\n") for w in writes[0::2])
        assert writes[1::2] == [b'{"n": 0}', b'{"n": 1}', b'{"n": 2}']
    else:
        assert len(writes) == 3 and all(w.endswith(b'}') and b"\r\n\r\n" in w for w in writes)


def test_compare_client_choice(tmp_path: Path) -> None:
    assert compare_args([]).client == "epoll"
    assert compare_args(["--client", "split"]).client == "split"
    with pytest.raises(SystemExit):
        compare_args(["--client", "aiohttp", "--aiohttp-python", str(tmp_path / "none")])
    with pytest.raises(SystemExit):
        compare_args(["--client", "openai", "--openai-python", str(tmp_path / "none")])
    python = Path(sys.executable)
    assert compare_args(["--client", "openai", "--openai-python", str(python)]).client == "openai"
