"""Unified-diff parsing and strict application (prfaas_sglang.patches.unidiff)."""

from __future__ import annotations

import difflib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas_sglang.errors import PatchError
from prfaas_sglang.patches.unidiff import (
    FileStatus,
    HunkStatus,
    apply_file_patch,
    parse_unified_diff,
)


def make_diff(old: str, new: str, path: str = "sglang/x.py", n: int = 3) -> str:
    return "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}", n=n)
    )


OLD = "".join(f"line {i}\n" for i in range(1, 41))
NEW = OLD.replace("line 5\n", "line 5\ninserted A\n").replace("line 30\n", "line 30 changed\n")


class TestApply:
    def test_exact(self):
        (fp,) = parse_unified_diff(make_diff(OLD, NEW))
        result = apply_file_patch(fp, OLD)
        assert result.status is FileStatus.APPLIES
        assert result.new_text == NEW
        assert [h.status for h in result.hunks] == [HunkStatus.EXACT, HunkStatus.EXACT]

    def test_offset_is_found_and_reported(self):
        """Upstream inserted 7 lines above the hunks: they still apply, with the offset named."""
        shifted = "".join(f"new top {i}\n" for i in range(7)) + OLD
        (fp,) = parse_unified_diff(make_diff(OLD, NEW))
        result = apply_file_patch(fp, shifted)
        assert result.status is FileStatus.APPLIES_WITH_OFFSET
        assert [h.offset_lines for h in result.hunks] == [7, 7]
        assert result.new_text == "".join(f"new top {i}\n" for i in range(7)) + NEW

    def test_changed_context_fails_naming_hunk_and_line(self):
        drifted = OLD.replace("line 29\n", "line 29 rewritten upstream\n")
        (fp,) = parse_unified_diff(make_diff(OLD, NEW))
        result = apply_file_patch(fp, drifted)
        assert result.status is FileStatus.FAILS
        (failed,) = result.failed_hunks
        assert failed.hunk.index == 2
        assert "line 29" in failed.detail and "rewritten upstream" in failed.detail

    def test_already_applied_is_detected(self):
        (fp,) = parse_unified_diff(make_diff(OLD, NEW))
        assert apply_file_patch(fp, NEW).status is FileStatus.ALREADY_APPLIED

    def test_new_file(self):
        (fp,) = parse_unified_diff("--- /dev/null\n+++ b/sglang/new.py\n@@ -0,0 +1,2 @@\n+a\n+b\n")
        assert fp.old_path is None and fp.path == "sglang/new.py"
        assert apply_file_patch(fp, None).new_text == "a\nb\n"
        assert apply_file_patch(fp, "a\nb\n").status is FileStatus.ALREADY_APPLIED
        assert apply_file_patch(fp, "other\n").status is FileStatus.FAILS

    def test_deleted_file(self):
        (fp,) = parse_unified_diff("--- a/sglang/old.py\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-a\n-b\n")
        result = apply_file_patch(fp, "a\nb\n")
        assert result.status is FileStatus.APPLIES and result.new_text is None
        assert apply_file_patch(fp, None).status is FileStatus.ALREADY_APPLIED

    def test_missing_target_file_fails(self):
        (fp,) = parse_unified_diff(make_diff(OLD, NEW))
        assert apply_file_patch(fp, None).status is FileStatus.FAILS

    def test_no_newline_at_end_of_file(self):
        old, new = "a\nb", "a\nc"
        diff = (
            "--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n a\n-b\n"
            "\\ No newline at end of file\n+c\n\\ No newline at end of file\n"
        )
        (fp,) = parse_unified_diff(diff)
        assert apply_file_patch(fp, old).new_text == new

    def test_hunks_do_not_match_before_previous_hunk(self):
        """A repeated block must not be matched above the previous hunk's end."""
        old = "x\ny\nz\n" * 3
        new = "x\ny\nZ\n" + "x\ny\nz\n" + "x\ny\nZ\n"
        (fp,) = parse_unified_diff(make_diff(old, new, n=1))
        assert apply_file_patch(fp, old).new_text == new


class TestParse:
    def test_header_lines_are_ignored(self):
        text = "Subject: x\nWhy: y\n\n" + make_diff(OLD, NEW)
        assert len(parse_unified_diff(text)) == 1

    @pytest.mark.parametrize(
        "body, message",
        [
            ("no diff here\n", "no file sections"),
            ("--- a/f\n+++ b/f\n@@ bogus @@\n", "malformed hunk header"),
            ("--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n a\n-b\n+c\n", "header says 3 / 3"),
            ("--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n a\n?b\n", "unexpected line"),
            ("--- a/f\n+++ b/f\n", "has no hunks"),
        ],
    )
    def test_malformed_patches_raise_with_source(self, body, message):
        with pytest.raises(PatchError, match=message) as err:
            parse_unified_diff(body, "0009-x.patch")
        assert "0009-x.patch" in str(err.value)


lines = st.lists(st.sampled_from(["a\n", "b\n", "c\n", "d\n", "def f():\n", "    pass\n"]), max_size=30)


@settings(max_examples=300, deadline=None)
@given(old=lines, new=lines, context=st.integers(min_value=0, max_value=3))
def test_any_difflib_diff_applies_and_reverses(old, new, context):
    """Oracle: whatever difflib writes, we apply to exactly its target, and see it as applied there."""
    old_text, new_text = "".join(old), "".join(new)
    if old_text == new_text:
        return
    (fp,) = parse_unified_diff(make_diff(old_text, new_text, n=context))
    forward = apply_file_patch(fp, old_text)
    assert forward.status in (FileStatus.APPLIES, FileStatus.APPLIES_WITH_OFFSET)
    assert forward.new_text == new_text
    backward = apply_file_patch(fp.reversed(), new_text)
    assert backward.new_text == old_text
