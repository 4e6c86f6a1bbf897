"""Hook ``decode-peer-rebootstrap``'s decisions (pure): the bootstrap server's query for a cached prefill
rank, and when a cached rank has moved. Its effect on real SGLang: tests/gpu/test_harness_sglang_cpu.py
(a prefill switched to decode and back serves every later request)."""

from __future__ import annotations

import threading
import types

import pytest
from helpers import applies_here

from prfaas_sglang.hooks.peer_rebootstrap import forget_rebuilt_prefill, moved, route_query

ADDR = "10.0.0.5:8998"
# a cached rank as SGLang 0.5.23's decode keeps it: /route's answer (PrefillRankInfo) plus its pp_rank and is_dummy
RANK = {"rank_ip": "10.0.0.5", "rank_port": 41234, "pp_rank": 0, "is_dummy": False}


def test_the_route_query_names_the_cached_ranks_place():
    assert route_query(f"{ADDR}_0_0_0", ADDR, [RANK]) == ("/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0"
                                                          "&target_pp_rank=0")
    two_stages = [{**RANK, "pp_rank": 1}, RANK]  # SGLang asks the higher PP ranks first
    assert route_query(f"{ADDR}_None_0_1", ADDR, two_stages) == ("/route?prefill_dp_rank=None&prefill_cp_rank=0"
                                                                 "&target_tp_rank=1&target_pp_rank=1")
    # another prefill's key, another shape, a rank without its PP rank, or several target TP ranks (which
    # cached rank is which is not recorded): nothing to ask
    for key, infos in (("10.0.0.6:8998_0_0_0", [RANK]), (f"{ADDR}_0_0", [RANK]), (f"{ADDR}_0_0_0", [{"rank_port": 1}]),
                       (f"{ADDR}_0_0_0", [RANK, {**RANK, "rank_port": 41235}]), (f"{ADDR}_0_0_0", [])):
        assert route_query(key, ADDR, infos) is None


@pytest.mark.parametrize(("current", "expected"), [
    ({"rank_ip": "10.0.0.5", "rank_port": 41234}, False),
    ({"rank_ip": "10.0.0.5", "rank_port": "41234"}, False),  # the port as the route's JSON may carry it
    ({"rank_ip": "10.0.0.5", "rank_port": 50000}, True),  # rebuilt: a new port
    ({"rank_ip": "10.0.0.7", "rank_port": 41234}, True),
    (None, True),  # the bootstrap server no longer knows the rank
])
def test_a_rank_that_moved_or_is_gone_is_a_rebuilt_prefill(current, expected):
    assert moved(RANK, current) is expected


@applies_here("decode-peer-rebootstrap")
def test_the_hook_drops_a_rebuilt_prefill_through_sglangs_own_failure_path(monkeypatch):
    """The hook asks once per heartbeat; where the rank moved it calls SGLang's _handle_node_failure for
    that prefill alone; where it did not, or nothing is cached, it does nothing."""
    import sglang.srt.disaggregation.common.conn as conn

    answers = {"port": 41234}
    asked = []

    class Session:
        def get(self, url, timeout):
            asked.append(url)
            return types.SimpleNamespace(status_code=200, json=lambda: {"rank_ip": "10.0.0.5", "rank_port": answers["port"]})

    monkeypatch.setattr(conn, "_get_bootstrap_session", lambda addr: Session())
    failed = []
    manager = types.SimpleNamespace(connection_lock=threading.Lock(), _handle_node_failure=failed.append,
                                    connection_pool={f"{ADDR}_0_0_0": [RANK], "10.0.0.6:8998_0_0_0": [RANK]})
    forget_rebuilt_prefill(None, manager, ADDR)
    assert failed == [] and asked == [f"http://{ADDR}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0"
                                      "&target_pp_rank=0"]
    answers["port"] = 50000
    forget_rebuilt_prefill(None, manager, ADDR)
    assert failed == [ADDR]
    forget_rebuilt_prefill(None, manager, "10.0.0.9:8998")  # nothing cached for it: not even asked
    assert len(asked) == 2
