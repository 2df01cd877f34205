"""Task trees from the Python client and the CLI, against a real ApiApp served by uvicorn
(the synchronous client runs in a thread while the test drives the node)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.api.http_api import ApiApp, ApiConfig
from broker.core import entries as e
from broker.replication.node import Node
from clients import cli
from clients.client import (
    AsyncStewardClient,
    AsyncTaskHandle,
    InvalidRequestError,
    NotFoundError,
    StewardClient,
    TaskTimeoutError,
    TreeFailedError,
)
from tests.support.asgi_server import Served, serve, unserve
from tests.support.http_api import run_and_finish
from tests.support.memory_node import memory_node


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Node, Served]]:
    node = memory_node(tmp_path)
    await node.start()
    server = await serve(ApiApp(node, ApiConfig()))
    try:
        yield node, server
    finally:
        await unserve(server)
        await node.stop(snapshot=False)


async def test_tree_result_waits_for_the_whole_tree(served: tuple[Node, Served]) -> None:
    node, server = served
    with StewardClient(server.url) as client:
        handle = await asyncio.to_thread(client.submit, "root", track_tree=True, tree_timeout_s=5)
        waiting = asyncio.ensure_future(asyncio.to_thread(handle.tree_result, 10))
        [child] = await run_and_finish(node, handle.id, "child")
        await asyncio.sleep(0.1)
        assert not waiting.done()  # the root finished, not its tree
        await run_and_finish(node, child)
        assert await asyncio.wait_for(waiting, 10) is None  # the root's result
        tree = (await asyncio.to_thread(handle.info))["tree"]
        assert tree == {"state": "completed", "attempt": 1, "timeout_s": 5.0}
        with pytest.raises(TaskTimeoutError):
            other = await asyncio.to_thread(client.submit, "root", track_tree=True)
            await asyncio.to_thread(other.tree_result, 0.2)


async def test_tree_result_raises_when_the_tree_failed(served: tuple[Node, Served]) -> None:
    node, server = served
    with StewardClient(server.url) as client:
        handle = await asyncio.to_thread(client.submit, "root", track_tree=True)
        [child] = await run_and_finish(node, handle.id, "child")
        await asyncio.to_thread(client.cancel, child)
        with pytest.raises(TreeFailedError, match=f"task {child} was cancelled"):
            await asyncio.to_thread(handle.tree_result, 10)
        plain = await asyncio.to_thread(client.submit, "plain")
        with pytest.raises(InvalidRequestError, match="does not root a tracked tree"):
            await asyncio.to_thread(plain.tree_result, 1)


async def test_cli_submits_tracked_roots_and_shows_their_tree(
    served: tuple[Node, Served], capsys: pytest.CaptureFixture[str]
) -> None:
    node, server = served
    argv = ["--url", server.url, "submit", "root", "--track-tree", "--tree-timeout-s", "7"]
    assert await asyncio.to_thread(cli.main, argv) == 0
    root = int(capsys.readouterr().out.strip())
    [child] = await run_and_finish(node, root, "child")
    assert await asyncio.to_thread(cli.main, ["--url", server.url, "task", str(root)]) == 0
    out = capsys.readouterr().out
    assert "tree: pending (run 1, timeout 7 s)" in out
    assert await asyncio.to_thread(cli.main, ["--url", server.url, "task", str(child)]) == 0
    assert f"root: {root}" in capsys.readouterr().out

    submitted = asyncio.Event()
    node.listeners.append(
        lambda entry, *_: submitted.set() if isinstance(entry, e.SubmitTasks) else None
    )
    waiting = asyncio.ensure_future(
        asyncio.to_thread(
            cli.main, ["--url", server.url, "submit", "root", "--track-tree", "--wait"]
        )
    )
    await asyncio.wait_for(submitted.wait(), 10)
    second = max(node.state.tasks)
    await run_and_finish(node, second)
    assert await asyncio.wait_for(waiting, 10) == 0
    assert f"task {second} tree completed (run 1, timeout 30 s)\n" in capsys.readouterr().out


async def test_clients_and_cli_show_a_tree_view(
    served: tuple[Node, Served], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 18: ``tree``/``trees`` of both clients and ``steward tree ROOT``."""
    node, server = served
    with StewardClient(server.url) as client:
        root = (await asyncio.to_thread(client.submit, "root", track_tree=True)).id
        [child] = await run_and_finish(node, root, "child")
        tree = await asyncio.to_thread(client.tree, root)
        assert tree["state"] == "pending" and tree["pending_anchors"] == [child]
        listed = await asyncio.to_thread(client.trees, state="pending")
        assert [t["root"] for t in listed["trees"]] == [root]
        with pytest.raises(NotFoundError):
            await asyncio.to_thread(client.tree, child)  # a tree task, not a root
    async with AsyncStewardClient(server.url) as async_client:
        assert (await async_client.tree(root))["tasks"]["finished"] == 1
        assert (await async_client.trees(state="completed"))["trees"] == []
    assert await asyncio.to_thread(cli.main, ["--url", server.url, "tree", str(root)]) == 0
    out = capsys.readouterr().out
    assert "state: pending" in out and f"1 acks awaited: {child}" in out, out
    assert "STATE" in out and "waiting" in out and "finished" in out, out
    assert await asyncio.to_thread(cli.main, ["--url", server.url, "tree", str(child)]) != 0
    assert f"task {child} does not root a tracked tree" in capsys.readouterr().err


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_wait_tree_is_on_the_tree_event_stream_not_a_long_poll(
    tmp_path: Path, flavour: str
) -> None:
    node = memory_node(tmp_path)
    await node.start()
    app = ApiApp(node, ApiConfig())
    server = await serve(app)
    context = app.context
    try:
        async with AsyncStewardClient(server.url) as aclient:
            with StewardClient(server.url) as client:
                handle = await asyncio.to_thread(client.submit, "root", track_tree=True)
                if flavour == "sync":
                    waiting = asyncio.ensure_future(asyncio.to_thread(handle.wait_tree, 20))
                else:
                    waiting = asyncio.ensure_future(
                        AsyncTaskHandle(aclient, handle.id, "waiting").wait_tree(20)
                    )
                [child] = await run_and_finish(node, handle.id, "child")
                for _ in range(200):  # bounded: the stream opens within 10 s
                    if context.feed.streams:
                        break
                    await asyncio.sleep(0.05)
                assert [s.filter.root for s in context.feed.subscriptions] == [handle.id]
                assert not context.waiters.trees  # nobody long-polls the tree
                assert not waiting.done()  # the root finished, not its tree
                await run_and_finish(node, child)
                root = await asyncio.wait_for(waiting, 10)
                assert root["id"] == handle.id and root["tree"]["state"] == "completed"
                # A tree already ended is answered at the stream's open.
                again = await asyncio.to_thread(handle.wait_tree, 5)
                assert again["tree"]["state"] == "completed"
    finally:
        await unserve(server)
        await node.stop(snapshot=False)
