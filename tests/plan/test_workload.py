"""Workloads: the truncated log-normal in closed form, empirical lengths, traces -> incremental lengths."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from helpers import TRACE
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.workload import (
    EmpiricalLengths,
    LruBlockCache,
    TraceRecord,
    TruncatedLogNormal,
    UnboundedCache,
    incremental_lengths,
    parse_trace_record,
)

CASE_STUDY = TruncatedLogNormal(mu=9.90, sigma=1.00, lo=128, hi=131072)


@pytest.fixture(scope="module")
def samples():
    """10^6 draws by rejection from numpy's own log-normal (independent of our formulas)."""
    rng = np.random.default_rng(20261122)
    draws = rng.lognormal(9.90, 1.00, size=1_300_000)
    kept = draws[(draws >= 128) & (draws <= 131072)][:1_000_000]
    assert kept.size == 1_000_000
    return kept


class TestCaseStudyFigures:
    def test_paper_figures_at_19_4k(self):
        split = CASE_STUDY.split(19_400)
        assert split.offload_fraction == pytest.approx(0.496, abs=0.002)
        assert 44_000 <= split.mean_long_tokens <= 46_000
        assert 27_000 <= CASE_STUDY.mean_tokens <= 28_000

    @pytest.mark.parametrize("t", [2_000, 10_000, 19_400, 40_000, 100_000])
    def test_closed_form_matches_monte_carlo_within_one_percent(self, samples, t):
        split = CASE_STUDY.split(t)
        long, short = samples[samples > t], samples[samples <= t]
        assert split.offload_fraction == pytest.approx(long.size / samples.size, rel=0.01)
        assert split.mean_long_tokens == pytest.approx(long.mean(), rel=0.01)
        assert split.mean_short_tokens == pytest.approx(short.mean(), rel=0.01)
        assert CASE_STUDY.mean_tokens == pytest.approx(samples.mean(), rel=0.01)

    def test_our_sampler_agrees_with_the_closed_form(self):
        draws = CASE_STUDY.sample(random.Random(7), 50_000)
        assert min(draws) >= 128 and max(draws) <= 131072
        assert np.mean(draws) == pytest.approx(CASE_STUDY.mean_tokens, rel=0.02)

    def test_extremes(self):
        assert CASE_STUDY.split(64).offload_fraction == pytest.approx(1.0)
        assert CASE_STUDY.split(64).mean_short_tokens is None
        top = CASE_STUDY.split(200_000)
        assert top.offload_fraction == 0.0 and top.mean_long_tokens is None
        assert top.mean_short_tokens == pytest.approx(CASE_STUDY.mean_tokens)

    @pytest.mark.parametrize("kwargs, field", [
        ({"mu": 9.9, "sigma": 0.0, "lo": 128, "hi": 1000}, "workload.sigma"),
        ({"mu": 9.9, "sigma": 1.0, "lo": 2000, "hi": 1000}, "workload.min_tokens"),
    ])
    def test_bad_parameters_name_the_field(self, kwargs, field):
        with pytest.raises(ConfigError) as err:
            TruncatedLogNormal(**kwargs)
        assert err.value.field == field


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(min_value=1, max_value=200_000), min_size=1, max_size=60), t=st.integers(0, 210_000))
def test_empirical_split_is_exact(lengths, t):
    split = EmpiricalLengths(lengths).split(t)
    long = [x for x in lengths if x > t]
    short = [x for x in lengths if x <= t]
    assert split.offload_fraction == pytest.approx(len(long) / len(lengths))
    assert split.mean_long_tokens == (pytest.approx(sum(long) / len(long)) if long else None)
    assert split.mean_short_tokens == (pytest.approx(sum(short) / len(short)) if short else None)


def test_empty_empirical_workload_is_refused():
    with pytest.raises(ConfigError, match="workload.lengths: is empty"):
        EmpiricalLengths([])


def rec(length: int, blocks: list[int]) -> TraceRecord:
    return TraceRecord(0.0, length, 10, tuple(blocks))


class TestIncrementalLengths:
    def test_shared_prefix_is_not_recomputed(self):
        records = [rec(1500, [0, 1, 2]), rec(1600, [0, 1, 3, 4]), rec(1500, [0, 1, 2])]
        assert incremental_lengths(records, UnboundedCache()) == [1500, 1600 - 1024, 1]

    def test_lru_forgets(self):
        records = [rec(1024, [0, 1]), rec(1024, [2, 3]), rec(1024, [0, 1])]
        assert incremental_lengths(records, LruBlockCache(4)) == [1024, 1024, 1]
        assert incremental_lengths(records, LruBlockCache(2)) == [1024, 1024, 1024]

    def test_only_a_leading_prefix_counts(self):
        records = [rec(1536, [0, 1, 2]), rec(1536, [9, 1, 2])]
        assert incremental_lengths(records, UnboundedCache()) == [1536, 1536]

    def test_bad_records_name_the_line(self):
        with pytest.raises(ConfigError, match="trace:3"):
            parse_trace_record({"timestamp": 0, "input_length": 10}, "trace:3")
        with pytest.raises(ConfigError, match="input_length must be > 0"):
            parse_trace_record({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}, "t")

    def test_mooncake_conversation_trace_reuse(self):
        """The shared trace: ~37% of input tokens are reusable with an unbounded cache (data README)."""
        assert TRACE.is_file(), f"{TRACE} ships in shared/data beside the checkout (or set PRFAAS_TRACE_PATH)"
        records = [parse_trace_record(json.loads(line), "trace") for line in TRACE.read_text().splitlines()]
        total = sum(r.input_length for r in records)
        unbounded = sum(incremental_lengths(records, UnboundedCache()))
        small = sum(incremental_lengths(records, LruBlockCache(2_000)))
        assert 1 - unbounded / total == pytest.approx(0.374, abs=0.01)
        assert unbounded < small < total


def test_negligible_tails_are_empty_sides_not_zero_means():
    """Found by the property test: a narrow log-normal has ~1e-25 mass below 2K tokens."""
    narrow = TruncatedLogNormal(mu=11.0, sigma=0.328125, lo=128, hi=131072)
    low = narrow.split(2048)
    assert low.offload_fraction == 1.0 and low.mean_short_tokens is None
    assert low.mean_long_tokens == pytest.approx(narrow.mean_tokens)
    for t in (30_000, 60_000, 100_000):
        split = narrow.split(t)
        assert 128 <= split.mean_short_tokens <= t <= split.mean_long_tokens <= 131072
