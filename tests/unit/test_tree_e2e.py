"""Task trees end to end: a real worker (clients.worker) spawning children through the
leader's worker endpoint (broker/workers/worker_link.py) on a Node with in-memory ledgers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from broker.core import TaskState, TreeState
from clients.worker import TaskContext, Worker, WorkerConfig
from tests.support.link_broker import Broker, BrokerFactory


def fanout(params: Any, ctx: TaskContext) -> int:
    for i in range(params["parts"]):
        ctx.spawn("part", {"i": i, "root": ctx.task_id})
    ctx.spawn("side", None, tracked=False)
    return int(params["parts"])


def part(params: Any, ctx: TaskContext) -> int:
    # A DAG: the leaf hangs from this part and from the root.
    ctx.spawn("leaf", {"i": params["i"]}, anchors=[ctx.task_id, params["root"]])
    return int(params["i"]) * 10


def leaf(params: Any, ctx: TaskContext) -> int:
    return int(params["i"]) + 1


async def test_a_real_worker_grows_a_tree_that_completes(broker: Broker, tmp_path: Path) -> None:
    worker = Worker(
        WorkerConfig(
            broker=f"127.0.0.1:{broker.link.port}",
            http_url="http://127.0.0.1:9",
            worker_id="real",
            task_types={"*": 4},
            cache_dir=tmp_path / "cache",
            reconnect_backoff_min_s=0.02,
            reconnect_backoff_max_s=0.2,
            spark="off",  # no Spark Connect server (a JVM) for these plain tasks
        )
    )
    for name, fn in (("fanout", fanout), ("part", part), ("leaf", leaf)):
        worker.runtime.register(name, fn)
    worker.runtime.register("side", lambda params, ctx: "side")
    running = asyncio.ensure_future(worker.run())
    try:
        [root] = await broker.submit(track_tree=True, task_type="fanout", params=b'{"parts": 3}')
        state = broker.node.state
        await broker.until(lambda: state.trees[root].state != TreeState.PENDING, 10.0)
        tree = state.trees[root]
        assert tree.state == TreeState.COMPLETED, tree.reason
        assert tree.attempt == 1
        tasks = sorted(state.tasks.values(), key=lambda t: t.id)
        assert [t.type for t in tasks].count("part") == 3
        assert [t.type for t in tasks].count("leaf") == 3
        tracked = [t for t in tasks if t.root == root]
        assert len(tracked) == 7  # root, 3 parts, 3 leaves; the side task is not tracked
        assert all(t.state == TaskState.FINISHED for t in tracked)
        assert sorted(t.result for t in tasks if t.type == "leaf") == [b"1", b"2", b"3"]
    finally:
        await worker.stop(wait=False, timeout_s=0.5)
        await asyncio.wait_for(running, 5)


async def test_a_crashing_child_fails_the_tree_and_the_root_is_replayed(
    make_broker: BrokerFactory, tmp_path: Path
) -> None:
    broker = await make_broker()
    crashes: list[int] = []

    def flaky(params: Any, ctx: TaskContext) -> str:
        if not crashes:  # the first run of the tree: the child crashes for good
            crashes.append(ctx.task_id)
            raise RuntimeError("child crashed")
        return "ok"

    worker = Worker(
        WorkerConfig(
            broker=f"127.0.0.1:{broker.link.port}",
            http_url="http://127.0.0.1:9",
            worker_id="real",
            cache_dir=tmp_path / "cache",
            spark="off",
        )
    )
    # spawn answers a handle (for later anchors), not JSON: the root returns nothing.
    worker.runtime.register("root", lambda params, ctx: ctx.spawn("flaky") and None)
    worker.runtime.register("flaky", flaky)
    running = asyncio.ensure_future(worker.run())
    try:
        [root] = await broker.submit(track_tree=True, task_type="root", max_attempts=2)
        state = broker.node.state
        await broker.until(lambda: state.trees[root].state == TreeState.COMPLETED, 10.0)
        tree = state.trees[root]
        assert tree.attempt == 2
        assert state.tasks[crashes[0]].state == TaskState.ERROR
        assert state.tasks[root].attempt == 2
    finally:
        await worker.stop(wait=False, timeout_s=0.5)
        await asyncio.wait_for(running, 5)
