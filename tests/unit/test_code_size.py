"""No module over 800 lines and no class over 400 (docs/DESIGN.md §9): split before it grows.

A file that keeps growing holds more than one concern; so does a class. Tests count too for
files (a test module that big mixes subjects), not for classes.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 800
MAX_CLASS_LINES = 400
SOURCE_PACKAGES = ("broker", "clients", "log", "snapshot", "examples", "bench")


def _python_files(*packages: str) -> list[Path]:
    return [path for package in packages for path in sorted((ROOT / package).rglob("*.py"))]


def test_no_module_over_800_lines() -> None:
    too_long = [
        f"{path.relative_to(ROOT)}: {lines} lines"
        for path in _python_files(*SOURCE_PACKAGES, "tests")
        if (lines := len(path.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not too_long, "split along its concerns:\n" + "\n".join(too_long)


def test_no_class_over_400_lines() -> None:
    too_long = []
    for path in _python_files(*SOURCE_PACKAGES):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}: class {node.name}, {lines} lines")
    assert not too_long, "give the class collaborators:\n" + "\n".join(too_long)
