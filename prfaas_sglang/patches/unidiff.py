"""Unified diffs: parse them and apply them to text, hunk by hunk (pure).

No I/O and no fuzz: a hunk applies only where all of its context and removed
lines match exactly, at the line its header names or at the nearest offset.
That strictness is the point: a seam patch that lands on different code must
fail loudly, not be bent into place.

Positions in this module are 0-based indices into the *original* file's lines
unless a name says otherwise; hunk headers are 1-based, as in the diff text::

    @@ -old_start,old_len +new_start,new_len @@
          |                                    old lines [old_start-1, old_start-1+old_len)
          +-- 1-based; for old_len == 0 it is the line *after which* to insert
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from prfaas_sglang.errors import PatchError

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)$")
_NO_NEWLINE = "\\ No newline at end of file"


@dataclass(frozen=True)
class Hunk:
    """One ``@@`` block. ``lines`` holds ``(tag, text)``; tag is ``' '``, ``'-'`` or ``'+'``
    and text keeps its newline (absent only at a file end without one)."""

    index: int  # 1-based within its file
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    header: str
    lines: tuple[tuple[str, str], ...]

    @property
    def old_lines(self) -> list[str]:
        return [text for tag, text in self.lines if tag in " -"]

    @property
    def new_lines(self) -> list[str]:
        return [text for tag, text in self.lines if tag in " +"]

    @property
    def old_index(self) -> int:
        """0-based index of the first old line (where an insertion goes when old_len == 0)."""
        return self.old_start if self.old_len == 0 else self.old_start - 1

    def reversed(self) -> Hunk:
        flip = {" ": " ", "-": "+", "+": "-"}
        return Hunk(
            self.index,
            self.new_start,
            self.new_len,
            self.old_start,
            self.old_len,
            self.header,
            tuple((flip[tag], text) for tag, text in self.lines),
        )


@dataclass(frozen=True)
class FilePatch:
    """The hunks for one file. ``old_path`` is None for a new file, ``new_path`` for a deletion."""

    old_path: str | None
    new_path: str | None
    hunks: tuple[Hunk, ...]

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""

    def reversed(self) -> FilePatch:
        return FilePatch(self.new_path, self.old_path, tuple(h.reversed() for h in self.hunks))


class HunkStatus(enum.Enum):
    EXACT = "exact"
    OFFSET = "offset"
    FAILED = "failed"


@dataclass(frozen=True)
class HunkResult:
    hunk: Hunk
    status: HunkStatus
    offset_lines: int | None = None  # where it matched, relative to its header (None if failed)
    detail: str | None = None


class FileStatus(enum.Enum):
    APPLIES = "applies"
    APPLIES_WITH_OFFSET = "applies with offset"
    ALREADY_APPLIED = "already applied"
    FAILS = "fails"


@dataclass
class FileResult:
    """Outcome of applying one :class:`FilePatch` to one text.

    ``new_text`` is the patched content (None for a deletion or a failure) and is
    valid only when ``status`` is APPLIES or APPLIES_WITH_OFFSET. For
    ALREADY_APPLIED the caller keeps the text it has.
    """

    path: str
    status: FileStatus
    hunks: list[HunkResult] = field(default_factory=list)
    new_text: str | None = None
    detail: str | None = None

    @property
    def failed_hunks(self) -> list[HunkResult]:
        return [h for h in self.hunks if h.status is HunkStatus.FAILED]


def _strip_prefix(path: str) -> str | None:
    path = path.split("\t", 1)[0].strip()
    if path == "/dev/null":
        return None
    if path.startswith(("a/", "b/")):
        return path[2:]
    return path


def parse_unified_diff(text: str, source: str = "<patch>") -> list[FilePatch]:
    """Parse every ``--- / +++ / @@`` section of ``text``.

    Anything before the first ``--- `` line (mail headers, the patch's
    description, ``diff --git`` lines, a diffstat) is ignored here; see
    ``series.parse_header``. Raises :class:`PatchError` naming ``source`` and the
    line number when a section is malformed or a hunk's line counts disagree
    with its header.
    """
    lines = text.splitlines(keepends=True)
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not (line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            i += 1
            continue
        old_path = _strip_prefix(line[4:])
        new_path = _strip_prefix(lines[i + 1][4:])
        i += 2
        hunks: list[Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            hunk, i = _parse_hunk(lines, i, len(hunks) + 1, source)
            hunks.append(hunk)
        if not hunks:
            raise PatchError(f"{source}:{i}: file section for {new_path or old_path} has no hunks")
        files.append(FilePatch(old_path, new_path, tuple(hunks)))
    if not files:
        raise PatchError(f"{source}: no file sections (--- / +++ / @@) found")
    return files


def _parse_hunk(lines: list[str], i: int, index: int, source: str) -> tuple[Hunk, int]:
    header = lines[i].rstrip("\n")
    match = _HUNK_RE.match(header)
    if not match:
        raise PatchError(f"{source}:{i + 1}: malformed hunk header {header!r}")
    old_start, old_len, new_start, new_len = (
        int(match.group(1)),
        int(match.group(2) if match.group(2) is not None else 1),
        int(match.group(3)),
        int(match.group(4) if match.group(4) is not None else 1),
    )
    body: list[tuple[str, str]] = []
    old_seen = new_seen = 0
    i += 1
    while i < len(lines) and (old_seen < old_len or new_seen < new_len):
        raw = lines[i]
        if raw.rstrip("\n") == _NO_NEWLINE:
            if body:
                tag, text = body[-1]
                body[-1] = (tag, text.rstrip("\n"))
            i += 1
            continue
        tag = raw[:1] if raw[:1] in (" ", "-", "+") else (" " if raw in ("\n", "") else None)
        if tag is None:
            raise PatchError(f"{source}:{i + 1}: unexpected line in hunk {index}: {raw.rstrip()!r}")
        text = raw[1:] if raw[:1] in (" ", "-", "+") else raw
        body.append((tag, text))
        old_seen += tag in " -"
        new_seen += tag in " +"
        i += 1
    if i < len(lines) and lines[i].rstrip("\n") == _NO_NEWLINE and body:
        tag, text = body[-1]
        body[-1] = (tag, text.rstrip("\n"))
        i += 1
    if old_seen != old_len or new_seen != new_len:
        raise PatchError(
            f"{source}: hunk {index} ({header}) has {old_seen} old / {new_seen} new lines, "
            f"header says {old_len} / {new_len}"
        )
    return Hunk(index, old_start, old_len, new_start, new_len, header, tuple(body)), i


def _find(haystack: list[str], needle: list[str], expected: int, lowest: int) -> int | None:
    """Index >= lowest where ``needle`` matches, nearest to ``expected`` first."""
    last = len(haystack) - len(needle)
    if last < lowest:
        return None
    expected = min(max(expected, lowest), last)
    for delta in range(0, max(expected - lowest, last - expected) + 1):
        for pos in (expected - delta, expected + delta) if delta else (expected,):
            if lowest <= pos <= last and haystack[pos : pos + len(needle)] == needle:
                return pos
    return None


def _mismatch_detail(lines: list[str], hunk: Hunk, pos: int) -> str:
    """Say which line of ``hunk`` differs at ``pos`` (for error messages)."""
    for k, want in enumerate(hunk.old_lines):
        have = lines[pos + k] if 0 <= pos + k < len(lines) else None
        if have != want:
            shown = "end of file" if have is None else repr(have.rstrip("\n"))
            return f"line {pos + k + 1}: expected {want.rstrip(chr(10))!r}, found {shown}"
    return "context not found"


def _apply_hunks(lines: list[str], hunks: tuple[Hunk, ...]) -> tuple[list[HunkResult], list[str] | None]:
    results: list[HunkResult] = []
    out: list[str] = []
    cursor = 0
    carried_offset = 0
    failed = False
    for hunk in hunks:
        expected = hunk.old_index + carried_offset
        pos = _find(lines, hunk.old_lines, expected, cursor)
        if pos is None:
            failed = True
            results.append(
                HunkResult(hunk, HunkStatus.FAILED, None, _mismatch_detail(lines, hunk, hunk.old_index))
            )
            continue
        offset = pos - hunk.old_index
        carried_offset = offset
        status = HunkStatus.EXACT if offset == 0 else HunkStatus.OFFSET
        results.append(HunkResult(hunk, status, offset))
        out.extend(lines[cursor:pos])
        out.extend(hunk.new_lines)
        cursor = pos + len(hunk.old_lines)
    if failed:
        return results, None
    out.extend(lines[cursor:])
    return results, out


def apply_file_patch(fp: FilePatch, old_text: str | None) -> FileResult:
    """Apply ``fp`` to ``old_text`` (None: the file does not exist). Pure."""
    if fp.old_path is None:  # creates a file
        new_text = "".join(fp.hunks[0].new_lines) if len(fp.hunks) == 1 else None
        if new_text is None:
            return FileResult(fp.path, FileStatus.FAILS, detail="a new-file section must have one hunk")
        if old_text is None:
            return FileResult(fp.path, FileStatus.APPLIES, new_text=new_text)
        if old_text == new_text:
            return FileResult(fp.path, FileStatus.ALREADY_APPLIED)
        return FileResult(fp.path, FileStatus.FAILS, detail="file to be created already exists")
    if old_text is None:
        if fp.new_path is None:
            return FileResult(fp.path, FileStatus.ALREADY_APPLIED)
        return FileResult(fp.path, FileStatus.FAILS, detail="file not found")

    lines = old_text.splitlines(keepends=True)
    results, out = _apply_hunks(lines, fp.hunks)
    if out is not None:
        status = (
            FileStatus.APPLIES
            if all(r.status is HunkStatus.EXACT for r in results)
            else FileStatus.APPLIES_WITH_OFFSET
        )
        new_text = None if fp.new_path is None else "".join(out)
        return FileResult(fp.path, status, results, new_text)
    # Forward failed: is it already there? (Reverse applies cleanly.)
    _, back = _apply_hunks(lines, fp.reversed().hunks)
    if back is not None:
        return FileResult(fp.path, FileStatus.ALREADY_APPLIED, results)
    return FileResult(fp.path, FileStatus.FAILS, results)
