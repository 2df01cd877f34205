"""Apply committed entries and report their effects: the one place both roles do it.

The leader applies what it wrote once durable (and confirmed), replay and the follower what
they read from the log (docs/DESIGN.md §2, §4); the node's listeners hear of every applied
entry from here, its leader listeners (metrics, the task log) of the entries the leader wrote.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker.core import ApplyResult
from broker.core import entries as e
from broker.core.effects import Applied
from broker.replication.common import NewerFormatError, logger
from log.api import LedgerEntry

if TYPE_CHECKING:
    from broker.replication.node import Node


class Applier:
    def __init__(self, node: Node) -> None:
        self._node = node
        self.last_logged_time_ms = 0  # leader's stamp of the last entry read from the log

    def apply_written(self, entry: e.Entry, position: tuple[int, int]) -> ApplyResult:
        """Apply one entry this leader wrote, now durable (and confirmed)."""
        node = self._node
        node.state.position = position  # the webhook outboxes' keys
        applied = node.state.apply(entry)
        node.position = position
        for leader_listener in node.leader_listeners:
            leader_listener(entry, applied)  # as the counters were: a failure is not hidden
        self._notify(entry, applied)
        return applied.result

    def apply_logged(self, ledger_entry: LedgerEntry) -> None:
        """Apply one entry read from the log (replay, follower)."""
        node = self._node
        position = (ledger_entry.ledger_id, ledger_entry.entry_id)
        try:
            record = e.decode_record(ledger_entry.data)
        except e.NewerEntryFormatError as exc:
            raise NewerFormatError(
                f"the log entry at ledger {position[0]} entry {position[1]}: {exc} "
                "(written by a leader of a newer release)"
            ) from None
        self.last_logged_time_ms = record.time_ms
        if isinstance(record, e.Confirm):
            node.position = position
            return
        node.state.position = position
        applied = node.state.apply(record)
        node.position = position
        self._notify(record, applied)

    def _notify(self, entry: e.Entry, applied: Applied) -> None:
        node = self._node
        for listener in node.listeners:
            try:
                listener(entry, applied)
            except Exception:
                logger.exception("apply listener failed")
