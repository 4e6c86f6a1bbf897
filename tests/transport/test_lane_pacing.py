"""Lane pacing: the policy (pure), the socket option on this process's lanes, and the kv-send sender
applying the policy's answer to its lanes as writes start and end (a scripted engine, real sockets).

What it buys on the emulated WAN link is measured by ``bench transport --unpaced-row`` (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import socket
import time
import types

import pytest
from test_kv_send import FakeEngine, _manager, _until

from prfaas_sglang.adapters.sockopts import max_pacing_rate, set_lane_pacing
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.hooks.kv_send_hook import start_async_sender
from prfaas_sglang.transport import kv_sender
from prfaas_sglang.transport.kv_send import DONE
from prfaas_sglang.transport.kv_sender import AsyncKvSender, lane_pacing_from_env
from prfaas_sglang.transport.lane_pacing import LanePacing

MiB = 1 << 20
LINK = LanePacing(rate_bps=1e9, rtt_s=0.02)  # 125 MB/s
SHARE_4, SHARE_2 = 32_812_500, 65_625_000  # 125 MB/s / n lanes, plus 5%


class TestPolicy:
    def test_equal_large_writes_all_in_flight_get_an_equal_share_each(self):
        assert LINK.cap([(16 * MiB, 5.0)] * 4, queued=False) == SHARE_4
        assert LINK.cap([(16 * MiB, 5.0), (16 * MiB + 1, 5.0)], queued=False) == SHARE_2  # two left of the four
        # started within an RTT, sizes within 10%: still one batch to keep level
        assert LINK.cap([(16 * MiB, 5.0), (15 * MiB, 5.019)], queued=False) == SHARE_2

    @pytest.mark.parametrize(("writes", "queued", "why"), [
        ([(16 * MiB, 5.0)] * 4, True, "writes queued behind: the engine's FIFO already evens the lanes out"),
        ([(16 * MiB, 5.0)], False, "one write: nothing to keep level"),
        ([], False, "nothing in flight"),
        ([(16 * MiB, 5.0), (8 * MiB, 5.0)], False, "unequal sizes would not end together at equal rates"),
        ([(16 * MiB, 5.0), (16 * MiB, 5.03)], False, "started an RTT and more apart"),
        ([(MiB, 5.0)] * 4, False, "small writes: lanes idle an RTT per write and must cover for each other"),
    ])
    def test_no_cap_where_it_would_hurt(self, writes, queued, why):
        assert LINK.cap(writes, queued) is None, why

    def test_a_faster_link_needs_larger_writes_and_gives_larger_caps(self):
        fast = LanePacing(100e9, 0.02)
        assert fast.cap([(16 * MiB, 0.0)] * 4, queued=False) is None  # 16 MiB is 5 ms at 25 Gbit/s: under 4 RTTs
        assert fast.cap([(1024 * MiB, 0.0)] * 4, queued=False) == 3_281_250_000
        assert LanePacing(400e9, 0.02).cap([(4096 * MiB, 0.0)] * 4, queued=False) == 13_125_000_000  # over 32 bits

    @pytest.mark.parametrize("text", ["", "1e9", "1e9,0.02,0.1,4", "fast,0.02", "0,0.02", "-1e9,0.02", "1e9,-0.02",
                                      "inf,0.02", "nan,0.02", "1e9,nan", "1e9,0.02,1.5", "1e9,0.02,-0.1",
                                      "1e9,0.02,nan", "1e9,0.02,"])
    def test_a_malformed_setting_is_refused_by_name(self, text, monkeypatch):
        with pytest.raises(ValueError, match="rate_bps,rtt_s"):
            LanePacing.parse(text)
        monkeypatch.setenv("PRFAAS_KV_LANE_PACING", text or ",")
        with pytest.raises(ConfigError, match="PRFAAS_KV_LANE_PACING"):
            lane_pacing_from_env()
        # the hook that starts the sender raises it, which stops the worker's startup
        monkeypatch.setenv("PRFAAS_KV_ASYNC_SEND", "1")
        manager = types.SimpleNamespace(engine=types.SimpleNamespace(engine=FakeEngine()))
        with pytest.raises(ConfigError, match="PRFAAS_KV_LANE_PACING"):
            start_async_sender(None, manager, None, types.SimpleNamespace(value="prefill"), None)
        assert not hasattr(manager, "_prfaas_sender")

    def test_an_operator_may_state_the_headroom(self):
        assert LanePacing.parse("1e9,0.02,0.1") == LanePacing(1e9, 0.02, 0.1)
        assert LanePacing.parse("1e9,0.02,0.1").cap([(16 * MiB, 5.0)] * 4, queued=False) == 34_375_000  # plus 10%
        assert LanePacing.parse("1e9,0.02,0").cap([(16 * MiB, 5.0)] * 4, queued=False) == 31_250_000  # the share

    def test_parse_reads_what_the_launcher_writes(self, monkeypatch):
        assert LanePacing.parse(" 1000000000, 0.02") == LINK
        monkeypatch.delenv("PRFAAS_KV_LANE_PACING", raising=False)
        assert lane_pacing_from_env() is None


def _listener() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    return server


class TestSocketOption:
    def test_only_connections_to_the_peers_ports_are_capped_and_the_cap_lifts(self):
        with _listener() as kv, _listener() as other:
            port = kv.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port)) as lane, \
                    socket.create_connection(("127.0.0.1", other.getsockname()[1])) as elsewhere:
                accepted, _ = kv.accept()
                with accepted:
                    assert set_lane_pacing(SHARE_4, {"10.9.9.9"}, (port, port)) == 0  # not a peer of ours
                    assert set_lane_pacing(SHARE_4, {"127.0.0.1"}, (port, port)) == 1
                    assert max_pacing_rate(lane) == SHARE_4
                    assert max_pacing_rate(elsewhere) is None and max_pacing_rate(accepted) is None
                    assert set_lane_pacing(13_750_000_000, {"127.0.0.1"}, (port, port)) == 1
                    assert max_pacing_rate(lane) == 13_750_000_000  # 64-bit rates reach the kernel whole
                    assert set_lane_pacing(None, {"127.0.0.1"}, (port, port)) == 1 and max_pacing_rate(lane) is None


class TestSender:
    def test_the_lanes_are_capped_while_an_even_batch_is_in_flight_and_freed_after(self, monkeypatch):
        with _listener() as kv:
            port = kv.getsockname()[1]
            monkeypatch.setattr(kv_sender, "set_lane_pacing", functools.partial(set_lane_pacing, port_range=(port, port)))
            engine = FakeEngine()
            sender = AsyncKvSender(_manager({1: "127.0.0.1:1"}), engine, wait_bound_s=10.0, lanes=4, pacing=LINK)
            with socket.create_connection(("127.0.0.1", port)) as lane:  # one of the engine's lanes to the peer
                # a 64 MiB chunk as four 16 MiB writes that continue each other on neither side
                even = [(i * 32 * MiB, (7 - i) * 16 * MiB, 16 * MiB) for i in range(4)]
                assert sender.submit("127.0.0.1:1", even) == 0
                _until(lambda: max_pacing_rate(lane) == SHARE_4)
                for _ in range(2):  # two writes end: the two left share the link
                    engine.status[next(i for i, v in engine.status.items() if v == 0)] = DONE
                _until(lambda: max_pacing_rate(lane) == SHARE_2)
                engine.end(DONE)
                assert sender.barrier("127.0.0.1:1", 1)
                _until(lambda: max_pacing_rate(lane) is None)
                changes = sender.pacing_changes
                assert changes == 3  # capped, re-capped, freed

                # eight writes for four lanes: while four wait behind, the engine's queue evens the lanes out
                assert sender.submit("127.0.0.1:1", [(i * 32 * MiB, i * 16 * MiB, 16 * MiB) for i in range(8)]) == 0
                _until(lambda: len(engine.submitted) == 8)
                time.sleep(0.05)
                assert max_pacing_rate(lane) is None and sender.pacing_changes == changes
                engine.end(DONE)  # the first four end at once: the last four go out together, nothing behind
                _until(lambda: len(engine.submitted) == 12)
                _until(lambda: max_pacing_rate(lane) == SHARE_4)
                engine.end(DONE)
                assert sender.barrier("127.0.0.1:1", 1) and sender.writes_failed == 0
                _until(lambda: max_pacing_rate(lane) is None)

    def test_without_pacing_the_lanes_are_left_alone(self, monkeypatch):
        with _listener() as kv:
            port = kv.getsockname()[1]
            monkeypatch.setattr(kv_sender, "set_lane_pacing", functools.partial(set_lane_pacing, port_range=(port, port)))
            engine = FakeEngine()
            sender = AsyncKvSender(_manager({1: "127.0.0.1:1"}), engine, wait_bound_s=10.0, lanes=4)
            with socket.create_connection(("127.0.0.1", port)) as lane:
                assert sender.submit("127.0.0.1:1", [(i * 32 * MiB, i * 16 * MiB, 16 * MiB) for i in range(4)]) == 0
                _until(lambda: len(engine.submitted) == 4)
                time.sleep(0.05)
                assert max_pacing_rate(lane) is None and sender.pacing_changes == 0
                engine.end(DONE)
                assert sender.barrier("127.0.0.1:1", 1)
