"""The servers and the API use the replication ``Node`` through its public names only
(``depose``, ``unavailable_reason``, ...): its private parts are broker/replication's, so
that package can change them without breaking a caller it cannot see."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _is_a_node(value: ast.expr) -> bool:
    """``node``, ``self.node``, ``api.node``, ... (how every caller names its Node)."""
    name = value.attr if isinstance(value, ast.Attribute) else getattr(value, "id", "")
    return name in ("node", "_node")


def test_nothing_outside_broker_replication_reaches_into_the_node() -> None:
    private = []
    for package in ("broker", "clients"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.is_relative_to(ROOT / "broker" / "replication"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and _is_a_node(node.value)
                ):
                    private.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert not private, "make it a public name of Node:\n" + "\n".join(private)
