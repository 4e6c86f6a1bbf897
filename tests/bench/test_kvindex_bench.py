"""``bench kvindex --page-sizes``: every row measures what it names, the emulated engine's cache included."""

from __future__ import annotations

from prfaas_sglang.bench.kvindex import by_page_size, render_markdown


def test_the_page_size_table_matches_the_held_prompt_whole_and_times_every_column():
    result = by_page_size((1, 64), prompt_tokens=1024, runs=2)
    assert [r["page_size"] for r in result["rows"]] == [1, 64]
    for row in result["rows"]:
        assert row["blocks"] == 1024 // row["page_size"] and row["matched_tokens"] == 1024
        for key in ("list_first_ms", "list_again_ms", "json_first_ms", "json_again_ms", "emulated_first_ms", "emulated_again_ms"):
            assert row[key] > 0, key
    table = render_markdown(result).splitlines()
    assert len(table) == 4 and table[0].count("|") == table[2].count("|") == 6
