"""The emulated engine's KV sending: a PrfaaS worker ships through the kv-send hooks' own sender
(the one a PrfaaS SGLang worker runs), an in-cluster prefill SGLang's way (synchronous slices).

Real Mooncake TCP on loopback, two endpoints in this process: the bytes land, progress adds up to
them, the region goes as :func:`split_even` says, and an unreachable peer fails the transfer at once
without failing the next one to a live peer.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from prfaas_sglang.engine.mock.engine import async_send
from prfaas_sglang.engine.mock.kv_transport import PATTERN, KvEndpoint, KvTransferError
from prfaas_sglang.roles import Role
from prfaas_sglang.transport.kv_send import split_even, timed_write_bytes

MiB = 1 << 20


@pytest.mark.parametrize(("role", "env", "expected"), [
    (Role.PRFAAS, None, True), (Role.PD_PREFILL, None, False),
    (Role.PRFAAS, "0", False), (Role.PD_PREFILL, "1", True),
])
def test_a_prfaas_worker_sends_through_the_hooks_sender_unless_told_otherwise(role, env, expected, monkeypatch):
    if env is None:
        monkeypatch.delenv("PRFAAS_KV_ASYNC_SEND", raising=False)
    else:
        monkeypatch.setenv("PRFAAS_KV_ASYNC_SEND", env)
    assert async_send(role) is expected


@pytest.fixture
def endpoints(monkeypatch):
    monkeypatch.setenv("MC_TCP_LANES_PER_PEER", "3")
    monkeypatch.setenv("PRFAAS_KV_LANE_PACING", "1e9,0.02")  # a stated link: 1 Gbit/s, 20 ms
    src = KvEndpoint("127.0.0.1", 40 * MiB, 0, async_send=True)
    sync = KvEndpoint("127.0.0.1", 40 * MiB, 0)
    dst = KvEndpoint("127.0.0.1", 0, 64 * MiB)
    yield src, sync, dst
    for e in (src, sync, dst):
        e.close()


def _send(src: KvEndpoint, dst: KvEndpoint, length: int, session: str | None = None) -> tuple[list[int], object]:
    offset = dst.arena.alloc(length)
    region = dst.region(offset, length)
    region[:] = 0
    progress: list[int] = []
    asyncio.run(src.write(session or dst.session, dst.base + offset, length, lambda n, since_s: progress.append(n)))
    dst.arena.free(offset, length)
    return progress, region


def test_the_sender_lands_every_byte_in_lane_sized_writes_and_reports_each(endpoints):
    src, sync, dst = endpoints
    assert src.sender is not None and src.sender.lanes == 3 and sync.sender is None
    assert src.write_bytes == timed_write_bytes(1e9, 3) == int(1e9 / 8 / 3 * 0.1)  # 0.1 s of a lane's share
    for length in (5 * MiB + 3, 40 * MiB):
        before = src.sender.counters()["writes_submitted"]
        progress, region = _send(src, dst, length)
        writes = split_even(0, 0, length, 3, max_write_bytes=src.write_bytes)
        assert (region == PATTERN).all()
        assert sorted(progress) == sorted(n for _, _, n in writes)  # one report per write, as each landed
        assert src.sender.counters()["writes_submitted"] - before == len(writes)
    progress, region = _send(sync, dst, 3 * MiB)  # SGLang's way: 1 MiB synchronous slices
    assert (region == PATTERN).all() and progress == [MiB] * 3
    assert src.sender.counters()["in_flight_bytes"] == 0 and src.sender.counters()["writes_failed"] == 0


def test_an_unreachable_peer_fails_at_once_and_the_next_transfer_lands(endpoints):
    src, _, dst = endpoints
    start = time.monotonic()
    with pytest.raises(KvTransferError, match="failed"):
        _send(src, dst, 4 * MiB, session="127.0.0.1:9")  # nothing listens there
    assert time.monotonic() - start < 5
    assert src.sender.counters()["writes_failed"] >= 1
    _, region = _send(src, dst, 4 * MiB)
    assert (region == PATTERN).all()


def test_a_closed_endpoint_fails_a_transfer_instead_of_hanging(endpoints):
    src, _, dst = endpoints
    src.sender.close()
    with pytest.raises(KvTransferError, match="closed"):
        _send(src, dst, MiB)
