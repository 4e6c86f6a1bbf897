"""The only place that looks at SGLang's version, and at what the installed SGLang does itself.

Nothing here imports sglang: the installed version comes from package
metadata, a tree's version from ``sglang/_version.py``, a marker (a text in a
file of the tree: :func:`installed_has`) from the installed files. Where a hook,
a backend or a patch differs between supported releases, the difference is
decided by such a marker ("upstream does it itself"), never by comparing versions.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from packaging.version import InvalidVersion, Version

from prfaas_sglang._pin import PINNED_SGLANG_VERSION, SUPPORTED_SGLANG_VERSIONS
from prfaas_sglang.envs import envs
from prfaas_sglang.errors import UpstreamVersionError

_VERSION_RE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)


def installed_sglang_version() -> str | None:
    """Version of the installed ``sglang`` distribution, or None if absent.

    A patched wheel reports ``0.5.15+prfaas.<hash>``; see :func:`base_version`.
    """
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_sglang_root() -> Path | None:
    """The directory that holds the installed ``sglang`` package (site-packages)."""
    try:
        dist = importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None
    root = Path(dist.locate_file(""))
    return root if (root / "sglang").is_dir() else None


def tree_sglang_version(root: Path) -> str | None:
    """Version recorded in ``<root>/sglang/_version.py`` (None if not found)."""
    version_file = root / "sglang" / "_version.py"
    if not version_file.is_file():
        return None
    match = _VERSION_RE.search(version_file.read_text())
    return match.group(1) if match else None


def base_version(version: str) -> str:
    """``0.5.15+prfaas.ab12`` -> ``0.5.15``; invalid strings come back unchanged."""
    try:
        return Version(version).base_version
    except InvalidVersion:
        return version


# What of SGLang's own layout decides which of our adapters applies (markers, never versions): SGLang
# 0.5.15 has a radix cache class per model kind, which our state-reporting caches subclass
# (hooks/hybrid_cache.py); 0.5.23 has one unified tree, with components (hooks/unified_cache.py).
RADIX_TREES = ("sglang/srt/mem_cache/mamba_radix_cache.py", "class MambaRadixCache(")
UNIFIED_TREE = ("sglang/srt/mem_cache/unified_cache/components/mamba.py", "class MambaComponent(")
# SGLang 0.5.23 writes each KV event as a tagged msgpack map (0.5.15: an array); the emulated engine's
# publisher writes them as the installed SGLang does (``wire.kv_events.encode_batch``).
KV_EVENT_MAPS = ("sglang/srt/disaggregation/kv_events.py", "Events are tagged msgpack maps")
# SGLang 0.5.23's CPU engine imports kernels of sgl_kernel's CPU build as its modules load; 0.5.15's does not.
CPU_ENGINE_IMPORTS_SGL_KERNEL = ("sglang/kernels/ops/kvcache/cache_move.py", "from sgl_kernel import copy_all_layer_kv_cache_cpu")
# SGLang 0.5.23 backs a decode server's retracted requests with a pinned host pool by default
# (cudaHostRegister: no CUDA, no start); ``--disaggregation-decode-retraction-backup cpu_tensor`` is its other way.
DECODE_RETRACTION_BACKUP = ("sglang/srt/mem_cache/kv_cache_builder.py", 'fields["disaggregation_decode_retraction_backup"]')
# SGLang 0.5.23's prefill, under its overlap scheduler, records a CUDA event before an early send of a
# cached prefix (torch.cuda.Event().record(forward_stream)): on its CPU engine that raises.
OVERLAP_EARLY_SEND_CUDA_EVENT = ("sglang/srt/disaggregation/prefill.py", "ev.record(self.forward_stream)")
# SGLang 0.5.23 serves /pd_role_switch (``--enable-pd-role-switch``): a PD worker turns into the other role in place.
PD_ROLE_SWITCH = ("sglang/srt/disaggregation/role_switch.py", "def handle_pd_role_switch(")


def installed_has(marker: tuple[str, str] | None, root: Path | None = None) -> bool:
    """Whether ``marker`` (a file under the tree, a text) is in the installed SGLang (``root``: another
    tree's directory holding ``sglang/``); False for None or where nothing is installed."""
    if marker is None:
        return False
    root = root or installed_sglang_root()
    if root is None:
        return False
    path = root / marker[0]
    return path.is_file() and marker[1] in path.read_text(errors="replace")


def release_root(version: str) -> Path | None:
    """The directory holding ``sglang/`` of supported release ``version`` here: the installed one, or its
    overlay beside the environment (``make env`` builds ``<venv>/sglang-<version>``); None where neither is."""
    import sys

    installed = installed_sglang_version()
    if installed is not None and base_version(installed) == version:
        return installed_sglang_root()
    overlay = Path(sys.prefix) / f"sglang-{version}"
    return overlay if tree_sglang_version(overlay) == version or (overlay / "sglang").is_dir() else None


def require_supported(found: str | None, where: str) -> None:
    """Raise :class:`UpstreamVersionError` unless ``found`` is a supported release
    (:data:`~prfaas_sglang._pin.SUPPORTED_SGLANG_VERSIONS`); ``PRFAAS_ALLOW_SGLANG_VERSION`` names one
    more that is accepted (rebase trials)."""
    if found is None:
        raise UpstreamVersionError(f"sglang is not installed ({where}); supported: "
                                   + ", ".join(f"sglang=={v}" for v in SUPPORTED_SGLANG_VERSIONS))
    allowed = set(SUPPORTED_SGLANG_VERSIONS)
    if envs.ALLOW_SGLANG_VERSION.get():
        allowed.add(base_version(envs.ALLOW_SGLANG_VERSION.get()))
    if base_version(found) not in allowed:
        raise UpstreamVersionError(
            f"{where} has sglang {found}, but this prfaas-sglang supports sglang "
            f"{', '.join(SUPPORTED_SGLANG_VERSIONS)} (set PRFAAS_ALLOW_SGLANG_VERSION={base_version(found)} to try it anyway)"
        )


def require_pinned(found: str | None, where: str, expected: str = PINNED_SGLANG_VERSION) -> None:
    """Raise :class:`UpstreamVersionError` unless ``found`` is the pinned release.

    ``PRFAAS_ALLOW_SGLANG_VERSION`` names one other version that is accepted
    (used by rebase trials).
    """
    if found is None:
        raise UpstreamVersionError(f"sglang is not installed ({where}); expected sglang=={expected}")
    allowed = {expected}
    if envs.ALLOW_SGLANG_VERSION.get():
        allowed.add(base_version(envs.ALLOW_SGLANG_VERSION.get()))
    if base_version(found) not in allowed:
        raise UpstreamVersionError(
            f"{where} has sglang {found}, but this prfaas-sglang is pinned to sglang=={expected} "
            f"(set PRFAAS_ALLOW_SGLANG_VERSION={base_version(found)} to try it anyway)"
        )
