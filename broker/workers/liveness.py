"""Heartbeat supervision of the workers (docs/DESIGN.md §8).

Every interval the leader sends each connection a Heartbeat and closes the ones silent past
the timeout; a worker the state counts as connected that has had no connection for that
long is declared dead through the log (its tasks are re-queued when the entry applies).
A silence of half the timeout is logged (WorkerSilent), so that a new leader judges the
worker from its start, not from its own (docs/DESIGN.md §8, "Silence across leader changes");
a closed connection is logged at once (WorkerDisconnected, §8, "Closed connections").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Final

import msgspec

from broker.core import TASK_HOLDING_WORKER_STATES, WorkerState
from broker.core import entries as e
from broker.replication.node import BrokerUnavailableError, Node, Stamp
from broker.workers.session import Clock, Session
from wire import worker_protocol as p

if TYPE_CHECKING:
    from broker.workers.link_config import WorkerLinkConfig

# One logger for all of the worker link's parts (operators and tests filter on this name).
logger = logging.getLogger("broker.workers.worker_link")

# Deleted artifacts are repeated in heartbeats this long (a worker reconnecting within
# it still hears), at most this many (a worker's cache is bounded anyway: LRU).
DROPPED_CODE_WINDOW_S: Final = 300.0
DROPPED_CODE_MAX: Final = 256


class Liveness:
    """Owns when each worker was last heard of, and the heartbeat loop."""

    def __init__(
        self, node: Node, config: WorkerLinkConfig, sessions: dict[str, Session], clock: Clock
    ) -> None:
        self.node = node
        self.config = config
        self.sessions = sessions  # the link's: worker id -> its current connection
        self.clock = clock
        # When a worker the state counts as connected was last seen (monotonic).
        self.last_contact: dict[str, float] = {}
        self._declaring_dead: set[str] = set()
        self._logging_silence: set[str] = set()  # in a WorkerSilent being written
        # Closed connections to log (worker id -> its registration's connected_ms and its
        # last frame), and the task logging them; one entry per batch.
        self._closed: dict[str, tuple[int, float]] = {}
        self._logging_closed: asyncio.Task[None] | None = None
        # Workers the state counts disconnected, as of the last beat: welcomed with the
        # timing of their time and back within it, they still count for today's timing.
        self._disconnected_workers = 0
        self._stopping = False  # the link closes every connection itself: log none
        self._started = clock()
        # Code artifacts deleted lately (sha -> when), told to workers in heartbeats.
        self._deleted_code: dict[str, float] = {}

    def code_deleted(self, sha256: str) -> None:
        """A DeleteCode applied: tell the workers to drop it (in the next heartbeats)."""
        self._deleted_code.pop(sha256, None)
        self._deleted_code[sha256] = self.clock()
        while len(self._deleted_code) > DROPPED_CODE_MAX:
            del self._deleted_code[next(iter(self._deleted_code))]

    def code_added(self, sha256: str) -> None:
        """Uploaded again: workers must no longer drop it."""
        self._deleted_code.pop(sha256, None)

    def _dropped_code(self, now: float) -> tuple[str, ...]:
        deleted = self._deleted_code
        while deleted and now - next(iter(deleted.values())) > DROPPED_CODE_WINDOW_S:
            del deleted[next(iter(deleted))]
        return tuple(deleted)

    def restart(self) -> None:
        """The link (re)starts: workers without contact are judged from now."""
        self._started = self.clock()
        self._stopping = False

    def contact(self, worker_id: str, at: float | None = None) -> None:
        """Heard from ``worker_id`` now, or ``at`` (its last frame, on a disconnect)."""
        self.last_contact[worker_id] = self.clock() if at is None else at

    def closed(self, worker_id: str, last_seen: float) -> None:
        """The current connection of ``worker_id`` closed, its last frame at ``last_seen``:
        log the worker disconnected (docs/DESIGN.md §8, "Closed connections"), batched with
        the others closed meanwhile."""
        worker = self.node.state.workers.get(worker_id)
        if (
            self._stopping
            or not self.node.writable
            or worker is None
            or worker.state != WorkerState.CONNECTED
        ):
            return
        self._closed[worker_id] = (worker.connected_ms, last_seen)
        if self._logging_closed is None or self._logging_closed.done():
            self._logging_closed = asyncio.create_task(
                self._log_closed(), name="steward-disconnected"
            )

    async def stop(self) -> None:
        """The link stops: log no more closed connections."""
        self._stopping = True
        self._closed.clear()
        task, self._logging_closed = self._logging_closed, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _log_closed(self) -> None:
        while self._closed:
            ids = list(self._closed)[: e.MAX_DISCONNECTED_BATCH]
            batch = [(worker_id, *self._closed.pop(worker_id)) for worker_id in ids]

            def build(stamp: Stamp, batch: list[tuple[str, int, float]] = batch) -> e.Entry:
                at = self.clock()
                return e.WorkerDisconnected(
                    time_ms=stamp.now_ms,
                    workers=tuple(
                        e.DisconnectedWorker(
                            worker_id, stamp.now_ms - int((at - last) * 1000), connected_ms
                        )
                        for worker_id, connected_ms, last in batch
                        # Connected again meanwhile: its registration has superseded this.
                        if worker_id not in self.sessions
                    ),
                )

            try:
                await self.node.propose(build)
            except BrokerUnavailableError:
                self._closed.clear()  # no longer the leader: the next one judges them
                return
            except Exception:
                logger.exception("logging disconnected workers failed")
                self._closed.clear()  # the heartbeat timeout still judges them
                return

    def live_session(self, worker_id: str) -> Session | None:
        """The open connection of this worker id that still heartbeats, if any.

        A connection silent for three heartbeat intervals (a working worker beats every
        interval) is presumed half-open: a reconnect of its worker may replace it."""
        session = self.sessions.get(worker_id)
        if session is None or session.closed:
            return None
        silent_s = self.clock() - session.last_seen
        return session if silent_s <= 3 * session.heartbeat_interval_s else None

    def timing_ms(self, *, welcoming: bool = False) -> tuple[int, int]:
        """(interval, timeout): the configured ones, or, once the connected workers would
        beat more than ``heartbeats_per_s`` times a second, a longer interval that keeps
        them within it and a timeout of at least three such intervals, so a worker still
        beats three times before it is judged (docs/DESIGN.md §8, "Heartbeats at scale";
        Nomad's heartbeat TTL grows with its nodes likewise). ``welcoming``: for the Welcome
        of a worker registered in the state but without its session yet."""
        interval = self.config.heartbeat_interval_ms
        timeout = self.config.heartbeat_timeout_ms
        budget = self.config.heartbeats_per_s
        if budget <= 0:
            return interval, timeout
        connected = self.node.state.capacity().connected_workers + self._disconnected_workers
        workers = max(len(self.sessions) + welcoming, connected)
        wanted = -(-workers * 1000 // budget)  # ceil: ms so that workers / interval <= budget
        if wanted <= interval:
            return interval, timeout
        return wanted, max(timeout, 3 * wanted)

    async def run(self) -> None:
        interval_s = self.config.heartbeat_interval_ms / 1000
        seq = 0
        while True:
            await asyncio.sleep(interval_s)
            seq += 1
            await self.beat(seq)

    async def beat(self, seq: int) -> None:
        """One heartbeat round: close silent connections, beat the ones due (each at the
        interval its Welcome named; one encoded frame for all), declare dead."""
        now = self.clock()
        dropped = self._dropped_code(now)
        heartbeat = p.Heartbeat(seq=seq, dropped_code=dropped)
        frame = p.encode_message(heartbeat)
        # Due a little early rather than a whole round late: rounds tick at the base interval.
        slack_s = self.config.heartbeat_interval_ms / 2000
        for session in list(self.sessions.values()):
            # Each connection is judged by the timeout its Welcome named.
            timeout_s = session.heartbeat_timeout_s
            if now - session.last_seen > timeout_s:
                logger.warning("worker %s missed its heartbeat deadline", session.worker_id)
                session.close()
                continue
            if session.frames_sent != session.frames_seen:
                session.frames_seen = session.frames_sent
                session.last_sent = now
            # Deleted code is told in heartbeats only: beat at the worker's interval then.
            last = session.last_beat if dropped else session.last_sent
            # A worker judges the leader by any frame within the timeout: half of it leaves
            # a whole beat of slack (docs/DESIGN.md §8, "Heartbeats at scale").
            if now - last + slack_s >= max(session.heartbeat_interval_s, timeout_s / 2):
                session.last_beat = session.last_sent = now
                session.send_frame(heartbeat, frame)
                session.frames_seen = session.frames_sent
        self._disconnected_workers = sum(
            1 for w in self.node.state.workers.values() if w.state == WorkerState.DISCONNECTED
        )
        if self.node.writable:
            try:
                await self._declare_dead_workers(now, self.timing_ms()[1])
            except Exception:
                logger.exception("declaring dead workers failed; retrying next beat")

    async def _declare_dead_workers(self, now: float, timeout_ms: int) -> None:
        """Declare dead the workers silent past the timeout: to this leader, or since the
        silence the state inherited from earlier leaders (docs/DESIGN.md §8, "Silence
        across leader changes"); then log the silences this leader newly sees."""
        timeout_s = timeout_ms / 1000
        # The time the next entry is stamped with: the state's clock as this leader moves it.
        state_now_ms = max(self.node.clock_ms(), self.node.state.now_ms)
        changes: list[tuple[str, int, float | None]] = []  # (id, connected_ms, last or heard)
        for worker in list(self.node.state.workers.values()):
            if worker.state not in TASK_HOLDING_WORKER_STATES or worker.id in self._declaring_dead:
                continue
            session = self.sessions.get(worker.id)
            inherited = worker.silent_since_ms
            if session is not None:
                last = session.last_seen
            else:
                last = self.last_contact.get(worker.id, self._started)
                if now - last > timeout_s or (
                    inherited is not None and state_now_ms - inherited > timeout_ms
                ):
                    if not await self._declare_dead(worker.id, worker.connected_ms, timeout_ms):
                        return
                    continue
            if worker.id in self._logging_silence or worker.state != WorkerState.CONNECTED:
                continue  # a disconnected worker's silence is its last frame, logged
            # A connection is judged by the timeout its Welcome named (its worker beats at
            # that Welcome's interval), a worker without one by today's.
            half_s = (timeout_s if session is None else session.heartbeat_timeout_s) / 2
            if inherited is None and now - last >= half_s:
                changes.append((worker.id, worker.connected_ms, last))
            elif inherited is not None and session is not None and now - last < half_s:
                changes.append((worker.id, worker.connected_ms, None))  # beats again
        for start in range(0, len(changes), e.MAX_SILENT_BATCH):
            if not await self._log_silence(changes[start : start + e.MAX_SILENT_BATCH]):
                return

    async def _declare_dead(self, worker_id: str, connected_ms: int, timeout_ms: int) -> bool:
        """Log the worker's death; False when this broker cannot write any more."""
        self._declaring_dead.add(worker_id)
        dead = e.WorkerDead(
            time_ms=0,
            worker_id=worker_id,
            reason=f"no heartbeat for {timeout_ms} ms",
            connected_ms=connected_ms,
        )

        def build(stamp: Stamp, dead: e.WorkerDead = dead) -> e.Entry:
            # Its running attempts end as lost, not counted (docs/DESIGN.md §6, "Lost workers").
            holds = bool(self.node.state.running_by_worker.get(worker_id))
            version = e.lost_attempts_version(holds)
            return msgspec.structs.replace(dead, time_ms=stamp.now_ms, v=version)

        try:
            await self.node.propose(build)
            logger.warning("worker %s declared dead", worker_id)
        except BrokerUnavailableError:
            return False
        finally:
            self._declaring_dead.discard(worker_id)
        return True

    async def _log_silence(self, batch: list[tuple[str, int, float | None]]) -> bool:
        """One WorkerSilent entry for ``batch``: each worker's last contact with this
        leader mapped onto the stamp's clock (None: heard again); False when this broker
        cannot write any more. Batched: a takeover finds every worker silent at once."""
        ids = {worker_id for worker_id, _, _ in batch}
        self._logging_silence |= ids

        def build(stamp: Stamp) -> e.Entry:
            at = self.clock()
            return e.WorkerSilent(
                time_ms=stamp.now_ms,
                workers=tuple(
                    e.SilentWorker(
                        worker_id,
                        None if last is None else stamp.now_ms - int((at - last) * 1000),
                        connected_ms,
                    )
                    for worker_id, connected_ms, last in batch
                ),
            )

        try:
            await self.node.propose(build)
        except BrokerUnavailableError:
            return False
        finally:
            self._logging_silence -= ids
        return True
