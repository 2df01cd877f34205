"""The follower (docs/DESIGN.md §4): tail the ledgers in the list and apply only what the
leader confirmed (last-add-confirmed carried by the entries, or the ledger's closed length)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from broker.replication.common import READ_CHUNK_ENTRIES, Role
from log.api import LedgerEntry, LedgerState

if TYPE_CHECKING:
    from broker.replication.node import Node


class Follower:
    """A node that follows: from boot (or step-down) until it takes over. Takes no writes."""

    role = Role.FOLLOWER
    writable = False
    failure: BaseException | None = None

    def __init__(self, node: Node, *, deposed: str | None = None) -> None:
        self._node = node
        # Why the leader this node was stopped taking writes (kept for its 503s).
        self.deposed = deposed

    def depose(self, reason: str) -> None:
        """Nothing to give up: this node does not lead."""

    async def drain(self, timeout_s: float) -> None:
        """Nothing in flight: a follower takes no writes."""

    async def close_ledger(self) -> None:
        """No ledger of its own to close."""

    async def run(self) -> None:
        """Apply what the leader confirms, until cancelled (see :meth:`Node.follow`)."""
        node = self._node
        poll_s = node.config.follower_list_poll_s
        done_through = -1  # highest closed ledger fully applied
        while True:
            ledger_list, _ = await node.ledger_list.get()
            node.history.check(ledger_list)
            tailed = False
            for info in ledger_list.ledgers:
                if info.ledger_id < node.position[0] or info.ledger_id <= done_through:
                    continue
                if info.state == LedgerState.CLOSED:
                    last = info.last_entry_id if info.last_entry_id is not None else -1
                    reader = await node.ledgers.open_ledger(info.ledger_id, recovery=False)
                    try:
                        await node.history.read_to(reader, last, self._note_progress)
                    finally:
                        await reader.close()
                    done_through = info.ledger_id
                else:
                    await self._tail(info.ledger_id)
                    tailed = True
                    break
            if not tailed:
                await asyncio.sleep(poll_s)

    def _note_progress(self, pending_entries: int) -> None:
        node = self._node
        # Wall clocks of leader and follower: fine on one host or with NTP.
        lag_ms = max(0, node.clock.now_ms() - node.applier.last_logged_time_ms)
        node.metrics.follower_lag_seconds.set(lag_ms / 1000)
        node.metrics.follower_lag_entries.set(pending_entries)

    async def _tail(self, ledger_id: int) -> None:
        """Follow one open ledger until the list says it is closed (or it is gone)."""
        node = self._node
        clock = node.clock
        poll_s = node.config.follower_list_poll_s
        reader = await node.ledgers.open_ledger(ledger_id, recovery=False)
        try:
            pending: list[LedgerEntry] = []  # read, not yet confirmed
            confirmed = -1  # highest LAC seen
            next_id = node.position[1] + 1 if node.position[0] == ledger_id else 0
            list_checked_at = clock.monotonic_s()
            while True:
                batch = await reader.read(next_id, READ_CHUNK_ENTRIES)
                for ledger_entry in batch:
                    confirmed = max(confirmed, ledger_entry.last_add_confirmed)
                    pending.append(ledger_entry)
                if batch:
                    next_id = batch[-1].entry_id + 1
                applied = 0
                while applied < len(pending) and pending[applied].entry_id <= confirmed:
                    node.applier.apply_logged(pending[applied])
                    applied += 1
                del pending[:applied]
                if applied or batch:
                    self._note_progress(len(pending))
                if not batch:
                    await reader.wait_for_entries(next_id - 1, poll_s)
                if clock.monotonic_s() - list_checked_at < poll_s:
                    continue
                list_checked_at = clock.monotonic_s()
                ledger_list, _ = await node.ledger_list.get()
                info = next((i for i in ledger_list.ledgers if i.ledger_id == ledger_id), None)
                if info is None:
                    return  # deleted: the caller re-reads the list (and finds the gap)
                if info.state == LedgerState.CLOSED:
                    # Everything up to the closed length is committed, the rest never was.
                    last = info.last_entry_id if info.last_entry_id is not None else -1
                    for ledger_entry in pending:
                        if ledger_entry.entry_id <= last:
                            node.applier.apply_logged(ledger_entry)
                    await node.history.read_to(reader, last, self._note_progress)
                    return
        finally:
            await reader.close()
