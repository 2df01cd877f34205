"""Handlers of the task resource: submit, read (long poll), list, search, cancel, logs."""

from __future__ import annotations

import logging
import math
from typing import Final

import msgspec
from msgspec import UNSET, UnsetType

from broker.api import api_models as m
from broker.api.common import (
    FINAL,
    TASK_STATES,
    HttpError,
    Request,
    admission_error,
    bool_param,
    decode,
    error_code,
    float_param,
    idempotency_key,
    int_param,
    iso_ms,
    json_encoder,
    rejected_error,
    task_view,
    to_epoch_ms,
)
from broker.api.context import ApiContext
from broker.api.output_store import PROXIED_HEADER, LogsError, logs_answer, logs_from_leader
from broker.core import (
    MAX_TREE_TIMEOUT_MS,
    Rejected,
    ReplayedResults,
    TaskRef,
    TreeState,
)
from broker.core import entries as e
from broker.core.admission import admission_problem
from broker.replication.node import Stamp
from broker.security.auth import ANONYMOUS_ADMIN, Principal
from broker.security.auth import Role as CallerRole

logger = logging.getLogger(__name__)

_submit_decoder: Final = msgspec.json.Decoder(m.SubmitBody)


class _BatchKeys(msgspec.Struct):
    """The names of the fields each task of a batch sets (values left undecoded)."""

    tasks: list[dict[str, msgspec.Raw]]


_batch_keys_decoder: Final = msgspec.json.Decoder(_BatchKeys)
_SHARED_DEFAULTS: Final = {
    f.name: f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
    for f in msgspec.structs.fields(m.SubmitBody)
    if f.name in m.SHARED_TASK_FIELDS
}
# Fields of one task only: a batch sets them in each task, never next to "tasks".
_ONE_TASK_FIELDS: Final = {"params": UNSET, "slot": None}
# A record's state (a str) as the API's enum: a dict lookup (TaskState(value) costs ~1 us).
_STATE: Final = {state.value: state for state in m.TaskState}


def _spec_fields(
    api: ApiContext, request: Request, item: m.TaskSubmission | m.SubmitBody, index: int | None
) -> e.TaskSpec:
    where = "" if index is None else f"tasks[{index}]: "
    tenant = api.tenant_of(request, item.tenant)
    if item.type is None:
        raise HttpError(400, "invalid_request", f"{where}type is required")
    params = b"null" if isinstance(item.params, UnsetType) else bytes(item.params)
    try:
        deadline_ms = to_epoch_ms(item.deadline, "deadline")
        start_after_ms = to_epoch_ms(item.start_after, "start_after")
    except HttpError as exc:
        raise HttpError(exc.status, exc.code, where + exc.message) from None
    # id 0 is a placeholder: the leader assigns ids when it logs the entry.
    spec = e.TaskSpec(
        id=0,
        type=item.type,
        tenant=tenant,
        params=params,
        slot=item.slot,
        max_attempts=item.max_attempts,
        max_lost=item.max_lost,
        deadline_ms=deadline_ms,
        start_after_ms=start_after_ms,
        resources=item.resources,
        transaction=item.transaction,
        code=item.code,
        track_tree=item.track_tree,
        tree_timeout_ms=_tree_timeout_ms(item, where),
        after=tuple(item.after),
        priority=item.priority,
        retry_backoff_ms=_seconds_ms(item.retry_backoff_s, "retry_backoff_s", where),
        retry_backoff_max_ms=(
            e.DEFAULT_RETRY_BACKOFF_MAX_MS
            if item.retry_backoff_max_s is None
            else _seconds_ms(item.retry_backoff_max_s, "retry_backoff_max_s", where)
        ),
    )
    problem = admission_problem(
        api.node.state,
        spec,
        max_params_bytes=api.config.max_params_bytes,
        code_owners_enforced=api.config.auth.enabled,
        check_served_type=not item.allow_unknown_type,
    )
    if problem is not None:
        raise admission_error(problem, where)
    if spec.transaction is not None and not _owns_transaction(api, request, spec.transaction):
        raise HttpError(404, "not_found", f"{where}transaction {spec.transaction} is not open")
    return spec


def _owns_transaction(api: ApiContext, request: Request, txn_id: int) -> bool:
    principal = request.principal
    if principal.role is not CallerRole.TENANT:
        return True
    txn = api.node.state.transactions.get(txn_id)
    return txn is None or txn.tenant == principal.tenant


def _seconds_ms(value: float, name: str, where: str) -> int:
    """A duration in seconds as milliseconds; its upper bound is validate_task_spec's."""
    if not (math.isfinite(value) and value >= 0):
        raise HttpError(400, "invalid_request", f"{where}{name} must be a number >= 0")
    # Past any bound: rejected as over it (1e308 s would overflow to inf in milliseconds).
    return round(min(value, 2**62 / 1000) * 1000)


def _tree_timeout_ms(item: m.TaskSubmission | m.SubmitBody, where: str) -> int:
    if item.tree_timeout_s is None:
        return e.DEFAULT_TREE_TIMEOUT_MS
    if not item.track_tree:
        raise HttpError(400, "invalid_request", f"{where}tree_timeout_s needs track_tree")
    limit_s = MAX_TREE_TIMEOUT_MS / 1000
    if not (math.isfinite(item.tree_timeout_s) and 0.001 <= item.tree_timeout_s <= limit_s):
        raise HttpError(
            400,
            "invalid_request",
            f"{where}tree_timeout_s must be between 0.001 and {limit_s:g} seconds",
        )
    return round(item.tree_timeout_s * 1000)


def _check_submit_rate(api: ApiContext, specs: list[e.TaskSpec]) -> None:
    """The leader refuses a submission over a tenant's submit rate before logging it
    (a follower leaves it to the leader it redirects to)."""
    if not api.node.is_leader:
        return
    counts: dict[str, int] = {}
    for spec in specs:
        counts[spec.tenant] = counts.get(spec.tenant, 0) + 1
    tenants = api.node.state.tenants
    for name, count in counts.items():
        tenant = tenants.get(name)
        if tenant is None or tenant.submit_rate <= 0:
            continue
        wait_s = api.submit_limiter.take(name, tenant.submit_rate, tenant.submit_burst, count)
        if wait_s is None:
            continue
        burst = api.submit_limiter.capacity(tenant.submit_rate, tenant.submit_burst)
        if math.isinf(wait_s):
            raise HttpError(
                400,
                "invalid_request",
                f"a batch of {count} tasks of tenant {name!r} is over its submit burst "
                f"({burst:g}): send smaller batches",
            )
        raise HttpError(
            429,
            "rate_limited",
            f"tenant {name!r} is over its submit rate ({tenant.submit_rate:g} tasks/s, "
            f"burst {burst:g}): retry in {wait_s:.3f} s",
            # Not "retryable" (that flag makes clients fail over to another broker, as
            # for a 503): the caller waits Retry-After, like after tenant_queue_full.
            ((b"retry-after", b"%d" % max(1, math.ceil(wait_s))),),
        )


def _batch_items(body: m.SubmitBody, raw: bytes) -> list[m.TaskSubmission]:
    """A batch's tasks with the shared fields given next to ``tasks`` applied to each task
    that does not set them itself (docs/API.md, "Batches"). A task's own tenant must be
    the batch's: one body files its tasks for one tenant, or names each task's."""
    assert body.tasks is not None
    for name, default in _ONE_TASK_FIELDS.items():
        if getattr(body, name) != default:
            raise HttpError(
                400,
                "invalid_request",
                f"{name} names one task: set it in each task of tasks, not next to tasks",
            )
    shared = {
        name: value
        for name, default in _SHARED_DEFAULTS.items()
        if (value := getattr(body, name)) != default
    }
    if not shared:
        return body.tasks
    # Which fields each task sets (its value may equal the default, and still wins).
    keys = _batch_keys_decoder.decode(raw).tasks
    tenant = shared.get("tenant")
    items = []
    for index, (item, named) in enumerate(zip(body.tasks, keys, strict=True)):
        if tenant is not None and not isinstance(item.tenant, UnsetType) and item.tenant != tenant:
            raise HttpError(
                400,
                "invalid_request",
                f"tasks[{index}]: tenant {item.tenant!r} differs from the batch's tenant "
                f"{tenant!r}: leave it out of the task, or send the tasks in separate batches",
            )
        fill = {
            # A copy each: no two tasks share a mutable value.
            name: value.copy() if isinstance(value, dict | list) else value
            for name, value in shared.items()
            if name not in named
        }
        items.append(msgspec.structs.replace(item, **fill) if fill else item)
    return items


async def submit(api: ApiContext, request: Request) -> tuple[int, bytes]:
    body = decode(_submit_decoder, request.body)
    key = idempotency_key(request, body.idempotency_key)
    if body.tasks is not None:
        if body.type is not None:
            raise HttpError(
                400,
                "invalid_request",
                "type names one task: send either {'tasks': [...]} with a type in each "
                "task, or one task, not both",
            )
        if not 0 < len(body.tasks) <= api.config.max_tasks_per_request:
            raise HttpError(
                400,
                "invalid_request",
                f"tasks must hold 1 to {api.config.max_tasks_per_request} tasks",
            )
        items = _batch_items(body, request.body)
        specs = [_spec_fields(api, request, item, i) for i, item in enumerate(items)]
    else:
        specs = [_spec_fields(api, request, body, None)]

    _check_submit_rate(api, specs)
    placer = api.node.placer
    placed: tuple[e.Assignment, ...] = ()

    def build(stamp: Stamp) -> e.Entry:
        nonlocal placed
        ids = stamp.task_ids(len(specs))
        tasks = tuple(
            msgspec.structs.replace(spec, id=task_id)
            for spec, task_id in zip(specs, ids, strict=True)
        )
        if placer is not None:
            # A task with dependencies waits for them: never placed at once.
            placed = placer.place(tuple(t for t in tasks if not t.after), stamp.now_ms)
        return e.SubmitTasks(
            time_ms=stamp.now_ms,
            tasks=tasks,
            idempotency_key=key,
            assignments=placed,
            v=e.submit_version(tasks, placed),
        )

    try:
        results = await api.node.propose(build)
    finally:
        # The placements are this submit's to give back, once its entry is settled
        # (applied or never to be); the placer counts them in flight until then.
        if placer is not None and placed:
            placer.release(placed)
    assert isinstance(results, list)
    # A replay answers as the first submission did (same status, same ids).
    replayed = isinstance(results, ReplayedResults)
    if replayed and len(results) != len(specs):
        raise HttpError(
            409,
            "conflict",
            f"idempotency key {key!r} was used for a submission of {len(results)} "
            f"tasks, not {len(specs)}; use a new key for a new submission",
        )
    if body.tasks is None:
        result = results[0]
        if isinstance(result, Rejected):
            raise rejected_error(result)
        return 201, json_encoder.encode(m.TaskRefBody(result.id, _STATE[result.state], replayed))
    out = [
        m.SubmittedTask(error=m.ErrorDetail(error_code(r.code), r.message))
        if isinstance(r, Rejected)
        else m.SubmittedTask(id=r.id, state=_STATE[r.state])
        for r in results
    ]
    return 200, json_encoder.encode(m.SubmitBatchResponse(out, replayed))


def _task_view(api: ApiContext, task_id: int, principal: Principal = ANONYMOUS_ADMIN) -> m.TaskView:
    task = api.node.state.tasks.get(task_id)
    # Another tenant's task answers like a missing one: its existence is not shown.
    if task is None or not principal.may_see_tenant(task.tenant):
        raise HttpError(404, "not_found", f"task {task_id} does not exist")
    view = task_view(task, api.node.state.tree(task_id), api.node.state.workers)
    progress = api.outputs.progress.get(task_id)
    if progress is not None:
        view.progress = m.TaskProgress(
            progress.fraction, progress.message, progress.attempt, iso_ms(progress.updated_ms) or ""
        )
    return view


async def get_task(api: ApiContext, request: Request) -> tuple[int, bytes]:
    task_id = int(request.params[0])
    unknown = set(request.query) - {"wait_s", "wait_tree"}
    if unknown:
        raise HttpError(400, "invalid_request", f"unknown query parameters: {sorted(unknown)}")
    wait_tree = bool_param(request.query, "wait_tree")
    view = _task_view(api, task_id, request.principal)
    wait_s = float_param(request.query, "wait_s", 0.0, 0.0, api.config.max_wait_s)
    if wait_tree and view.tree is None:
        raise HttpError(
            400, "invalid_request", f"task {task_id} does not root a tracked tree (wait_tree)"
        )
    if wait_tree:
        done = view.tree is not None and view.tree.state != TreeState.PENDING
        waiters = api.waiters.trees
    else:
        done = view.state in FINAL
        waiters = api.waiters.tasks
    if wait_s > 0 and not done:
        # Long poll: answer as soon as the task reaches a final state (its tree ends).
        await api.waiters.wait(waiters, task_id, wait_s)
        view = _task_view(api, task_id, request.principal)
    return 200, json_encoder.encode(view)


async def task_logs(api: ApiContext, request: Request) -> tuple[int, bytes]:
    """An attempt's captured output: broker/api/output_store.py (only the leader holds it;
    a follower asks the leader, so the dashboard works on any broker)."""
    view = api.cluster_view
    try:
        if view is not None and not api.node.writable:
            leader = view.leader()
            return await logs_from_leader(
                leader.url if leader is not None and leader.url != view.url else None,
                request.path,
                request.query,
                request.header(b"authorization"),
                proxied=request.header(PROXIED_HEADER) is not None,
                ssl_context=view.peer_ssl_context,
            )
        answer = await logs_answer(
            api.outputs,
            api.node.state,
            request.principal,
            int(request.params[0]),
            request.query,
        )
    except LogsError as exc:
        raise HttpError(exc.status, exc.code, exc.message, retryable=exc.retryable) from None
    return 200, answer


def _state_filter(request: Request, cursor: str) -> str | None:
    """The state filter of a task list, its query parameters checked."""
    query = request.query
    unknown = set(query) - {"state", "tenant", "type", "limit", cursor}
    if unknown:
        raise HttpError(400, "invalid_request", f"unknown query parameters: {sorted(unknown)}")
    state = query.get("state")
    if state is not None and state not in TASK_STATES:
        raise HttpError(400, "invalid_request", f"state must be one of {sorted(TASK_STATES)}")
    return state


def _listed_tenant(api: ApiContext, request: Request) -> str | None:
    """The tenant filter of a task list: a tenant token lists its own tenant only."""
    tenant = request.query.get("tenant")
    if request.principal.role is CallerRole.TENANT:
        if tenant is not None and tenant != request.principal.tenant:
            raise HttpError(403, "forbidden", "a tenant token lists its own tenant's tasks only")
        tenant = request.principal.tenant
    return tenant


async def list_tasks(api: ApiContext, request: Request) -> tuple[int, bytes]:
    state = _state_filter(request, "after")
    limit = int_param(request.query, "limit", 100, 1, api.config.max_list_limit)
    after = int_param(request.query, "after", 0, 0, 2**62)
    tasks = api.node.state.list_tasks(
        state=state,
        tenant=_listed_tenant(api, request),
        task_type=request.query.get("type"),
        after_id=after,
        limit=limit,
    )
    next_after = tasks[-1].id if len(tasks) == limit else None
    return 200, json_encoder.encode(
        m.TaskList(
            [task_view(t, api.node.state.tree(t.id), api.node.state.workers) for t in tasks],
            next_after,
        )
    )


async def recent_tasks(api: ApiContext, request: Request) -> tuple[int, bytes]:
    """Matching tasks, newest first (the dashboard's task search)."""
    state_filter = _state_filter(request, "before")
    limit = int_param(request.query, "limit", 50, 1, api.config.max_list_limit)
    before = int_param(request.query, "before", 2**62, 1, 2**62)
    state = api.node.state
    tasks = state.list_tasks(
        state=state_filter,
        tenant=_listed_tenant(api, request),
        task_type=request.query.get("type"),
        before_id=before,
        limit=limit,
        newest_first=True,
    )
    found = [task_view(task, state.tree(task.id), state.workers) for task in tasks]
    next_before = found[-1].id if len(found) == limit else None
    return 200, json_encoder.encode(m.RecentTaskList(found, next_before))


async def cancel_task(api: ApiContext, request: Request) -> tuple[int, bytes]:
    task_id = int(request.params[0])
    if request.body.strip():
        raise HttpError(400, "invalid_request", "cancel takes no body")
    _task_view(api, task_id, request.principal)  # 404 before logging anything
    result = await api.node.propose(
        lambda stamp: e.CancelTask(time_ms=stamp.now_ms, task_id=task_id)
    )
    if isinstance(result, Rejected):
        raise rejected_error(result)
    assert isinstance(result, TaskRef)
    return 200, json_encoder.encode(m.TaskRefBody(result.id, _STATE[result.state]))
