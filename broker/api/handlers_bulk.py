"""POST /api/v1/tasks/cancel: cancel the live tasks that match a filter, in bounded
batches (one CancelTasks entry each, docs/DESIGN.md §6, "Bulk cancel")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import msgspec

from broker.api import api_models as m
from broker.api.common import HttpError, Request, decode, json_encoder, rejected_error, to_epoch_ms
from broker.api.context import ApiContext
from broker.core import LIVE_STATES, CancelCount, Rejected, StateMachine
from broker.core import entries as e
from broker.replication.node import Stamp
from broker.security.auth import Role as CallerRole

_decoder: Final = msgspec.json.Decoder(m.BulkCancelBody)
_LIVE: Final = frozenset(s.value for s in LIVE_STATES)


def _scope(request: Request, stated: str | None) -> str | None:
    """The tenant whose tasks may be cancelled: a tenant token's own; an admin's choice
    (None: every tenant's)."""
    principal = request.principal
    if principal.role is CallerRole.TENANT:
        if stated is not None and stated != principal.tenant:
            raise HttpError(403, "forbidden", "a tenant token cancels its own tenant's tasks only")
        return principal.tenant
    if principal.role is not CallerRole.ADMIN:
        raise HttpError(403, "forbidden", "this needs a tenant or admin token")
    return stated


def matching(
    state: StateMachine,
    *,
    tenant: str | None,
    task_type: str | None,
    states: frozenset[str],
    tree: int | None,
    before_ms: int | None,
) -> list[int]:
    """Ids of the live tasks matching every given filter, ascending."""
    if tree is not None:
        candidates: set[int] = set(state.tree_live.get(tree, ()))
    else:
        candidates = set().union(*(state.by_state[s] for s in states))
    tasks = state.tasks
    out = []
    for task_id in candidates:
        task = tasks[task_id]
        if (
            task.state in states
            and (tenant is None or task.tenant == tenant)
            and (task_type is None or task.type == task_type)
            and (before_ms is None or task.created_ms < before_ms)
        ):
            out.append(task_id)
    out.sort()
    return out


def _batch_entry(
    batch: tuple[int, ...], reason: str, tenant: str | None
) -> Callable[[Stamp], e.Entry]:
    def build(stamp: Stamp) -> e.Entry:
        return e.CancelTasks(time_ms=stamp.now_ms, task_ids=batch, reason=reason, tenant=tenant)

    return build


async def cancel_tasks(api: ApiContext, request: Request) -> tuple[int, bytes]:
    body = decode(_decoder, request.body)
    if all(
        v is None for v in (body.tenant, body.type, body.state, body.tree, body.submitted_before)
    ):
        raise HttpError(
            400,
            "invalid_request",
            "name at least one filter: tenant, type, state, tree or submitted_before",
        )
    tenant = _scope(request, body.tenant)
    if body.state is not None and body.state.value not in _LIVE:
        raise HttpError(
            400, "invalid_request", f"state must be a live state: one of {sorted(_LIVE)}"
        )
    states = _LIVE if body.state is None else frozenset({body.state.value})
    before_ms = to_epoch_ms(body.submitted_before, "submitted_before")
    reason = body.reason if body.reason is not None else "cancelled by request"
    if not 0 < len(reason) <= 1000:
        raise HttpError(400, "invalid_request", "reason must hold 1 to 1000 characters")
    ids = matching(
        api.node.state,
        tenant=tenant,
        task_type=body.type,
        states=states,
        tree=body.tree,
        before_ms=before_ms,
    )
    cancelled = skipped = batches = 0
    for start in range(0, len(ids), e.MAX_CANCEL_BATCH):
        batch = tuple(ids[start : start + e.MAX_CANCEL_BATCH])
        # Each batch is its own entry: a bulk cancel never holds the log for long, and a
        # task that ended meanwhile is skipped by apply (docs/DESIGN.md §6).
        result = await api.node.propose(_batch_entry(batch, reason, tenant))
        if isinstance(result, Rejected):
            raise rejected_error(result)
        assert isinstance(result, CancelCount)
        cancelled += result.cancelled
        skipped += result.skipped
        batches += 1
    answer = m.BulkCancelResult(
        matched=len(ids), cancelled=cancelled, skipped=skipped, batches=batches
    )
    return 200, json_encoder.encode(answer)
