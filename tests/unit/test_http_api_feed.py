"""The event feed (broker/api/event_feed.py): ``GET /api/v1/events`` without ``tasks`` in
process. Every task becoming final, in log order, filtered by tenant, tree and states;
resumed from ``Last-Event-ID`` without loss or duplicates; 410 for a key older than the
ring; a follower behind the client's key skips what the client saw."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import httpx

from broker.api.event_feed import FeedFilter
from broker.api.http_api import ApiApp
from broker.core import StateMachine
from tests.support.auth_env import Env, error_code
from tests.support.event_streams import EVENTS, parse_events
from tests.support.http_api import CONFIG, TASKS, Api, error_of, run_and_finish, submit


async def feed(
    client: httpx.AsyncClient, query: str = "", last: str | None = None
) -> list[dict[str, Any]]:
    headers = {} if last is None else {"last-event-id": last}
    target = f"{EVENTS}?wait_s=0" + (f"&{query}" if query else "")
    response = await client.get(target, headers=headers)
    assert response.status_code == 200, response.text
    return [event for event in parse_events(response.text) if "comment" not in event]


async def finish_some(api: Api) -> list[int]:
    """Four tasks final in order: finished (tenant a), error (b), cancelled (a), finished (b)."""
    ids = [(await submit(api, tenant=t))["id"] for t in ("a", "b", "a", "b")]
    await run_and_finish(api.node, ids[0])
    await run_and_finish(api.node, ids[1], ok=False)
    assert (await api.post(f"{TASKS}/{ids[2]}/cancel")).status_code == 200
    await run_and_finish(api.node, ids[3])
    return ids


async def test_live_events_in_log_order_and_filters(api: Api) -> None:
    opened = asyncio.ensure_future(api.get(f"{EVENTS}?wait_s=1"))
    tenant_a = asyncio.ensure_future(api.get(f"{EVENTS}?wait_s=1&tenant=a&states=finished"))
    await asyncio.sleep(0.05)
    assert api.app.context.feed.streams == 2
    ids = await finish_some(api)
    events = parse_events((await asyncio.wait_for(opened, 5)).text)
    assert [e["data"]["id"] for e in events] == ids
    assert [e["data"]["state"] for e in events] == ["finished", "error", "cancelled", "finished"]
    keys = [tuple(map(int, e["id"].split(":"))) for e in events]
    assert keys == sorted(keys) and len(set(keys)) == 4
    only_a = parse_events((await asyncio.wait_for(tenant_a, 5)).text)
    assert [e["data"]["id"] for e in only_a] == [ids[0]]
    assert api.app.context.feed.streams == 0


async def test_resume_from_last_event_id_without_loss_or_duplicates(api: Api) -> None:
    await finish_some(api)  # before any key: not asked for
    opened = asyncio.ensure_future(api.get(f"{EVENTS}?wait_s=1"))
    await asyncio.sleep(0.05)
    ids = await finish_some(api)
    events = parse_events((await asyncio.wait_for(opened, 5)).text)
    for cut in range(len(events)):
        rest = await feed(api.client, last=events[cut]["id"])
        assert [e["data"]["id"] for e in rest] == ids[cut + 1 :]
        assert [e["id"] for e in rest] == [e["id"] for e in events[cut + 1 :]]
    # LEDGER:ENTRY: after every event of that entry; filters apply to the replay too.
    ledger, entry, _ = events[0]["id"].split(":")
    rest = await feed(api.client, "tenant=b", last=f"{ledger}:{entry}")
    assert [e["data"]["id"] for e in rest] == [ids[1], ids[3]]
    # Without Last-Event-ID: from now (nothing with wait_s=0).
    assert await feed(api.client) == []


async def test_a_key_older_than_the_ring_answers_410(api: Api) -> None:
    app = ApiApp(api.node, replace(CONFIG, event_history=2))
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        opened = asyncio.ensure_future(client.get(f"{EVENTS}?wait_s=1"))
        await asyncio.sleep(0.05)
        await finish_some(api)
        events = parse_events((await asyncio.wait_for(opened, 5)).text)
        assert len(await feed(client, last=events[1]["id"])) == 2  # the ring holds 2
        gone = await client.get(EVENTS, headers={"last-event-id": events[0]["id"]})
        assert "no longer holds" in error_of(gone, 410, "event_id_gone")


async def test_a_broker_behind_the_key_skips_what_the_client_saw(api: Api) -> None:
    ledger, entry = api.node.position
    # The client read up to two entries ahead from another broker (the leader).
    ahead = f"{ledger}:{entry + 2}:0"
    opened = asyncio.ensure_future(api.get(f"{EVENTS}?wait_s=1", headers={"last-event-id": ahead}))
    await asyncio.sleep(0.05)
    ids = [(await submit(api))["id"] for _ in range(3)]
    for task_id in ids:
        await run_and_finish(api.node, task_id)
    events = parse_events((await asyncio.wait_for(opened, 5)).text)
    keys = [tuple(map(int, e["id"].split(":"))) for e in events]
    assert keys and all(key > (ledger, entry + 2, 0) for key in keys)


async def test_a_stream_too_far_behind_ends_and_resumes(api: Api) -> None:
    app = ApiApp(api.node, replace(CONFIG, max_event_backlog=2))
    feed_ = app.context.feed
    slow = feed_.subscribe(FeedFilter(), None)  # nobody sends its chunks: it falls behind
    ids = [(await submit(api))["id"] for _ in range(3)]
    for task_id in ids:
        assert (await api.post(f"{TASKS}/{task_id}/cancel")).status_code == 200
    assert len(slow.ready) == 2 and not slow.pending  # its stream sends those two and ends
    feed_.unsubscribe(slow)
    # Its client resumes from the last id it got: the third event is replayed.
    last = parse_events(slow.ready[1].decode())[0]["id"]
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        rest = await feed(client, last=last)
    assert [e["data"]["id"] for e in rest] == ids[2:]
    assert feed_.streams == 0


async def test_bad_feed_requests(api: Api) -> None:
    for query, headers, fragment in [
        ("states=running", {}, "states must be final states"),
        ("states=", {}, "states must be final states"),
        ("tree=x", {}, "tree must be a task id"),
        ("type=noop", {}, "unknown query parameters"),
        ("", {"last-event-id": "7"}, "Last-Event-ID must be"),
        ("", {"last-event-id": "a:b:c"}, "Last-Event-ID must be"),
        ("", {"last-event-id": ""}, "Last-Event-ID must be"),
    ]:
        response = await api.get(f"{EVENTS}?{query}", headers=headers)
        assert fragment in error_of(response, 400, "invalid_request"), (query, response.text)
    assert api.app.context.feed.streams == 0


async def test_a_tenant_token_sees_its_own_tenant_only(env: Env) -> None:
    mine = await env.call("alice", "GET", EVENTS, params={"wait_s": 0, "tenant": "alice"})
    assert mine.status_code == 200
    other = await env.call("alice", "GET", EVENTS, params={"wait_s": 0, "tenant": "bob"})
    assert error_code(other, 403) == "forbidden"
    assert error_code(await env.call("worker", "GET", EVENTS, params={"wait_s": 0}), 403)


async def test_the_tree_filter(api: Api) -> None:
    root = (await submit(api, track_tree=True))["id"]
    other = (await submit(api))["id"]
    opened = asyncio.ensure_future(api.get(f"{EVENTS}?wait_s=1&tree={root}"))
    await asyncio.sleep(0.05)
    (child,) = await run_and_finish(api.node, root, "noop")
    await run_and_finish(api.node, other)
    await run_and_finish(api.node, child)
    events = parse_events((await asyncio.wait_for(opened, 5)).text)
    assert [e["data"]["id"] for e in events] == [root, child]


async def test_a_state_loaded_from_a_snapshot_answers_410_for_keys_before_it(api: Api) -> None:
    opened = asyncio.ensure_future(api.get(f"{EVENTS}?wait_s=1"))
    await asyncio.sleep(0.05)
    await finish_some(api)
    events = parse_events((await asyncio.wait_for(opened, 5)).text)
    # As a follower catching up from a snapshot: the entries it covers were never applied.
    loaded = StateMachine.from_snapshot(api.node.state.encode_snapshot())
    api.node.applier.install(loaded, api.node.position)
    gone = await api.get(EVENTS, headers={"last-event-id": events[-1]["id"]})
    assert error_of(gone, 410, "event_id_gone")
    ledger, entry = api.node.position
    assert await feed(api.client, last=f"{ledger}:{entry}") == []  # from the snapshot on
    ids = await finish_some(api)
    assert [e["data"]["id"] for e in await feed(api.client, last=f"{ledger}:{entry}")] == ids


async def test_a_tenant_tokens_feed_holds_its_own_tasks_only(env: Env) -> None:
    ids = {}
    for who in ("alice", "bob"):
        response = await env.call(who, "POST", TASKS, json={"type": "noop"})
        ids[who] = int(response.json()["id"])
    opened = asyncio.ensure_future(env.call("alice", "GET", EVENTS, params={"wait_s": 1}))
    await asyncio.sleep(0.05)
    for who, task_id in ids.items():
        assert (await env.call(who, "POST", f"{TASKS}/{task_id}/cancel")).status_code == 200
    events = parse_events((await asyncio.wait_for(opened, 5)).text)
    assert [e["data"]["id"] for e in events] == [ids["alice"]]
