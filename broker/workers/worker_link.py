"""The leader's side of the worker protocol: one TCP connection per worker.

Everything that changes state goes through the log first: a worker's
(re)connection (with the reconciliation of the tasks it still runs), the
assignments of a scheduling round, batches of finish reports, and a worker
declared dead after missing its heartbeat deadline. Workers are told only
after the entry is applied.

The protocol itself (frames, messages) lives in :mod:`wire.worker_protocol` and which
frame may come when in :mod:`wire.conversation`; this module is the asyncio
wrapper around them. Its collaborators (docs/DESIGN.md §8, §9): :mod:`~broker.workers.handshake`
(Hello to Welcome), :mod:`~broker.workers.liveness` (heartbeats, dead workers) and
:mod:`~broker.workers.finish_queue` (finish reports); scheduling rounds and task output
stay here. Every reading of the clock goes through the one injected ``clock``. Its
configuration, which they all read, is :class:`~broker.workers.link_config.WorkerLinkConfig`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import defaultdict
from typing import Any

from broker.api.edges import RefusalLog
from broker.api.output_store import OutputStore
from broker.core import Rejected, TaskState
from broker.core import entries as e
from broker.core.effects import Applied
from broker.core.scheduler import schedule
from broker.replication.node import BrokerStartupError, BrokerUnavailableError, Node, Stamp
from broker.security.tls import TlsConfigError, server_context
from broker.workers.finish_queue import FinishQueue
from broker.workers.handshake import Handshake
from broker.workers.link_config import WorkerLinkConfig
from broker.workers.liveness import Liveness
from broker.workers.placement import SubmitPlacement
from broker.workers.session import Clock, Session, peer_address, send_error
from broker.workers.session_reader import SessionReader
from wire import worker_protocol as p
from wire.conversation import Conversation, Role

__all__ = ["WorkerLink", "WorkerLinkConfig"]

logger = logging.getLogger(__name__)  # task events: broker/observability/task_log.py

# Scheduling rounds shorter than this run back to back (a few hundred workers); a longer
# one is followed by a pause as long as itself, at most the second bound.
ROUND_PACING_FLOOR_S = 0.002
ROUND_PACING_MAX_S = 0.1
# How long a connection over the handshake cap (max_unauthenticated) waits for a slot.
HANDSHAKE_WAIT_S = 3.0


class WorkerLink:
    def __init__(
        self,
        node: Node,
        config: WorkerLinkConfig,
        outputs: OutputStore | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.node = node
        self.config = config
        self.clock = clock
        # Where the workers' Output frames go; shared with the HTTP API's logs route.
        self.outputs = (
            outputs
            if outputs is not None
            else OutputStore(max_total_bytes=config.max_output_total_bytes)
        )
        self.sessions: dict[str, Session] = {}
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._dirty = asyncio.Event()
        self._refusals = RefusalLog(logger)
        self.liveness = Liveness(node, config, self.sessions, clock)
        self.handshake = Handshake(node, config, self.sessions, self.liveness, self._dirty.set)
        self.finishes = FinishQueue(node, config, self.sessions)
        # Assignments carried by submit entries (docs/DESIGN.md §6); set on the node in start.
        self.placement = SubmitPlacement(lambda: node.state, self.sessions)
        self.placement.wake = self._dirty.set
        node.listeners.append(self._on_applied)

    @property
    def draining(self) -> bool:
        """The broker is stopping: assign nothing new, by the scheduler or with a submit
        (docs/DESIGN.md §6, "Stopping")."""
        return self.placement.paused

    @draining.setter
    def draining(self, value: bool) -> None:
        self.placement.paused = value

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        self.liveness.restart()
        # Build the state's capacity index now (O(workers) once), not in the first submit
        # or round; from here each entry keeps it in step (docs/DESIGN.md §8).
        self.node.state.capacity()
        tls_options: dict[str, Any] = {}
        if self.config.tls is not None:
            try:
                tls_options["ssl"] = server_context(self.config.tls)
            except TlsConfigError as exc:
                raise BrokerStartupError(str(exc)) from None
            # A client that never completes the handshake (plain TCP) is dropped after this.
            tls_options["ssl_handshake_timeout"] = self.config.hello_timeout_s
        try:
            self._server = await asyncio.start_server(
                self._handle_connection,
                self.config.host,
                self.config.port,
                limit=2**20,
                # Every worker of a failed leader reconnects at once (the kernel caps it).
                backlog=4096,
                **tls_options,
            )
        except OSError as exc:
            raise BrokerStartupError(
                f"cannot listen for workers on {self.config.host}:{self.config.port}: "
                f"{exc.strerror or exc}"
            ) from None
        self.outputs.fetcher = self._fetch_output
        self.node.placer = self.placement
        self._tasks = [
            asyncio.create_task(self._schedule_loop(), name="steward-schedule"),
            asyncio.create_task(self.finishes.run(), name="steward-finish"),
            asyncio.create_task(self.liveness.run(), name="steward-heartbeat"),
        ]
        self._dirty.set()
        logger.info(
            "worker endpoint on %s:%d%s",
            self.config.host,
            self.port,
            " (TLS)" if self.config.tls is not None else "",
        )

    async def stop(self) -> None:
        await self.liveness.stop()  # closing every connection below is not their workers'
        with contextlib.suppress(ValueError):
            self.node.listeners.remove(self._on_applied)
        if self.outputs.fetcher == self._fetch_output:
            self.outputs.fetcher = None
        if self.node.placer is self.placement:
            self.node.placer = None
        if self._server is not None:
            self._server.close()
        for session in list(self.sessions.values()):
            session.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), timeout=2)

    # --- after each applied entry -------------------------------------------------------

    def _on_applied(self, entry: e.Entry, applied: Applied) -> None:
        result = applied.result
        if not isinstance(entry, e.AssignTasks):
            # Anything else may have freed capacity or queued work (or left a task the
            # leader placed in a submit waiting: apply refused the placement).
            self._dirty.set()
        if applied.effects:
            self._push_assignments(applied)
        # One Cancel per (worker, reason): an entry may stop tasks for different reasons
        # (a cancel whose clock advance also fires deadlines).
        by_worker: dict[tuple[str, str], list[p.TaskAttempt]] = defaultdict(list)
        for stop in applied.stops:
            by_worker[stop.worker_id, stop.reason].append(p.TaskAttempt(stop.task_id, stop.attempt))
        for (worker_id, reason), attempts in by_worker.items():
            session = self.sessions.get(worker_id)
            if session is not None:
                session.send(p.Cancel(tasks=tuple(attempts), reason=reason))
        if (
            isinstance(entry, e.DeleteCode)
            and not isinstance(result, Rejected)
            and entry.sha256 not in self.node.state.artifacts  # deleted, not a claim dropped
        ):
            self.liveness.code_deleted(entry.sha256)
        elif isinstance(entry, e.AddCode):
            self.liveness.code_added(entry.sha256)
        if isinstance(entry, e.RevokeToken) and not isinstance(result, Rejected):
            # A revoked worker credential loses its connections at once, not at reconnect.
            for session in list(self.sessions.values()):
                if session.credential == entry.token_id:
                    logger.warning(
                        "worker %s: its credential %s was revoked; disconnecting",
                        session.worker_id,
                        entry.token_id,
                    )
                    session.send_error("unauthorized", "the worker credential was revoked")

    # --- connections ----------------------------------------------------------------------

    async def _handle_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        peer = peer_address(writer)
        # Over the cap, a connection waits a little for a slot before it is refused.
        if not await self.handshake.acquire(min(self.config.hello_timeout_s, HANDSHAKE_WAIT_S)):
            self._refusals.warning(
                "worker port: refused %s: %d connections are already in their handshake",
                peer,
                self.handshake.unauthenticated,
            )
            send_error(
                writer,
                "too_many_connections",
                f"over {self.config.max_unauthenticated} connections are in their handshake; "
                "retry later",
            )
            return
        decoder = p.FrameDecoder(min(self.config.max_hello_bytes, self.config.max_frame_bytes))
        session: Session | None = None
        try:
            session = await self.handshake.accept(
                reader, writer, peer, decoder, Conversation(Role.BROKER)
            )
            decoder.max_frame_bytes = self.config.max_frame_bytes
            # From here frames are dispatched as they arrive (broker/workers/session_reader.py).
            session_reader = await SessionReader.take_over(
                reader, writer, session, decoder, self._dispatch, self.clock
            )
            await session_reader.done
        except p.ProtocolError as exc:
            if session is None:
                self._refusals.warning("worker port: refused %s: %s", peer, exc.message)
            else:
                logger.warning("worker %s at %s: %s", session.worker_id, peer, exc.message)
            send_error(writer, exc.code, exc.message)
        except TimeoutError:
            self._refusals.warning(
                "worker port: refused %s: no hello within %s s", peer, self.config.hello_timeout_s
            )
            send_error(writer, "timeout", "no hello within the handshake timeout")
        except BrokerUnavailableError as exc:
            send_error(writer, "unavailable", str(exc))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if session is not None:
                session.close()
                if self.sessions.get(session.worker_id) is session:
                    del self.sessions[session.worker_id]
                    # Judged from its last frame, not from the close: a worker closed for
                    # its silence is then dead once the timeout has passed since it last
                    # spoke, not a second timeout later.
                    self.liveness.contact(session.worker_id, session.last_seen)
                    # Shown disconnected at once, on every broker (docs/DESIGN.md §8,
                    # "Closed connections"); the timeout still decides its death.
                    self.liveness.closed(session.worker_id, session.last_seen)
                    logger.info("worker %s disconnected", session.worker_id)
            else:
                writer.close()

    def _dispatch(self, session: Session, message: p.Message) -> None:
        # A frame the conversation table does not allow now: ProtocolError (Error, close).
        session.conversation.receive(message)
        if isinstance(message, p.Heartbeat):
            return
        if isinstance(message, p.Finish):
            self.finishes.add(session, message.reports)
            return
        if isinstance(message, p.Output):
            self._on_output(session, message)
            return
        if isinstance(message, p.Progress):
            self._on_progress(session, message)
            return
        assert isinstance(message, p.Error)
        logger.warning("worker %s reported: %s", session.worker_id, message.message)
        session.close()

    # --- task output (not state: kept in self.outputs, never logged) ---------------------

    def _on_output(self, session: Session, message: p.Output) -> None:
        """Keep an attempt's output if that attempt was assigned to this very connection
        (running, or ended on it) and its worker serves the task's tenant; else refuse it
        (logged): a worker must not write into another attempt's output."""
        key = (message.task_id, message.attempt)
        problem = self._not_its_attempt(session, message.task_id, message.attempt)
        if problem:
            self._refusals.warning(
                "worker %s at %s: refused output for task %d attempt %d: %s",
                session.worker_id,
                session.peer,
                message.task_id,
                message.attempt,
                problem,
            )
            self.outputs.missing(key)
            return
        if message.missing:
            self.outputs.missing(key)
        else:
            self.outputs.add(key, message.offset, message.data, complete=message.complete)
        # Output of tasks the state forgot (retention) goes too, checked now and then.
        tasks = self.node.state.tasks
        self.outputs.prune(lambda task_id: task_id in tasks)

    def _not_its_attempt(self, session: Session, task_id: int, attempt: int) -> str:
        """Why a worker may not report on this attempt ("" when it may)."""
        task = self.node.state.tasks.get(task_id)
        worker = self.node.state.workers.get(session.worker_id)
        if task is None or task.attempt != attempt or task.worker != session.worker_id:
            return "an attempt not assigned to it"
        if self.sessions.get(session.worker_id) is not session:
            return "an attempt of a replaced connection"
        if worker is None or (worker.tenants and task.tenant not in worker.tenants):
            return "a tenant it does not serve"
        return ""

    def _on_progress(self, session: Session, message: p.Progress) -> None:
        """Keep a running attempt's progress (leader memory: docs/DESIGN.md §6, "Task
        progress") under the same rule as its output; a bad value is refused, logged."""
        problem = self._not_its_attempt(session, message.task_id, message.attempt)
        task = self.node.state.tasks.get(message.task_id)
        if not problem and (task is None or task.state != TaskState.RUNNING):
            problem = "a task not running"
        if not problem and not (
            math.isfinite(message.fraction)
            and 0.0 <= message.fraction <= 1.0
            and len(message.message) <= p.MAX_PROGRESS_CHARS
        ):
            problem = "a fraction outside 0..1 or a message too long"
        if problem:
            self._refusals.warning(
                "worker %s at %s: refused progress for task %d attempt %d: %s",
                session.worker_id,
                session.peer,
                message.task_id,
                message.attempt,
                problem,
            )
            return
        self.outputs.progress.put(
            message.task_id, message.attempt, message.fraction, message.message
        )

    def _fetch_output(self, worker_id: str, task_id: int, attempt: int) -> bool:
        """Ask a connected worker for an attempt's output (it answers with Output)."""
        session = self.sessions.get(worker_id)
        if session is None or session.closed or not session.answers_fetch:
            return False
        session.send(p.FetchOutput(tasks=(p.TaskAttempt(task_id, attempt),)))
        return True

    # --- scheduling -------------------------------------------------------------------------

    async def _schedule_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            if not self.sessions or not self.node.writable or self.draining:
                continue
            if self.placement.busy:
                # Placements in submits are in flight: a round now would not count their
                # slots. The applied submit wakes this loop (broker/workers/placement.py).
                self.placement.deferred = True
                continue
            state = self.node.state
            started = time.perf_counter()
            assignments = schedule(
                state,
                max_assignments=self.config.max_assignments_per_round,
                eligible_workers=self.sessions.keys(),
            )
            # A round's setup costs O(workers) (broker/core/scheduler.py): with thousands
            # of workers, pause as long as it took before the next, so that rounds take at
            # most about half the loop and each assigns what finished meanwhile, instead of
            # one round per applied entry (docs/DESIGN.md §8, "Workers at scale").
            pause_s = time.perf_counter() - started
            if not assignments:
                await self._pace(pause_s)
                continue
            batch = tuple(assignments)

            def build(stamp: Stamp, batch: tuple[e.Assignment, ...] = batch) -> e.Entry:
                return e.AssignTasks(
                    time_ms=stamp.now_ms, assignments=batch, v=e.STARTS_RECORDED_VERSION
                )

            try:
                await self.node.propose(build)  # its effects push the Assign frames
            except BrokerUnavailableError:
                continue
            if len(batch) >= self.config.max_assignments_per_round:
                self._dirty.set()
            await self._pace(pause_s)

    @staticmethod
    async def _pace(pause_s: float) -> None:
        if pause_s >= ROUND_PACING_FLOOR_S:
            await asyncio.sleep(min(pause_s, ROUND_PACING_MAX_S))

    def _push_assignments(self, applied: Applied) -> None:
        """Send each worker the attempts an applied entry started on it (an AssignTasks
        entry's or a submit's own): the one path by which tasks reach workers."""
        tasks = self.node.state.tasks
        by_worker: dict[str, list[p.AssignedTask]] = defaultdict(list)
        for started in applied.assigned:
            task = tasks.get(started.task_id)
            if task is None or task.state != TaskState.RUNNING or task.attempt != started.attempt:
                continue  # already over (ended later in the same entry)
            by_worker[started.worker_id].append(
                p.AssignedTask(
                    task_id=task.id,
                    attempt=task.attempt,
                    type=task.type,
                    tenant=task.tenant,
                    params=task.params,
                    code=task.code,
                    deadline_ms=task.deadline_ms,
                    resources=task.resources,
                )
            )
        for worker_id, tasks_for in by_worker.items():
            session = self.sessions.get(worker_id)
            if session is not None:
                for message in p.assign_messages(tasks_for, session.max_frame_bytes):
                    session.send(message)
            # If it vanished meanwhile, it either reconnects without these tasks
            # (reconciliation re-queues them) or is declared dead.
