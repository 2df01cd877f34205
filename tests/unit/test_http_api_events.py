"""Task events (broker/api/handlers_events.py): ``GET /api/v1/events`` in process.

The stream reports each named task once when it is final (at once if it already is), with
the log position of the entry that made it final (and the task's index in it) as the event
id, and ends once all were
reported or after ``wait_s``; bad requests are JSON errors before the stream starts, and
no subscription outlives its stream.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import httpx

from broker.api.common import ApiConfig
from broker.api.http_api import ApiApp
from tests.support.auth_env import Env, error_code
from tests.support.event_streams import EVENTS, parse_events
from tests.support.http_api import CONFIG, TASKS, Api, error_of, get_task, run_and_finish, submit


def assert_no_subscriptions(app: ApiApp) -> None:
    assert app.context.events.streams == 0
    assert app.context.events.watchers == {}


async def stream(api: Api, query: str) -> tuple[httpx.Response, list[dict[str, Any]]]:
    response = await api.get(f"{EVENTS}?{query}")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    return response, parse_events(response.text)


async def test_a_final_task_is_reported_at_once_and_the_stream_ends(api: Api) -> None:
    task_id = (await submit(api))["id"]
    await run_and_finish(api.node, task_id)
    _, events = await stream(api, f"tasks={task_id}")
    # Already final when the stream opened: no id (where it became final is not kept).
    assert events == [{"event": "task", "data": await get_task(api, task_id)}]
    assert_no_subscriptions(api.app)


async def test_tasks_are_reported_when_they_become_final_with_their_position(api: Api) -> None:
    first, second, third = [(await submit(api))["id"] for _ in range(3)]
    await run_and_finish(api.node, third)
    opened = asyncio.ensure_future(stream(api, f"tasks={first},{second},{third}&wait_s=10"))
    await asyncio.sleep(0.05)
    assert not opened.done()
    assert api.app.context.events.watchers.keys() == {first, second}
    await run_and_finish(api.node, first, ok=False)
    finished_at = api.node.position
    cancelled = await api.post(f"{TASKS}/{second}/cancel")
    assert cancelled.status_code == 200
    cancelled_at = api.node.position
    _, events = await asyncio.wait_for(opened, 5)
    assert [(ev["data"]["id"], ev["data"]["state"]) for ev in events] == [
        (third, "finished"),
        (first, "error"),
        (second, "cancelled"),
    ]
    assert "id" not in events[0]
    # The entry's position and the task's index among the tasks it made final.
    assert events[1]["id"] == "{}:{}:0".format(*finished_at)
    assert events[2]["id"] == "{}:{}:0".format(*cancelled_at)
    # The data is the task's view as GET answers it.
    assert events[1]["data"] == await get_task(api, first)
    assert events[2]["data"] == await get_task(api, second)
    assert_no_subscriptions(api.app)


async def test_the_stream_ends_after_wait_s(api: Api) -> None:
    task_id = (await submit(api))["id"]
    started = asyncio.get_running_loop().time()
    _, events = await stream(api, f"tasks={task_id}&wait_s=0.2")
    assert events == []
    assert 0.15 < asyncio.get_running_loop().time() - started < 3
    assert_no_subscriptions(api.app)
    # wait_s=0: only what is final already.
    _, events = await stream(api, f"tasks={task_id}&wait_s=0")
    assert events == []


async def test_bad_requests_are_json_errors_before_the_stream(api: Api) -> None:
    task_id = (await submit(api))["id"]
    for query, fragment in [
        ("tasks=", "tasks is required"),
        ("tasks=1,,2", "separated by commas"),
        ("tasks=1,%202", "separated by commas"),
        ("tasks=-1", "separated by commas"),
        ("tasks=1.5", "separated by commas"),
        ("tasks=abc", "separated by commas"),
        ("tasks=" + "9" * 19, "separated by commas"),
        (f"tasks={task_id},{task_id}", f"task {task_id} twice"),
        ("tasks=" + ",".join(str(i) for i in range(1, 10_002)), "at most 10000"),
        (f"tasks={task_id}&wait_s=61", "wait_s must be"),
        (f"tasks={task_id}&wait_s=nan", "wait_s must be"),
        (f"tasks={task_id}&state=finished", "unknown query parameters"),
        (f"tasks={task_id}&tasks={task_id}", "given twice"),
    ]:
        response = await api.get(f"{EVENTS}?{query}")
        assert fragment in error_of(response, 400, "invalid_request"), (query, response.text)
    missing = await api.get(f"{EVENTS}?tasks={task_id},{task_id + 100}")
    assert error_of(missing, 404, "not_found") == f"task {task_id + 100} does not exist"
    assert_no_subscriptions(api.app)


async def drive(
    app: ApiApp, query: bytes, disconnect: asyncio.Event
) -> tuple[list[dict[str, Any]], asyncio.Queue[bytes]]:
    """Call ``app`` directly: its messages, and the body chunks as they are sent; the
    client disconnects when ``disconnect`` is set."""
    sent: list[dict[str, Any]] = []
    chunks: asyncio.Queue[bytes] = asyncio.Queue()
    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            await chunks.put(message["body"])

    scope = {"type": "http", "method": "GET", "path": EVENTS, "query_string": query}
    await app(scope, receive, send)
    return sent, chunks


async def test_keep_alive_comments_and_a_client_that_goes_away(api: Api) -> None:
    app = ApiApp(api.node, replace(CONFIG, event_keepalive_s=0.05))
    task_id = (await submit(api))["id"]
    gone = asyncio.Event()
    driving = asyncio.ensure_future(drive(app, f"tasks={task_id}".encode(), gone))
    await asyncio.sleep(0.3)
    assert not driving.done()
    assert app.context.events.streams == 1
    gone.set()
    sent, chunks = await asyncio.wait_for(driving, 5)
    assert sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream") in sent[0]["headers"]
    bodies = [chunks.get_nowait() for _ in range(chunks.qsize())]
    assert len(bodies) >= 2 and set(bodies) == {b": keep-alive\n\n"}
    assert all(m.get("more_body") for m in sent[1:])  # abandoned, not ended
    assert_no_subscriptions(app)


async def test_streams_per_broker_are_bounded(api: Api) -> None:
    app = ApiApp(api.node, replace(CONFIG, max_event_streams=1))
    task_id = (await submit(api))["id"]
    gone = asyncio.Event()
    first = asyncio.ensure_future(drive(app, f"tasks={task_id}".encode(), gone))
    await asyncio.sleep(0.05)
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        refused = await client.get(f"{EVENTS}?tasks={task_id}")
        assert "event streams already" in error_of(refused, 503, "unavailable")
        gone.set()
        await asyncio.wait_for(first, 5)
        await run_and_finish(api.node, task_id)
        again = await client.get(f"{EVENTS}?tasks={task_id}")
        assert again.status_code == 200 and len(parse_events(again.text)) == 1
    assert_no_subscriptions(app)


def test_the_default_bounds() -> None:
    config = ApiConfig()
    assert (config.max_event_tasks, config.max_event_streams) == (10_000, 1_000)
    assert config.event_keepalive_s == 15.0


async def test_a_tenant_streams_its_own_tasks_only(env: Env) -> None:
    response = await env.call("alice", "POST", TASKS, json={"type": "noop"})
    alice_task = int(response.json()["id"])
    missing = alice_task + 1000
    as_bob = await env.call("bob", "GET", EVENTS, params={"tasks": str(alice_task)})
    nothing = await env.call("bob", "GET", EVENTS, params={"tasks": str(missing)})
    assert error_code(as_bob, 404) == error_code(nothing, 404) == "not_found"
    assert "alice" not in as_bob.text
    for who in ("alice", "admin"):
        mine = await env.call(who, "GET", EVENTS, params={"tasks": str(alice_task), "wait_s": 0})
        assert mine.status_code == 200
    assert error_code(await env.call("worker", "GET", EVENTS, params={"tasks": "1"}), 403)
