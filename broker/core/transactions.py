"""The state machine's transactions: begin, commit, rollback and expiry (docs/DESIGN.md §2).

A transaction's tasks are PENDING until its commit; a rolled back or expired one's tasks
never existed. A transaction answers only to its own tenant.
"""

from __future__ import annotations

from broker.core import entries as e
from broker.core.books import Books
from broker.core.indexes import TimerKind
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


def begin(books: Books, entry: e.BeginTransaction) -> TransactionRef | Rejected:
    if entry.transaction_id <= books.max_transaction_id:
        return Rejected(
            ErrorCode.INVALID, f"transaction id {entry.transaction_id} was already used"
        )
    books.max_transaction_id = entry.transaction_id
    if not NAME_RE.match(entry.tenant):
        return Rejected(ErrorCode.INVALID, "tenant name is not valid")
    if entry.ttl_ms <= 0:
        return Rejected(ErrorCode.INVALID, "ttl_ms must be > 0")
    books.tenant(entry.tenant)
    txn = Transaction(
        id=entry.transaction_id,
        tenant=entry.tenant,
        created_ms=books.now_ms,
        expires_ms=books.now_ms + entry.ttl_ms,
    )
    books.transactions[txn.id] = txn
    books.push_timer(txn.expires_ms, TimerKind.TXN_EXPIRE, txn.id)
    return TransactionRef(txn.id, txn.tenant, txn.expires_ms)


def open_transaction(books: Books, txn_id: int, tenant: str | None) -> Transaction | None:
    """The open transaction ``txn_id`` as ``tenant`` sees it (None: any tenant's):
    another tenant's answers as one that is not open, so its existence is not shown."""
    txn = books.transactions.get(txn_id)
    if txn is None or (tenant is not None and txn.tenant != tenant):
        return None
    return txn


def commit(books: Books, entry: e.CommitTransaction) -> TransactionDone | Rejected:
    txn = open_transaction(books, entry.transaction_id, entry.tenant)
    if txn is None:
        return Rejected(ErrorCode.NOT_FOUND, f"transaction {entry.transaction_id} is not open")
    del books.transactions[txn.id]
    committed: list[int] = []
    for task_id in txn.task_ids:
        task = books.tasks.get(task_id)
        if task is None or task.state != TaskState.PENDING:
            continue
        task.transaction = None
        if task.start_after_ms is not None and task.start_after_ms > books.now_ms:
            books.move(task, TaskState.DELAYED)
            books.push_timer(task.start_after_ms, TimerKind.START, task.id)
        else:
            books.move(task, TaskState.WAITING)
        committed.append(task_id)
    return TransactionDone(txn.id, "committed", tuple(committed))


def rollback(books: Books, entry: e.RollbackTransaction) -> TransactionDone | Rejected:
    txn = open_transaction(books, entry.transaction_id, entry.tenant)
    if txn is None:
        return Rejected(ErrorCode.NOT_FOUND, f"transaction {entry.transaction_id} is not open")
    dropped = drop_transaction(books, txn)
    return TransactionDone(txn.id, "rolled_back", tuple(dropped))


def drop_transaction(books: Books, txn: Transaction) -> list[int]:
    # A rolled back (or expired) transaction's tasks never existed.
    del books.transactions[txn.id]
    dropped: list[int] = []
    for task_id in txn.task_ids:
        task = books.tasks.get(task_id)
        if task is not None and task.state == TaskState.PENDING:
            books.delete_task(task)
            dropped.append(task_id)
    return dropped
