"""The one synchronous HTTP client (``adapters/http_sync.py``) against a local stdlib server."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from prfaas_sglang.adapters import http_sync


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    peers: list = []
    hung_up = threading.Event()  # /bye's connection was closed by the server

    def log_message(self, *args):  # quiet
        pass

    def _answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Prfaas-Route", "pd/p/d")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.peers.append(self.client_address)
        if self.path == "/ok":
            self._answer(200, b'{"a": 1}')
        elif self.path == "/text":
            self._answer(200, b"not json", "text/plain")
        elif self.path == "/bye":  # answers as if kept alive, then closes the connection while it is idle
            self._answer(200, b'{"a": 1}')
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            self.hung_up.set()
        elif self.path == "/slow":
            time.sleep(1.0)
            self._answer(200, b"{}")
        elif self.path == "/events":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(3):
                self.wfile.write(f"data: {i}\n\n".encode())
                self.wfile.flush()
        else:
            self._answer(404, b'{"error": "no such path"}')

    def do_POST(self):
        self.peers.append(self.client_address)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        self._answer(200, json.dumps({"got": json.loads(body), "type": self.headers.get("Content-Type")}).encode())


@pytest.fixture
def server():
    _Handler.peers = []
    _Handler.hung_up.clear()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_json_calls_and_their_errors(server):
    assert http_sync.get_json(server + "/ok", timeout_s=5) == {"a": 1}
    assert http_sync.post_json(server + "/echo", {"x": [1]}, timeout_s=5) == {"got": {"x": [1]}, "type": "application/json"}
    answer = http_sync.get(server + "/missing", timeout_s=5)  # any status is an answer
    assert answer.status == 404 and not answer.ok and answer.json() == {"error": "no such path"}
    assert answer.headers.get("x-prfaas-route") == "pd/p/d"  # names in any case
    with pytest.raises(http_sync.HttpError) as err:
        http_sync.get_json(server + "/missing", timeout_s=5)
    assert err.value.status == 404 and "no such path" in str(err.value) and isinstance(err.value, OSError)
    with pytest.raises(http_sync.HttpError, match="not JSON") as err:
        http_sync.get_json(server + "/text", timeout_s=5)
    assert err.value.status == 200
    assert http_sync.get_text(server + "/text", timeout_s=5) == "not json"


def test_no_answer_says_whether_a_connection_was_made(server):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    with pytest.raises(http_sync.HttpError) as err:
        http_sync.get_json(f"http://127.0.0.1:{closed_port}/ok", timeout_s=5)
    assert err.value.status is None and err.value.connected is False
    with pytest.raises(http_sync.HttpError) as err:
        http_sync.get_json(server + "/slow", timeout_s=0.2)
    assert err.value.status is None and err.value.connected is True


def test_a_client_reuses_its_connection_and_drops_one_the_server_closed(server):
    client = http_sync.Client(headers={"X-Test": "1"})
    try:
        for _ in range(3):
            assert client.get_json(server + "/ok", timeout_s=5) == {"a": 1}
        assert client.post_json(server + "/echo", [1], timeout_s=5)["got"] == [1]
        assert len(set(_Handler.peers)) == 1  # one connection for all four
        assert client.get_json(server + "/bye", timeout_s=5) == {"a": 1}  # the server closes it once idle
        assert _Handler.hung_up.wait(5)
        assert client.get_json(server + "/ok", timeout_s=5) == {"a": 1}
        assert len(set(_Handler.peers)) == 2  # the closed connection was replaced, not used
    finally:
        client.close()


def test_a_stream_is_read_as_it_arrives(server):
    with http_sync.stream("GET", server + "/events", timeout_s=5) as answer:
        assert answer.status == 200
        assert [line for line in answer.lines() if line] == [b"data: 0", b"data: 1", b"data: 2"]
