"""The HTTP API (broker/api/http_api.py) in process: submitting tasks, accepted and refused.

The ``api`` fixture (tests/support/http_api.py) fails a test on any unexpected 5xx.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.support.http_api import (
    CONFIG,
    FAR_FUTURE,
    FAR_FUTURE_UNIX,
    PAST_UNIX,
    TASKS,
    Api,
    all_tasks,
    begin,
    error_of,
    get_task,
    observe,
    raw_asgi,
    submit,
    wait_for_state,
)

# --- submit: happy paths --------------------------------------------------------------


async def test_submit_single_returns_201_id_and_state(api: Api) -> None:
    response = await api.post(TASKS, json={"type": "noop"})
    assert response.status_code == 201
    assert response.json() == {"id": 1, "state": "waiting"}
    task = await get_task(api, 1)
    assert task["type"] == "noop"
    assert task["tenant"] == "default"
    assert task["state"] == "waiting"
    assert task["params"] is None
    assert task["attempt"] == 0
    assert task["max_attempts"] == 1
    assert task["created_at"].endswith("Z")
    assert task["updated_at"] == task["created_at"]
    for absent in ("slot", "transaction", "worker", "deadline", "start_after", "finished_at"):
        assert task[absent] is None


async def test_submit_all_fields_shown_back(api: Api) -> None:
    created = await submit(
        api,
        type="pkg.mod:run",
        allow_unknown_type=True,  # no code: an embedded worker's own name
        tenant="team-a",
        params={"x": 1},
        slot="nightly/report",
        max_attempts=3,
        deadline=FAR_FUTURE_UNIX,
        resources={"cpu": 2, "memory_mb": 512.5, "gpu": 0},
    )
    task = await get_task(api, created["id"])
    assert task["type"] == "pkg.mod:run"
    assert task["tenant"] == "team-a"
    assert task["params"] == {"x": 1}
    assert task["slot"] == "nightly/report"
    assert task["max_attempts"] == 3
    assert task["deadline"] == FAR_FUTURE
    assert task["resources"] == {"cpu": 2.0, "memory_mb": 512.5, "gpu": 0.0}


async def test_priority_and_retry_backoff_shown_back(api: Api) -> None:
    plain = await get_task(api, (await submit(api, type="a"))["id"])
    assert plain["priority"] == 0 and plain["retry_backoff_s"] is None
    created = await submit(api, type="a", priority=-7, max_attempts=3, retry_backoff_s=1.5)
    task = await get_task(api, created["id"])
    assert task["priority"] == -7
    assert task["retry_backoff_s"] == 1.5 and task["retry_backoff_max_s"] == 3600.0
    created = await submit(api, type="a", retry_backoff_s=2, retry_backoff_max_s=10)
    assert (await get_task(api, created["id"]))["retry_backoff_max_s"] == 10.0


async def test_max_lost_is_taken_and_shown_with_the_lost_count(api: Api) -> None:
    """docs/API.md: ``max_lost`` (default 3) bounds the attempts lost with a worker, which
    ``lost`` counts; not counted against max_attempts (docs/DESIGN.md §6, "Lost workers")."""
    plain = await get_task(api, (await submit(api, type="a"))["id"])
    assert (plain["lost"], plain["max_lost"]) == (0, 3)
    created = await submit(api, type="a", max_lost=0)
    assert (await get_task(api, created["id"]))["max_lost"] == 0
    response = await api.post(TASKS, json={"tasks": [{"type": "a", "max_lost": 100}]})
    assert response.status_code == 200, response.text
    assert (await get_task(api, response.json()["tasks"][0]["id"]))["max_lost"] == 100
    for bad in (-1, 101):
        response = await api.post(TASKS, json={"type": "a", "max_lost": bad})
        message = error_of(response, 400, "invalid_request")
        assert message == "max_lost must be between 0 and 100", message


async def test_a_huge_backoff_is_a_400_not_a_server_error(api: Api) -> None:
    # Found by the HTTP fuzzer: 1.8e308 s overflowed to inf once in milliseconds.
    for field in ("retry_backoff_s", "retry_backoff_max_s"):
        body = {"type": "a", "max_attempts": 2, "retry_backoff_s": 1, field: 1.7976931348623157e308}
        response = await api.post(TASKS, json=body)
        assert response.status_code == 400, response.text
        assert field in response.json()["error"]["message"], response.text


async def test_submit_batch_returns_per_task_results(api: Api) -> None:
    body = {"tasks": [{"type": "a"}, {"type": "b", "tenant": "t2"}, {"type": "c"}]}
    response = await api.post(TASKS, json=body)
    assert response.status_code == 200
    assert response.json() == {
        "tasks": [
            {"id": 1, "state": "waiting"},
            {"id": 2, "state": "waiting"},
            {"id": 3, "state": "waiting"},
        ]
    }
    assert [t["type"] for t in await all_tasks(api)] == ["a", "b", "c"]
    assert (await get_task(api, 2))["tenant"] == "t2"


async def test_batch_of_max_size_is_accepted(api: Api) -> None:
    body = {"tasks": [{"type": "a"}] * CONFIG.max_tasks_per_request}
    response = await api.post(TASKS, json=body)
    assert response.status_code == 200
    assert len(response.json()["tasks"]) == CONFIG.max_tasks_per_request


async def test_batch_per_task_errors_leave_the_others_accepted(api: Api) -> None:
    await api.put("/api/v1/tenants/small", json={"max_waiting": 1})
    body = {
        "tasks": [
            {"type": "a", "slot": "s"},
            {"type": "a", "slot": "s"},  # slot held by the first one
            {"type": "a", "deadline": PAST_UNIX},
            {"type": "a", "transaction": 999},
            {"type": "a", "tenant": "small"},
        ]
    }
    response = await api.post(TASKS, json=body)
    assert response.status_code == 200, response.text
    results = response.json()["tasks"]
    assert results[0] == {"id": 1, "state": "waiting"}
    assert results[4] == {"id": 5, "state": "waiting"}
    expected_codes = {1: "slot_busy", 2: "invalid_request", 3: "not_found"}
    for index, code in expected_codes.items():
        assert set(results[index]) == {"error"}, results[index]
        assert results[index]["error"]["code"] == code
        assert results[index]["error"]["message"]
    assert "passed" in results[2]["error"]["message"]
    assert [t["id"] for t in await all_tasks(api)] == [1, 5]
    # The tenant's queue is now full: a batch reports that per task as well.
    response = await api.post(TASKS, json={"tasks": [{"type": "a", "tenant": "small"}]})
    assert response.json()["tasks"][0]["error"]["code"] == "tenant_queue_full"


@pytest.mark.parametrize(
    "raw",
    [
        b"null",
        b"true",
        b"0",
        b"-1.5e3",
        b"12345678901234567890123",
        b'"text"',
        b'"caf\\u00e9 \\n"',
        b"[]",
        b'[1, "a", null, {"k": [true]}]',
        b'{"nested": {"k": [1, 2]}, "u": "\xc3\xa9"}',
        b'{ "spaced" :  [ 1 ,2 ] }',
    ],
)
async def test_params_of_any_json_type_are_returned_verbatim(api: Api, raw: bytes) -> None:
    response = await api.post(TASKS, content=b'{"type": "t", "params": ' + raw + b"}")
    assert response.status_code == 201, response.text
    task_id = response.json()["id"]
    shown = await api.get(f"{TASKS}/{task_id}")
    assert b'"params":' + raw + b"," in shown.content
    assert shown.json()["params"] == json.loads(raw)
    listed = await api.get(TASKS)
    assert b'"params":' + raw + b"," in listed.content


async def test_params_left_out_are_null(api: Api) -> None:
    created = await submit(api)
    assert (await get_task(api, created["id"]))["params"] is None


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("2100-01-01T00:00:00Z", FAR_FUTURE),
        ("2100-01-01T02:00:00+02:00", FAR_FUTURE),
        ("2099-12-31T19:00:00.000-05:00", FAR_FUTURE),
        ("2100-01-01T00:00:00.250Z", "2100-01-01T00:00:00.250Z"),
        (FAR_FUTURE_UNIX, FAR_FUTURE),
        (FAR_FUTURE_UNIX + 0.5, "2100-01-01T00:00:00.500Z"),
    ],
)
async def test_deadline_rfc3339_and_unix_seconds(api: Api, value: Any, shown: str) -> None:
    created = await submit(api, deadline=value)
    assert created["state"] == "waiting"
    assert (await get_task(api, created["id"]))["deadline"] == shown


async def test_start_after_in_the_future_is_delayed(api: Api) -> None:
    by_date = await submit(api, start_after="2100-01-01T00:00:00Z")
    by_unix = await submit(api, start_after=FAR_FUTURE_UNIX)
    assert by_date["state"] == by_unix["state"] == "delayed"
    assert (await get_task(api, by_unix["id"]))["start_after"] == FAR_FUTURE
    assert [t["id"] for t in await all_tasks(api, state="delayed")] == [1, 2]


async def test_start_after_in_the_past_is_waiting(api: Api) -> None:
    created = await submit(api, start_after=PAST_UNIX)
    assert created["state"] == "waiting"
    assert (await get_task(api, created["id"]))["start_after"] == "2001-09-09T01:46:40.000Z"


async def test_times_at_the_ends_of_the_range_are_shown_back(api: Api) -> None:
    early = await submit(api, start_after=0)
    late = await submit(api, start_after=99_999_999_999, deadline="5138-11-16T09:46:39.999Z")
    assert (await get_task(api, early["id"]))["start_after"] == "1970-01-01T00:00:00.000Z"
    shown = await get_task(api, late["id"])
    assert shown["start_after"] == "5138-11-16T09:46:39.000Z"
    assert shown["deadline"] == "5138-11-16T09:46:39.999Z"
    assert len(await all_tasks(api)) == 2


async def test_delayed_task_becomes_waiting_when_due(api: Api) -> None:
    created = await submit(api, start_after=api.node.clock_ms() / 1000 + 0.15)
    assert created["state"] == "delayed"
    await wait_for_state(api, created["id"], "waiting")


async def test_deadline_reached_fails_the_task(api: Api) -> None:
    created = await submit(api, deadline=api.node.clock_ms() / 1000 + 0.15)
    await wait_for_state(api, created["id"], "error")
    task = await get_task(api, created["id"])
    assert "deadline" in task["error"]
    assert task["finished_at"] is not None


async def test_body_of_exactly_the_limit_is_accepted(api: Api) -> None:
    body = b'{"type": "a"}'
    body += b" " * (CONFIG.max_request_bytes - len(body))
    response = await api.post(TASKS, content=body)
    assert response.status_code == 201, response.text


async def test_params_of_exactly_the_limit_are_accepted(api: Api) -> None:
    params = json.dumps("x" * (CONFIG.max_params_bytes - 2)).encode()
    assert len(params) == CONFIG.max_params_bytes
    response = await api.post(TASKS, content=b'{"type": "a", "params": ' + params + b"}")
    assert response.status_code == 201, response.text


# --- submit: refused before logging (nothing applied) ---------------------------------

OK_TASK: dict[str, Any] = {"type": "ok"}
BIG_PARAMS = "x" * 2000

# (body, status, code, fragment the message must hold)
INVALID_SINGLE: list[tuple[Any, int, str, str]] = [
    (b"", 400, "invalid_request", "body is required"),
    (b"  \n", 400, "invalid_request", "body is required"),
    (b'{"type": "a"', 400, "invalid_json", "malformed JSON"),
    (b"{'type': 'a'}", 400, "invalid_json", "malformed JSON"),
    (b"\xff\xfe{}", 400, "invalid_json", "malformed JSON"),
    (
        b'{"type": "a", "params": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
        400,
        "invalid_json",
        "deep",
    ),
    (b'{"tasks": [{"type": "a", "params": ' + b"{" * 9_000 + b"}", 400, "invalid_json", ""),
    (b"[]", 400, "invalid_request", "object"),
    (b"null", 400, "invalid_request", "object"),
    (b'"noop"', 400, "invalid_request", "object"),
    ({}, 400, "invalid_request", "type is required"),
    ({"type": None}, 400, "invalid_request", "type is required"),
    ({"params": 1}, 400, "invalid_request", "type is required"),
    ({"type": 1}, 400, "invalid_request", "$.type"),
    ({"type": "a", "max_attempts": "x"}, 400, "invalid_request", "$.max_attempts"),
    ({"type": "a", "max_attempts": 1.5}, 400, "invalid_request", "$.max_attempts"),
    ({"type": "a", "max_attempts": True}, 400, "invalid_request", "$.max_attempts"),
    ({"type": "a", "resources": {"cpu": "a"}}, 400, "invalid_request", "$.resources"),
    ({"type": "a", "resources": [1]}, 400, "invalid_request", "$.resources"),
    ({"type": "a", "tenant": None}, 400, "invalid_request", "$.tenant"),
    ({"type": "a", "slot": 5}, 400, "invalid_request", "$.slot"),
    ({"type": "a", "transaction": "1"}, 400, "invalid_request", "$.transaction"),
    ({"type": "a", "transaction": 2**64}, 400, "invalid_request", "$.transaction"),
    ({"type": "a", "transaction": -(2**63) - 1}, 400, "invalid_request", "$.transaction"),
    ({"type": "a", "bogus_field": 1}, 400, "invalid_request", "bogus_field"),
    ({"type": "a", "urgency": 1}, 400, "invalid_request", "urgency"),
    ({"type": "a", "priority": 1.5}, 400, "invalid_request", "$.priority"),
    ({"type": "a", "priority": 10**7}, 400, "invalid_request", "priority must be between"),
    ({"type": "a", "retry_backoff_s": -1}, 400, "invalid_request", "retry_backoff_s must be"),
    ({"type": "a", "retry_backoff_s": 1e9}, 400, "invalid_request", "retry_backoff_s must be"),
    ({"type": "a", "retry_backoff_max_s": -2}, 400, "invalid_request", "retry_backoff_max_s"),
    ({"type": "a", "tasks": [OK_TASK]}, 400, "invalid_request", "not both"),
    ({"tasks": []}, 400, "invalid_request", "1 to 5 tasks"),
    ({"tasks": "x"}, 400, "invalid_request", "$.tasks"),
    ({"tasks": [OK_TASK] * 6}, 400, "invalid_request", "1 to 5 tasks"),
    ({"type": ""}, 400, "invalid_request", "type must be"),
    ({"type": "has space"}, 400, "invalid_request", "type must be"),
    ({"type": "x" * 129}, 400, "invalid_request", "type must be"),
    ({"type": "a", "tenant": ""}, 400, "invalid_request", "tenant must be"),
    ({"type": "a", "tenant": "-leading-dash"}, 400, "invalid_request", "tenant must be"),
    ({"type": "a", "tenant": "a/b"}, 400, "invalid_request", "tenant must be"),
    ({"type": "a", "tenant": "t" * 65}, 400, "invalid_request", "tenant must be"),
    ({"type": "a", "slot": ""}, 400, "invalid_request", "slot must be"),
    ({"type": "a", "slot": "s" * 257}, 400, "invalid_request", "slot must be"),
    ({"type": "a", "max_attempts": 0}, 400, "invalid_request", "max_attempts"),
    ({"type": "a", "max_attempts": -1}, 400, "invalid_request", "max_attempts"),
    ({"type": "a", "max_attempts": 1001}, 400, "invalid_request", "max_attempts"),
    ({"type": "a", "max_attempts": 2**70}, 400, "invalid_request", "max_attempts"),
    ({"type": "a", "resources": {"cpu": -1}}, 400, "invalid_request", "resource 'cpu'"),
    ({"type": "a", "resources": {"bad name": 1}}, 400, "invalid_request", "resource name"),
    ({"type": "a", "resources": {f"r{i}": 1 for i in range(33)}}, 400, "invalid_request", "32"),
    ({"type": "a", "code": "not-a-sha"}, 400, "invalid_request", "sha256"),
    ({"type": "a", "deadline": "2100-01-01T00:00:00"}, 400, "invalid_request", "time zone"),
    ({"type": "a", "start_after": "2100-01-01T00:00:00"}, 400, "invalid_request", "time zone"),
    ({"type": "a", "deadline": "tomorrow"}, 400, "invalid_request", "$.deadline"),
    ({"type": "a", "deadline": "2100-02-30T00:00:00Z"}, 400, "invalid_request", "$.deadline"),
    ({"type": "a", "deadline": True}, 400, "invalid_request", "$.deadline"),
    ({"type": "a", "deadline": -1}, 400, "invalid_request", "deadline must be"),
    ({"type": "a", "deadline": 1e11}, 400, "invalid_request", "deadline must be"),
    ({"type": "a", "start_after": 1e300}, 400, "invalid_request", "start_after must be"),
    # Times that cannot be shown back as RFC 3339 (years 0 and 10000 in UTC).
    (
        {"type": "a", "start_after": "0001-01-01T00:00:00+01:00"},
        400,
        "invalid_request",
        "start_after must be",
    ),
    (
        {"type": "a", "deadline": "9999-12-31T23:59:59-05:00"},
        400,
        "invalid_request",
        "deadline must be",
    ),
    ({"type": "a", "params": BIG_PARAMS}, 413, "too_large", "params over 1024 bytes"),
    # A built-in type's misspelt param is refused, not ignored by the task (issue 17).
    ({"type": "sleep", "params": {"secs": 1}}, 400, "invalid_request", "allowed keys: seconds"),
    ({"type": "sleep", "params": {"seconds": "1"}}, 400, "invalid_request", "number >= 0"),
    ({"type": "spark.sql", "params": {}}, 400, "invalid_request", "query"),
]


@pytest.mark.parametrize(("body", "status", "code", "fragment"), INVALID_SINGLE)
async def test_invalid_single_submission_applies_nothing(
    api: Api, body: Any, status: int, code: str, fragment: str
) -> None:
    await submit(api)  # some state to keep
    before = await observe(api)
    if isinstance(body, bytes):
        response = await api.post(TASKS, content=body)
    else:
        response = await api.post(TASKS, json=body)
    assert fragment in error_of(response, status, code)
    assert await observe(api) == before


# (bad task in second place, status, code, fragment)
INVALID_IN_BATCH: list[tuple[Any, int, str, str]] = [
    ({"type": 1}, 400, "invalid_request", "$.tasks[1].type"),
    ({"type": "a", "max_attempts": "x"}, 400, "invalid_request", "$.tasks[1].max_attempts"),
    ({"type": "a", "resources": {"cpu": "a"}}, 400, "invalid_request", "$.tasks[1].resources"),
    ({"type": "a", "bogus_field": 1}, 400, "invalid_request", "bogus_field"),
    ({"tenant": "x"}, 400, "invalid_request", "type"),
    ({"type": "bad type"}, 400, "invalid_request", "tasks[1]: type must be"),
    ({"type": "a", "tenant": "-x"}, 400, "invalid_request", "tasks[1]: tenant must be"),
    ({"type": "a", "slot": ""}, 400, "invalid_request", "tasks[1]: slot must be"),
    ({"type": "a", "max_attempts": 0}, 400, "invalid_request", "tasks[1]: max_attempts"),
    ({"type": "a", "resources": {"cpu": -0.5}}, 400, "invalid_request", "tasks[1]: resource"),
    ({"type": "a", "deadline": "2100-01-01T00:00:00"}, 400, "invalid_request", "tasks[1]: dead"),
    ({"type": "a", "start_after": -5}, 400, "invalid_request", "tasks[1]: start_after"),
    ({"type": "a", "params": BIG_PARAMS}, 413, "too_large", "tasks[1]: params over"),
    ({"type": "fail", "params": {"msg": "x"}}, 400, "invalid_request", "tasks[1]: fail params"),
]


@pytest.mark.parametrize(("bad", "status", "code", "fragment"), INVALID_IN_BATCH)
async def test_invalid_task_in_batch_applies_nothing(
    api: Api, bad: Any, status: int, code: str, fragment: str
) -> None:
    await submit(api)
    before = await observe(api)
    response = await api.post(TASKS, json={"tasks": [OK_TASK, bad, OK_TASK]})
    assert fragment in error_of(response, status, code)
    assert await observe(api) == before


async def test_oversized_body_with_content_length_is_413(api: Api) -> None:
    before = await observe(api)
    body = b'{"type": "a"}' + b" " * CONFIG.max_request_bytes
    response = await api.post(TASKS, content=body)
    assert "over 65536 bytes" in error_of(response, 413, "too_large")
    assert await observe(api) == before


async def test_oversized_streamed_body_without_content_length_is_413(api: Api) -> None:
    before = await observe(api)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"type": "a", "params": "'
        for _ in range(20):
            yield b"x" * 4096
        yield b'"}'

    request = api.client.build_request("POST", TASKS, content=chunks())
    assert "content-length" not in request.headers
    assert request.headers["transfer-encoding"] == "chunked"
    response = await api.client.send(request)
    error_of(response, 413, "too_large")
    assert await observe(api) == before


async def test_streamed_body_under_the_limit_is_accepted(api: Api) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for part in (b'{"type"', b': "stream', b'ed", "params": [1,', b" 2]}"):
            yield part

    response = await api.post(TASKS, content=chunks())
    assert response.status_code == 201, response.text
    assert (await get_task(api, response.json()["id"]))["params"] == [1, 2]


async def test_declared_content_length_over_the_limit_is_413_before_reading(api: Api) -> None:
    status, body = await raw_asgi(
        api,
        "POST",
        TASKS,
        headers=[(b"content-length", str(CONFIG.max_request_bytes + 1).encode())],
        chunks=[b'{"type": "a"}'],
    )
    assert status == 413
    assert body["error"]["code"] == "too_large"


async def test_bad_content_length_is_400(api: Api) -> None:
    status, body = await raw_asgi(
        api, "POST", TASKS, headers=[(b"content-length", b"twelve")], chunks=[b'{"type": "a"}']
    )
    assert status == 400
    assert body["error"] == {"code": "invalid_request", "message": "bad Content-Length"}


async def test_client_disconnect_while_sending_is_4xx(api: Api) -> None:
    before = await observe(api)
    status, body = await raw_asgi(api, "POST", TASKS, disconnect=True)
    assert status == 400
    assert body["error"]["code"] == "invalid_request"
    assert await observe(api) == before


async def test_chunked_body_in_several_messages(api: Api) -> None:
    status, body = await raw_asgi(api, "POST", TASKS, chunks=[b'{"ty', b'pe": ', b'"a"}'])
    assert (status, body) == (201, {"id": 1, "state": "waiting"})


# --- submit: refused by the state machine ------------------------------------------------


async def test_deadline_in_the_past_is_400_invalid(api: Api) -> None:
    for past in (PAST_UNIX, "2001-01-01T00:00:00Z"):
        response = await api.post(TASKS, json={"type": "a", "deadline": past})
        assert "passed" in error_of(response, 400, "invalid_request")
    assert await all_tasks(api) == []


async def test_unknown_transaction_is_404(api: Api) -> None:
    response = await api.post(TASKS, json={"type": "a", "transaction": 12345})
    assert "12345" in error_of(response, 404, "not_found")
    assert await all_tasks(api) == []


async def test_transaction_of_another_tenant_is_404(api: Api) -> None:
    # Scoped to its tenant: to another, a transaction is not open (its owner unsaid).
    txn = await begin(api, tenant="owner")
    response = await api.post(TASKS, json={"type": "a", "tenant": "other", "transaction": txn})
    message = error_of(response, 404, "not_found")
    assert message == f"transaction {txn} is not open" and "owner" not in message
    assert await all_tasks(api) == []


async def test_slot_busy_is_409_until_the_holder_ends(api: Api) -> None:
    first = await submit(api, slot="the-slot")
    response = await api.post(TASKS, json={"type": "a", "slot": "the-slot"})
    assert str(first["id"]) in error_of(response, 409, "slot_busy")
    assert len(await all_tasks(api)) == 1
    other = await submit(api, slot="another-slot")
    assert other["state"] == "waiting"
    assert (await api.post(f"{TASKS}/{first['id']}/cancel")).status_code == 200
    assert (await submit(api, slot="the-slot"))["state"] == "waiting"


async def test_tenant_queue_full_is_429(api: Api) -> None:
    response = await api.put("/api/v1/tenants/busy", json={"max_waiting": 2})
    assert response.status_code == 200
    await submit(api, tenant="busy")
    await submit(api, tenant="busy", start_after=FAR_FUTURE_UNIX)  # delayed counts too
    response = await api.post(TASKS, json={"type": "a", "tenant": "busy"})
    assert "max_waiting" in error_of(response, 429, "tenant_queue_full")
    assert len(await all_tasks(api, tenant="busy")) == 2
    assert (await submit(api, tenant="not-busy"))["state"] == "waiting"
