"""The state machine's code artifacts: uploads, owners, readiness and deletion; tasks
waiting for an artifact that is not ready are parked on it (docs/DESIGN.md §7).
"""

from __future__ import annotations

from collections.abc import Iterator

from broker.core import entries as e
from broker.core.books import Books
from broker.core.entries import SHA256_RE
from broker.core.records import (
    LIVE_STATES,
    Artifact,
    ArtifactUpload,
    ErrorCode,
    Rejected,
    Task,
    TreeState,
)
from broker.core.transitions import TaskState
from broker.core.validation import (
    NAME_RE,
)


def add_code(books: Books, entry: e.AddCode) -> Artifact | Rejected:
    if not SHA256_RE.fullmatch(entry.sha256):
        return Rejected(ErrorCode.INVALID, "sha256 must be 64 lowercase hex digits")
    if entry.size_bytes < 0:
        return Rejected(ErrorCode.INVALID, "size_bytes must be >= 0")
    if entry.tenant is not None and not NAME_RE.match(entry.tenant):
        return Rejected(ErrorCode.INVALID, f"tenant name {entry.tenant!r} is not valid")
    artifact = books.artifacts.get(entry.sha256)
    if artifact is None:
        artifact = books.artifacts[entry.sha256] = Artifact(
            entry.sha256,
            entry.name,
            entry.size_bytes,
            books.now_ms,
            entry.ready,
            [entry.tenant] if entry.tenant is not None else [],
        )
    else:
        if entry.ready and not artifact.ready:
            # Uploaded again by a leader that needs no replicas first: no reason to wait.
            release_code(books, artifact)
        if entry.tenant is None:
            if artifact.owners:
                # An admin upload shares it with every tenant: they are shown the
                # admin's name and time, not those of the tenant that uploaded first.
                artifact.name, artifact.created_ms = entry.name, books.now_ms
            artifact.owners = []
        elif artifact.owners and entry.tenant not in artifact.owners:
            artifact.owners = sorted([*artifact.owners, entry.tenant])
    if entry.tenant is not None and artifact.upload_of(entry.tenant) is None:
        artifact.uploads.append(ArtifactUpload(entry.tenant, entry.name, books.now_ms))
    return artifact


def code_ready(books: Books, entry: e.CodeReady) -> Artifact | Rejected:
    if not SHA256_RE.fullmatch(entry.sha256):
        return Rejected(ErrorCode.INVALID, "sha256 must be 64 lowercase hex digits")
    artifact = books.artifacts.get(entry.sha256)
    if artifact is None:
        return Rejected(ErrorCode.NOT_FOUND, f"code artifact {entry.sha256} is unknown")
    if not artifact.ready:
        release_code(books, artifact)
    return artifact


def release_code(books: Books, artifact: Artifact) -> None:
    """Mark an artifact ready; its parked tasks join their queues, in id order."""
    artifact.ready = True
    for task_id in books.queues.unpark_all(artifact.sha256):
        books.queues.queue(books.tasks[task_id])


def needing_code(books: Books) -> Iterator[Task]:
    """The tasks that need their code: the live ones (pending, delayed, waiting,
    running), and the finished roots of pending trees (a failing tree replays them)."""
    tasks = books.tasks
    for state in LIVE_STATES:
        for task_id in books.states.by_state[state]:
            yield tasks[task_id]
    for tree in books.trees.values():
        if tree.state == TreeState.PENDING:
            root = tasks.get(tree.root)
            if root is not None and root.state == TaskState.FINISHED:
                yield root


def code_users(books: Books, sha256: str) -> list[int]:
    """Ids of the tasks that need the artifact (:func:`needing_code`)."""
    return sorted(task.id for task in needing_code(books) if task.code == sha256)


def codes_in_use(books: Books) -> set[str]:
    """Every artifact a task needs (one pass over the tasks that need theirs)."""
    return {task.code for task in needing_code(books) if task.code is not None}


def unneeded_artifacts(books: Books, unused_for_ms: int, now_ms: int | None = None) -> list[str]:
    """Artifacts no task has needed for ``unused_for_ms`` by ``now_ms`` (default the
    state's clock, which stands still while no entry is applied; the leader passes its
    own): code retention's candidates."""
    now_ms = books.now_ms if now_ms is None else now_ms
    in_use = codes_in_use(books)
    return sorted(
        a.sha256
        for a in books.artifacts.values()
        if a.sha256 not in in_use and max(a.created_ms, a.last_used_ms) + unused_for_ms <= now_ms
    )


def delete_code(books: Books, entry: e.DeleteCode) -> Artifact | Rejected:
    if not SHA256_RE.fullmatch(entry.sha256):
        return Rejected(ErrorCode.INVALID, "sha256 must be 64 lowercase hex digits")
    artifact = books.artifacts.get(entry.sha256)
    tenant = entry.tenant
    # A tenant is told the same for an artifact it cannot see as for a missing one.
    if artifact is None or (
        tenant is not None and artifact.owners and tenant not in artifact.owners
    ):
        return Rejected(ErrorCode.NOT_FOUND, f"code artifact {entry.sha256} is unknown")
    if tenant is not None and not artifact.owners:
        return Rejected(
            ErrorCode.CONFLICT, "a shared artifact (an admin's upload) is deleted by an admin"
        )
    if tenant is not None and len(artifact.owners) > 1:
        # Other tenants keep using it: only this tenant's claim goes, the file stays.
        artifact.owners = [o for o in artifact.owners if o != tenant]
        artifact.uploads = [u for u in artifact.uploads if u.tenant != tenant]
        return artifact
    users = code_users(books, entry.sha256)
    if users:
        shown = ", ".join(str(i) for i in users[:20])
        more = f" and {len(users) - 20} more" if len(users) > 20 else ""
        return Rejected(
            ErrorCode.CONFLICT,
            f"code artifact {entry.sha256} is needed by tasks {shown}{more} (not final,"
            " or the root of a pending tree, which a failure replays)",
        )
    if entry.unused_for_ms > 0 and (
        max(artifact.created_ms, artifact.last_used_ms) + entry.unused_for_ms > books.now_ms
    ):
        return Rejected(ErrorCode.CONFLICT, f"code artifact {entry.sha256} was used again")
    del books.artifacts[entry.sha256]
    return artifact
