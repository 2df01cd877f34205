"""The fit rule (broker/core/fit.py, docs/DESIGN.md §6 "Fit and admission"): whether a task
fits a worker, decided in one module that the scheduler, ``apply`` and the submit placement
all ask. Its functions, then an ``ast`` check that no other module under broker/ defines
them again, an epsilon for resources, or the ``"*"`` pool."""

from __future__ import annotations

import ast
from pathlib import Path

from broker.core import fit
from broker.core.fit import (
    ANY_TYPE,
    RESOURCE_EPSILON,
    fits,
    pool_of,
    resources_fit,
    resources_held,
    resources_left,
    serves_tenant,
    within_global_limits,
)
from broker.core.records import Task

BROKER = Path(__file__).resolve().parents[2] / "broker"
FIT_MODULE = BROKER / "core" / "fit.py"


def _defined_names(tree: ast.AST) -> set[str]:
    """Every name a module defines anywhere: functions, classes, assigned names and
    attributes (``self._EPSILON = ...``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Name):
                    names.add(part.id)
                elif isinstance(part, ast.Attribute):
                    names.add(part.attr)
    return names


def _star_constants(tree: ast.AST) -> list[int]:
    """Lines with the string constant "*" in code (docstrings and comments aside)."""
    docstrings = {
        id(body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and (body := node.body)
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
    }
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value == "*" and id(node) not in docstrings
    ]


def test_the_fit_rule_is_defined_in_one_module_only() -> None:
    # The rule's names: what broker/core/fit.py defines at module level.
    fit_module = ast.parse(FIT_MODULE.read_text())
    fit_names: set[str] = set()
    for node in fit_module.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            fit_names.add(node.name)
        elif isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            fit_names.update(t.id for t in targets if isinstance(t, ast.Name))
    assert {"fits", "pool_of", "resources_fit", "RESOURCE_EPSILON", "ANY_TYPE"} <= fit_names
    problems: list[str] = []
    for path in sorted(BROKER.rglob("*.py")):
        if path == FIT_MODULE:
            continue
        where = path.relative_to(BROKER.parent)
        tree = ast.parse(path.read_text(), str(path))
        defined = _defined_names(tree)
        for name in sorted(defined & fit_names):
            problems.append(f"{where} defines {name}, the fit rule's (broker/core/fit.py)")
        for name in sorted(n for n in defined if "epsilon" in n.lower()):
            problems.append(f"{where} defines {name}: the fit rule's RESOURCE_EPSILON is the one")
        for line in _star_constants(tree):
            problems.append(f"{where}:{line} spells the '*' pool: use fit.ANY_TYPE / pool_of")
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_second_definition(tmp_path: Path) -> None:
    # The check itself: a module with its own epsilon, pool rule and "*" is caught.
    source = (
        "_EPSILON = 1e-9\n"
        "class W:\n"
        "    def __init__(self):\n"
        "        self.resource_epsilon = 0.0\n"
        "def pool_of(types, t):\n"
        "    '''*'''\n"
        "    return t if t in types else '*'\n"
    )
    tree = ast.parse(source)
    assert {"_EPSILON", "resource_epsilon", "pool_of"} <= _defined_names(tree)
    assert _star_constants(tree) == [7]


def test_a_type_listed_by_name_uses_its_own_pool_never_the_star_pool() -> None:
    assert pool_of({"spark": 0, ANY_TYPE: 4}, "spark") == "spark"
    assert pool_of({"spark": 2, ANY_TYPE: 4}, "noop") == ANY_TYPE
    assert pool_of({"spark": 2}, "noop") is None
    assert pool_of({}, "noop") is None


def test_a_worker_without_a_tenant_list_serves_every_tenant() -> None:
    assert serves_tenant([], "acme") and serves_tenant(None, "acme")
    assert serves_tenant(["acme"], "acme") and not serves_tenant(["acme"], "other")


def _holding(task_id: int, resources: dict[str, float]) -> Task:
    return Task(
        id=task_id,
        type="a",
        tenant="t",
        params=b"null",
        state="running",
        created_ms=0,
        updated_ms=0,
        resources=resources,
    )


def test_fractional_asks_adding_up_to_the_capacity_fit() -> None:
    tenth = _holding(1, {"cpu": 0.1})
    left = resources_left({"cpu": 1.0}, [tenth] * 9)
    assert left["cpu"] != 0.1  # float rounding: 1.0 - 9 * 0.1 is not 0.1 exactly
    assert resources_fit({"cpu": 0.1}, left)
    assert not resources_fit({"cpu": 0.1 + 10 * RESOURCE_EPSILON}, left)


def test_a_resource_the_worker_lacks_fits_only_a_zero_ask() -> None:
    assert not resources_fit({"gpu": 1.0}, {"cpu": 4.0})
    assert resources_fit({"gpu": 0.0}, {"cpu": 4.0})
    assert resources_fit({}, {})


def test_global_limits_count_only_limited_resources() -> None:
    holders = [
        _holding(1, {"lic": 2.0, "cpu": 8.0}),
        _holding(2, {"lic": 1.0}),
    ]
    used = resources_held(holders, {"lic": 4.0})
    assert used == {"lic": 3.0}
    assert within_global_limits({"lic": 1.0, "cpu": 100.0}, {"lic": 4.0}, used)
    assert not within_global_limits({"lic": 1.5}, {"lic": 4.0}, used)
    assert within_global_limits({"lic": 0.0}, {"lic": 0.0}, {"lic": 5.0})


def test_fits_needs_the_tenant_a_free_slot_and_the_resources() -> None:
    assert fits(["t"], "t", 1, {"cpu": 1.0}, {"cpu": 1.0})
    assert not fits(["u"], "t", 1, {"cpu": 1.0}, {"cpu": 1.0})
    assert not fits([], "t", 0, {"cpu": 1.0}, {"cpu": 1.0})
    assert not fits([], "t", 1, {"cpu": 0.5}, {"cpu": 1.0})
    assert fit.fits([], "t", 3, {}, {})
