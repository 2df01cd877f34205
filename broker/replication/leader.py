r"""The acting leader (docs/DESIGN.md §2, §4): take-over, the write path, ledger rolls.

Write path: the caller's ``build(stamp)`` turns a request into an entry with leader-chosen
ids and time; the entry is appended to the open ledger (group commit in the backend); when
it is durable it is applied, in log order, and only then is the caller answered. Nothing is
applied before it is durable and nothing is acknowledged before it is applied. In cluster
mode (``leadership_check`` set) a deposed leader never acknowledges a write the next leader
lacks: on a fencing backend because its appends fail once the next leader recovered the
ledger (so only the elector's own view is checked per batch); otherwise every durable group
commit is confirmed against ZooKeeper (elector connected and lowest in the queue, ledger
list version unchanged since this leader last wrote it) before it is applied and answered
(docs/DESIGN.md §4). A :class:`Leader` lives for one term: a role change swaps it for a
follower.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from broker.core import ApplyResult
from broker.core import entries as e
from broker.replication.common import (
    BrokerStartupError,
    BrokerUnavailableError,
    LeadershipLostError,
    Role,
    cancel_all,
    logger,
    with_ledger_closed,
)
from broker.replication.context import RoleContext
from broker.replication.schedule_loop import fire_schedules_loop
from broker.replication.stamp import IdCounters, Stamp
from log.api import LedgerError, LedgerWriter


@dataclass(slots=True)
class _InFlight:
    entry: e.Record
    ledger_id: int
    durable: asyncio.Future[int]
    answer: asyncio.Future[ApplyResult]


class Leader:
    """One leader term of a node: created at take-over (or standalone start), dropped at
    step-down. Owns the open ledger, the writes in flight and the term's loops (timers;
    in cluster mode the confirmation and the idle marker), and rolls the ledger."""

    def __init__(self, context: RoleContext, role: Role) -> None:
        self._context = context
        # STANDALONE; or CANDIDATE (taking over) until open_for_writes in cluster mode.
        self.role = role
        self.writer: LedgerWriter | None = None
        self._writer_created_ms = 0
        self.inflight: collections.deque[_InFlight] = collections.deque()
        self.gate: asyncio.Event | None = None  # set while rolling: proposals wait
        self.failure: BaseException | None = None
        self.deposed: str | None = None
        self.ids = IdCounters()
        self._last_time_ms = 0
        self.tasks: list[asyncio.Task[None]] = []
        self.roll_task: asyncio.Task[None] | None = None
        self._durable_ready = asyncio.Event()  # cluster mode: a durable batch to confirm
        self.last_real_position: tuple[int, int] = (-1, -1)  # last non-marker entry applied
        self.marked_position: tuple[int, int] = (-1, -1)  # covered by a Confirm marker
        self._last_append_time = 0.0
        self._durable_in_batch = 0  # durable callbacks since the batch-size flush

    # --- take-over and the end of the term -------------------------------------------------

    async def recover_log(self) -> None:
        """Replay every ledger after our position, fencing and recovering a ledger left
        open (by a dead or deposed leader)."""
        history = self._context.history
        applier = self._context.applier
        ledger_list = await history.read_list()
        history.check(ledger_list)
        for info in ledger_list.ledgers:
            if info.ledger_id < applier.position[0]:
                continue
            await history.replay_ledger(info)
        logger.info(
            "replayed the log up to %s (%d entries applied)",
            applier.position,
            applier.state.entries_applied,
        )

    async def open_for_writes(self) -> None:
        """Open our own ledger, CAS it into the list, accept writes."""
        context = self._context
        self.writer, self._writer_created_ms = await context.history.open_ledger()
        state = context.applier.state
        self.ids = IdCounters(state.max_task_id + 1, state.max_transaction_id + 1)
        self._last_time_ms = state.now_ms
        self.tasks = [
            asyncio.create_task(self._timer_loop(), name="steward-timers"),
            asyncio.create_task(fire_schedules_loop(context, self), name="steward-schedules"),
        ]
        context.metrics.follower_lag_seconds.set(0)
        context.metrics.follower_lag_entries.set(0)
        if context.election.leadership_check is not None:
            self.tasks.append(asyncio.create_task(self._marker_loop(), name="steward-lac-marker"))
            if not context.ledgers.can_fence:
                self.tasks.append(asyncio.create_task(self._confirm_loop(), name="steward-confirm"))
            self.role = Role.LEADER
        logger.info(
            "broker %s leads at position %s with %d tasks",
            context.config.broker_id,
            context.applier.position,
            len(state.tasks),
        )

    async def drain(self, timeout_s: float) -> None:
        """A clean stop: let a roll and the writes in flight finish, stop the loops."""
        if self.roll_task is not None:
            # Let a roll finish its ledger-list update rather than cut it in half.
            await asyncio.wait([self.roll_task], timeout=timeout_s)
        if self.inflight:
            pending = [item.answer for item in self.inflight]
            await asyncio.wait(pending, timeout=timeout_s)
        await cancel_all(self.tasks)

    async def close_ledger(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None and self.failure is None and self.deposed is None:
            try:
                last_entry_id = await writer.close()
                await self._context.history.update(
                    lambda ll: with_ledger_closed(ll, writer.ledger_id, last_entry_id)
                )
            except (LedgerError, BrokerUnavailableError):
                logger.exception("could not close ledger %d cleanly", writer.ledger_id)

    async def step_down(self, reason: str) -> None:
        """Fail what is in flight with a retryable error, abandon the ledger (the next
        leader recovers it)."""
        if self.deposed is None:
            self.deposed = reason
        self._fail_inflight(LeadershipLostError(f"this broker stopped leading: {reason}"))
        if self.roll_task is not None:
            self.roll_task.cancel()
        await cancel_all(self.tasks)
        if self.roll_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.roll_task
            self.roll_task = None
        writer, self.writer = self.writer, None
        if writer is not None:
            # Pending appends may still land (the new leader's recovery then includes
            # them) or fail as fenced; nobody was told they succeeded.
            with contextlib.suppress(LedgerError, TimeoutError):
                async with asyncio.timeout(5):
                    await writer.close()
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.set()

    @property
    def writable(self) -> bool:
        return (
            self.role in (Role.STANDALONE, Role.LEADER)
            # Mid-roll there is briefly no writer: proposals wait at the gate for the
            # next one, so the leader still takes writes (no 503 on every roll).
            and (self.writer is not None or self.gate is not None)
            and self.failure is None
            and self.deposed is None
            and not self._context.closing()
        )

    # --- write path -------------------------------------------------------------------------

    async def propose(self, build: Callable[[Stamp], e.Entry]) -> ApplyResult:
        context = self._context
        while self.gate is not None and not context.closing():
            await self.gate.wait()
        if not self.writable:  # (a term that stepped down stays unwritable)
            raise context.unavailable_error()
        # No await between stamping and append: ids and time reach the log in order.
        now_ms = max(context.clock.now_ms(), self._last_time_ms)
        self._last_time_ms = now_ms
        answer = self._append(e.encode_entry(build(Stamp(self.ids, now_ms))))
        result: ApplyResult = await answer
        return result

    def _append(self, data: bytes) -> asyncio.Future[ApplyResult]:
        writer = self.writer
        assert writer is not None
        # Apply what followers and replay will read, not the original object
        # (an int where the log carries a float would make the digests differ).
        entry = e.decode_record(data)
        durable = writer.append(data)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[ApplyResult] = loop.create_future()
        self.inflight.append(_InFlight(entry, writer.ledger_id, durable, answer))
        now = self._context.clock.monotonic_s()
        durable.add_done_callback(functools.partial(self._on_durable, now))
        self._context.stats.entries_appended += 1
        self._last_append_time = now
        return answer

    def _on_durable(self, appended_at: float, durable: asyncio.Future[int]) -> None:
        if not durable.cancelled() and durable.exception() is None:
            # (exception() also marks a failure retrieved: it is read through inflight,
            # or dropped once deposed, so no "never retrieved" noise.)
            loop = asyncio.get_running_loop()
            context = self._context
            context.metrics.append_latency.observe(context.clock.monotonic_s() - appended_at)
            self._durable_in_batch += 1
            if self._durable_in_batch == 1:
                # A group commit resolves its futures together, so their callbacks are
                # queued back to back: this one runs after the last of them.
                loop.call_soon(self._flush_batch_size)
        check = self._context.election.leadership_check
        if check is not None and not self._context.ledgers.can_fence:
            self._durable_ready.set()  # the confirm loop asks ZooKeeper first (§4)
            return
        inflight = self.inflight
        if not (inflight and inflight[0].durable.done()):
            return  # an earlier callback of the same group commit applied this entry
        # With a fencing ledger what is durable is in the history the next leader
        # recovers: no ZooKeeper round trip per batch (§4). The elector's own view
        # (watches, connection state) still stops a leader that knows it lost.
        if check is not None and not check():
            self.depose("lost the election or the ZooKeeper connection")
            return
        self._apply_durable_head(len(inflight))

    def _flush_batch_size(self) -> None:
        self._context.metrics.observe_batch(self._durable_in_batch)
        self._durable_in_batch = 0

    def _apply_durable_head(self, limit: int) -> None:
        # Futures resolve in entry order; apply the durable entries at the head.
        inflight = self.inflight
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
                self._context.applier.pass_marker(position)
                if not item.answer.done():
                    item.answer.set_result(None)
                continue
            result = self._context.applier.apply_written(entry, position)
            self.last_real_position = position
            if not item.answer.done():
                item.answer.set_result(_detached(result))
        self._maybe_roll()

    # --- cluster mode: confirm each group commit, mark the idle log ----------------------

    async def _confirm_loop(self) -> None:
        """Cluster mode on a backend that cannot fence: apply durable batches only after
        ZooKeeper confirms we lead (docs/DESIGN.md §4)."""
        while True:
            await self._durable_ready.wait()
            self._durable_ready.clear()
            count = 0
            for item in self.inflight:
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
                self.depose(reason)
                return
            self._apply_durable_head(count)
            writer = self.writer
            position = self._context.applier.position
            if writer is not None and position[0] == writer.ledger_id:
                writer.confirm(position[1])  # the LAC followers may apply up to (§3)
            if self.inflight and self.inflight[0].durable.done():
                self._durable_ready.set()

    async def _leadership_lost_reason(self) -> str | None:
        context = self._context
        check = context.election.leadership_check
        if check is not None and not check():
            return "lost the election or the ZooKeeper connection"
        try:
            async with context.history.lock:
                version = await context.ledger_list.confirmed_version()
        except LedgerError as exc:
            return f"cannot confirm leadership in ZooKeeper: {exc}"
        if version != context.history.list_version:
            return (
                f"the ledger list changed to version {version} (this leader wrote "
                f"{context.history.list_version}): another broker took over"
            )
        return None

    def depose(self, reason: str) -> None:
        if self.deposed is not None:
            return
        context = self._context
        logger.error("broker %s was deposed: %s", context.config.broker_id, reason)
        self.deposed = reason
        self._fail_inflight(LeadershipLostError(f"this broker is no longer the leader: {reason}"))
        on_deposed = context.election.on_deposed
        if on_deposed is not None:
            on_deposed(reason)

    def _fail(self, failure: BaseException, first: _InFlight) -> None:
        # After a failed append nothing later may be applied: the log may have a hole.
        if self._context.election.leadership_check is not None:
            # In a cluster a failed append means fenced (another leader) or a broken
            # store: give the leadership up; a new leader recovers the ledger.
            self.inflight.appendleft(first)
            self.depose(f"ledger append failed: {failure}")
            return
        if self.failure is None:
            logger.critical("ledger append failed, refusing writes: %s", failure)
            self.failure = failure
        self.inflight.appendleft(first)
        self._fail_inflight(self._context.unavailable_error())

    def _fail_inflight(self, error: BrokerUnavailableError) -> None:
        for item in self.inflight:
            if not item.answer.done():
                item.answer.set_exception(error)
                # Nobody may await it (markers): keep asyncio from logging it.
                item.answer.exception()
        self.inflight.clear()

    async def _marker_loop(self) -> None:
        """Write a Confirm marker once the log is idle, so followers catch up fully."""
        context = self._context
        idle_s = context.config.confirm_idle_ms / 1000
        while True:
            await asyncio.sleep(idle_s)
            if (
                self.inflight
                or self.gate is not None
                or not self.writable
                or self.last_real_position == self.marked_position
                or context.clock.monotonic_s() - self._last_append_time < idle_s
            ):
                continue
            self.marked_position = self.last_real_position
            now_ms = max(context.clock.now_ms(), self._last_time_ms)
            self._append(e.encode_entry(e.Confirm(time_ms=now_ms)))

    # --- ledger rolls ------------------------------------------------------------------------

    def _maybe_roll(self) -> None:
        context = self._context
        writer = self.writer
        if (
            writer is None
            or self.gate is not None
            or context.closing()
            or self.failure
            or self.deposed is not None
        ):
            return
        too_big = writer.size_bytes >= context.config.ledger_roll_bytes
        too_old = (
            context.clock.now_ms() - self._writer_created_ms >= context.config.ledger_roll_age_ms
        )
        if too_big or too_old:
            self.gate = asyncio.Event()
            self.roll_task = asyncio.create_task(self._roll(writer), name="steward-roll")

    async def _roll(self, old: LedgerWriter) -> None:
        gate = self.gate
        try:
            last_entry_id = await old.close()
            await self._context.history.update(
                lambda ll: with_ledger_closed(ll, old.ledger_id, last_entry_id)
            )
            self.writer = None
            self.writer, self._writer_created_ms = await self._context.history.open_ledger()
            self._context.stats.ledgers_rolled += 1
            logger.info("rolled from ledger %d to %d", old.ledger_id, self._writer_id())
        except LeadershipLostError as exc:
            self.depose(str(exc))
        except (LedgerError, BrokerStartupError) as exc:
            if self._context.election.leadership_check is not None:
                self.depose(f"ledger roll failed: {exc}")
            elif self.failure is None:
                logger.critical("ledger roll failed, refusing writes: %s", exc)
                self.failure = exc
        finally:
            self.roll_task = None
            if self.gate is gate:
                self.gate = None
            if gate is not None:
                gate.set()

    def _writer_id(self) -> int:
        return self.writer.ledger_id if self.writer is not None else -1

    # --- timers and retention --------------------------------------------------------------

    async def _timer_loop(self) -> None:
        context = self._context
        while True:
            await asyncio.sleep(context.config.timer_poll_interval_s)
            due_ms = context.applier.state.next_timer_ms()
            if due_ms is None or due_ms > context.clock.now_ms() or self.inflight:
                continue
            with contextlib.suppress(BrokerUnavailableError):
                await self.propose(lambda stamp: e.Tick(time_ms=stamp.now_ms))

    async def retain_after_snapshot(self) -> None:
        try:
            await self._context.history.apply_retention()
        except LeadershipLostError as exc:
            self.depose(str(exc))
        except Exception as exc:
            # The snapshot is written; retention runs again after the next one
            # (e.g. ZooKeeper unreachable for a moment: not worth a traceback).
            logger.warning(
                "ledger retention skipped: %s: %s", type(exc).__name__, exc or "no detail"
            )


def _detached(result: ApplyResult) -> ApplyResult:
    """A result the caller can read later: apply may return a live state object (a
    Tenant), which the rest of the batch, applied before the caller resumes, changes."""
    if isinstance(result, msgspec.Struct) and not result.__struct_config__.frozen:
        return copy.copy(result)
    return result
