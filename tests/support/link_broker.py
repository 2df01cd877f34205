"""The harness of the leader's worker endpoint: a Node on in-memory ledgers with a WorkerLink
on an ephemeral port (heartbeats every 100 ms, a 600 ms heartbeat timeout), and the
``make_broker`` / ``broker`` fixtures (registered in tests/conftest.py).

Tests drive it with :class:`tests.support.fake_worker.FakeWorker`; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from broker.core import Applied, ApplyResult, Task, TaskRef
from broker.core import entries as e
from broker.observability.node_observer import observe_node
from broker.replication.node import Node, NodeConfig, Stamp, wall_clock_ms
from broker.workers.worker_link import WorkerLink, WorkerLinkConfig
from log.memory import MemoryLedgerListStore, MemoryLedgerStore
from snapshot.store import SnapshotStore
from tests.support.fake_worker import FakeWorker

INTERVAL_MS = 100
TIMEOUT_MS = 600
WAIT_S = 3.0
BROKER_ID = "broker-under-test"

E = TypeVar("E", bound=e.Entry)


class Clock:
    """Wall-clock milliseconds, unless a test freezes (and then moves) it."""

    def __init__(self) -> None:
        self.frozen: int | None = None

    def __call__(self) -> int:
        return self.frozen if self.frozen is not None else wall_clock_ms()

    def freeze(self) -> int:
        self.frozen = wall_clock_ms()
        return self.frozen


class Monotonic:
    """A monotonic clock for the worker link that moves only when a test moves ``now``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Broker:
    node: Node
    link: WorkerLink
    clock: Clock
    applied: list[tuple[e.Entry, ApplyResult]] = field(default_factory=list)
    workers: list[FakeWorker] = field(default_factory=list)

    def worker(self, worker_id: str = "w1", **options: Any) -> FakeWorker:
        worker = FakeWorker(self.link.port, worker_id, **options)
        self.workers.append(worker)
        return worker

    def task(self, task_id: int) -> Task:
        return self.node.state.tasks[task_id]

    def entries(self, kind: type[E]) -> list[E]:
        return [entry for entry, _ in self.applied if isinstance(entry, kind)]

    async def submit(
        self,
        count: int = 1,
        *,
        tenant: str = "t",
        task_type: str = "noop",
        params: bytes = b"null",
        max_attempts: int = 1,
        deadline_in_ms: int | None = None,
        track_tree: bool = False,
        placed: bool = False,
        max_lost: int = e.DEFAULT_MAX_LOST,
    ) -> list[int]:
        """Submit ``count`` tasks in one entry; ``placed``: as the API's submit does, let the
        link put their assignments into the entry (docs/DESIGN.md §6)."""
        placer = self.node.placer if placed else None
        assignments: tuple[e.Assignment, ...] = ()

        def build(stamp: Stamp) -> e.Entry:
            nonlocal assignments
            deadline = None if deadline_in_ms is None else stamp.now_ms + deadline_in_ms
            tasks = tuple(
                e.TaskSpec(
                    id=task_id,
                    type=task_type,
                    tenant=tenant,
                    params=params,
                    max_attempts=max_attempts,
                    deadline_ms=deadline,
                    track_tree=track_tree,
                    max_lost=max_lost,
                )
                for task_id in stamp.task_ids(count)
            )
            if placer is not None:
                assignments = placer.place(tasks, stamp.now_ms)
            return e.SubmitTasks(
                time_ms=stamp.now_ms,
                tasks=tasks,
                assignments=assignments,
                v=e.submit_version(tasks),
            )

        try:
            results = await self.node.propose(build)
        finally:
            if placer is not None:
                placer.release(assignments)
        assert isinstance(results, list)
        refs = [r for r in results if isinstance(r, TaskRef)]
        assert len(refs) == count, results
        return [r.id for r in refs]

    async def cancel(self, task_id: int, reason: str = "cancelled by request") -> None:
        result = await self.node.propose(
            lambda stamp: e.CancelTask(time_ms=stamp.now_ms, task_id=task_id, reason=reason)
        )
        assert isinstance(result, TaskRef), result

    async def until(self, condition: Callable[[], bool], wait_s: float = WAIT_S) -> None:
        """Poll until ``condition()`` holds; fail after ``wait_s`` seconds."""
        deadline = time.monotonic() + wait_s
        while True:
            if condition():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition still false after {wait_s} s")
            await asyncio.sleep(0.01)


BrokerFactory = Callable[..., Awaitable[Broker]]


@pytest.fixture
async def make_broker(tmp_path: Path) -> AsyncIterator[BrokerFactory]:
    started: list[Broker] = []

    async def make(node_options: dict[str, Any] | None = None, **link_options: Any) -> Broker:
        clock = Clock()
        data_dir = tmp_path / f"broker{len(started)}"
        node = Node(
            NodeConfig(
                **{
                    "data_dir": data_dir,
                    "broker_id": BROKER_ID,
                    "snapshot_interval_s": 3600.0,
                    "timer_poll_interval_s": 0.02,
                    **(node_options or {}),
                }
            ),
            ledgers=MemoryLedgerStore(),
            ledger_list=MemoryLedgerListStore(),
            snapshots=SnapshotStore(data_dir / "snapshots"),
            clock_ms=clock,
        )
        observe_node(node)
        await node.start()
        settings: dict[str, Any] = {
            "port": 0,
            "heartbeat_interval_ms": INTERVAL_MS,
            "heartbeat_timeout_ms": TIMEOUT_MS,
            "hello_timeout_s": 2.0,
            **link_options,
        }
        link_clock = settings.pop("link_clock", time.monotonic)  # the link's monotonic clock
        link = WorkerLink(node, WorkerLinkConfig(**settings), clock=link_clock)
        broker = Broker(node, link, clock)

        def record(entry: e.Entry, applied: Applied) -> None:
            broker.applied.append((entry, applied.result))

        node.listeners.append(record)
        await link.start()
        started.append(broker)
        return broker

    yield make
    for broker in started:
        for worker in broker.workers:
            await worker.close()
        await broker.link.stop()
        await broker.node.stop(snapshot=False)
        broker.node.state.check_invariants()


@pytest.fixture
async def broker(make_broker: BrokerFactory) -> Broker:
    return await make_broker()
