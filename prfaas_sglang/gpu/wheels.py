"""Wheels for another interpreter, from PyPI or a local wheelhouse, read member by member.

A wheel on PyPI is opened in place: HTTP range requests read its zip directory and then only the
members the bundle keeps, so sglang-kernel's 615 MB wheel costs the ~20 MB an H100 loads.
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.gpu.bundle import BundleError, dropped

INDEX_URL = "https://pypi.org/simple"
HTTP_TIMEOUT_S = 120.0


def supported_tags(python_version: str, platforms: Iterable[str]) -> list[Tag]:
    """The tags a CPython ``python_version`` on ``platforms`` accepts, most preferred first."""
    major, minor = (int(part) for part in python_version.split(".")[:2])
    platforms = list(platforms)
    tags = list(cpython_tags((major, minor), abis=[f"cp{major}{minor}", "abi3", "none"], platforms=platforms))
    tags += list(compatible_tags((major, minor), interpreter=f"cp{major}{minor}", platforms=platforms))
    return tags


def pick_wheel(filenames: Iterable[str], name: str, version: str, tags: list[Tag]) -> str | None:
    """The file among ``filenames`` that is a wheel of ``name`` ``version`` for the most preferred
    of ``tags``; None when none is."""
    rank = {tag: i for i, tag in enumerate(tags)}
    want_name, want_version = canonicalize_name(name), Version(version)
    best: tuple[int, str] | None = None
    for filename in filenames:
        if not filename.endswith(".whl"):
            continue
        try:
            wheel_name, wheel_version, _build, wheel_tags = parse_wheel_filename(filename)
        except ValueError:
            continue
        if wheel_name != want_name or wheel_version != want_version:
            continue
        score = min((rank[tag] for tag in wheel_tags if tag in rank), default=None)
        if score is not None and (best is None or score < best[0]):
            best = (score, filename)
    return best[1] if best else None


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over HTTP range requests, read in blocks (cached)."""

    def __init__(self, url: str, size_bytes: int, block_bytes: int = 1 << 20):
        super().__init__()
        self.url, self.size_bytes, self.block_bytes = url, size_bytes, block_bytes
        self.pos = 0
        self._blocks: dict[int, bytes] = {}
        self.fetched_bytes = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size_bytes}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def _block(self, index: int) -> bytes:
        block = self._blocks.get(index)
        if block is None:
            start = index * self.block_bytes
            end = min(self.size_bytes, start + self.block_bytes) - 1
            # identity: the bytes at these offsets of the file itself, not of a compressed encoding
            answer = http_sync.get(self.url, timeout_s=HTTP_TIMEOUT_S,
                                   headers={"Range": f"bytes={start}-{end}", "Accept-Encoding": "identity"})
            if answer.raise_for_status().status != 206:
                raise BundleError(f"{self.url}: the server ignored a range request (HTTP {answer.status})")
            block = answer.body
            self.fetched_bytes += len(block)
            if len(self._blocks) > 64:  # members are read front to back: old blocks are not read again
                self._blocks.clear()
            self._blocks[index] = block
        return block

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view) and self.pos < self.size_bytes:
            index, offset = divmod(self.pos, self.block_bytes)
            chunk = self._block(index)[offset: offset + len(view) - done]
            view[done: done + len(chunk)] = chunk
            done += len(chunk)
            self.pos += len(chunk)
        return done


@dataclass(frozen=True)
class WheelFile:
    filename: str
    location: str  # a URL or a local path
    size_bytes: int


class WheelSource:
    """Where wheels come from: a local directory (``wheelhouse``) first, then the package index."""

    def __init__(self, wheelhouse: Path | None = None, index_url: str = INDEX_URL):
        self.wheelhouse = wheelhouse
        self.index_url = index_url.rstrip("/")

    def files(self, name: str) -> list[WheelFile]:
        if self.wheelhouse is not None:
            local = [WheelFile(p.name, str(p), p.stat().st_size) for p in sorted(self.wheelhouse.glob("*.whl"))]
            if any(canonicalize_name(parse_wheel_filename(f.filename)[0]) == canonicalize_name(name) for f in local):
                return local
        url = f"{self.index_url}/{canonicalize_name(name)}/"
        try:
            page = http_sync.get_json(url, timeout_s=HTTP_TIMEOUT_S, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        except http_sync.HttpError as err:
            raise BundleError(f"cannot list {name} on {self.index_url}: {err}") from None
        return [WheelFile(f["filename"], f["url"], int(f.get("size") or 0)) for f in page.get("files", ())
                if f["filename"].endswith(".whl")]

    def find(self, name: str, version: str, tags: list[Tag]) -> WheelFile:
        files = self.files(name)
        chosen = pick_wheel((f.filename for f in files), name, version, tags)
        if chosen is None:
            raise BundleError(f"no wheel of {name}=={version} for {tags[0]} on {self.wheelhouse or self.index_url}")
        return next(f for f in files if f.filename == chosen)

    def open(self, wheel: WheelFile) -> tuple[zipfile.ZipFile, RangeFile | None]:
        if os.path.exists(wheel.location):
            return zipfile.ZipFile(wheel.location), None
        raw = RangeFile(wheel.location, wheel.size_bytes)
        return zipfile.ZipFile(io.BufferedReader(raw, buffer_size=1 << 16)), raw


@dataclass
class Extracted:
    wheel: WheelFile
    kept_files: int = 0
    kept_bytes: int = 0
    dropped_files: int = 0
    dropped_bytes: int = 0
    fetched_bytes: int = 0


def extract(source: WheelSource, wheel: WheelFile, dist: str, dest: Path, drop: bool = True) -> Extracted:
    """Unpack ``wheel`` into ``dest`` (a site directory), less the members :func:`bundle.dropped`
    names for ``dist`` when ``drop``. ``*.data/purelib|platlib`` members go to the site root."""
    out = Extracted(wheel)
    archive, raw = source.open(wheel)
    with archive:
        for info in archive.infolist():
            if info.is_dir():
                continue
            member = info.filename
            parts = member.split("/")
            if len(parts) > 2 and parts[0].endswith(".data") and parts[1] in ("purelib", "platlib"):
                member = "/".join(parts[2:])
            elif len(parts) > 1 and parts[0].endswith(".data"):
                continue  # scripts and headers: not imported
            if drop and dropped(dist, member):
                out.dropped_files += 1
                out.dropped_bytes += info.file_size
                continue
            target = dest / member
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as src, open(target, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(target, mode | 0o600)
            out.kept_files += 1
            out.kept_bytes += info.file_size
    out.fetched_bytes = raw.fetched_bytes if raw is not None else wheel.size_bytes
    return out
