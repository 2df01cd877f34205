"""The servers and the API use the replication ``Node`` through its public names only
(``depose``, ``unavailable_reason``, ...): its private parts are broker/replication's, so
that package can change them without breaking a caller it cannot see. And one hand writes
the node's state: only the applier assigns ``state`` and ``position`` (docs/DESIGN.md §4)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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


# --- one hand writes the node's state ---------------------------------------------------------

# The one module that assigns the replicated state and its position (docs/DESIGN.md §4).
_THE_WRITER = ROOT / "broker" / "replication" / "applier.py"
_STATE_NAMES = ("state", "position")
_SCANNED = ("broker", "clients", "log", "snapshot", "examples", "tests", "bench", "scripts")


def _names_in(value: ast.expr) -> list[str]:
    """Every name along ``a.b[0].c()``: ``a``, ``b``, ``c``."""
    names: list[str] = []
    while True:
        if isinstance(value, ast.Attribute):
            names.append(value.attr)
            value = value.value
        elif isinstance(value, ast.Subscript | ast.Call):
            value = value.value if isinstance(value, ast.Subscript) else value.func
        elif isinstance(value, ast.Name):
            names.append(value.id)
            return names
        else:
            return names


def _reaches_the_node(value: ast.expr) -> bool:
    """The object is a node, its applier or something reached through them:
    ``node``, ``self._node``, ``api.node.state``, ``lnode``, ``self.applier`` ..."""
    return any(n.strip("_").endswith(("node", "applier")) for n in _names_in(value))


def _assigned(tree: ast.AST) -> list[tuple[int, ast.expr, str]]:
    """(line, object, attribute) of every attribute assignment: ``=``, ``+=``, annotated,
    tuple unpacking, ``for`` and ``with ... as`` targets, and ``setattr(obj, "name", ...)``."""
    targets: list[ast.expr] = []
    found: list[tuple[int, ast.expr, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets.extend(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.For | ast.AsyncFor):
            targets.append(node.target)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            targets.append(node.optional_vars)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            found.append((node.lineno, node.args[0], node.args[1].value))
    while targets:
        target = targets.pop()
        if isinstance(target, ast.Tuple | ast.List):
            targets.extend(target.elts)
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        elif isinstance(target, ast.Attribute):
            found.append((target.lineno, target.value, target.attr))
    return found


def node_state_writers(root: Path) -> list[str]:
    """Every assignment of the node's ``state`` or ``position`` outside the applier.

    It is one when it assigns an attribute named ``state`` or ``position`` (of the node, of
    the applier, of the state machine: ``node.state.position``) and either sits in
    broker/replication, where every such attribute is the node's, or assigns it on an object
    reached through a node or an applier anywhere in the repository (tests included)."""
    writers = []
    replication = root / "broker" / "replication"
    for top in _SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            if path == root / _THE_WRITER.relative_to(ROOT):
                continue
            text = path.read_text()
            if not any(f".{name}" in text or "setattr" in text for name in _STATE_NAMES):
                continue  # (parsing only the files that may assign one: a quick scan)
            tree = ast.parse(text, filename=str(path))
            for line, value, attr in _assigned(tree):
                if attr in _STATE_NAMES and (
                    path.is_relative_to(replication) or _reaches_the_node(value)
                ):
                    shown = ast.unparse(value)
                    writers.append(f"{path.relative_to(root)}:{line}: {shown}.{attr} = ...")
    return writers


def test_only_the_applier_assigns_the_node_state_and_position() -> None:
    writers = node_state_writers(ROOT)
    assert not writers, (
        "only broker/replication/applier.py moves the node's state and position (apply an "
        "entry, pass a marker, install a snapshot through the applier):\n" + "\n".join(writers)
    )


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("broker/replication/snapshots.py", "def f(node, s):\n    node.state = s\n"),
        ("broker/replication/history.py", "def f(self):\n    self._node.position = (1, 2)\n"),
        ("broker/replication/leader.py", "def f(n):\n    n.position, x = (1, 2), 3\n"),
        ("broker/replication/leader.py", "def f(a):\n    a.applier.state.position = (1, 2)\n"),
        ("broker/api/handlers.py", "def f(api, s):\n    api.node.state = s\n"),
        ("tests/unit/test_x.py", "def f(node):\n    setattr(node.applier, 'position', (1, 1))\n"),
    ],
)
def test_the_check_finds_a_planted_writer(tmp_path: Path, path: str, source: str) -> None:
    for top in _SCANNED:
        (tmp_path / top).mkdir()
    planted = tmp_path / path
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_text(source)
    # The applier itself, and unrelated objects' states elsewhere, are no writers.
    writer = tmp_path / _THE_WRITER.relative_to(ROOT)
    writer.parent.mkdir(parents=True, exist_ok=True)
    writer.write_text("def f(self, s):\n    self.state = s\n")
    (tmp_path / "broker/core.py").write_text("def f(task, s):\n    task.state = s\n")
    assert len(node_state_writers(tmp_path)) == 1, node_state_writers(tmp_path)
