r"""The broker's replication core: boot, the write path, ledger rolling, snapshots.

Write path (docs/DESIGN.md §2): the caller's ``build(stamp)`` turns a request into an
entry with leader-chosen ids and time; the entry is appended to the open
ledger (group commit in the backend); when it is durable it is applied, in
log order, and only then is the caller answered. Nothing is applied before it
is durable and nothing is acknowledged before it is applied.

Boot: newest valid local snapshot, then every ledger after its position; a
ledger left open by a dead writer is recovered (fenced, truncated to its valid
prefix, marked closed with compare-and-set) before a new one is opened.

Roles (docs/DESIGN.md §4). A standalone node recovers and leads at once (:meth:`Node.start`).
In a cluster a node boots (:meth:`Node.boot`), then *follows*: it tails the ledgers in
the list and applies only what the leader confirmed (last-add-confirmed carried by the
entries, or the ledger's closed length). When elected it *takes over*
(:meth:`Node.recover_log` then :meth:`Node.open_for_writes`); when deposed it
:meth:`Node.step_down`\ s and follows again from where it is. In cluster mode
(``leadership_check`` set) every durable group commit is confirmed against ZooKeeper
(elector connected and lowest in the queue, ledger list version unchanged since this
leader last wrote it) before it is applied and answered, so a deposed leader never
acknowledges a write.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import fcntl
import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Final

import msgspec

from broker.core import entries as e
from broker.core.effects import Applied
from broker.core.state import ApplyResult, StateMachine
from broker.observability.metrics import BrokerMetrics
from broker.observability.task_log import log_applied
from log.api import (
    BadVersionError,
    LedgerEntry,
    LedgerError,
    LedgerInfo,
    LedgerList,
    LedgerListStore,
    LedgerReader,
    LedgerState,
    LedgerStore,
    LedgerWriter,
)
from log.private_fs import FILE_MODE, make_private_dirs
from snapshot.store import SnapshotStore

logger = logging.getLogger(__name__)

VERSION: Final = "0.1.0"
READ_CHUNK_ENTRIES: Final = 2_000


class BrokerUnavailableError(Exception):
    """The broker cannot take writes now; the request may be retried (HTTP 503)."""


class BrokerStartupError(Exception):
    """The broker cannot start (data dir in use, history missing...); a clear message."""


class HistoryGapError(BrokerStartupError):
    """The local state cannot be continued from the log: the ledgers after it are gone.

    A cluster broker answers it by downloading a newer snapshot from a peer."""


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


class Stamp:
    """What the leader chooses for one entry before it is logged: time and ids."""

    __slots__ = ("_node", "now_ms")

    def __init__(self, node: Node, now_ms: int) -> None:
        self._node = node
        self.now_ms = now_ms

    def task_ids(self, count: int) -> range:
        first = self._node._next_task_id
        self._node._next_task_id += count
        return range(first, first + count)

    def transaction_id(self) -> int:
        ident = self._node._next_transaction_id
        self._node._next_transaction_id += 1
        return ident


ApplyListener = Callable[[e.Entry, Applied], None]
"""Called after each entry the leader applies: (entry, its result and effects as values,
broker.core.effects). Must not block; runs on the event loop."""


@dataclass(slots=True)
class _InFlight:
    entry: e.Record
    ledger_id: int
    durable: asyncio.Future[int]
    answer: asyncio.Future[ApplyResult]


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class NodeStats:
    started_ms: int = field(default_factory=wall_clock_ms)
    entries_appended: int = 0
    snapshots_taken: int = 0
    ledgers_rolled: int = 0
    last_snapshot_ms: int | None = None


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
        self.clock_ms = clock_ms
        self.state = StateMachine()
        self.position: tuple[int, int] = (-1, -1)  # (ledger id, entry id) last applied
        self.stats = NodeStats()
        self.role = Role.IDLE
        # Cluster mode: the elector's synchronous "am I the leader right now" (connected and
        # lowest in the queue). None: standalone, durable entries are applied at once.
        self.leadership_check: Callable[[], bool] | None = None
        # Called (on the loop) when this leader finds it was deposed; the owner steps down.
        self.on_deposed: Callable[[str], None] | None = None
        self._writer: LedgerWriter | None = None
        self._writer_created_ms = 0
        self._list_version = -1
        self._inflight: collections.deque[_InFlight] = collections.deque()
        self._gate: asyncio.Event | None = None  # set while rolling: proposals wait
        self._failure: BaseException | None = None
        self._deposed: str | None = None
        self._closing = False
        self._next_task_id = 1
        self._next_transaction_id = 1
        self._last_time_ms = 0
        self._entries_at_snapshot = 0
        self._snapshot_position: tuple[int, int] = (-1, -1)
        self._background: list[asyncio.Task[None]] = []  # all roles
        self._leader_tasks: list[asyncio.Task[None]] = []  # acting leader only
        self._roll_task: asyncio.Task[None] | None = None
        self._snapshot_lock = asyncio.Lock()
        # Ledger list updates are read-modify-CAS sequences: a roll and retention must
        # not interleave theirs (the loser would fail the node).
        self._ledger_list_lock = asyncio.Lock()
        self._durable_ready = asyncio.Event()  # cluster mode: a durable batch to confirm
        self._last_real_position: tuple[int, int] = (-1, -1)  # last non-marker entry applied
        self._marked_position: tuple[int, int] = (-1, -1)  # covered by a Confirm marker
        self._last_append_loop_time = 0.0
        self.listeners: list[ApplyListener] = []
        self.metrics = BrokerMetrics()
        self.metrics.bind(lambda: self.state, lambda: str(self.role), lambda: self.position)
        self._durable_in_batch = 0  # durable callbacks since the batch-size flush
        self._last_logged_time_ms = 0  # leader's stamp of the last entry read from the log
        # Called with the roots whose task tree ended (completed, or failed for good)
        # after each applied entry that ended some; must not block either.
        self.tree_listeners: list[Callable[[list[int]], None]] = []

    # --- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Standalone: boot, recover the log and lead at once."""
        await self.boot()
        self.role = Role.STANDALONE
        await self._recover_and_open()

    async def boot(self) -> None:
        """Load the newest usable local snapshot and start the periodic snapshots."""
        await self.load_snapshot()
        self._entries_at_snapshot = self.state.entries_applied
        self._background = [
            asyncio.create_task(self._snapshot_loop(), name="steward-snapshots"),
        ]

    async def _recover_and_open(self) -> None:
        await self.recover_log()
        await self.open_for_writes()

    async def recover_log(self) -> None:
        """Take-over, step 2: replay every ledger after our position, fencing and
        recovering a ledger left open (by a dead or deposed leader)."""
        if self.role != Role.STANDALONE:
            self.role = Role.CANDIDATE
        self._deposed = None
        self._failure = None
        async with self._ledger_list_lock:
            ledger_list, self._list_version = await self.ledger_list.get()
        self._check_history(ledger_list)
        for info in ledger_list.ledgers:
            if info.ledger_id < self.position[0]:
                continue
            await self._replay_ledger(info)
        logger.info(
            "replayed the log up to %s (%d entries applied)",
            self.position,
            self.state.entries_applied,
        )

    async def open_for_writes(self) -> None:
        """Take-over, step 4: open our own ledger, CAS it into the list, accept writes."""
        await self._open_new_ledger()
        self._next_task_id = self.state.max_task_id + 1
        self._next_transaction_id = self.state.max_transaction_id + 1
        self._last_time_ms = self.state.now_ms
        self._closing = False
        self._leader_tasks = [asyncio.create_task(self._timer_loop(), name="steward-timers")]
        self.metrics.follower_lag_seconds.set(0)
        self.metrics.follower_lag_entries.set(0)
        if self.leadership_check is not None:
            self._leader_tasks += [
                asyncio.create_task(self._confirm_loop(), name="steward-confirm"),
                asyncio.create_task(self._marker_loop(), name="steward-lac-marker"),
            ]
            self.role = Role.LEADER
        logger.info(
            "broker %s leads at position %s with %d tasks",
            self.config.broker_id,
            self.position,
            len(self.state.tasks),
        )

    async def stop(self, *, snapshot: bool = True, drain_timeout_s: float = 10.0) -> None:
        """Refuse new writes, finish in-flight ones, close the ledger, snapshot."""
        self._closing = True
        if self._roll_task is not None:
            # Let a roll finish its ledger-list update rather than cut it in half.
            await asyncio.wait([self._roll_task], timeout=drain_timeout_s)
        if self._inflight:
            pending = [item.answer for item in self._inflight]
            await asyncio.wait(pending, timeout=drain_timeout_s)
        await _cancel_all(self._leader_tasks)
        await _cancel_all(self._background)
        writer, self._writer = self._writer, None
        if writer is not None and self._failure is None and self._deposed is None:
            try:
                last_entry_id = await writer.close()
                await self._update_ledger_list(
                    lambda ll: _with_ledger_closed(ll, writer.ledger_id, last_entry_id)
                )
            except (LedgerError, BrokerUnavailableError):
                logger.exception("could not close ledger %d cleanly", writer.ledger_id)
        if snapshot and self._failure is None and self.position != self._snapshot_position:
            await self.take_snapshot()

    async def step_down(self, reason: str) -> None:
        """Stop acting as leader at once: fail what is in flight with a retryable error,
        abandon the ledger (the next leader recovers it). The node can follow again."""
        if self.role not in (Role.LEADER, Role.CANDIDATE):
            return
        logger.warning("broker %s steps down: %s", self.config.broker_id, reason)
        self.role = Role.FOLLOWER
        if self._deposed is None:
            self._deposed = reason
        self._fail_inflight(LeadershipLostError(f"this broker stopped leading: {reason}"))
        if self._roll_task is not None:
            self._roll_task.cancel()
        await _cancel_all(self._leader_tasks)
        if self._roll_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._roll_task
            self._roll_task = None
        writer, self._writer = self._writer, None
        if writer is not None:
            # Pending appends may still land (the new leader's recovery then includes
            # them) or fail as fenced; nobody was told they succeeded.
            with contextlib.suppress(LedgerError, TimeoutError):
                async with asyncio.timeout(5):
                    await writer.close()
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.set()

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    @property
    def deposed_reason(self) -> str | None:
        """Why this leader stopped taking writes (None while it may take them)."""
        return self._deposed

    @property
    def writable(self) -> bool:
        return (
            self.role in (Role.STANDALONE, Role.LEADER)
            # Mid-roll there is briefly no writer: proposals wait at the gate for the
            # next one, so the leader still takes writes (no 503 on every roll).
            and (self._writer is not None or self._gate is not None)
            and self._failure is None
            and self._deposed is None
            and not self._closing
        )

    # --- boot ---------------------------------------------------------------------------

    async def load_snapshot(self) -> bool:
        """Replace the state with the newest usable local snapshot (False: none)."""
        # A snapshot whose verified body this build cannot decode is skipped too.
        loaded = await asyncio.to_thread(
            self.snapshots.load_newest_decoded, StateMachine.from_snapshot
        )
        if loaded is None:
            return False
        header, state = loaded
        if (header.ledger_id, header.entry_id) <= self.position:
            return False  # not newer than what we have
        self.state = state
        self.position = (header.ledger_id, header.entry_id)
        self._snapshot_position = self.position
        self._entries_at_snapshot = self.state.entries_applied
        logger.info("loaded snapshot at position %s", self.position)
        return True

    def _check_history(self, ledger_list: LedgerList) -> None:
        ids = [info.ledger_id for info in ledger_list.ledgers]
        position_ledger = self.position[0]
        if position_ledger >= 0 and position_ledger not in ids:
            raise HistoryGapError(
                f"this broker's state is at ledger {position_ledger}, which is no longer "
                f"in the ledger list {ids}: the history after it is gone"
            )
        first = ledger_list.first_ledger_id
        if position_ledger < 0 and ids and first is not None and ids[0] != first:
            # Retention deleted the start of the history: replaying what is left would
            # silently build a state that lacks everything before ledger ids[0].
            raise HistoryGapError(
                f"no usable snapshot, and the ledgers from {first} to before {ids[0]} were "
                "deleted by retention: the history cannot be replayed from its start; "
                "restore a snapshot into the snapshots directory"
            )

    async def _replay_ledger(self, info: LedgerInfo) -> None:
        if info.state == LedgerState.CLOSED:
            reader = await self.ledgers.open_ledger(info.ledger_id, recovery=False)
            last_entry_id = info.last_entry_id if info.last_entry_id is not None else -1
        else:
            # Left open by a writer that died (or is deposed): mark it closing, fence it
            # and fix its end, then record that end.
            if info.state == LedgerState.OPEN:
                await self._update_ledger_list(
                    lambda ll: _with_ledger_state(ll, info.ledger_id, LedgerState.CLOSING)
                )
            reader = await self.ledgers.open_ledger(info.ledger_id, recovery=True)
            last_entry_id = reader.last_entry_id if reader.last_entry_id is not None else -1
            logger.info("recovered ledger %d: last entry %d", info.ledger_id, last_entry_id)
            await self._update_ledger_list(
                lambda ll: _with_ledger_closed(ll, info.ledger_id, last_entry_id)
            )
        try:
            await self._read_to(reader, last_entry_id)
        finally:
            await reader.close()

    async def _read_to(self, reader: LedgerReader, last_entry_id: int) -> None:
        """Apply the entries after our position up to ``last_entry_id`` (all committed)."""
        ledger_id = reader.ledger_id
        next_id = self.position[1] + 1 if self.position[0] == ledger_id else 0
        while next_id <= last_entry_id:
            count = min(READ_CHUNK_ENTRIES, last_entry_id - next_id + 1)
            batch = await reader.read(next_id, count)
            if not batch:
                raise BrokerStartupError(
                    f"ledger {ledger_id} ends at entry {next_id - 1} but the ledger "
                    f"list says it holds entries up to {last_entry_id}"
                )
            for ledger_entry in batch:
                self._apply_logged(ledger_entry)
            next_id = batch[-1].entry_id + 1
            self._note_follower_progress(0)
        if self.position[0] != ledger_id and last_entry_id < 0:
            return
        if self.position < (ledger_id, last_entry_id):
            self.position = (ledger_id, last_entry_id)

    def _apply_logged(self, ledger_entry: LedgerEntry) -> None:
        """Apply one entry read from the log (replay, follower)."""
        record = e.decode_record(ledger_entry.data)
        position = (ledger_entry.ledger_id, ledger_entry.entry_id)
        self._last_logged_time_ms = record.time_ms
        if isinstance(record, e.Confirm):
            self.position = position
            return
        applied = self.state.apply(record)
        self.position = position
        self._notify(record, applied)

    def _notify(self, entry: e.Entry, applied: Applied) -> None:
        for listener in self.listeners:
            try:
                listener(entry, applied)
            except Exception:
                logger.exception("apply listener failed")
        ended = applied.trees_ended
        if ended:
            for tree_listener in self.tree_listeners:
                try:
                    tree_listener(ended)
                except Exception:
                    logger.exception("tree listener failed")

    async def _open_new_ledger(self) -> None:
        writer = await self.ledgers.create_ledger()
        created_ms = self.clock_ms()

        def add(ledger_list: LedgerList) -> LedgerList:
            first = ledger_list.first_ledger_id
            return replace(
                ledger_list,
                ledgers=(
                    *ledger_list.ledgers,
                    LedgerInfo(writer.ledger_id, created_ms, LedgerState.OPEN),
                ),
                first_ledger_id=writer.ledger_id if first is None else first,
                writer=self.config.broker_id,
            )

        try:
            await self._update_ledger_list(add)
        except BaseException:
            with contextlib.suppress(LedgerError):
                await writer.close()
            raise
        if self.leadership_check is not None and not self.ledgers.can_fence:
            # Entries carry as LAC only what this leader confirmed in ZooKeeper, so the
            # late appends of a deposed leader never make followers apply anything beyond
            # the history the next leader recovers. A fencing backend makes those appends
            # fail instead, and keeps the plain durable LAC (followers see entries one
            # ZooKeeper round trip sooner).
            writer.confirm(-1)
        self._writer = writer
        self._writer_created_ms = created_ms

    async def _update_ledger_list(self, change: Callable[[LedgerList], LedgerList]) -> None:
        async with self._ledger_list_lock:
            current, version = await self.ledger_list.get()
            if version != self._list_version:
                message = (
                    f"the ledger list changed behind this broker (version {version}, "
                    f"expected {self._list_version}): another broker is writing this history"
                )
                if self.leadership_check is not None:
                    raise LeadershipLostError(message)
                # Standalone: one broker owns the data dir (flock), so the list was
                # changed behind our back: stop rather than overwrite it.
                raise BrokerStartupError(message)
            try:
                self._list_version = await self.ledger_list.compare_and_set(
                    change(current), version
                )
            except BadVersionError as exc:
                if self.leadership_check is not None:
                    raise LeadershipLostError(str(exc)) from exc
                raise

    # --- follower -----------------------------------------------------------------------

    async def follow(self) -> None:
        """Apply what the leader confirms, until cancelled.

        Raises :class:`HistoryGapError` when the ledgers after our position are gone
        (download a snapshot, :meth:`load_snapshot`, and follow again).
        """
        self.role = Role.FOLLOWER
        poll_s = self.config.follower_list_poll_s
        done_through = -1  # highest closed ledger fully applied
        while True:
            ledger_list, _ = await self.ledger_list.get()
            self._check_history(ledger_list)
            tailed = False
            for info in ledger_list.ledgers:
                if info.ledger_id < self.position[0] or info.ledger_id <= done_through:
                    continue
                if info.state == LedgerState.CLOSED:
                    last = info.last_entry_id if info.last_entry_id is not None else -1
                    reader = await self.ledgers.open_ledger(info.ledger_id, recovery=False)
                    try:
                        await self._read_to(reader, last)
                    finally:
                        await reader.close()
                    done_through = info.ledger_id
                else:
                    await self._tail(info.ledger_id)
                    tailed = True
                    break
            if not tailed:
                await asyncio.sleep(poll_s)

    def _note_follower_progress(self, pending_entries: int) -> None:
        if self.role != Role.FOLLOWER:
            return
        # Wall clocks of leader and follower: fine on one host or with NTP.
        lag_ms = max(0, wall_clock_ms() - self._last_logged_time_ms)
        self.metrics.follower_lag_seconds.set(lag_ms / 1000)
        self.metrics.follower_lag_entries.set(pending_entries)

    async def _tail(self, ledger_id: int) -> None:
        """Follow one open ledger until the list says it is closed (or it is gone)."""
        loop = asyncio.get_running_loop()
        poll_s = self.config.follower_list_poll_s
        reader = await self.ledgers.open_ledger(ledger_id, recovery=False)
        try:
            pending: list[LedgerEntry] = []  # read, not yet confirmed
            confirmed = -1  # highest LAC seen
            next_id = self.position[1] + 1 if self.position[0] == ledger_id else 0
            list_checked_at = loop.time()
            while True:
                batch = await reader.read(next_id, READ_CHUNK_ENTRIES)
                for ledger_entry in batch:
                    confirmed = max(confirmed, ledger_entry.last_add_confirmed)
                    pending.append(ledger_entry)
                if batch:
                    next_id = batch[-1].entry_id + 1
                applied = 0
                while applied < len(pending) and pending[applied].entry_id <= confirmed:
                    self._apply_logged(pending[applied])
                    applied += 1
                del pending[:applied]
                if applied or batch:
                    self._note_follower_progress(len(pending))
                if not batch:
                    await reader.wait_for_entries(next_id - 1, poll_s)
                if loop.time() - list_checked_at < poll_s:
                    continue
                list_checked_at = loop.time()
                ledger_list, _ = await self.ledger_list.get()
                info = next((i for i in ledger_list.ledgers if i.ledger_id == ledger_id), None)
                if info is None:
                    return  # deleted: the caller re-reads the list (and finds the gap)
                if info.state == LedgerState.CLOSED:
                    # Everything up to the closed length is committed, the rest never was.
                    last = info.last_entry_id if info.last_entry_id is not None else -1
                    for ledger_entry in pending:
                        if ledger_entry.entry_id <= last:
                            self._apply_logged(ledger_entry)
                    await self._read_to(reader, last)
                    return
        finally:
            await reader.close()

    # --- write path -------------------------------------------------------------------------

    async def propose(self, build: Callable[[Stamp], e.Entry]) -> ApplyResult:
        """Log the entry ``build`` makes, apply it once durable, return apply's result."""
        while self._gate is not None and not self._closing:
            await self._gate.wait()
        if not self.writable:
            raise self._unavailable_error()
        # No await between stamping and append: ids and time reach the log in order.
        now_ms = max(self.clock_ms(), self._last_time_ms)
        self._last_time_ms = now_ms
        answer = self._append(e.encode_entry(build(Stamp(self, now_ms))))
        result: ApplyResult = await answer
        return result

    def _append(self, data: bytes) -> asyncio.Future[ApplyResult]:
        writer = self._writer
        assert writer is not None
        # Apply what followers and replay will read, not the original object
        # (an int where the log carries a float would make the digests differ).
        entry = e.decode_record(data)
        durable = writer.append(data)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[ApplyResult] = loop.create_future()
        self._inflight.append(_InFlight(entry, writer.ledger_id, durable, answer))
        now = loop.time()
        durable.add_done_callback(functools.partial(self._on_durable, now))
        self.stats.entries_appended += 1
        self._last_append_loop_time = now
        return answer

    def _unavailable_error(self) -> BrokerUnavailableError:
        if self.role in (Role.FOLLOWER, Role.CANDIDATE) or self._deposed is not None:
            return LeadershipLostError(self._unavailable_reason())
        return BrokerUnavailableError(self._unavailable_reason())

    def _unavailable_reason(self) -> str:
        if self._failure is not None:
            return f"the broker's log failed ({self._failure}); restart it"
        if self._closing:
            return "the broker is shutting down"
        if self._deposed is not None:
            return f"this broker is no longer the leader ({self._deposed})"
        if self.role == Role.FOLLOWER:
            return "this broker is not the leader"
        if self.role == Role.CANDIDATE:
            return "this broker is taking over as leader; retry shortly"
        return "the broker is not ready"

    def _on_durable(self, appended_at: float, durable: asyncio.Future[int]) -> None:
        if not durable.cancelled() and durable.exception() is None:
            # (exception() also marks a failure retrieved: it is read through _inflight,
            # or dropped once deposed, so no "never retrieved" noise.)
            loop = asyncio.get_running_loop()
            self.metrics.append_latency.observe(loop.time() - appended_at)
            self._durable_in_batch += 1
            if self._durable_in_batch == 1:
                # A group commit resolves its futures together, so their callbacks are
                # queued back to back: this one runs after the last of them.
                loop.call_soon(self._flush_batch_size)
        if self.leadership_check is None:
            self._apply_durable_head(len(self._inflight))
        else:
            self._durable_ready.set()

    def _flush_batch_size(self) -> None:
        self.metrics.observe_batch(self._durable_in_batch)
        self._durable_in_batch = 0

    def _apply_durable_head(self, limit: int) -> None:
        # Futures resolve in entry order; apply the durable entries at the head.
        inflight = self._inflight
        while limit > 0 and inflight and inflight[0].durable.done():
            limit -= 1
            item = inflight.popleft()
            failure = item.durable.exception()
            if failure is not None:
                self._fail(failure, item)
                return
            position = (item.ledger_id, item.durable.result())
            entry = item.entry
            if isinstance(entry, e.Confirm):
                self.position = position
                if not item.answer.done():
                    item.answer.set_result(None)
                continue
            applied = self.state.apply(entry)
            self.position = self._last_real_position = position
            self.metrics.observe_applied(entry, applied, self.state)
            log_applied(entry, applied, self.state)
            self._notify(entry, applied)
            if not item.answer.done():
                item.answer.set_result(_detached(applied.result))
        self._maybe_roll()

    async def _confirm_loop(self) -> None:
        """Cluster mode: apply durable batches only after ZooKeeper confirms we lead."""
        while True:
            await self._durable_ready.wait()
            self._durable_ready.clear()
            count = 0
            for item in self._inflight:
                if not item.durable.done():
                    break
                count += 1
            if count == 0:
                continue
            # Also when an append of the batch failed: the durable entries before it are
            # applied and answered, so they need the confirmation too (a fenced append
            # means another leader already took over).
            reason = await self._leadership_lost_reason()
            if reason is not None:
                self._depose(reason)
                return
            self._apply_durable_head(count)
            writer = self._writer
            if (
                writer is not None
                and not self.ledgers.can_fence
                and self.position[0] == writer.ledger_id
            ):
                writer.confirm(self.position[1])
            if self._inflight and self._inflight[0].durable.done():
                self._durable_ready.set()

    async def _leadership_lost_reason(self) -> str | None:
        check = self.leadership_check
        if check is not None and not check():
            return "lost the election or the ZooKeeper connection"
        try:
            async with self._ledger_list_lock:
                version = await self.ledger_list.confirmed_version()
        except LedgerError as exc:
            return f"cannot confirm leadership in ZooKeeper: {exc}"
        if version != self._list_version:
            return (
                f"the ledger list changed to version {version} (this leader wrote "
                f"{self._list_version}): another broker took over"
            )
        return None

    def _depose(self, reason: str) -> None:
        if self._deposed is not None:
            return
        logger.error("broker %s was deposed: %s", self.config.broker_id, reason)
        self._deposed = reason
        self._fail_inflight(LeadershipLostError(f"this broker is no longer the leader: {reason}"))
        if self.on_deposed is not None:
            self.on_deposed(reason)

    def _fail(self, failure: BaseException, first: _InFlight) -> None:
        # After a failed append nothing later may be applied: the log may have a hole.
        if self.leadership_check is not None:
            # In a cluster a failed append means fenced (another leader) or a broken
            # store: give the leadership up; a new leader recovers the ledger.
            self._inflight.appendleft(first)
            self._depose(f"ledger append failed: {failure}")
            return
        if self._failure is None:
            logger.critical("ledger append failed, refusing writes: %s", failure)
            self._failure = failure
        self._inflight.appendleft(first)
        self._fail_inflight(BrokerUnavailableError(self._unavailable_reason()))

    def _fail_inflight(self, error: BrokerUnavailableError) -> None:
        for item in self._inflight:
            if not item.answer.done():
                item.answer.set_exception(error)
                # Nobody may await it (markers): keep asyncio from logging it.
                item.answer.exception()
        self._inflight.clear()

    async def _marker_loop(self) -> None:
        """Write a Confirm marker once the log is idle, so followers catch up fully."""
        loop = asyncio.get_running_loop()
        idle_s = self.config.confirm_idle_ms / 1000
        while True:
            await asyncio.sleep(idle_s)
            if (
                self._inflight
                or self._gate is not None
                or not self.writable
                or self._last_real_position == self._marked_position
                or loop.time() - self._last_append_loop_time < idle_s
            ):
                continue
            self._marked_position = self._last_real_position
            now_ms = max(self.clock_ms(), self._last_time_ms)
            self._append(e.encode_entry(e.Confirm(time_ms=now_ms)))

    def _maybe_roll(self) -> None:
        writer = self._writer
        if (
            writer is None
            or self._gate is not None
            or self._closing
            or self._failure
            or self._deposed is not None
        ):
            return
        too_big = writer.size_bytes >= self.config.ledger_roll_bytes
        too_old = self.clock_ms() - self._writer_created_ms >= self.config.ledger_roll_age_ms
        if too_big or too_old:
            self._gate = asyncio.Event()
            self._roll_task = asyncio.create_task(self._roll(writer), name="steward-roll")

    async def _roll(self, old: LedgerWriter) -> None:
        gate = self._gate
        try:
            last_entry_id = await old.close()
            await self._update_ledger_list(
                lambda ll: _with_ledger_closed(ll, old.ledger_id, last_entry_id)
            )
            self._writer = None
            await self._open_new_ledger()
            self.stats.ledgers_rolled += 1
            logger.info("rolled from ledger %d to %d", old.ledger_id, self._writer_id())
        except LeadershipLostError as exc:
            self._depose(str(exc))
        except (LedgerError, BrokerStartupError) as exc:
            if self.leadership_check is not None:
                self._depose(f"ledger roll failed: {exc}")
            elif self._failure is None:
                logger.critical("ledger roll failed, refusing writes: %s", exc)
                self._failure = exc
        finally:
            self._roll_task = None
            if self._gate is gate:
                self._gate = None
            if gate is not None:
                gate.set()

    def _writer_id(self) -> int:
        return self._writer.ledger_id if self._writer is not None else -1

    # --- timers -----------------------------------------------------------------------

    async def _timer_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.timer_poll_interval_s)
            due_ms = self.state.next_timer_ms()
            if due_ms is None or due_ms > self.clock_ms() or self._inflight:
                continue
            with contextlib.suppress(BrokerUnavailableError):
                await self.propose(lambda stamp: e.Tick(time_ms=stamp.now_ms))

    # --- snapshots and retention ---------------------------------------------------------

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.snapshot_interval_s)
            new_entries = self.state.entries_applied - self._entries_at_snapshot
            if new_entries >= self.config.snapshot_min_entries:
                try:
                    await self.take_snapshot()
                except Exception:
                    logger.exception("periodic snapshot failed")

    async def take_snapshot(self) -> None:
        async with self._snapshot_lock:
            # Encoding runs on the loop so the state cannot change under it; the
            # compression, hashing and fsync run in a thread.
            started = time.perf_counter()
            body = self.state.encode_snapshot()
            ledger_id, entry_id = self.position
            entries_applied = self.state.entries_applied
            created_ms = self.clock_ms()

            def write() -> int | None:
                info = self.snapshots.write(
                    cluster_id=self.config.cluster_id,
                    ledger_id=ledger_id,
                    entry_id=entry_id,
                    created_ms=created_ms,
                    digest=hashlib.sha256(body).hexdigest(),
                    body=body,
                )
                try:
                    return info.path.stat().st_size
                except FileNotFoundError:
                    return None  # pruned at once (older than the kept ones)

            size_bytes = await asyncio.to_thread(write)
            self.metrics.snapshot_duration.observe(time.perf_counter() - started)
            self.metrics.snapshot_body.set(len(body))
            if size_bytes is not None:
                self.metrics.snapshot_size.set(size_bytes)
            self._entries_at_snapshot = entries_applied
            self._snapshot_position = (ledger_id, entry_id)
            self.stats.snapshots_taken += 1
            self.stats.last_snapshot_ms = self.clock_ms()
            if not self._closing and self.writable:
                try:
                    await self._apply_retention()
                except LeadershipLostError as exc:
                    self._depose(str(exc))
                except Exception as exc:
                    # The snapshot is written; retention runs again after the next one
                    # (e.g. ZooKeeper unreachable for a moment: not worth a traceback).
                    logger.warning(
                        "ledger retention skipped: %s: %s", type(exc).__name__, exc or "no detail"
                    )

    async def _apply_retention(self) -> None:
        snapshots = await asyncio.to_thread(self.snapshots.list)
        if not snapshots:
            return
        # Keep every ledger some kept snapshot may still need to replay from.
        oldest_needed = min(info.header.ledger_id for info in snapshots)
        horizon_ms = self.clock_ms() - self.config.ledger_retention_ms
        ledger_list, _ = await self.ledger_list.get()
        # A prefix of the list only: leaders' clocks differ, so a ledger may look younger
        # than the next one; deleting around it would leave a hole in the history that a
        # replica at a position in it would replay straight over (_check_history passes).
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
        await self._update_ledger_list(
            lambda ll: replace(
                ll, ledgers=tuple(i for i in ll.ledgers if i.ledger_id not in expired)
            )
        )
        for ledger_id in expired:
            await self.ledgers.delete_ledger(ledger_id)
        logger.info("retention deleted ledgers %s", expired)


def _detached(result: ApplyResult) -> ApplyResult:
    """A result the caller can read later: apply may return a live state object (a
    Tenant), which the rest of the batch, applied before the caller resumes, changes."""
    if isinstance(result, msgspec.Struct) and not result.__struct_config__.frozen:
        return copy.copy(result)
    return result


async def _cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    tasks.clear()


def _with_ledger_state(ledger_list: LedgerList, ledger_id: int, state: LedgerState) -> LedgerList:
    return replace(
        ledger_list,
        ledgers=tuple(
            replace(info, state=state) if info.ledger_id == ledger_id else info
            for info in ledger_list.ledgers
        ),
    )


def _with_ledger_closed(ledger_list: LedgerList, ledger_id: int, last_entry_id: int) -> LedgerList:
    return replace(
        ledger_list,
        ledgers=tuple(
            replace(info, state=LedgerState.CLOSED, last_entry_id=last_entry_id)
            if info.ledger_id == ledger_id
            else info
            for info in ledger_list.ledgers
        ),
    )


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
