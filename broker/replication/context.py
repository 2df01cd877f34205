"""What the node's roles and parts are given of it (docs/DESIGN.md §4): a narrow context,
not the :class:`~broker.replication.node.Node`.

A leader term, the follower, the schedule firing loop and the local snapshots read the
state and position through the applier and move them only through it; the node keeps its
lifecycle (``closing``, the current role) and answers for it through two callables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from broker.replication.applier import Applier
from broker.replication.clock import NodeClock
from broker.replication.common import BrokerUnavailableError, Election, NodeConfig, NodeStats
from broker.replication.history import LedgerHistory
from broker.replication.instruments import ReplicationMetrics
from log.api import LedgerListStore, LedgerStore
from snapshot.store import SnapshotStore


@dataclass(slots=True)
class RoleContext:
    config: NodeConfig
    ledgers: LedgerStore
    ledger_list: LedgerListStore
    snapshots: SnapshotStore
    clock: NodeClock
    stats: NodeStats
    applier: Applier
    history: LedgerHistory
    election: Election
    # Injected by ``observe_node`` after the node is made (so not frozen): replication
    # imports no metrics (docs/DESIGN.md §9).
    metrics: ReplicationMetrics
    # The node's stop() began: no more writes.
    closing: Callable[[], bool]
    # The node's answer to a write it cannot take now (its reason, from its current role).
    unavailable_error: Callable[[], BrokerUnavailableError]
