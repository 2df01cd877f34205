"""The HTTP API on an in-memory node, driven through httpx's ASGI transport.

The ``api`` fixture (registered in tests/conftest.py) yields an ``Api``: the node, the ASGI
app and a client whose answers are recorded; at the end no answer may be a 5xx unless the
test allowed 503 (a client's mistake must never be a 500), and every answer must be as the
OpenAPI document says (tests/support/openapi_check.py). The helpers submit, read and
wait on tasks and check error answers; ``run_and_finish`` logs a worker running a task and
finishing it with spawned children.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.api.http_api import ApiApp, ApiConfig
from broker.api.openapi import openapi_document
from broker.core import entries as e
from broker.replication.node import Node, Stamp
from tests.support.memory_node import memory_node
from tests.support.openapi_check import ResponseChecker

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
    checker = ResponseChecker(openapi_document(CONFIG))

    async def record(response: httpx.Response) -> None:
        statuses.append((f"{response.request.method} {response.request.url}", response.status_code))
        await checker.async_hook(response)

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
    assert not checker.problems, "answers unlike the OpenAPI document:\n" + "\n".join(
        checker.problems[:20]
    )


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


async def run_and_finish(node: Node, task_id: int, *children: str, ok: bool = True) -> list[int]:
    """Register a worker, assign ``task_id`` to it and log its finish spawning children
    of these types anchored to it; the children's ids."""
    await node.propose(
        lambda s: e.RegisterWorker(time_ms=s.now_ms, worker_id="w", task_types={"*": 100})
    )
    await node.propose(
        lambda s: e.AssignTasks(
            time_ms=s.now_ms,
            assignments=(e.Assignment(task_id, "w"),),
            v=e.STARTS_RECORDED_VERSION,
        )
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
