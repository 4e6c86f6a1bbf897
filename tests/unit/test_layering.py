"""The package's layering, checked on its import graph (static: every import statement, also inside functions).

Rules (DESIGN.md, "Layout"; the README's paragraph for contributors):

1. The pure core (planner, policy, threshold controller, KV index, wire formats, the runtime model,
   topology and roles, cost models) imports no I/O: no sockets, event loops, threads, processes,
   clocks, SGLang or model libraries, directly or through any module of ours it imports.
2. The router and the kv-index never import the emulated engine.
3. The emulated engine never imports the launcher.
4. Wire formats live in ``prfaas_sglang/wire``: no other module declares a msgspec struct.
5. One ZMQ subscriber: only ``adapters/zmq.py`` opens SUB sockets.
6. One runtime model: outside the planner, only ``runtime.py`` constructs a planner ``Deployment``.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest
from helpers import REPO_ROOT

PACKAGE = REPO_ROOT / "prfaas_sglang"

PURE = (
    "prfaas_sglang.plan.model", "prfaas_sglang.plan.search", "prfaas_sglang.plan.workload", "prfaas_sglang.plan.profiles",
    "prfaas_sglang.plan.analytic", "prfaas_sglang.plan.scenario", "prfaas_sglang.plan.report", "prfaas_sglang.plan.anchors",
    "prfaas_sglang.router.policy", "prfaas_sglang.router.threshold", "prfaas_sglang.router.longterm", "prfaas_sglang.router.link",
    "prfaas_sglang.router.workers", "prfaas_sglang.router.service", "prfaas_sglang.router.metrics",
    "prfaas_sglang.router.calibration", "prfaas_sglang.bench.slo", "prfaas_sglang.bench.capacity_rows",
    "prfaas_sglang.engine.mock.truth",
    "prfaas_sglang.kvindex.index", "prfaas_sglang.kvindex.feed", "prfaas_sglang.kvindex.admission",
    "prfaas_sglang.wire.kv_events", "prfaas_sglang.wire.blocks", "prfaas_sglang.wire.telemetry", "prfaas_sglang.wire.handoff",
    "prfaas_sglang.wire.token_ids", "prfaas_sglang.wire.kv_snapshot", "prfaas_sglang.wire.auth", "prfaas_sglang.router.openapi",
    "prfaas_sglang.wire.role_switch",
    "prfaas_sglang.runtime", "prfaas_sglang.topology", "prfaas_sglang.roles", "prfaas_sglang.configcheck",
    "prfaas_sglang.errors", "prfaas_sglang.protocol", "prfaas_sglang.transport.meter", "prfaas_sglang.transport.wan_defaults",
    "prfaas_sglang.transport.tcpstate", "prfaas_sglang.transport.kv_send", "prfaas_sglang.transport.kv_stage",
    "prfaas_sglang.transport.lane_pacing",
    "prfaas_sglang.launch.command", "prfaas_sglang.engine.mock.prefix_cache", "prfaas_sglang.engine.mock.timing",
    "prfaas_sglang.engine.mock.scheduler", "prfaas_sglang.gpu.bundle",
    "prfaas_sglang.hosts", "prfaas_sglang.launch.k8s", "prfaas_sglang.launch.dashboard", "prfaas_sglang.bench.promql_lite",
)
IO_MODULES = {"socket", "ssl", "http", "urllib", "asyncio", "threading", "multiprocessing", "subprocess", "selectors",
              "signal", "concurrent", "time", "aiohttp", "requests", "zmq", "uvloop", "mooncake", "sglang", "torch",
              "transformers", "tokenizers", "matplotlib"}


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO_ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@cache
def tree(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text())


@cache
def imports(name: str) -> tuple[frozenset[str], frozenset[str]]:
    """(modules of ours it imports, top-level external modules it imports); TYPE_CHECKING blocks excluded."""
    ours, external = set(), set()
    package = name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    add(full if full in MODULES else base)
            visit(child)

    def add(target: str):
        if target.split(".")[0] == "prfaas_sglang":
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            ours.add(target)
            parts = target.split(".")
            ours.update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in MODULES)
        else:
            external.add(target.split(".")[0])

    visit(tree(name))
    ours.discard(name)
    return frozenset(ours), frozenset(external)


def closure(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo.extend(imports(current)[0])
    return seen


def test_every_listed_pure_module_exists():
    assert set(PURE) <= set(MODULES), set(PURE) - set(MODULES)


@pytest.mark.parametrize("name", PURE)
def test_pure_core_imports_no_io(name):
    offenders = {m: sorted(imports(m)[1] & IO_MODULES) for m in closure(name) if imports(m)[1] & IO_MODULES}
    assert not offenders, f"{name} reaches I/O through {offenders}"


@pytest.mark.parametrize("prefix", ["prfaas_sglang.router", "prfaas_sglang.kvindex"])
def test_router_and_kvindex_never_import_the_emulated_engine(prefix):
    for name in (m for m in MODULES if m.startswith(prefix)):
        reached = {m for m in closure(name) if m.startswith("prfaas_sglang.engine")}
        assert not reached, f"{name} imports {sorted(reached)}"


def test_only_the_emulation_knows_the_engines_truth():
    """The emulated engine's service-time truth (``engine/mock/truth.py``) is read by the engine, the
    simulator's nodes and the benchmarks that set it; nothing the router runs reaches it."""
    truth = "prfaas_sglang.engine.mock.truth"
    allowed = ("prfaas_sglang.engine.mock", "prfaas_sglang.sim", "prfaas_sglang.bench")
    for name in MODULES:
        if truth in imports(name)[0]:
            assert name.startswith(allowed), f"{name} imports the engines' truth"
    for name in (m for m in MODULES if m.startswith(("prfaas_sglang.router", "prfaas_sglang.kvindex"))):
        assert truth not in closure(name), f"{name} reaches the engines' truth"


def test_the_emulated_engine_never_imports_the_launcher():
    for name in (m for m in MODULES if m.startswith("prfaas_sglang.engine")):
        reached = {m for m in closure(name) if m.startswith("prfaas_sglang.launch")}
        assert not reached, f"{name} imports {sorted(reached)}"


def _classes_and_calls(name: str):
    yield from ast.walk(tree(name))


def test_wire_formats_live_in_wire():
    for name in MODULES:
        if name.startswith("prfaas_sglang.wire"):
            continue
        for node in _classes_and_calls(name):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                assert not any("Struct" in b for b in bases), f"{name}.{node.name} declares a wire struct outside wire/"


def test_one_zmq_subscriber():
    for name in MODULES:
        if name == "prfaas_sglang.adapters.zmq":
            continue
        subs = [n for n in _classes_and_calls(name) if isinstance(n, ast.Attribute) and n.attr == "SUB"]
        assert not subs, f"{name} opens its own ZMQ SUB socket"


def test_only_the_runtime_model_builds_a_deployment():
    for name in MODULES:
        if name.startswith("prfaas_sglang.plan") or name == "prfaas_sglang.runtime":
            continue
        calls = [n for n in _classes_and_calls(name) if isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] == "Deployment"]
        assert not calls, f"{name} builds a planner Deployment; use prfaas_sglang.runtime"


def test_the_checker_sees_function_level_imports(tmp_path):
    """The graph includes imports inside functions (where the package puts its lazy ones)."""
    assert "prfaas_sglang.router.server" in imports("prfaas_sglang.router.__main__")[0]
    assert "aiohttp" in imports("prfaas_sglang.router.__main__")[1]
