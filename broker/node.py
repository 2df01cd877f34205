"""The broker's replication core: boot, the write path, ledger rolling, snapshots.

Write path (DESIGN §2): the caller's ``build(stamp)`` turns a request into an
entry with leader-chosen ids and time; the entry is appended to the open
ledger (group commit in the backend); when it is durable it is applied, in
log order, and only then is the caller answered. Nothing is applied before it
is durable and nothing is acknowledged before it is applied.

Boot: newest valid local snapshot, then every ledger after its position; a
ledger left open by a dead writer is recovered (fenced, truncated to its valid
prefix, marked closed with compare-and-set) before a new one is opened.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from broker import entries as e
from broker.state import ApplyResult, StateMachine, StopRunning
from log.api import (
    LedgerError,
    LedgerInfo,
    LedgerList,
    LedgerListStore,
    LedgerState,
    LedgerStore,
    LedgerWriter,
)
from snapshot.store import SnapshotStore

logger = logging.getLogger(__name__)

VERSION: Final = "0.1.0"
READ_CHUNK_ENTRIES: Final = 2_000


class BrokerUnavailableError(Exception):
    """The broker cannot take writes now; the request may be retried (HTTP 503)."""


class BrokerStartupError(Exception):
    """The broker cannot start (data dir in use, history missing...); a clear message."""


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


ApplyListener = Callable[[e.Entry, ApplyResult, list[int], list[StopRunning]], None]
"""Called after each entry the leader applies: (entry, result, tasks that became
final, running tasks to stop). Must not block; runs on the event loop."""


@dataclass(slots=True)
class _InFlight:
    entry: e.Entry
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
        self._writer: LedgerWriter | None = None
        self._writer_created_ms = 0
        self._list_version = -1
        self._inflight: collections.deque[_InFlight] = collections.deque()
        self._gate: asyncio.Event | None = None  # set while rolling: proposals wait
        self._failure: BaseException | None = None
        self._closing = False
        self._next_task_id = 1
        self._next_transaction_id = 1
        self._last_time_ms = 0
        self._entries_at_snapshot = 0
        self._snapshot_position: tuple[int, int] = (-1, -1)
        self._background: list[asyncio.Task[None]] = []
        self._roll_task: asyncio.Task[None] | None = None
        self._snapshot_lock = asyncio.Lock()
        # Ledger list updates are read-modify-CAS sequences: a roll and retention must
        # not interleave theirs (the loser would fail the node).
        self._ledger_list_lock = asyncio.Lock()
        self.listeners: list[ApplyListener] = []

    # --- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        await self._recover()
        self.state.collect_effects = True
        await self._open_new_ledger()
        self._next_task_id = self.state.max_task_id + 1
        self._next_transaction_id = self.state.max_transaction_id + 1
        self._last_time_ms = self.state.now_ms
        self._entries_at_snapshot = self.state.entries_applied
        self._background = [
            asyncio.create_task(self._timer_loop(), name="steward-timers"),
            asyncio.create_task(self._snapshot_loop(), name="steward-snapshots"),
        ]
        logger.info(
            "broker %s ready at position %s with %d tasks",
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
        for task in self._background:
            task.cancel()
        for task in self._background:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._background = []
        if self._inflight:
            pending = [item.answer for item in self._inflight]
            await asyncio.wait(pending, timeout=drain_timeout_s)
        writer, self._writer = self._writer, None
        if writer is not None and self._failure is None:
            try:
                last_entry_id = await writer.close()
                await self._update_ledger_list(
                    lambda ll: _with_ledger_closed(ll, writer.ledger_id, last_entry_id)
                )
            except LedgerError:
                logger.exception("could not close ledger %d cleanly", writer.ledger_id)
        if snapshot and self._failure is None and self.position != self._snapshot_position:
            await self.take_snapshot()

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    @property
    def writable(self) -> bool:
        return self._writer is not None and self._failure is None and not self._closing

    # --- boot ---------------------------------------------------------------------------

    async def _recover(self) -> None:
        # A snapshot whose verified body this build cannot decode is skipped too.
        loaded = await asyncio.to_thread(
            self.snapshots.load_newest_decoded, StateMachine.from_snapshot
        )
        if loaded is not None:
            header, self.state = loaded
            self.position = (header.ledger_id, header.entry_id)
            self._snapshot_position = self.position
            logger.info("loaded snapshot at position %s", self.position)
        ledger_list, self._list_version = await self.ledger_list.get()
        ids = [info.ledger_id for info in ledger_list.ledgers]
        snapshot_ledger = self.position[0]
        if snapshot_ledger >= 0 and snapshot_ledger not in ids:
            raise BrokerStartupError(
                f"the newest usable snapshot is at ledger {snapshot_ledger}, which is no longer "
                f"in the ledger list {ids}: the history after it is gone"
            )
        first = ledger_list.first_ledger_id
        if snapshot_ledger < 0 and ids and first is not None and ids[0] != first:
            # Retention deleted the start of the history: replaying what is left would
            # silently build a state that lacks everything before ledger ids[0].
            raise BrokerStartupError(
                f"no usable snapshot, and the ledgers from {first} to before {ids[0]} were "
                "deleted by retention: the history cannot be replayed from its start; "
                "restore a snapshot into the snapshots directory"
            )
        for info in ledger_list.ledgers:
            if info.ledger_id < snapshot_ledger:
                continue
            await self._replay_ledger(info)
        logger.info(
            "replayed the log up to %s (%d entries applied)",
            self.position,
            self.state.entries_applied,
        )

    async def _replay_ledger(self, info: LedgerInfo) -> None:
        if info.state == LedgerState.CLOSED:
            reader = await self.ledgers.open_ledger(info.ledger_id, recovery=False)
            last_entry_id = info.last_entry_id if info.last_entry_id is not None else -1
        else:
            # Left open by a writer that died (or is deposed): fence it and fix its end.
            reader = await self.ledgers.open_ledger(info.ledger_id, recovery=True)
            last_entry_id = reader.last_entry_id if reader.last_entry_id is not None else -1
            logger.info("recovered ledger %d: last entry %d", info.ledger_id, last_entry_id)
            await self._update_ledger_list(
                lambda ll: _with_ledger_closed(ll, info.ledger_id, last_entry_id)
            )
        try:
            next_id = self.position[1] + 1 if self.position[0] == info.ledger_id else 0
            while next_id <= last_entry_id:
                count = min(READ_CHUNK_ENTRIES, last_entry_id - next_id + 1)
                batch = await reader.read(next_id, count)
                if not batch:
                    raise BrokerStartupError(
                        f"ledger {info.ledger_id} ends at entry {next_id - 1} but the ledger "
                        f"list says it holds entries up to {last_entry_id}"
                    )
                for ledger_entry in batch:
                    self.state.apply(e.decode_entry(ledger_entry.data))
                    self.position = (info.ledger_id, ledger_entry.entry_id)
                next_id = batch[-1].entry_id + 1
        finally:
            await reader.close()

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

        await self._update_ledger_list(add)
        self._writer = writer
        self._writer_created_ms = created_ms

    async def _update_ledger_list(self, change: Callable[[LedgerList], LedgerList]) -> None:
        # Standalone: one broker owns the data dir (flock), so a failed CAS means
        # the list was changed behind our back: stop rather than overwrite it.
        async with self._ledger_list_lock:
            current, version = await self.ledger_list.get()
            if version != self._list_version:
                raise BrokerStartupError(
                    f"the ledger list changed behind this broker (version {version}, "
                    f"expected {self._list_version}): another broker is writing this history"
                )
            self._list_version = await self.ledger_list.compare_and_set(change(current), version)

    # --- write path -------------------------------------------------------------------------

    async def propose(self, build: Callable[[Stamp], e.Entry]) -> ApplyResult:
        """Log the entry ``build`` makes, apply it once durable, return apply's result."""
        while self._gate is not None and not self._closing:
            await self._gate.wait()
        writer = self._writer
        if writer is None or self._failure is not None or self._closing:
            raise BrokerUnavailableError(self._unavailable_reason())
        # No await between stamping and append: ids and time reach the log in order.
        now_ms = max(self.clock_ms(), self._last_time_ms)
        self._last_time_ms = now_ms
        data = e.encode_entry(build(Stamp(self, now_ms)))
        # Apply what followers and replay will read, not the original object
        # (an int where the log carries a float would make the digests differ).
        entry = e.decode_entry(data)
        durable = writer.append(data)
        answer: asyncio.Future[ApplyResult] = asyncio.get_running_loop().create_future()
        self._inflight.append(_InFlight(entry, writer.ledger_id, durable, answer))
        durable.add_done_callback(self._on_durable)
        self.stats.entries_appended += 1
        return await answer

    def _unavailable_reason(self) -> str:
        if self._failure is not None:
            return f"the broker's log failed ({self._failure}); restart it"
        if self._closing:
            return "the broker is shutting down"
        return "the broker is not ready"

    def _on_durable(self, _: asyncio.Future[int]) -> None:
        # Futures resolve in entry order; apply every durable entry at the head.
        inflight = self._inflight
        while inflight and inflight[0].durable.done():
            item = inflight.popleft()
            failure = item.durable.exception()
            if failure is not None:
                self._fail(failure, item)
                return
            result = self.state.apply(item.entry)
            self.position = (item.ledger_id, item.durable.result())
            final, stops = self.state.drain_effects()
            for listener in self.listeners:
                try:
                    listener(item.entry, result, final, stops)
                except Exception:
                    logger.exception("apply listener failed")
            if not item.answer.done():
                item.answer.set_result(result)
        self._maybe_roll()

    def _fail(self, failure: BaseException, first: _InFlight) -> None:
        # After a failed append nothing later may be applied: the log may have a hole.
        if self._failure is None:
            logger.critical("ledger append failed, refusing writes: %s", failure)
            self._failure = failure
        error = BrokerUnavailableError(self._unavailable_reason())
        for item in (first, *self._inflight):
            if not item.answer.done():
                item.answer.set_exception(error)
        self._inflight.clear()

    def _maybe_roll(self) -> None:
        writer = self._writer
        if writer is None or self._gate is not None or self._closing or self._failure:
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
        except (LedgerError, BrokerStartupError) as exc:
            if self._failure is None:
                logger.critical("ledger roll failed, refusing writes: %s", exc)
                self._failure = exc
        finally:
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
            body = self.state.encode_snapshot()
            ledger_id, entry_id = self.position
            entries_applied = self.state.entries_applied
            created_ms = self.clock_ms()

            def write() -> None:
                self.snapshots.write(
                    cluster_id=self.config.cluster_id,
                    ledger_id=ledger_id,
                    entry_id=entry_id,
                    created_ms=created_ms,
                    digest=hashlib.sha256(body).hexdigest(),
                    body=body,
                )

            await asyncio.to_thread(write)
            self._entries_at_snapshot = entries_applied
            self._snapshot_position = (ledger_id, entry_id)
            self.stats.snapshots_taken += 1
            self.stats.last_snapshot_ms = self.clock_ms()
            if not self._closing:
                await self._apply_retention()

    async def _apply_retention(self) -> None:
        snapshots = await asyncio.to_thread(self.snapshots.list)
        if not snapshots:
            return
        # Keep every ledger some kept snapshot may still need to replay from.
        oldest_needed = min(info.header.ledger_id for info in snapshots)
        horizon_ms = self.clock_ms() - self.config.ledger_retention_ms
        ledger_list, _ = await self.ledger_list.get()
        expired = [
            info.ledger_id
            for info in ledger_list.ledgers
            if info.state == LedgerState.CLOSED
            and info.ledger_id < oldest_needed
            and info.created_ms < horizon_ms
        ]
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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
