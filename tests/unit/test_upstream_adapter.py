"""The upstream adapter (``prfaas_sglang/_compat``): the one place that decides anything by SGLang release.

* Nothing else in the package tells releases apart: no ``installed_has``, marker tuple, ImportError probe
  around an import, ``hasattr``, or version comparison outside the adapter (an AST scan; what looks like one
  and is not -- an optional third-party dependency, an object's kind on every release -- is allowed by
  name, with its reason).
* Every marker and every adapter function names the tests that run what it decides; they exist and refer
  to it, and the release-dependent test list (what the second release's leg runs) holds them all.
* Markers are named, read once per tree, and each tells the supported releases apart as documented.
* The emulated engine reports a configurable release.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO_ROOT
from test_layering import GRAPH, ImportGraph

from prfaas_sglang import _compat
from prfaas_sglang._compat import MARKERS, Marker, TreeKind, accessors, release_tests
from prfaas_sglang._pin import PINNED_SGLANG_VERSION, SUPPORTED_SGLANG_VERSIONS
from prfaas_sglang.errors import ConfigError, UpstreamVersionError
from prfaas_sglang.plugin import HOOKS, REGISTRATIONS, HookSpec

ADAPTER = "prfaas_sglang._compat"

# --- no release decision outside the adapter ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Finding:
    """Something in ``module`` at ``line`` that looks like a release decision: ``rule`` and what it is about."""

    module: str
    line: int
    rule: str  # "installed_has" | "marker" | "ImportError probe" | "hasattr" | "version comparison"
    detail: str  # the name, the attribute, the module probed or the version text


MARKER_FILE = re.compile(r"^sglang/.+\.py$")
VERSION_TEXT = re.compile(r"^\d+\.\d+(\.\d+)?([a-z+.].*)?$")
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}
IMPORT_CALLS = {"import_module", "__import__", "find_spec"}
VERSION_CALLS = {"Version", "parse_version", "LooseVersion", "StrictVersion"}

# What the scan finds that decides nothing by SGLang release, and why (module, rule, detail).
ALLOWED = {
    ("prfaas_sglang.plugin", "ImportError probe", "import_module"):
        "resolve_target's error report: which module on a hook target's path fails to import, on any release",
    ("prfaas_sglang.plan.plots", "ImportError probe", "matplotlib"):
        "an optional third-party dependency (plots): a typed error names the extra to install",
    ("prfaas_sglang.plan.fleet_model", "ImportError probe", "scipy"):
        "an optional third-party dependency (the fleet LP): a typed error names the extra to install",
    ("prfaas_sglang.router.__main__", "ImportError probe", "uvloop"):
        "an optional third-party event loop: asyncio's own where it is not installed",
    ("prfaas_sglang.launch.grafana", "ImportError probe", "grafana_foundation_sdk"):
        "an optional third-party dependency (the dashboard): a typed error names the extra to install",
    ("prfaas_sglang.gpu.wheels", "version comparison", "Version"):
        "picks the wheel files of one pinned version from an index listing (PEP 440 matching), on any release",
    ("prfaas_sglang.patches.tree", "version comparison", "Version"):
        "validates a patched wheel's local version label (PEP 440); compares nothing",
    ("prfaas_sglang.hooks.kv_send_hook", "hasattr", "transfer_submit_write"):
        "Mooncake's engine, a third-party build, not SGLang: without asynchronous writes KV goes synchronously",
    ("prfaas_sglang.hooks.kv_send_hook", "hasattr", "transfer_check_status"): "as transfer_submit_write",
    ("prfaas_sglang.hooks.decode_stage", "hasattr", "num_pages"):
        "the allocator's kind on every release: the paged allocator counts pages, the page-1 one does not",
    ("prfaas_sglang.hooks.decode_stage", "hasattr", "kv_args"):
        "the KV manager's kind on every release: a Mooncake manager has KV args, a fake one has none",
    ("prfaas_sglang.hooks.decode_stage", "hasattr", "max_total_num_tokens"):
        "a prealloc queue without a scheduler of SGLang's (a caller's stand-in) keeps its own count only",
    ("prfaas_sglang.router.server", "hasattr", "packed_prefix"):
        "our own JSON-id type (wire.token_ids.JsonIds), not an SGLang object",
    ("prfaas_sglang.gpu.tiny_model", "hasattr", "get_text_config"):
        "a transformers config (a multimodal one nests its text config), not SGLang",
}


def _name_of(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    types_ = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(t is not None and _name_of(t) in IMPORT_ERRORS for t in types_)


def _imported(body: list[ast.stmt]) -> list[str]:
    """What a ``try`` body imports: top-level module names, or the import call's name (``import_module``)."""
    found = []
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.Import):
            found += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or ".").split(".")[0] if not node.level else ".")
        elif isinstance(node, ast.Call) and _name_of(node.func) in IMPORT_CALLS:
            found.append(_name_of(node.func))
    return found


def _is_marker(node: ast.AST) -> bool:
    """A ``("sglang/....py", "text")`` tuple, or a ``Marker("sglang/....py", ...)`` built outside the adapter."""
    items = node.elts if isinstance(node, ast.Tuple) else node.args if (
        isinstance(node, ast.Call) and _name_of(node.func) == "Marker") else []
    return (len(items) >= 2 and all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items[:2])
            and bool(MARKER_FILE.match(items[0].value)))


def _version_text(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(VERSION_TEXT.match(node.value))


def _rules(node: ast.AST) -> Iterator[tuple[str, str]]:
    """(rule, detail) for each way ``node`` decides by release."""
    if (isinstance(node, (ast.Name, ast.Attribute)) and _name_of(node) == "installed_has") or (
            isinstance(node, ast.alias) and node.name == "installed_has"):
        yield "installed_has", "installed_has"
    if _is_marker(node):
        items = node.elts if isinstance(node, ast.Tuple) else node.args
        yield "marker", items[0].value
    if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
        yield from (("ImportError probe", name) for name in _imported(node.body))
    if isinstance(node, ast.Call) and _name_of(node.func) == "hasattr" and len(node.args) == 2:
        attr = node.args[1]
        yield "hasattr", attr.value if isinstance(attr, ast.Constant) else ast.unparse(attr)
    if isinstance(node, ast.Call) and _name_of(node.func) in VERSION_CALLS:
        yield "version comparison", _name_of(node.func)
    if isinstance(node, ast.Compare) and any(_version_text(n) for n in (node.left, *node.comparators)):
        yield "version comparison", next(n.value for n in (node.left, *node.comparators) if _version_text(n))
    if isinstance(node, ast.Attribute) and node.attr == "__version__" and _name_of(node.value) == "sglang":
        yield "version comparison", "sglang.__version__"


def release_decisions(graph: ImportGraph) -> list[Finding]:
    """Every finding in the package outside the adapter."""
    found = []
    for name in sorted(m for m in graph.modules if m != ADAPTER and not m.startswith(ADAPTER + ".")):
        for node in ast.walk(graph.tree(name)):
            found += [Finding(name, getattr(node, "lineno", 0), rule, detail) for rule, detail in _rules(node)]
    return found


def test_nothing_outside_the_adapter_decides_by_release():
    """Releases are told apart in ``prfaas_sglang/_compat`` only; what the scan finds elsewhere is allowed
    with a reason, and every allowance still matches something (a stale one is removed)."""
    found = release_decisions(GRAPH)
    allowed = ALLOWED
    offenders = [f for f in found if (f.module, f.rule, f.detail) not in allowed]
    assert not offenders, "release decisions outside the adapter (move them into prfaas_sglang/_compat):\n" + "\n".join(
        f"  {f.module}:{f.line}: {f.rule} ({f.detail})" for f in offenders)
    assert set(allowed) <= {(f.module, f.rule, f.detail) for f in found}, "stale allowances"


def test_the_scan_finds_each_kind_of_release_decision_outside_the_adapter_only(tmp_path):
    """A new release decision fails the scan, whichever shape it takes; the same text in the adapter does not."""
    decisions = '''
from prfaas_sglang._compat import installed_has
from packaging.version import Version
import sglang

NEW = ("sglang/srt/new.py", "def new_seam(")
try:
    from sglang.srt.new import seam
except ImportError:
    seam = None

def pick(req, v):
    if hasattr(req, "extend_end"):
        return 1
    return v >= "0.5.23" or Version(v) > Version(sglang.__version__) or installed_has(NEW)
'''
    for rel in ("__init__.py", "_compat/__init__.py", "hooks/__init__.py"):
        (tmp_path / "prfaas_sglang" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "prfaas_sglang" / rel).write_text("")
    (tmp_path / "prfaas_sglang" / "hooks" / "new_hook.py").write_text(decisions)
    (tmp_path / "prfaas_sglang" / "_compat" / "accessors.py").write_text(decisions)
    (tmp_path / "prfaas_sglang" / "plan.py").write_text("try:\n    import scipy\nexcept ImportError:\n    scipy = None\n"
                                                       "ok = hasattr(scipy, 'optimize')\n")
    found = {(f.rule, f.detail) for f in release_decisions(ImportGraph(tmp_path)) if f.module.endswith("new_hook")}
    assert found == {("installed_has", "installed_has"), ("marker", "sglang/srt/new.py"), ("ImportError probe", "sglang"),
                     ("hasattr", "extend_end"), ("version comparison", "0.5.23"), ("version comparison", "Version"),
                     ("version comparison", "sglang.__version__")}
    assert not [f for f in release_decisions(ImportGraph(tmp_path)) if f.module.startswith(ADAPTER)]
    plan = {(f.rule, f.detail) for f in release_decisions(ImportGraph(tmp_path)) if f.module.endswith("plan")}
    assert plan == {("ImportError probe", "scipy"), ("hasattr", "optimize")}  # found, so it needs an allowance


# --- every marker and adapter function names tests that run it ------------------------------------------

NAMED = list(release_tests.named_tests())
# Adapter functions that decide nothing by release themselves (versions, the marker lookup, the marking).
PLUMBING = {"installed_sglang_version", "installed_sglang_root", "tree_sglang_version", "base_version", "release_root",
            "installed_has", "tree_markers", "exercised_by"}


def _public_functions(module: types.ModuleType) -> list[str]:
    return [name for name, fn in vars(module).items() if inspect.isfunction(fn) and fn.__module__ == module.__name__
            and not name.startswith("_")]


def test_every_marker_is_a_named_constant_of_the_adapter_and_every_spec_names_its_markers_there():
    named = [v for v in vars(_compat).values() if isinstance(v, Marker)]
    assert sorted(map(repr, named)) == sorted(map(repr, MARKERS)) and len(set(MARKERS)) == len(MARKERS)
    for spec in (*HOOKS, *REGISTRATIONS):
        for marker in (spec.upstream_marker, spec.only_if):
            assert marker is None or marker in MARKERS, f"{spec.name}: an inline marker {marker}; name it in _compat"


@pytest.mark.parametrize("module", [_compat, accessors], ids=lambda m: m.__name__)
def test_every_release_dependent_function_of_the_adapter_names_its_tests(module):
    unmarked = [name for name in _public_functions(module) if name not in PLUMBING and not getattr(vars(module)[name], "tests", "")]
    assert not unmarked, f"mark these with @exercised_by(tests): {unmarked}"


def _defined_names(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


@pytest.mark.parametrize(("who", "entry"), NAMED, ids=[f"{w}->{e}" for w, e in NAMED])
def test_every_named_test_exists(who, entry):
    path, *names = entry.split("::")
    assert (REPO_ROOT / path).is_file(), f"{who} names {path}, which does not exist"
    assert set(names) <= _defined_names(REPO_ROOT / path), f"{who} names {entry}: no such test there"


@functools.cache
def _adapter_names_used() -> dict[str, frozenset[str]]:
    """Per package module outside the adapter, the adapter's names it uses: imported from
    ``prfaas_sglang._compat`` (or a module of it), or read as ``_compat.NAME`` / ``accessors.NAME``."""
    used: dict[str, frozenset[str]] = {}
    for module in (m for m in GRAPH.modules if not m.startswith(ADAPTER)):
        names = set()
        for node in ast.walk(GRAPH.tree(module)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(ADAPTER):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.Attribute) and _name_of(node.value) in ("_compat", "accessors"):
                names.add(node.attr)
        used[module] = frozenset(names)
    return used


def _users(names: set[str]) -> set[str]:
    """The package modules outside the adapter that use any of ``names``; not the
    plugin for a marker, which its specs name as data (a test of a spec is found by the spec's name and hook)."""
    markers = {name for name, v in vars(_compat).items() if isinstance(v, Marker)}
    return {m for m, used in _adapter_names_used().items() if used & (names - markers if m == "prfaas_sglang.plugin" else names)}


def _adapter_functions_reading(constant: str) -> set[str]:
    source = {fn.__name__: inspect.getsource(fn) for fn in release_tests.adapter_functions()}
    return {name for name, text in source.items() if re.search(rf"\b{constant}\b", text)}


def _mentions(module: str) -> re.Pattern:
    """How a test names a package module: its dotted name, ``from PACKAGE import ... LEAF``, its path; a
    ``__main__`` by its package (``-m``)."""
    package, leaf = module.rsplit(".", 1)
    forms = [re.escape(module), rf"from {re.escape(package)} import \(?[^)\n]*\b{leaf}\b", re.escape(module.replace(".", "/") + ".py")]
    if leaf == "__main__":
        forms.append(rf"\b{re.escape(package)}\b(?!\.)")
    return re.compile("|".join(forms))


def _what_refers_to(who: str) -> tuple[set[str], set[str]]:
    """(names, modules) a test that runs what ``who`` decides mentions, one at least: its own name; for a
    marker, the adapter functions that read it and the hooks and backends it decides (their names, hook
    functions and modules); the package modules that use any of those, and the hooks they hold."""
    kind, _, name = who.partition(" ")
    if kind == "spec":
        return {name}, set()
    own = {name} if kind == "marker" else {who.rsplit(".", 1)[1]}
    decided = [s for s in (*HOOKS, *REGISTRATIONS) if kind == "marker" and getattr(_compat, name) in (s.upstream_marker, s.only_if)]
    if kind == "marker":
        own |= _adapter_functions_reading(name)
    modules = _users(own) | {s.hook.partition(":")[0] for s in decided if isinstance(s, HookSpec)}
    names = own | {s.name for s in decided} | {s.hook.partition(":")[2] for s in decided if isinstance(s, HookSpec)}
    return names | {s.name for s in HOOKS if s.hook.partition(":")[0] in modules}, modules


# Tests that run what they are named for through servers they start, and so cannot name it: (who, test).
THROUGH_SERVERS = {
    ("marker KV_EVENT_MAPS", "tests/engine/test_pd.py::test_kv_events_decode_with_sglang_classes"):
        "emulated workers publish (adapters/zmq) and the test decodes with the installed SGLang's classes",
    ("prfaas_sglang._compat.kv_events_as_maps", "tests/engine/test_pd.py::test_kv_events_decode_with_sglang_classes"):
        "as KV_EVENT_MAPS",
    ("marker CPU_ENGINE_IMPORTS_SGL_KERNEL", "tests/gpu/test_harness_sglang_cpu.py"):
        "real SGLang servers the harness starts on this CPU (gpu/e2e's environment for them)",
    ("prfaas_sglang._compat.cpu_engine_imports_sgl_kernel", "tests/gpu/test_harness_sglang_cpu.py"):
        "as CPU_ENGINE_IMPORTS_SGL_KERNEL",
}
HELPER_FILE = re.compile(r"\b(\w+)\.py\b")


def _test_text(entry: str) -> str:
    """A test file's text, with that of the helper files beside it it names (a probe it runs)."""
    path = REPO_ROOT / entry.partition("::")[0]
    text = path.read_text()
    helpers = {path.with_name(f"{m}.py") for m in HELPER_FILE.findall(text) if not m.startswith("test_")}
    return "\n".join([text, *(h.read_text() for h in sorted(helpers) if h.is_file())])


@pytest.mark.parametrize(("who", "entry"), [(w, e) for w, e in NAMED if not w.startswith("spec ")],
                         ids=[f"{w}->{e}" for w, e in NAMED if not w.startswith("spec ")])
def test_every_test_a_marker_or_an_adapter_function_names_refers_to_it(who, entry):
    """A named test mentions what it is named for (by name, or a module or hook that uses it), itself or in a
    helper it runs: a list that drifts from the tests it names fails here."""
    if (who, entry) in THROUGH_SERVERS:
        pytest.skip(THROUGH_SERVERS[who, entry])
    text = _test_text(entry)
    names, modules = _what_refers_to(who)
    assert any(re.search(rf"\b{re.escape(n)}\b", text) for n in names) or any(
        _mentions(m).search(text) for m in modules), f"{entry} mentions none of {sorted(names | modules)}"


# --- the second release's leg: what it runs ------------------------------------------------------------

LEG = release_tests.release_dependent_tests()
# A test module reaches SGLang's own code when it imports sglang (anywhere in it), runs a probe that does
# (tests/*/*_probe.py), or drives real SGLang through the CPU harness.
REACHES_SGLANG = re.compile(r"^\s*(?:from sglang[\s.]|import sglang\b)|_probe\.py|\bsglang_cpu\b|run_probe\("
                            r"|engine=\"sglang-cpu\"", re.M)


def _in_leg(entry: str) -> bool:
    path = entry.partition("::")[0]
    return entry in LEG or path in LEG


def test_the_leg_holds_every_named_test_the_drift_tests_and_the_adapters_own():
    missing = [f"{who} -> {entry}" for who, entry in NAMED if not _in_leg(entry)]
    drift = [p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "tests" / "drift").glob("test_*.py")]
    missing += [entry for entry in (*drift, release_tests.ADAPTER_TESTS) if not _in_leg(entry)]
    assert drift and not missing, missing


@pytest.mark.parametrize("entry", release_tests.COMPARED_WITH_SGLANG)
def test_every_test_compared_with_sglang_exists_and_reaches_it(entry):
    path, *names = entry.split("::")
    assert (REPO_ROOT / path).is_file() and set(names) <= _defined_names(REPO_ROOT / path), entry
    assert REACHES_SGLANG.search((REPO_ROOT / path).read_text()), f"{entry} does not reach SGLang"


def test_every_test_module_that_reaches_sglang_runs_in_the_second_releases_leg():
    """Nothing that touches SGLang's code drifts silently on another release: each such module is named by
    a spec, a marker, an adapter function or :data:`release_tests.COMPARED_WITH_SGLANG` (whole, or the tests
    of it that do)."""
    reaching = sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "tests").rglob("test_*.py")
                      if REACHES_SGLANG.search(p.read_text()))
    assert len(reaching) > 20, reaching  # the rule still finds them
    assert [path for path in reaching if not any(e.partition("::")[0] == path for e in LEG)] == []


# --- markers: named, read once per tree, telling the releases apart ---------------------------------------

# The supported releases whose tree has each marker (a marker found in all or none decides nothing, unless it
# waits for a release to come: KV_EVENTS_COMPONENT_TYPES retires the state-event backends where upstream has them).
RELEASES_WITH = {
    "RADIX_TREES": {"0.5.15"}, "UNIFIED_TREE": {"0.5.23"}, "KV_EVENT_MAPS": {"0.5.23"},
    "CPU_ENGINE_IMPORTS_SGL_KERNEL": {"0.5.23"}, "DECODE_RETRACTION_BACKUP": {"0.5.23"},
    "OVERLAP_EARLY_SEND_CUDA_EVENT": {"0.5.23"}, "PD_ROLE_SWITCH": {"0.5.23"}, "DRAINED_ABORT_ACK": {"0.5.23"},
    "HOST_TENSOR_INDICES": {"0.5.23"}, "MAMBA_CAPACITY_ENSURED": {"0.5.23"}, "RECEIVER_SEND_TIMEOUT": {"0.5.23"},
    "METRICS_ROUTE_PATH": {"0.5.23"}, "KV_EVENTS_COMPONENT_TYPES": set(), "DECLARED_RESOLUTION": {"0.5.23"},
    "PUBLISHER_BOUND_ENDPOINTS": {"0.5.23"}, "RUNTIME_CONTEXT_PUBLISH": {"0.5.23"},
}


@pytest.mark.parametrize("release", SUPPORTED_SGLANG_VERSIONS)
def test_each_marker_is_in_the_releases_it_says(release):
    """Read from the release's tree here (the installed one, or ``make env``'s overlay)."""
    assert {name for name, v in vars(_compat).items() if isinstance(v, Marker)} == set(RELEASES_WITH)
    root = _compat.release_root(release)
    if root is None:
        pytest.skip(f"no tree of sglang {release} here (make env builds the overlays)")
    found = {name for name in RELEASES_WITH if _compat.installed_has(getattr(_compat, name), root)}
    assert found == {name for name, releases in RELEASES_WITH.items() if release in releases}


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_named_marker_is_read_once_per_tree_and_any_other_each_time(tmp_path):
    root = _tree(tmp_path, {_compat.RADIX_TREES.file: "class MambaRadixCache(Base):\n"})
    assert _compat.installed_has(_compat.RADIX_TREES, root)
    assert _compat.tree_markers(root) == {_compat.RADIX_TREES}
    (root / _compat.RADIX_TREES.file).write_text("")
    assert _compat.installed_has(_compat.RADIX_TREES, root)  # computed once for this tree
    assert not _compat.installed_has((_compat.RADIX_TREES.file, "class MambaRadixCache("), root)  # a patch's: read now
    assert not _compat.installed_has(None, root)


def test_the_tree_kind_follows_the_trees_markers_and_an_unknown_tree_is_refused(tmp_path):
    per_kind = _tree(tmp_path / "a", {_compat.RADIX_TREES.file: _compat.RADIX_TREES.text})
    unified = _tree(tmp_path / "b", {_compat.UNIFIED_TREE.file: _compat.UNIFIED_TREE.text})
    assert _compat.tree_kind(per_kind) is TreeKind.PER_KIND and _compat.tree_kind(unified) is TreeKind.UNIFIED
    with pytest.raises(UpstreamVersionError, match="neither a radix cache per model kind nor the unified tree"):
        _compat.tree_kind(_tree(tmp_path / "c", {"sglang/__init__.py": ""}))


def test_the_cache_moves_run_on_the_installed_trees_own_functions():
    """Chosen by the adapter when called, not by rebinding at import (hooks/cache_import imports neither)."""
    backend = accessors.cache_move_backend()
    expected = {TreeKind.PER_KIND: "cache_import_radix", TreeKind.UNIFIED: "cache_import_unified"}[_compat.tree_kind()]
    assert backend.__name__ == f"prfaas_sglang.hooks.{expected}"
    assert {"export_prefix", "import_prefix", "usable_prefix_tokens"} <= set(vars(backend))
    reaches = GRAPH.module_level_imports("prfaas_sglang.hooks.cache_import")
    assert not reaches & {"prfaas_sglang.hooks.cache_import_radix", "prfaas_sglang.hooks.cache_import_unified"}


# --- the emulated engine's release ------------------------------------------------------------------------


def _engine_args(*extra: str):
    from prfaas_sglang.engine.mock.__main__ import build_parser

    return build_parser().parse_args(["--role", "pd-decode", "--port", "1", "--profile", "m@a", *extra])


def test_the_emulated_engine_reports_the_release_it_is_given_the_pin_by_default(monkeypatch):
    from prfaas_sglang.engine.mock.__main__ import config_from_args
    from prfaas_sglang.engine.mock.sglang_http import _info

    monkeypatch.delenv("PRFAAS_ALLOW_SGLANG_VERSION", raising=False)
    assert config_from_args(_engine_args()).sglang_release == PINNED_SGLANG_VERSION
    other = next(v for v in SUPPORTED_SGLANG_VERSIONS if v != PINNED_SGLANG_VERSION)
    config = config_from_args(_engine_args("--sglang-release", other))
    engine = types.SimpleNamespace(config=config, tokenizer=None, max_total_tokens=1024, layerwise=False,
                                   timing=types.SimpleNamespace(max_batch=8, hybrid=False))
    assert _info(engine)["version"] == other
    with pytest.raises(ConfigError, match="--sglang-release"):
        config_from_args(_engine_args("--sglang-release", "0.4.0"))
