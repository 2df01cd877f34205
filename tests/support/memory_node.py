"""A broker Node on in-memory ledgers, for tests that serve its API in process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from broker.observability.node_observer import observe_node
from broker.replication.node import Node, NodeConfig
from log.memory import MemoryLedgerListStore, MemoryLedgerStore
from snapshot.store import SnapshotStore


def memory_node(data_dir: Path, **config: Any) -> Node:
    """An unstarted Node: memory ledgers, snapshots in ``data_dir/snapshots``, timers
    polled every 10 ms (``config`` overrides NodeConfig fields); its metrics and task log
    attached as a server attaches them."""
    node = Node(
        NodeConfig(**{"data_dir": data_dir, "timer_poll_interval_s": 0.01, **config}),
        ledgers=MemoryLedgerStore(),
        ledger_list=MemoryLedgerListStore(),
        snapshots=SnapshotStore(data_dir / "snapshots"),
    )
    observe_node(node)
    return node
