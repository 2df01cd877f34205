"""Attach a node's observers: its metrics and the task log (docs/DESIGN.md §9).

Replication imports nothing from here: a :class:`~broker.replication.node.Node` reports to
the instruments it is given and calls the listeners registered on it. :func:`observe_node`
is the one place that gives it this broker's :class:`BrokerMetrics` and registers the
leader's consumers of applied entries (the task counters, the task log). Call it wherever a
node is built to serve (the servers, the test and bench harnesses).
"""

from __future__ import annotations

from broker.core import entries as e
from broker.core.effects import Applied
from broker.observability.metrics import BrokerMetrics
from broker.observability.task_log import log_applied
from broker.replication.node import Node


def observe_node(node: Node) -> BrokerMetrics:
    """Create the node's metrics, bind them to its state, role and position, inject them,
    and count and log each entry this node applies as the leader that wrote it."""
    metrics = BrokerMetrics()
    metrics.bind(lambda: node.state, lambda: str(node.role), lambda: node.position)
    node.metrics = metrics
    observe_applied = metrics.observe_applied

    def count_applied(entry: e.Entry, applied: Applied) -> None:
        observe_applied(entry, applied, node.state)

    def log_task_events(entry: e.Entry, applied: Applied) -> None:
        log_applied(entry, applied, node.state)

    node.leader_listeners += [count_applied, log_task_events]
    return metrics
