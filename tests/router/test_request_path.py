"""The router's request path stays readable top to bottom (issue #58): the HTTP handler reaches
``policy.route`` in three calls (``server.dispatch`` -> ``RouterService.decide`` ->
``fleet.route_fleet`` -> ``policy.route``), and no function on the way, nor any of the request-path
module, is over 60 lines. Checked on the source (AST), so it stays true as the code grows."""

from __future__ import annotations

import ast

import pytest
from helpers import REPO_ROOT

ROUTER = REPO_ROOT / "prfaas_sglang" / "router"
MAX_LINES = 60
# module -> the functions of it on the request path (None: every function of the module)
REQUEST_PATH = {
    "server.py": None,
    "service.py": {"RouterService.route_input", "RouterService.decide", "RouterService.snapshot", "RouterService.begin",
                   "RouterService.prefill_done", "RouterService.finish", "RouterService.leg_failed",
                   "RouterService.first_token", "RouterService.token_gap", "RouterService.start_waiting",
                   "RouterService.stop_waiting"},
    "fleet.py": None,
    "policy.py": {"route"},
}


def functions(module: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function of ``router/<module>`` by qualified name (``Class.method``, ``outer.inner``)."""
    out = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[prefix + child.name] = child
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse((ROUTER / module).read_text()), "")
    return out


def called(fn: ast.AST) -> set[str]:
    """The names ``fn`` calls: ``f(...)`` as ``f``, ``x.f(...)`` as ``f``."""
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else "")
    return names


@pytest.mark.parametrize("module", sorted(REQUEST_PATH))
def test_no_function_on_the_request_path_is_over_60_lines(module):
    found = functions(module)
    wanted = REQUEST_PATH[module] or set(found)
    assert wanted <= set(found), f"router/{module} lost {sorted(wanted - set(found))}: update REQUEST_PATH"
    long = {name: found[name].end_lineno - found[name].lineno + 1 for name in wanted}
    assert {n: lines for n, lines in long.items() if lines > MAX_LINES} == {}


def test_the_handler_reaches_policy_route_in_three_calls():
    server, service, fleet = functions("server.py"), functions("service.py"), functions("fleet.py")
    assert "dispatch" in called(ast.parse((ROUTER / "app.py").read_text()))  # the generate paths' handler
    assert "decide" in called(server["dispatch"])  # 1: the handler asks the service
    assert "route_fleet" in called(service["RouterService.decide"])  # 2: the service asks the fleet
    assert "route" in called(fleet["route_fleet"])  # 3: the fleet asks each pair's policy
