"""Handlers of tracked task trees: one tree's view and the list of trees by state.

A tree's record (broker/core/records.py, TreeRecord) is Storm's acker entry; these views
add what the record does not hold, read from the replicated state at request time: its
tasks by state (the ``tree_members`` index), the live tasks it waits for
(``tree_live``) and its age (docs/DESIGN.md §2).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator
from typing import Final

from broker.api import api_models as m
from broker.api.common import HttpError, Request, int_param, iso_ms, json_encoder
from broker.api.context import ApiContext
from broker.core import StateMachine, TaskState, TreeRecord, TreeState
from broker.security.auth import Role as CallerRole

#: The reason the state machine gives a run that timed out (broker/core/state.py, _fire).
TIMED_OUT_REASON: Final = "tree timed out"
#: The states GET /api/v1/trees filters on.
TREE_STATES: Final = ("pending", "completed", "failed", "timed_out")
#: Most pending anchors one view lists (pending_count counts them all).
MAX_ANCHORS_LISTED: Final = 100


def view_state(tree: TreeRecord) -> str:
    """The tree's state as the API shows it: ``timed_out`` is a tree that failed for good
    because its last run timed out; ``failed`` any other failure."""
    if tree.state == TreeState.FAILED and tree.reason == TIMED_OUT_REASON:
        return "timed_out"
    return tree.state


def tree_detail(state: StateMachine, tree: TreeRecord, now_ms: int) -> m.TreeDetail:
    """The view of one tree at ``now_ms`` (wall clock, for its age)."""
    root = state.tasks[tree.root]  # a record lives exactly as long as its root task
    counts = {s.value: 0 for s in TaskState}
    tasks = state.tasks
    for task_id in state.tree_members.get(tree.root, ()):
        counts[tasks[task_id].state] += 1
    live = state.tree_live.get(tree.root, set()) if tree.state == TreeState.PENDING else set()
    end_ms = tree.ended_ms if tree.ended_ms is not None else now_ms
    return m.TreeDetail(
        root=tree.root,
        tenant=tree.tenant,
        state=view_state(tree),
        attempt=tree.attempt,
        timeout_s=tree.timeout_ms / 1000,
        started_at=iso_ms(root.created_ms) or "",
        age_s=max(0, end_ms - root.created_ms) / 1000,
        tasks=counts,
        pending_anchors=heapq.nsmallest(MAX_ANCHORS_LISTED, live),
        pending_count=len(live),
        deadline=iso_ms(tree.deadline_ms) if tree.state == TreeState.PENDING else None,
        ended_at=iso_ms(tree.ended_ms),
        reason=tree.reason,
    )


def list_trees(
    state: StateMachine,
    *,
    tree_state: str | None,
    tenant: str | None,
    after: int,
    limit: int,
) -> list[TreeRecord]:
    """Matching trees with root id > ``after``, the lowest roots first, at most ``limit``."""

    def matching() -> Iterator[int]:
        for root_id, tree in state.trees.items():
            if root_id <= after or (tenant is not None and tree.tenant != tenant):
                continue
            if tree_state is not None and view_state(tree) != tree_state:
                continue
            yield root_id

    return [state.trees[root] for root in heapq.nsmallest(limit, matching())]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


async def get_tree(api: ApiContext, request: Request) -> tuple[int, bytes]:
    root = int(request.params[0])
    if request.query:
        raise HttpError(
            400, "invalid_request", f"unknown query parameters: {sorted(request.query)}"
        )
    state = api.node.state
    tree = state.tree(root)
    # Another tenant's tree answers like a missing one: its existence is not shown.
    if tree is None or not request.principal.may_see_tenant(tree.tenant):
        raise HttpError(404, "not_found", f"task {root} does not root a tracked tree")
    return 200, json_encoder.encode(tree_detail(state, tree, _now_ms()))


async def get_trees(api: ApiContext, request: Request) -> tuple[int, bytes]:
    query = request.query
    unknown = set(query) - {"state", "tenant", "limit", "after"}
    if unknown:
        raise HttpError(400, "invalid_request", f"unknown query parameters: {sorted(unknown)}")
    tree_state = query.get("state")
    if tree_state is not None and tree_state not in TREE_STATES:
        raise HttpError(400, "invalid_request", f"state must be one of {list(TREE_STATES)}")
    tenant = query.get("tenant")
    principal = request.principal
    if principal.role is CallerRole.TENANT:
        if tenant is not None and tenant != principal.tenant:
            raise HttpError(403, "forbidden", "a tenant token lists its own tenant's trees only")
        tenant = principal.tenant
    limit = int_param(query, "limit", 100, 1, api.config.max_list_limit)
    after = int_param(query, "after", 0, 0, 2**62)
    state = api.node.state
    trees = list_trees(state, tree_state=tree_state, tenant=tenant, after=after, limit=limit)
    now_ms = _now_ms()
    views = [tree_detail(state, tree, now_ms) for tree in trees]
    next_after = trees[-1].root if len(trees) == limit else None
    return 200, json_encoder.encode(m.TreeList(views, next_after))
