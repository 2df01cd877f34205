"""Cancel by filter: the CancelTasks entry (broker/core/tasks.py) and
POST /api/v1/tasks/cancel (broker/api/handlers_bulk.py), in process."""

from __future__ import annotations

import msgspec
import pytest

from broker.core import CancelCount, ErrorCode, StateMachine
from broker.core import entries as e
from tests.support.auth_env import Env, error_code
from tests.support.http_api import TASKS, Api, get_task
from tests.support.machine import Trees, code

BULK = "/api/v1/tasks/cancel"


def test_cancel_tasks_cancels_live_ones_and_skips_the_rest() -> None:
    m = Trees()
    waiting = m.add()
    running = m.add()
    m.run(running)
    done = m.add()
    m.done(done)
    other = m.add("u")
    entry = e.CancelTasks(
        time_ms=m.now, task_ids=(waiting, running, done, other, 999), reason="bulk", tenant="t"
    )
    # Written as entry format 3, the first that has it (a format-2 broker refuses it).
    assert e.decode_entry(e.encode_entry(entry)) == msgspec.structs.replace(entry, v=3)
    assert m.apply(entry) == CancelCount(cancelled=2, skipped=3)
    assert [m.state(i) for i in (waiting, running, done, other)] == [
        "cancelled",
        "cancelled",
        "finished",
        "waiting",
    ]
    assert m.m.tasks[running].error == "bulk"
    _, stops = m.drain_effects()
    assert [s.task_id for s in stops] == [running]  # its worker is told to stop it
    # An admin's batch (no tenant) takes any tenant's task.
    assert m.apply(e.CancelTasks(time_ms=m.now, task_ids=(other,))) == CancelCount(1, 0)
    copy = StateMachine.from_snapshot(m.m.encode_snapshot())
    assert copy.digest() == m.m.digest()


def test_a_batch_over_the_bound_is_refused() -> None:
    m = Trees()
    ids = tuple(range(1, e.MAX_CANCEL_BATCH + 2))
    assert code(m.apply(e.CancelTasks(time_ms=m.now, task_ids=ids))) is ErrorCode.INVALID


async def _submit(api: Api, **task: object) -> int:
    response = await api.post(TASKS, json={"type": "noop", **task})
    assert response.status_code == 201, response.text
    task_id: int = response.json()["id"]
    return task_id


async def test_cancel_by_tenant_type_state_and_time(api: Api) -> None:
    a1 = await _submit(api, tenant="a")
    a2 = await _submit(api, tenant="a", type="etl")
    a3 = await _submit(api, tenant="a", start_after=4102444800)  # delayed
    b1 = await _submit(api, tenant="b")
    response = await api.post(BULK, json={"tenant": "a", "state": "waiting", "type": "etl"})
    assert response.status_code == 200, response.text
    assert response.json() == {"matched": 1, "cancelled": 1, "skipped": 0, "batches": 1}
    assert (await get_task(api, a2))["state"] == "cancelled"
    response = await api.post(BULK, json={"tenant": "a", "reason": "clean-up"})
    assert response.json()["cancelled"] == 2
    assert (await get_task(api, a3))["error"] == "clean-up"
    assert (await get_task(api, a1))["state"] == "cancelled"
    assert (await get_task(api, b1))["state"] == "waiting"
    nothing_before = await api.post(BULK, json={"submitted_before": 1_000_000_000})
    assert nothing_before.json() == {"matched": 0, "cancelled": 0, "skipped": 0, "batches": 0}
    everyone = await api.post(BULK, json={"submitted_before": 4102444800})  # an admin: all
    assert everyone.json()["cancelled"] == 1


async def test_cancel_a_tree_and_in_several_batches(api: Api) -> None:
    root = await _submit(api, tenant="t", track_tree=True)
    plain = await _submit(api, tenant="t")
    response = await api.post(BULK, json={"tree": root})
    assert response.json()["cancelled"] == 1
    assert (await get_task(api, plain))["state"] == "waiting"
    body = {"tasks": [{"type": "noop", "tenant": "many"}] * 5}
    for _ in range(250):  # 1,250 tasks: two batches
        assert (await api.post(TASKS, json=body)).status_code == 200
    response = await api.post(BULK, json={"tenant": "many"})
    assert response.json() == {"matched": 1250, "cancelled": 1250, "skipped": 0, "batches": 2}


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "at least one filter"),
        ({"state": "finished"}, "live state"),
        ({"state": "sleeping"}, "$.state"),
        ({"tenant": "a", "colour": "red"}, "colour"),
        ({"tenant": "a", "reason": ""}, "reason"),
        ({"submitted_before": "yesterday"}, "submitted_before"),
    ],
)
async def test_bad_bulk_cancels_are_400(api: Api, body: dict[str, object], message: str) -> None:
    response = await api.post(BULK, json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


async def test_a_tenant_cancels_its_own_tasks_only(env: Env) -> None:
    ids = {}
    for who in ("alice", "bob"):
        response = await env.call(who, "POST", TASKS, json={"type": "noop"})
        ids[who] = response.json()["id"]
    refused = await env.call("alice", "POST", BULK, json={"tenant": "bob"})
    assert error_code(refused, 403) == "forbidden"
    assert error_code(await env.call("worker", "POST", BULK, json={"state": "waiting"}), 403)
    mine = await env.call("alice", "POST", BULK, json={"state": "waiting"})
    assert mine.json()["cancelled"] == 1
    states = {}
    for who, task_id in ids.items():
        states[who] = (await env.call("admin", "GET", f"{TASKS}/{task_id}")).json()["state"]
    assert states == {"alice": "cancelled", "bob": "waiting"}
