"""Asynchronous KV sending inside SGLang's Mooncake backend (the ``kv-send`` hooks).

Pure parts first: :func:`coalesce` and the :class:`SendLedger` (statuses from a scripted
function). Then SGLang's own Mooncake classes on CPU (``sglang_mooncake_probe.py``: bootstrap
server, prefill and decode managers over host buffers, real TCP on loopback, the plugin's
``register()``), as the launcher starts a PrfaaS worker with ``PRFAAS_KV_ASYNC_SEND=1``: the KV
of three requests in three chunks each arrives intact and every chunk was submitted
asynchronously; a request whose transfer the engine refuses fails on both sides, as with
SGLang's synchronous batches, and the next request goes through; the meter sees every byte.
"""

from __future__ import annotations

from sglang_cpu import run_probe

from prfaas_sglang.demo.cluster import PortPicker
from prfaas_sglang.transport.kv_send import DONE, FAILED, PENDING, TIMED_OUT, SendLedger, coalesce

CHUNKS, REQUESTS, BUFFERS, PAGES_PER_CHUNK = 3, 3, 8, 64


def test_coalesce_merges_only_what_continues_on_both_sides():
    blocks = [(100, 1000, 10), (110, 1010, 5), (115, 2000, 5), (120, 2006, 5), (125, 2011, 0), (125, 2011, 2),
              (300, 3000, 1)]
    # src continues at 115 but dst does not; 120 -> 125 continues on both sides past an empty entry.
    assert coalesce(blocks) == [(100, 1000, 15), (115, 2000, 5), (120, 2006, 7), (300, 3000, 1)]
    assert coalesce([]) == []
    assert coalesce([(1, 2, 3)] * 1) == [(1, 2, 3)]


class TestSendLedger:
    def test_a_write_is_read_until_it_ends_and_never_after(self):
        script = {1: [PENDING, DONE], 2: [PENDING, PENDING, FAILED], 3: [TIMED_OUT]}
        reads: list[int] = []

        def status(write_id: int) -> int:
            reads.append(write_id)
            return script[write_id].pop(0)

        ledger = SendLedger()
        a = ledger.add("d0", {1: 100, 2: 50})
        ledger.add("d1", {3: 10})
        assert ledger.reap(status, "d0") == [] and ledger.pending("d0") and ledger.pending("d1")
        ended = ledger.reap(status)
        assert [(e.delivered_bytes, e.batch_done) for e in ended] == [(100, False), (0, True)]  # write 1; write 3 timed out
        assert ledger.failed("d1") and not ledger.failed("d0") and not ledger.pending("d1")
        ended = ledger.reap(status)
        assert [(e.batch is a, e.delivered_bytes, e.batch_done) for e in ended] == [(True, 0, True)]
        assert a.failed and a.delivered_bytes == 100 and ledger.failed("d0") and ledger.batches == []
        assert ledger.reap(status) == [] and reads == [1, 2, 1, 2, 3, 2]  # nothing read after its end
        ledger.forget("d0")
        assert not ledger.failed("d0") and ledger.in_flight_bytes() == 0

    def test_a_handed_on_failure_abandons_what_is_in_flight(self):
        script = {1: [FAILED], 2: [PENDING, FAILED], 3: [PENDING, DONE]}
        ledger = SendLedger()
        ledger.add("d0", {1: 10, 2: 10})
        ledger.add("d0", {3: 10})
        ledger.reap(lambda i: script[i].pop(0))
        assert ledger.failed("d0") and ledger.in_flight("d0") == 2 and ledger.pending("d0")
        ledger.forget("d0")  # SGLang failed the rooms and blacklisted the session
        assert not ledger.pending("d0") and ledger.in_flight("d0") == 0  # a later room waits for none of it
        assert ledger.in_flight_bytes() == 20  # still read until it ends
        ended = ledger.reap(lambda i: script[i].pop(0))
        assert {e.delivered_bytes for e in ended} == {0, 10} and not ledger.failed("d0")  # not a new failure
        assert ledger.batches == []


def test_sglang_sends_each_chunk_asynchronously_and_the_kv_lands_intact():
    out = run_probe(PRFAAS_ROLE="prfaas", PRFAAS_KV_ASYNC_SEND="1", PRFAAS_TELEMETRY_PORT=str(PortPicker()()))
    assert all(r["sender"] == r["receiver"] == out["success"] and r["kv_intact"] and r["aux_intact"]
               for r in out["requests"]), out["requests"]
    sent = out["async"]
    assert sent["batches"] == REQUESTS * CHUNKS  # every chunk asynchronously; the aux after the barrier, synchronously
    # Random pages: nothing continues on both sides, so one write per page and buffer (K and V of 4 layers).
    assert sent["writes"] == REQUESTS * CHUNKS * PAGES_PER_CHUNK * BUFFERS and sent["writes_failed"] == 0
    assert sent["in_flight_bytes"] == 0
    per_request = out["kv_bytes_per_request"] + out["aux_bytes_per_request"]
    assert out["metered_bytes"] == REQUESTS * per_request  # the meter saw every byte land
    assert out["metered_transfers"] == REQUESTS * (CHUNKS + 1)
    assert out["prefill_rooms_left"] == out["decode_rooms_left"] == out["transfer_infos_left"] == []


def test_a_refused_transfer_fails_the_request_on_both_sides_and_the_next_one_succeeds():
    for async_send in ("1", "0"):  # the same outcome as SGLang's synchronous batches
        out = run_probe(PRFAAS_ROLE="prfaas", PRFAAS_KV_ASYNC_SEND=async_send, FAIL_ROOM="2")
        states = [(r["sender"], r["receiver"]) for r in out["requests"]]
        ok, failed = (out["success"],) * 2, (out["failed"],) * 2
        assert states == [ok, failed, ok], (async_send, out["requests"])
        assert out["requests"][2]["kv_intact"] and out["requests"][2]["aux_intact"]
        assert out["failed_sessions"] == ["127.0.0.1:1"]  # the refused session only; the real one still takes KV
        assert out["prefill_rooms_left"] == out["decode_rooms_left"] == out["transfer_infos_left"] == []
        if async_send == "1":
            assert out["async"]["in_flight_bytes"] == 0
        else:
            assert out["async"] is None
