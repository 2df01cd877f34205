"""Deleting code artifacts (docs/DESIGN.md §7): the DeleteCode entry in the pure state
machine (owners, live users, retention), the store's removal, and the HTTP route."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from functools import partial
from pathlib import Path
from typing import Any, Final

import httpx
import msgspec
import pytest

from broker.artifacts.code_store import CodeStore
from broker.core import Artifact, ErrorCode, StateMachine, TaskState
from broker.core import entries as e
from broker.core.effects import Applied
from broker.leader.code_retention import CodeRetention
from broker.workers.liveness import DROPPED_CODE_MAX, DROPPED_CODE_WINDOW_S, Liveness
from broker.workers.worker_link import WorkerLinkConfig
from clients.worker.artifacts import ArtifactCache, CodeDrops
from tests.support.auth_env import Env, error_code
from tests.support.http_api import Api
from tests.support.machine import Machine, Trees, code
from tests.support.memory_node import memory_node

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


def _serving_cache(tmp_path: Path, files: dict[str, bytes], **kwargs: Any) -> ArtifactCache:
    def handler(request: httpx.Request) -> httpx.Response:
        sha = request.url.path.rsplit("/", 1)[-1]
        data = files.get(sha)
        return httpx.Response(200, content=data) if data is not None else httpx.Response(404)

    return ArtifactCache(
        tmp_path / "cache", "http://broker.test", transport=httpx.MockTransport(handler), **kwargs
    )


def test_worker_cache_drops_deleted_artifacts_and_evicts_least_recently_used(
    tmp_path: Path,
) -> None:
    blobs = [f"X = {i}\n".encode() * 100 for i in range(3)]  # 600 bytes each
    files = {hashlib.sha256(b).hexdigest(): b for b in blobs}
    first, second, third = files
    cache = _serving_cache(tmp_path, files, max_cache_bytes=1300)
    try:
        cache.fetch(first)
        cache.fetch(second)
        assert cache.usage() == (2, 1200)
        old = time.time() - 60
        os.utime(cache.cache_dir / f"{first}.py", (old, old))
        cache.fetch(first)  # a use: now the most recent
        os.utime(cache.cache_dir / f"{second}.py", (old, old))
        cache.fetch(third)  # over the bound: the least recently used (second) goes
        names = sorted(p.name for p in cache.cache_dir.iterdir() if p.suffix == ".py")
        assert names == sorted([f"{first}.py", f"{third}.py"])
        # A deleted artifact is dropped; dropping one not cached is harmless.
        assert cache.drop(first)
        assert not cache.drop(first)
        assert cache.usage() == (1, 600)
        # Needed again (uploaded again): downloaded again.
        downloads = cache.downloads
        cache.fetch(first)
        assert cache.downloads == downloads + 1
    finally:
        cache.close()


def test_worker_cache_unbounded_with_zero(tmp_path: Path) -> None:
    blobs = [f"Y = {i}\n".encode() * 100 for i in range(3)]
    files = {hashlib.sha256(b).hexdigest(): b for b in blobs}
    cache = _serving_cache(tmp_path, files, max_cache_bytes=0)
    try:
        for sha in files:
            cache.fetch(sha)
        assert cache.usage()[0] == 3
    finally:
        cache.close()


def test_heartbeats_name_deleted_code_for_a_while(tmp_path: Path) -> None:
    now = [1000.0]
    liveness = Liveness(memory_node(tmp_path), WorkerLinkConfig(), {}, lambda: now[0])
    liveness.code_deleted(SHA)
    liveness.code_deleted(OTHER)
    assert liveness._dropped_code(now[0]) == (SHA, OTHER)
    liveness.code_added(OTHER)  # uploaded again: no longer dropped
    assert liveness._dropped_code(now[0]) == (SHA,)
    now[0] += DROPPED_CODE_WINDOW_S + 1
    assert liveness._dropped_code(now[0]) == ()
    for i in range(DROPPED_CODE_MAX + 5):
        liveness.code_deleted(f"{i:064x}")
    assert len(liveness._dropped_code(now[0])) == DROPPED_CODE_MAX


async def test_code_drops_handles_each_named_sha_once(tmp_path: Path) -> None:
    blob = b"Z = 1\n"
    sha = hashlib.sha256(blob).hexdigest()
    cache = _serving_cache(tmp_path, {sha: blob})
    drops = CodeDrops(cache)
    try:
        await asyncio.to_thread(cache.fetch, sha)
        drops.on_heartbeat((sha, "not-a-sha"))
        await asyncio.wait_for(asyncio.gather(*drops._background), 10)
        assert cache.usage() == (0, 0)
        await asyncio.to_thread(cache.fetch, sha)  # uploaded and used again meanwhile
        drops.on_heartbeat((sha,))  # the same list again: not dropped a second time
        assert not drops._background
        assert cache.usage() == (1, len(blob))
    finally:
        cache.close()


async def test_retention_sweep_deletes_only_unneeded_artifacts(tmp_path: Path) -> None:
    node = memory_node(tmp_path)
    await node.start()
    try:
        for sha in (SHA, OTHER):
            await node.propose(
                partial(
                    lambda sha, stamp: e.AddCode(
                        time_ms=stamp.now_ms, sha256=sha, name="a.py", size_bytes=1
                    ),
                    sha,
                )
            )
        await node.propose(
            lambda stamp: e.SubmitTasks(
                time_ms=stamp.now_ms,
                tasks=(e.TaskSpec(id=1, type="py", tenant="t", code=OTHER),),
            )
        )
        retention = CodeRetention(node, 1)
        await asyncio.sleep(0.01)
        assert await retention.sweep() == 1
        assert list(node.state.artifacts) == [OTHER]  # a waiting task needs it
        with pytest.raises(ValueError):
            CodeRetention(node, -1)
        await CodeRetention(node, 0).start()  # 0: keeps forever, starts nothing
    finally:
        await node.stop()


async def test_tenants_delete_their_own_uploads_with_authentication(env: Env) -> None:
    script = b"def run(params, ctx):\n    return 3\n"
    uploaded = await env.call("alice", "POST", "/api/v1/code?name=a.py", content=script)
    assert uploaded.status_code == 201, uploaded.text
    sha = uploaded.json()["sha256"]
    url = f"/api/v1/code/{sha}"
    # Bob is told what he would be told of a missing artifact; workers may not delete.
    assert error_code(await env.call("bob", "DELETE", url), 404) == "not_found"
    assert (await env.call("worker", "DELETE", url)).status_code == 403
    # Shared by Bob's upload of the same bytes: Alice's delete drops her claim only.
    again = await env.call("bob", "POST", "/api/v1/code?name=b.py", content=script)
    assert again.status_code == 201
    mine = await env.call("alice", "DELETE", url)
    assert mine.status_code == 200 and mine.json()["name"] == "a.py", mine.text
    assert env.node.state.artifacts[sha].owners == ["bob"]
    assert error_code(await env.call("alice", "GET", url), 404) == "not_found"
    assert (await env.call("bob", "GET", url)).status_code == 200
    # Bob's is the last claim: the artifact goes.
    assert (await env.call("bob", "DELETE", url)).status_code == 200
    assert sha not in env.node.state.artifacts
    # An admin's upload is shared: a tenant's delete is refused, an admin's is not.
    shared = await env.call("admin", "POST", "/api/v1/code?name=s.py", content=script)
    assert error_code(await env.call("alice", "DELETE", url), 409) == "conflict"
    assert shared.status_code == 201
    assert (await env.call("admin", "DELETE", url)).status_code == 200


def test_store_removes_files_the_state_does_not_know(tmp_path: Path) -> None:
    store = CodeStore(tmp_path / "code")
    kept = store.put(b"a = 1\n")
    orphan = store.put(b"b = 2\n")
    (store.directory / "notes.txt").write_text("not an artifact")
    assert store.remove_unknown({kept}) == 1
    assert store.has(kept) and not store.has(orphan)
    assert (store.directory / "notes.txt").exists()


def test_the_finished_root_of_a_pending_tree_keeps_its_code() -> None:
    """A failing tree replays its root: the root's code is needed until the tree ends."""
    sm = Trees()
    add_code(sm)
    root = sm.root(code=SHA, max_attempts=2)
    (child,) = sm.done(root, sm.child(root))
    assert sm.state(root) == TaskState.FINISHED and sm.tree(root).state == "pending"
    refused = delete(sm)
    assert code(refused) == ErrorCode.CONFLICT and str(root) in refused.message  # type: ignore[attr-defined]
    assert sm.m.unneeded_artifacts(0) == []
    sm.done(child)
    assert sm.tree(root).state == "completed"
    assert isinstance(delete(sm), Artifact)
