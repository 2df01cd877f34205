"""The state machine's task trees, Storm's acker: a tracked root's tree completes when the
XOR of its live tasks' values is 0, and fails (then replays the root if it may) when one of
its tasks ends in error, is cancelled or the tree times out (docs/DESIGN.md §2).

The failure and the end of a tree follow from task moves, so ``Books`` (broker/core/books.py)
does them; here: the tree's start, the checks of a finish's spawns, and the invariants.
"""

from __future__ import annotations

from collections.abc import Callable

from broker.core import entries as e
from broker.core.books import Books
from broker.core.indexes import TimerKind
from broker.core.records import (
    _MASK64,
    LIVE_STATES,
    TreeState,
    tree_value,
)


def use_ids(books: Books, spawn: tuple[e.Spawn, ...]) -> None:
    # Children not created still used up the ids the leader stamped for them.
    if spawn:
        books.max_task_id = max(books.max_task_id, *(s.task.id for s in spawn))


def spawn_refusal(books: Books, spawn: tuple[e.Spawn, ...]) -> str | None:
    """Why a finish may not create these children: all of them would not fit in a
    tenant's max_waiting (each tenant counted once, in the children's order)."""
    if not spawn:
        return None
    counts: dict[str, int] = {}
    for child in spawn:
        counts[child.task.tenant] = counts.get(child.task.tenant, 0) + 1
    for name, count in counts.items():
        tenant = books.tenants.get(name)
        limit = tenant.max_waiting if tenant is not None else 0
        if limit and books.queued(name) + count > limit:
            return f"spawn refused: tenant {name!r} max_waiting {limit} reached"
    return None


def start_tree(books: Books, root: int) -> None:
    """The root runs: its tree's timeout starts, once per run."""
    tree = books.trees.get(root)
    if tree is not None and tree.state == TreeState.PENDING and tree.deadline_ms is None:
        tree.deadline_ms = books.now_ms + tree.timeout_ms
        books.push_timer(tree.deadline_ms, TimerKind.TREE_DEADLINE, root)


def in_tree(books: Books, task_id: int, root: int) -> bool:
    task = books.tasks.get(task_id)
    return task is not None and task.root == root


def check_tree_invariants(books: Books, fail: Callable[[str], None]) -> None:
    """The tree records against their tasks (the tree index is checked by itself:
    broker/core/indexes.py)."""
    # O(tasks): recompute each tree's live members and the XOR of their values.
    live: dict[int, set[int]] = {}
    xor: dict[int, int] = {}
    for task in books.tasks.values():
        if task.root is None or task.state not in LIVE_STATES:
            continue
        live.setdefault(task.root, set()).add(task.id)
        xor[task.root] = xor.get(task.root, 0) ^ tree_value(task.id)
    for root_id, tree in books.trees.items():
        root = books.tasks.get(root_id)
        if tree.root != root_id or root is None or root.root != root_id:
            fail(f"tree record {tree.root} kept under {root_id} or without its root task")
        elif root.tenant != tree.tenant:
            fail(f"tree {root_id} of tenant {tree.tenant!r}, root's is {root.tenant!r}")
        if tree.state == TreeState.PENDING:
            if tree.ack_val != xor.get(root_id, 0):
                fail(f"tree {root_id} ack val differs from the XOR of its live tasks")
            if tree.ack_val == 0:
                fail(f"tree {root_id} is pending with ack val 0")
        elif root_id in live:
            fail(f"tree {root_id} is {tree.state} but tasks {sorted(live[root_id])} live")
        if not 0 <= tree.ack_val <= _MASK64 or tree.attempt < 1:
            fail(f"tree {root_id} ack val or attempt out of range")
    for root_id in live:
        if root_id not in books.trees:
            fail(f"live tasks of tree {root_id} that has no record")
