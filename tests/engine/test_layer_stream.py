"""The emulated prefill streams its KV by layer group (PRFAAS_KV_LAYERWISE), as the kv-layerwise hooks do on SGLang.

In process, with the worker's own prefill loop and flows; only the Mooncake endpoint and the notify
POST are replaced by recorders (the real transfer is ``test_mock_kv_send``'s and ``test_pd``'s), so
the test sees when each write left against when the prefill's forwards ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from conftest import PREFILL_PROFILE

from prfaas_sglang.engine.mock.engine import MockConfig, MockEngine
from prfaas_sglang.engine.mock.timing import load_timing
from prfaas_sglang.plan.overlap import STREAM_GROUPS
from prfaas_sglang.protocol import Bootstrap, EngineRequest
from prfaas_sglang.roles import Role
from prfaas_sglang.wire.handoff import Registration

PROMPT_TOKENS, CHUNK_TOKENS = 16_384, 8_192


class _Link:
    """Records each write (offset into the decode region, bytes, when it left on the loop's clock)."""

    def __init__(self):
        self.writes: list[tuple[int, int, float]] = []

    async def write(self, session, addr, length, on_progress):
        self.writes.append((addr, length, time.monotonic()))
        on_progress(length, None)


class _Answered:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    def raise_for_status(self):
        pass


def _prefill(layerwise: bool, monkeypatch) -> tuple[MockEngine, list[float], int]:
    """One 16K-token prefill (two 8K chunks) on a PrfaaS worker; (the engine, when each forward ended, its KV bytes)."""
    monkeypatch.setenv("PRFAAS_KV_LAYERWISE", "1" if layerwise else "0")
    timing = load_timing(PREFILL_PROFILE, 200.0, 0.01, None)
    config = MockConfig(Role.PRFAAS, "127.0.0.1", 0, PREFILL_PROFILE, "m", chunked_prefill_size=CHUNK_TOKENS)
    forward_ends: list[float] = []

    async def run():
        engine = MockEngine(config, timing)
        engine.kv = _Link()
        engine._post_signed = lambda url, payload, **kw: _Answered()
        ended = engine.prefills.complete

        def complete(forward):
            forward_ends.append(time.monotonic())
            return ended(forward)

        engine.prefills.complete = complete
        loop = asyncio.create_task(engine._prefill_loop())
        req = EngineRequest("generate", tuple(range(PROMPT_TOKENS)), 1, False, "r", None, Bootstrap("127.0.0.1", 1, 7))
        length = timing.kv_bytes(PROMPT_TOKENS)
        engine.register_decode(Registration(7, "peer:1", 1 << 20, length, "http://127.0.0.1:1/kv"))
        ready = await engine.prefill(req)
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        assert ready.ok and ready.kv_bytes == length
        return engine

    return asyncio.run(run()), forward_ends, timing.kv_bytes(PROMPT_TOKENS)


def test_a_streamed_prefill_sends_its_kv_layer_group_by_group_before_it_ends(monkeypatch):
    engine, forward_ends, length = _prefill(True, monkeypatch)
    writes = engine.kv.writes
    assert len(forward_ends) == 2  # two chunks
    before_end = [w for w in writes if w[2] < forward_ends[-1]]
    # every layer group of both forwards but the last one's last went before the prefill ended
    assert len(before_end) == 2 * STREAM_GROUPS - 1, writes
    # contiguous, in order, and together exactly the request's KV (the state with the last group)
    offsets = [addr - (1 << 20) for addr, _, _ in writes]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert all(a + n == b for (a, n, _), b in zip(writes, [w[0] for w in writes[1:]], strict=False))
    assert sum(n for _, n, _ in writes) == length
    # what is left after the last forward: its last layer group's KV (1/G of one of two chunks), and the state
    state = load_timing(PREFILL_PROFILE, 200.0, 0.01, None).kv_bytes_beyond(PROMPT_TOKENS, PROMPT_TOKENS)
    assert writes[-1][1] == length - int((length - state) * (1 - 1 / (2 * STREAM_GROUPS)))
    assert engine.stats.kv_bytes_sent == length


def test_without_streaming_the_kv_leaves_after_the_prefill_in_one_transfer(monkeypatch):
    engine, forward_ends, length = _prefill(False, monkeypatch)
    assert [n for _, n, _ in engine.kv.writes] == [length]
    assert engine.kv.writes[0][2] >= forward_ends[-1]


def test_a_streamed_prefill_whose_request_is_abandoned_sends_no_more(monkeypatch):
    """Cancelled mid-prefill (the client went away): the shipper stops with the prefill; nothing hangs."""
    monkeypatch.setenv("PRFAAS_KV_LAYERWISE", "1")
    timing = load_timing(PREFILL_PROFILE, 20.0, 0.01, None)
    config = MockConfig(Role.PRFAAS, "127.0.0.1", 0, PREFILL_PROFILE, "m", chunked_prefill_size=CHUNK_TOKENS)

    async def run():
        engine = MockEngine(config, timing)
        engine.kv = _Link()
        loop = asyncio.create_task(engine._prefill_loop())
        req = EngineRequest("generate", tuple(range(PROMPT_TOKENS)), 1, False, "r", None, Bootstrap("127.0.0.1", 1, 8))
        engine.register_decode(Registration(8, "peer:1", 1 << 20, timing.kv_bytes(PROMPT_TOKENS), "http://127.0.0.1:1/kv"))
        task = asyncio.create_task(engine.prefill(req))
        while not engine.kv.writes:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        sent = len(engine.kv.writes)
        await asyncio.sleep(timing.prefill_s(PROMPT_TOKENS))
        loop.cancel()
        return engine, sent

    engine, sent = asyncio.run(run())
    assert len(engine.kv.writes) == sent and not engine._written and len(engine.prefills) == 0
