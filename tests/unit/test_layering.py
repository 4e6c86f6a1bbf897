"""The package's layering, checked on its import graph (static: every import statement, also inside functions).

Rules (docs/architecture.md, "Layers"):

1. The pure core imports no I/O: no sockets, event loops, threads, processes, clocks, SGLang or model
   libraries, directly or through any module of ours it imports. Which modules are pure comes from the
   package layout: each package's ``__init__.py`` says either ``IO_MODULES`` (a pure package: every
   module but these is pure) or ``PURE_MODULES`` (an I/O package: these are pure), so a new module of a
   pure package is checked without being listed, and a new package must say which it is.
2. The router and the kv-index never import the emulated engine.
3. The emulated engine never imports the launcher.
4. Wire formats live in ``prfaas_sglang/wire``: no other module declares a msgspec struct, writes or
   reads a versioned JSON object (a ``"v"`` key).
5. One ZMQ subscriber: only ``adapters/zmq.py`` opens SUB sockets.
6. One runtime model: outside the planner, only ``runtime.py`` constructs a planner ``Deployment``.
7. One synchronous HTTP client: only ``adapters/http_sync.py`` imports one (``requests``, ``urllib.request``,
   ``http.client``).
8. The GPU checks import the GPU harness, never the other way round.
9. No circle of module-level imports (imports inside functions may point back).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest
from helpers import REPO_ROOT

IO_LIBRARIES = {"socket", "ssl", "http", "urllib", "asyncio", "threading", "multiprocessing", "subprocess", "selectors",
                "signal", "concurrent", "time", "aiohttp", "requests", "zmq", "uvloop", "mooncake", "sglang", "torch",
                "transformers", "tokenizers", "matplotlib"}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class ImportGraph:
    """The modules under ``root/prfaas_sglang``, their imports, and the layering map their packages declare."""

    def __init__(self, root: Path):
        self.root = root
        self.modules = {self._name(p): p for p in (root / "prfaas_sglang").rglob("*.py")}

    def _name(self, path: Path) -> str:
        parts = list(path.relative_to(self.root).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    @cache  # noqa: B019 - one graph per test session
    def tree(self, name: str) -> ast.Module:
        return ast.parse(self.modules[name].read_text())

    def is_package(self, name: str) -> bool:
        return self.modules[name].name == "__init__.py"

    def package_of(self, name: str) -> str:
        return name if self.is_package(name) else name.rsplit(".", 1)[0]

    def imports(self, name: str) -> tuple[frozenset[str], frozenset[str]]:
        """(modules of ours it imports, top-level external modules it imports); TYPE_CHECKING blocks excluded."""
        return self._imports(name, module_level=False)

    def module_level_imports(self, name: str) -> frozenset[str]:
        """The modules of ours ``name`` imports as it is imported itself: its imports outside function bodies
        (the ones that can make a circle at import time); TYPE_CHECKING blocks excluded."""
        return self._imports(name, module_level=True)[0]

    @cache  # noqa: B019
    def _imports(self, name: str, module_level: bool) -> tuple[frozenset[str], frozenset[str]]:
        ours, external = set(), set()
        package = self.package_of(name)

        def visit(node):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _type_checking(child):
                    continue
                if module_level and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
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
                        add(full if full in self.modules else base)
                visit(child)

        def add(target: str):
            if target.split(".")[0] == "prfaas_sglang":
                while target not in self.modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                ours.add(target)
                parts = target.split(".")
                ours.update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in self.modules)
            else:
                external.add(target)

        visit(self.tree(name))
        ours.discard(name)
        return frozenset(ours), frozenset(external)

    def import_cycles(self) -> list[list[str]]:
        """The circles of :meth:`module_level_imports` (each a strongly connected set of two or more modules,
        sorted); empty when the package imports without one."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        cycles: list[list[str]] = []

        def connect(module: str) -> None:  # Tarjan's algorithm
            index[module] = low[module] = len(index)
            stack.append(module)
            for target in self.module_level_imports(module):
                if target not in index:
                    connect(target)
                    low[module] = min(low[module], low[target])
                elif target in stack:
                    low[module] = min(low[module], index[target])
            if low[module] == index[module]:
                component = stack[stack.index(module):]
                del stack[stack.index(module):]
                if len(component) > 1:
                    cycles.append(sorted(component))

        for module in sorted(self.modules):
            if module not in index:
                connect(module)
        return sorted(cycles)

    def libraries(self, name: str) -> frozenset[str]:
        """The top-level external packages ``name`` imports."""
        return frozenset(m.split(".")[0] for m in self.imports(name)[1])

    def closure(self, name: str) -> set[str]:
        seen, todo = set(), [name]
        while todo:
            current = todo.pop()
            if current not in seen:
                seen.add(current)
                todo.extend(self.imports(current)[0])
        return seen

    def layer_map(self, package: str) -> tuple[str, frozenset[str]]:
        """("IO_MODULES" | "PURE_MODULES", the names it lists) as the package's ``__init__.py`` declares it."""
        declared = [(target.id, node.value) for node in self.tree(package).body if isinstance(node, ast.Assign)
                    for target in node.targets if isinstance(target, ast.Name) and target.id in ("IO_MODULES", "PURE_MODULES")]
        assert len(declared) == 1, f"{package}/__init__.py declares {len(declared)} of IO_MODULES / PURE_MODULES; it must declare one"
        kind, value = declared[0]
        return kind, frozenset(ast.literal_eval(value))

    def pure(self) -> set[str]:
        """The pure set, from the package layout: every module its package's map says is pure."""
        pure = set()
        for name in self.modules:
            kind, listed = self.layer_map(self.package_of(name))
            leaf = "__init__" if self.is_package(name) else name.rsplit(".", 1)[1]
            if (kind == "IO_MODULES") == (leaf not in listed):
                pure.add(name)
        return pure

    def io_offenders(self, name: str) -> dict[str, list[str]]:
        return {m: sorted(self.libraries(m) & IO_LIBRARIES) for m in self.closure(name) if self.libraries(m) & IO_LIBRARIES}


GRAPH = ImportGraph(REPO_ROOT)
MODULES = GRAPH.modules
PURE = sorted(GRAPH.pure())
imports = GRAPH.imports
closure = GRAPH.closure
tree = GRAPH.tree


def test_every_package_declares_its_layer_and_lists_only_its_own_modules():
    for package in (m for m in MODULES if GRAPH.is_package(m)):
        _, listed = GRAPH.layer_map(package)
        own = {m.rsplit(".", 1)[1] for m in MODULES if m != package and (
               GRAPH.package_of(m) == package or (GRAPH.is_package(m) and m.rsplit(".", 1)[0] == package))}
        assert listed <= own | {"__main__"}, f"{package} lists modules it does not have: {sorted(listed - own)}"


def test_the_core_of_the_product_is_in_the_pure_set():
    """The map keeps the policy objects pure (a package cannot silently flip to I/O)."""
    core = {"prfaas_sglang.plan.model", "prfaas_sglang.router.policy", "prfaas_sglang.router.threshold",
            "prfaas_sglang.router.longterm", "prfaas_sglang.router.calibration", "prfaas_sglang.kvindex.index",
            "prfaas_sglang.wire.kv_events", "prfaas_sglang.runtime", "prfaas_sglang.topology",
            "prfaas_sglang.transport.meter", "prfaas_sglang.engine.mock.truth", "prfaas_sglang.bench.slo"}
    assert core <= set(PURE), sorted(core - set(PURE))


def _write(root: Path, files: dict[str, str]) -> ImportGraph:
    for rel, text in files.items():
        path = root / "prfaas_sglang" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return ImportGraph(root)


def test_a_new_module_of_a_pure_package_is_checked_without_being_listed(tmp_path):
    graph = _write(tmp_path, {
        "__init__.py": "IO_MODULES = ()\n",
        "wire/__init__.py": "IO_MODULES = ()\n",
        "wire/new_format.py": "import socket\n",
        "bench/__init__.py": 'PURE_MODULES = ("slo",)\n',
        "bench/slo.py": "from prfaas_sglang.wire import new_format\n",
        "bench/new_bench.py": "import socket\n",
    })
    assert {"prfaas_sglang.wire.new_format", "prfaas_sglang.bench.slo"} <= graph.pure()
    assert "prfaas_sglang.bench.new_bench" not in graph.pure()
    assert graph.io_offenders("prfaas_sglang.wire.new_format") == {"prfaas_sglang.wire.new_format": ["socket"]}
    assert "prfaas_sglang.wire.new_format" in graph.io_offenders("prfaas_sglang.bench.slo")


def test_a_package_without_a_layering_map_fails(tmp_path):
    graph = _write(tmp_path, {"__init__.py": "IO_MODULES = ()\n", "newpkg/__init__.py": '"""No map."""\n',
                              "newpkg/x.py": ""})
    with pytest.raises(AssertionError, match="newpkg/__init__.py declares 0"):
        graph.pure()


@pytest.mark.parametrize("name", PURE)
def test_pure_core_imports_no_io(name):
    offenders = GRAPH.io_offenders(name)
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


def _versioned_json(node: ast.AST) -> bool:
    """A dict literal with a ``"v"`` key, a ``x["v"]`` subscript or an ``x.get("v")`` call: a versioned
    JSON object written or read by hand (wire/'s formats carry their version as ``"v"``)."""
    v = lambda n: isinstance(n, ast.Constant) and n.value == "v"  # noqa: E731
    return ((isinstance(node, ast.Dict) and any(v(k) for k in node.keys if k is not None))
            or (isinstance(node, ast.Subscript) and v(node.slice))
            or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and bool(node.args) and v(node.args[0])))


def test_wire_formats_live_in_wire():
    for name in MODULES:
        if name.startswith("prfaas_sglang.wire"):
            continue
        for node in _classes_and_calls(name):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                assert not any("Struct" in b for b in bases), f"{name}.{node.name} declares a wire struct outside wire/"
            assert not _versioned_json(node), (f"{name}:{node.lineno} writes or reads a versioned JSON object by hand "
                                               f"({ast.unparse(node)[:60]}); declare its format in prfaas_sglang/wire")


@pytest.mark.parametrize(("source", "caught"), [
    ('doc = {"v": 1, "served": True}', True), ('version = doc["v"]', True), ('version = doc.get("v")', True),
    ('doc = {"version": 1}', False), ('x = doc["value"]', False)])
def test_the_wire_rule_sees_a_hand_written_versioned_object(source, caught):
    assert any(_versioned_json(n) for n in ast.walk(ast.parse(source))) is caught


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


def test_module_level_imports_form_no_circle():
    """Importing any module of the package never re-enters one still being imported (a circle at import
    time works only by the order of its statements); imports inside functions may point back."""
    assert GRAPH.import_cycles() == []


def test_a_circle_of_module_level_imports_is_found_and_a_function_level_one_is_not(tmp_path):
    graph = _write(tmp_path, {
        "__init__.py": "IO_MODULES = ()\n",
        "a.py": "from prfaas_sglang import b\n",
        "b.py": "if True:\n    import prfaas_sglang.a\n",
        "c.py": "from prfaas_sglang import d\n",
        "d.py": "def late():\n    from prfaas_sglang import c\n",
    })
    assert graph.import_cycles() == [["prfaas_sglang.a", "prfaas_sglang.b"]]
    assert "prfaas_sglang.c" in graph.imports("prfaas_sglang.d")[0]  # still an import, just not at import time
    assert "prfaas_sglang.c" not in graph.module_level_imports("prfaas_sglang.d")


def test_the_checker_sees_function_level_imports(tmp_path):
    """The graph includes imports inside functions (where the package puts its lazy ones)."""
    assert "prfaas_sglang.router.app" in imports("prfaas_sglang.router.__main__")[0]
    assert "aiohttp" in imports("prfaas_sglang.router.__main__")[1]


SYNC_HTTP_CLIENTS = ("requests", "urllib.request", "http.client")


def test_one_synchronous_http_client():
    for name in MODULES:
        if name == "prfaas_sglang.adapters.http_sync":
            continue
        clients = {m for m in imports(name)[1] if m.startswith(SYNC_HTTP_CLIENTS)}
        assert not clients, f"{name} imports {sorted(clients)}; use prfaas_sglang.adapters.http_sync"


def test_the_gpu_checks_import_the_harness_not_the_other_way_round():
    assert "prfaas_sglang.gpu.e2e" in imports("prfaas_sglang.gpu.checks")[0]
    assert "prfaas_sglang.gpu.checks" not in closure("prfaas_sglang.gpu.e2e")
