"""The layout of tests/ itself: helpers live in tests/support, test modules import none of
each other (docs/TESTING.md).

Every module under tests/ is parsed with ``ast`` (nothing is imported); an import of a test
module (``tests.<layer>.test_*`` or a bare ``test_*``) anywhere, at module level or inside
a function, is an error.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def imported_names(tree: ast.Module, package: str) -> list[str]:
    """Every module name ``tree`` imports (relative imports resolved against ``package``)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base]) if base else ".".join(parts)
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names)
    return names


def is_test_module(name: str) -> bool:
    """``tests.<layer>.test_*``, or a bare ``test_*`` (a sibling in a folder without
    ``__init__.py``, such as tests/sim)."""
    parts = name.split(".")
    if parts[0].startswith("test_"):
        return True
    return len(parts) >= 3 and parts[0] == "tests" and parts[2].startswith("test_")


def test_no_test_module_imports_another() -> None:
    offences = []
    for path in sorted(TESTS.rglob("*.py")):
        package = ".".join(path.relative_to(TESTS.parent).parent.parts)
        tree = ast.parse(path.read_text(), str(path))
        for name in imported_names(tree, package):
            if is_test_module(name):
                offences.append(f"{path.relative_to(TESTS.parent)} imports {name}")
    assert not offences, "move shared helpers to tests/support:\n" + "\n".join(offences)


def test_no_two_test_modules_share_a_file_name() -> None:
    """pytest imports test modules of folders without ``__init__.py`` by their file name
    alone: two layers with one name fail the whole run at collection (each passes alone)."""
    seen: dict[str, Path] = {}
    clashes: list[str] = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(TESTS)} and {path.relative_to(TESTS)}")
        seen.setdefault(path.name, path)
    assert not clashes, "test modules sharing a file name: " + "; ".join(clashes)
