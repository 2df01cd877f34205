"""What every part of the replication core shares: errors, roles, configuration, stats, the
election's hooks and the ledger list edits (docs/DESIGN.md §3, §4)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Final

from broker.core import entries as e
from broker.core.effects import Applied
from log.api import LedgerList, LedgerState

# One logger for all of the node's parts (operators and tests filter on this name).
logger = logging.getLogger("broker.replication.node")

VERSION: Final = "0.1.0"
READ_CHUNK_ENTRIES: Final = 2_000


class BrokerUnavailableError(Exception):
    """The broker cannot take writes now; the request may be retried (HTTP 503)."""


class BrokerStartupError(Exception):
    """The broker cannot start (data dir in use, history missing...); a clear message."""


class HistoryGapError(BrokerStartupError):
    """The local state cannot be continued from the log: the ledgers after it are gone.

    A cluster broker answers it by downloading a newer snapshot from a peer, one at
    ``needed_position`` or later (the first ledger still listed): a snapshot older than
    that leaves the same gap."""

    def __init__(self, message: str, needed_position: tuple[int, int] | None = None) -> None:
        super().__init__(message)
        self.needed_position = needed_position


class NewerFormatError(BrokerStartupError):
    """The log or a local snapshot was written by a newer release (docs/OPERATIONS.md,
    "Rolling upgrade"): this broker stops rather than skip what it cannot read, which
    would fork its state from the others'."""


class LeadershipLostError(BrokerUnavailableError):
    """This node stopped being the acting leader (deposed, fenced, or lost ZooKeeper)."""


class Role(StrEnum):
    IDLE = "idle"  # not booted yet
    STANDALONE = "standalone"
    FOLLOWER = "follower"
    CANDIDATE = "candidate"  # elected, taking over: recovering the log
    LEADER = "leader"


@dataclass(frozen=True)
class NodeConfig:
    data_dir: Path
    broker_id: str = "standalone"
    cluster_id: str = "standalone"
    ledger_roll_bytes: int = 64 * 1024 * 1024
    ledger_roll_age_ms: int = 3600 * 1000
    ledger_retention_ms: int = 48 * 3600 * 1000
    snapshot_interval_s: float = 60.0
    snapshot_min_entries: int = 1  # take a periodic snapshot only when this many are new
    snapshot_keep: int = 3
    timer_poll_interval_s: float = 0.05
    # Cluster mode: the leader writes a Confirm marker after the log was idle this long,
    # so followers can apply the last entries (their LAC travels in later entries).
    confirm_idle_ms: int = 5
    # How often a follower re-reads the ledger list while tailing (a closed or new ledger).
    follower_list_poll_s: float = 0.05


@dataclass
class NodeStats:
    started_ms: int
    entries_appended: int = 0
    snapshots_taken: int = 0
    ledgers_rolled: int = 0
    last_snapshot_ms: int | None = None


@dataclass(slots=True)
class Election:
    """Cluster mode's hooks into the elector, set by the server before the node follows
    (both None: standalone, where durable entries are applied at once)."""

    # The elector's synchronous "am I the leader right now" (connected and lowest in the
    # queue).
    leadership_check: Callable[[], bool] | None = None
    # Called (on the loop) when this leader finds it was deposed; the owner steps down.
    on_deposed: Callable[[str], None] | None = None


ApplyListener = Callable[[e.Entry, Applied], None]
"""Called after an applied entry: (entry, its result and effects as values,
broker.core.effects). ``Node.listeners`` hear of every applied entry, ``Node.leader_listeners``
of those the leader wrote (both lists are the applier's). Must not block; runs on the event
loop."""


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    tasks.clear()


def with_ledger_state(ledger_list: LedgerList, ledger_id: int, state: LedgerState) -> LedgerList:
    return replace(
        ledger_list,
        ledgers=tuple(
            replace(info, state=state) if info.ledger_id == ledger_id else info
            for info in ledger_list.ledgers
        ),
    )


def with_ledger_closed(ledger_list: LedgerList, ledger_id: int, last_entry_id: int) -> LedgerList:
    return replace(
        ledger_list,
        ledgers=tuple(
            replace(info, state=LedgerState.CLOSED, last_entry_id=last_entry_id)
            if info.ledger_id == ledger_id
            else info
            for info in ledger_list.ledgers
        ),
    )
