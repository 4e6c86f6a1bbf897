"""The kernel's view of the KV connections (pure parts) and telemetry wire v3."""

from __future__ import annotations

import json

import pytest

from prfaas_sglang.transport.meter import LinkMeter, with_tcp_view
from prfaas_sglang.transport.tcpstate import TcpCongestion, TcpConn, kv_connections, parse_ss
from prfaas_sglang.wire.telemetry import LinkSample

# Captured from `ss -tineH state established` / `ss -tinpH` in a bench namespace (Mooncake lanes, 2026-11-23).
SS_E = """\
0      131096 10.215.201.1:39514 10.215.201.2:16936 ino:384161 sk:9 cgroup:unreachable:1 <->
\t bbr wscale:10,10 rto:224 rtt:20.916/0.716 ato:40 mss:1448 cwnd:208 ssthresh:86 bytes_sent:136908384 bytes_retrans:140480 bytes_acked:136733129 bytes_received:8344 bbr:(bw:48224496bps,mrtt:20.155,pacing_gain:1.25,cwnd_gain:2) send 115197552bps pacing_rate 47742256bps delivery_rate 47255024bps delivered:95957 busy:44776ms unacked:25 retrans:0/98 notsent:96320 minrtt:19.244 snd_wnd:1134592
ESTAB 0      0       10.215.202.1:43516 10.215.202.2:16516 users:(("python",pid=25952,fd=12)) ino:384162
\t ts sack cubic wscale:10,10 rto:224 rtt:20.57/0.063 cwnd:23 bytes_sent:74004752 bytes_retrans:66608 bytes_acked:73938145 delivery_rate 7.3Mbps minrtt:20
garbage line
"""


def test_parse_ss_reads_both_layouts():
    a, b = parse_ss(SS_E)
    assert (a.remote_ip, a.remote_port, a.inode, a.pid) == ("10.215.201.2", 16936, 384161, None)
    assert a.rtt_ms == 20.916 and a.min_rtt_ms == 19.244 and a.cwnd == 208 and a.unacked == 25 and a.notsent_bytes == 96320
    assert a.bytes_acked == 136733129 and a.bytes_retrans == 140480 and a.delivery_rate_bps == 47255024
    assert b.pid == 25952 and b.inode == 384162 and b.delivery_rate_bps == pytest.approx(7.3e6) and b.unacked == 0
    assert kv_connections([a, b], {384162}) == [b]
    assert kv_connections([a, b], {384161, 384162}, peer_ips={"10.215.201.2"}) == [a]


def conn(acked: int, sent: int, retrans: int = 0, rtt: float = 20.0, busy: bool = True) -> TcpConn:
    return TcpConn("10.0.0.1:1", "10.0.0.2:15001", None, rtt_ms=rtt, min_rtt_ms=20.0, bytes_sent=sent, bytes_acked=acked,
                   bytes_retrans=retrans, unacked=10 if busy else 0)


def test_goodput_and_the_congestion_flag_with_hysteresis():
    cc = TcpCongestion(clear_after=2)
    assert cc.update([conn(0, 0)], 0.0) is None  # nothing to difference yet
    steady = cc.update([conn(25_000_000, 25_000_000)], 0.25)  # 100 MB/s... 800 Mbit/s delivered
    assert steady.goodput_bps == pytest.approx(800e6) and steady.backlogged and not steady.congested
    queued = cc.update([conn(25_500_000, 25_600_000, rtt=80.0)], 0.5)  # 16 Mbit/s; the queue quadrupled the RTT
    assert queued.goodput_bps == pytest.approx(16e6) and queued.congested
    lossy = cc.update([conn(26_000_000, 26_200_000, retrans=50_000, rtt=21.0)], 0.75)  # 8% of what was sent, resent
    assert lossy.retrans_fraction == pytest.approx(50_000 / 600_000) and lossy.congested
    quiet = [cc.update([conn(26_000_000 + k, 26_200_000 + k, retrans=50_000, rtt=21.0)], 1.0 + 0.25 * k) for k in (1, 2)]
    assert quiet[0].congested and not quiet[1].congested  # cleared after two quiet intervals
    idle = cc.update([conn(26_000_002, 26_200_002, retrans=50_000, rtt=90.0, busy=False)], 1.75)
    assert not idle.backlogged and not idle.congested  # a high RTT with nothing waiting is not congestion


def test_a_backlogged_interval_sets_the_published_capacity():
    meter = LinkMeter()
    sample = meter.sample("w", 10.0, 1e9)
    cc = TcpCongestion()
    cc.update([conn(0, 0)], 0.0)
    published = with_tcp_view(sample, cc.update([conn(1_000_000, 1_000_000, rtt=70.0)], 0.5))
    assert published.capacity_bps == pytest.approx(16e6) and published.congested and published.tcp.rtt_ms == 70.0
    again = LinkSample.decode(published.encode())
    assert again == published and json.loads(published.encode())["v"] == 5
    assert with_tcp_view(sample, None) is sample


@pytest.mark.parametrize("payload, message", [
    ({"v": 2, "tcp": None}, "v3 fields"),
    ({"v": 3, "tcp": 5}, "tcp must be an object"),
    ({"v": 3, "tcp": {"connections": 1}}, "tcp"),
    ({"v": 3, "congested": "yes"}, "congested"),
    ({"v": 3, "tcp": {"connections": -1, "goodput_bps": 1.0, "retrans_fraction": None, "rtt_ms": None, "min_rtt_ms": None,
                      "delivery_rate_bps": None, "backlogged": True}}, "connections"),
    ({"v": 6}, "unsupported telemetry version"),
    ({"v": 3, "failed": 1}, "v4 fields"),
    ({"v": 4, "failed": -1}, "failed"),
    ({"v": 4, "completed": True}, "completed"),
    ({"v": 4, "latency_p50_s": float("nan")}, "latency_p50_s"),
    ({"v": 4, "peers": []}, "peers must be an object"),
    ({"v": 4, "peers": {"d:1": 3}}, "must be an object"),
    ({"v": 4, "peers": {"d:1": {"egress_bps": 1.0}}}, "peers"),
    ({"v": 4, "peers": {"d:1": {"egress_bps": -1.0, "offered_bps": 0.0, "inflight": 0, "completed": 0, "failed": 0}}},
     "egress_bps"),
    ({"v": 5, "peers": {"d:1": {"egress_bps": 0.0, "offered_bps": 0.0, "inflight": 0, "completed": 0, "failed": 0,
                                "backlog_bytes": -3}}}, "backlog_bytes"),
])
def test_malformed_v3_to_v5_are_refused(payload, message):
    base = {"worker": "w", "ts": 1.0, "egress_bps": 0.0, "busy_fraction": 0.0, "capacity_bps": None, "inflight": 0}
    with pytest.raises(ValueError, match=message):
        LinkSample.decode(json.dumps({**base, **payload}).encode())


def test_v2_still_decodes_without_a_tcp_view():
    base = {"v": 2, "worker": "w", "ts": 1.0, "egress_bps": 0.0, "busy_fraction": 0.0, "capacity_bps": None, "inflight": 0}
    sample = LinkSample.decode(json.dumps(base).encode())
    assert sample.tcp is None and sample.congested is False
