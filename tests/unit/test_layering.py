"""Which package may import which: the layering of broker/, log/, snapshot/, clients/, examples/.

Every module is parsed with ``ast`` (nothing is imported) and every import in it, at module
level or inside a function, is checked against the rule of the module's package in RULES
below. A module's rule is the entry with the longest ``package`` prefix; a module without a
rule is an error too, so a new package has to be placed in the table. docs/DESIGN.md
("Code layout") describes the packages.

- ``may_import``: the project modules (and their submodules) a package may import besides
  its own. Project modules are those under broker, log, snapshot, clients and examples. A
  bare ``import clients`` (a root package, which holds no code of its own) is not checked.
- ``forbidden``: top-level modules (standard library or third-party) it must not import.

Boundaries the table keeps, in words:

- broker.core (the pure state machine) imports nothing from the project outside core and no
  IO, clock, randomness or concurrency module: no asyncio, socket, ssl, selectors,
  subprocess, threading, os, time, random, uuid, kazoo, uvicorn, httpx, pulsar,
  prometheus_client (so no metrics).
- wire/ (the worker wire protocol and its conversation table, which both sides speak) and
  broker.security (tokens, TLS: used by brokers and every client) import nothing from the
  project.
- broker.replication (the node) imports only core, log/ and snapshot/: nothing from
  broker.observability (no metrics, no task log) and no prometheus_client; it reports to
  an injected ReplicationMetrics and to listeners that broker.observability attaches.
- log/ and snapshot/ import nothing from broker/ (so none of broker.api, ha, workers,
  observability) and nothing from clients/.
- Nothing in broker/ imports clients/ (the development launchers in clients/dev are called
  from clients/cli/servers.py, tests and bench only).
- clients.dev (development launchers) imports only broker.security and the prctl helpers of
  clients.worker.sandbox.
- clients/ imports wire/ and, from broker/, only: the API
  models the worker reads (ClusterSummary), broker.security, the structured-log setup, the
  artifact checks and the artifact-name pattern (broker.core.entries.SHA256_RE) the worker
  shares with the broker;
  clients/cli/servers.py additionally the broker launch entry points it runs for `steward
  broker` / `steward standalone` (listed in its rule).
- The worker's rooms (WORKER_ROOMS) each import only the rooms below them: spark, then
  task_processes, runtime, link; the worker's base modules (config, task_api, artifacts,
  sandbox, task_env, task_identity, spark_remote_url) import no room, only the package's
  entry points (``clients.worker``, ``clients.worker.__main__``) take from every room.

Inside a package the modules import each other without a circle (:func:`import_circles`):
every import counts, ``TYPE_CHECKING`` ones too, since a type-only circle is the same
coupling (two modules that cannot be read, or split, apart).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = ("broker", "log", "snapshot", "clients", "examples", "wire")

# Nothing with IO, a clock, randomness or threads: apply must be deterministic and replayable.
_IMPURE = (
    "asyncio",
    "socket",
    "ssl",
    "selectors",
    "subprocess",
    "threading",
    "multiprocessing",
    "concurrent",
    "os",
    "time",
    "random",
    "uuid",
    "kazoo",
    "uvicorn",
    "httpx",
    "pulsar",
    "prometheus_client",
)
_NETWORK = ("asyncio", "socket", "subprocess", "kazoo", "uvicorn", "httpx", "prometheus_client")
_BROKER_SHARED_WITH_CLIENTS = (
    "broker.api.api_models",
    "broker.security",
    "broker.observability.logs",
    "broker.artifacts.artifact_check",
    "broker.core.entries",
)


@dataclass(frozen=True)
class Rule:
    package: str
    may_import: tuple[str, ...]
    forbidden: tuple[str, ...] = ()
    why: str = ""
    # Only the module itself (a root package), not its subpackages: so a new subpackage
    # has no rule until someone places it in the table.
    exact: bool = False


# fmt: off
RULES: tuple[Rule, ...] = (
    # --- broker/ ---------------------------------------------------------------------------
    Rule("broker", (), why="the root package holds no code", exact=True),
    Rule("broker.core", (), _IMPURE,
         "the pure state machine: same result on leader, followers and snapshot load"),
    Rule("broker.security", (), why="tokens and TLS, shared by brokers and every client"),
    Rule("broker.artifacts", ("broker.core.entries", "log.private_fs"),
         why="the artifact store and checks: used by the API, HA and the worker"),
    # No metrics, task log or logs setup: the node reports to the instruments it is given (a
    # Protocol of its own) and calls registered listeners; broker.observability attaches both.
    Rule("broker.replication", ("broker.core", "log", "snapshot"), ("prometheus_client",),
         "the replicated node: the state machine on the write-ahead log and snapshots; it"
         " imports nothing from broker.observability (observe_node attaches metrics, task log)"),
    Rule("broker.observability.logs", (), why="log setup, also used by workers and the CLI"),
    Rule("broker.observability",
         ("broker.core", "broker.replication", "broker.security.tls", "broker.api.api_models"),
         why="metrics, task log and dashboard read the state; they never drive it"),
    Rule("broker.api",
         ("broker.core", "broker.replication", "broker.security", "broker.artifacts",
          "broker.observability.dashboard", "broker.observability.metrics", "snapshot.peer"),
         why="the HTTP API: above the node, beside workers and HA, below the server"),
    Rule("broker.workers",
         ("wire", "broker.core", "broker.replication", "broker.security",
          "broker.api.edges", "broker.api.output_store", "broker.observability.logs"),
         why="the worker link: above the node; shares the API's edges and output store"),
    Rule("broker.ha",
         ("broker.core", "broker.replication", "broker.security", "broker.artifacts",
          "log.zk_list"),
         why="election and code replication: above the node, not the API or workers"),
    Rule("broker.leader",
         ("broker.core", "broker.replication", "broker.workers", "broker.ha", "log.zk_list"),
         why="the acting leader's duties: above the node, the worker link and code replication;"
             " below the servers that start them, beside the API"),
    Rule("broker.server", ("broker", "log", "snapshot"),
         why="the process entry points wire every broker package together"),
    # --- wire/ ------------------------------------------------------------------------------
    Rule("wire", (), _NETWORK,
         "the worker wire protocol and its conversation table: both sides import it, so it"
         " imports neither"),
    # --- log/ and snapshot/ ----------------------------------------------------------------
    Rule("log", (), why="the write-ahead log backends know nothing of the broker"),
    Rule("log.pulsar", ("log.api",),
         why="the Pulsar backend (writer, reader, store, config, wire format) on the ledger API"),
    Rule("snapshot", ("log.private_fs",), why="snapshot files know nothing of the broker"),
    # --- clients/ --------------------------------------------------------------------------
    Rule("clients", (), why="the root package holds no code", exact=True),
    Rule("clients.progress", ()),
    # The package: errors, routing (leader-following, retries), encoding, transport (its own
    # HTTP/1.1 client, sync and asyncio), sync and async, the producers.
    Rule("clients.client", ("broker.security", "broker.api.api_models"),
         why="the Python client speaks HTTP; it shares credentials, TLS and the API's "
             "request models (the producer checks a task as the broker decodes it)"),
    Rule("clients.worker", ("wire", *_BROKER_SHARED_WITH_CLIENTS, "log.private_fs"),
         why="a worker shares the wire protocol and checks with the broker, nothing else"),
    Rule("clients.dev", ("broker.security", "clients.worker.sandbox"),
         why="development launchers start brokers as processes, never import them"),
    Rule("clients.cli",
         ("wire", *_BROKER_SHARED_WITH_CLIENTS, "clients.client", "clients.progress",
          "clients.worker.__main__", "clients.demo.run"),
         why="the CLI: a client; `steward worker` and `steward demo` hand over to theirs"),
    # `steward broker` / `steward standalone` run a broker in this process, `cluster up` a
    # local cluster: only this module of the CLI imports their launch entry points.
    Rule("clients.cli.servers",
         ("wire", *_BROKER_SHARED_WITH_CLIENTS, "clients.cli", "clients.dev",
          "broker.server", "broker.api.http_api", "broker.api.edges",
          "broker.replication.node", "broker.workers.worker_link", "log.pulsar"),
         why="the CLI's broker launch entry points: `steward broker|standalone|cluster up`"),
    Rule("clients.demo",
         ("clients.client", "clients.progress", "clients.worker", "clients.dev"),
         why="the demo drives the public client and a local worker"),
    Rule("examples", ("clients.client", "clients.demo.run"),
         why="examples use the public client (and the demo's local cluster without --url)"),
)
# fmt: on


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    imported: str
    rule: Rule

    def __str__(self) -> str:
        allowed = ", ".join(self.rule.may_import) or "nothing from the project"
        return (
            f"{self.module}:{self.line} imports {self.imported}: rule for "
            f"{self.rule.package!r} ({self.rule.why or 'see RULES'}) allows {allowed}"
            + (f"; forbids {', '.join(self.rule.forbidden)}" if self.rule.forbidden else "")
        )


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def rule_for(module: str, rules: tuple[Rule, ...]) -> Rule | None:
    matching = [
        rule
        for rule in rules
        if module == rule.package or (not rule.exact and _within(module, rule.package))
    ]
    return max(matching, key=lambda rule: len(rule.package), default=None)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names imported from it) for every import in the file."""
    is_package = path.name == "__init__.py"
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            found.append((node.lineno, target, [alias.name for alias in node.names]))
    return found


def check_tree(root: Path, rules: tuple[Rule, ...] = RULES) -> list[str]:
    """Every layering problem under ``root``, one readable line each."""
    problems: list[str] = []
    for top in PROJECT_PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            module = module_name(path, root)
            rule = rule_for(module, rules)
            if rule is None:
                problems.append(f"{module}: no rule in RULES covers this module; add one")
                continue
            for line, imported, names in imports_of(path, module):
                if imported in PROJECT_PACKAGES or _within(imported, rule.package):
                    continue
                if imported.split(".")[0] in PROJECT_PACKAGES:
                    # `from broker.api import api_models` names the submodule it imports.
                    targets = [f"{imported}.{name}" for name in names] or [imported]
                    if any(_within(imported, allowed) for allowed in rule.may_import) or all(
                        any(_within(t, allowed) for allowed in rule.may_import) for t in targets
                    ):
                        continue
                    shown = f"{imported} ({', '.join(names)})" if names else imported
                    problems.append(str(Violation(module, line, shown, rule)))
                elif imported.split(".")[0] in rule.forbidden:
                    problems.append(str(Violation(module, line, imported, rule)))
    return problems


def import_circles(root: Path) -> list[tuple[str, ...]]:
    """Each package's import circles among its own modules (the ``.py`` files directly in
    it; a subpackage is a package of its own), counting every import: at module level,
    inside functions and under ``TYPE_CHECKING``. One sorted tuple per strongly connected
    set of two or more modules."""
    circles: list[tuple[str, ...]] = []
    for top in PROJECT_PACKAGES:
        for init in sorted((root / top).rglob("__init__.py")):
            package = module_name(init, root)
            files = {
                f"{package}.{path.stem}": path
                for path in sorted(init.parent.glob("*.py"))
                if path.name != "__init__.py"
            }
            edges: dict[str, set[str]] = {module: set() for module in files}
            for module, path in files.items():
                for _, imported, names in imports_of(path, module):
                    for target in (imported, *(f"{imported}.{name}" for name in names)):
                        if not target.startswith(package + "."):
                            continue
                        child = package + "." + target[len(package) + 1 :].split(".")[0]
                        if child in files and child != module:
                            edges[module].add(child)
            circles.extend(_strongly_connected(edges))
    return sorted(circles)


def _strongly_connected(edges: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Tarjan's algorithm: the sets of two or more nodes that all reach each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(edges[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(tuple(sorted(members)))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_package_has_an_import_circle() -> None:
    circles = sorted(import_circles(ROOT))
    assert not circles, "import circles inside a package (TYPE_CHECKING imports count):\n" + (
        "\n".join(" <-> ".join(circle) for circle in circles)
    )


def test_the_tree_keeps_its_layers() -> None:
    problems = check_tree(ROOT)
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_the_table_keeps_the_stated_boundaries() -> None:
    # The table itself, so a later edit to RULES cannot quietly open one of these.
    for rule in RULES:
        if _within(rule.package, "broker"):
            assert not [m for m in rule.may_import if _within(m, "clients")], rule
        if _within(rule.package, "log") or _within(rule.package, "snapshot"):
            assert not [m for m in rule.may_import if _within(m, "broker")], rule
        if _within(rule.package, "broker.core"):
            assert rule.may_import == () and set(_NETWORK) <= set(rule.forbidden), rule
        if _within(rule.package, "broker.replication"):
            assert not [m for m in rule.may_import if _within(m, "broker.observability")], rule
            assert "prometheus_client" in rule.forbidden, rule
        if _within(rule.package, "clients") and rule.package != "clients.cli.servers":
            broker_imports = [m for m in rule.may_import if _within(m, "broker")]
            assert set(broker_imports) <= set(_BROKER_SHARED_WITH_CLIENTS), rule


def test_broker_keeps_at_most_eight_modules_at_its_top() -> None:
    top = sorted(path.name for path in (ROOT / "broker").glob("*.py"))
    assert len(top) <= 8, f"broker/ has {len(top)} top-level modules: {top}"


def test_every_package_is_listed_for_the_wheel() -> None:
    # setuptools gets an explicit package list: a package missing from it is missing from the
    # image (the Dockerfile installs the wheel), which no in-tree test would notice.
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    on_disk = {
        module_name(init, ROOT)
        for top in ("broker", "log", "snapshot", "clients", "wire")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert on_disk - listed == set(), f"packages missing from pyproject.toml: {on_disk - listed}"


#: The worker's rooms, bottom up, each with the rooms it may import (docs/DESIGN.md §9).
WORKER_ROOMS: dict[str, tuple[str, ...]] = {
    "clients.worker.spark": (),
    "clients.worker.task_processes": ("clients.worker.spark",),
    "clients.worker.runtime": ("clients.worker.spark", "clients.worker.task_processes"),
    "clients.worker.link": ("clients.worker.spark", "clients.worker.runtime"),
}
_WORKER_ENTRY_POINTS = ("clients.worker", "clients.worker.__main__")


def worker_room_problems(root: Path) -> list[str]:
    """Imports between the worker's rooms against WORKER_ROOMS, one line each."""

    def room_of(module: str) -> str | None:
        return next((room for room in WORKER_ROOMS if _within(module, room)), None)

    problems: list[str] = []
    for path in sorted((root / "clients" / "worker").rglob("*.py")):
        module = module_name(path, root)
        if module in _WORKER_ENTRY_POINTS:
            continue
        own = room_of(module)
        allowed = WORKER_ROOMS[own] if own else ()
        for line, imported, names in imports_of(path, module):
            targets = [imported] if room_of(imported) else [f"{imported}.{n}" for n in names]
            for target in targets:
                room = room_of(target)
                if room is not None and room != own and room not in allowed:
                    where = f"room {own}" if own else "a base module of the worker"
                    problems.append(f"{module}:{line} imports {target}: {where} may not")
    return problems


def test_the_worker_rooms_keep_their_order() -> None:
    problems = worker_room_problems(ROOT)
    assert not problems, "worker room violations:\n" + "\n".join(problems)


def test_the_room_check_names_a_room_importing_one_above_it(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "clients/worker/spark/x.py": "from clients.worker.runtime import task_runtime\n",
            "clients/worker/config.py": "from clients.worker.link.worker_link import Worker\n",
            "clients/worker/link/y.py": "from clients.worker.runtime.task_runtime import T\n",
        },
    )
    problems = worker_room_problems(tmp_path)
    assert len(problems) == 2, problems
    assert any("clients.worker.spark.x:1 imports clients.worker.runtime" in p for p in problems)
    assert any("clients.worker.config:1" in p and "base module" in p for p in problems)


# --- the checker itself ---------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


_CLEAN_TREE = {
    "broker/__init__.py": "",
    "broker/core/__init__.py": "",
    "broker/core/state.py": "import hashlib\nfrom broker.core import entries\n",
    "broker/core/entries.py": "import re\n",
    "broker/api/__init__.py": "",
    "broker/api/http_api.py": "from broker.core import x\nfrom . import api_models\n",
    "broker/api/api_models.py": "",
    "log/__init__.py": "",
    "clients/__init__.py": "",
    "clients/client.py": "from broker.security.tls import client_context\n",
}


@pytest.mark.parametrize(
    "files",
    [
        {  # a type-only circle is still one
            "a.py": "import typing\nif typing.TYPE_CHECKING:\n    from log.x.b import B\n",
            "b.py": "from log.x import a\n",
        },
        {  # through a function-level import and a relative one, over three modules
            "a.py": "def f():\n    from .b import g\n",
            "b.py": "from log.x.c import h\n",
            "c.py": "from . import a\n",
        },
    ],
)
def test_import_circles_finds_a_planted_circle(tmp_path: Path, files: dict[str, str]) -> None:
    _write(tmp_path, {"log/__init__.py": "", "log/x/__init__.py": ""})
    _write(tmp_path, {f"log/x/{name}": text for name, text in files.items()})
    assert import_circles(tmp_path) == [tuple(f"log.x.{n[:-3]}" for n in sorted(files))]


def test_import_circles_passes_one_way_imports_and_other_packages(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "log/__init__.py": "",
            "log/x/__init__.py": "from log.x import a\n",  # the package's own __init__
            "log/x/a.py": "from log.x.b import B\nfrom log.y import a\n",
            "log/x/b.py": "from log.y.a import A\n",
            "log/y/__init__.py": "",
            "log/y/a.py": "from log.x import a\n",  # log.y and log.x: not inside one package
        },
    )
    assert import_circles(tmp_path) == []


def test_checker_passes_a_clean_tree(tmp_path: Path) -> None:
    _write(tmp_path, _CLEAN_TREE)
    assert check_tree(tmp_path) == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        # core reaching into IO, the API, metrics
        ("broker/core/state.py", "import asyncio\n", "broker.core.state:1 imports asyncio"),
        ("broker/core/state.py", "def f():\n    import time\n", "broker.core.state:2 imports time"),
        (
            "broker/core/state.py",
            "from broker.observability.metrics import BrokerMetrics\n",
            "imports broker.observability.metrics",
        ),
        ("broker/core/state.py", "from ..api import http_api\n", "imports broker.api"),
        # replication reaching into observability (metrics, the task log)
        (
            "broker/replication/node.py",
            "from broker.observability.metrics import BrokerMetrics\n",
            "broker.replication.node:1 imports broker.observability.metrics",
        ),
        (
            "broker/replication/applier.py",
            "def f():\n    from broker.observability import task_log\n",
            "imports broker.observability",
        ),
        ("broker/replication/leader.py", "import prometheus_client\n", "imports prometheus_client"),
        # log/ reaching into the broker
        ("log/file.py", "from broker.workers import worker_link\n", "log.file:1 imports"),
        # broker reaching into clients
        ("broker/api/http_api.py", "import clients.dev.zk\n", "imports clients.dev.zk"),
        # a client importing the broker's internals
        (
            "clients/client.py",
            "from broker.replication.node import Node\n",
            "rule for 'clients.client'",
        ),
        # a module no rule covers
        ("broker/newthing/x.py", "", "broker.newthing.x: no rule"),
    ],
)
def test_checker_names_a_planted_violation(
    tmp_path: Path, module: str, source: str, expected: str
) -> None:
    _write(tmp_path, {**_CLEAN_TREE, module: source})
    problems = check_tree(tmp_path)
    assert len(problems) == 1, problems
    assert expected in problems[0]
