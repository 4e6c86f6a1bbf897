"""A deployment with a secret, end to end on emulated workers (issue #16 item 4).

Every process gets ``PRFAAS_SECRET_FILE`` except one: the PD prefill worker plays a node that
does not hold the deployment's secret (a forged KV-event and telemetry source). Shown here:

* requests flow through the router with signed hand-offs and CURVE event streams;
* the router refuses the secret-less node's event stream (a failed handshake, counted) and its
  index never holds that node's blocks;
* without the worker API key, a worker's endpoints answer 401 (health and metrics stay open);
* a registration or ``kv_ready`` that is unsigned, signed with another secret, replayed, or names
  a host outside the topology is refused before it is acted on, and counted by reason;
* nothing binds all interfaces, Mooncake's two listeners per engine included (the launcher's bind
  shim; Mooncake cannot be told an interface), checked in the socket table.
"""

from __future__ import annotations

import os
import sys
import time
from unittest import mock

import psutil
import pytest
import requests
from helpers import wait_subscribed

from prfaas_sglang.demo.cluster import ProcessGroup, local_topology, start_deployment
from prfaas_sglang.wire.auth import AUTH_HEADER, DeploymentKeys, sign
from prfaas_sglang.wire.handoff import KvReady, Registration

SECRET = b"a test deployment secret, 40 bytes long"
PAGE = 512


def metric(url: str, name: str, labels: str = "") -> float:
    for line in requests.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def rejected(url: str, reason: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in requests.get(url + "/metrics", timeout=5).text.splitlines()
               if line.startswith("prfaas:auth_rejected_total{") and f'reason="{reason}"' in line)


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secured")
    secret = tmp / "secret"
    secret.write_bytes(SECRET + b"\n")
    secret.chmod(0o600)
    group = ProcessGroup(tmp / "logs")
    doc = local_topology(speedup=50, kv_scale=0.002, threshold_tokens=4096)
    with mock.patch.dict(os.environ, {"PRFAAS_SECRET_FILE": str(secret)}):
        # The PD prefill worker starts without the secret: a node outside the deployment.
        d = start_deployment(group, doc, "--no-early-rejection",
                             engine_args={r: ("--bootstrap-timeout-s", "5") for r in ("prfaas", "pd-prefill", "pd-decode")},
                             node_env={"pd-prefill": {"PRFAAS_SECRET_FILE": ""}}, name="secured")
    try:
        yield group, d, DeploymentKeys.from_secret(SECRET)
    finally:
        group.stop()


@pytest.mark.slow
def test_requests_flow_with_signed_hand_offs_and_authenticated_event_streams(secured):
    _, d, _ = secured
    # a PUB/SUB join: the store event published before the router's handshake would be lost (a loaded CI machine)
    wait_subscribed(d.router.url + "/status", ["kv:prfaas-0", "link:prfaas-0"])
    ids = list(range(3_000_000, 3_000_000 + 16 * PAGE))
    for _ in range(2):  # the PrfaaS cache keeps (and reports) a prefix seen twice, not a one-off prompt
        r = requests.post(d.router.url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}},
                          timeout=120)
        assert r.status_code == 200, r.text[:300]
        assert r.headers["x-prfaas-route"].startswith("prfaas/")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        status = requests.get(d.router.url + "/status", timeout=5).json()
        subs = status["subscriptions"]
        if subs.get("kv:prfaas-0", {}).get("frames", 0) > 0 and subs.get("link:prfaas-0", {}).get("frames", 0) > 0:
            break
        time.sleep(0.2)
    assert subs["kv:prfaas-0"]["frames"] > 0 and subs["kv:prfaas-0"]["auth_failures"] == 0, subs
    assert subs["link:prfaas-0"]["frames"] > 0 and subs["link:prfaas-0"]["auth_failures"] == 0, subs


@pytest.mark.slow
def test_the_router_refuses_the_event_stream_of_a_node_without_the_secret(secured):
    _, d, keys = secured
    rogue = d.worker("pd-prefill").url
    # The rogue node publishes events (a prefill it ran); the router must hear none of them.
    ids = list(range(4_000_000, 4_000_000 + 4 * PAGE))
    requests.post(rogue + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1},
                                             "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 7},
                  headers=keys.bearer(), timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        subs = requests.get(d.router.url + "/status", timeout=5).json()["subscriptions"]
        if subs.get("kv:pd-prefill-0", {}).get("auth_failures", 0) > 0:
            break
        time.sleep(0.2)
    assert subs["kv:pd-prefill-0"]["auth_failures"] > 0 and subs["kv:pd-prefill-0"]["frames"] == 0, subs
    assert metric(d.router.url, "prfaas_router_zmq_auth_failures_total") > 0
    workers = requests.get(d.router.url + "/status", timeout=5).json()["workers"]
    assert not workers["pd-prefill-0"]["index_blocks"], workers["pd-prefill-0"]


def test_a_workers_api_needs_the_deployment_key_but_health_and_metrics_stay_open(secured):
    _, d, keys = secured
    decode = d.worker("pd-decode").url
    before = rejected(decode, "missing")
    body = {"input_ids": [1, 2, 3], "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 1}
    for method, path, payload in (("post", "/generate", body), ("post", "/flush_cache", None),
                                  ("post", "/prfaas/faults", {"fail_kv_transfers": 1}), ("get", "/server_info", None)):
        r = getattr(requests, method)(decode + path, json=payload, timeout=10)
        assert r.status_code == 401, (path, r.status_code, r.text[:200])
    wrong = requests.post(decode + "/flush_cache", headers={"Authorization": "Bearer not-the-key"}, timeout=10)
    assert wrong.status_code == 401
    assert rejected(decode, "missing") >= before + 4 and rejected(decode, "bad_key") >= 1
    assert requests.get(decode + "/health", timeout=10).status_code == 200
    assert requests.get(decode + "/server_info", headers=keys.bearer(), timeout=10).status_code == 200


def _post(url: str, path: str, payload: dict, key: bytes | None, headers: dict | None = None,
          now_s: float | None = None) -> requests.Response:
    import json

    body = json.dumps(payload).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h[AUTH_HEADER] = sign(key, "POST", path, body, time.time() if now_s is None else now_s)
    return requests.post(url + path, data=body, headers=h, timeout=10)


def test_a_forged_registration_is_refused_before_it_is_acted_on_and_counted(secured):
    _, d, keys = secured
    p = d.worker("prfaas")
    boot = f"http://127.0.0.1:{p.bootstrap_port}"
    reg = Registration(room=424242, session="127.0.0.1:1", addr=4096, length=1 << 20,
                       notify_url="http://127.0.0.1:1/prfaas/kv_ready").to_json()
    other = DeploymentKeys.from_secret(b"somebody else's secret, long enough")
    before = {r: rejected(p.url, r) for r in ("missing", "bad_mac", "stale", "replayed", "unknown_peer")}
    assert _post(boot, "/prfaas/register", reg, None).status_code == 401
    assert _post(boot, "/prfaas/register", reg, other.handoff_key).status_code == 401
    assert _post(boot, "/prfaas/register", reg, keys.handoff_key, now_s=time.time() - 600).status_code == 401
    # Signed for another path: the MAC covers the path.
    body = b'{"v": 2}'
    r = requests.post(boot + "/prfaas/register", data=body,
                      headers={AUTH_HEADER: sign(keys.handoff_key, "POST", "/prfaas/kv_ready", body, time.time())}, timeout=10)
    assert r.status_code == 401
    # A signed registration naming a host outside the topology: 403.
    evil = dict(reg, notify_url="http://10.255.0.9:80/prfaas/kv_ready", room=424243)
    assert _post(boot, "/prfaas/register", evil, keys.handoff_key).status_code == 403
    # A valid one is accepted once; the same bytes and signature again are a replay.
    body = Registration(room=424244, session="127.0.0.1:1", addr=4096, length=1 << 20,
                        notify_url="http://127.0.0.1:1/prfaas/kv_ready").to_json()
    import json

    raw = json.dumps(body).encode()
    header = {AUTH_HEADER: sign(keys.handoff_key, "POST", "/prfaas/register", raw, time.time()), "Content-Type": "application/json"}
    assert requests.post(boot + "/prfaas/register", data=raw, headers=header, timeout=10).status_code == 200
    assert requests.post(boot + "/prfaas/register", data=raw, headers=header, timeout=10).status_code == 401
    after = {r: rejected(p.url, r) for r in before}
    assert after["missing"] >= before["missing"] + 1
    assert after["bad_mac"] >= before["bad_mac"] + 2
    assert after["stale"] >= before["stale"] + 1
    assert after["replayed"] >= before["replayed"] + 1
    assert after["unknown_peer"] >= before["unknown_peer"] + 1


def test_a_forged_kv_ready_and_a_foreign_bootstrap_host_are_refused(secured):
    _, d, keys = secured
    decode = d.worker("pd-decode").url
    ready = KvReady(room=99, ok=True, kv_bytes=1, cached_tokens=0, first_token=5, transfer_s=0.01, error=None).to_json()
    # Even with the API key, kv_ready needs the hand-off signature.
    assert _post(decode, "/prfaas/kv_ready", ready, None, keys.bearer()).status_code == 401
    assert _post(decode, "/prfaas/kv_ready", ready, b"x" * 32, keys.bearer()).status_code == 401
    before = rejected(decode, "unknown_peer")
    r = requests.post(decode + "/generate", headers=keys.bearer(), timeout=10, json={
        "input_ids": list(range(100)), "sampling_params": {"max_new_tokens": 1},
        "bootstrap_host": "10.255.0.9", "bootstrap_port": 8998, "bootstrap_room": 5})
    assert r.status_code == 403, r.text[:200]
    assert rejected(decode, "unknown_peer") == before + 1


def test_nothing_listens_on_all_interfaces(secured):
    """Every listener of every process binds the node's address, Mooncake's two per engine too (the
    launcher preloads the bind shim, prfaas_sglang/native/bindshim.c: its handshake listener on
    127.0.0.1, its dual-stack data listener on the v4-mapped ::ffff:127.0.0.1)."""
    group, d, _ = secured
    mooncake = {}
    for proc in group.procs:
        try:
            listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
        assert listening, proc.name
        for addr in listening:
            assert addr.ip in ("127.0.0.1", "::ffff:127.0.0.1"), (proc.name, addr)
            if 15000 <= addr.port <= 17000:
                mooncake.setdefault(proc.name, []).append(addr.ip)
    # Mooncake's RPC (handshake) and TCP data listeners, in its port range, one pair per engine.
    assert {name: sorted(ips) for name, ips in mooncake.items()} == {
        name: ["127.0.0.1", "::ffff:127.0.0.1"] for name in ("prfaas-0", "pd-prefill-0", "pd-decode-0")}, mooncake


def test_the_router_serves_tls_when_given_a_certificate(secured):
    """A second router over the same workers, with ``--tls-cert-file/--tls-key-file``: HTTPS answers
    (health, a routed request), plain HTTP on that port does not."""
    from helpers import REPO_ROOT

    from prfaas_sglang.demo.cluster import PortPicker

    group, d, _ = secured
    tls = REPO_ROOT / "tests" / "fixtures" / "tls"
    port = PortPicker()("127.0.0.1")
    proc = group.start("router-tls", [sys.executable, "-m", "prfaas_sglang.launch", "--config", str(d.router.config),
                                      "--port", str(port), "--no-early-rejection",
                                      "--tls-cert-file", str(tls / "cert.pem"), "--tls-key-file", str(tls / "key.pem")],
                       env={"PRFAAS_SECRET_FILE": str(group.log_dir.parent / "secret")})
    url = f"https://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (group.log_dir / "router-tls.log").read_text()[-800:]
        try:
            if requests.get(url + "/health", verify=str(tls / "cert.pem"), timeout=2).status_code == 200:
                break
        except requests.exceptions.ConnectionError:
            pass
        assert time.monotonic() < deadline, "the TLS router never answered"
        time.sleep(0.3)
    r = requests.post(url + "/generate", json={"input_ids": list(range(5_000_000, 5_000_000 + 16 * PAGE)),
                                               "sampling_params": {"max_new_tokens": 2}},
                      verify=str(tls / "cert.pem"), timeout=120)
    assert r.status_code == 200, r.text[:300]
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
    proc.terminate()
    proc.wait(timeout=20)


@pytest.mark.slow
def test_a_router_refuses_half_a_tls_configuration_or_a_bad_certificate(tmp_path):
    from helpers import run_py

    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    for flags, words in ((["--tls-cert-file", str(bad)], "go together"),
                         (["--tls-cert-file", str(bad), "--tls-key-file", str(bad)], "cannot load")):
        proc = run_py(["-m", "prfaas_sglang.router", "--config", "launch/local-two-cluster.yaml", "--port", "1", *flags],
                      timeout=60)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-500:]
