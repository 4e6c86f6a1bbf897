"""Deployment-secret authentication (issue #16 item 4): the pure rules, the ZMQ adapter's CURVE on
real sockets, SGLang's own publisher and server arguments under our hooks, and the launcher.

End to end on emulated workers: ``tests/router/test_security_e2e.py``.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.security import check_peer, load_keys, peer_hosts
from prfaas_sglang.wire.auth import (
    AuthError,
    DeploymentKeys,
    ReplayGuard,
    check_bearer,
    sign,
    verify,
)

KEYS = DeploymentKeys.from_secret(b"0123456789abcdef-unit-test-secret")
NOW = 1_790_000_000.0


# --- wire.auth -------------------------------------------------------------------------------


def reason(fn) -> str:
    with pytest.raises(AuthError) as err:
        fn()
    return err.value.reason


@given(method=st.sampled_from(["POST", "GET"]), path=st.text(min_size=1, max_size=40).map(lambda p: "/" + p),
       body=st.binary(max_size=200))
def test_a_signature_verifies_only_for_the_same_method_path_and_body(method, path, body):
    header = sign(KEYS.handoff_key, method, path, body, NOW)
    verify(KEYS.handoff_key, header, method, path, body, NOW + 5)
    assert reason(lambda: verify(KEYS.handoff_key, header, method, path, body + b"x", NOW)) == "bad_mac"
    assert reason(lambda: verify(KEYS.handoff_key, header, method, path + "x", body, NOW)) == "bad_mac"
    other = "GET" if method == "POST" else "POST"
    assert reason(lambda: verify(KEYS.handoff_key, header, other, path, body, NOW)) == "bad_mac"


def test_signatures_are_refused_when_missing_malformed_stale_or_from_another_secret():
    header = sign(KEYS.handoff_key, "POST", "/p", b"{}", NOW)
    assert reason(lambda: verify(KEYS.handoff_key, None, "POST", "/p", b"{}", NOW)) == "missing"
    assert reason(lambda: verify(KEYS.handoff_key, "v1 t=1 mac=zz", "POST", "/p", b"{}", NOW)) == "malformed"
    assert reason(lambda: verify(KEYS.handoff_key, header.replace("v1", "v2"), "POST", "/p", b"{}", NOW)) == "malformed"
    assert reason(lambda: verify(KEYS.handoff_key, header, "POST", "/p", b"{}", NOW + 61)) == "stale"
    assert reason(lambda: verify(KEYS.handoff_key, header, "POST", "/p", b"{}", NOW - 61)) == "stale"
    other = DeploymentKeys.from_secret(b"another deployment's secret!")
    assert reason(lambda: verify(other.handoff_key, header, "POST", "/p", b"{}", NOW)) == "bad_mac"


def test_derived_keys_are_independent_stable_and_hidden():
    again = DeploymentKeys.from_secret(b"0123456789abcdef-unit-test-secret\n")  # a file's newline is not the secret
    assert again == KEYS
    parts = [KEYS.handoff_key, bytes.fromhex(KEYS.worker_api_key), KEYS.zmq_server_seed, KEYS.zmq_client_seed]
    assert len(set(parts)) == 4 and all(len(p) == 32 for p in parts)
    assert "0123" not in repr(KEYS) and KEYS.worker_api_key not in repr(KEYS)
    with pytest.raises(ValueError, match="at least 16"):
        DeploymentKeys.from_secret(b"short   \n")


def test_the_bearer_check_is_sglangs_rule():
    check_bearer(KEYS.worker_api_key, f"Bearer {KEYS.worker_api_key}")
    check_bearer(KEYS.worker_api_key, f"bearer {KEYS.worker_api_key}")
    assert reason(lambda: check_bearer(KEYS.worker_api_key, None)) == "missing"
    assert reason(lambda: check_bearer(KEYS.worker_api_key, KEYS.worker_api_key)) == "bad_key"
    assert reason(lambda: check_bearer(KEYS.worker_api_key, "Basic " + KEYS.worker_api_key)) == "bad_key"
    assert reason(lambda: check_bearer(KEYS.worker_api_key, "Bearer " + KEYS.worker_api_key[:-1])) == "bad_key"


def test_the_replay_guard_refuses_a_mac_within_its_window_and_stays_bounded():
    guard = ReplayGuard(window_s=120, max_entries=100)
    guard.check("a", NOW)
    assert reason(lambda: guard.check("a", NOW + 119)) == "replayed"
    guard.check("a", NOW + 121)  # expired: a signature that old is refused as stale anyway
    for i in range(1000):
        guard.check(f"m{i}", NOW + 200)
    assert len(guard) <= 100


# --- security.py ----------------------------------------------------------------------------


def test_peers_are_checked_by_host_whatever_the_form():
    allowed = peer_hosts("127.0.0.1, Worker-A ,::1")
    for ok in ("127.0.0.1", "http://127.0.0.1:9/x", "worker-a", "127.0.0.1:16000", "http://[::1]:80/p",
               "[::1]:16000", "::1", "[0:0:0:0:0:0:0:1]:5", "http://[0::1]:80/"):  # IPv6 session ids, any spelling
        check_peer(allowed, ok, "host")
    for bad in ("10.0.0.1", "http://169.254.169.254/latest", "http://127.0.0.1.evil:80/", "http://[::1", "",
                "http://user@10.0.0.1:80/", "[::2]:16000", "[::1", "::1]:5"):
        assert reason(lambda bad=bad: check_peer(allowed, bad, "host")) == "unknown_peer"
    check_peer(None, "10.0.0.1", "host")  # no list: any host
    with pytest.raises(ConfigError):
        peer_hosts(" , ")


def test_the_secret_file_is_read_checked_and_refused_with_a_typed_error(tmp_path, monkeypatch):
    monkeypatch.delenv("PRFAAS_SECRET_FILE", raising=False)
    assert load_keys() is None
    good = tmp_path / "s"
    good.write_bytes(b"0123456789abcdef-unit-test-secret\n")
    good.chmod(0o600)
    monkeypatch.setenv("PRFAAS_SECRET_FILE", str(good))
    assert load_keys() == KEYS
    short = tmp_path / "short"
    short.write_bytes(b"tiny")
    for path, words in ((tmp_path / "absent", "cannot read"), (short, "at least 16")):
        with pytest.raises(ConfigError, match=words):
            load_keys(str(path))
    good.chmod(0o666)
    with pytest.raises(ConfigError, match="writable by anyone"):
        load_keys(str(good))


# --- adapters/zmq.py: CURVE on real sockets ---------------------------------------------------


def _port() -> int:
    from prfaas_sglang.demo.cluster import PortPicker

    return PortPicker()()


async def _collect(sub, source: str, seconds: float, publish) -> tuple[list, dict]:
    got: list = []
    sub.watch(source, f"tcp://127.0.0.1:{publish.port}", b"t", got.append)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not got:
        publish()
        await asyncio.sleep(0.05)
    return got, sub.stats(time.monotonic())[source]


class _Pub:
    """A PUB at a free port, plain or CURVE with the given server keys."""

    def __init__(self, curve=None, server_secret: bytes | None = None):
        from prfaas_sglang.adapters.zmq import ZmqPublisher

        self.port = _port()
        if server_secret is None:
            self.pub = ZmqPublisher(f"tcp://127.0.0.1:{self.port}", "t", curve=curve)
            self.send = lambda: self.pub.publish_raw(b"payload")
        else:  # a forger who made up its own CURVE server key
            self.sock = zmq.Context.instance().socket(zmq.PUB)
            self.sock.curve_secretkey = server_secret
            self.sock.curve_publickey = zmq.curve_public(server_secret)
            self.sock.curve_server = True
            self.sock.bind(f"tcp://127.0.0.1:{self.port}")
            self.send = lambda: self.sock.send_multipart([b"t", b"payload"], flags=zmq.NOBLOCK)

    def __call__(self):
        self.send()

    def close(self):
        (self.pub.close() if hasattr(self, "pub") else self.sock.close(linger=0))


def test_curve_streams_deliver_only_between_holders_of_the_deployment_key():
    from zmq.utils import z85

    from prfaas_sglang.adapters.zmq import CurveKeys, ZmqSubscriber

    curve = CurveKeys.from_deployment(KEYS)

    async def run():
        sub = ZmqSubscriber(curve=curve)
        pubs = {"good": _Pub(curve), "plain": _Pub(), "forged": _Pub(server_secret=z85.encode(b"f" * 32))}
        try:
            good, good_stats = await _collect(sub, "good", 5, pubs["good"])
            plain, plain_stats = await _collect(sub, "plain", 1.5, pubs["plain"])
            forged, forged_stats = await _collect(sub, "forged", 1.5, pubs["forged"])
            # A subscriber without the key learns nothing from a deployment's publisher (prompt privacy).
            eavesdropper = ZmqSubscriber()
            heard, _ = await _collect(eavesdropper, "eve", 1.5, pubs["good"])
            await eavesdropper.close()
            return good, good_stats, plain, plain_stats, forged, forged_stats, heard
        finally:
            await sub.close()
            for p in pubs.values():
                p.close()

    good, good_stats, plain, plain_stats, forged, forged_stats, heard = asyncio.run(run())
    assert good and good_stats["auth_failures"] == 0 and good_stats["connected"] and good_stats["connects"] == 1
    assert not plain and plain_stats["frames"] == 0 and plain_stats["auth_failures"] >= 1
    assert not forged and forged_stats["frames"] == 0 and forged_stats["auth_failures"] >= 1
    assert not plain_stats["connected"] and not forged_stats["connected"] and forged_stats["connects"] == 0
    assert not heard  # the eavesdropper has no key: the handshake fails (NULL vs CURVE) before ZAP


def test_a_subscription_is_connected_from_its_handshake_until_its_publisher_goes_and_again_when_it_returns():
    """``connected``: set by the handshake, cleared when the publisher goes, set again on its return.
    Once connected, the first frames heard are the publisher's (it may still drop one published at the
    instant of the handshake, before it applied the subscription: so the test publishes until heard)."""
    from prfaas_sglang.adapters.zmq import ZmqPublisher, ZmqSubscriber

    async def wait_for(sub, predicate, timeout_s: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while not predicate(stats := sub.stats(time.monotonic())["s"]):
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.01)
        return stats

    async def run():
        port = _port()
        sub, got = ZmqSubscriber(), []
        sub.watch("s", f"tcp://127.0.0.1:{port}", b"t", got.append)
        assert sub.stats(time.monotonic())["s"]["connected"] is False  # nothing is listening yet
        pub = ZmqPublisher(f"tcp://127.0.0.1:{port}", "t")
        try:
            await wait_for(sub, lambda s: s["connected"])
            for _ in range(200):  # bounded: 10 s
                pub.publish_raw(b"first")
                await asyncio.sleep(0.05)
                if got:
                    break
            pub.close()
            await wait_for(sub, lambda s: not s["connected"])
            pub = ZmqPublisher(f"tcp://127.0.0.1:{port}", "t")
            return got, await wait_for(sub, lambda s: s["connected"])
        finally:
            pub.close()
            await sub.close()

    got, stats = asyncio.run(run())
    assert got and all(frame == [b"t", b"first"] for frame in got) and stats["connects"] == 2
    assert stats["frames"] == len(got)


def test_a_publisher_that_stops_answering_without_closing_is_dropped_by_the_heartbeat():
    """A publisher whose host vanished sends no FIN: only ZMTP heartbeats tell. A publisher process
    stopped (SIGSTOP: its kernel still holds the connection, its I/O thread answers no PING) reads as
    disconnected within the heartbeat's timeout, so the subscriber reconnects, resolving the name again
    (a recreated Kubernetes pod under the same name: scripts/k8s-local.sh's drill)."""
    import os
    import signal
    import subprocess
    import sys

    from prfaas_sglang.adapters.zmq import HEARTBEAT_TIMEOUT_MS, ZmqSubscriber

    port = _port()
    code = ("import sys, time, zmq; s = zmq.Context().socket(zmq.PUB); s.bind(sys.argv[1]); print('up', flush=True)\n"
            "while True: s.send_multipart([b't', b'x']); time.sleep(0.05)")
    pub = subprocess.Popen([sys.executable, "-c", code, f"tcp://127.0.0.1:{port}"], stdout=subprocess.PIPE, text=True)

    async def run() -> float:
        sub = ZmqSubscriber()
        try:
            sub.watch("s", f"tcp://127.0.0.1:{port}", b"t", lambda frames: None)
            deadline = time.monotonic() + 10
            while not sub.stats(time.monotonic())["s"]["connected"]:
                assert time.monotonic() < deadline, "never connected"
                await asyncio.sleep(0.02)
            os.kill(pub.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            while sub.stats(time.monotonic())["s"]["connected"]:
                assert time.monotonic() - stopped < 3 * HEARTBEAT_TIMEOUT_MS / 1e3, "still connected to a silent publisher"
                await asyncio.sleep(0.05)
            return time.monotonic() - stopped
        finally:
            await sub.close()

    try:
        assert pub.stdout.readline().strip() == "up"
        asyncio.run(run())
    finally:
        pub.kill()
        os.kill(pub.pid, signal.SIGCONT)
        pub.wait(timeout=10)


def test_a_curve_subscriber_with_another_key_is_refused_by_the_publisher_and_counted():
    from prfaas_sglang.adapters.zmq import CurveKeys, ZmqSubscriber

    ours = CurveKeys.from_deployment(KEYS)
    theirs = CurveKeys.from_deployment(DeploymentKeys.from_secret(b"another deployment, same server key?"))
    # A client that knows our server's public key (it is not a secret) but holds another client key.
    intruder = CurveKeys(ours.server_secret, ours.server_public, theirs.client_secret, theirs.client_public)

    async def run():
        pub = _Pub(ours)
        sub = ZmqSubscriber(curve=intruder)
        try:
            got, stats = await _collect(sub, "x", 2, pub)
            return got, stats, pub.pub.refused_subscribers
        finally:
            await sub.close()
            pub.close()

    got, stats, refused = asyncio.run(run())
    assert not got and stats["frames"] == 0
    assert refused >= 1 and stats["auth_failures"] >= 1


# --- SGLang's own classes under our hooks ---------------------------------------------------


def test_sglangs_publisher_binds_the_configured_host_with_curve_for_a_deployment_with_a_secret(tmp_path, monkeypatch):
    from sglang.srt.disaggregation.kv_events import EventBatch

    from prfaas_sglang.adapters.zmq import CurveKeys
    from prfaas_sglang.hooks import event_publisher
    from prfaas_sglang.launch.command import kv_events_config

    secret = tmp_path / "s"
    secret.write_bytes(b"0123456789abcdef-unit-test-secret")
    monkeypatch.setenv("PRFAAS_SECRET_FILE", str(secret))
    port = _port()
    endpoint = json.loads(kv_events_config(port, "127.0.0.1"))["endpoint"]
    assert endpoint == f"tcp://127.0.0.1:{port}"  # upstream would connect to a non-wildcard host; ours binds
    publisher = event_publisher.StateEventsZmqPublisher(attn_dp_rank=0, endpoint=endpoint, topic="kv-events")
    curve = CurveKeys.from_deployment(KEYS)

    def subscriber(keys):
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.subscribe(b"kv-events")
        if keys:
            sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = (
                keys.client_secret, keys.client_public, keys.server_public)
        sock.connect(endpoint)
        return sock

    ours, plain = subscriber(curve), subscriber(None)
    try:
        deadline = time.monotonic() + 10
        while not ours.poll(100):
            publisher.publish(EventBatch(ts=time.time(), events=[]))
            assert time.monotonic() < deadline, "the deployment's subscriber got nothing"
        topic, _seq, _payload = ours.recv_multipart()
        assert topic == b"kv-events"
        assert not plain.poll(300)
    finally:
        ours.close(linger=0)
        plain.close(linger=0)
        publisher.shutdown()


def test_sglangs_replay_socket_is_a_curve_server_too_and_shutdown_closes_its_context(tmp_path, monkeypatch):
    """Issue #16 review: the replay ROUTER was made in the CURVE context but without CURVE (anyone
    could read back every buffered batch, i.e. prompts), and the CURVE context was never closed."""
    import inspect

    from sglang.srt.disaggregation.kv_events import EventBatch, ZmqEventPublisher

    from prfaas_sglang.adapters.zmq import CurveKeys
    from prfaas_sglang.hooks import event_publisher

    secret = tmp_path / "s"
    secret.write_bytes(b"0123456789abcdef-unit-test-secret")
    monkeypatch.setenv("PRFAAS_SECRET_FILE", str(secret))
    # SGLang's replay answer: 0.5.15 ``(seq, payload)``; 0.5.23 the live frame ``(topic, seq, payload)``
    replays_topic = "self._topic_bytes" in inspect.getsource(ZmqEventPublisher._service_replay)
    port, replay_port = _port(), _port()
    publisher = event_publisher.StateEventsZmqPublisher(attn_dp_rank=0, endpoint=f"tcp://127.0.0.1:{port}", topic="kv-events",
                                                     replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    curve = CurveKeys.from_deployment(KEYS)

    def replay_client(keys):
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        if keys:
            sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = (
                keys.client_secret, keys.client_public, keys.server_public)
        sock.connect(f"tcp://127.0.0.1:{replay_port}")
        sock.send((0).to_bytes(8, "big"))
        return sock

    server = publisher._curve_server
    try:
        publisher.publish(EventBatch(ts=time.time(), events=[]))
        plain, ours = replay_client(None), replay_client(curve)
        assert ours.poll(5000), "the deployment's replay client got nothing"
        frames = ours.recv_multipart()
        if replays_topic:
            topic, seq, _payload = frames
            assert topic == b"kv-events"
        else:
            seq, _payload = frames
        assert int.from_bytes(seq, "big") == 0
        assert not plain.poll(500)  # no handshake without the deployment's key: nothing replayed
        plain.close()
        ours.close()
    finally:
        publisher.shutdown()
    assert server is not None and server.ctx.closed  # the ZAP thread and its context are gone
    assert publisher._curve_server is None


def test_the_worker_api_key_hook_sets_sglangs_key_and_refuses_a_contradicting_one(tmp_path, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    from prfaas_sglang.hooks.deployment_auth import DeploymentAuthError, set_worker_api_key

    try:  # 0.5.23: resolution declares decisions over the frozen inputs; SGLang reads the resolved value
        from sglang.srt.arg_groups.overrides import resolution_result
        writes_record = False
    except ImportError:  # 0.5.15: resolution writes the record
        writes_record = True

        def resolution_result(args, field):
            return getattr(args, field)

    args = ServerArgs(model_path="dummy", device="cpu")
    monkeypatch.delenv("PRFAAS_SECRET_FILE", raising=False)
    set_worker_api_key(None, args)
    assert resolution_result(args, "api_key") is None  # no secret: a stock server
    secret = tmp_path / "s"
    secret.write_bytes(b"0123456789abcdef-unit-test-secret")
    monkeypatch.setenv("PRFAAS_SECRET_FILE", str(secret))
    set_worker_api_key(None, args)
    assert resolution_result(args, "api_key") == KEYS.worker_api_key
    set_worker_api_key(None, args)  # idempotent: every process resolving the args runs it
    assert resolution_result(args, "api_key") == KEYS.worker_api_key
    if writes_record:  # 0.5.15: a key written over the record later
        args.api_key = "operator-chosen"
        with pytest.raises(DeploymentAuthError, match="differs"):
            set_worker_api_key(None, args)
    operator = ServerArgs(model_path="dummy", device="cpu", api_key="operator-chosen")  # --api-key given
    with pytest.raises(DeploymentAuthError, match="differs"):
        set_worker_api_key(None, operator)


def test_the_bootstrap_peer_hook_refuses_a_host_outside_the_topology(monkeypatch):
    from sglang.srt.managers.io_struct import GenerateReqInput

    from prfaas_sglang.hooks.deployment_auth import check_bootstrap_peer

    req = GenerateReqInput(input_ids=[1, 2, 3], bootstrap_host="10.9.9.9", bootstrap_port=8998, bootstrap_room=1)
    monkeypatch.delenv("PRFAAS_PEER_HOSTS", raising=False)
    assert check_bootstrap_peer(None, req, [1, 2, 3]) is None
    monkeypatch.setenv("PRFAAS_PEER_HOSTS", "127.0.0.1,10.0.0.2")
    with pytest.raises(ValueError, match="not a peer"):
        check_bootstrap_peer(None, req, [1, 2, 3])
    req.bootstrap_host = "10.0.0.2"
    assert check_bootstrap_peer(None, req, [1, 2, 3]) is None
    assert check_bootstrap_peer(None, GenerateReqInput(input_ids=[1]), [1]) is None  # not a PD request


def test_the_bootstrap_peer_hook_lets_sglangs_own_health_probe_and_warmup_through(monkeypatch):
    """SGLang's /health and PD warm-up send ``FAKE_BOOTSTRAP_HOST`` (a host no worker contacts):
    refused, a PD worker with peers configured never turned healthy (seen on a GPU)."""
    import inspect

    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.io_struct import GenerateReqInput

    from prfaas_sglang.hooks.deployment_auth import check_bootstrap_peer

    monkeypatch.setenv("PRFAAS_PEER_HOSTS", "10.0.0.1,10.0.0.2")
    health = GenerateReqInput(input_ids=[0], bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_room=0)
    assert check_bootstrap_peer(None, health, [0]) is None
    # the PD warm-up as each release sends it (2 DP ranks): 0.5.23 one request per rank
    # (_send_disaggregation_warmup_requests), 0.5.15 one batch with a host per rank
    per_rank = getattr(http_server, "_send_disaggregation_warmup_requests", None)
    if per_rank is not None:
        for rank in range(2):
            warmup = GenerateReqInput(input_ids=[10, 11, 12, 13], bootstrap_host=FAKE_BOOTSTRAP_HOST,
                                      bootstrap_room=rank, routed_dp_rank=rank)
            assert check_bootstrap_peer(None, warmup, [10, 11, 12, 13]) is None
    else:
        warmup = GenerateReqInput(input_ids=[[0], [0]], bootstrap_host=[FAKE_BOOTSTRAP_HOST] * 2, bootstrap_room=[0, 1])
        assert check_bootstrap_peer(None, warmup, [[0], [0]]) is None
    mixed = GenerateReqInput(input_ids=[[0], [0]], bootstrap_host=[FAKE_BOOTSTRAP_HOST, "10.9.9.9"], bootstrap_room=[0, 1])
    with pytest.raises(ValueError, match="'10.9.9.9' is not a peer"):
        check_bootstrap_peer(None, mixed, [[0], [0]])
    # the marker is still what SGLang's probe and warm-up send (else this allowance is stale)
    source = inspect.getsource(http_server)
    assert "gri.bootstrap_host = FAKE_BOOTSTRAP_HOST" in source
    if per_rank is not None:
        assert '"bootstrap_host": FAKE_BOOTSTRAP_HOST,' in inspect.getsource(per_rank)
    else:
        assert '"bootstrap_host": [FAKE_BOOTSTRAP_HOST] * server_args.dp_size' in source


# --- the launcher ---------------------------------------------------------------------------


def test_the_launcher_names_the_topologys_engine_hosts_as_peers():
    from prfaas_sglang.launch.command import mock_command, peer_hosts, with_peer_hosts
    from prfaas_sglang.topology import parse_topology

    def topo(decode_host: str):
        return parse_topology({"version": 1, "clusters": {
            "p": {"kind": "prfaas", "nodes": [{"name": "p0", "role": "prfaas", "host": "10.0.0.1", "port": 1, "bootstrap_port": 2}]},
            "d": {"kind": "pd", "nodes": [{"name": "d0", "role": "pd-decode", "host": decode_host, "port": 3}]},
            "c": {"kind": "control", "nodes": [{"name": "r", "role": "router", "host": "10.9.9.9", "port": 4}]}},
            "links": [{"from": "p", "to": "d", "bandwidth_gbps": 10}]})

    t = topo("10.0.0.2")
    assert peer_hosts(t) == "10.0.0.1,10.0.0.2"  # engines only: the router hands no KV
    assert peer_hosts(topo("0.0.0.0")) is None  # a wildcard host: peers unknown, so no list
    cmd = with_peer_hosts(mock_command(t.node("d0"), "python", "h20x8"), t, {})
    assert cmd.env["PRFAAS_PEER_HOSTS"] == "10.0.0.1,10.0.0.2"
    kept = with_peer_hosts(mock_command(t.node("d0"), "python", "h20x8"), t, {"PRFAAS_PEER_HOSTS": "x"})
    assert "PRFAAS_PEER_HOSTS" not in kept.env and kept.env_kept["PRFAAS_PEER_HOSTS"] == "10.0.0.1,10.0.0.2"


def test_the_vocab_hook_refuses_ids_sglang_would_read_out_of_bounds():
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import GenerateReqInput

    from prfaas_sglang.hooks.deployment_auth import check_ids_in_vocab

    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100))
    ok = GenerateReqInput(input_ids=[0, 5, 99])
    assert check_ids_in_vocab(manager, ok, ok.input_ids) is None
    for ids in ([0, 100], [-1, 3], [[1, 2], [3, 4096]]):
        with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 100\)"):
            check_ids_in_vocab(manager, GenerateReqInput(input_ids=ids), ids)
    image = GenerateReqInput(input_ids=[1, 10**6], image_data=["x.png"])
    assert check_ids_in_vocab(manager, image, image.input_ids) is None  # multimodal: SGLang's processors decide
    assert check_ids_in_vocab(SimpleNamespace(), ok, ok.input_ids) is None  # no model config: nothing to check


def test_sglangs_link_telemetry_publisher_binds_its_host_with_curve():
    """The kv-telemetry hook's publisher (real SGLang PrfaaS workers): on the configured host, a
    CURVE server: the deployment's subscriber gets samples, one without the key nothing."""
    from prfaas_sglang.adapters.zmq import CurveKeys, ZmqSubscriber
    from prfaas_sglang.hooks.kv_telemetry import LinkTelemetry
    from prfaas_sglang.wire.telemetry import TELEMETRY_TOPIC

    curve = CurveKeys.from_deployment(KEYS)
    port = _port()
    telemetry = LinkTelemetry(port, "w@test", "127.0.0.1", curve)
    telemetry.start()

    async def run():
        ours, eve = ZmqSubscriber(curve=curve), ZmqSubscriber()
        got, heard = [], []
        ours.watch("ours", f"tcp://127.0.0.1:{port}", TELEMETRY_TOPIC, got.append)
        eve.watch("eve", f"tcp://127.0.0.1:{port}", TELEMETRY_TOPIC, heard.append)
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.6)  # two more intervals for the eavesdropper
        listening = [c.laddr for c in psutil.Process().net_connections("inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        await ours.close()
        await eve.close()
        return got, heard, listening

    import psutil

    try:
        got, heard, listening = asyncio.run(run())
    finally:
        telemetry.stop()
    assert got and got[0][0] == TELEMETRY_TOPIC
    assert not heard
    assert [a.ip for a in listening] == ["127.0.0.1"]
