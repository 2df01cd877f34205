"""The HTTP API (broker/api/http_api.py) in process: reading and cancelling tasks,
transactions and tenants.

The ``api`` fixture (tests/support/http_api.py) fails a test on any unexpected 5xx.
"""

from __future__ import annotations

import asyncio
import re
from datetime import datetime
from typing import Any

import pytest

from tests.support.http_api import (
    FAR_FUTURE_UNIX,
    STATES,
    TASKS,
    TXNS,
    Api,
    all_tasks,
    begin,
    error_of,
    get_task,
    observe,
    raw_asgi,
    submit,
)

# --- reading tasks -------------------------------------------------------------------------


async def test_get_unknown_task_is_404(api: Api) -> None:
    assert "does not exist" in error_of(await api.get(f"{TASKS}/1"), 404, "not_found")
    assert "does not exist" in error_of(await api.get(f"{TASKS}/0"), 404, "not_found")


@pytest.mark.parametrize("task_id", ["abc", "-1", "1.5", "1e3", "9" * 19, "1%20"])
async def test_get_non_numeric_or_overlong_id_is_404_no_route(api: Api, task_id: str) -> None:
    assert "no such endpoint" in error_of(await api.get(f"{TASKS}/{task_id}"), 404, "not_found")


async def test_get_huge_id_is_404(api: Api) -> None:
    message = error_of(await api.get(f"{TASKS}/{'9' * 18}"), 404, "not_found")
    assert "9" * 18 in message


@pytest.mark.parametrize(
    ("query", "fragment"),
    [
        ("wait_s=x", "wait_s must be"),
        ("wait_s=-1", "wait_s must be"),
        ("wait_s=nan", "wait_s must be"),
        ("wait_s=inf", "wait_s must be"),
        ("wait_s=100000", "wait_s must be"),
        ("wait_s=1&wait_s=2", "given twice"),
        ("state=waiting", "unknown query parameters"),
    ],
)
async def test_get_task_bad_query_is_400(api: Api, query: str, fragment: str) -> None:
    created = await submit(api)
    response = await api.get(f"{TASKS}/{created['id']}?{query}")
    assert fragment in error_of(response, 400, "invalid_request")


async def test_get_task_long_poll(api: Api) -> None:
    created = await submit(api)
    task_url = f"{TASKS}/{created['id']}"
    # Times out with the current state.
    response = await api.get(task_url, params={"wait_s": 0.05})
    assert response.json()["state"] == "waiting"
    # Answers as soon as the task reaches a final state.
    poll = asyncio.create_task(api.get(task_url, params={"wait_s": 10}))
    await asyncio.sleep(0.05)
    assert not poll.done()
    await api.post(f"{task_url}/cancel")
    response = await asyncio.wait_for(poll, 5)
    assert response.json()["state"] == "cancelled"
    # A final task is answered at once.
    response = await asyncio.wait_for(api.get(task_url, params={"wait_s": 10}), 5)
    assert response.json()["state"] == "cancelled"
    error_of(await api.get(f"{TASKS}/999", params={"wait_s": 1}), 404, "not_found")


async def populate(api: Api) -> dict[str, list[int]]:
    """Tasks of two tenants and two types, one cancelled, one delayed."""
    ids: dict[str, list[int]] = {"all": []}
    for i in range(7):
        tenant = "t1" if i % 2 == 0 else "t2"
        task_type = "alpha" if i < 4 else "beta"
        created = await submit(api, type=task_type, tenant=tenant)
        ids["all"].append(created["id"])
    cancelled = ids["all"][2]
    assert (await api.post(f"{TASKS}/{cancelled}/cancel")).status_code == 200
    delayed = await submit(api, type="beta", tenant="t1", start_after=FAR_FUTURE_UNIX)
    ids["all"].append(delayed["id"])
    ids["cancelled"] = [cancelled]
    ids["delayed"] = [delayed["id"]]
    return ids


async def test_list_filters(api: Api) -> None:
    ids = await populate(api)
    everything = await all_tasks(api)
    assert [t["id"] for t in everything] == ids["all"]
    assert [t["id"] for t in await all_tasks(api, state="cancelled")] == ids["cancelled"]
    assert [t["id"] for t in await all_tasks(api, state="delayed")] == ids["delayed"]
    waiting = [t["id"] for t in await all_tasks(api, state="waiting")]
    assert waiting == [i for i in ids["all"] if i not in ids["cancelled"] + ids["delayed"]]
    assert await all_tasks(api, state="running") == []
    t1 = await all_tasks(api, tenant="t1")
    assert t1 and all(t["tenant"] == "t1" for t in t1)
    assert [t["id"] for t in t1] == [t["id"] for t in everything if t["tenant"] == "t1"]
    beta = await all_tasks(api, type="beta")
    assert [t["id"] for t in beta] == [t["id"] for t in everything if t["type"] == "beta"]
    combined = await all_tasks(api, tenant="t1", type="beta", state="waiting")
    assert [t["id"] for t in combined] == [
        t["id"]
        for t in everything
        if t["tenant"] == "t1" and t["type"] == "beta" and t["state"] == "waiting"
    ]
    assert await all_tasks(api, tenant="nobody") == []
    assert await all_tasks(api, type="") == []
    after = await all_tasks(api, after=ids["all"][3])
    assert [t["id"] for t in after] == ids["all"][4:]


async def test_list_default_limit_and_empty(api: Api) -> None:
    response = await api.get(TASKS)
    assert response.status_code == 200
    assert response.json() == {"tasks": [], "next_after": None}


async def test_list_pagination_with_next_after(api: Api) -> None:
    ids = await populate(api)
    seen: list[int] = []
    after = 0
    for _ in range(20):
        response = await api.get(TASKS, params={"limit": 3, "after": after})
        assert response.status_code == 200
        page = response.json()
        assert len(page["tasks"]) <= 3
        seen.extend(t["id"] for t in page["tasks"])
        if page["next_after"] is None:
            break
        assert page["next_after"] == page["tasks"][-1]["id"]
        after = page["next_after"]
    else:
        raise AssertionError("pagination never ended")
    assert seen == ids["all"]
    # Filtered pagination too.
    first = (await api.get(TASKS, params={"tenant": "t2", "limit": 1})).json()
    second = (
        await api.get(TASKS, params={"tenant": "t2", "limit": 1, "after": first["next_after"]})
    ).json()
    assert [t["tenant"] for t in first["tasks"] + second["tasks"]] == ["t2", "t2"]
    assert first["tasks"][0]["id"] < second["tasks"][0]["id"]


@pytest.mark.parametrize(
    ("query", "fragment"),
    [
        ("state=bogus", "state must be one of"),
        ("state=", "state must be one of"),
        ("state=WAITING", "state must be one of"),
        ("limit=0", "limit must be"),
        ("limit=51", "limit must be"),
        ("limit=100000", "limit must be"),
        ("limit=x", "limit must be"),
        ("limit=-1", "limit must be"),
        ("limit=", "limit must be"),
        ("limit=1.5", "limit must be"),
        ("limit=" + "9" * 30, "limit must be"),
        ("after=x", "after must be"),
        ("after=-1", "after must be"),
        ("after=" + "9" * 20, "after must be"),
        ("page=2", "page"),
        ("limit=5&page=2&sort=id", "sort"),
        ("limit=1&limit=2", "given twice"),
        ("state=waiting&state=waiting", "given twice"),
        ("justakey", "malformed query string"),
        ("a=1&&b=2", "malformed query string"),
    ],
)
async def test_list_bad_query_is_400(api: Api, query: str, fragment: str) -> None:
    response = await api.get(f"{TASKS}?{query}")
    assert fragment in error_of(response, 400, "invalid_request")


async def test_list_non_ascii_query_is_400(api: Api) -> None:
    status, body = await raw_asgi(api, "GET", TASKS, query="tenant=é".encode())
    assert status == 400
    assert body["error"]["code"] == "invalid_request"


async def test_list_every_state_is_a_valid_filter(api: Api) -> None:
    for state in STATES:
        assert (await api.get(TASKS, params={"state": state})).status_code == 200


# --- cancel ----------------------------------------------------------------------------------


async def test_cancel_waiting_then_again_is_409(api: Api) -> None:
    created = await submit(api)
    response = await api.post(f"{TASKS}/{created['id']}/cancel")
    assert response.status_code == 200
    assert response.json() == {"id": created["id"], "state": "cancelled"}
    task = await get_task(api, created["id"])
    assert task["state"] == "cancelled"
    assert task["finished_at"] is not None
    before = await observe(api)
    again = await api.post(f"{TASKS}/{created['id']}/cancel")
    assert "already cancelled" in error_of(again, 409, "conflict")
    # The refusal was logged (apply is the authority) but changed no task.
    assert (await observe(api))[2:] == before[2:]


async def test_cancel_delayed_and_pending_tasks(api: Api) -> None:
    delayed = await submit(api, start_after=FAR_FUTURE_UNIX)
    txn = await begin(api)
    pending = await submit(api, transaction=txn)
    for task in (delayed, pending):
        response = await api.post(f"{TASKS}/{task['id']}/cancel")
        assert response.json() == {"id": task["id"], "state": "cancelled"}
    committed = await api.post(f"{TXNS}/{txn}/commit")
    assert committed.json()["tasks"] == []


async def test_cancel_unknown_is_404_and_logs_nothing(api: Api) -> None:
    before = await observe(api)
    error_of(await api.post(f"{TASKS}/77/cancel"), 404, "not_found")
    error_of(await api.post(f"{TASKS}/x/cancel"), 404, "not_found")
    assert await observe(api) == before


async def test_cancel_with_a_body_is_400(api: Api) -> None:
    created = await submit(api)
    before = await observe(api)
    response = await api.post(f"{TASKS}/{created['id']}/cancel", json={"reason": "x"})
    assert "no body" in error_of(response, 400, "invalid_request")
    assert await observe(api) == before
    assert (await get_task(api, created["id"]))["state"] == "waiting"


async def test_cancel_with_get_is_405(api: Api) -> None:
    created = await submit(api)
    error_of(await api.get(f"{TASKS}/{created['id']}/cancel"), 405, "method_not_allowed")


# --- transactions -------------------------------------------------------------------------


async def test_begin_defaults(api: Api) -> None:
    for response in (await api.post(TXNS), await api.post(TXNS, json={})):
        assert response.status_code == 201
        body = response.json()
        assert set(body) == {"id", "tenant", "expires_at"}
        assert body["tenant"] == "default"
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", body["expires_at"])
    first, second = (await api.post(TXNS)).json(), (await api.post(TXNS)).json()
    assert second["id"] == first["id"] + 1


async def test_begin_with_tenant_and_ttl(api: Api) -> None:
    response = await api.post(TXNS, json={"tenant": "team-x", "ttl_s": 3600})
    assert response.status_code == 201
    body = response.json()
    assert body["tenant"] == "team-x"
    expires = datetime.fromisoformat(body["expires_at"].replace("Z", "+00:00"))
    delta_s = expires.timestamp() - api.node.clock_ms() / 1000
    assert 3590 < delta_s <= 3600


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"ttl_s": 0}, "ttl_s"),
        ({"ttl_s": -1}, "ttl_s"),
        ({"ttl_s": 86401}, "ttl_s"),
        ({"ttl_s": 1e300}, "ttl_s"),
        ({"ttl_s": "60"}, "$.ttl_s"),
        ({"ttl_s": None}, "$.ttl_s"),
        ({"tenant": ""}, "tenant"),
        ({"tenant": "bad name"}, "tenant"),
        ({"tenant": 5}, "$.tenant"),
        ({"isolation": "serializable"}, "isolation"),
        (b"[]", "object"),
        (b"{", "malformed JSON"),
    ],
)
async def test_begin_invalid_is_400(api: Api, body: Any, fragment: str) -> None:
    before = await observe(api)
    if isinstance(body, bytes):
        response = await api.post(TXNS, content=body)
    else:
        response = await api.post(TXNS, json=body)
    assert response.status_code == 400
    code = response.json()["error"]["code"]
    assert fragment in error_of(response, 400, code)
    assert code in {"invalid_request", "invalid_json"}
    assert await observe(api) == before


async def test_commit_makes_every_task_waiting(api: Api) -> None:
    outside = await submit(api)
    txn = await begin(api)
    inside = [await submit(api, transaction=txn, params=i) for i in range(3)]
    response = await api.post(TASKS, json={"tasks": [{"type": "b", "transaction": txn}]})
    inside.append(response.json()["tasks"][0])
    assert {t["state"] for t in inside} == {"pending"}
    assert len(await all_tasks(api, state="pending")) == 4
    task = await get_task(api, inside[0]["id"])
    assert task["transaction"] == txn
    response = await api.post(f"{TXNS}/{txn}/commit")
    assert response.status_code == 200
    ids = [t["id"] for t in inside]
    assert response.json() == {"id": txn, "outcome": "committed", "tasks": ids}
    for task_id in ids:
        task = await get_task(api, task_id)
        assert task["state"] == "waiting"
        assert task["transaction"] is None
    assert (await get_task(api, outside["id"]))["state"] == "waiting"
    assert await all_tasks(api, state="pending") == []
    error_of(await api.post(TASKS, json={"type": "a", "transaction": txn}), 404, "not_found")


async def test_commit_with_a_delayed_task(api: Api) -> None:
    txn = await begin(api)
    task = await submit(api, transaction=txn, start_after=FAR_FUTURE_UNIX)
    assert task["state"] == "pending"
    assert (await api.post(f"{TXNS}/{txn}/commit")).status_code == 200
    assert (await get_task(api, task["id"]))["state"] == "delayed"


async def test_rollback_drops_the_tasks(api: Api) -> None:
    txn = await begin(api, tenant="t")
    inside = [await submit(api, tenant="t", transaction=txn, slot=f"s{i}") for i in range(2)]
    response = await api.post(f"{TXNS}/{txn}/rollback")
    assert response.status_code == 200
    ids = [t["id"] for t in inside]
    assert response.json() == {"id": txn, "outcome": "rolled_back", "tasks": ids}
    for task_id in ids:
        error_of(await api.get(f"{TASKS}/{task_id}"), 404, "not_found")
    assert await all_tasks(api) == []
    assert (await submit(api, tenant="t", slot="s0"))["state"] == "waiting"  # slot freed


async def test_commit_and_rollback_unknown_are_404(api: Api) -> None:
    before = await observe(api)
    for action in ("commit", "rollback"):
        error_of(await api.post(f"{TXNS}/42/{action}"), 404, "not_found")
        error_of(await api.post(f"{TXNS}/{'9' * 18}/{action}"), 404, "not_found")
        error_of(await api.post(f"{TXNS}/abc/{action}"), 404, "not_found")
    assert await observe(api) == before


async def test_commit_twice_is_404_the_second_time(api: Api) -> None:
    txn = await begin(api)
    assert (await api.post(f"{TXNS}/{txn}/commit")).status_code == 200
    error_of(await api.post(f"{TXNS}/{txn}/commit"), 404, "not_found")
    error_of(await api.post(f"{TXNS}/{txn}/rollback"), 404, "not_found")


async def test_rollback_after_rollback_is_404(api: Api) -> None:
    txn = await begin(api)
    assert (await api.post(f"{TXNS}/{txn}/rollback")).status_code == 200
    error_of(await api.post(f"{TXNS}/{txn}/rollback"), 404, "not_found")
    error_of(await api.post(f"{TXNS}/{txn}/commit"), 404, "not_found")


async def test_commit_with_a_body_is_400(api: Api) -> None:
    txn = await begin(api)
    response = await api.post(f"{TXNS}/{txn}/commit", json={"force": True})
    assert "no body" in error_of(response, 400, "invalid_request")
    assert (await api.post(f"{TXNS}/{txn}/commit")).status_code == 200


async def test_expired_transaction_drops_its_tasks(api: Api) -> None:
    response = await api.post(TXNS, json={"ttl_s": 0.1})
    txn = response.json()["id"]
    task = await submit(api, transaction=txn)
    for _ in range(500):
        if (await api.get(f"{TASKS}/{task['id']}")).status_code == 404:
            break
        await asyncio.sleep(0.01)
    error_of(await api.get(f"{TASKS}/{task['id']}"), 404, "not_found")
    error_of(await api.post(f"{TXNS}/{txn}/commit"), 404, "not_found")


# --- tenants -------------------------------------------------------------------------------


async def test_get_unknown_tenant_is_404(api: Api) -> None:
    assert "unknown" in error_of(await api.get("/api/v1/tenants/nobody"), 404, "not_found")


async def test_put_creates_and_returns_limits(api: Api) -> None:
    response = await api.put(
        "/api/v1/tenants/team-a", json={"max_waiting": 10, "max_running": 2, "weight": 2.5}
    )
    assert response.status_code == 200
    view = response.json()
    assert view == {
        "name": "team-a",
        "max_waiting": 10,
        "max_running": 2,
        "weight": 2.5,
        "counts": dict.fromkeys(STATES, 0),
        "submit_rate": 0.0,
        "submit_burst": 0,
    }
    assert (await api.get("/api/v1/tenants/team-a")).json() == view
    listed = (await api.get("/api/v1/tenants")).json()
    assert view in listed["tenants"]


async def test_put_partial_keeps_other_fields(api: Api) -> None:
    await api.put("/api/v1/tenants/t", json={"max_waiting": 10, "max_running": 2, "weight": 2.5})
    response = await api.put("/api/v1/tenants/t", json={"max_running": 5})
    assert response.json()["max_waiting"] == 10
    assert response.json()["max_running"] == 5
    assert response.json()["weight"] == 2.5
    response = await api.put("/api/v1/tenants/t", json={"weight": None})
    assert response.json()["weight"] == 2.5
    response = await api.put("/api/v1/tenants/t", json={})
    assert (response.json()["max_waiting"], response.json()["max_running"]) == (10, 5)
    response = await api.put("/api/v1/tenants/t", json={"max_waiting": 0})
    assert response.json()["max_waiting"] == 0  # 0: unlimited


async def test_put_new_tenant_gets_defaults(api: Api) -> None:
    response = await api.put("/api/v1/tenants/fresh", json={"weight": 3})
    assert response.json()["max_waiting"] == 0
    assert response.json()["max_running"] == 0
    assert response.json()["weight"] == 3.0


async def test_tenant_counts_follow_its_tasks(api: Api) -> None:
    await submit(api, tenant="counted")
    await submit(api, tenant="counted", start_after=FAR_FUTURE_UNIX)
    view = (await api.get("/api/v1/tenants/counted")).json()
    assert view["counts"]["waiting"] == 1
    assert view["counts"]["delayed"] == 1


@pytest.mark.parametrize(
    ("body", "code", "fragment"),
    [
        ({"max_waiting": -1}, "invalid_request", "max_waiting"),
        ({"max_running": -5}, "invalid_request", "max_running"),
        ({"weight": 0}, "invalid_request", "weight"),
        ({"weight": -1.5}, "invalid_request", "weight"),
        ({"weight": "x"}, "invalid_request", "$.weight"),
        (b'{"weight": 1e400}', "invalid_request", "$.weight"),
        ({"max_waiting": "10"}, "invalid_request", "$.max_waiting"),
        ({"max_waiting": 1.5}, "invalid_request", "$.max_waiting"),
        ({"max_waiting": 2**64}, "invalid_request", "$.max_waiting"),
        ({"max_running": 2**63}, "invalid_request", "$.max_running"),
        ({"max_queued": 5}, "invalid_request", "max_queued"),
        ({"weight": 1, "priority": 3}, "invalid_request", "priority"),
        (b"", "invalid_request", "body is required"),
        (b"[1]", "invalid_request", "object"),
        (b"{max_waiting: 1}", "invalid_json", "malformed JSON"),
    ],
)
async def test_put_invalid_limits_is_400(api: Api, body: Any, code: str, fragment: str) -> None:
    await api.put("/api/v1/tenants/t", json={"max_waiting": 3})
    before = await observe(api)
    if isinstance(body, bytes):
        response = await api.put("/api/v1/tenants/t", content=body)
    else:
        response = await api.put("/api/v1/tenants/t", json=body)
    assert fragment in error_of(response, 400, code)
    assert await observe(api) == before
    assert (await api.get("/api/v1/tenants/t")).json()["max_waiting"] == 3


@pytest.mark.parametrize("name", ["-x", "a%20b", "%C3%A9t%C3%A9", "x" * 65, ".hidden"])
async def test_invalid_tenant_name_is_400(api: Api, name: str) -> None:
    before = await observe(api)
    message = error_of(await api.get(f"/api/v1/tenants/{name}"), 400, "invalid_request")
    assert "not valid" in message
    response = await api.put(f"/api/v1/tenants/{name}", json={"weight": 2})
    error_of(response, 400, "invalid_request")
    assert await observe(api) == before


async def test_tenant_name_with_a_slash_has_no_route(api: Api) -> None:
    error_of(await api.get("/api/v1/tenants/a/b"), 404, "not_found")


async def test_lowering_max_waiting_is_effective_at_once(api: Api) -> None:
    existing = [await submit(api, tenant="shrink") for _ in range(3)]
    response = await api.put("/api/v1/tenants/shrink", json={"max_waiting": 2})
    assert response.status_code == 200
    assert response.json()["counts"]["waiting"] == 3
    error_of(
        await api.post(TASKS, json={"type": "a", "tenant": "shrink"}), 429, "tenant_queue_full"
    )
    remaining = await all_tasks(api, tenant="shrink")
    assert [t["id"] for t in remaining] == [t["id"] for t in existing]
    assert {t["state"] for t in remaining} == {"waiting"}
    # Below the limit again after two cancellations.
    await api.post(f"{TASKS}/{existing[0]['id']}/cancel")
    error_of(
        await api.post(TASKS, json={"type": "a", "tenant": "shrink"}), 429, "tenant_queue_full"
    )
    await api.post(f"{TASKS}/{existing[1]['id']}/cancel")
    assert (await submit(api, tenant="shrink"))["state"] == "waiting"
    # Raising it (0: unlimited) is effective at once too.
    await api.put("/api/v1/tenants/shrink", json={"max_waiting": 0})
    for _ in range(3):
        await submit(api, tenant="shrink")
