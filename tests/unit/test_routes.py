"""The route table (broker/api/routes.py) is the one place the API's routes are declared:
no other module of broker/api holds a path string, every route has a permission, and
docs/API.md lists exactly the table's routes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from broker.api.http_api import compile_routes
from broker.api.routes import PUBLIC_PATHS, ROUTES, Permission

ROOT = Path(__file__).resolve().parents[2]
API_PACKAGE = ROOT / "broker" / "api"
API_DOC = ROOT / "docs" / "API.md"
ROUTED_PATHS = {route.path for route in ROUTES}


def _path_strings(source: str) -> list[tuple[int, str]]:
    """String literals that name a route: under /api/, or a routed path (e.g. "/healthz")."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            if value.startswith("/api/") or value in ROUTED_PATHS:
                found.append((node.lineno, value))
    return found


def test_no_path_string_outside_the_route_table() -> None:
    modules = sorted(API_PACKAGE.rglob("*.py"))
    assert API_PACKAGE / "routes.py" in modules
    offenders = [
        f"{module.relative_to(ROOT)}:{line}: {value!r}"
        for module in modules
        if module.name != "routes.py"
        for line, value in _path_strings(module.read_text())
    ]
    assert not offenders, "path strings belong in broker/api/routes.py:\n" + "\n".join(offenders)


def test_the_path_check_finds_paths() -> None:
    source = 'A = "/api/v1/tasks"\nB = "/healthz"\nC = "/api/v1/x/" + "y"\nD = "a /healthz"\n'
    assert [value for _, value in _path_strings(source)] == [
        "/api/v1/tasks",
        "/healthz",
        "/api/v1/x/",
    ]


def test_every_route_has_a_permission_and_is_declared_once() -> None:
    seen: set[tuple[str, str]] = set()
    for route in ROUTES:
        assert isinstance(route.permission, Permission), route
        assert route.method in {"GET", "POST", "PUT", "DELETE"}, route
        assert route.summary, route
        assert (route.method, route.path) not in seen, f"{route.method} {route.path} twice"
        seen.add((route.method, route.path))
        # Every {param} of the path is declared (dispatch matches its regex).
        declared = {p.name for p in route.params if p.where == "path"}
        assert set(re.findall(r"\{(\w+)\}", route.path)) == declared, route.path
    groups = compile_routes(ROUTES)
    assert sum(len(group.handlers) for group in groups) == len(ROUTES)


def test_public_paths_are_derived_from_the_table() -> None:
    # Served without credentials: health, this document and the dashboard's files only.
    assert {"/healthz", "/api/v1/openapi.json", "/", "/dashboard/{name}"} == PUBLIC_PATHS
    for route in ROUTES:
        if route.path in PUBLIC_PATHS:
            assert route.method == "GET" and route.permission.public


def _documented_routes() -> set[tuple[str, str]]:
    """Every `METHOD /path` in docs/API.md (a query string dropped)."""
    text = API_DOC.read_text()
    found = re.findall(r"`(GET|POST|PUT|PATCH|DELETE|HEAD|OPTIONS) (/[^`?\s]*)[^`]*`", text)
    return {(method, path) for method, path in found}


def test_api_doc_lists_exactly_the_routes_of_the_table() -> None:
    documented = _documented_routes()
    table = {(route.method, route.path) for route in ROUTES}
    missing = sorted(table - documented)
    assert not missing, f"routes missing from docs/API.md: {missing}"
    unknown = sorted(documented - table)
    assert not unknown, f"docs/API.md lists routes the table does not have: {unknown}"
