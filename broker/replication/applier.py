"""The one hand that moves the node's state and position (docs/DESIGN.md §4).

Every change of the replicated state goes through :class:`Applier`: an entry the leader
wrote, once durable (and confirmed); an entry replay or the follower read from the log
(docs/DESIGN.md §2); a Confirm marker, which moves only the position; a snapshot, which
replaces both (§5). The node and its roles read ``applier.state`` and ``applier.position``
and never assign them (a test holds it). The listeners hear of every applied entry from
here, the leader listeners (metrics, the task log) of the entries the leader wrote.
"""

from __future__ import annotations

from broker.core import ApplyResult, StateMachine
from broker.core import entries as e
from broker.core.effects import Applied
from broker.replication.common import ApplyListener, NewerFormatError, logger
from log.api import LedgerEntry


class Applier:
    def __init__(self) -> None:
        self.state = StateMachine()
        self.position: tuple[int, int] = (-1, -1)  # (ledger id, entry id) last applied
        self.last_logged_time_ms = 0  # leader's stamp of the last entry read from the log
        # Called after every applied entry (leader, follower, replay) with its effects;
        # a listener reads what it needs from them (e.g. ``applied.trees_ended``).
        self.listeners: list[ApplyListener] = []
        # Called, before ``listeners``, only for the entries this leader wrote and applied
        # (once per acknowledged write; never for a follower or a replay): the task
        # counters and the task log (broker.observability's ``observe_node`` adds them).
        self.leader_listeners: list[ApplyListener] = []

    def apply_written(self, entry: e.Entry, position: tuple[int, int]) -> ApplyResult:
        """Apply one entry this leader wrote, now durable (and confirmed)."""
        self.state.position = position  # the webhook outboxes' keys
        applied = self.state.apply(entry)
        self.position = position
        for leader_listener in self.leader_listeners:
            leader_listener(entry, applied)  # as the counters were: a failure is not hidden
        self._notify(entry, applied)
        return applied.result

    def pass_marker(self, position: tuple[int, int]) -> None:
        """A Confirm marker this leader wrote is durable: nothing to apply, the position
        moves past it."""
        self.position = position

    def apply_logged(self, ledger_entry: LedgerEntry) -> None:
        """Apply one entry read from the log (replay, follower)."""
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
            self.position = position
            return
        self.state.position = position
        applied = self.state.apply(record)
        self.position = position
        self._notify(record, applied)

    def install(self, state: StateMachine, position: tuple[int, int]) -> None:
        """Replace the state with a snapshot's, taken at ``position`` (docs/DESIGN.md §5)."""
        self.state = state
        self.position = position

    def _notify(self, entry: e.Entry, applied: Applied) -> None:
        for listener in self.listeners:
            try:
                listener(entry, applied)
            except Exception:
                logger.exception("apply listener failed")
