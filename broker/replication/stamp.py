"""What the leader chooses for an entry before it is logged: its time and ids
(docs/DESIGN.md §4, the write path)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class IdCounters:
    """A leader term's next task and transaction ids (from the state when it opened)."""

    next_task_id: int = 1
    next_transaction_id: int = 1


class Stamp:
    """Time and ids for one entry: ``build(stamp)`` turns a request into the entry."""

    __slots__ = ("_ids", "now_ms")

    def __init__(self, ids: IdCounters, now_ms: int) -> None:
        self._ids = ids
        self.now_ms = now_ms

    def task_ids(self, count: int) -> range:
        first = self._ids.next_task_id
        self._ids.next_task_id += count
        return range(first, first + count)

    def transaction_id(self) -> int:
        ident = self._ids.next_transaction_id
        self._ids.next_transaction_id += 1
        return ident
