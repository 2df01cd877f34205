"""The ledger list and the history in it: compare-and-set edits, the gap check, replay
(docs/DESIGN.md §3). Shared by the leader (recovery, rolls, retention) and the follower."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import replace

from broker.replication.applier import Applier
from broker.replication.clock import NodeClock
from broker.replication.common import (
    READ_CHUNK_ENTRIES,
    BrokerStartupError,
    Election,
    HistoryGapError,
    LeadershipLostError,
    NodeConfig,
    logger,
    with_ledger_closed,
    with_ledger_state,
)
from log.api import (
    BadVersionError,
    LedgerError,
    LedgerInfo,
    LedgerList,
    LedgerListStore,
    LedgerReader,
    LedgerState,
    LedgerStore,
    LedgerWriter,
)
from snapshot.store import SnapshotStore


def check_continues(ledger_list: LedgerList, position: tuple[int, int]) -> None:
    """Raise :class:`HistoryGapError` unless the listed ledgers continue a state at
    ``position`` (the history after it, or from the start when there is no state)."""
    ids = [info.ledger_id for info in ledger_list.ledgers]
    position_ledger = position[0]
    if position_ledger >= 0 and position_ledger not in ids:
        raise HistoryGapError(
            f"this broker's state is at ledger {position_ledger}, which is no longer "
            f"in the ledger list {ids}: the history after it is gone",
            needed_position=(ids[0], -1) if ids else None,
        )
    first = ledger_list.first_ledger_id
    if position_ledger < 0 and ids and first is not None and ids[0] != first:
        # Retention deleted the start of the history: replaying what is left would
        # silently build a state that lacks everything before ledger ids[0].
        raise HistoryGapError(
            f"no usable snapshot, and the ledgers from {first} to before {ids[0]} were "
            "deleted by retention: the history cannot be replayed from its start; "
            "restore a snapshot into the snapshots directory",
            needed_position=(ids[0], -1),
        )


class LedgerHistory:
    def __init__(
        self,
        *,
        config: NodeConfig,
        ledgers: LedgerStore,
        ledger_list: LedgerListStore,
        snapshots: SnapshotStore,
        applier: Applier,
        clock: NodeClock,
        election: Election,
    ) -> None:
        self._config = config
        self._ledgers = ledgers
        self._ledger_list = ledger_list
        self._snapshots = snapshots
        self._applier = applier  # replay applies through it
        self._clock = clock
        self._election = election
        self.list_version = -1  # the ledger list version this node last read or wrote
        # Ledger list updates are read-modify-CAS sequences: a roll and retention must
        # not interleave theirs (the loser would fail the node).
        self.lock = asyncio.Lock()

    async def read_list(self) -> LedgerList:
        """Read the list and remember its version (a take-over's starting point)."""
        async with self.lock:
            ledger_list, self.list_version = await self._ledger_list.get()
        return ledger_list

    async def update(self, change: Callable[[LedgerList], LedgerList]) -> None:
        in_cluster = self._election.leadership_check is not None
        async with self.lock:
            current, version = await self._ledger_list.get()
            if version != self.list_version:
                message = (
                    f"the ledger list changed behind this broker (version {version}, "
                    f"expected {self.list_version}): another broker is writing this history"
                )
                if in_cluster:
                    raise LeadershipLostError(message)
                # Standalone: one broker owns the data dir (flock), so the list was
                # changed behind our back: stop rather than overwrite it.
                raise BrokerStartupError(message)
            try:
                self.list_version = await self._ledger_list.compare_and_set(
                    change(current), version
                )
            except BadVersionError as exc:
                if in_cluster:
                    raise LeadershipLostError(str(exc)) from exc
                raise

    def check(self, ledger_list: LedgerList) -> None:
        """The listed ledgers continue this node's state (else :class:`HistoryGapError`)."""
        check_continues(ledger_list, self._applier.position)

    async def replay_ledger(self, info: LedgerInfo) -> None:
        ledgers = self._ledgers
        if info.state == LedgerState.CLOSED:
            reader = await ledgers.open_ledger(info.ledger_id, recovery=False)
            last_entry_id = info.last_entry_id if info.last_entry_id is not None else -1
        else:
            # Left open by a writer that died (or is deposed): mark it closing, fence it
            # and fix its end, then record that end.
            if info.state == LedgerState.OPEN:
                await self.update(
                    lambda ll: with_ledger_state(ll, info.ledger_id, LedgerState.CLOSING)
                )
            reader = await ledgers.open_ledger(info.ledger_id, recovery=True)
            last_entry_id = reader.last_entry_id if reader.last_entry_id is not None else -1
            logger.info("recovered ledger %d: last entry %d", info.ledger_id, last_entry_id)
            await self.update(lambda ll: with_ledger_closed(ll, info.ledger_id, last_entry_id))
        try:
            await self.read_to(reader, last_entry_id)
        finally:
            await reader.close()

    async def read_to(
        self,
        reader: LedgerReader,
        last_entry_id: int,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        """Apply the entries after our position up to ``last_entry_id`` (all committed)."""
        applier = self._applier
        ledger_id = reader.ledger_id
        next_id = applier.position[1] + 1 if applier.position[0] == ledger_id else 0
        while next_id <= last_entry_id:
            count = min(READ_CHUNK_ENTRIES, last_entry_id - next_id + 1)
            batch = await reader.read(next_id, count)
            if not batch:
                raise BrokerStartupError(
                    f"ledger {ledger_id} ends at entry {next_id - 1} but the ledger "
                    f"list says it holds entries up to {last_entry_id}"
                )
            for ledger_entry in batch:
                applier.apply_logged(ledger_entry)
            next_id = batch[-1].entry_id + 1
            if on_progress is not None:
                on_progress(0)

    async def open_ledger(self) -> tuple[LedgerWriter, int]:
        """A leader's new ledger, CAS'd into the list as open: (its writer, created ms)."""
        writer = await self._ledgers.create_ledger()
        created_ms = self._clock.now_ms()

        def add(ledger_list: LedgerList) -> LedgerList:
            first = ledger_list.first_ledger_id
            return replace(
                ledger_list,
                ledgers=(
                    *ledger_list.ledgers,
                    LedgerInfo(writer.ledger_id, created_ms, LedgerState.OPEN),
                ),
                first_ledger_id=writer.ledger_id if first is None else first,
                writer=self._config.broker_id,
            )

        try:
            await self.update(add)
        except BaseException:
            with contextlib.suppress(LedgerError):
                await writer.close()
            raise
        if self._election.leadership_check is not None and not self._ledgers.can_fence:
            # Entries carry as LAC only what this leader confirmed in ZooKeeper, so the
            # late appends of a deposed leader never make followers apply anything beyond
            # the history the next leader recovers. A fencing backend makes those appends
            # fail instead, and keeps the plain durable LAC (followers see entries one
            # ZooKeeper round trip sooner).
            writer.confirm(-1)
        return writer, created_ms

    async def apply_retention(self) -> None:
        """Delete the closed ledgers no kept snapshot needs, once past the retention."""
        snapshots = await asyncio.to_thread(self._snapshots.list)
        if not snapshots:
            return
        # Keep every ledger some kept snapshot may still need to replay from.
        oldest_needed = min(info.header.ledger_id for info in snapshots)
        horizon_ms = self._clock.now_ms() - self._config.ledger_retention_ms
        ledger_list, _ = await self._ledger_list.get()
        # A prefix of the list only: leaders' clocks differ, so a ledger may look younger
        # than the next one; deleting around it would leave a hole in the history that a
        # replica at a position in it would replay straight over (check passes).
        expired: list[int] = []
        for info in ledger_list.ledgers:
            if not (
                info.state == LedgerState.CLOSED
                and info.ledger_id < oldest_needed
                and info.created_ms < horizon_ms
            ):
                break
            expired.append(info.ledger_id)
        if not expired:
            return
        await self.update(
            lambda ll: replace(
                ll, ledgers=tuple(i for i in ll.ledgers if i.ledger_id not in expired)
            )
        )
        for ledger_id in expired:
            await self._ledgers.delete_ledger(ledger_id)
        logger.info("retention deleted ledgers %s", expired)
