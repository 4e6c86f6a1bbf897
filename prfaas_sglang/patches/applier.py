"""Evaluate and apply a whole series against a source tree.

Patches are evaluated in series order against an in-memory overlay, so patch
N sees the text patches 1..N-1 produced; nothing is written until every patch
is known to apply (all or nothing).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from prfaas_sglang.errors import PatchError
from prfaas_sglang.patches.series import Patch, Series
from prfaas_sglang.patches.tree import SourceTree
from prfaas_sglang.patches.unidiff import FileResult, FileStatus, HunkStatus, apply_file_patch


class PatchStatus(enum.Enum):
    APPLIES = "applies"
    APPLIES_WITH_OFFSET = "applies with offset"
    ALREADY_APPLIED = "already applied"
    PARTIALLY_APPLIED = "partially applied"
    FAILS = "fails"

    @property
    def ok(self) -> bool:
        return self in (PatchStatus.APPLIES, PatchStatus.APPLIES_WITH_OFFSET, PatchStatus.ALREADY_APPLIED)


@dataclass
class PatchReport:
    patch: Patch
    files: list[FileResult]
    status: PatchStatus

    def failure_lines(self) -> list[str]:
        """One line per failing file/hunk: ``<patch>: <file>: hunk N (@@ ... @@): <detail>``."""
        lines = []
        for fr in self.files:
            if fr.status is not FileStatus.FAILS:
                continue
            if not fr.failed_hunks:
                lines.append(f"{self.patch.name}: {fr.path}: {fr.detail}")
            for hr in fr.failed_hunks:
                lines.append(
                    f"{self.patch.name}: {fr.path}: hunk {hr.hunk.index} ({hr.hunk.header}) "
                    f"does not apply: {hr.detail}"
                )
        if self.status is PatchStatus.PARTIALLY_APPLIED:
            lines.append(f"{self.patch.name}: some files are already patched and others are not")
        return lines

    def offsets(self) -> list[str]:
        return [
            f"{fr.path} hunk {hr.hunk.index} at {hr.offset_lines:+d} lines"
            for fr in self.files
            for hr in fr.hunks
            if hr.status is HunkStatus.OFFSET
        ]


@dataclass
class SeriesReport:
    """Outcome for a whole series on one tree. ``changes`` is valid only when ``ok``."""

    target: str
    version: str | None
    patches: list[PatchReport]
    changes: dict[str, str | None] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(p.status.ok for p in self.patches)

    @property
    def fully_applied(self) -> bool:
        return all(p.status is PatchStatus.ALREADY_APPLIED for p in self.patches)


def _patch_status(files: list[FileResult]) -> PatchStatus:
    statuses = {fr.status for fr in files}
    if FileStatus.FAILS in statuses:
        return PatchStatus.FAILS
    if statuses == {FileStatus.ALREADY_APPLIED}:
        return PatchStatus.ALREADY_APPLIED
    if FileStatus.ALREADY_APPLIED in statuses:
        return PatchStatus.PARTIALLY_APPLIED
    if FileStatus.APPLIES_WITH_OFFSET in statuses:
        return PatchStatus.APPLIES_WITH_OFFSET
    return PatchStatus.APPLIES


_MISSING = object()


def evaluate(series: Series, read: Callable[[str], str | None], target: str, version: str | None) -> SeriesReport:
    """Dry-run the series over ``read`` (path -> text or None). Pure apart from ``read``."""
    overlay: dict[str, str | None] = {}
    reports: list[PatchReport] = []
    for patch in series.patches:
        results: list[FileResult] = []
        pending: dict[str, str | None] = {}
        for fp in patch.files:
            current = overlay.get(fp.path, _MISSING)
            text = read(fp.path) if current is _MISSING else current
            if fp.old_path and fp.new_path and fp.old_path != fp.new_path:
                result = FileResult(fp.path, FileStatus.FAILS, detail="renames are not supported")
            else:
                result = apply_file_patch(fp, text)
            results.append(result)
            if result.status in (FileStatus.APPLIES, FileStatus.APPLIES_WITH_OFFSET):
                pending[fp.path] = result.new_text
        status = _patch_status(results)
        if status in (PatchStatus.APPLIES, PatchStatus.APPLIES_WITH_OFFSET):
            overlay.update(pending)
        reports.append(PatchReport(patch, results, status))
    return SeriesReport(target, version, reports, overlay)


def evaluate_tree(series: Series, tree: SourceTree) -> SeriesReport:
    return evaluate(series, tree.read, tree.label, tree.version)


def apply_to_tree(series: Series, tree: SourceTree) -> SeriesReport:
    """Apply every not-yet-applied patch to ``tree``; idempotent.

    Raises :class:`PatchError` naming each failing patch and hunk, before
    anything is written.
    """
    report = evaluate_tree(series, tree)
    if not report.ok:
        raise PatchError(failure_message(report))
    for rel, text in report.changes.items():
        tree.write(rel, text)
    return report


def failure_message(report: SeriesReport) -> str:
    lines = [line for p in report.patches for line in p.failure_lines()]
    return f"patch series does not apply to {report.target}:\n  " + "\n  ".join(lines)
