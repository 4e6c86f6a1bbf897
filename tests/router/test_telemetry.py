"""Link telemetry: busy fraction, egress and delivered capacity from transfer records (pure)."""

from __future__ import annotations

import pytest

from prfaas_sglang.transport.telemetry import LinkMeter, LinkSample


def test_idle_link():
    s = LinkMeter(window_s=1.0).sample("w", 10.0)
    assert (s.busy_fraction, s.egress_bps, s.capacity_bps, s.inflight) == (0.0, 0.0, None, 0)


def test_back_to_back_transfers_saturate():
    m = LinkMeter(window_s=1.0)
    t = 0.0
    for i in range(10):  # each 125 KB in 0.2 s: a 5 Mbit/s link, always busy
        m.start(i, t)
        t += 0.2
        m.end(i, t, 125_000)
    s = m.sample("w", t)
    assert s.busy_fraction == pytest.approx(1.0)
    assert s.capacity_bps == pytest.approx(5e6)
    assert s.egress_bps == pytest.approx(5e6)


def test_overlapping_transfers_are_counted_once_and_inflight_counts_as_busy():
    m = LinkMeter(window_s=1.0)
    m.start(1, 0.0)
    m.start(2, 0.1)
    m.end(1, 0.3, 1000)
    m.end(2, 0.4, 1000)
    m.start(3, 0.8)  # still in flight at 1.0
    s = m.sample("w", 1.0)
    assert s.busy_fraction == pytest.approx(0.4 + 0.2)
    assert s.inflight == 1


def test_old_transfers_leave_the_window():
    m = LinkMeter(window_s=1.0)
    m.start(1, 0.0)
    m.end(1, 0.5, 10_000)
    assert m.sample("w", 5.0).busy_fraction == 0.0


def test_wire_round_trip_and_rejection():
    s = LinkSample("p0", 1.5, 8e6, 0.5, 1.6e7, 2, 3)
    assert LinkSample.decode(s.encode()) == s
    for bad in (b"{}", b"not json", b'{"v": 2, "worker": "x"}'):
        with pytest.raises(ValueError):
            LinkSample.decode(bad)


def test_histogram_buckets_are_cumulative():
    from prfaas_sglang.router.metrics import Histogram

    h = Histogram(buckets=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    text = h.render("x", 'route="pd"')
    assert 'x_bucket{route="pd",le="0.1"} 2' in text
    assert 'x_bucket{route="pd",le="1"} 3' in text
    assert 'x_bucket{route="pd",le="+Inf"} 4' in text
    assert 'x_count{route="pd"} 4' in text and h.total == pytest.approx(3.65)
