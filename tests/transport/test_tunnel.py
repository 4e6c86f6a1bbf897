"""Encrypted links (``links[].encrypt``): a WireGuard tunnel per host, transparent to Mooncake, failing closed.

Two network namespaces joined by the link emulator, a PrfaaS host in one and a PD host in the other; each
brings up the tunnel its topology plans for it (``transport/tunnel_plan.py``, ``adapters/wireguard.py``;
wireguard-go, as this kernel has no WireGuard). A capture on the PD side's link device sees what crosses
the wire. Needs root, /dev/net/tun, wireguard-go and wg (scripts/setup-env.sh installs them).
"""

from __future__ import annotations

import dataclasses
import json
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prfaas_sglang.adapters.wireguard import Tunnel, TunnelError, public_keys
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.topology import parse_topology
from prfaas_sglang.transport.linkem import EmulatedLink
from prfaas_sglang.transport.tunnel_plan import RULE_PRIORITY, moved_peers, plan
from prfaas_sglang.wire.auth import DeploymentKeys

PEER = (sys.executable, "-m", "prfaas_sglang.bench.transport_peer")
CAPTURE = (sys.executable, "-m", "prfaas_sglang.bench.wire_capture")
KEYS = DeploymentKeys.from_secret(b"a deployment secret of 32 bytes!")
PATTERN = b"\x01" * 64  # transport_peer's payload is ones: a run of them in a packet is KV in clear
TUNNEL_PORT = 51820
# A launcher's environment without the virtual environment's bin: the system's, /usr/local first (where
# scripts/install-wireguard-go.sh puts wireguard-go: without it a machine with no older one in /usr/bin failed)
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def raw_topology(prfaas_host: str, pd_host: str, encrypt: bool = True) -> dict:
    return {
        "version": 1,
        "clusters": {"prfaas": {"kind": "prfaas", "nodes": [{"name": "prfaas-0", "role": "prfaas", "host": prfaas_host,
                                                             "port": 30000, "bootstrap_port": 8998}]},
                     "pd": {"kind": "pd", "nodes": [{"name": "pd-decode-0", "role": "pd-decode", "host": pd_host, "port": 30001},
                                                    {"name": "pd-prefill-0", "role": "pd-prefill", "host": pd_host,
                                                     "port": 30002, "bootstrap_port": 8999}]}},
        "links": [{"from": "prfaas", "to": "pd", "bandwidth_gbps": 1, "encrypt": encrypt}]}


def topology(prfaas_host: str, pd_host: str, encrypt: bool = True):
    return parse_topology(raw_topology(prfaas_host, pd_host, encrypt))


def test_the_plan_puts_each_side_behind_the_other_and_refuses_what_it_cannot_encrypt():
    topo = topology("10.1.0.1", "10.2.0.1")
    keys = {}
    prfaas = plan(topo, "10.1.0.1", lambda h: keys.setdefault(h, f"key-of-{h}"))
    pd = plan(topo, "10.2.0.1", lambda h: f"key-of-{h}")
    assert prfaas.peer_hosts == ("10.2.0.1",) and pd.peer_hosts == ("10.1.0.1",)
    assert prfaas.peers[0].public_key == "key-of-10.2.0.1" and prfaas.listen_port == TUNNEL_PORT
    assert prfaas.interface != pd.interface and len(prfaas.interface) <= 15
    assert plan(topology("10.1.0.1", "10.2.0.1", encrypt=False), "10.1.0.1", str) is None
    assert plan(topo, "10.9.9.9", str) is None  # a host on no encrypted link
    with pytest.raises(ConfigError, match=r"links\[0\]\.encrypt: host 127.0.0.1 is on both sides"):
        plan(topology("127.0.0.1", "127.0.0.1"), "127.0.0.1", str)
    with pytest.raises(ConfigError, match=r"links\[0\]\.encrypt: host pd-0.example is not an IP address"):
        plan(topology("10.1.0.1", "pd-0.example"), "10.1.0.1", str)


def test_a_plan_between_names_resolves_them_and_says_which_peer_moved():
    topo = topology("prfaas-0.x", "pd-0.x")
    addresses = {"prfaas-0.x": "10.1.0.1", "pd-0.x": "10.2.0.1"}
    first = plan(topo, "prfaas-0.x", lambda h: f"key-of-{h}", resolve=addresses.__getitem__)
    assert (first.address, first.peers[0].host, first.peer_hosts) == ("10.1.0.1", "pd-0.x", ("10.2.0.1",))
    assert first.peers[0].public_key == "key-of-pd-0.x"  # keys by name: a recreated pod keeps its key
    again = plan(topo, "prfaas-0.x", lambda h: f"key-of-{h}", resolve={**addresses, "pd-0.x": "10.2.0.7"}.__getitem__)
    assert again.interface == first.interface
    assert [(b.address, a.address) for b, a in moved_peers(first, again)] == [("10.2.0.1", "10.2.0.7")]
    assert moved_peers(first, first) == []
    with pytest.raises(ConfigError, match="resolve to one address"):
        plan(topo, "prfaas-0.x", str, resolve=lambda h: "10.1.0.1")


def test_a_plan_locks_the_far_sides_ranges_and_refuses_one_that_holds_its_own_host():
    """``clusters.<c>.cidrs``: each host's tunnel locks the other side's ranges (and its peers outside them); a
    range given for the far side that holds the host itself (one pod range for both sides) is refused by name;
    a bad range is refused by its path."""
    raw = raw_topology("10.1.0.1", "10.2.0.1")
    raw["clusters"]["prfaas"]["cidrs"] = ["10.1.0.0/16"]
    raw["clusters"]["pd"]["cidrs"] = ["10.2.0.0/16", "fd00:2::/64"]
    topo = parse_topology(raw)
    prfaas, pd = plan(topo, "10.1.0.1", str), plan(topo, "10.2.0.1", str)
    assert prfaas.locked == ("10.2.0.0/16", "fd00:2::/64") and pd.locked == ("10.1.0.0/16",)
    assert prfaas.locked_destinations() == ("10.2.0.0/16", "fd00:2::/64")  # the peer lies inside: the range covers it
    raw["clusters"]["pd"]["cidrs"] = ["10.3.0.0/16"]  # the peer outside the range: locked on its own too
    assert plan(parse_topology(raw), "10.1.0.1", str).locked_destinations() == ("10.3.0.0/16", "10.2.0.1")
    raw["clusters"]["pd"]["cidrs"] = ["10.0.0.0/8"]  # one range for both sides
    with pytest.raises(ConfigError, match=r"clusters\.pd\.cidrs: 10\.0\.0\.0/8 holds 10\.1\.0\.1's own address"):
        plan(parse_topology(raw), "10.1.0.1", str)
    for bad, field in ((["10.2.0.1/16"], r"clusters\.pd\.cidrs\[0\]: not an address range"), ("10.2.0.0/16", r"clusters\.pd\.cidrs: must be a list"),
                       ([16], r"clusters\.pd\.cidrs\[0\]")):
        raw["clusters"]["pd"]["cidrs"] = bad
        with pytest.raises(ConfigError, match=field):
            parse_topology(raw)


def test_every_host_derives_every_peers_key_from_the_secret_alone():
    assert KEYS.tunnel_private_key("10.1.0.1") == DeploymentKeys.from_secret(b"a deployment secret of 32 bytes!").tunnel_private_key("10.1.0.1")
    assert KEYS.tunnel_private_key("10.1.0.1") != KEYS.tunnel_private_key("10.2.0.1")
    assert KEYS.tunnel_private_key("10.1.0.1") != DeploymentKeys.from_secret(b"another secret, also 32 bytes!!").tunnel_private_key("10.1.0.1")


@pytest.fixture
def link():
    with EmulatedLink(tag=None, rate_mbit=400, rtt_ms=2) as link:
        yield link


def tunnels(link: EmulatedLink, b_keys: DeploymentKeys = KEYS) -> tuple[Tunnel, Tunnel]:
    topo = topology(link.ip_a, link.ip_b)
    a = Tunnel(plan(topo, link.ip_a, public_keys(KEYS)), KEYS.tunnel_private_key(link.ip_a), wrap=link.wrap_a)
    b = Tunnel(plan(topo, link.ip_b, public_keys(KEYS)), b_keys.tunnel_private_key(link.ip_b), wrap=link.wrap_b)
    return a, b


class Capture:
    """What crosses B's link device meanwhile: per packet its protocol, ports and whether it holds the payload."""

    def __init__(self, link: EmulatedLink):
        self.proc = subprocess.Popen((*link.wrap_b, *CAPTURE, link.tun_b, PATTERN.hex()),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def stop(self) -> dict:
        out, _ = self.proc.communicate(timeout=30)
        return json.loads(out)


def kv_transfer(link: EmulatedLink, payload_mib: int, timeout_s: float = 60) -> dict:
    """One Mooncake TCP transfer of ones from A to B (bench transport's peers); its answer."""
    recv = subprocess.Popen((*link.wrap_b, *PEER, "recv", "--host", link.ip_b, "--buffer-mib", str(payload_mib)),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={"MC_FORCE_TCP": "1", "PATH": "/usr/bin:/bin", "MC_TCP_PROGRESS_TIMEOUT_SEC": "5",
                                 "MC_TRANSFER_TIMEOUT": "10"})
    try:
        landing = json.loads(recv.stdout.readline())
        send = subprocess.Popen((*link.wrap_a, *PEER, "send", "--host", link.ip_a, "--buffer-mib", str(payload_mib),
                                 "--peer", landing["session"], "--addr", str(landing["addr"])),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env={"MC_FORCE_TCP": "1", "PATH": "/usr/bin:/bin", "MC_TCP_PROGRESS_TIMEOUT_SEC": "5",
                                     "MC_TRANSFER_TIMEOUT": "10"})
        assert send.stdout.readline()
        job = {"payload_bytes": payload_mib << 20, "request_bytes": 1 << 20, "chunk_bytes": 8 << 20}
        out, _ = send.communicate(json.dumps(job) + "\n", timeout=timeout_s)
        return json.loads(out.splitlines()[0]) if out.strip() else {"ok": False}
    finally:
        recv.stdin.close()
        recv.wait(timeout=10)


def test_kv_through_the_tunnel_shows_none_of_its_bytes_on_the_link(link):
    a, b = tunnels(link)
    with a, b:
        capture = Capture(link)
        result = kv_transfer(link, 16)
        seen = capture.stop()
    assert result["ok"], result
    assert seen["dropped"] == 0 and seen["bytes"] > 16 << 20  # the capture saw every packet; the KV crossed here
    assert seen["protocols"] == {"udp": seen["packets"]}  # nothing but WireGuard's UDP
    assert seen["ports"] == [TUNNEL_PORT] and seen["with_pattern"] == 0


def test_a_host_without_the_key_receives_nothing(link):
    """B's tunnel holds a key from another secret: the handshake never completes, so A's KV reaches B neither
    decrypted nor in clear, and the transfer fails."""
    a, b = tunnels(link, b_keys=DeploymentKeys.from_secret(b"an impostor's secret, 32 bytes!!"))
    with a, b:
        capture = Capture(link)
        result = kv_transfer(link, 4, timeout_s=90)
        seen = capture.stop()
        assert not result["ok"]
        assert seen["with_pattern"] == 0 and set(seen["protocols"]) <= {"udp"} and seen["bytes"] < 64 << 10


def test_a_tunnel_taken_down_fails_closed(link):
    """The interface gone (a crashed tunnel): the peer's address is a blackhole, not a way around in clear."""
    a, b = tunnels(link)
    with a, b:
        assert kv_transfer(link, 1)["ok"]
        a.take_down_interface()
        capture = Capture(link)
        connect = subprocess.run((*link.wrap_a, sys.executable, "-c",
                                  f"import socket; socket.create_connection(({link.ip_b!r}, 9), timeout=3)"),
                                 capture_output=True, text=True, timeout=30)
        time.sleep(0.2)
        seen = capture.stop()
    assert connect.returncode != 0 and "Invalid argument" in connect.stderr  # a blackhole route refuses the connect
    assert seen["packets"] == 0


@pytest.mark.skipif(shutil.which("nft") is None, reason="the netfilter lock needs nftables (scripts/setup-env.sh installs it)")
def test_routing_that_fails_to_hold_still_sends_nothing_in_clear(link):
    """The policy rule gone (what a second tunnel's cleanup once did): the netfilter lock drops A's packets for B
    that would leave by the link in clear, and counts them; nothing but the tunnel's UDP crosses."""
    a, b = tunnels(link)
    with a, b:
        assert a.filtered and a.blocked_packets() == 0
        subprocess.run((*link.wrap_a, "ip", "-4", "rule", "del", "priority", str(RULE_PRIORITY)), check=True)
        capture = Capture(link)
        connect = subprocess.run((*link.wrap_a, sys.executable, "-c",
                                  f"import socket; socket.create_connection(({link.ip_b!r}, 9), timeout=2)"),
                                 capture_output=True, text=True, timeout=30)
        seen = capture.stop()
        assert connect.returncode != 0 and a.blocked_packets() > 0
    assert set(seen["protocols"]) <= {"udp"} and seen["ports"] in ([], [TUNNEL_PORT])


def test_an_address_of_the_far_range_the_tunnel_does_not_route_yet_receives_nothing(link):
    """B's range locked (``clusters.pd.cidrs``): B back at an address the tunnel has not resolved yet (a pod just
    recreated) is reachable on the link, yet A's connection to it is refused before a packet leaves; once the
    tunnel moves B's peer there, the KV crosses encrypted; after ``down`` the range is no longer held."""
    moved_to = f"10.217.{link.tag}.2"
    raw = raw_topology(link.ip_a, link.ip_b)
    raw["clusters"]["pd"]["cidrs"] = [f"10.217.{link.tag}.0/24"]
    a = Tunnel(plan(parse_topology(raw), link.ip_a, public_keys(KEYS)), KEYS.tunnel_private_key(link.ip_a), wrap=link.wrap_a)
    subprocess.run((*link.wrap_b, "ip", "addr", "add", f"{moved_to}/32", "dev", link.tun_b), check=True)
    subprocess.run((*link.wrap_a, "ip", "route", "add", f"{moved_to}/32", "dev", link.tun_a), check=True)

    def connect() -> tuple[subprocess.CompletedProcess, dict]:
        capture = Capture(link)
        proc = subprocess.run((*link.wrap_a, sys.executable, "-c",
                               f"import socket; socket.create_connection(({moved_to!r}, 9), timeout=2)"),
                              capture_output=True, text=True, timeout=30)
        time.sleep(0.2)
        return proc, capture.stop()

    without_range, _ = tunnels(link)
    with without_range:  # the control: the tunnel knows only B's old address, so the new one is reached in clear
        _, seen = connect()
        assert seen["protocols"].get("tcp", 0) > 0, seen
    _, b = tunnels(link)
    with a, b:
        proc, seen = connect()
        assert proc.returncode != 0 and "Invalid argument" in proc.stderr, proc.stderr  # the range's blackhole
        assert set(seen["protocols"]) <= {"udp"} and seen["with_pattern"] == 0, seen
        moved = dataclasses.replace(a.plan, peers=(dataclasses.replace(a.plan.peers[0], address=moved_to),))
        assert a.update(moved) == [(link.ip_b, moved_to)]  # what the holder does once the name resolves again
        capture = Capture(link)
        result = kv_transfer(_Moved(link, moved_to), 1)
        seen = capture.stop()
        assert result["ok"], result
        assert seen["protocols"] == {"udp": seen["packets"]} and seen["with_pattern"] == 0
    routes = subprocess.run((*link.wrap_a, "ip", "route", "show", "table", "all"), capture_output=True, text=True).stdout
    assert f"10.217.{link.tag}.0/24" not in routes


def test_a_tunnel_that_fails_to_come_up_leaves_the_hosts_other_tunnel_whole(link):
    """A second tunnel on a host whose port is taken fails, and its cleanup takes its own interface only: the rule
    and routes that keep the first one's peers out of the clear stay, and KV still crosses encrypted. A second
    holder of the same host's tunnel is refused before it touches anything (it would replace the live interface)."""
    a, b = tunnels(link)
    with a, b:
        second = Tunnel(dataclasses.replace(a.plan, interface="pwgsecond"), KEYS.tunnel_private_key(link.ip_a),
                        wrap=link.wrap_a)
        with pytest.raises(TunnelError, match="in use"):
            second.up()
        same = Tunnel(a.plan, KEYS.tunnel_private_key(link.ip_a), wrap=link.wrap_a)
        with pytest.raises(TunnelError, match=f"the tunnel {a.plan.interface} of {link.ip_a} is held by another process"):
            same.up()
        capture = Capture(link)
        result = kv_transfer(link, 1)
        seen = capture.stop()
    assert result["ok"], result
    assert seen["protocols"] == {"udp": seen["packets"]} and seen["ports"] == [TUNNEL_PORT]


def test_a_tunnel_that_cannot_come_up_says_why(link):
    a, _ = tunnels(link)
    a.userspace = "/nonexistent/wireguard-go"
    with pytest.raises(TunnelError, match="cannot bring up the tunnel|did not start"):
        a.up()


def test_the_launcher_holds_a_hosts_tunnel_and_a_node_on_the_link_refuses_to_start_without_it(link, tmp_path):
    """``launch --tunnel --host H`` brings H's tunnel up, holds it and takes it down on SIGTERM; an engine node on
    the encrypted link refuses to start (one line, the command to run) while its host has no tunnel."""
    import yaml

    from prfaas_sglang.adapters.wireguard import not_up

    config = tmp_path / "topology.yaml"
    config.write_text(yaml.safe_dump(raw_topology(link.ip_a, link.ip_b)))
    doc = topology(link.ip_a, link.ip_b)
    secret = tmp_path / "secret"
    secret.write_bytes(b"a deployment secret of 32 bytes!")
    secret.chmod(0o600)
    env = {"PRFAAS_SECRET_FILE": str(secret), "PATH": SYSTEM_PATH}
    launch = (*link.wrap_a, sys.executable, "-m", "prfaas_sglang.launch", "--config", str(config))
    refused = subprocess.run((*launch, "--node", "prfaas-0", "--engine", "mock", "--profile", "kimi-linear-1t-hybrid@h200x8"),
                             capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"the tunnel of host {link.ip_a} is not up" in refused.stderr and "--tunnel --host" in refused.stderr
    holder = subprocess.Popen((*launch, "--tunnel", "--node", "prfaas-0"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert holder.stdout.readline().startswith("tunnel pwg"), holder.stderr.read()
        tunnel_plan = plan(doc, link.ip_a, lambda h: "")
        assert not_up(tunnel_plan, link.wrap_a) is None
    finally:
        holder.terminate()
        assert holder.wait(timeout=20) == 0
    assert not_up(tunnel_plan, link.wrap_a) is not None  # taken down with the holder
    lonely = subprocess.run((*launch, "--tunnel", "--host", "10.9.9.9"), capture_output=True, text=True, env=env, timeout=60)
    assert lonely.returncode == 2 and "--host: 10.9.9.9 is on no encrypted link" in lonely.stderr
    bad = subprocess.run((*launch, "--tunnel", "--node", "prfaas-0"), capture_output=True, text=True, timeout=60,
                         env={**env, "PRFAAS_TUNNEL_RESOLVE_S": "-1"})
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "PRFAAS_TUNNEL_RESOLVE_S: must be" in bad.stderr
    assert not_up(tunnel_plan, link.wrap_a) is not None  # refused before any tunnel came up


def _hosts_file(ns: str, entries: dict[str, str]) -> None:
    """``ip netns exec NS`` sees this as /etc/hosts: the names a Kubernetes cluster's DNS would give."""
    directory = Path("/etc/netns") / ns
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "hosts").write_text("".join(f"{address} {name}\n" for name, address in entries.items()))


def test_a_tunnel_between_names_follows_a_peer_that_comes_back_at_a_new_address(link, tmp_path):
    """Hosts given as names (Kubernetes pods' DNS names): each ``--tunnel`` holder resolves them, keys derive from
    the names, and when B's pod comes back at another address, A's holder moves B's peer there within a few
    resolutions; the KV to B's new address crosses encrypted."""
    import yaml

    names = {"prfaas-0.test": link.ip_a, "pd-0.test": link.ip_b}
    moved_to = f"10.217.{link.tag}.2"
    for ns in (link.ns_a, link.ns_b):
        _hosts_file(ns, names)
    config = tmp_path / "topology.yaml"
    config.write_text(yaml.safe_dump(raw_topology("prfaas-0.test", "pd-0.test")))
    secret = tmp_path / "secret"
    secret.write_bytes(b"a deployment secret of 32 bytes!")
    secret.chmod(0o600)
    env = {"PRFAAS_SECRET_FILE": str(secret), "PATH": SYSTEM_PATH, "PRFAAS_TUNNEL_RESOLVE_S": "0.3"}

    def hold(wrap, node):
        proc = subprocess.Popen((*wrap, sys.executable, "-m", "prfaas_sglang.launch", "--config", str(config), "--tunnel",
                                 "--node", node), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = proc.stdout.readline()
        assert line.startswith("tunnel pwg"), proc.stderr.read()
        return proc, line

    a, a_line = hold(link.wrap_a, "prfaas-0")
    b, _ = hold(link.wrap_b, "pd-decode-0")
    try:
        assert f"peers {link.ip_b}" in a_line  # the name, resolved
        capture = Capture(link)
        first = kv_transfer(link, 1)
        b.terminate()  # B's pod goes, and comes back at another address
        assert b.wait(timeout=20) == 0
        subprocess.run((*link.wrap_b, "ip", "addr", "add", f"{moved_to}/32", "dev", link.tun_b), check=True)
        subprocess.run((*link.wrap_a, "ip", "route", "add", f"{moved_to}/32", "dev", link.tun_a), check=True)
        for ns in (link.ns_a, link.ns_b):
            _hosts_file(ns, {**names, "pd-0.test": moved_to})
        b, _ = hold(link.wrap_b, "pd-decode-0")
        ready, _, _ = select.select([a.stdout], [], [], 15)  # a few resolutions, 0.3 s apart
        assert ready and a.stdout.readline().strip().endswith(f"peer {link.ip_b} moved to {moved_to}")
        second = kv_transfer(_Moved(link, moved_to), 1)
        seen = capture.stop()
    finally:
        for proc in (a, b):
            proc.terminate()
            proc.wait(timeout=20)
        for ns in (link.ns_a, link.ns_b):
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
    assert first["ok"] and second["ok"], (first, second)
    assert seen["protocols"] == {"udp": seen["packets"]} and seen["ports"] == [TUNNEL_PORT] and seen["with_pattern"] == 0


class _Moved:
    """``link`` with B at another address, for :func:`kv_transfer`."""

    def __init__(self, link: EmulatedLink, ip_b: str):
        self._link, self.ip_b = link, ip_b

    def __getattr__(self, name: str):
        return getattr(self._link, name)


def test_the_tunnel_bench_measures_both_paths_side_by_side():
    """``bench tunnel`` at its smallest: the same link, a transfer through the tunnel and one in clear, each counted,
    and the tunnel daemons' CPU per gigabit (the figures themselves are BENCHMARKS.md's, not asserted here)."""
    from prfaas_sglang.bench import tunnel

    result = tunnel.run(rate_mbit=200, rtt_ms=2, payloads_mib=(4,), repeats=1)
    (row,) = result["rows"]
    assert row["tunnel_fraction"] > 0 and row["clear_fraction"] > 0 and row["ratio"] is not None
    assert result["tunnel"] in ("kernel", "wireguard-go") and (row["wg_cpu_s_per_gbit"] or 0) >= 0
