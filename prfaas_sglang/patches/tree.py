"""Where patches land: an installed sglang, an unpacked wheel, a rewritten wheel (I/O).

Paths inside a patch are relative to the directory that *contains* the
``sglang`` package (``a/sglang/srt/...``), which is the same in site-packages
and in a wheel, so one series serves both.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.version import InvalidVersion, Version

from prfaas_sglang._compat import installed_sglang_root, tree_sglang_version
from prfaas_sglang.envs import envs
from prfaas_sglang.errors import PatchError, UpstreamVersionError

_REPO_ROOT = Path(__file__).resolve().parents[2]
_WHEEL_NAME_RE = re.compile(r"^sglang-([^-]+)-(.+)\.whl$")


def is_checkout() -> bool:
    """True when running from a source checkout (not an installed wheel)."""
    return (_REPO_ROOT / "pyproject.toml").is_file() and (_REPO_ROOT / "prfaas_sglang").is_dir()


def default_patches_dir() -> Path:
    """``PRFAAS_PATCHES_DIR``, else the checkout's ``patches/``, else the copy in the wheel."""
    if envs.PATCHES_DIR.get():
        return Path(envs.PATCHES_DIR.get())
    if is_checkout() and (_REPO_ROOT / "patches" / "series").is_file():
        return _REPO_ROOT / "patches"
    return Path(__file__).resolve().parents[1] / "_patches"


def default_wheel_cache() -> Path:
    if envs.WHEEL_CACHE.get():
        return Path(envs.WHEEL_CACHE.get())
    if is_checkout():
        return _REPO_ROOT / ".cache" / "wheels"
    return Path.home() / ".cache" / "prfaas-sglang" / "wheels"


class SourceTree:
    """A directory that contains the ``sglang`` package.

    ``read`` returns None for a missing file; ``write(rel, None)`` deletes.
    Files written are remembered in ``created`` when they did not exist before.
    """

    def __init__(self, root: Path, label: str):
        self.root = root
        self.label = label
        self.created: list[str] = []

    @property
    def version(self) -> str | None:
        return tree_sglang_version(self.root)

    def read(self, rel: str) -> str | None:
        path = self.root / rel
        return path.read_text() if path.is_file() else None

    def write(self, rel: str, text: str | None) -> None:
        path = self.root / rel
        if text is None:
            path.unlink(missing_ok=True)
            return
        if not path.exists():
            self.created.append(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def __repr__(self) -> str:
        return f"SourceTree({self.label})"


def installed_tree() -> SourceTree:
    root = installed_sglang_root()
    if root is None:
        raise UpstreamVersionError("sglang is not installed in this environment")
    return SourceTree(root, f"installed sglang at {root}")


def record_created_files(tree: SourceTree) -> None:
    """Add files a patch created to the installed dist-info RECORD (so pip uninstall removes them)."""
    if not tree.created:
        return
    records = sorted(tree.root.glob("sglang-*.dist-info/RECORD"))
    if not records:
        return
    with records[0].open("a") as fh:
        for rel in tree.created:
            fh.write(f"{rel},,\n")


def wheel_version(wheel: Path) -> str:
    match = _WHEEL_NAME_RE.match(wheel.name)
    if not match:
        raise PatchError(f"{wheel}: not an sglang wheel file name")
    return match.group(1)


def _run_pip(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args, "--disable-pip-version-check"],
        capture_output=True,
        text=True,
    )


def latest_sglang_version() -> str:
    """The newest sglang release on the package index (asks pip)."""
    proc = _run_pip(["index", "versions", "sglang"])
    match = re.search(r"^sglang \(([^)]+)\)", proc.stdout, re.M)
    if proc.returncode != 0 or not match:
        raise PatchError(f"cannot ask the package index for sglang's versions: {proc.stderr.strip()[-300:]}")
    return match.group(1)


def find_or_download_wheel(version: str, cache_dir: Path | None = None) -> Path:
    """The pristine ``sglang==version`` wheel, from the cache or downloaded into it."""
    cache_dir = cache_dir or default_wheel_cache()
    cache_dir.mkdir(parents=True, exist_ok=True)

    def cached() -> Path | None:
        hits = sorted(p for p in cache_dir.glob(f"sglang-{version}-*.whl") if "+" not in p.name)
        return hits[-1] if hits else None

    hit = cached()
    if hit:
        return hit
    proc = _run_pip(["download", "--no-deps", "--only-binary=:all:", "-d", str(cache_dir), f"sglang=={version}"])
    hit = cached()
    if proc.returncode != 0 or hit is None:
        raise PatchError(
            f"cannot download sglang=={version} into {cache_dir}: "
            + (proc.stderr.strip().splitlines() or ["no wheel for this Python"])[-1]
        )
    return hit


def unpack_wheel(wheel: Path, workdir: Path | None = None) -> SourceTree:
    """Unpack ``wheel`` into a fresh directory (under ``workdir`` or a temp dir)."""
    target = Path(tempfile.mkdtemp(prefix="prfaas-wheel-", dir=workdir))
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
    return SourceTree(target, f"wheel {wheel.name}")


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def write_patched_wheel(
    pristine: Path, changes: dict[str, str | None], local_label: str, out_dir: Path
) -> Path:
    """Write ``sglang-<ver>+<local_label>-<tags>.whl`` into ``out_dir``.

    ``changes`` maps a path inside the wheel to its new text (None: delete).
    The dist-info directory is renamed, METADATA's ``Version`` rewritten and
    RECORD regenerated with fresh hashes. ``sglang==<ver>`` still matches the
    result (PEP 440 ignores a local label when the specifier has none).
    """
    match = _WHEEL_NAME_RE.match(pristine.name)
    if not match:
        raise PatchError(f"{pristine}: not an sglang wheel file name")
    version, tags = match.groups()
    try:
        Version(f"{version}+{local_label}")
    except InvalidVersion as err:
        raise PatchError(f"local label {local_label!r} is not a valid PEP 440 local version") from err
    new_version = f"{version}+{local_label}"
    old_info, new_info = f"sglang-{version}.dist-info/", f"sglang-{new_version}.dist-info/"
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / f"sglang-{new_version}-{tags}.whl"

    entries: dict[str, bytes] = {}
    with zipfile.ZipFile(pristine) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            name = info.filename
            data = zf.read(info)
            if name.startswith(old_info):
                name = new_info + name[len(old_info) :]
                if name == new_info + "METADATA":
                    data = re.sub(
                        rb"^Version: .*$", f"Version: {new_version}".encode(), data, count=1, flags=re.M
                    )
            entries[name] = data
    for rel, text in changes.items():
        if text is None:
            entries.pop(rel, None)
        else:
            entries[rel] = text.encode()

    record_name = new_info + "RECORD"
    rows = io.StringIO()
    writer = csv.writer(rows, lineterminator="\n")
    for name, data in entries.items():
        if name != record_name:
            writer.writerow([name, _record_hash(data), len(data)])
    writer.writerow([record_name, "", ""])
    entries[record_name] = rows.getvalue().encode()

    tmp = out_path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    tmp.replace(out_path)
    return out_path
