"""Link telemetry: the sender's meter, the wire format, the router's aggregate view (pure)."""

from __future__ import annotations

import json
import math

import pytest

from prfaas_sglang.router.link import LinkAggregator, link_share
from prfaas_sglang.transport.meter import LinkMeter
from prfaas_sglang.wire.telemetry import LinkSample


def test_idle_link():
    s = LinkMeter(window_s=1.0).sample("w", 10.0, 0.0)
    assert (s.busy_fraction, s.egress_bps, s.capacity_bps, s.inflight, s.offered_bps, s.backlog_bytes) == (0.0, 0.0, None, 0, 0.0, 0)


def test_back_to_back_transfers_saturate():
    m = LinkMeter(window_s=1.0)
    t = 0.0
    for i in range(10):  # each 125 KB in 0.2 s: a 5 Mbit/s link, always busy
        m.start(i, t, 125_000)
        t += 0.2
        m.progress(i, t, 125_000)
        m.end(i, t)
    s = m.sample("w", t, 0.0)
    assert s.busy_fraction == pytest.approx(1.0)
    assert s.capacity_bps == pytest.approx(5e6)
    assert s.egress_bps == pytest.approx(5e6)


def test_a_rate_drop_shows_within_a_slice_not_a_whole_transfer():
    """A 10 MB transfer in 1 MB slices: 100 Mbit/s, then 10 Mbit/s from t=0.4. The meter sees 10 Mbit/s
    one second after the drop, long before the transfer ends (it has 8 MB left at 0.8 Mbit per 80 ms...)."""
    m = LinkMeter(window_s=1.0)
    m.start(1, 0.0, 10_000_000)
    t = 0.0
    for _ in range(5):  # 5 slices at 100 Mbit/s: 80 ms each
        t += 0.08
        m.progress(1, t, 1_000_000)
    for _ in range(2):  # then 10 Mbit/s: 0.8 s per slice
        t += 0.8
        m.progress(1, t, 1_000_000)
    s = m.sample("w", t, 0.0)
    assert s.inflight == 1 and s.backlog_bytes == 3_000_000 and s.busy_fraction == pytest.approx(1.0)
    assert s.capacity_bps == pytest.approx(1e7, rel=0.3)


def test_writes_on_parallel_lanes_count_over_their_own_spans():
    """One transfer as writes on 4 lanes of a 40 Mbit/s link (10 Mbit/s each, 1.25 MB: 1 s a write),
    landing 10 ms apart each round. Spread from each write's own start (``since_s``), the rate is the
    link's; spread from the transfer's previous delivery, the later writes of a round count as sent in
    the moment after the first, and the rate reads 1.6x too high."""
    def meter(with_since: bool) -> LinkMeter:
        m = LinkMeter(window_s=1.0)
        m.start(1, 0.0, 16 * 1_250_000)
        for r in range(3):
            for lane in range(4):
                started, landed = r * 1.03 + 0.0, r * 1.03 + 1.0 + 0.01 * lane
                m.progress(1, landed, 1_250_000, started if with_since else None)
        return m

    exact, lumped = (meter(w).sample("w", 3.5, 0.0).capacity_bps for w in (True, False))
    assert exact == pytest.approx(40e6, rel=0.1)
    assert lumped > 1.4 * 40e6


def test_a_stall_reads_as_zero_capacity():
    m = LinkMeter(window_s=1.0)
    m.start(1, 0.0, 5_000_000)
    s = m.sample("w", 3.0, 0.0)
    assert s.capacity_bps == 0.0 and s.busy_fraction == 1.0 and s.egress_bps == 0.0 and s.backlog_bytes == 5_000_000


def test_offered_load_counts_requests_not_deliveries():
    m = LinkMeter(window_s=1.0)
    m.start(1, 0.5, 1_000_000)
    m.start(2, 0.6, 1_000_000)
    s = m.sample("w", 1.0, 0.0)
    assert s.offered_bps == pytest.approx(16e6) and s.egress_bps == 0.0


def test_overlapping_transfers_are_counted_once_and_inflight_counts_as_busy():
    m = LinkMeter(window_s=1.0)
    m.start(1, 0.0, 1000)
    m.start(2, 0.1, 1000)
    m.progress(1, 0.3, 1000)
    m.end(1, 0.3)
    m.progress(2, 0.4, 1000)
    m.end(2, 0.4)
    m.start(3, 0.8, 1000)  # still in flight at 1.0
    s = m.sample("w", 1.0, 0.0)
    assert s.busy_fraction == pytest.approx(0.4 + 0.2)
    assert s.inflight == 1


def test_old_transfers_leave_the_window():
    m = LinkMeter(window_s=1.0)
    m.start(1, 0.0, 10_000)
    m.progress(1, 0.5, 10_000)
    m.end(1, 0.5)
    s = m.sample("w", 5.0, 0.0)
    assert s.busy_fraction == 0.0 and s.offered_bps == 0.0 and s.capacity_bps is None


def test_outcomes_latency_and_peers():
    """v4: what each transfer came to, per decode peer, within the window."""
    m = LinkMeter(window_s=1.0)
    m.start(1, 0.1, 1000, "d0:1")
    m.progress(1, 0.3, 1000)
    m.end(1, 0.3)  # delivered in 0.2 s
    m.start(2, 0.2, 2000, "d1:1")
    m.end(2, 0.6, ok=False)  # failed, nothing delivered
    m.start(3, 0.5, 1000, "d0:1")
    m.progress(3, 0.9, 1000)
    m.end(3, 0.9)  # delivered in 0.4 s
    m.start(4, 0.95, 500, "d1:1")  # in flight
    s = m.sample("w", 1.0, 0.0)
    assert (s.completed, s.failed) == (2, 1)
    assert s.latency_p50_s == pytest.approx(0.2) and s.latency_max_s == pytest.approx(0.4)
    d0, d1 = s.peers["d0:1"], s.peers["d1:1"]
    assert (d0.completed, d0.failed, d0.inflight) == (2, 0, 0) and d0.egress_bps == pytest.approx(16_000)
    assert (d1.completed, d1.failed, d1.inflight) == (0, 1, 1) and d1.egress_bps == 0.0
    assert d1.offered_bps == pytest.approx(8 * 2500)
    assert sum(p.egress_bps for p in s.peers.values()) == pytest.approx(s.egress_bps)
    assert LinkSample.decode(s.encode()) == s
    later = m.sample("w", 3.0, 0.0)  # everything ended before the window
    assert (later.completed, later.failed, later.latency_p50_s) == (0, 0, None)
    assert set(later.peers) == {"d1:1"} and later.peers["d1:1"].inflight == 1  # transfer 4 still runs


def test_transfers_without_a_peer_list_no_peers():
    m = LinkMeter(window_s=1.0)
    m.start(1, 0.0, 1000)
    m.end(1, 0.5, ok=False)
    s = m.sample("w", 1.0, 0.0)
    assert s.peers is None and s.failed == 1 and s.latency_p50_s is None


def test_each_peer_has_its_own_busy_time_capacity_and_backlog():
    """v5: a worker sending to two PD clusters crosses two links; each peer's figures are its own transfers'."""
    m = LinkMeter(window_s=1.0)
    m.start(1, 0.0, 10_000, "east:1")
    m.progress(1, 0.5, 10_000)  # 10 KB in 0.5 s: 160 kbit/s toward east
    m.end(1, 0.5)
    m.start(2, 0.0, 1_000, "west:1")
    m.progress(2, 1.0, 500)  # west is slow: 500 B in 1 s, half still to go
    s = m.sample("w", 1.0, 0.0)
    east, west = s.peers["east:1"], s.peers["west:1"]
    assert east.busy_fraction == pytest.approx(0.5) and east.capacity_bps == pytest.approx(160_000)
    assert east.backlog_bytes == 0
    assert west.busy_fraction == pytest.approx(1.0) and west.capacity_bps == pytest.approx(4_000)
    assert west.backlog_bytes == 500
    assert s.busy_fraction == pytest.approx(1.0) and s.backlog_bytes == 500
    assert LinkSample.decode(s.encode()) == s


def test_a_sample_splits_into_the_links_its_peers_cross():
    m = LinkMeter(window_s=1.0)
    m.start(1, 0.0, 10_000, "10.0.1.5:1")
    m.progress(1, 0.5, 10_000)
    m.end(1, 0.5)
    m.start(2, 0.0, 1_000, "10.0.2.5:1")
    m.progress(2, 1.0, 500)
    s = m.sample("w", 1.0, 0.0)

    def on(prefix):
        return lambda peer: peer.startswith(prefix)

    east, west = link_share(s, on("10.0.1.")), link_share(s, on("10.0.2."))
    assert set(east.peers) == {"10.0.1.5:1"} and east.egress_bps == pytest.approx(80_000)
    assert east.capacity_bps == pytest.approx(160_000) and east.busy_fraction == pytest.approx(0.5)
    assert (east.backlog_bytes, east.inflight, east.completed) == (0, 0, 1)
    assert west.capacity_bps == pytest.approx(4_000) and (west.backlog_bytes, west.inflight) == (500, 1)
    assert east.tcp is None and not east.congested
    assert link_share(s, on("10.0.")) is s  # every peer on the link: the sample as it is
    idle = link_share(s, on("10.0.3."))  # no transfer toward that cluster in the window
    assert (idle.egress_bps, idle.busy_fraction, idle.capacity_bps, idle.peers) == (0.0, 0.0, None, None)
    unnamed = LinkSample("w", 0.0, 1e6, 1.0, 1e6, 1)
    assert link_share(unnamed, on("10.0.1.")) is unnamed  # no peer list: cannot be split


class TestWire:
    def test_v4_peers_decode_without_the_v5_fields_and_refuse_them(self):
        peer = {"egress_bps": 1.0, "offered_bps": 1.0, "inflight": 0, "completed": 1, "failed": 0}
        v4 = {"v": 4, "worker": "p0", "ts": 1.0, "egress_bps": 1.0, "busy_fraction": 0.5, "capacity_bps": None,
              "inflight": 0, "peers": {"d:1": peer}}
        s = LinkSample.decode(json.dumps(v4).encode())
        assert (s.peers["d:1"].busy_fraction, s.peers["d:1"].capacity_bps, s.peers["d:1"].backlog_bytes) == (0.0, None, 0)
        v4["peers"]["d:1"]["busy_fraction"] = 0.5
        with pytest.raises(ValueError, match="v5 fields"):
            LinkSample.decode(json.dumps(v4).encode())
        v5 = {**v4, "v": 5, "peers": {"d:1": {**peer, "busy_fraction": 1.5}}}
        with pytest.raises(ValueError, match="busy_fraction"):
            LinkSample.decode(json.dumps(v5).encode())

    def test_round_trip(self):
        s = LinkSample("p0", 1.5, 8e6, 0.5, 1.6e7, 2, 3, 1.0, 9e6, 4096)
        assert LinkSample.decode(s.encode()) == s

    def test_v1_still_decodes(self):
        v1 = {"v": 1, "worker": "p0", "ts": 1.0, "egress_bps": 8e6, "busy_fraction": 0.5, "capacity_bps": None,
              "inflight": 0, "queue": 0}
        s = LinkSample.decode(json.dumps(v1).encode())
        assert s.offered_bps == 8e6 and s.backlog_bytes == 0 and s.window_s == 1.0
        assert (s.completed, s.failed, s.latency_p50_s, s.peers) == (0, 0, None, None)

    @pytest.mark.parametrize("payload", [
        b"{}", b"not json", b"42", b"null", b'"str"', b"[]",
        b'{"v": 3, "worker": "x"}',
        b'{"v": 2, "worker": "x", "ts": 1, "egress_bps": 1, "busy_fraction": "high", "capacity_bps": null, "inflight": 0}',
        b'{"v": 2, "worker": "x", "ts": 1, "egress_bps": 1, "busy_fraction": 0.5, "capacity_bps": NaN, "inflight": 0}',
        b'{"v": 2, "worker": "x", "ts": 1, "egress_bps": 1, "busy_fraction": 1.5, "capacity_bps": null, "inflight": 0}',
        b'{"v": 2, "worker": "x", "ts": 1, "egress_bps": -1, "busy_fraction": 0.5, "capacity_bps": null, "inflight": 0}',
        b'{"v": 2, "worker": "x", "ts": 1, "egress_bps": 1, "busy_fraction": 0.5, "capacity_bps": null, "inflight": -2}',
        b'{"v": 2, "worker": "x", "ts": 1, "egress_bps": 1, "busy_fraction": 0.5, "capacity_bps": null, "inflight": 0, "extra": 1}',
        b'{"v": 2, "worker": 7, "ts": 1, "egress_bps": 1, "busy_fraction": 0.5, "capacity_bps": null, "inflight": 0}',
    ])
    def test_rejects_anything_else_with_value_error(self, payload):
        with pytest.raises(ValueError):
            LinkSample.decode(payload)


class TestAggregate:
    def sample(self, name, busy, capacity, egress=0.0, offered=0.0, backlog=0):
        return LinkSample(name, 0.0, egress, busy, capacity, 1, 0, 1.0, offered, backlog)

    def test_workers_share_the_link(self):
        agg = LinkAggregator(stale_after_s=2.0)
        agg.update("a", self.sample("a", 1.0, 20e6, egress=20e6, offered=30e6, backlog=100), 0.0)
        agg.update("b", self.sample("b", 0.5, 20e6, egress=10e6, offered=5e6, backlog=50), 0.0)
        v = agg.view(1.0)
        assert v.busy_fraction == 1.0 and v.egress_bps == 30e6 and v.offered_bps == 35e6 and v.backlog_bytes == 150
        assert v.capacity_bps == pytest.approx(30e6)  # 20 while always busy + 20 for half the time

    def test_outcomes_and_congestion_add_up(self):
        agg = LinkAggregator(stale_after_s=2.0)
        agg.update("a", LinkSample("a", 0.0, 0.0, 1.0, 0.0, 1, completed=3, failed=2, congested=True), 0.0)
        agg.update("b", LinkSample("b", 0.0, 0.0, 0.5, None, 0, completed=4), 0.0)
        v = agg.view(1.0)
        assert (v.completed, v.failed, v.congested) == (7, 2, True)
        agg.update("a", LinkSample("a", 0.0, 0.0, 1.0, 0.0, 1), 1.0)
        assert (agg.view(1.5).failed, agg.view(1.5).congested) == (0, False)

    def test_a_silent_worker_drops_out_and_nobody_means_unknown(self):
        agg = LinkAggregator(stale_after_s=2.0)
        agg.update("a", self.sample("a", 1.0, 20e6), 0.0)
        agg.update("b", self.sample("b", 0.2, None), 2.5)
        assert agg.view(3.0).capacity_bps is None          # a is stale; b measured nothing
        assert agg.view(10.0) is None
        assert not math.isnan(agg.view(3.0).busy_fraction)


def test_histogram_buckets_are_cumulative():
    from prfaas_sglang.router.metrics import Histogram

    h = Histogram(buckets=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    text = h.render("x", {"route": "pd"})  # prometheus_client writes labels sorted by name
    assert 'x_bucket{le="0.1",route="pd"} 2' in text
    assert 'x_bucket{le="1",route="pd"} 3' in text
    assert 'x_bucket{le="+Inf",route="pd"} 4' in text
    assert 'x_count{route="pd"} 4' in text and h.total == pytest.approx(3.65)


class TestSilenceAndLateness:
    """Issue #16: during an outage the telemetry went silent while the router kept offloading, and
    after it the samples held in the send queue were replayed and raised ``t`` for seconds."""

    @staticmethod
    def sample(ts: float, busy: float = 1.0) -> LinkSample:
        return LinkSample("p", ts, 1e6, busy, 1e6, 1)

    def test_samples_delayed_beyond_the_horizon_are_discarded_not_replayed(self):
        agg = LinkAggregator(stale_after_s=2.0)
        offset = 3600.0  # the sender's clock is an hour behind: a constant offset is absorbed
        for i in range(5):
            assert agg.update("p", self.sample(1000.0 + i - offset), now_s=float(i), wall_s=1000.0 + i + 0.01)
        # a 45 s outage, then the queued samples arrive in a burst, the newest last
        burst = [self.sample(1004.0 + k - offset) for k in range(1, 46)]
        taken = [agg.update("p", s, now_s=50.0, wall_s=1050.0) for s in burst]
        assert taken == [False] * 43 + [True] * 2  # sent within 2 s of arrival: the last two
        assert agg.discarded == 43
        assert agg.view(50.5) is not None

    def test_v1_monotonic_timestamps_are_taken(self):
        agg = LinkAggregator(stale_after_s=2.0)
        assert all(agg.update("p", self.sample(50.0 + i), now_s=float(i), wall_s=1.7e9 + i) for i in range(3))

    def test_silent_while_busy_is_down_until_heard_again(self):
        agg = LinkAggregator(stale_after_s=2.0)
        agg.note_silence("p", 10.0, busy=True)
        assert agg.down() == frozenset()  # never heard: nothing to say
        agg.update("p", self.sample(0.0), now_s=0.0)
        agg.note_silence("p", 1.5, busy=True)
        agg.note_silence("p", 5.0, busy=False)  # silent but idle: the link may simply carry nothing
        assert agg.down() == frozenset()
        agg.note_silence("p", 5.0, busy=True)
        assert agg.down() == {"p"}
        agg.note_silence("p", 9.0, busy=False)  # its work drained (failed over): still down
        assert agg.down() == {"p"}
        agg.update("p", self.sample(9.0), now_s=9.0)
        assert agg.down() == frozenset()


def test_the_router_routes_around_a_prfaas_worker_silent_while_busy():
    from helpers import REPO_ROOT

    from prfaas_sglang import runtime
    from prfaas_sglang.router.service import RouterConfig, new_service
    from prfaas_sglang.router.workers import workers_from_topology
    from prfaas_sglang.topology import load_topology

    topology = load_topology(REPO_ROOT / "launch" / "local-two-cluster.yaml")
    service = new_service(RouterConfig(), runtime.from_topology(topology), workers_from_topology(topology))
    prfaas = next(w for w in service.workers.values() if w.cluster == "prfaas")
    assert prfaas.telemetry_endpoint
    ps = service.only_pair()

    def listed(now_s: float) -> set[str]:
        return {w.name for w in service.snapshot(set(), now_s, ps).workers}

    ps.link.update(prfaas.name, LinkSample(prfaas.name, 100.0, 1e6, 0.5, 1e6, 1), now_s=0.0, wall_s=100.0)
    prfaas.outstanding_prefill_s = 3.0  # a long prefill and its transfer in flight
    assert prfaas.name in listed(1.0)
    assert prfaas.name not in listed(4.0)  # silent for 4 s with work in flight: the link is presumed down
    status = service.status(4.0)
    assert status["link_down_workers"] == [prfaas.name]
    rendered = service.counters.render(service.metrics_gauges(4.0))
    assert f'prfaas_router_link_down{{link="prfaas-b->pd-a",worker="{prfaas.name}"}} 1' in rendered
    prfaas.outstanding_prefill_s = 0.0
    assert prfaas.name not in listed(6.0)
    ps.link.update(prfaas.name, LinkSample(prfaas.name, 106.0, 1e6, 0.5, 1e6, 1), now_s=6.0, wall_s=106.0)
    assert prfaas.name in listed(6.1)
