"""The patch series: ``series`` (order) + patch files (content + header). Pure parsing.

``series`` is the only source of order: one file name per line, ``#`` comments
and blank lines ignored (quilt's format; only ``-p1`` paths are supported and
no per-line options are accepted).

Every patch starts with a header of trailer-style fields before its first
``diff``/``---`` line. Required fields (see patches/README.md)::

    Subject:          [area] one line
    Why:              the problem, in upstream's terms
    How:              the seam; where the logic lives in prfaas_sglang/
    Upstream-Status:  vendor-specific | not-yet | submitted <URL> | merged <commit>
    Upstream-Base:    sglang 0.5.15
    Removal:          when this patch can be dropped
    Tests:            tests that exercise it (paths)

Optional: ``Upstream-Marker: <file under site-packages> :: <text>``, text whose presence in a newer
SGLang says it does this itself (``rebase-check`` reports it as "upstream does it itself").
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from prfaas_sglang.errors import PatchError
from prfaas_sglang.patches.unidiff import FilePatch, parse_unified_diff

REQUIRED_FIELDS = ("Subject", "Why", "How", "Upstream-Status", "Upstream-Base", "Removal", "Tests")
UPSTREAM_STATUS_PREFIXES = ("vendor-specific", "not-yet", "submitted", "merged")
PATCH_NAME_RE = re.compile(r"^\d{4}-[a-z0-9][a-z0-9-]*\.patch$")
# Files in patches/ that are not patches.
NON_PATCH_FILES = frozenset({"series", "README.md"})

_FIELD_RE = re.compile(r"^([A-Z][A-Za-z-]*):[ \t]*(.*)$")
_BODY_START_RE = re.compile(r"^(diff --git |--- |Index: )")


@dataclass(frozen=True)
class Patch:
    """One patch of the series. ``files`` are its parsed sections."""

    name: str
    path: Path
    header: dict[str, str]
    files: tuple[FilePatch, ...]
    text: str

    @property
    def upstream_marker(self) -> tuple[str, str] | None:
        """(file, text) from the optional ``Upstream-Marker`` field; None when absent or malformed
        (``lint`` names a malformed one)."""
        file, sep, text = self.header.get("Upstream-Marker", "").partition(" :: ")
        return (file.strip(), text.strip()) if sep and file.strip() and text.strip() else None

    @property
    def subject(self) -> str:
        subject = self.header.get("Subject", "")
        return re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject)


@dataclass(frozen=True)
class Series:
    """The ordered patches of one ``patches/`` directory."""

    directory: Path
    patches: tuple[Patch, ...]

    def for_tree(self, root: Path) -> Series:
        """The patches a tree (the directory holding ``sglang/``) needs: a patch whose Upstream-Marker
        is in the tree is retired there (upstream does it itself), neither applied nor required."""
        from prfaas_sglang._compat import change_status

        return Series(self.directory, tuple(p for p in self.patches if change_status(p.upstream_marker, root=root) != "retired"))

    def retired_in(self, root: Path) -> tuple[Patch, ...]:
        """The patches :meth:`for_tree` leaves out of ``root``."""
        kept = {p.name for p in self.for_tree(root).patches}
        return tuple(p for p in self.patches if p.name not in kept)

    @property
    def digest(self) -> str:
        """8 hex chars over names and contents, in order; names the patched wheel."""
        h = hashlib.sha256()
        for patch in self.patches:
            h.update(patch.name.encode() + b"\0" + patch.text.encode() + b"\0")
        return h.hexdigest()[:8]


def parse_header(text: str) -> dict[str, str]:
    """Trailer-style ``Key: value`` fields before the diff body.

    Indented lines continue the previous field. The mail ``From <sha>`` line and
    free prose are skipped; a repeated key keeps its first value.
    """
    fields: dict[str, str] = {}
    current: str | None = None
    for line in text.splitlines():
        if _BODY_START_RE.match(line):
            break
        if current and line[:1] in (" ", "\t") and line.strip():
            fields[current] = (fields[current] + " " + line.strip()).strip()
            continue
        match = _FIELD_RE.match(line)
        if match and not line.startswith("From "):
            current = match.group(1)
            fields.setdefault(current, match.group(2).strip())
        else:
            current = None
    return fields


def read_series_names(directory: Path) -> list[str]:
    series_file = directory / "series"
    if not series_file.is_file():
        raise PatchError(f"{series_file}: not found")
    names: list[str] = []
    for lineno, raw in enumerate(series_file.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 1:
            raise PatchError(f"{series_file}:{lineno}: options are not supported ({raw.strip()!r})")
        names.append(parts[0])
    return names


def load_series(directory: Path) -> Series:
    """Read ``directory/series`` and every patch it names, in order.

    Raises :class:`PatchError` for a missing file, a duplicate entry or a diff
    that does not parse. Header completeness is :func:`lint`'s job.
    """
    names = read_series_names(directory)
    seen: set[str] = set()
    patches: list[Patch] = []
    for name in names:
        if name in seen:
            raise PatchError(f"{directory / 'series'}: {name} is listed twice")
        seen.add(name)
        path = directory / name
        if not path.is_file():
            raise PatchError(f"{directory / 'series'}: {name} is listed but {path} does not exist")
        text = path.read_text()
        patches.append(
            Patch(name, path, parse_header(text), tuple(parse_unified_diff(text, name)), text)
        )
    return Series(directory, tuple(patches))


def lint(directory: Path, repo_root: Path | None = None) -> list[str]:
    """Problems with the series as a list of one-line messages (empty: clean).

    Checks: every file in the directory is in ``series`` (or is a known
    non-patch file), every entry exists and parses, names follow
    ``NNNN-area-verb-phrase.patch``, every header has all required fields,
    ``Upstream-Status`` starts with a known value and, when ``repo_root`` is
    given, every path in ``Tests`` exists.
    """
    problems: list[str] = []
    try:
        names = read_series_names(directory)
    except PatchError as err:
        return [str(err)]
    listed = set(names)
    for entry in sorted(directory.iterdir()):
        if entry.name in NON_PATCH_FILES or entry.name.startswith("."):
            continue
        if entry.name not in listed:
            problems.append(f"{entry.name}: in {directory} but not in series")
    for name in names:
        if not PATCH_NAME_RE.match(name):
            problems.append(f"{name}: name must look like NNNN-area-verb-phrase.patch")
        path = directory / name
        if not path.is_file():
            problems.append(f"{name}: listed in series but missing")
            continue
        text = path.read_text()
        try:
            parse_unified_diff(text, name)
        except PatchError as err:
            problems.append(str(err))
        header = parse_header(text)
        for key in REQUIRED_FIELDS:
            if not header.get(key):
                problems.append(f"{name}: header field {key!r} is missing or empty")
        marker = header.get("Upstream-Marker")
        if marker is not None and Patch(name, path, header, (), text).upstream_marker is None:
            problems.append(f"{name}: Upstream-Marker must read '<file> :: <text>'")
        status = header.get("Upstream-Status", "")
        if status and not status.startswith(UPSTREAM_STATUS_PREFIXES):
            problems.append(
                f"{name}: Upstream-Status {status!r} must start with one of "
                + ", ".join(UPSTREAM_STATUS_PREFIXES)
            )
        if repo_root is not None and header.get("Tests"):
            for test_path in re.split(r"[,\s]+", header["Tests"]):
                test_file = test_path.split("::", 1)[0]
                if test_file and not (repo_root / test_file).exists():
                    problems.append(f"{name}: Tests names {test_file}, which does not exist")
    if len(names) != len(listed):
        problems.append("series lists a patch more than once")
    return problems
