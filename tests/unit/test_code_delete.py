"""Deleting code artifacts (docs/DESIGN.md §7): the DeleteCode entry in the pure state
machine (owners, live users, retention), the store's removal, and the HTTP route."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Final

import msgspec

from broker.artifacts.code_store import CodeStore
from broker.core import entries as e
from broker.core.effects import Applied
from broker.core.state import Artifact, ErrorCode, StateMachine, TaskState
from tests.support.http_api import Api
from tests.support.machine import Machine, code

SHA: Final = "ab" * 32
OTHER: Final = "cd" * 32
HOUR_MS: Final = 3600 * 1000


def add_code(sm: Machine, sha256: str = SHA, tenant: str | None = None) -> Artifact:
    entry = e.AddCode(time_ms=sm.now, sha256=sha256, name="job.py", size_bytes=10, tenant=tenant)
    result = sm.apply(entry)
    assert isinstance(result, Artifact), result
    return result


def delete(
    sm: Machine, sha256: str = SHA, tenant: str | None = None, unused_for_ms: int = 0
) -> object:
    return sm.apply(
        e.DeleteCode(time_ms=sm.now, sha256=sha256, tenant=tenant, unused_for_ms=unused_for_ms)
    )


def test_delete_is_refused_while_a_live_task_uses_it_and_names_them() -> None:
    sm = Machine()
    sm.register()
    add_code(sm)
    running = sm.add(code=SHA)
    assert sm.assign(running) is not None
    waiting = sm.add(code=SHA)
    delayed = sm.add(code=SHA, start_after_ms=sm.now + 60_000)
    refused = delete(sm)
    assert code(refused) == ErrorCode.CONFLICT
    assert f"{running}, {waiting}, {delayed}" in refused.message  # type: ignore[attr-defined]
    assert SHA in sm.m.artifacts
    sm.cancel(waiting)
    sm.cancel(delayed)
    sm.finish(sm.outcome(running))
    assert sm.state(running) == TaskState.FINISHED
    deleted = delete(sm)
    assert isinstance(deleted, Artifact) and deleted.sha256 == SHA
    assert SHA not in sm.m.artifacts
    # Gone: a second delete and a submit that uses it are refused.
    assert code(delete(sm)) == ErrorCode.NOT_FOUND
    assert code(sm.submit_one(code=SHA)) == ErrorCode.NOT_FOUND
    # Uploaded again: usable again.
    add_code(sm)
    assert sm.state(sm.add(code=SHA)) == TaskState.WAITING


def test_unready_artifact_with_parked_tasks_is_not_deleted() -> None:
    sm = Machine()
    sm.apply(e.AddCode(time_ms=sm.now, sha256=SHA, name="a.py", size_bytes=1, ready=False))
    parked = sm.add(code=SHA)
    assert sm.m.parked == {SHA: {parked: None}}
    assert code(delete(sm)) == ErrorCode.CONFLICT
    sm.cancel(parked)
    assert isinstance(delete(sm), Artifact)
    assert sm.m.parked == {}


def test_tenants_delete_only_their_own_claim() -> None:
    sm = Machine()
    add_code(sm, tenant="acme")
    add_code(sm, tenant="beta")
    assert code(delete(sm, tenant="gamma")) == ErrorCode.NOT_FOUND  # not told it exists
    # acme's delete drops its claim only: beta keeps using the artifact.
    kept = delete(sm, tenant="acme")
    assert isinstance(kept, Artifact) and kept.owners == ["beta"]
    assert [u.tenant for u in sm.m.artifacts[SHA].uploads] == ["beta"]
    assert code(delete(sm, tenant="acme")) == ErrorCode.NOT_FOUND
    # The last owner deletes it.
    assert isinstance(delete(sm, tenant="beta"), Artifact)
    assert SHA not in sm.m.artifacts
    # A shared (admin) upload: tenants may not delete it, an admin may.
    add_code(sm, OTHER)
    assert code(delete(sm, OTHER, tenant="acme")) == ErrorCode.CONFLICT
    assert isinstance(delete(sm, OTHER), Artifact)


def test_retention_counts_from_the_last_task_that_needed_it() -> None:
    sm = Machine()
    add_code(sm)
    sm.at(2 * HOUR_MS)
    task = sm.add(code=SHA)
    assert sm.m.unneeded_artifacts(HOUR_MS) == []  # a live task needs it
    assert code(delete(sm, unused_for_ms=HOUR_MS)) == ErrorCode.CONFLICT
    sm.at(HOUR_MS)
    sm.cancel(task)
    assert sm.m.artifacts[SHA].last_used_ms == sm.now
    sm.at(HOUR_MS - 1)
    sm.tick()
    assert sm.m.unneeded_artifacts(HOUR_MS) == []
    # The leader's retention entry is re-checked on apply: refused while not yet due.
    assert code(delete(sm, unused_for_ms=HOUR_MS)) == ErrorCode.CONFLICT
    sm.at(1)
    sm.tick()
    assert sm.m.unneeded_artifacts(HOUR_MS) == [SHA]
    assert isinstance(delete(sm, unused_for_ms=HOUR_MS), Artifact)


def test_last_used_survives_a_snapshot_and_old_snapshots_load() -> None:
    sm = Machine()
    add_code(sm)
    sm.cancel(sm.add(code=SHA))
    copy = StateMachine.from_snapshot(sm.m.encode_snapshot())
    assert copy.artifacts[SHA].last_used_ms == sm.m.artifacts[SHA].last_used_ms == sm.now
    # An artifact record written before the field existed reads as never used.
    old = msgspec.msgpack.encode([SHA, "job.py", 10, 5, True, [], []])
    assert msgspec.msgpack.decode(old, type=Artifact).last_used_ms == 0


def test_store_removes_the_file_when_a_delete_is_applied(tmp_path: Path) -> None:
    store = CodeStore(tmp_path / "code")
    sha = store.put(b"print(1)\n")
    assert store.usage() == (1, 9)
    artifact = Artifact(sha, "a.py", 9, 0)
    past = int(time.time() * 1000) + 1000
    # A claim dropped (the tenant is no longer an owner): the file stays.
    claim = e.DeleteCode(time_ms=past, sha256=sha, tenant="acme")
    artifact.owners = ["beta"]
    store.on_applied(claim, Applied(artifact, ()))
    assert store.has(sha)
    # Written after the delete's time (an upload racing it): kept.
    store.on_applied(e.DeleteCode(time_ms=past - 60_000, sha256=sha), Applied(artifact, ()))
    assert store.has(sha)
    # A rejected delete changes nothing.
    store.on_applied(e.DeleteCode(time_ms=past, sha256=sha), Applied(None, ()))
    assert store.has(sha)
    store.on_applied(e.DeleteCode(time_ms=past, sha256=sha), Applied(artifact, ()))
    assert not store.has(sha) and store.usage() == (0, 0)
    assert not store.remove(sha)
    assert not [n for n in os.listdir(store.directory) if not n.startswith(".")]


async def test_http_delete(api: Api) -> None:
    node = api.node

    async def upload(sha: str) -> None:
        await node.propose(
            lambda stamp: e.AddCode(time_ms=stamp.now_ms, sha256=sha, name="j.py", size_bytes=3)
        )

    url = f"/api/v1/code/{SHA}"
    missing = await api.client.delete(url)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    await upload(SHA)
    submitted = await api.post("/api/v1/tasks", json={"type": "py", "code": SHA})
    assert submitted.status_code == 201, submitted.text
    task_id = submitted.json()["id"]
    refused = await api.client.delete(url)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "conflict"
    assert str(task_id) in refused.json()["error"]["message"]
    cancelled = await api.post(f"/api/v1/tasks/{task_id}/cancel")
    assert cancelled.status_code == 200
    deleted = await api.client.delete(url)
    assert deleted.status_code == 200, deleted.text
    assert deleted.json()["sha256"] == SHA and deleted.json()["name"] == "j.py"
    listed = await api.get("/api/v1/code")
    assert listed.json()["artifacts"] == []
    bad = await api.client.delete("/api/v1/code/xyz")
    assert bad.status_code in (400, 404)
