"""Tenant-scoped names (issue 14, item 6): idempotency keys, slot names and transaction
lookups belong to a tenant, and uploading bytes another tenant uploaded answers exactly as
a first upload would.

Driven through the HTTP API with tenant tokens (tests/unit/test_auth.py's ``env``) and, for
what the API cannot reach alone (mixed batches, old snapshots), on the state machine.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from broker.api.http_api import iso_ms
from broker.core import (
    ErrorCode,
    Rejected,
    ReplayedResults,
    StateMachine,
    TaskRef,
    TransactionDone,
)
from broker.core import entries as e
from tests.support.auth_env import Env, error_code
from tests.support.machine import Machine

TASKS = "/api/v1/tasks"
TXNS = "/api/v1/transactions"


async def _post_task(env: Env, who: str, key: str | None = None, **fields: Any) -> Any:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return await env.call(who, "POST", TASKS, json={"type": "noop", **fields}, headers=headers)


# --- idempotency keys ----------------------------------------------------------------------


async def test_another_tenants_idempotency_key_creates_its_own_task(env: Env) -> None:
    first = await _post_task(env, "alice", "nightly-42", params={"who": "alice"})
    assert first.status_code == 201, first.text
    assert first.json().get("replayed", False) is False
    # Bob happens to use (or guessed) the same key: he gets a task of his own, not Alice's.
    theirs = await _post_task(env, "bob", "nightly-42", params={"who": "bob"})
    assert theirs.status_code == 201, theirs.text
    assert theirs.json().get("replayed", False) is False
    assert theirs.json()["id"] != first.json()["id"]
    task = await env.call("bob", "GET", f"{TASKS}/{theirs.json()['id']}")
    assert task.status_code == 200 and task.json()["tenant"] == "bob"
    assert task.json()["params"] == {"who": "bob"}
    # Each tenant's retry still replays its own first submission.
    for who, original in (("alice", first), ("bob", theirs)):
        again = await _post_task(env, who, "nightly-42")
        assert again.status_code == 201
        assert again.json() == {**original.json(), "replayed": True}
    # The same holds for batches (the key in the body).
    body = {"idempotency_key": "batch", "tasks": [{"type": "noop"}, {"type": "noop"}]}
    ids = {}
    for who in ("alice", "bob"):
        batch = await env.call(who, "POST", TASKS, json=body)
        assert batch.status_code == 200, batch.text
        assert batch.json().get("replayed", False) is False
        ids[who] = [t["id"] for t in batch.json()["tasks"]]
    assert not set(ids["alice"]) & set(ids["bob"])


def test_keys_are_scoped_in_the_state_machine_and_survive_a_snapshot() -> None:
    sm = Machine()

    def submit(key: str, *specs: e.TaskSpec) -> list[TaskRef | Rejected]:
        result = sm.apply(e.SubmitTasks(time_ms=sm.now, tasks=specs, idempotency_key=key))
        assert isinstance(result, list)
        return result

    [a] = submit("k", sm.spec("a"))
    [b] = submit("k", sm.spec("b"))
    assert isinstance(a, TaskRef) and isinstance(b, TaskRef) and a.id != b.id
    # An admin's batch mixing tenants has a scope of its own, apart from each tenant's.
    mixed = submit("k", sm.spec("a"), sm.spec("b"))
    assert not isinstance(mixed, ReplayedResults) and all(isinstance(r, TaskRef) for r in mixed)
    assert list(sm.m.idempotency) == [("a", "k"), ("b", "k"), ("a,b", "k")]
    loaded = Machine(StateMachine.from_snapshot(sm.m.encode_snapshot()))
    loaded.m.check_invariants()
    assert loaded.m.digest() == sm.m.digest()
    for machine in (sm, loaded):
        replay = machine.apply(
            e.SubmitTasks(time_ms=machine.now, tasks=(machine.spec("b"),), idempotency_key="k")
        )
        assert isinstance(replay, ReplayedResults) and list(replay) == [b]


def test_a_snapshot_with_unscoped_keys_still_loads() -> None:
    # Written before keys were scoped: records without a scope, artifacts without uploads.
    sm = Machine()
    sm.apply(e.SubmitTasks(time_ms=sm.now, tasks=(sm.spec("a"),), idempotency_key="k"))
    sm.apply(e.AddCode(time_ms=sm.now, sha256="c" * 64, name="a.py", size_bytes=3, tenant="a"))
    body = msgspec.msgpack.decode(sm.m.encode_snapshot())
    body["idempotency"] = [record[:3] for record in body["idempotency"]]
    body["artifacts"] = [artifact[:6] for artifact in body["artifacts"]]
    loaded = Machine(StateMachine.from_snapshot(msgspec.msgpack.encode(body)))
    loaded.m.check_invariants()
    # The key's scope is read from its task's tenant: it still replays for that tenant only.
    assert list(loaded.m.idempotency) == [("a", "k")]
    assert loaded.m.artifacts["c" * 64].uploads == []
    replay = loaded.apply(
        e.SubmitTasks(time_ms=loaded.now, tasks=(loaded.spec("a"),), idempotency_key="k")
    )
    assert isinstance(replay, ReplayedResults)


# --- slots ---------------------------------------------------------------------------------


async def test_another_tenants_slot_of_the_same_name_does_not_block(env: Env) -> None:
    alice = await _post_task(env, "alice", slot="x")
    assert alice.status_code == 201, alice.text
    bob = await _post_task(env, "bob", slot="x")
    assert bob.status_code == 201, bob.text
    # Within one tenant the slot still holds: the second submission is refused.
    for who, holder in (("alice", alice), ("bob", bob)):
        busy = await _post_task(env, who, slot="x")
        assert error_code(busy, 409) == "slot_busy"
        assert str(holder.json()["id"]) in busy.json()["error"]["message"]
    # Bob's slot frees when his task ends; Alice's stays held by hers.
    cancelled = await env.call("bob", "POST", f"{TASKS}/{bob.json()['id']}/cancel")
    assert cancelled.status_code == 200
    assert (await _post_task(env, "bob", slot="x")).status_code == 201
    assert error_code(await _post_task(env, "alice", slot="x"), 409) == "slot_busy"


# --- transactions --------------------------------------------------------------------------


async def test_another_tenants_transaction_is_not_found_by_any_route(env: Env) -> None:
    txn = (await env.call("alice", "POST", TXNS, json={"ttl_s": 30})).json()["id"]
    missing = txn + 1000
    # To Bob it answers exactly as a transaction that does not exist.
    for action in ("commit", "rollback"):
        mine = await env.call("bob", "POST", f"{TXNS}/{txn}/{action}")
        none = await env.call("bob", "POST", f"{TXNS}/{missing}/{action}")
        assert error_code(mine, 404) == error_code(none, 404) == "not_found"
        assert mine.json()["error"]["message"] == f"transaction {txn} is not open"
    joined = await _post_task(env, "bob", transaction=txn)
    assert error_code(joined, 404) == "not_found"
    # Nor does an admin's submission for Bob find it (it names nobody's tenant).
    as_admin = await _post_task(env, "admin", tenant="bob", transaction=txn)
    assert error_code(as_admin, 404) == "not_found"
    assert as_admin.json()["error"]["message"] == f"transaction {txn} is not open"
    assert "alice" not in as_admin.text
    # Alice's transaction was left alone.
    assert (await _post_task(env, "alice", transaction=txn)).status_code == 201
    done = await env.call("alice", "POST", f"{TXNS}/{txn}/commit")
    assert done.status_code == 200 and done.json()["outcome"] == "committed"


def test_the_state_machine_scopes_transaction_lookups_too() -> None:
    # apply is the authority: an entry naming another tenant finds nothing.
    sm = Machine()
    txn = sm.begin("alice")
    sm.add("alice", transaction=txn)
    for entry in (
        e.CommitTransaction(time_ms=sm.now, transaction_id=txn, tenant="bob"),
        e.RollbackTransaction(time_ms=sm.now, transaction_id=txn, tenant="bob"),
    ):
        refused = sm.apply(entry)
        assert refused == Rejected(ErrorCode.NOT_FOUND, f"transaction {txn} is not open")
    done = sm.apply(e.CommitTransaction(time_ms=sm.now, transaction_id=txn, tenant="alice"))
    assert isinstance(done, TransactionDone) and done.outcome == "committed"


# --- code uploads --------------------------------------------------------------------------

ALICES = b"def run(ctx, params):\n    return 'shared'\n"
BOBS_OWN = b"def run(ctx, params):\n    return 'bobbie'\n"  # same length, never seen before


async def test_uploading_bytes_another_tenant_uploaded_answers_like_a_first_upload(
    env: Env,
) -> None:
    assert len(ALICES) == len(BOBS_OWN)
    first = await env.call(
        "alice", "POST", "/api/v1/code?name=alice-secret-model.py", content=ALICES
    )
    assert first.status_code == 201, first.text
    # Bob uploads the same bytes Alice did, and bytes nobody uploaded: the two answers
    # differ only in the hash (which he computes himself) and his own upload times.
    fresh = await env.call("bob", "POST", "/api/v1/code?name=job.py", content=BOBS_OWN)
    await asyncio.sleep(0.005)  # so that his two uploads have different times
    seen = await env.call("bob", "POST", "/api/v1/code?name=job.py", content=ALICES)
    assert seen.status_code == fresh.status_code == 201, (seen.text, fresh.text)
    assert sorted(seen.headers) == sorted(fresh.headers)

    def shape(body: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in body.items() if k not in ("sha256", "created_at")}

    assert shape(seen.json()) == shape(fresh.json())
    assert seen.json()["name"] == "job.py"
    # His upload's time is his own, not Alice's first upload's.
    sha = seen.json()["sha256"]
    artifact = env.node.state.artifacts[sha]
    bobs = artifact.upload_of("bob")
    assert bobs is not None and bobs.name == "job.py"
    assert seen.json()["created_at"] == iso_ms(bobs.created_ms)
    # And his listing shows what he uploaded, nothing of Alice's.
    listed = await env.call("bob", "GET", "/api/v1/code")
    assert listed.status_code == 200
    names = {a["sha256"]: a["name"] for a in listed.json()["artifacts"]}
    assert names == {sha: "job.py", fresh.json()["sha256"]: "job.py"}
    # In the order he uploaded them: the bytes Alice sent first are not listed first.
    assert [a["sha256"] for a in listed.json()["artifacts"]] == [fresh.json()["sha256"], sha]
    assert "alice" not in listed.text
    # Alice keeps seeing her own name.
    hers = await env.call("alice", "GET", "/api/v1/code")
    assert [a["name"] for a in hers.json()["artifacts"]] == ["alice-secret-model.py"]


def test_an_admin_share_shows_the_admins_name_to_every_tenant() -> None:
    sm = Machine()
    sha = "d" * 64
    sm.apply(e.AddCode(time_ms=sm.at(1), sha256=sha, name="private.py", size_bytes=1, tenant="a"))
    sm.apply(e.AddCode(time_ms=sm.at(1), sha256=sha, name="shared.py", size_bytes=1))
    artifact = sm.m.artifacts[sha]
    assert (artifact.owners, artifact.name, artifact.created_ms) == ([], "shared.py", sm.now)
    own = artifact.upload_of("a")
    assert own is not None and own.name == "private.py"
