"""The follower (docs/DESIGN.md §4): tail the ledgers in the list and apply only what the
leader confirmed (last-add-confirmed carried by the entries, or the ledger's closed length)."""

from __future__ import annotations

import asyncio

from broker.replication.common import READ_CHUNK_ENTRIES, Role
from broker.replication.context import RoleContext
from log.api import LedgerEntry, LedgerState


class Follower:
    """A node that follows: from boot (or step-down) until it takes over. Takes no writes."""

    role = Role.FOLLOWER
    writable = False
    failure: BaseException | None = None

    def __init__(self, context: RoleContext, *, deposed: str | None = None) -> None:
        self._context = context
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
        context = self._context
        poll_s = context.config.follower_list_poll_s
        done_through = -1  # highest closed ledger fully applied
        while True:
            ledger_list, _ = await context.ledger_list.get()
            context.history.check(ledger_list)
            tailed = False
            for info in ledger_list.ledgers:
                position = context.applier.position
                if info.ledger_id < position[0] or info.ledger_id <= done_through:
                    continue
                if info.state == LedgerState.CLOSED:
                    last = info.last_entry_id if info.last_entry_id is not None else -1
                    reader = await context.ledgers.open_ledger(info.ledger_id, recovery=False)
                    try:
                        await context.history.read_to(reader, last, self._note_progress)
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
        context = self._context
        # Wall clocks of leader and follower: fine on one host or with NTP.
        lag_ms = max(0, context.clock.now_ms() - context.applier.last_logged_time_ms)
        context.metrics.follower_lag_seconds.set(lag_ms / 1000)
        context.metrics.follower_lag_entries.set(pending_entries)

    async def _tail(self, ledger_id: int) -> None:
        """Follow one open ledger until the list says it is closed (or it is gone)."""
        context = self._context
        applier = context.applier
        clock = context.clock
        poll_s = context.config.follower_list_poll_s
        reader = await context.ledgers.open_ledger(ledger_id, recovery=False)
        try:
            pending: list[LedgerEntry] = []  # read, not yet confirmed
            confirmed = -1  # highest LAC seen
            position = applier.position
            next_id = position[1] + 1 if position[0] == ledger_id else 0
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
                    applier.apply_logged(pending[applied])
                    applied += 1
                del pending[:applied]
                if applied or batch:
                    self._note_progress(len(pending))
                if not batch:
                    await reader.wait_for_entries(next_id - 1, poll_s)
                if clock.monotonic_s() - list_checked_at < poll_s:
                    continue
                list_checked_at = clock.monotonic_s()
                ledger_list, _ = await context.ledger_list.get()
                info = next((i for i in ledger_list.ledgers if i.ledger_id == ledger_id), None)
                if info is None:
                    return  # deleted: the caller re-reads the list (and finds the gap)
                if info.state == LedgerState.CLOSED:
                    # Everything up to the closed length is committed, the rest never was.
                    last = info.last_entry_id if info.last_entry_id is not None else -1
                    for ledger_entry in pending:
                        if ledger_entry.entry_id <= last:
                            applier.apply_logged(ledger_entry)
                    await context.history.read_to(reader, last, self._note_progress)
                    return
        finally:
            await reader.close()
