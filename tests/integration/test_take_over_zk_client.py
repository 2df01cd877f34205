"""A take-over waits for the ledger list's ZooKeeper client (docs/DESIGN.md §4): the
broker has two ZooKeeper clients, the elector's and the ledger list's; after a ZooKeeper
server's loss the elector's may reconnect first. The elected broker then waits for the
other one (bounded by the session timeout) and takes over, instead of failing the
take-over and handing the leadership to another broker (the back of the queue).

One broker in-process on a real ZooKeeper server: it leads, the ledger list's client is
stopped, the node steps down (as after the server's loss), and the client comes back once
the take-over waits for it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from broker.replication.common import NodeConfig
from broker.replication.node import Role
from broker.server.cluster import BrokerConfig, ClusterBroker
from broker.workers.worker_link import WorkerLinkConfig
from clients.dev.zk import ZooKeeperServer

WAIT_S = 15.0


async def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {WAIT_S} s"
        await asyncio.sleep(0.02)


async def test_the_take_over_waits_for_the_ledger_lists_client(
    zookeeper: ZooKeeperServer, tmp_path: Path
) -> None:
    node = NodeConfig(data_dir=tmp_path / "b1", broker_id="b1", cluster_id="zk-client-wait")
    broker = ClusterBroker(
        BrokerConfig(
            node,
            zookeeper.connect_string,
            ledger_dir=tmp_path / "ledgers",
            workers=WorkerLinkConfig(host="127.0.0.1", port=0),  # a free port
        )
    )
    await broker.start()
    try:
        await _until(lambda: broker.node.role == Role.LEADER, "leader")
        queued_as = broker.elector.queue_node
        await asyncio.to_thread(broker.zk.stop)  # the elector's client stays connected
        # What the manager does when the elector's session is suspended a moment.
        await broker._stop_leading("test: the ZooKeeper server was lost")
        await _until(lambda: broker.zk_back.waits == 1, "wait for the ledger list's client")
        assert broker.node.role != Role.LEADER
        await asyncio.to_thread(broker.zk.start, WAIT_S)
        # The second leadership counts once its services run (after the role changes).
        await _until(lambda: broker.leader_changes == 2, "take-over")
        # Taken over in place: still the same node of the queue.
        assert broker.node.role == Role.LEADER
        assert broker.elector.queue_node == queued_as
    finally:
        await broker.stop()
