"""The pipelining producer (``client.producer()``) against real brokers: a standalone
``steward standalone`` process (no workers: the tasks only need to be durable), and a
3-broker cluster on a real ZooKeeper whose leader is killed with kill -9 under a producer
submitting continuously. Every wait is bounded."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from clients.client import (
    AsyncStewardClient,
    AsyncTaskHandle,
    StewardClient,
    StewardError,
    TaskHandle,
    TenantQueueFullError,
)
from clients.client.api_calls import Request
from clients.dev.zk import ZooKeeperServer
from tests.support.cluster_procs import ClusterProcesses
from tests.support.procs import BrokerProcess
from tests.support.worker_procs import wait_until
from tests.support.write_load import fetch_tasks

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def broker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("producer")
    broker = BrokerProcess(root / "data", log_path=root / "broker.log")
    broker.start()
    try:
        yield broker.url
    finally:
        broker.kill9()


def _count_requests(producer: Any) -> list[int]:
    """Wrap the sender's real ``_send``: the size of each batch request it makes."""
    sizes: list[int] = []
    send = producer._sender._send

    def counting(request: Request) -> Any:
        answer = send(request)
        sizes.append(len(answer))
        return answer

    producer._sender._send = counting
    return sizes


def test_every_future_resolves_to_a_durable_task_in_submit_order(broker_url: str) -> None:
    with StewardClient(broker_url) as client:
        with client.producer(linger_ms=60_000, max_batch=250) as p:
            sizes = _count_requests(p)
            futures = [p.submit("noop", {"n": n}, tenant="order") for n in range(1000)]
            p.flush(timeout=60)
            assert all(f.done() for f in futures)
        handles = [f.result(0) for f in futures]
        assert all(isinstance(h, TaskHandle) for h in handles)
        ids = [h.id for h in handles]
        assert len(set(ids)) == 1000 and ids == sorted(ids)  # created in submit order
        assert sizes == [250] * 4  # max_batch, not the (long) linger, cut the batches
        assert handles[7].info()["params"] == {"n": 7}
        listed = client.tasks(tenant="order", limit=1000)["tasks"]
        assert [t["id"] for t in listed] == ids
        assert [t["params"]["n"] for t in listed] == list(range(1000))


def test_linger_batches_a_slow_trickle(broker_url: str) -> None:
    with StewardClient(broker_url) as client, client.producer(linger_ms=2000, max_batch=1000) as p:
        sizes = _count_requests(p)
        futures = []
        for n in range(10):  # all within the first one's linger
            futures.append(p.submit("noop", {"n": n}, tenant="linger"))
            time.sleep(0.005)
        handles = [f.result(timeout=30) for f in futures]
        assert sizes == [10]
        assert len({h.id for h in handles}) == 10


def test_a_full_tenant_queue_fails_only_the_overflowing_futures(broker_url: str) -> None:
    with StewardClient(broker_url) as client:
        client.set_tenant("full", max_waiting=50)
        with client.producer(linger_ms=5, max_batch=30) as p:
            futures = [p.submit("noop", {"n": n}, tenant="full") for n in range(120)]
        done: list[tuple[int, TaskHandle]] = []
        refused: list[int] = []
        for n, future in enumerate(futures):
            error = future.exception(0)
            if error is None:
                done.append((n, future.result(0)))
            else:
                assert isinstance(error, TenantQueueFullError), error
                assert error.code == "tenant_queue_full" and "max_waiting" in error.message
                refused.append(n)
        assert [n for n, _ in done] == list(range(50))  # in order, until the queue was full
        assert refused == list(range(50, 120))  # nothing dropped silently
        listed = client.tasks(tenant="full", limit=1000)["tasks"]
        assert sorted(t["id"] for t in listed) == [h.id for _, h in done]


def test_async_producer(broker_url: str) -> None:
    async def main() -> list[AsyncTaskHandle]:
        async with (
            AsyncStewardClient(broker_url) as client,
            client.producer(linger_ms=2, max_batch=200) as p,
        ):
            futures = [await p.submit("noop", {"n": n}, tenant="async") for n in range(1000)]
            await asyncio.wait_for(p.flush(), 60)
            handles = [f.result() for f in futures]
            assert (await client.task(handles[3].id))["params"] == {"n": 3}
            return handles

    handles = asyncio.run(main())
    ids = [h.id for h in handles]
    assert len(set(ids)) == 1000 and ids == sorted(ids)
    with StewardClient(broker_url) as client:
        listed = client.tasks(tenant="async", limit=1000)["tasks"]
        assert [t["params"]["n"] for t in listed] == list(range(1000))


@pytest.mark.slow
def _created(futures: list[Future[TaskHandle]]) -> int:
    """How many of ``futures`` resolved to a handle."""
    return sum(1 for f in futures if f.done() and not f.cancelled() and f.exception() is None)


def test_kill9_leader_under_a_producer(zookeeper: ZooKeeperServer, tmp_path: Path) -> None:
    """Every future resolves (a handle or a clear error); each task whose future got a
    handle exists once on the new leader; no task exists twice (by its marker)."""
    with ClusterProcesses(zookeeper.connect_string, tmp_path) as cluster:
        leader = cluster.wait_for_leader(30)
        stop = threading.Event()
        futures: list[Future[TaskHandle]] = []
        with StewardClient(cluster.urls(), failover_timeout_s=40) as client:
            producer = client.producer(linger_ms=5, max_batch=200)

            def submit_continuously() -> None:
                marker = 0
                while not stop.is_set():
                    for _ in range(20):
                        futures.append(producer.submit("noop", {"m": marker}, tenant="pf"))
                        marker += 1
                    time.sleep(0.01)

            thread = threading.Thread(target=submit_continuously, daemon=True)
            thread.start()
            # Killed once the leader acknowledged some batches, while more are in flight.
            wait_until(lambda: _created(futures[:200]) == 200, 30, "200 tasks created")
            before_kill = len(futures)
            cluster.kill9(leader.broker_id)
            new = cluster.wait_for_leader(30, excluding=[leader.broker_id])
            after_failover = len(futures)  # keep submitting until the new leader creates some
            wait_until(
                lambda: _created(futures[after_failover : after_failover + 200]) > 0,
                60,
                "a task created by the new leader",
            )
            stop.set()
            thread.join(10)
            producer.close(timeout=90)
        outcomes: list[TaskHandle | BaseException] = []
        for future in futures:
            error = future.exception(0)  # resolved: close() flushed everything
            outcomes.append(future.result(0) if error is None else error)
        handles = {n: o for n, o in enumerate(outcomes) if isinstance(o, TaskHandle)}
        errors = [o for o in outcomes if not isinstance(o, TaskHandle)]
        assert all(isinstance(e, StewardError) for e in errors), errors[:3]
        print(
            f"\n{len(futures)} submitted ({before_kill} before the kill), "
            f"{len(handles)} handles, {len(errors)} errors"
        )
        assert any(n >= before_kill for n in handles), "nothing created after the failover"
        tasks = fetch_tasks(new, tenant="pf")
        markers = Counter(t["params"]["m"] for t in tasks.values())
        twice = [m for m, count in markers.items() if count > 1]
        assert not twice, f"tasks created twice: markers {twice[:10]}"
        for n, handle in handles.items():
            assert tasks[handle.id]["params"] == {"m": n}, (n, handle)
        # Only futures that failed may lack a task.
        assert len(tasks) >= len(handles)
        digest = cluster.wait_for_equal_digests(30)
        print(f"2 brokers agree on digest {digest[:16]}")
