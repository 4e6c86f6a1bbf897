"""The router front (``router/front.py``) in front of a real router and emulated workers, with the
router killed (``kill -9``) and restarted under it: clients see answers or typed errors, never a
reset connection."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import threading
import time

import pytest
import requests
from deployments import REALTIME_PAIR

from prfaas_sglang.demo.cluster import (
    ProcessGroup,
    free_port,
    start_front,
    start_router,
)
from prfaas_sglang.router.front import may_resend

pytestmark = pytest.mark.xdist_group(REALTIME_PAIR)  # the router runs over the shared real-time pair (tests/deployments.py)
VOCAB = 4096


def ids(start: int, n: int) -> list[int]:
    return [(t * 40503) % VOCAB for t in range(start, start + n)]


@pytest.fixture(scope="module")
def deployment(realtime_pair, tmp_path_factory):
    """PD-P and PD-D (real time, so requests are in flight when the router dies), the router, and
    the front before it (retry window 20 s)."""
    group = ProcessGroup(tmp_path_factory.mktemp("front") / "logs")
    try:
        realtime_pair.reset()
        router = start_router(group, realtime_pair.doc, "--no-early-rejection", "--health-interval-s", "0.5")
        front = start_front(group, router.url, retry_window_s=20)
        yield {"group": group, "front": front, "router": router}
    finally:
        group.stop()


def kill(group: ProcessGroup, name: str) -> None:
    proc = next(p for p in reversed(group.procs) if p.name == name)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_only_the_data_plane_and_reads_are_sent_again_once_the_router_may_have_them():
    assert may_resend("POST", "/generate") and may_resend("POST", "/v1/chat/completions") and may_resend("GET", "/status")
    assert not may_resend("POST", "/admin/workers") and not may_resend("DELETE", "/admin/workers/x")
    assert not may_resend("POST", "/flush_cache")


@pytest.mark.slow
def test_requests_in_flight_and_arriving_while_the_router_is_dead_are_answered_or_end_with_an_error_event(deployment):
    group, front, router = deployment["group"], deployment["front"], deployment["router"]
    body = {"input_ids": ids(10_000, 300), "sampling_params": {"max_new_tokens": 300}}
    assert requests.post(front + "/generate", json=body, timeout=60).status_code == 200  # relayed

    def plain(k):  # whole answers: the front resends them after the restart
        return requests.post(front + "/generate", json={**body, "input_ids": ids(20_000 + 1000 * k, 300)}, timeout=60)

    streamed = requests.post(front + "/generate", json={**body, "stream": True}, timeout=60, stream=True)
    lines = streamed.iter_lines()
    assert b"error" not in next(line for line in lines if line.startswith(b"data: "))  # the stream started
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        in_flight = [pool.submit(plain, k) for k in range(2)]
        time.sleep(0.3)
        kill(group, "router")
        arriving = [pool.submit(plain, k) for k in range(2, 4)]  # sent to a dead router
        rest = [line for line in lines if line.startswith(b"data: ")]
        time.sleep(1.0)
        restarted = group.restart("router")
        group.wait_healthy(router.url + "/health", restarted)
        answers = [f.result() for f in in_flight + arriving]
    assert [r.status_code for r in answers] == [200] * 4, [r.text[:200] for r in answers]
    assert all(json.loads(r.text)["meta_info"]["completion_tokens"] == 300 for r in answers)
    assert rest[-1] == b"data: [DONE]" and json.loads(rest[-2][len(b"data: "):])["error"]["code"] == 502
    counters = requests.get(front + "/front/health", timeout=5).json()
    assert counters["resent"] >= 2 and counters["stream_broken"] == 1


def test_a_router_that_stays_down_is_a_typed_503_after_the_retry_window(tmp_path):
    group = ProcessGroup(tmp_path / "logs")
    try:
        url = start_front(group, f"http://127.0.0.1:{free_port()}", retry_window_s=1)
        port = int(url.rsplit(":", 1)[1])
        started = time.monotonic()
        r = requests.post(url + "/admin/workers", json={}, timeout=30)  # never reached the router: resent too
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["type"] == "router_unavailable" and time.monotonic() - started < 10.0  # bounded by the window
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:  # a declared 1 TiB body, refused unread
            conn.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (1 << 40))
            head = conn.recv(65536)
        assert head.startswith(b"HTTP/1.1 413") and b'"too_large"' in head
    finally:
        group.stop()


def test_a_request_the_router_dropped_is_not_sent_again_unless_it_is_the_data_plane(tmp_path):
    """A router that accepts a request and dies before answering: an admin change is answered 502
    (not repeated behind the operator's back); a generation is sent again."""
    group = ProcessGroup(tmp_path / "logs")
    seen = []

    def drop_everything(listener):  # reads each request, then closes without answering
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                seen.append(conn.recv(65536).split(b" ", 2)[:2])

    with socket.create_server(("127.0.0.1", 0)) as listener:
        threading.Thread(target=drop_everything, args=(listener,), daemon=True).start()
        try:
            url = start_front(group, f"http://127.0.0.1:{listener.getsockname()[1]}", retry_window_s=1)
            admin = requests.post(url + "/admin/threshold", json={"threshold_tokens": 1}, timeout=30)
            assert admin.status_code == 502 and admin.json()["error"]["type"] == "router_failed"
            assert seen.count([b"POST", b"/admin/threshold"]) == 1
            gen = requests.post(url + "/generate", json={"input_ids": [1]}, timeout=30)
            assert gen.status_code == 503 and seen.count([b"POST", b"/generate"]) >= 2
        finally:
            group.stop()


@pytest.mark.parametrize("argv,words", [
    (["--router", "ftp://x", "--port", "1"], "http(s) URL"),
    (["--router", "http://x", "--port", "1", "--retry-window-s", "nan"], "--retry-window-s"),
    (["--router", "http://x", "--port", "99999"], "--port must be in 1..65535"),
])
def test_a_bad_command_line_is_refused_with_the_flag_named(argv, words, capsys):
    from prfaas_sglang.router.front import main

    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2 and words in capsys.readouterr().err
