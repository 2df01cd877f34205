"""The state machine's transactions: begin, commit, rollback and expiry (docs/DESIGN.md §2).

A transaction's tasks are PENDING until its commit; a rolled back or expired one's tasks
never existed. A transaction answers only to its own tenant.
"""

from __future__ import annotations

from broker.core import entries as e
from broker.core.machine_base import MachineBase, _Timer
from broker.core.records import (
    ErrorCode,
    Rejected,
    Transaction,
    TransactionDone,
    TransactionRef,
)
from broker.core.transitions import TaskState
from broker.core.validation import (
    NAME_RE,
)


class TransactionsMixin(MachineBase):
    """The BeginTransaction, CommitTransaction and RollbackTransaction entries."""

    def _begin(self, entry: e.BeginTransaction) -> TransactionRef | Rejected:
        if entry.transaction_id <= self.max_transaction_id:
            return Rejected(
                ErrorCode.INVALID, f"transaction id {entry.transaction_id} was already used"
            )
        self.max_transaction_id = entry.transaction_id
        if not NAME_RE.match(entry.tenant):
            return Rejected(ErrorCode.INVALID, "tenant name is not valid")
        if entry.ttl_ms <= 0:
            return Rejected(ErrorCode.INVALID, "ttl_ms must be > 0")
        self._tenant(entry.tenant)
        txn = Transaction(
            id=entry.transaction_id,
            tenant=entry.tenant,
            created_ms=self.now_ms,
            expires_ms=self.now_ms + entry.ttl_ms,
        )
        self.transactions[txn.id] = txn
        self._push_timer(txn.expires_ms, _Timer.TXN_EXPIRE, txn.id)
        return TransactionRef(txn.id, txn.tenant, txn.expires_ms)

    def _open_transaction(self, txn_id: int, tenant: str | None) -> Transaction | None:
        """The open transaction ``txn_id`` as ``tenant`` sees it (None: any tenant's):
        another tenant's answers as one that is not open, so its existence is not shown."""
        txn = self.transactions.get(txn_id)
        if txn is None or (tenant is not None and txn.tenant != tenant):
            return None
        return txn

    def _commit(self, entry: e.CommitTransaction) -> TransactionDone | Rejected:
        txn = self._open_transaction(entry.transaction_id, entry.tenant)
        if txn is None:
            return Rejected(ErrorCode.NOT_FOUND, f"transaction {entry.transaction_id} is not open")
        del self.transactions[txn.id]
        committed: list[int] = []
        for task_id in txn.task_ids:
            task = self.tasks.get(task_id)
            if task is None or task.state != TaskState.PENDING:
                continue
            task.transaction = None
            if task.start_after_ms is not None and task.start_after_ms > self.now_ms:
                self._move(task, TaskState.DELAYED)
                self._push_timer(task.start_after_ms, _Timer.START, task.id)
            else:
                self._move(task, TaskState.WAITING)
            committed.append(task_id)
        return TransactionDone(txn.id, "committed", tuple(committed))

    def _rollback(self, entry: e.RollbackTransaction) -> TransactionDone | Rejected:
        txn = self._open_transaction(entry.transaction_id, entry.tenant)
        if txn is None:
            return Rejected(ErrorCode.NOT_FOUND, f"transaction {entry.transaction_id} is not open")
        dropped = self._drop_transaction(txn)
        return TransactionDone(txn.id, "rolled_back", tuple(dropped))

    def _drop_transaction(self, txn: Transaction) -> list[int]:
        # A rolled back (or expired) transaction's tasks never existed.
        del self.transactions[txn.id]
        dropped: list[int] = []
        for task_id in txn.task_ids:
            task = self.tasks.get(task_id)
            if task is not None and task.state == TaskState.PENDING:
                self._delete_task(task)
                dropped.append(task_id)
        return dropped
