"""The capacity harness's own arithmetic (bench/capacity.py): which arrivals a run scores, identical prompts
across loads, the shift, what a client's result counts as, the bucket order read from a peer's log, ratios."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from prfaas_sglang.bench import capacity
from prfaas_sglang.bench.capacity import (
    CapacitySetting,
    Stream,
    bucket_first,
    outcome,
    ratios,
    schedule,
)
from prfaas_sglang.demo.client import RequestResult
from prfaas_sglang.errors import ConfigError


class Words:
    """A stand-in for the tokenizer's text source: one word per token."""

    def text(self, rng, n_tokens: int) -> str:
        return " " + " ".join(f"w{rng.randrange(1000)}" for _ in range(n_tokens))


SETTING = CapacitySetting(speedup=4.0, scored_per_seed=30, warmup_s=10.0)


@pytest.mark.slow
def test_a_run_scores_the_arrivals_after_the_warm_up_and_keeps_the_load_on_after_them():
    arrivals, scored = schedule(Stream(SETTING, 0, Words()), SETTING, 1.0, 30)
    assert len(scored) == 30
    offsets = [a.offset_s * SETTING.speedup for a in arrivals]  # emulated seconds
    assert all(t < SETTING.warmup_s for t in offsets[: scored.start]) and offsets[scored.start] >= SETTING.warmup_s
    cooldown = SETTING.give_up_slos * SETTING.ttft_slo + SETTING.output_tokens * SETTING.tbt_slo * 2
    assert offsets[-1] == pytest.approx(offsets[scored.stop - 1] + cooldown, abs=3.0)
    # unless given, the warm-up lasts as long as a scored request may take: with 1024-token outputs the decode
    # batch a scored arrival meets has filled (2 x 25.6 s of decode at 40 tok/s, and 2.5 TTFT SLOs)
    default = dataclasses.replace(SETTING, warmup_s=None)
    arrivals, scored = schedule(Stream(default, 0, Words()), default, 1.0, 30)
    first = arrivals[scored.start].offset_s * default.speedup
    assert default.warmup == cooldown == pytest.approx(63.7) and default.warmup <= first < default.warmup + 10


@pytest.mark.slow
def test_every_load_plays_the_same_prompts_in_the_same_order():
    stream = Stream(SETTING, 1, Words())
    slow, _ = schedule(stream, SETTING, 0.5, 30)
    fast, _ = schedule(stream, SETTING, 2.0, 30)
    n = min(len(slow), len(fast))
    assert [a.body["prompt"] for a in slow[:n]] == [a.body["prompt"] for a in fast[:n]]
    assert slow[5].offset_s == pytest.approx(4 * fast[5].offset_s)
    other = Stream(SETTING, 2, Words())
    assert schedule(other, SETTING, 0.5, 30)[0][0].body["prompt"] != slow[0].body["prompt"]


def test_the_shift_doubles_every_prompt_from_the_middle_of_the_scored_window():
    shift = dataclasses.replace(SETTING, workload="shift")
    base, scored = schedule(Stream(SETTING, 3, Words()), SETTING, 1.0, 30)
    doubled, _ = schedule(Stream(shift, 3, Words()), shift, 1.0, 30)
    middle = SETTING.warmup_s + 15.0
    for a, b in zip(base, doubled, strict=False):
        expected = a.input_tokens if a.offset_s * 4 < middle else min(2 * a.input_tokens, capacity.MAX_INPUT_TOKENS)
        assert b.input_tokens == expected


@pytest.mark.parametrize("result, refused, failed, met", [
    (RequestResult(100, status=503, retry_after_s=1.0), True, False, False),
    (RequestResult(100, status=408), True, False, False),
    (RequestResult(100, status=502, error="decode failed"), False, True, False),
    (RequestResult(100), False, False, False),  # never answered before the harness gave up
    (RequestResult(100, status=200, ttft_s=0.5, token_gaps_s=[0.005] * 9, output_tokens=10), False, False, True),
    (RequestResult(100, status=200, ttft_s=0.5, token_gaps_s=[0.005] * 3), False, False, False),  # cut mid-stream
])
def test_what_a_clients_result_counts_as(result, refused, failed, met):
    o = outcome(result, speedup=4.0)
    assert (o.refused, o.failed, o.meets(5.0, 0.025)) == (refused, failed, met)
    if result.ttft_s is not None:
        assert o.ttft_s == pytest.approx(2.0) and (met or math.isinf(o.mean_tbt_s))


def test_the_bucket_order_is_read_from_the_peers_log(tmp_path):
    log = tmp_path / "peer.log"
    old = 'Init boundary:[Boundary { url: "http://a:1", range: [0, 9] }, Boundary { url: "http://b:2", range: [10, 99] }]\n'
    log.write_text(old)
    offset = log.stat().st_size
    log.write_text(old + 'Init boundary:[Boundary { url: "http://b:2", range: [0, 99] }]\n'
                   'Init boundary:[Boundary { url: "http://b:2", range: [0, 9] }, Boundary { url: "http://a:1", range: [10, 99] }]\n')
    assert bucket_first(log, 0, 2) == "http://b:2" and bucket_first(log, offset, 2) == "http://b:2"
    assert bucket_first(log, log.stat().st_size, 2, timeout_s=0.1) is None


def test_ratios_pool_and_spread_over_seeds():
    def row(pooled, seeds):
        return {"capacity_rps": {"0.9": pooled, "0.99": pooled / 2},
                "per_seed_capacity_rps": {"0.9": seeds, "0.99": {k: v / 2 for k, v in seeds.items()}}}

    rows = {"prfaas": row(1.0, {"0": 1.0, "1": 0.9, "2": 1.1}), "peer-a": row(0.5, {"0": 0.5, "1": 0.45, "2": 0.5}),
            "peer-b": row(0.25, {"0": 0.25, "1": 0.0, "2": 0.3})}
    r = ratios(rows, {"sglang-router": "peer-a", "smg": "peer-b"})["0.9"]
    assert r["best_other"] == "peer-a" and r["capacity_ratio_vs_best"] == pytest.approx(2.0)
    assert r["capacity_ratio_vs_best_per_seed"] == {"median": 2.0, "min": 2.0, "max": pytest.approx(2.2)}
    # a seed where the peer met the target at no probed load has no finite ratio: it is left out of the spread
    assert r["vs"]["smg"]["per_seed"] == {"median": pytest.approx((4.0 + 1.1 / 0.3) / 2), "min": pytest.approx(1.1 / 0.3),
                                           "max": 4.0}


def test_each_of_our_other_rows_gets_its_ratio_and_paired_interval_even_without_a_peer():
    """An ablation run (``--families none --ours prfaas,prfaas-no-calibration``) has no peer to compare with, yet
    the question it asks is ours over the other: that ratio, its spread over seeds and the grid's paired interval,
    in the document and its rendering. A peer's row is not taken for one of ours."""
    from prfaas_sglang.bench.slo import CapacityInterval

    def row(pooled, seeds):
        return {"capacity_rps": {"0.9": pooled, "0.99": pooled / 2},
                "per_seed_capacity_rps": {"0.9": seeds, "0.99": {k: v / 2 for k, v in seeds.items()}}}

    def estimate(capacity, samples):
        return CapacityInterval(0.9, capacity, min(samples), max(samples), 0.95, None, tuple(samples))

    rows = {"prfaas": row(1.2, {"0": 1.2, "1": 1.0}), "prfaas-no-calibration": row(1.0, {"0": 1.0, "1": 1.0}),
            "sr-power_of_two-admit8": row(0.6, {"0": 0.6, "1": 0.5})}
    intervals = {"prfaas": estimate(1.2, [1.1, 1.2, 1.3, 1.25]), "prfaas-no-calibration": estimate(1.0, [1.0, 1.0, 1.0, 1.0])}
    r = ratios(rows, {}, intervals)
    assert set(r) == {"0.9", "0.99"} and "vs" not in r["0.9"]
    assert set(r["0.9"]["ablations"]) == {"prfaas-no-calibration"}  # the peer's row is no ablation of ours
    ablation = r["0.9"]["ablations"]["prfaas-no-calibration"]
    assert ablation["ratio"] == pytest.approx(1.2) and ablation["per_seed"] == {"median": pytest.approx(1.1), "min": 1.0,
                                                                                "max": pytest.approx(1.2)}
    assert ablation["interval"]["low"] > 1 and ablation["interval"]["ahead"]  # every paired replicate above 1
    assert "interval" not in r["0.99"]["ablations"]["prfaas-no-calibration"]  # the grid estimates 90% only
    with_peer = ratios(rows, {"sglang-router": "sr-power_of_two-admit8"}, intervals)["0.9"]
    assert with_peer["best_other"] == "sr-power_of_two-admit8" and with_peer["ablations"] == r["0.9"]["ablations"]
    text = capacity._render_ratios("0.9", r["0.9"])
    assert len(text) == 1 and "prfaas-no-calibration" in text[0] and "1.20" in text[0] and ", ahead" in text[0]


def test_a_condition_run_in_pieces_merges_and_takes_ours_over_the_best_peer_from_that_peers_own_piece(tmp_path, capsys):
    """A condition too long for one run (a sweep per family) runs one family per piece, ours beside it each time.
    Merged, every piece stays itself, and ours over the best peer of them all is the ratio measured in that peer's
    piece, never ours from one run over a peer from another. Pieces of one condition run with another setting
    are refused; a piece run again replaces the earlier run."""
    def row(pooled):
        return {"capacity_rps": {"0.9": pooled, "0.99": pooled / 2},
                "per_seed_capacity_rps": {"0.9": {"0": pooled}, "0.99": {"0": pooled / 2}}}

    def piece(family, peer, ours, theirs, seeds=3):
        rows = {"prfaas": row(ours), peer: row(theirs)}
        return {"condition": "c", "setting": {"seeds": seeds}, "sweep": {family: {}}, "rows": rows,
                "ratios": ratios(rows, {family: peer})}

    by_sr, by_naive = piece("sglang-router", "sr-cache_aware", 1.0, 0.5), piece("naive", "naive-sr-cap8", 0.9, 0.6)
    merged = capacity.merge([by_sr, by_naive, piece("naive", "naive-sr-cap8", 0.9, 0.6)])  # naive's piece twice
    assert [c["piece"] for c in merged["conditions"]] == ["sglang-router; ours prfaas", "naive; ours prfaas"]
    best = merged["across"]["c"]
    assert best["best_other"] == "naive-sr-cap8" and best["piece"] == "naive; ours prfaas"
    assert best["ratio"] == pytest.approx(0.9 / 0.6) and best["ours_rps"] == 0.9  # not 1.0 / 0.6 across two runs
    (text,) = capacity._render_across(merged)
    assert text.startswith("c, across its pieces: the best peer is naive-sr-cap8") and "from that piece: 1.50" in text
    alone = capacity.merge([by_sr])
    assert "across" not in alone and "piece" not in alone["conditions"][0]
    with pytest.raises(ConfigError, match="seeds"):
        capacity.merge([by_sr, piece("naive", "naive-sr-cap8", 0.9, 0.6, seeds=2)])
    # from the command line: a usage error naming the field, not a traceback
    from prfaas_sglang.bench.__main__ import main

    paths = [tmp_path / "sr.json", tmp_path / "naive.json"]
    for path, doc in zip(paths, (by_sr, piece("naive", "naive-sr-cap8", 0.9, 0.6, seeds=2)), strict=True):
        path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit) as ended:
        main(["compare", "--merge", *map(str, paths)])
    assert ended.value.code == 2 and "different settings (seeds)" in capsys.readouterr().err


def test_a_run_kept_on_disk_is_estimated_again_from_its_runs_by_todays_estimator(tmp_path, capsys):
    """``--merge --refit``: a document (or a ``.partial.json``) that kept its grid's runs and its bisection's gets
    its intervals and ratios estimated again from both (``refit``); one that kept no grid runs is left as it is."""
    def met(share, n=100):
        return "1" * round(share * n) + "0" * (n - round(share * n))

    def row(crossing, name):
        probes = [{"load_rps": crossing * 0.9, "met_in_arrival_order": {"0": met(0.97), "1": met(0.95)}},
                  {"load_rps": crossing * 1.2, "met_in_arrival_order": {"0": met(0.7), "1": met(0.75)}}]
        grid = {f"{crossing * f:g}": {"0": met(a), "1": met(a - 0.02)} for f, a in ((0.95, 0.95), (1.0, 0.91), (1.06, 0.85))}
        return {"capacity_rps": {"0.9": crossing * 0.9, "0.99": 0.0}, "per_seed_capacity_rps": {"0.9": {}, "0.99": {}},
                "probes": probes}, grid

    ours, our_grid = row(1.0, "prfaas")
    theirs, their_grid = row(0.5, "sr-cache_aware")
    setting = dataclasses.asdict(dataclasses.replace(SETTING, seeds=2, grid_resamples=200))
    cond = {"condition": "c", "setting": setting, "sweep": {"sglang-router": {}}, "best_config": {"sglang-router": "sr-cache_aware"},
            "rows": {"prfaas": ours, "sr-cache_aware": theirs}, "grid_runs": {"prfaas": our_grid, "sr-cache_aware": their_grid}}
    again = capacity.refit(cond)
    for name in ("prfaas", "sr-cache_aware"):
        iv = again["rows"][name]["interval"]
        assert [t["runs"] for t in iv["grid"]] == [2] * 5 and iv["censored"] is None and iv["low"] <= iv["capacity"] <= iv["high"]
    assert 0.9 < again["rows"]["prfaas"]["interval"]["capacity"] < 1.2
    assert again["ratios"]["0.9"]["vs"]["sglang-router"]["interval"]["ratio"] == pytest.approx(2.0, rel=0.05)
    assert "interval" not in cond["rows"]["prfaas"]  # the document given stays as it was
    assert capacity.refit({k: v for k, v in cond.items() if k != "grid_runs"}) == {k: v for k, v in cond.items() if k != "grid_runs"}
    with pytest.raises(ConfigError, match="--refit"):
        capacity.refit({**cond, "rows": {"prfaas": ours}})  # a grid run of a row the document lacks
    from prfaas_sglang.bench.__main__ import main

    path = tmp_path / "c.partial.json"
    path.write_text(json.dumps(cond))
    assert main(["compare", "--merge", str(path), "--refit", "--json"]) == 0
    (printed,) = json.loads(capsys.readouterr().out)["result"]["conditions"]
    assert printed["refit"] and printed["rows"]["prfaas"]["interval"] == again["rows"]["prfaas"]["interval"]


@pytest.mark.parametrize(("speedup", "timeout", "rate"), [(4.0, "1", "4"), (2.0, "2", "2"), (1.0, "4", "1")])
def test_a_peers_time_valued_knobs_reach_it_in_wall_time_at_the_deployments_speedup(tmp_path, monkeypatch, speedup,
                                                                                   timeout, rate):
    """sglang-router's admission row: a 4 s queue timeout and 1 token a second on the emulated clock, its load poll
    at its fastest. The flags the peer process is started with are those, in wall time at the speedup."""
    from types import SimpleNamespace

    from prfaas_sglang.bench.capacity_rows import ALL

    started = {}
    monkeypatch.setattr(capacity, "start_peer_router", lambda *a, **kw: started.update(kw) or "http://peer")
    worker = SimpleNamespace(url="http://w", bootstrap_port=1)
    up = capacity.Up("hetero", None, SimpleNamespace(workers={"prfaas-0": worker, "pd-prefill-0": worker,
                                                               "pd-decode-0": worker}),
                     {"emulation": {"speedup": speedup}}, None)
    capacity.start_row_router(ALL["sr-power_of_two-admit8"], up, SimpleNamespace(log_dir=tmp_path))
    args = started["extra_args"]
    flag = dict(zip(args[::2], args[1::2], strict=True))
    assert flag["--queue-timeout-secs"] == timeout and flag["--rate-limit-tokens-per-second"] == rate
    assert flag["--worker-startup-check-interval"] == "1" and flag["--max-concurrent-requests"] == "8"


def test_a_knob_the_peer_cannot_take_at_this_speedup_is_refused_with_its_name():
    from prfaas_sglang.bench.capacity_rows import (
        ALL,
        EmulatedSeconds,
        KnobClockError,
        emulated_knobs,
        peer_args,
    )

    with pytest.raises(KnobClockError, match="--queue-timeout-secs: 4 emulated s is 0.5 wall s at speedup 8"):
        peer_args(ALL["sr-cache_aware-admit8"].args, 8.0)
    with pytest.raises(KnobClockError, match="6 emulated s is 1.5 wall s at speedup 4: the peer takes whole numbers"):
        peer_args((EmulatedSeconds("--prefill-queue-timeout-secs", 6),), 4.0)
    # What a reader compares with the SLO: the knobs on the emulated clock (the poll period is the peer's floor).
    assert emulated_knobs(ALL["sr-power_of_two-admit8"].args, 4.0) == {
        "--worker-startup-check-interval": 4.0, "--rate-limit-tokens-per-second": 1, "--queue-timeout-secs": 4}


def test_the_grid_probes_every_row_load_and_seed_once_interleaved_and_its_intervals_reach_the_ratios():
    """bench/capacity.py ``grid``, with a probe whose attainment curve is known: ours crosses 90% at 1.0 req/s, the
    peer at 0.5. Every (row, load, seed) is probed once, rows interleaved; each estimate lands near its crossing
    (coverage itself is tested over 100 trials in test_slo.py) and the ratio's interval (in ``ratios``) says ours
    is ahead."""
    import random

    import numpy as np

    from prfaas_sglang.bench.capacity_rows import ALL

    ours, peer = ALL["prfaas"], ALL["sr-cache_aware"]
    crossing = {"prfaas": 1.0, "sr-cache_aware": 0.5}
    calls = []
    rng = np.random.default_rng(0)

    def probe(row, load, seed):
        calls.append((row.name, load, seed))
        p = 1 / (1 + math.exp((load / crossing[row.name] - 1.12) / 0.05))  # 0.9 at load = crossing x ~1.0
        return list(rng.random(300) < p)

    setting = dataclasses.replace(SETTING, seeds=2, grid_loads=7, grid_step=1.06, grid_resamples=300)
    centres = {"prfaas": 1.05, "sr-cache_aware": 0.48}  # the bisection's, a little off
    kept = []  # what a run cut short keeps: the checkpoint after every probe
    out = capacity.grid(probe, setting, [ours, peer], centres, random.Random(1), log=lambda _m: None,
                        checkpoint=lambda runs: kept.append(json.loads(json.dumps(runs))))
    assert sorted(calls) == sorted(set(calls)) and len(calls) == 2 * 7 * 2
    assert len(kept) == len(calls) and sum(len(seeds) for loads in kept[-1].values() for seeds in loads.values()) == 28
    assert all(len(run) == 300 and set(run) <= {"0", "1"} for loads in kept[-1].values() for seeds in loads.values()
               for run in seeds.values())
    assert [name for name, _, _ in calls[:6]] != ["prfaas"] * 6 or [n for n, _, _ in calls[6:12]] != ["prfaas"] * 6
    truth = {name: crossing[name] * (1.12 + 0.05 * math.log(1 / 9)) for name in crossing}
    for name, (est, table) in out.items():
        assert est.low < est.capacity < est.high and abs(est.capacity / truth[name] - 1) < 0.05, (name, est, truth[name])
        assert est.censored is None
        assert len(table) == 7 and all(t["arrivals"] == 600 for t in table)
    rows = {name: {"capacity_rps": {"0.9": est.capacity, "0.99": 0.0},
                   "per_seed_capacity_rps": {"0.9": {}, "0.99": {}}} for name, (est, _) in out.items()}
    result = capacity.ratios(rows, {"sglang-router": "sr-cache_aware"}, {name: est for name, (est, _) in out.items()})
    ratio = result["0.9"]["vs"]["sglang-router"]["interval"]
    assert ratio["ahead"] and ratio["low"] < ratio["ratio"] < ratio["high"] and abs(ratio["ratio"] / 2.0 - 1) < 0.05
    assert "interval" not in result["0.99"]["vs"]["sglang-router"]


def test_the_interval_pools_the_bisections_runs_and_a_censored_grid_grows_a_load_at_a_time():
    """bench/capacity.py ``grid``: ours crosses 90% at about 1.0 req/s, but its grid sits at 0.6 (a bisection
    cut short). Alone, every grid load passes: the grid adds one load above its top, every seed, twice
    (``grid_extensions``), and the estimate stays censored, saying so. With the bisection's failing probe at 1.1
    pooled in (``probe_runs``), the fit crosses between the grid and it: nothing is added."""
    import random

    import numpy as np

    from prfaas_sglang.bench.capacity_rows import ALL

    ours = ALL["prfaas"]
    rng = np.random.default_rng(0)
    calls = []

    def probe(row, load, seed):
        calls.append((load, seed))
        return list(rng.random(200) < 1 / (1 + math.exp((load - 1.11) / 0.05)))

    setting = dataclasses.replace(SETTING, seeds=2, grid_loads=3, grid_step=1.06, grid_resamples=100, grid_extensions=2)
    out = capacity.grid(probe, setting, [ours], {"prfaas": 0.6}, random.Random(1), log=lambda _m: None)
    est, table = out["prfaas"]
    assert est.censored == "above-grid" and len(calls) == 3 * 2 + 2 * 2
    top = max(load for load, _ in calls[:6])
    assert sorted({load for load, _ in calls[6:]}) == pytest.approx([top * 1.06, top * 1.06**2])
    assert [t["runs"] for t in table] == [2] * 5

    bisection = {"probes": [{"load_rps": 1.1, "met_in_arrival_order": {"0": "0" * 150 + "1" * 50, "1": "01" * 100}},
                            {"load_rps": 0.6, "met_in_arrival_order": {"1": "1" * 200}}]}
    prior = capacity.probe_runs(bisection)
    assert sorted(prior) == [0.6, 1.1] and len(prior[1.1][1]) == 1 and sum(prior[1.1][1][0]) == 100
    calls.clear()
    out = capacity.grid(probe, setting, [ours], {"prfaas": 0.6}, random.Random(1), log=lambda _m: None,
                        prior={"prfaas": prior})
    est, table = out["prfaas"]
    assert est.censored is None and len(calls) == 3 * 2 and 0.6 < est.capacity < 1.1
    fitted = {round(t["load_rps"], 3): t for t in table}
    assert fitted[1.1]["runs"] == 2 and fitted[1.1]["attainment"] == pytest.approx(150 / 400)
    assert fitted[0.6]["runs"] == 3 and fitted[0.6]["arrivals"] == 600  # the grid's centre and the probe: one load


def test_the_attainment_plot_draws_every_measurement_of_every_row_one_png_per_condition(tmp_path):
    from prfaas_sglang.bench.capacity_plots import row_points, write_attainment_plots

    row = {"probes": [{"load_rps": 0.5, "attainment": 1.0, "arrivals": 70}, {"load_rps": 0.8, "attainment": 0.6, "arrivals": 70}],
           "interval": {"capacity": 0.7, "low": 0.65, "high": 0.74,
                        "grid": [{"load_rps": 0.8, "attainment": 0.55, "arrivals": 210}, {"load_rps": 0.7, "attainment": 0.9,
                                                                                          "arrivals": 210}]}}
    assert row_points(row) == [(0.5, 1.0, 70), (0.7, 0.9, 210), (0.8, 0.55, 210)]  # the grid's where both measured
    conditions = [{"condition": c, "ttft_slo_s": 5.0, "setting": {"output_tokens": 1024}, "rows": {"prfaas": row}}
                  for c in ("case-study/abundant", "case-study/scarce")]
    paths = write_attainment_plots({"conditions": conditions}, tmp_path)
    assert [p.name for p in paths] == ["attainment-case-study_abundant.png", "attainment-case-study_scarce.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_the_sweep_pools_seeds_and_bisects_what_it_cannot_tell_from_the_best():
    """Every configuration of a family runs on ``sweep_seeds`` seeds at each sweep load; one within the two standard
    errors of the best is ``close`` (bisected beside it), one far below is not, a router that will not start is
    recorded; after the bisection the family's best is the close one if it reached the higher capacity."""
    from types import SimpleNamespace

    from prfaas_sglang.bench.capacity_rows import family_rows
    from prfaas_sglang.bench.slo import Outcome

    rows = family_rows("naive")
    level = {r.name: 0.2 for r in rows} | {rows[0].name: 0.80, rows[1].name: 0.78, rows[2].name: 0.40}
    calls = []

    def run(row, load, seed, scored):
        calls.append((row.name, seed))
        if row.name == rows[3].name:
            raise capacity.RowFailed("no start")
        met = round(level[row.name] * scored)
        outcomes = [Outcome(100, 0.1 if k < met else None) for k in range(scored)]
        return {"outcomes": outcomes, "window_s": 10.0}

    runner = SimpleNamespace(run=run, fleet=SimpleNamespace(keep_only=lambda kinds: None))
    setting = dataclasses.replace(SETTING, sweep_seeds=2, sweep_scored=50)
    kept = []  # what a run cut short would keep: the sweep so far, after each configuration
    out = capacity.sweep(runner, setting, 1.0, ("naive",), log=lambda _m: None,
                         checkpoint=lambda so_far: kept.append([g["row"] for g in so_far["naive"]["grid"]]))["naive"]
    assert out["best"] == rows[0].name and out["close"] == [rows[1].name] and out["seeds"] == 2
    assert kept == [[r.name for r in rows[:k]] for k in range(1, len(rows) + 1)]  # the one that failed to start too
    assert {seed for name, seed in calls if name == rows[0].name} == {0, 1}
    assert sum(name == rows[0].name for name, _ in calls) == 2 * len(capacity.SWEEP_LOADS)
    by_row = {g["row"]: g for g in out["grid"]}
    assert by_row[rows[3].name]["error"] == "no start" and by_row[rows[0].name]["stderr"] == pytest.approx(
        math.sqrt(0.8 * 0.2 / 100) / math.sqrt(2), rel=1e-6)
    bisected = {rows[0].name: {"capacity_rps": {"0.9": 0.50}}, rows[1].name: {"capacity_rps": {"0.9": 0.55}}}
    assert capacity.final_best({"naive": out}, bisected) == {"naive": rows[1].name}
    assert capacity.final_best({"naive": out}, {}) == {"naive": rows[0].name}


def test_on_a_trace_condition_the_routers_prior_is_not_the_trace_it_is_judged_on(tmp_path):
    """The topology the capacity run writes tells the router to plan for the case study while the arrivals come from
    the trace; a prior is the evaluated trace only when named (and the condition then says so)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 2000, "output_length": 10, "hash_ids": [1]}\n')
    setting = CapacitySetting(workload=f"trace:{trace}")
    doc = capacity.topology(setting, "hetero")
    assert doc["scheduler"]["workload"]["kind"] != "trace" and capacity.prior_workload(setting) == "case-study"
    named = dataclasses.replace(setting, prior=f"trace:{trace}")
    assert capacity.topology(named, "hetero")["scheduler"]["workload"]["kind"] == "trace"
    assert named.condition.endswith("prior-t.jsonl") and "prior" not in setting.condition


def test_the_layerwise_ablation_row_runs_our_router_over_a_deployment_whose_link_streams():
    """``prfaas-layerwise``: our router, unchanged, over a deployment of its own whose topology marks the link
    ``layerwise`` (its PrfaaS engines stream by layer group, its router's estimate overlaps), beside ``prfaas`` on the
    plain one: an ablation inside one run. ``--layerwise`` turns it on for every deployment of the condition."""
    from prfaas_sglang import runtime
    from prfaas_sglang.bench import capacity_rows
    from prfaas_sglang.topology import parse_topology

    row = capacity_rows.ALL["prfaas-layerwise"]
    assert row.family == "ours" and row.router == "prfaas" and row.args == capacity_rows.ALL["prfaas"].args
    setting = capacity.CapacitySetting()
    streams = {kind: runtime.from_topology(parse_topology(capacity.topology(setting, kind))).layerwise
               for kind in ("hetero", row.deployment)}
    assert streams == {"hetero": False, "hetero-layerwise": True}
    assert capacity.topology(dataclasses.replace(setting, layerwise=True), "hetero")["links"][0]["layerwise"] is True
    assert capacity_rows.DEPLOYMENTS[row.deployment] == capacity_rows.DEPLOYMENTS["hetero"] and row.deployment in capacity_rows.SHAPED


def test_the_report_shows_each_windows_median_prediction_error_and_says_when_an_old_run_had_only_the_mean():
    def run(windows: list[dict]) -> dict:
        return {"prefill_scale": {"prfaas": 0.8, "pd": 1.0}, "ttft_error_series": windows}

    new = [{"requests": "1-25", "median_relative_error": 0.30, "mean_relative_error": 0.50},
           {"requests": "26-50", "median_relative_error": 0.10, "mean_relative_error": 0.40}]
    old = [{"requests": "1-25", "mean_relative_error": 0.50}, {"requests": "26-50", "mean_relative_error": 0.40}]

    def report(runs: list[dict]) -> str:
        row = {"capacity_rps": {"0.9": 0.3}, "probes": [{"load_rps": 0.3, "calibration": runs}]}
        return "\n".join(capacity._render_calibration({"rows": {"prfaas": row}}))

    assert "error (median of a window) 0.30 -> 0.10" in report([run(new), run(new)])
    assert "error (mean of a window) 0.50 -> 0.40" in report([run(new), run(old)])


@pytest.mark.parametrize(("flags", "words"), [(["--scored", "5"], "--scored must be in [10, 2000]"),
                                             (["--grid-loads", "1"], "--grid-loads must be 0 (no grid) or in [2, 15]"),
                                             (["--warmup-s", "-1"], "--warmup-s must be in [0, 600]"),
                                             (["--out", "/no-such-dir-prfaas/piece.json"], "--out: no directory /no-such-dir-prfaas"),
                                             (["--stream-interval", "0"], "--stream-interval must be in [1, 64]")])
def test_a_probe_length_or_grid_the_method_cannot_use_is_refused_before_anything_starts(flags, words, capsys):
    import argparse

    from prfaas_sglang.bench.subcommands import Invocation

    parser = argparse.ArgumentParser()
    capacity.add_arguments(parser)
    args = parser.parse_args(["--capacity", "--families", "none", "--ours", "prfaas", *flags])
    with pytest.raises(SystemExit) as exit_:
        capacity._capacity_run(args, Invocation.now(parser))
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_a_probe_keeps_each_seeds_arrivals_met_in_arrival_order_so_a_drift_within_a_run_shows():
    from prfaas_sglang.bench.slo import Outcome

    setting = CapacitySetting()
    ok, late, refused = (Outcome(1000, 1.0, 0.01), Outcome(1000, setting.ttft_slo + 1, 0.01),
                         Outcome(1000, None, refused=True))
    runs = [{"seed": seed, "outcomes": outcomes, "window_s": 10.0, "offload_fraction": 0.5, "clean_start": True,
             "engine_timing_s": {"prefill": [1.0, 1.0], "decode": [1.0, 1.0]}}
            for seed, outcomes in ((0, [ok, ok, late, refused]), (1, [ok, late]))]
    summary = capacity.probe_summary(runs, setting)
    assert summary["met_in_arrival_order"] == {"0": "1100", "1": "10"}
    assert summary["per_seed_attainment"] == {"0": 0.5, "1": 0.5}


def test_a_rows_grid_is_centred_in_its_bracket_and_beside_a_one_sided_one():
    setting = CapacitySetting(grid_loads=5, grid_step=1.06)
    half_span = setting.grid_step ** ((setting.grid_loads - 1) / 2)

    def result(lo, hi):
        return {"search": {"brackets": {"0.9": {"lo": lo, "hi": hi}}}}

    narrow = capacity.grid_centre(result(0.30, 0.31), setting, floor_rps=0.2)
    assert 0.30 < narrow < 0.31  # at the bracket's resolution: about the bisected capacity
    wide = capacity.grid_centre(result(0.244, 0.352), setting, floor_rps=0.2)  # cut wide by --rounds 2
    assert wide == pytest.approx((0.244 * 0.352) ** 0.5)  # the grid's middle in the bracket's, not at its bottom
    assert wide / half_span > 0.244 and wide * half_span < 0.352
    centre = capacity.grid_centre(result(None, 0.33), setting, floor_rps=0.2)  # one probe, failed (--rounds 1)
    assert centre * half_span == pytest.approx(0.33) and centre > 0.2  # the grid's top at the failing load
    centre = capacity.grid_centre(result(0.5, None), setting, floor_rps=0.2)  # passed at the top of the search
    assert centre / half_span == pytest.approx(0.5)  # the grid's bottom at the passing load
    assert capacity.grid_centre(result(None, None), setting, floor_rps=0.2) == 0.2
