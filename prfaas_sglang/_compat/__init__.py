"""The upstream adapter: the only place that decides anything by SGLang release (any side: router,
launcher, worker; reads files only).

Nothing here imports sglang: the installed version comes from package metadata, a tree's version
from ``sglang/_version.py``, and what a release does from its *markers* (:class:`Marker`: a text in a
file of the tree), read once per tree (:func:`tree_markers`). Where a hook, a backend, a patch or an
accessor differs between supported releases, the difference is decided by a named marker here
("upstream does it itself"), never by comparing versions; the one version comparison,
:func:`tools_as_sent`, is keyed on the release a *remote* worker reports, which no installed tree can tell.

The package:

* this module: versions, every marker, and the decisions made from them (:func:`change_status` for
  the hooks, backends and patches; :func:`tree_kind`; :func:`serves_pd_role_switch`, ...);
* :mod:`prfaas_sglang._compat.accessors`: what reads or writes SGLang's own objects differently per
  release (server-args resolution, a request's chunk end and pool row, the event publisher's endpoints,
  the decode allocator's staged pages, the cache-move functions of the installed tree);
* :mod:`prfaas_sglang._compat.release_tests`: the tests that differ by release, which the second
  release's leg runs.

Every marker and every decision or accessor names the tests that run the code paths it decides
(``Marker.tests``, :func:`exercised_by`); ``tests/unit/test_upstream_adapter.py`` checks that they do, and
fails on a release decision anywhere else in the package (``installed_has``, a marker tuple, an
ImportError probe, a ``hasattr`` that tells releases apart, a version comparison).
"""

from __future__ import annotations

import enum
import functools
import importlib.metadata
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from packaging.version import InvalidVersion, Version

from prfaas_sglang._pin import PINNED_SGLANG_VERSION, SUPPORTED_SGLANG_VERSIONS
from prfaas_sglang.envs import envs
from prfaas_sglang.errors import UpstreamVersionError

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): a pure package;
# these modules of it do I/O (they read SGLang's objects, or the hook specs that import it).
IO_MODULES = ("accessors", "release_tests")

_VERSION_RE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)
_F = TypeVar("_F", bound=Callable[..., Any])


def exercised_by(tests: str) -> Callable[[_F], _F]:
    """Mark a release-dependent function of the adapter with the tests that run the code paths it decides
    (space-separated paths relative to the repository, ``path::name`` allowed), as ``fn.tests``;
    :func:`~prfaas_sglang._compat.release_tests.release_dependent_tests` collects them."""

    def mark(fn: _F) -> _F:
        fn.tests = tests  # type: ignore[attr-defined]
        return fn

    return mark


# --- versions --------------------------------------------------------------------------------------


def installed_sglang_version() -> str | None:
    """Version of the installed ``sglang`` distribution, or None if absent.

    A patched wheel reports ``0.5.15+prfaas.<hash>``; see :func:`base_version`.
    """
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def installed_sglang_root() -> Path | None:
    """The directory that holds the installed ``sglang`` package (site-packages); looked up once per process."""
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


def release_root(version: str) -> Path | None:
    """The directory holding ``sglang/`` of supported release ``version`` here: the installed one, or its
    overlay beside the environment (``make env`` builds ``<venv>/sglang-<version>``); None where neither is."""
    installed = installed_sglang_version()
    if installed is not None and base_version(installed) == version:
        return installed_sglang_root()
    overlay = Path(sys.prefix) / f"sglang-{version}"
    return overlay if tree_sglang_version(overlay) == version or (overlay / "sglang").is_dir() else None


def _allowed_versions(expected: tuple[str, ...]) -> set[str]:
    allowed = set(expected)
    if envs.ALLOW_SGLANG_VERSION.get():
        allowed.add(base_version(envs.ALLOW_SGLANG_VERSION.get()))
    return allowed


@exercised_by("tests/unit/test_plugin.py")
def require_supported(found: str | None, where: str) -> None:
    """Raise :class:`UpstreamVersionError` unless ``found`` is a supported release
    (:data:`~prfaas_sglang._pin.SUPPORTED_SGLANG_VERSIONS`); ``PRFAAS_ALLOW_SGLANG_VERSION`` names one
    more that is accepted (rebase trials)."""
    if found is None:
        raise UpstreamVersionError(f"sglang is not installed ({where}); supported: "
                                   + ", ".join(f"sglang=={v}" for v in SUPPORTED_SGLANG_VERSIONS))
    if base_version(found) not in _allowed_versions(SUPPORTED_SGLANG_VERSIONS):
        raise UpstreamVersionError(
            f"{where} has sglang {found}, but this prfaas-sglang supports sglang "
            f"{', '.join(SUPPORTED_SGLANG_VERSIONS)} (set PRFAAS_ALLOW_SGLANG_VERSION={base_version(found)} to try it anyway)"
        )


@exercised_by("tests/unit/test_plugin.py")
def require_pinned(found: str | None, where: str, expected: str = PINNED_SGLANG_VERSION) -> None:
    """Raise :class:`UpstreamVersionError` unless ``found`` is the pinned release.

    ``PRFAAS_ALLOW_SGLANG_VERSION`` names one other version that is accepted
    (used by rebase trials).
    """
    if found is None:
        raise UpstreamVersionError(f"sglang is not installed ({where}); expected sglang=={expected}")
    if base_version(found) not in _allowed_versions((expected,)):
        raise UpstreamVersionError(
            f"{where} has sglang {found}, but this prfaas-sglang is pinned to sglang=={expected} "
            f"(set PRFAAS_ALLOW_SGLANG_VERSION={base_version(found)} to try it anyway)"
        )


# --- markers ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Marker:
    """A text in a file of an SGLang tree (``file`` relative to the directory holding ``sglang/``) whose
    presence says what that release does: how this package tells releases apart. ``tests``: the tests
    that run the code paths it decides (space-separated paths, ``path::name`` allowed)."""

    file: str
    text: str
    tests: str


# SGLang 0.5.15 has a radix cache class per model kind, which our state-reporting caches subclass
# (hooks/hybrid_cache.py); 0.5.23 has one unified tree, with components (hooks/unified_cache.py).
RADIX_TREES = Marker("sglang/srt/mem_cache/mamba_radix_cache.py", "class MambaRadixCache(",
                     tests="tests/engine/test_state_events.py tests/engine/test_decode_radix_hybrid.py "
                           "tests/engine/test_unified_cache.py tests/bench/test_decode_reuse.py")
UNIFIED_TREE = Marker("sglang/srt/mem_cache/unified_cache/components/mamba.py", "class MambaComponent(",
                      tests="tests/engine/test_unified_cache.py tests/engine/test_cache_move_sglang.py")
# SGLang 0.5.23 writes each KV event as a tagged msgpack map (0.5.15: an array); the emulated engine's
# publisher writes them as the installed SGLang does (``wire.kv_events.encode_batch``).
KV_EVENT_MAPS = Marker("sglang/srt/disaggregation/kv_events.py", "Events are tagged msgpack maps",
                       tests="tests/engine/test_pd.py::test_kv_events_decode_with_sglang_classes")
# SGLang 0.5.23's CPU engine imports kernels of sgl_kernel's CPU build as its modules load; 0.5.15's does not.
CPU_ENGINE_IMPORTS_SGL_KERNEL = Marker("sglang/kernels/ops/kvcache/cache_move.py",
                                       "from sgl_kernel import copy_all_layer_kv_cache_cpu",
                                       tests="tests/gpu/test_e2e_harness.py::test_an_import_only_sgl_kernel_imports_every_name_and_refuses_every_call "
                                             "tests/gpu/test_harness_sglang_cpu.py")
# SGLang 0.5.23 backs a decode server's retracted requests with a pinned host pool by default
# (cudaHostRegister: no CUDA, no start); ``--disaggregation-decode-retraction-backup cpu_tensor`` is its other way.
DECODE_RETRACTION_BACKUP = Marker(
    "sglang/srt/mem_cache/kv_cache_builder.py", 'fields["disaggregation_decode_retraction_backup"]',
    tests="tests/gpu/test_e2e_harness.py::test_a_switchable_deployment_has_two_pd_prefills_that_switch_in_place")
# SGLang 0.5.23's prefill, under its overlap scheduler, records a CUDA event before an early send of a
# cached prefix (torch.cuda.Event().record(forward_stream)): on its CPU engine that raises.
OVERLAP_EARLY_SEND_CUDA_EVENT = Marker(
    "sglang/srt/disaggregation/prefill.py", "ev.record(self.forward_stream)",
    tests="tests/gpu/test_e2e_harness.py::test_a_switchable_deployment_has_two_pd_prefills_that_switch_in_place")
# SGLang 0.5.23 serves /pd_role_switch (``--enable-pd-role-switch``): a PD worker turns into the other role in place.
PD_ROLE_SWITCH = Marker("sglang/srt/disaggregation/role_switch.py", "def handle_pd_role_switch(",
                        tests="tests/router/test_conversion.py tests/gpu/test_harness_sglang_cpu.py "
                              "tests/unit/test_peer_rebootstrap.py")
# SGLang 0.5.23 keeps an aborted room's decode pages until every prefill rank ACKs that its writes drained
# (hook kv-send-ack-drain applies only there).
DRAINED_ABORT_ACK = Marker("sglang/srt/disaggregation/common/conn.py", "def _maybe_ack_drained_abort(",
                           tests="tests/transport/test_kv_send.py")
# SGLang 0.5.23's Mooncake sender takes its page indices through pinned memory and a CUDA event unless
# it says otherwise (hook cpu-sender-indices applies only there).
HOST_TENSOR_INDICES = Marker("sglang/srt/disaggregation/mooncake/conn.py", "supports_host_tensor_indices = True",
                             tests="tests/transport/test_layerwise.py")
# SGLang 0.5.23 (#38634) makes room for a decode request's Mamba state slot itself: hook decode-state-slot retires.
MAMBA_CAPACITY_ENSURED = Marker("sglang/srt/mem_cache/allocation.py", "def ensure_mamba_capacity(",
                                tests="tests/engine/test_decode_radix_hybrid.py")
# SGLang 0.5.23's decode receiver sockets send with a timeout: hooks abort-notify-nonblocking and
# metadata-send-nonblocking retire.
RECEIVER_SEND_TIMEOUT = Marker("sglang/srt/disaggregation/common/conn.py",
                               "envs.SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT.get() * 1000",
                               tests="tests/transport/test_receiver_sends.py")
# SGLang 0.5.23 labels an HTTP metric with the route's path itself: hook metrics-route-path retires.
METRICS_ROUTE_PATH = Marker("sglang/srt/observability/http_request_metrics.py",
                            'getattr(route, "path", request.url.path)', tests="tests/unit/test_http_metrics.py")
# A release with component-typed KV events (upstream main, sglang PR #32514; in neither supported release)
# retires the state-event backends (prfaas-hybrid, prfaas-hybrid-unified, prfaas-zmq).
KV_EVENTS_COMPONENT_TYPES = Marker("sglang/srt/server_args.py", "enable_kv_events_component_types",
                                   tests="tests/engine/test_state_events.py tests/engine/test_unified_cache.py")
# SGLang 0.5.23 resolves ServerArgs with frozen raw inputs: a handler declares its decisions
# (``declare_resolution``) and readers see them through ``resolving_view``; 0.5.15 writes the record.
DECLARED_RESOLUTION = Marker("sglang/srt/arg_groups/overrides.py", "def declare_resolution(",
                             tests="tests/unit/test_plugin.py tests/unit/test_security.py")
# SGLang 0.5.23's ZMQ event publisher records where its sockets bound and advertises it in /server_info.
PUBLISHER_BOUND_ENDPOINTS = Marker("sglang/srt/disaggregation/kv_events.py", "def _bound_endpoint(",
                                   tests="tests/unit/test_security.py")
# SGLang 0.5.23's managers read the serving config from a process-wide runtime context the scheduler
# process publishes; 0.5.15's read only the arguments they are given.
RUNTIME_CONTEXT_PUBLISH = Marker("sglang/srt/runtime_context.py", "def publish(",
                                 tests="tests/transport/test_layerwise.py")

MARKERS: tuple[Marker, ...] = (
    RADIX_TREES, UNIFIED_TREE, KV_EVENT_MAPS, CPU_ENGINE_IMPORTS_SGL_KERNEL, DECODE_RETRACTION_BACKUP,
    OVERLAP_EARLY_SEND_CUDA_EVENT, PD_ROLE_SWITCH, DRAINED_ABORT_ACK, HOST_TENSOR_INDICES, MAMBA_CAPACITY_ENSURED,
    RECEIVER_SEND_TIMEOUT, METRICS_ROUTE_PATH, KV_EVENTS_COMPONENT_TYPES, DECLARED_RESOLUTION,
    PUBLISHER_BOUND_ENDPOINTS, RUNTIME_CONTEXT_PUBLISH,
)


def _has_text(root: Path, file: str, text: str) -> bool:
    path = root / file
    return path.is_file() and text in path.read_text(errors="replace")


@functools.cache
def tree_markers(root: Path) -> frozenset[Marker]:
    """The named markers (:data:`MARKERS`) the tree at ``root`` (the directory holding ``sglang/``) has:
    its files are read once per tree and process."""
    return frozenset(m for m in MARKERS if _has_text(root, m.file, m.text))


def installed_has(marker: Marker | tuple[str, str] | None, root: Path | None = None) -> bool:
    """Whether ``marker`` is in the installed SGLang (``root``: another tree's directory holding
    ``sglang/``); False for None or where nothing is installed. A named marker is looked up in
    :func:`tree_markers`; any other ``(file, text)`` (a patch header's ``Upstream-Marker``) is read now."""
    if marker is None:
        return False
    root = root or installed_sglang_root()
    if root is None:
        return False
    if marker in MARKERS:
        return marker in tree_markers(root)
    file, text = marker if isinstance(marker, tuple) else (marker.file, marker.text)
    return _has_text(root, file, text)


# --- decisions -------------------------------------------------------------------------------------


@exercised_by("tests/drift/test_hook_targets.py tests/unit/test_plugin.py")
def change_status(upstream_marker: Marker | tuple[str, str] | None, only_if: Marker | tuple[str, str] | None = None,
                  root: Path | None = None) -> str:
    """Where a change of ours (a hook, a registered backend, a patch) stands on the installed SGLang
    (``root``: another tree): ``"retired"`` where the release shows ``upstream_marker`` (it does the job
    itself: not installed, not checked), ``"not applicable"`` where it lacks ``only_if`` (a seam only
    other releases have), else ``"applies"``."""
    if installed_has(upstream_marker, root):
        return "retired"
    if only_if is not None and not installed_has(only_if, root):
        return "not applicable"
    return "applies"


class TreeKind(enum.Enum):
    """How a release builds its radix cache."""

    PER_KIND = "per-kind"  # a class per model kind (RadixCache, MambaRadixCache, SWARadixCache): 0.5.15
    UNIFIED = "unified"  # one unified tree whose components hold KV and state: 0.5.23


@exercised_by("tests/engine/test_state_events.py tests/engine/test_unified_cache.py "
              "tests/engine/test_decode_radix_hybrid.py tests/engine/test_cache_move_sglang.py "
              "tests/bench/test_decode_reuse.py")
def tree_kind(root: Path | None = None) -> TreeKind:
    """The installed SGLang's radix cache (``root``: another tree), by :data:`RADIX_TREES` and
    :data:`UNIFIED_TREE`. Raises UpstreamVersionError where neither is found (no SGLang, or an unknown one)."""
    if installed_has(RADIX_TREES, root):
        return TreeKind.PER_KIND
    if installed_has(UNIFIED_TREE, root):
        return TreeKind.UNIFIED
    raise UpstreamVersionError(f"the SGLang at {root or installed_sglang_root()} has neither a radix cache per "
                               "model kind nor the unified tree")


@exercised_by(KV_EVENT_MAPS.tests)
def kv_events_as_maps(root: Path | None = None) -> bool:
    """Whether KV events are written as the installed SGLang writes them since 0.5.23, tagged maps
    (:data:`KV_EVENT_MAPS`); arrays (0.5.15's) also where no SGLang is installed."""
    return installed_has(KV_EVENT_MAPS, root)


@exercised_by("tests/router/test_conversion.py tests/gpu/test_harness_sglang_cpu.py")
def serves_pd_role_switch(root: Path | None = None) -> bool:
    """Whether the installed SGLang serves ``/pd_role_switch`` itself (:data:`PD_ROLE_SWITCH`, 0.5.23)."""
    return installed_has(PD_ROLE_SWITCH, root)


@exercised_by(OVERLAP_EARLY_SEND_CUDA_EVENT.tests)
def overlap_early_send_records_cuda_event(root: Path | None = None) -> bool:
    """Whether the installed SGLang's overlap scheduler records a CUDA event before a prefill's early send
    (:data:`OVERLAP_EARLY_SEND_CUDA_EVENT`, 0.5.23): on its CPU engine a PD server must run without it."""
    return installed_has(OVERLAP_EARLY_SEND_CUDA_EVENT, root)


@exercised_by(DECODE_RETRACTION_BACKUP.tests)
def decode_retraction_backup_pins_host_memory(root: Path | None = None) -> bool:
    """Whether the installed SGLang backs a decode server's retracted requests with a CUDA-registered host
    pool by default (:data:`DECODE_RETRACTION_BACKUP`, 0.5.23): on CPU its ``cpu_tensor`` backup is needed."""
    return installed_has(DECODE_RETRACTION_BACKUP, root)


@exercised_by(CPU_ENGINE_IMPORTS_SGL_KERNEL.tests)
def cpu_engine_imports_sgl_kernel(root: Path | None = None) -> bool:
    """Whether the installed SGLang's CPU engine imports ``sgl_kernel``'s CPU build as its modules load
    (:data:`CPU_ENGINE_IMPORTS_SGL_KERNEL`, 0.5.23)."""
    return installed_has(CPU_ENGINE_IMPORTS_SGL_KERNEL, root)


@exercised_by(RUNTIME_CONTEXT_PUBLISH.tests)
def publishes_runtime_context(root: Path | None = None) -> bool:
    """Whether the installed SGLang's managers read a published runtime context (:data:`RUNTIME_CONTEXT_PUBLISH`,
    0.5.23): a process that builds them outside a server must publish one first."""
    return installed_has(RUNTIME_CONTEXT_PUBLISH, root)


# --- the release a remote worker reports -------------------------------------------------------------

# A request's ``tools`` reach the chat template as SGLang's pydantic ``Function`` dumps them: up to 0.5.15
# every field in the model's order (description, name, parameters, strict: false); from 0.5.23 the keys the
# client sent in the client's order, ``strict`` and ``defer_loading`` only when set (protocol.py's
# ``Function._serialize``). The router renders as the workers' release does (their /server_info ``version``):
# a remote release, which no installed tree tells, so this one decision compares versions.
TOOLS_AS_SENT_FROM_SGLANG = "0.5.23"


@exercised_by("tests/router/test_tokenizer.py")
def tools_as_sent(sglang_version: str | None) -> bool:
    """Whether SGLang ``sglang_version`` renders a request's tools as the client sent them (None, or not a
    version: the pin's way)."""
    try:
        return sglang_version is not None and Version(sglang_version) >= Version(TOOLS_AS_SENT_FROM_SGLANG)
    except InvalidVersion:
        return False


@exercised_by("tests/router/test_tokenizer.py")
def tool_function_dump(fn: dict, defer_loading: Any, as_sent: bool) -> dict:
    """A request's ``tools[i].function`` (``fn``, with a ``name``) as SGLang's ``Function`` dumps it for the
    chat template; ``defer_loading``: the function's own, else its tool's. ``as_sent`` (:func:`tools_as_sent`):
    0.5.23's dump, the client's keys in its order, ``strict`` and ``defer_loading`` only when set; otherwise
    0.5.15's, every field in the model's order with ``strict`` false by default."""
    if as_sent:
        model = {"description": fn.get("description"), "name": fn["name"], "parameters": fn.get("parameters"),
                 "strict": fn.get("strict"), "defer_loading": defer_loading}
        model = {k: v for k, v in model.items() if v is not None or k not in ("strict", "defer_loading")}
        order = [k for k in fn if k in model] + [k for k in model if k not in fn]
        return {k: model[k] for k in order}
    function = {"description": fn.get("description"), "name": fn["name"], "parameters": fn.get("parameters"),
                "strict": fn.get("strict", False)}
    if defer_loading is not None:
        function["defer_loading"] = defer_loading
    return function
