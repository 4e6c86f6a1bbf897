"""SGLang's --disaggregation-decode-enable-radix-cache on the emulated decode worker: a follow-up turn
ships only the KV beyond what the decode worker kept from the previous turn (real HTTP, real Mooncake bytes)."""

from __future__ import annotations

import pytest
from conftest import start_worker
from test_pd import KV_SCALE, metric, pd_request

from prfaas_sglang.engine.mock.__main__ import (
    build_parser,
    check_decode_radix_cache,
    config_from_args,
)
from prfaas_sglang.engine.mock.timing import load_timing
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.wire.handoff import HANDOFF_VERSION, KvReady, Registration

PAGE = 512
# SGLang 0.5.15 has the decode-side radix cache for full-attention models; linear-attention hybrids
# have it through patch 0001 (hooks/decode_radix); sliding-window models are refused.
PREFILL_PROFILE = "qwen3-235b-a22b@h200x8"
DECODE_PROFILE = "qwen3-235b-a22b@h20x8"
HYBRID_PROFILE = "kimi-linear-1t-hybrid@h20x8"


@pytest.fixture(scope="module")
def cached_pair(module_procs):
    common = ("--speedup", "20", "--kv-scale", str(KV_SCALE), "--context-tokens", "65536", "--bootstrap-timeout-s", "5",
              "--page-size", str(PAGE))
    prefill = start_worker(module_procs, "prfaas", PREFILL_PROFILE, *common)
    decode = start_worker(module_procs, "pd-decode", DECODE_PROFILE, *common, "--disaggregation-decode-enable-radix-cache")
    return prefill, decode


@pytest.mark.slow
def test_a_follow_up_turn_ships_only_the_kv_beyond_the_decode_workers_prefix(cached_pair):
    prefill, decode = cached_pair
    timing = load_timing(DECODE_PROFILE, 1.0, KV_SCALE, None)
    first_prompt = list(range(10_000, 30_000))
    p1, d1 = pd_request(prefill, decode, {"input_ids": first_prompt, "sampling_params": {"max_new_tokens": 4}})
    assert p1.status == 200 and d1.status == 200, (p1.text, d1.text)
    assert d1.json()["meta_info"]["prfaas"]["decode_prefix_len"] == 0
    assert d1.json()["meta_info"]["prfaas"]["kv_bytes"] == timing.kv_bytes(len(first_prompt))

    # The next turn: the previous prompt, its answer, and a new message.
    second_prompt = first_prompt + d1.json()["output_ids"] + list(range(40_000, 43_000))
    before = metric(decode, "prfaas:kv_bytes_received_total")
    p2, d2 = pd_request(prefill, decode, {"input_ids": second_prompt, "sampling_params": {"max_new_tokens": 4}})
    assert p2.status == 200 and d2.status == 200, (p2.text, d2.text)
    held = d2.json()["meta_info"]["prfaas"]["decode_prefix_len"]
    # Whole pages of the first turn (its prompt and answer), never the new message.
    assert held == (len(first_prompt) + 4) // PAGE * PAGE
    shipped = d2.json()["meta_info"]["prfaas"]["kv_bytes"]
    assert shipped == p2.json()["meta_info"]["prfaas"]["kv_bytes"] == timing.kv_bytes_beyond(len(second_prompt), held)
    assert shipped < timing.kv_bytes(len(second_prompt))
    assert metric(decode, "prfaas:kv_bytes_received_total") - before == shipped
    assert d2.json()["output_ids"] == pd_request(prefill, decode, {"input_ids": second_prompt,
                                                                  "sampling_params": {"max_new_tokens": 4}})[1].json()["output_ids"]


def test_a_hybrid_follow_up_turn_ships_the_kv_beyond_the_decode_workers_pages_and_the_state(module_procs):
    common = ("--speedup", "20", "--kv-scale", str(KV_SCALE), "--context-tokens", "65536", "--bootstrap-timeout-s", "5",
              "--page-size", str(PAGE))
    prefill = start_worker(module_procs, "prfaas", "kimi-linear-1t-hybrid@h200x8", *common)
    decode = start_worker(module_procs, "pd-decode", HYBRID_PROFILE, *common, "--disaggregation-decode-enable-radix-cache")
    timing = load_timing(HYBRID_PROFILE, 1.0, KV_SCALE, None)
    first_prompt = list(range(10_000, 30_000))
    _, d1 = pd_request(prefill, decode, {"input_ids": first_prompt, "sampling_params": {"max_new_tokens": 4}})
    assert d1.status == 200, d1.text
    second_prompt = first_prompt + d1.json()["output_ids"] + list(range(40_000, 43_000))
    p2, d2 = pd_request(prefill, decode, {"input_ids": second_prompt, "sampling_params": {"max_new_tokens": 4}})
    assert p2.status == 200 and d2.status == 200, (p2.text, d2.text)
    held = d2.json()["meta_info"]["prfaas"]["decode_prefix_len"]
    # Whole pages of the first turn, a page short of the last one: the first turn's state ends there.
    assert held == (len(first_prompt) + 4) // PAGE * PAGE - PAGE
    shipped = d2.json()["meta_info"]["prfaas"]["kv_bytes"]
    assert shipped == timing.kv_bytes_beyond(len(second_prompt), held)
    assert timing.kv_bytes(0) < shipped < timing.kv_bytes(len(second_prompt))  # the state always ships


def test_an_unrelated_prompt_ships_everything(cached_pair):
    prefill, decode = cached_pair
    prompt = list(range(50_000, 56_000))
    _, d = pd_request(prefill, decode, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}})
    assert d.json()["meta_info"]["prfaas"]["decode_prefix_len"] == 0
    assert d.json()["meta_info"]["prfaas"]["kv_bytes"] == load_timing(DECODE_PROFILE, 1.0, KV_SCALE, None).kv_bytes(len(prompt))


def test_a_stream_interval_below_one_is_refused_by_name():
    args = build_parser().parse_args(["--role", "pd-decode", "--port", "1", "--profile", DECODE_PROFILE, "--stream-interval", "0"])
    with pytest.raises(ConfigError, match="--stream-interval.*must be >= 1, got 0"):
        config_from_args(args)


def test_the_flag_belongs_to_decode_roles():
    args = build_parser().parse_args(["--role", "pd-prefill", "--port", "1", "--bootstrap-port", "2", "--profile", PREFILL_PROFILE,
                                      "--disaggregation-decode-enable-radix-cache"])
    with pytest.raises(ConfigError, match="decode roles"):
        config_from_args(args)


def test_sliding_window_models_are_refused_as_sglang_refuses_them_and_linear_hybrids_are_not():
    swa = "mimo-v2-flash@h20x8"
    args = build_parser().parse_args(["--role", "pd-decode", "--port", "1", "--profile", swa,
                                      "--disaggregation-decode-enable-radix-cache"])
    with pytest.raises(ConfigError, match="sliding-window"):
        check_decode_radix_cache(config_from_args(args), load_timing(swa, 1.0, KV_SCALE, None))
    args = build_parser().parse_args(["--role", "pd-decode", "--port", "1", "--profile", HYBRID_PROFILE,
                                      "--disaggregation-decode-enable-radix-cache"])
    check_decode_radix_cache(config_from_args(args), load_timing(HYBRID_PROFILE, 1.0, KV_SCALE, None))  # patch 0001


def test_a_hybrid_decode_worker_reuses_kv_whatever_the_states_and_stops_a_page_short_of_one():
    """``PrefixCache.decode_reusable_tokens``, the decode rule of ``hooks/decode_radix``: full-attention
    pages whatever their checkpoints, a page short of a checkpoint the match would end at."""
    from prfaas_sglang.engine.mock.prefix_cache import PrefixCache

    cache = PrefixCache(4, 64, hybrid=True, checkpoint_interval_tokens=None)
    turn = list(range(100, 124))  # 6 pages; one checkpoint, at its last page
    cache.insert(turn)
    branch = turn[:16] + list(range(900, 910))  # shares 4 pages, no checkpoint among them
    assert cache.match(branch).cached_tokens == 0  # a prefill worker resumes no state there
    assert cache.decode_reusable_tokens(branch) == 16
    assert cache.decode_reusable_tokens(turn + [1, 2, 3, 4]) == 20  # ends at the checkpoint: a page short
    plain = PrefixCache(4, 64, hybrid=False)
    plain.insert(turn)
    assert plain.decode_reusable_tokens(turn + [1, 2, 3, 4]) == 24


def test_kv_bytes_beyond_keeps_the_state_and_the_later_pages():
    timing = load_timing(HYBRID_PROFILE, 1.0, KV_SCALE, None)
    assert timing.kv_bytes_beyond(20_000, 0) == timing.kv_bytes(20_000)
    state = timing.kv_bytes(0)  # the recurrent state: it does not grow with length, and always ships
    assert timing.kv_bytes_beyond(20_000, 8_192) == pytest.approx(timing.kv_bytes(20_000 - 8_192), abs=2)
    assert timing.kv_bytes_beyond(20_000, 19_968) >= state
    with pytest.raises(ValueError):
        timing.kv_bytes_beyond(100, 101)


def test_handoff_v2_carries_the_decode_prefix_and_still_reads_v1():
    reg = Registration(7, "127.0.0.1:1", 4096, 100, "http://127.0.0.1:9/prfaas/kv_ready", 1024)
    assert reg.to_json()["v"] == HANDOFF_VERSION == 2
    assert Registration.decode(reg.to_json()) == reg
    v1 = {k: v for k, v in reg.to_json().items() if k != "decode_prefix_len"} | {"v": 1}
    assert Registration.decode(v1).decode_prefix_len == 0
    with pytest.raises(ValueError, match="decode_prefix_len"):
        Registration.decode(reg.to_json() | {"decode_prefix_len": -1})
    with pytest.raises(ValueError, match="version"):
        KvReady.decode({"v": 3, "room": 1, "ok": True, "kv_bytes": 1, "cached_tokens": 0, "first_token": 1, "transfer_s": 0.1})
