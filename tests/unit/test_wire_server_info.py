"""``wire/server_info.py``: the facts read from a worker's ``/server_info``, and our versioned section in it."""

from __future__ import annotations

import json

import pytest

from prfaas_sglang.wire.server_info import (
    CACHE_MOVE_KEY,
    CACHE_MOVE_VERSION,
    CacheMoveSection,
    FactsError,
    parse_server_info,
    with_live_mode,
)


def test_cache_move_section_round_trips_as_the_hook_writes_it():
    served = CacheMoveSection.served_unless(None)
    assert served.to_json() == {"v": CACHE_MOVE_VERSION, "served": True, "reason": None} and CACHE_MOVE_VERSION == 1
    refused = CacheMoveSection.served_unless("needs tp, pp and dp size 1")
    assert refused.served is False and refused.reason == "needs tp, pp and dp size 1"
    for section in (served, refused):
        assert CacheMoveSection.decode(json.loads(json.dumps(section.to_json()))) == section  # through /server_info's JSON


@pytest.mark.parametrize("section", [{"v": 2, "served": True}, {"served": True}, {"v": True, "served": True},
                                     {"v": "1", "served": True}])
def test_cache_move_section_of_another_version_is_a_typed_error(section):
    with pytest.raises(FactsError, match="version"):
        CacheMoveSection.decode(section)


@pytest.mark.parametrize("section", [None, [], {"v": 1}, {"v": 1, "served": "yes"}, {"v": 1, "served": True, "reason": 5}])
def test_malformed_cache_move_section_is_a_typed_error(section):
    with pytest.raises(FactsError):
        CacheMoveSection.decode(section)


def test_the_router_asks_only_a_worker_whose_v1_section_says_served():
    info = {"page_size": 64}
    assert parse_server_info(info).cache_import is False  # a stock SGLang server
    assert parse_server_info({**info, CACHE_MOVE_KEY: CacheMoveSection.served_unless(None).to_json()}).cache_import is True
    assert parse_server_info({**info, CACHE_MOVE_KEY: CacheMoveSection.served_unless("tp 2").to_json()}).cache_import is False
    for section in ({"v": 2, "served": True}, {"v": 1, "served": "yes"}, "served"):  # not refused: just not asked
        assert parse_server_info({**info, CACHE_MOVE_KEY: section}).cache_import is False


def test_the_kv_index_reads_the_block_size_and_endpoint_the_router_reads(monkeypatch):
    from prfaas_sglang.kvindex import __main__ as kvindex_main

    answers = {"http://w:1/server_info": {"page_size": 64, "kv_events": {"endpoint_port_base": 5557, "topic": "kv",
                                                                         "block_size": 16}},
               "http://w:2/server_info": {"page_size": 32, "kv_events": None},
               "http://w:3/server_info": {"page_size": 0}}

    monkeypatch.setattr("prfaas_sglang.adapters.http_sync.get_json", lambda url, *, timeout_s, headers=None: answers[url])
    size, endpoint = kvindex_main._block_size("http://w:1", None)
    assert size == 16 and (endpoint.port, endpoint.topic) == (5557, "kv")
    assert parse_server_info(answers["http://w:1/server_info"]).kv_events == endpoint
    assert kvindex_main._block_size("http://w:2", None) == (32, None)
    assert kvindex_main._block_size("http://w:3", 8) == (8, None)  # malformed: the fallback, as when it does not answer


def test_the_live_role_comes_from_model_info_where_the_worker_states_it():
    """SGLang 0.5.23's /server_info is its startup configuration: a worker switched to decode in place
    still says prefill there, while /model_info says decode. 0.5.15 and the emulated engine say nothing
    there, and their /server_info stands."""
    info = {"page_size": 1, "disaggregation_mode": "prefill"}
    assert parse_server_info(with_live_mode(info, {"disaggregation_mode": "decode"})).disaggregation_mode == "decode"
    assert info["disaggregation_mode"] == "prefill"  # not changed in place
    for silent in (None, {}, {"model_path": "m"}, {"disaggregation_mode": 3}, [1]):
        assert with_live_mode(info, silent) is info
    assert with_live_mode([1], {"disaggregation_mode": "decode"}) == [1]  # a bad body is still parse_server_info's to refuse
