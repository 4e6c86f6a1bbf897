"""``free_port``: ports for servers started later come from below the kernel's ephemeral range, so no
``bind(0)`` or ``connect()`` of another process takes one before its server binds it."""

from __future__ import annotations

import random
import socket

from prfaas_sglang.demo import cluster


def test_picks_lie_above_mooncakes_ports_and_below_the_kernels_and_are_free():
    low, _ = cluster.ephemeral_port_range()
    picker = cluster.PortPicker()
    ports = [picker() for _ in range(20)]
    assert len(set(ports)) == 20
    for port in ports:
        assert cluster.OWN_PORTS_FROM <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_skipped():
    class FirstPick(random.Random):
        """Answers ``first`` once, then at random."""

        def __init__(self, first: int):
            super().__init__(7)
            self.first, self.calls = first, 0

        def randrange(self, start, stop):
            self.calls += 1
            return self.first if self.calls == 1 else super().randrange(start, stop)

    busy = cluster.free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", busy))
        held.listen()
        rng = FirstPick(busy)
        port = cluster.free_port(rng=rng)
    assert rng.calls >= 2 and port != busy


def test_where_the_range_is_empty_the_kernel_picks(monkeypatch):
    low, high = cluster.ephemeral_port_range()
    monkeypatch.setattr(cluster, "ephemeral_port_range", lambda: (1024, 65535))
    port = cluster.free_port()
    assert low <= port <= high
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_the_range_is_read_from_the_kernel(tmp_path):
    path = tmp_path / "range"
    path.write_text("40000\t50000\n")
    assert cluster.ephemeral_port_range(str(path)) == (40000, 50000)
    path.write_text("garbage")
    assert cluster.ephemeral_port_range(str(path)) == (32768, 60999)
