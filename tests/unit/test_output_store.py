"""The leader's task output store (broker/api/output_store.py): bounds, offsets, fetches,
and the logs route's answers (tenant scope, bad attempts)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from broker.api.http_api import ApiApp, ApiConfig
from broker.api.output_store import LogsError, OutputStore, logs_answer, logs_from_leader
from broker.core import Task, TaskState
from broker.security.auth import ANONYMOUS_ADMIN, Principal, Role
from clients.client import NotFoundError, StewardClient
from clients.worker.runtime.task_runtime import split_dropped_note
from tests.support.asgi_server import serve, unserve
from tests.support.http_api import run_and_finish
from tests.support.memory_node import memory_node
from wire import worker_protocol as p

MIB = 1024 * 1024


def test_an_attempt_keeps_its_last_bytes_only() -> None:
    store = OutputStore(max_attempt_bytes=10)
    store.add((1, 1), 0, b"0123456789abc")
    assert store.get((1, 1)) == (3, b"3456789abc", False)
    store.add((1, 1), 13, b"XYZ")
    assert store.get((1, 1)) == (6, b"6789abcXYZ", False)
    assert store.total_bytes == 10


def test_running_chunks_append_only_what_is_new_and_a_gap_starts_afresh() -> None:
    store = OutputStore()
    store.add((1, 1), 0, b"hello ")
    store.add((1, 1), 3, b"lo world")  # overlaps: only " world"... after offset 6 is new
    assert store.get((1, 1)) == (0, b"hello world", False)
    store.add((1, 1), 0, b"hel")  # a repeat: nothing new
    assert store.get((1, 1)) == (0, b"hello world", False)
    store.add((1, 1), 100, b"later")  # bytes 11..99 were never seen
    assert store.get((1, 1)) == (100, b"later", False)
    assert store.total_bytes == 5


def test_the_final_tail_replaces_the_chunks_and_late_chunks_are_ignored() -> None:
    store = OutputStore()
    store.add((1, 1), 0, b"partial")
    store.add((1, 1), 2, b"rtial and the rest", complete=True)
    assert store.get((1, 1)) == (2, b"rtial and the rest", True)
    store.add((1, 1), 20, b"late")
    assert store.get((1, 1)) == (2, b"rtial and the rest", True)
    assert store.total_bytes == len(b"rtial and the rest")


def test_the_total_bound_evicts_the_least_recently_written_attempt() -> None:
    store = OutputStore(max_attempt_bytes=100, max_total_bytes=250)
    for task_id in (1, 2, 3):
        store.add((task_id, 1), 0, b"x" * 100)
    assert (1, 1) not in store and (2, 1) in store and (3, 1) in store
    assert store.total_bytes == 200
    store.add((2, 1), 100, b"y" * 10)  # 2 is now the most recent
    store.add((4, 1), 0, b"z" * 100)
    assert (3, 1) not in store and (2, 1) in store and (4, 1) in store
    assert store.total_bytes <= 250


def test_the_attempt_count_is_bounded_too() -> None:
    store = OutputStore(max_attempts=3)
    for task_id in range(10):
        store.add((task_id, 1), 0, b"")
    assert len(store) == 3 and (9, 1) in store and (6, 1) not in store


def test_forgotten_tasks_lose_their_output() -> None:
    store = OutputStore()
    store.add((1, 1), 0, b"a")
    store.add((1, 2), 0, b"b")
    store.add((2, 1), 0, b"c")
    store.drop_task(1)
    assert len(store) == 1 and store.total_bytes == 1
    store.prune(lambda task_id: task_id != 2, force=True)
    assert len(store) == 0 and store.total_bytes == 0


def test_worker_dropped_note_gives_the_offset() -> None:
    assert split_dropped_note(b"[... 42 earlier bytes of output dropped ...]\nrest") == (
        42,
        b"rest",
    )
    assert split_dropped_note(b"no note [... 1 earlier bytes of output dropped ...]\n") == (
        0,
        b"no note [... 1 earlier bytes of output dropped ...]\n",
    )


def test_output_frames_are_bounded_by_the_protocol() -> None:
    ok = p.Output(task_id=1, attempt=1, data=b"x" * p.MAX_OUTPUT_BYTES)
    decoder = p.FrameDecoder()
    assert decoder.feed(p.encode_message(ok)) == [ok]
    too_big = p.encode_message(p.Output(task_id=1, attempt=1, data=b"x" * (p.MAX_OUTPUT_BYTES + 1)))
    with pytest.raises(p.ProtocolError) as caught:
        p.FrameDecoder().feed(too_big)
    assert caught.value.code == "output_too_large"


async def test_fetch_waits_for_the_worker_and_gives_up_when_it_has_nothing() -> None:
    store = OutputStore()
    asked: list[tuple[str, int, int]] = []

    def fetcher(worker_id: str, task_id: int, attempt: int) -> bool:
        asked.append((worker_id, task_id, attempt))
        loop = asyncio.get_running_loop()
        if task_id == 1:
            loop.call_soon(lambda: store.add((1, 1), 0, b"from the worker", complete=True))
        else:
            loop.call_soon(lambda: store.missing((task_id, attempt)))
        return True

    assert not await store.fetch("w", (1, 1), 1.0)  # no link: no fetcher
    store.fetcher = fetcher
    assert await store.fetch("w", (1, 1), 5.0)
    assert not await store.fetch("w", (2, 1), 5.0)
    assert asked == [("w", 1, 1), ("w", 2, 1)]
    assert store.get((1, 1)) == (0, b"from the worker", True)


class _State:
    def __init__(self, *tasks: Task) -> None:
        self.tasks = {t.id: t for t in tasks}


def _task(task_id: int, tenant: str, state: str, attempt: int) -> Task:
    return Task(
        id=task_id,
        type="noop",
        tenant=tenant,
        params=b"null",
        state=state,
        created_ms=0,
        updated_ms=0,
        attempt=attempt,
        max_attempts=3,
        worker="w1" if attempt else None,
    )


async def _answer(
    store: OutputStore, state: _State, principal: Principal, task_id: int, **query: str
) -> dict[str, object]:
    body = await logs_answer(store, state, principal, task_id, query)  # type: ignore[arg-type]
    answer: dict[str, object] = json.loads(body)
    return answer


async def test_logs_answers_from_an_offset_and_say_when_output_was_dropped() -> None:
    store = OutputStore(max_attempt_bytes=8)
    state = _State(_task(5, "alice", TaskState.RUNNING, 2))
    store.add((5, 2), 0, b"0123456789")  # keeps "23456789"
    first = await _answer(store, state, ANONYMOUS_ADMIN, 5)
    assert first["attempt"] == 2 and first["output"] == "23456789"
    assert first["truncated"] is True and first["offset"] == 2 and first["next_offset"] == 10
    assert first["complete"] is False
    store.add((5, 2), 10, b"\xffab")
    more = await _answer(store, state, ANONYMOUS_ADMIN, 5, offset="10")
    assert more["output"] == "\ufffdab" and more["truncated"] is False
    assert more["next_offset"] == 13
    # An earlier attempt is over, whatever the task does now.
    older = await _answer(store, state, ANONYMOUS_ADMIN, 5, attempt="1")
    assert older["available"] is False and older["complete"] is True


async def test_logs_are_the_owners_only_and_bad_requests_are_4xx() -> None:
    store = OutputStore()
    state = _State(_task(5, "alice", TaskState.FINISHED, 1), _task(6, "alice", "waiting", 0))
    store.add((5, 1), 0, b"alice's secret output", complete=True)
    alice = Principal(Role.TENANT, tenant="alice")
    bob = Principal(Role.TENANT, tenant="bob")
    assert (await _answer(store, state, alice, 5))["output"] == "alice's secret output"
    for principal, task_id, query, status in [
        (bob, 5, {}, 404),  # another tenant's task: as missing
        (alice, 7, {}, 404),
        (alice, 5, {"attempt": "2"}, 400),
        (alice, 5, {"attempt": "0"}, 400),
        (alice, 5, {"attempt": "x"}, 400),
        (alice, 5, {"offset": "-1"}, 400),
        (alice, 5, {"since": "1"}, 400),
        (alice, 6, {"attempt": "1"}, 400),  # never ran
    ]:
        with pytest.raises(LogsError) as caught:
            await _answer(store, state, principal, task_id, **query)
        assert caught.value.status == status, (principal, task_id, query)
    not_run = await _answer(store, state, alice, 6)
    assert not_run["available"] is False and not_run["output"] == ""
    assert not_run["complete"] is False  # it may still run: a follower keeps polling
    never = _State(_task(8, "alice", TaskState.CANCELLED, 0))
    assert (await _answer(store, never, alice, 8))["complete"] is True


async def test_a_follower_passes_the_request_to_the_leader_once(tmp_path: Path) -> None:
    """The leader served over HTTP; what a follower does with a logs request (and what
    the Python client gets from the leader)."""
    node = memory_node(tmp_path)
    await node.start()
    store = OutputStore()
    server = await serve(ApiApp(node, ApiConfig(), outputs=store))
    try:
        with StewardClient(server.url) as client:
            task_id = (await asyncio.to_thread(client.submit, "noop")).id
            await run_and_finish(node, task_id)
            store.add((task_id, 1), 0, b"printed\n", complete=True)
            path = f"/api/v1/tasks/{task_id}/logs"
            status, body = await logs_from_leader(
                server.url, path, {"offset": "2"}, None, proxied=False, ssl_context=None
            )
            assert status == 200 and json.loads(body)["output"] == "inted\n"
            status, body = await logs_from_leader(
                server.url, path, {"attempt": "9"}, None, proxied=False, ssl_context=None
            )
            assert status == 400 and json.loads(body)["error"]["code"] == "invalid_request"
            logs = await asyncio.to_thread(client.logs, task_id)
            assert logs["output"] == "printed\n" and logs["complete"] is True
            with pytest.raises(NotFoundError):
                await asyncio.to_thread(client.logs, task_id + 100)
    finally:
        await unserve(server)
        await node.stop(snapshot=False)
    # No leader known, a request already passed on once, a leader that does not answer.
    for url, proxied in (
        (None, False),
        ("http://127.0.0.1:9", True),
        ("http://127.0.0.1:9", False),
    ):
        with pytest.raises(LogsError) as caught:
            await logs_from_leader(url, "/x", {}, None, proxied=proxied, ssl_context=None)
        assert caught.value.status == 503 and caught.value.retryable
