"""``free_port``: ports for servers started later come from below the kernel's ephemeral range, so no
``bind(0)`` or ``connect()`` of another process takes one before its server binds it."""

from __future__ import annotations

import random
import socket

import pytest

from prfaas_sglang.demo import cluster
from prfaas_sglang.errors import ConfigError


def test_picks_lie_above_mooncakes_ports_and_below_the_kernels_and_are_free():
    low, _ = cluster.ephemeral_port_range()
    picker = cluster.PortPicker()
    ports = [picker() for _ in range(20)]
    assert len(set(ports)) == 20
    for port in ports:
        assert cluster.OWN_PORTS_FROM <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


class FirstPick(random.Random):
    """Answers ``first`` once, then at random."""

    def __init__(self, first: int):
        super().__init__(7)
        self.first, self.calls = first, 0

    def randrange(self, start, stop):
        self.calls += 1
        return self.first if self.calls == 1 else super().randrange(start, stop)


@pytest.mark.parametrize("held_on", ["127.0.0.1", "127.0.0.2"])
def test_a_port_in_use_on_any_address_is_skipped(held_on):
    """Held on another address than the server's (a namespace link's host end; 127.0.0.2 stands in):
    still not free, since a server that binds 0.0.0.0 (smg's metrics) could not take it."""
    busy = cluster.free_port()
    with socket.socket() as held:
        held.bind((held_on, busy))
        held.listen()
        rng = FirstPick(busy)
        port = cluster.free_port("127.0.0.1", rng=rng)
    assert rng.calls >= 2 and port != busy


def test_where_the_range_is_empty_the_kernel_picks(monkeypatch):
    monkeypatch.delenv("PRFAAS_PORT_RANGE", raising=False)  # a parallel test worker's slice
    low, high = cluster.ephemeral_port_range()
    monkeypatch.setattr(cluster, "ephemeral_port_range", lambda: (1024, 65535))
    port = cluster.free_port()
    assert low <= port <= high
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_worker_slice_bounds_the_picks_and_a_malformed_one_is_refused(monkeypatch):
    monkeypatch.setenv("PRFAAS_PORT_RANGE", "27000-27016")
    assert all(27000 <= cluster.free_port() < 27016 for _ in range(20))
    for bad in ("27016-27000", "27000", "a-b", "0-10"):
        monkeypatch.setenv("PRFAAS_PORT_RANGE", bad)
        with pytest.raises(ConfigError, match="PRFAAS_PORT_RANGE"):
            cluster.own_port_range()


def test_a_picker_never_returns_a_port_picked_for_a_server_not_yet_started(monkeypatch):
    """A topology's ports are picked, then bound when its servers start; another pick of the same run
    (the dashboard bench's Prometheus and kv-index) must avoid them, or the server starting later finds its
    port taken (fresh-clone run, issue #58: a Prometheus started first held a PD-P worker's bootstrap port)."""
    doc = cluster.local_topology(role_switch="restart")
    ports = cluster.topology_ports(doc)
    named = {n[key] for n in cluster.topology_nodes(doc).values() for key in cluster.NODE_PORT_KEYS if n.get(key)}
    assert ports == named and any(n.get("switch_port") for n in cluster.topology_nodes(doc).values())
    monkeypatch.setenv("PRFAAS_PORT_RANGE", "27000-27004")
    pick = cluster.PortPicker(taken={27000, 27001, 27002})
    assert pick() == 27003  # the only one left; free_port alone would answer any of the four
    with pytest.raises(cluster.StartupError, match="no free port in 27000-27004 that is not already picked"):
        pick()  # the range is spent: a typed error, not a loop without end


def test_the_range_is_read_from_the_kernel(tmp_path):
    path = tmp_path / "range"
    path.write_text("40000\t50000\n")
    assert cluster.ephemeral_port_range(str(path)) == (40000, 50000)
    path.write_text("garbage")
    assert cluster.ephemeral_port_range(str(path)) == (32768, 60999)
