r"""The broker's replication node: one state machine on the write-ahead log, in one role.

A :class:`Node` holds what every role shares (the applier with the state and its position,
the stores, the one clock, listeners, injected instruments, local snapshots) and delegates the
rest to the object of its current role (docs/DESIGN.md §4): a
:class:`~broker.replication.leader.Leader` (take-over, the write path with group commit, ledger
rolls, retention) or a :class:`~broker.replication.follower.Follower` (tail the ledgers, apply
what the leader confirmed). A role change swaps that object.

One hand writes the state: only the :class:`~broker.replication.applier.Applier` moves
``state`` and ``position`` (an applied entry, a Confirm marker, an installed snapshot); the
node shows them read-only. The roles and parts get a
:class:`~broker.replication.context.RoleContext` (stores, history, applier, clock, config,
metrics), never the node; only this module imports the role modules, so the package has no
import circle.

Boot: newest valid local snapshot, then every ledger after its position; a ledger left open
by a dead writer is recovered (fenced, truncated to its valid prefix, marked closed with
compare-and-set) before a new one is opened.

A standalone node recovers and leads at once (:meth:`Node.start`). In a cluster a node
boots (:meth:`Node.boot`), then *follows* (:meth:`Node.follow`). When elected it *takes
over* (:meth:`Node.recover_log` then :meth:`Node.open_for_writes`); when deposed it
:meth:`Node.step_down`\ s and follows again from where it is.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from broker.core import ApplyResult, StateMachine
from broker.core import entries as e
from broker.replication.applier import Applier
from broker.replication.clock import NodeClock, wall_clock_ms
from broker.replication.common import (
    READ_CHUNK_ENTRIES,
    VERSION,
    ApplyListener,
    BrokerStartupError,
    BrokerUnavailableError,
    Election,
    HistoryGapError,
    LeadershipLostError,
    NodeConfig,
    NodeStats,
    Role,
    cancel_all,
    logger,
)
from broker.replication.context import RoleContext
from broker.replication.follower import Follower
from broker.replication.history import LedgerHistory
from broker.replication.instruments import NoReplicationMetrics, ReplicationMetrics
from broker.replication.leader import Leader
from broker.replication.snapshots import Snapshots
from broker.replication.stamp import Stamp
from log.api import LedgerListStore, LedgerStore
from log.private_fs import FILE_MODE, make_private_dirs
from snapshot.store import SnapshotStore

__all__ = [
    "READ_CHUNK_ENTRIES",
    "VERSION",
    "ApplyListener",
    "BrokerStartupError",
    "BrokerUnavailableError",
    "DataDirLock",
    "HistoryGapError",
    "LeadershipLostError",
    "Node",
    "NodeConfig",
    "NodeStats",
    "Role",
    "Stamp",
    "SubmitPlacer",
    "wall_clock_ms",
]


class SubmitPlacer(Protocol):
    """Places the tasks of a submit entry being built on free worker slots, so the entry
    carries their assignments (docs/DESIGN.md §6); the worker link is one while it leads."""

    def place(self, tasks: Sequence[e.TaskSpec], now_ms: int) -> tuple[e.Assignment, ...]:
        """Assignments for the first tasks (none if any task of any tenant waits)."""
        ...

    def release(self, assignments: tuple[e.Assignment, ...]) -> None:
        """The entry was applied or will never be: stop counting these as in flight."""
        ...


class Node:
    def __init__(
        self,
        config: NodeConfig,
        *,
        ledgers: LedgerStore,
        ledger_list: LedgerListStore,
        snapshots: SnapshotStore,
        clock_ms: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self.config = config
        self.ledgers = ledgers
        self.ledger_list = ledger_list
        self.snapshots = snapshots
        self.clock = NodeClock(clock_ms)  # every time read of the node and its roles
        self.stats = NodeStats(started_ms=self.clock.now_ms())
        # The one writer of the state and its position (read them as ``node.state``,
        # ``node.position``).
        self.applier = Applier()
        # Called after every applied entry (leader, follower, replay), and before them only
        # for the entries this leader wrote: the applier's lists (common.ApplyListener).
        self.listeners: list[ApplyListener] = self.applier.listeners
        self.leader_listeners: list[ApplyListener] = self.applier.leader_listeners
        # Cluster mode: the elector's hooks (set through leadership_check, on_deposed).
        self._election = Election()
        self.closing = False  # stop() began: no more writes
        # While a worker link leads: puts assignments into submit entries as they are built.
        self.placer: SubmitPlacer | None = None
        self.history = LedgerHistory(
            config=config,
            ledgers=ledgers,
            ledger_list=ledger_list,
            snapshots=snapshots,
            applier=self.applier,
            clock=self.clock,
            election=self._election,
        )
        # What the roles and parts are given of the node.
        self._context = RoleContext(
            config=config,
            ledgers=ledgers,
            ledger_list=ledger_list,
            snapshots=snapshots,
            clock=self.clock,
            stats=self.stats,
            applier=self.applier,
            history=self.history,
            election=self._election,
            metrics=NoReplicationMetrics(),
            closing=lambda: self.closing,
            unavailable_error=self.unavailable_error,
        )
        self.local_snapshots = Snapshots(self._context, after_take=self._retain_after_snapshot)
        self._duty: Leader | Follower | None = None  # the current role's object
        self._background: list[asyncio.Task[None]] = []  # all roles: periodic snapshots

    # --- what the applier and the server set -------------------------------------------

    @property
    def state(self) -> StateMachine:
        """The replicated state (read-only here: only the applier moves it)."""
        return self.applier.state

    @property
    def position(self) -> tuple[int, int]:
        """(ledger id, entry id) of the last entry applied (or passed: a Confirm marker)."""
        return self.applier.position

    @property
    def leadership_check(self) -> Callable[[], bool] | None:
        """Cluster mode: the elector's synchronous "am I the leader right now" (connected
        and lowest in the queue). None: standalone, durable entries are applied at once."""
        return self._election.leadership_check

    @leadership_check.setter
    def leadership_check(self, check: Callable[[], bool] | None) -> None:
        self._election.leadership_check = check

    @property
    def on_deposed(self) -> Callable[[str], None] | None:
        """Called (on the loop) when this leader finds it was deposed; the owner steps down."""
        return self._election.on_deposed

    @on_deposed.setter
    def on_deposed(self, callback: Callable[[str], None] | None) -> None:
        self._election.on_deposed = callback

    @property
    def metrics(self) -> ReplicationMetrics:
        """Replication's instruments (injected by ``observe_node``; by default they drop
        everything): docs/DESIGN.md §9, replication imports no metrics."""
        return self._context.metrics

    @metrics.setter
    def metrics(self, metrics: ReplicationMetrics) -> None:
        self._context.metrics = metrics

    # --- the current role -------------------------------------------------------------

    @property
    def clock_ms(self) -> Callable[[], int]:
        return self.clock.now_ms

    @property
    def role(self) -> Role:
        return self._duty.role if self._duty is not None else Role.IDLE

    @property
    def is_leader(self) -> bool:
        """Acting as leader or taking over (the current role object is a Leader)."""
        return isinstance(self._duty, Leader)

    @property
    def leader(self) -> Leader | None:
        """The current leader term's object (None when not leading)."""
        return self._duty if isinstance(self._duty, Leader) else None

    @property
    def failure(self) -> BaseException | None:
        return self._duty.failure if self._duty is not None else None

    @property
    def deposed_reason(self) -> str | None:
        """Why this leader stopped taking writes (None while it may take them)."""
        return self._duty.deposed if self._duty is not None else None

    @property
    def writable(self) -> bool:
        return self._duty is not None and self._duty.writable

    # --- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Standalone: boot, recover the log and lead at once."""
        await self.boot()
        leader = self._duty = Leader(self._context, Role.STANDALONE)
        await leader.recover_log()
        await self.open_for_writes()

    async def boot(self) -> None:
        """Load the newest usable local snapshot and start the periodic snapshots."""
        await self.load_snapshot()
        self.local_snapshots.entries_at_snapshot = self.state.entries_applied
        self._background = [
            asyncio.create_task(self.local_snapshots.loop(), name="steward-snapshots"),
        ]

    async def recover_log(self) -> None:
        """Take-over, step 2: replay every ledger after our position, fencing and
        recovering a ledger left open (by a dead or deposed leader)."""
        leader = self._duty
        if not isinstance(leader, Leader) or leader.role != Role.STANDALONE:
            leader = self._duty = Leader(self._context, Role.CANDIDATE)
        else:
            leader.deposed = None
            leader.failure = None
        await leader.recover_log()

    async def open_for_writes(self) -> None:
        """Take-over, step 4: open our own ledger, CAS it into the list, accept writes."""
        leader = self._duty
        assert isinstance(leader, Leader), "open_for_writes before recover_log"
        await leader.open_for_writes()
        self.closing = False

    async def follow(self) -> None:
        """Apply what the leader confirms, until cancelled.

        Raises :class:`HistoryGapError` when the ledgers after our position are gone
        (download a snapshot, :meth:`load_snapshot`, and follow again).
        """
        follower = self._duty
        if not isinstance(follower, Follower):
            follower = self._duty = Follower(self._context, deposed=self.deposed_reason)
        await follower.run()

    async def stop(self, *, snapshot: bool = True, drain_timeout_s: float = 10.0) -> None:
        """Refuse new writes, finish in-flight ones, close the ledger, snapshot."""
        self.closing = True
        duty = self._duty
        if duty is not None:
            await duty.drain(drain_timeout_s)
        await cancel_all(self._background)
        if duty is not None:
            await duty.close_ledger()
        if (
            snapshot
            and self.failure is None
            and self.position != self.local_snapshots.snapshot_position
        ):
            await self.take_snapshot()

    async def step_down(self, reason: str) -> None:
        """Stop acting as leader at once: fail what is in flight with a retryable error,
        abandon the ledger (the next leader recovers it). The node can follow again."""
        leader = self._duty
        if not isinstance(leader, Leader) or leader.role not in (Role.LEADER, Role.CANDIDATE):
            return
        logger.warning("broker %s steps down: %s", self.config.broker_id, reason)
        deposed = reason if leader.deposed is None else leader.deposed
        self._duty = Follower(self._context, deposed=deposed)
        await leader.step_down(reason)

    def depose(self, reason: str) -> None:
        """This leader lost its leadership (the elector says so, or a fenced append)."""
        if self._duty is not None:
            self._duty.depose(reason)

    # --- snapshots --------------------------------------------------------------------

    async def load_snapshot(self) -> bool:
        """Replace the state with the newest usable local snapshot (False: none)."""
        return await self.local_snapshots.load()

    async def take_snapshot(self) -> None:
        await self.local_snapshots.take()

    async def _retain_after_snapshot(self) -> None:
        leader = self.leader
        if leader is not None and not self.closing and self.writable:
            await leader.retain_after_snapshot()

    # --- write path -------------------------------------------------------------------

    async def propose(self, build: Callable[[Stamp], e.Entry]) -> ApplyResult:
        """Log the entry ``build`` makes, apply it once durable, return apply's result."""
        leader = self.leader
        if leader is None:
            raise self.unavailable_error()
        return await leader.propose(build)

    def unavailable_error(self) -> BrokerUnavailableError:
        if self.role in (Role.FOLLOWER, Role.CANDIDATE) or self.deposed_reason is not None:
            return LeadershipLostError(self.unavailable_reason())
        return BrokerUnavailableError(self.unavailable_reason())

    def unavailable_reason(self) -> str:
        """Why this broker takes no writes now: the message of its 503s and of ``/healthz``."""
        if self.failure is not None:
            return f"the broker's log failed ({self.failure}); restart it"
        if self.closing:
            return "the broker is shutting down"
        if self.deposed_reason is not None:
            return f"this broker is no longer the leader ({self.deposed_reason})"
        if self.role == Role.FOLLOWER:
            return "this broker is not the leader"
        if self.role == Role.CANDIDATE:
            return "this broker is taking over as leader; retry shortly"
        return "the broker is not ready"


class DataDirLock:
    """One standalone broker per data dir: an exclusive flock held while it runs."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "broker.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        make_private_dirs(self.path.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise BrokerStartupError(
                f"data dir {self.path.parent} is in use by another broker (pid {holder})"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
