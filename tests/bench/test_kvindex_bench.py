"""``bench kvindex``, each of its three reports at a small size (in process, under a second each): every
row measures what it names, the emulated engine's cache included."""

from __future__ import annotations

from prfaas_sglang.bench.kvindex import by_page_size, held, render_markdown, run


def test_the_page_size_table_matches_the_held_prompt_whole_and_times_every_column():
    result = by_page_size((1, 64), prompt_tokens=1024, runs=2)
    assert [r["page_size"] for r in result["rows"]] == [1, 64]
    for row in result["rows"]:
        assert row["blocks"] == 1024 // row["page_size"] and row["matched_tokens"] == 1024
        for key in ("list_first_ms", "list_again_ms", "json_first_ms", "json_again_ms", "emulated_first_ms", "emulated_again_ms"):
            assert row[key] > 0, key
    table = render_markdown(result).splitlines()
    assert len(table) == 4 and table[0].count("|") == table[2].count("|") == 6


def test_ingest_counts_every_event_of_every_worker_and_a_128k_prompt_is_matched():
    result = run(workers=2, prompts_per_worker=3, match_runs=2)
    assert result["workers"] == 3 and result["events"] > 0 and result["match_tokens"] == 131_072
    assert result["ingest_events_per_s"] > 0 and result["match_p50_ms"] > 0
    assert render_markdown(result).splitlines()[2].startswith(f"| 3 | {result['events']:,} |")


def test_a_held_index_reports_every_block_it_was_given_and_what_holding_them_costs():
    result = held(blocks=5_000, workers=2, chain_blocks=1_000, collections=1)
    assert result["blocks"] == 5_000 and result["lookup_blocks"] == 1_000
    # A difference of two gc.get_objects() counts: a held index adds a handful of tracked objects whatever its
    # size, and the process's own churn between the counts moves it by a few either way (-7 in a fresh-clone run,
    # -8 on a first call alone): what must hold is that 5,000 blocks are not thousands of tracked objects.
    assert abs(result["gc_tracked_objects"]) < 100 and result["ingest_blocks_per_s"] > 0
    assert render_markdown(result).splitlines()[2].startswith("| 5,000 | 2 |")
