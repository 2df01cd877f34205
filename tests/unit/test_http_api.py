"""The HTTP API (broker/api/http_api.py) in process: every error path and the happy paths.

Each test gets a fresh Node on memory ledgers behind ``httpx.ASGITransport``. The
fixture records every response and fails the test if any had a status >= 500, except
the 503s a test declares on purpose: a client's mistake must never be a 500.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.api.http_api import ApiApp, ApiConfig
from broker.core import entries as e
from broker.replication.node import Node, Stamp
from tests.support.memory_node import memory_node

CONFIG = ApiConfig(
    max_request_bytes=64 * 1024,
    max_tasks_per_request=5,
    max_params_bytes=1024,
    max_list_limit=50,
)
TASKS = "/api/v1/tasks"
TXNS = "/api/v1/transactions"
FAR_FUTURE = "2100-01-01T00:00:00.000Z"
FAR_FUTURE_UNIX = 4102444800
PAST_UNIX = 1_000_000_000  # 2001
STATES = ("pending", "delayed", "waiting", "running", "finished", "error", "cancelled")


@dataclass
class Api:
    node: Node
    app: ApiApp
    client: httpx.AsyncClient
    statuses: list[tuple[str, int]] = field(default_factory=list)
    allow_503: bool = False
    stopped: bool = False

    async def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return await self.client.get(url, **kwargs)

    async def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return await self.client.post(url, **kwargs)

    async def put(self, url: str, **kwargs: Any) -> httpx.Response:
        return await self.client.put(url, **kwargs)


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    node = memory_node(tmp_path)
    await node.start()
    app = ApiApp(node, CONFIG)
    statuses: list[tuple[str, int]] = []

    async def record(response: httpx.Response) -> None:
        statuses.append((f"{response.request.method} {response.request.url}", response.status_code))

    # ApiApp types scope and messages as dict; httpx as MutableMapping.
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(
        transport=transport, base_url="http://test", event_hooks={"response": [record]}
    ) as client:
        harness = Api(node, app, client, statuses)
        try:
            yield harness
        finally:
            if not harness.stopped:
                await node.stop(snapshot=False)
            await node.ledgers.close()
    allowed = {503} if harness.allow_503 else set()
    server_errors = [(what, s) for what, s in statuses if s >= 500 and s not in allowed]
    assert not server_errors, f"server errors: {server_errors}"


# --- helpers -------------------------------------------------------------------------


def error_of(response: httpx.Response, status: int, code: str) -> str:
    """Assert a JSON error answer ``{"error": {"code", "message"}}``; return the message."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}, body
    # 503s say they may be retried; nothing else does.
    expected = {"code", "message", "retryable"} if status == 503 else {"code", "message"}
    assert set(body["error"]) == expected, body
    assert body["error"].get("retryable", False) is (status == 503), body
    assert body["error"]["code"] == code, body
    message = body["error"]["message"]
    assert isinstance(message, str) and message, body
    assert "Traceback" not in message
    return message


async def submit(api: Api, **fields: Any) -> dict[str, Any]:
    fields.setdefault("type", "noop")
    response = await api.post(TASKS, json=fields)
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    assert set(body) == {"id", "state"}
    return body


async def get_task(api: Api, task_id: int) -> dict[str, Any]:
    response = await api.get(f"{TASKS}/{task_id}")
    assert response.status_code == 200, response.text
    task: dict[str, Any] = response.json()
    return task


async def all_tasks(api: Api, **query: Any) -> list[dict[str, Any]]:
    response = await api.get(TASKS, params={"limit": CONFIG.max_list_limit, **query})
    assert response.status_code == 200, response.text
    tasks: list[dict[str, Any]] = response.json()["tasks"]
    return tasks


async def observe(api: Api) -> tuple[Any, ...]:
    """What must not change when a request is refused before logging anything."""
    digest = (await api.get("/api/v1/state/digest")).json()
    cluster = (await api.get("/api/v1/cluster")).json()
    ids = [t["id"] for t in await all_tasks(api)]
    return digest["position"], digest["digest"], cluster["tasks"], ids


async def begin(api: Api, **fields: Any) -> int:
    response = await api.post(TXNS, json=fields)
    assert response.status_code == 201, response.text
    txn_id: int = response.json()["id"]
    return txn_id


async def wait_for_state(api: Api, task_id: int, state: str, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if (await get_task(api, task_id))["state"] == state:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"task {task_id} never became {state}: {await get_task(api, task_id)}")


async def raw_asgi(
    api: Api,
    method: str,
    path: str,
    *,
    headers: Iterable[tuple[bytes, bytes]] = (),
    chunks: Iterable[bytes] = (b"",),
    disconnect: bool = False,
    query: bytes = b"",
) -> tuple[int, dict[str, Any]]:
    """Call the ASGI app directly, for requests httpx will not send."""
    parts = list(chunks)
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": chunk, "more_body": i < len(parts) - 1}
        for i, chunk in enumerate(parts)
    ]
    if disconnect:
        messages = [{"type": "http.disconnect"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": query,
        "headers": list(headers),
    }
    await api.app(scope, receive, send)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    status: int = sent[0]["status"]
    api.statuses.append((f"{method} {path} (raw)", status))
    headers_out = dict(sent[0]["headers"])
    assert headers_out[b"content-type"] == b"application/json"
    assert int(headers_out[b"content-length"]) == len(sent[1]["body"])
    body: dict[str, Any] = json.loads(sent[1]["body"])
    return status, body


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
    ({"type": "a", "priority": 1}, 400, "invalid_request", "priority"),
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


# --- routing, health, cluster, digest, OpenAPI ------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("DELETE", TASKS),
        ("PUT", TASKS),
        ("PATCH", TASKS),
        ("HEAD", TASKS),
        ("DELETE", f"{TASKS}/1"),
        ("POST", f"{TASKS}/1"),
        ("GET", TXNS),
        ("GET", f"{TXNS}/1/commit"),
        ("POST", "/api/v1/tenants"),
        ("DELETE", "/api/v1/tenants/x"),
        ("POST", "/api/v1/cluster"),
        ("POST", "/api/v1/state/digest"),
        ("POST", "/healthz"),
        ("POST", "/api/v1/openapi.json"),
    ],
)
async def test_method_not_allowed_is_405(api: Api, method: str, path: str) -> None:
    before = await observe(api)
    response = await api.client.request(method, path, json={"type": "a"})
    assert response.status_code == 405
    if method != "HEAD":
        assert "use " in error_of(response, 405, "method_not_allowed")
    assert await observe(api) == before


@pytest.mark.parametrize(
    "path", ["/api", "/api/v1", "/api/v1/", "/api/v2/tasks", "/api/v1/tasks/", "/healthz/"]
)
async def test_unknown_path_is_404(api: Api, path: str) -> None:
    assert "no such endpoint" in error_of(await api.get(path), 404, "not_found")
    error_of(await api.post(path, json={}), 404, "not_found")


async def test_healthz(api: Api) -> None:
    response = await api.get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["writable"] is True
    assert set(body["position"]) == {"ledger_id", "entry_id"}


async def test_cluster_shape(api: Api) -> None:
    await submit(api)
    await submit(api, start_after=FAR_FUTURE_UNIX)
    response = await api.get("/api/v1/cluster")
    assert response.status_code == 200
    summary = response.json()
    assert summary["cluster_id"] == "standalone"
    assert summary["leader"] == "standalone"
    assert summary["workers"] == []
    assert summary["tenants"] == 1
    assert summary["tasks"] == {**dict.fromkeys(STATES, 0), "waiting": 1, "delayed": 1}
    [broker] = summary["brokers"]
    assert set(broker) == {
        "id",
        "host",
        "port",
        "uptime_secs",
        "is_leader",
        "version",
        "position",
        "digest",
        "role",
    }
    assert broker["role"] == "standalone"
    assert broker["digest"] == api.node.state.digest()
    assert summary["leader_url"] is None  # the test app has no cluster view
    assert broker["id"] == "standalone"
    assert broker["host"] == CONFIG.host
    assert broker["port"] == CONFIG.port
    assert isinstance(broker["uptime_secs"], float | int) and broker["uptime_secs"] >= 0
    assert broker["is_leader"] is True
    assert isinstance(broker["version"], str) and broker["version"]
    assert set(broker["position"]) == {"ledger_id", "entry_id"}
    assert all(isinstance(v, int) for v in broker["position"].values())


async def test_digest_shape_and_progress(api: Api) -> None:
    empty = (await api.get("/api/v1/state/digest")).json()
    assert empty["position"] == {"ledger_id": -1, "entry_id": -1}  # nothing logged yet
    await submit(api)
    first = (await api.get("/api/v1/state/digest")).json()
    assert first["digest"] != empty["digest"]
    assert set(first) == {"position", "digest"}
    assert set(first["position"]) == {"ledger_id", "entry_id"}
    assert re.fullmatch(r"[0-9a-f]{64}", first["digest"])
    assert first == (await api.get("/api/v1/state/digest")).json()
    await submit(api)
    second = (await api.get("/api/v1/state/digest")).json()
    assert second["digest"] != first["digest"]
    assert second["position"]["ledger_id"] == first["position"]["ledger_id"]
    assert second["position"]["entry_id"] == first["position"]["entry_id"] + 1
    cluster = (await api.get("/api/v1/cluster")).json()
    assert cluster["brokers"][0]["position"] == second["position"]


def _path_shape(path: str) -> str:
    """A route regex or an OpenAPI path with every parameter as ``{}``."""
    path = path.removeprefix("^").removesuffix("$")
    path = re.sub(r"\([^)]*\)", "{}", path)
    return re.sub(r"\{\w*\}", "{}", path)


async def test_openapi_document_lists_every_route(api: Api) -> None:
    response = await api.get("/api/v1/openapi.json")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    doc = json.loads(response.content)
    assert doc["openapi"].startswith("3.")
    assert doc["info"]["title"] == "Steward"
    served = {
        (_path_shape(route.pattern.pattern), method.lower())
        for route in api.app._routes
        for method in route.handlers
    }
    documented = {
        (_path_shape(path), method)
        for path, operations in doc["paths"].items()
        for method in operations
    }
    missing = {(p, m) for p, m in served if p != "/api/v1/openapi.json"} - documented
    assert not missing, f"routes missing from the OpenAPI document: {sorted(missing)}"
    assert documented <= served
    for path in ("/api/v1/tasks", "/api/v1/tasks/{id}", "/api/v1/tenants/{name}", "/healthz"):
        assert path in doc["paths"]
    # Every $ref resolves to a component schema.
    refs = re.findall(r'"\$ref":\s*"#/components/schemas/([^"]+)"', response.text)
    assert refs
    assert set(refs) <= set(doc["components"]["schemas"])
    # The same bytes every time (cached).
    assert (await api.get("/api/v1/openapi.json")).content == response.content


async def test_lifespan_and_other_scopes(api: Api) -> None:
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await api.app({"type": "lifespan"}, receive, send)
    assert [m["type"] for m in sent] == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
    ]
    sent.clear()
    await api.app({"type": "websocket", "path": "/"}, receive, send)
    assert sent == []


# --- unavailable -----------------------------------------------------------------------------


async def test_writes_after_stop_are_503_unavailable(api: Api) -> None:
    task = await submit(api)
    txn = await begin(api)
    await api.node.stop(snapshot=False)
    api.stopped = True
    api.allow_503 = True
    writes = [
        await api.post(TASKS, json={"type": "a"}),
        await api.post(TASKS, json={"tasks": [{"type": "a"}]}),
        await api.post(f"{TASKS}/{task['id']}/cancel"),
        await api.post(TXNS),
        await api.post(f"{TXNS}/{txn}/commit"),
        await api.put("/api/v1/tenants/t", json={"weight": 2}),
    ]
    for response in writes:
        assert "shutting down" in error_of(response, 503, "unavailable")
    health = await api.get("/healthz")
    assert health.status_code == 503
    assert health.json()["status"] == "unavailable"
    assert health.json()["writable"] is False
    assert health.json()["reason"]
    # Reads still work and client mistakes are still 4xx.
    assert (await get_task(api, task["id"]))["state"] == "waiting"
    error_of(await api.post(TASKS, content=b"{"), 400, "invalid_json")
    error_of(await api.post(f"{TASKS}/999/cancel"), 404, "not_found")


# --- idempotency keys --------------------------------------------------------------------------


async def test_idempotency_key_header_replays_a_single_submission(api: Api) -> None:
    headers = {"Idempotency-Key": "retry-me-1"}
    first = await api.post(TASKS, json={"type": "a"}, headers=headers)
    assert first.status_code == 201, first.text
    assert set(first.json()) == {"id", "state"}
    before = await all_tasks(api)
    again = await api.post(TASKS, json={"type": "a"}, headers=headers)
    assert again.status_code == 201, again.text
    assert again.json() == {**first.json(), "replayed": True}
    assert await all_tasks(api) == before
    # Another key, or none, creates a task.
    other = await api.post(TASKS, json={"type": "a"}, headers={"Idempotency-Key": "another"})
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]
    assert len(await all_tasks(api)) == len(before) + 1


async def test_idempotency_key_field_replays_a_batch(api: Api) -> None:
    body = {"idempotency_key": "batch-1", "tasks": [{"type": "a"}, {"type": "b", "slot": "s"}]}
    first = await api.post(TASKS, json=body)
    assert first.status_code == 200, first.text
    ids = [t["id"] for t in first.json()["tasks"]]
    assert "replayed" not in first.json()
    cluster = (await api.get("/api/v1/cluster")).json()["tasks"]
    # The same key in the header, as a retrying client may send it: same answer.
    again = await api.post(TASKS, json=body, headers={"Idempotency-Key": "batch-1"})
    assert again.status_code == 200, again.text
    assert again.json() == {**first.json(), "replayed": True}
    assert [t["id"] for t in again.json()["tasks"]] == ids
    assert (await api.get("/api/v1/cluster")).json()["tasks"] == cluster


async def test_replayed_batch_repeats_its_per_task_errors(api: Api) -> None:
    await submit(api, slot="held")
    body = {"idempotency_key": "k", "tasks": [{"type": "a"}, {"type": "b", "slot": "held"}]}
    first = await api.post(TASKS, json=body)
    assert first.status_code == 200
    assert first.json()["tasks"][1]["error"]["code"] == "slot_busy"
    again = await api.post(TASKS, json=body)
    assert again.json() == {**first.json(), "replayed": True}


async def test_key_reused_for_another_number_of_tasks_is_409(api: Api) -> None:
    await api.post(TASKS, json={"type": "a"}, headers={"Idempotency-Key": "k"})
    before = await all_tasks(api)
    response = await api.post(
        TASKS, json={"tasks": [{"type": "a"}, {"type": "a"}]}, headers={"Idempotency-Key": "k"}
    )
    assert "new key" in error_of(response, 409, "conflict")
    assert await all_tasks(api) == before


@pytest.mark.parametrize(
    ("headers", "fields", "fragment"),
    [
        ({"Idempotency-Key": "k" * 129}, {}, "1-128 printable ASCII"),
        ({"Idempotency-Key": "caf\xe9".encode("latin-1")}, {}, "1-128 printable ASCII"),
        ({}, {"idempotency_key": ""}, "length >= 1"),
        ({}, {"idempotency_key": "k" * 129}, "length <= 128"),
        ({}, {"idempotency_key": "clé"}, "matching regex"),
        ({}, {"idempotency_key": "line\n"}, "1-128 printable ASCII"),
        ({}, {"idempotency_key": 7}, "Expected `str | null`"),
        ({"Idempotency-Key": "a"}, {"idempotency_key": "b"}, "differ"),
    ],
)
async def test_bad_idempotency_key_is_400_and_applies_nothing(
    api: Api, headers: dict[str, Any], fields: dict[str, Any], fragment: str
) -> None:
    before = await observe(api)
    for body in ({"type": "a", **fields}, {"tasks": [{"type": "a"}], **fields}):
        response = await api.post(TASKS, json=body, headers=headers)
        assert fragment in error_of(response, 400, "invalid_request")
    assert await observe(api) == before


async def test_idempotency_key_sent_twice_is_400(api: Api) -> None:
    before = await observe(api)
    headers = [("Idempotency-Key", "a"), ("Idempotency-Key", "a")]
    response = await api.post(TASKS, json={"type": "a"}, headers=headers)
    assert "twice" in error_of(response, 400, "invalid_request")
    assert await observe(api) == before


async def test_idempotency_key_inside_a_batch_item_is_400(api: Api) -> None:
    response = await api.post(TASKS, json={"tasks": [{"type": "a", "idempotency_key": "k"}]})
    assert "idempotency_key" in error_of(response, 400, "invalid_request")


async def test_openapi_documents_the_idempotency_key(api: Api) -> None:
    doc = (await api.get("/api/v1/openapi.json")).json()
    post = doc["paths"]["/api/v1/tasks"]["post"]
    assert [p["name"] for p in post["parameters"]] == ["Idempotency-Key"]
    assert "idempotency_key" in doc["components"]["schemas"]["SubmitBody"]["properties"]
    assert "replayed" in doc["components"]["schemas"]["TaskRefBody"]["properties"]


# --- task trees ---------------------------------------------------------------------------


async def _run_and_finish(api: Api, task_id: int, *children: str, ok: bool = True) -> list[int]:
    return await run_and_finish(api.node, task_id, *children, ok=ok)


async def run_and_finish(node: Node, task_id: int, *children: str, ok: bool = True) -> list[int]:
    """Register a worker, assign ``task_id`` to it and log its finish spawning children
    of these types anchored to it; the children's ids."""
    await node.propose(
        lambda s: e.RegisterWorker(time_ms=s.now_ms, worker_id="w", task_types={"*": 100})
    )
    await node.propose(
        lambda s: e.AssignTasks(time_ms=s.now_ms, assignments=(e.Assignment(task_id, "w"),))
    )
    ids: list[int] = []

    def build(stamp: Stamp) -> e.Entry:
        ids.extend(stamp.task_ids(len(children)))
        spawn = tuple(
            e.Spawn(task=e.TaskSpec(id=i, type=t, tenant="default"), anchors=(task_id,))
            for i, t in zip(ids, children, strict=True)
        )
        outcome = e.TaskOutcome(
            task_id=task_id,
            worker_id="w",
            attempt=1,
            ok=ok,
            result=b"null" if ok else None,
            error=None if ok else "boom",
            spawn=spawn,
        )
        return e.FinishTasks(time_ms=stamp.now_ms, outcomes=(outcome,))

    await node.propose(build)
    return ids


async def test_submit_with_track_tree_shows_the_tree(api: Api) -> None:
    root = (await submit(api, track_tree=True, tree_timeout_s=12.5))["id"]
    plain = (await submit(api))["id"]
    view = await get_task(api, root)
    assert view["tree"] == {"state": "pending", "attempt": 1, "timeout_s": 12.5}
    assert view["root"] == root and view["parent"] is None
    assert (await get_task(api, plain))["tree"] is None
    assert api.node.state.tasks[root].root == root

    [child] = await _run_and_finish(api, root, "child")
    view = await get_task(api, child)
    assert view["root"] == root and view["parent"] == root and view["tree"] is None
    listed = {t["id"]: t for t in await all_tasks(api)}
    assert listed[root]["tree"]["state"] == "pending"


async def test_default_tree_timeout_is_30_s(api: Api) -> None:
    root = (await submit(api, track_tree=True))["id"]
    assert (await get_task(api, root))["tree"]["timeout_s"] == 30.0


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"tree_timeout_s": 5}, "tree_timeout_s needs track_tree"),
        ({"track_tree": True, "tree_timeout_s": 0}, "tree_timeout_s must be between"),
        ({"track_tree": True, "tree_timeout_s": 10**9}, "tree_timeout_s must be between"),
        ({"track_tree": "yes"}, "track_tree"),
    ],
)
async def test_bad_tree_fields_are_400(api: Api, fields: dict[str, Any], fragment: str) -> None:
    response = await api.post(TASKS, json={"type": "noop", **fields})
    assert fragment in error_of(response, 400, "invalid_request")


async def test_wait_tree_answers_when_the_tree_ends(api: Api) -> None:
    root = (await submit(api, track_tree=True))["id"]
    url = f"{TASKS}/{root}"
    response = await api.get(url, params={"wait_tree": "true", "wait_s": 0.05})
    assert response.json()["tree"]["state"] == "pending"
    poll = asyncio.create_task(api.get(url, params={"wait_tree": "true", "wait_s": 10}))
    [child] = await _run_and_finish(api, root, "child")
    await asyncio.sleep(0.05)
    # The root finished, its tree did not: still waiting.
    assert (await get_task(api, root))["state"] == "finished"
    assert not poll.done()
    await api.post(f"{TASKS}/{child}/cancel")  # the tree fails (no attempts left)
    response = await asyncio.wait_for(poll, 5)
    tree = response.json()["tree"]
    assert tree["state"] == "failed"
    assert tree["reason"] == f"task {child} was cancelled"
    # An ended tree is answered at once.
    response = await asyncio.wait_for(api.get(url, params={"wait_tree": "1", "wait_s": 10}), 5)
    assert response.json()["tree"]["state"] == "failed"
    assert not api.app._tree_waiters


async def test_wait_tree_completed(api: Api) -> None:
    root = (await submit(api, track_tree=True))["id"]
    url = f"{TASKS}/{root}"
    poll = asyncio.create_task(api.get(url, params={"wait_tree": "true", "wait_s": 10}))
    await _run_and_finish(api, root)
    response = await asyncio.wait_for(poll, 5)
    assert response.json()["tree"] == {"state": "completed", "attempt": 1, "timeout_s": 30.0}


async def test_wait_tree_errors(api: Api) -> None:
    plain = (await submit(api))["id"]
    response = await api.get(f"{TASKS}/{plain}", params={"wait_tree": "true", "wait_s": 1})
    assert "does not root a tracked tree" in error_of(response, 400, "invalid_request")
    response = await api.get(f"{TASKS}/{plain}", params={"wait_tree": "maybe"})
    assert "wait_tree must be true or false" in error_of(response, 400, "invalid_request")


# --- found by fuzzing (tests/integration/test_fuzz_http.py) ----------------------------------


async def test_names_with_a_final_newline_are_refused(api: Api) -> None:
    # NAME_RE ends in "$", which lets a final "\n" through .match.
    response = await api.put("/api/v1/tenants/acme%0A", json={"weight": 2})
    assert "is not valid" in error_of(response, 400, "invalid_request")
    response = await api.get("/api/v1/tenants/acme%0A")
    assert "is not valid" in error_of(response, 400, "invalid_request")
    response = await api.post(TXNS, json={"tenant": "acme\n"})
    error_of(response, 400, "invalid_request")
    response = await api.put("/api/v1/config", json={"global_limits": {"cpu\n": 1}})
    error_of(response, 400, "invalid_request")
    assert "acme\n" not in api.node.state.tenants


async def test_openapi_states_the_bounds_the_server_checks(api: Api) -> None:
    document = (await api.get("/api/v1/openapi.json")).json()
    schemas = document["components"]["schemas"]
    paths = document["paths"]

    def param(path: str, method: str, name: str) -> dict[str, Any]:
        found = [p for p in paths[path][method]["parameters"] if p["name"] == name]
        schema: dict[str, Any] = found[0]["schema"]
        return schema

    # The served document tells this broker's limits, not the defaults.
    assert param(TASKS, "get", "limit")["maximum"] == CONFIG.max_list_limit
    assert param(f"{TASKS}/{{id}}", "get", "wait_s")["maximum"] == CONFIG.max_wait_s
    assert param(TASKS, "get", "after")["maximum"] == 2**62
    name_pattern = param("/api/v1/tenants/{name}", "put", "name")["pattern"]
    assert re.search(name_pattern, "acme") and not re.search(name_pattern, "-acme")
    assert param("/api/v1/code", "post", "name")["pattern"]
    txn = schemas["TransactionBegin"]["properties"]
    assert txn["ttl_s"]["exclusiveMinimum"] == 0 and txn["ttl_s"]["maximum"] == 86400
    assert txn["tenant"]["pattern"] == name_pattern
    limits = schemas["TenantLimits"]["properties"]
    assert limits["weight"]["anyOf"][0]["exclusiveMinimum"] == 0
    assert limits["max_waiting"]["anyOf"][0]["minimum"] == 0
    retention = schemas["ClusterConfigPatch"]["properties"]["finished_task_retention_s"]
    assert retention["anyOf"][0]["minimum"] == 1
    # And the server refuses what the document excludes, with a 400.
    for response in [
        await api.put("/api/v1/tenants/acme", json={"weight": 0}),
        await api.put("/api/v1/tenants/acme", json={"max_running": -1}),
        await api.post(TXNS, json={"ttl_s": 86401}),
        await api.post(TXNS, json={"ttl_s": 0}),
        await api.put("/api/v1/config", json={"finished_task_retention_s": 0.5}),
        await api.put("/api/v1/config", json={"global_limits": {"cpu": -1}}),
        await api.get(TASKS, params={"after": 2**62 + 1}),
    ]:
        error_of(response, 400, "invalid_request")
