"""Handlers of code artifacts: upload (checked out of process), list, download, delete."""

from __future__ import annotations

import asyncio
import logging
import time

from broker.api import api_models as m
from broker.api.common import (
    ASSIGNMENT_WAIT_S,
    Binary,
    HttpError,
    Request,
    artifact_view,
    json_encoder,
    rejected_error,
)
from broker.api.context import ApiContext
from broker.artifacts.code_store import ArtifactTooLargeError, InvalidArtifactError
from broker.core import (
    Artifact,
    Rejected,
    WorkerState,
)
from broker.core import entries as e
from broker.security.auth import Principal
from broker.security.auth import Role as CallerRole

logger = logging.getLogger(__name__)


async def upload_code(api: ApiContext, request: Request) -> tuple[int, bytes]:
    store = api.code_store_or_404()
    # A tenant's upload is its own; an admin's (or any without authentication) shared.
    owner = request.principal.tenant if api.config.auth.enabled else None
    unknown = set(request.query) - {"name"}
    if unknown:
        raise HttpError(400, "invalid_request", f"unknown query parameters: {sorted(unknown)}")
    name = request.query.get("name")
    if name is None:
        raise HttpError(400, "invalid_request", "the name query parameter is required")
    data = request.body
    try:
        # Never parsed here: a hostile .py or zip must not grow or stall the broker.
        await api.upload_checker.check(name, data)
    except InvalidArtifactError as exc:
        too_large = isinstance(exc, ArtifactTooLargeError)
        logger.warning(
            "code upload %r (%d bytes) from %s refused: %s", name, len(data), request.peer, exc
        )
        if too_large:
            raise HttpError(413, "too_large", str(exc)) from None
        raise HttpError(400, "invalid_artifact", str(exc)) from None
    sha256 = await asyncio.to_thread(store.put, data)
    ready = api.config.min_code_replicas <= 1
    result = await api.node.propose(
        lambda stamp: e.AddCode(
            time_ms=stamp.now_ms,
            sha256=sha256,
            name=name,
            size_bytes=len(data),
            ready=ready,
            tenant=owner,
        )
    )
    if isinstance(result, Rejected):
        raise rejected_error(result)
    assert isinstance(result, Artifact)
    # Always 201 and the uploader's own name and time: the same answer whether or not
    # another tenant sent these bytes before.
    return 201, json_encoder.encode(artifact_view(result, owner))


async def delete_code(api: ApiContext, request: Request) -> tuple[int, bytes]:
    """A log entry (docs/DESIGN.md §7): once applied, every broker removes the file; 409
    while a live task needs it. A tenant deletes only its own uploads (an artifact
    other tenants uploaded too loses that tenant's claim only); an admin any."""
    if request.body.strip():
        raise HttpError(400, "invalid_request", "delete takes no body")
    sha256 = request.params[0]
    tenant = request.principal.tenant if api.config.auth.enabled else None
    known = api.node.state.artifacts.get(sha256)
    # The caller's view before the delete drops its upload record.
    view = artifact_view(known, tenant) if known is not None else None
    result = await api.node.propose(
        lambda stamp: e.DeleteCode(time_ms=stamp.now_ms, sha256=sha256, tenant=tenant)
    )
    if isinstance(result, Rejected):
        raise rejected_error(result)
    assert isinstance(result, Artifact)
    logger.info(
        "code artifact %s deleted by %s (client %s)",
        sha256[:12],
        tenant or "an admin",
        request.peer,
    )
    return 200, json_encoder.encode(view or artifact_view(result, tenant))


def _may_read_code(api: ApiContext, request: Request, artifact: Artifact) -> bool:
    principal = request.principal
    if principal.role is CallerRole.WORKER:
        return _assigned_to_credential(api, principal, artifact.sha256)
    if principal.role is not CallerRole.TENANT:
        return True  # admin and peer brokers
    return not artifact.owners or principal.tenant in artifact.owners


def _assigned_to_credential(api: ApiContext, principal: Principal, sha256: str) -> bool:
    """Whether a task running on a connected worker of this credential uses the
    artifact: a worker credential (or the shared worker token, ``token_id`` None)
    reads only the code of tasks currently assigned to its own workers."""
    state = api.node.state
    for worker in state.workers.values():
        if worker.state != WorkerState.CONNECTED or worker.credential != principal.token_id:
            continue
        for task_id in state.running_by_worker.get(worker.id, ()):
            task = state.tasks.get(task_id)
            if task is not None and task.code == sha256:
                return True
    return False


async def list_code(api: ApiContext, request: Request) -> tuple[int, bytes]:
    tenant = request.principal.tenant if request.principal.role is CallerRole.TENANT else None
    views = [
        artifact_view(a, tenant)
        for a in api.node.state.artifacts.values()
        if _may_read_code(api, request, a)
    ]
    if tenant is not None:
        # In the order the tenant uploaded them, not that of the bytes' first upload
        # (which would tell that another tenant sent some of them earlier). ISO times
        # of one width sort as strings.
        views.sort(key=lambda view: (view.created_at, view.sha256))
    return 200, json_encoder.encode(m.ArtifactList(views))


async def download_code(api: ApiContext, request: Request) -> tuple[int, bytes]:
    store = api.code_store_or_404()
    sha256 = request.params[0]
    artifact = api.node.state.artifacts.get(sha256)
    allowed = artifact is not None and _may_read_code(api, request, artifact)
    if artifact is not None and not allowed and request.principal.role is CallerRole.WORKER:
        allowed = await _await_assignment(api, request.principal, sha256)
    if artifact is None or not allowed or not store.has(sha256):
        # One answer for a missing artifact and one the caller may not read.
        if artifact is not None and not allowed:
            logger.warning(
                "refused code artifact %s to %s credential %s: no task of its workers "
                "uses it (client %s)",
                sha256[:12],
                request.principal.role.value,
                request.principal.token_id or "(shared worker token)",
                request.peer,
            )
        raise HttpError(404, "not_found", f"code artifact {sha256} is not on this broker")
    try:
        # Hashed on every read: a damaged copy is dropped (and fetched again), not served.
        data = await asyncio.to_thread(store.read, sha256)
    except FileNotFoundError:
        raise HttpError(404, "not_found", f"code artifact {sha256} is not on this broker") from None
    return 200, Binary(data)


async def _await_assignment(api: ApiContext, principal: Principal, sha256: str) -> bool:
    """A follower may not have applied the assignment its leader already pushed to
    the worker: wait a little for it there (bounded) before refusing."""
    if api.node.writable:
        return False  # the leader applied the assignment before the worker heard of it
    deadline = time.monotonic() + ASSIGNMENT_WAIT_S
    while time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        if _assigned_to_credential(api, principal, sha256):
            return True
    return False
