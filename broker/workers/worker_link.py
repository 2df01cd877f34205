"""The leader's side of the worker protocol: one TCP connection per worker.

Everything that changes state goes through the log first: a worker's
(re)connection (with the reconciliation of the tasks it still runs), the
assignments of a scheduling round, batches of finish reports, and a worker
declared dead after missing its heartbeat deadline. Workers are told only
after the entry is applied.

The protocol itself (frames, messages) lives in :mod:`broker.workers.protocol`; this
module is the asyncio wrapper around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import msgspec

from broker.api.edges import RefusalLog
from broker.api.output_store import OutputStore
from broker.core import entries as e
from broker.core.scheduler import schedule
from broker.core.state import (
    NAME_RE,
    Applied,
    ErrorCode,
    Rejected,
    TaskRef,
    TaskState,
    WorkerReconciled,
    WorkerState,
)
from broker.observability.logs import task_fields
from broker.replication.node import BrokerStartupError, BrokerUnavailableError, Node, Stamp
from broker.security.auth import Role as CallerRole
from broker.security.auth import hash_token
from broker.security.tls import TlsConfig, TlsConfigError, server_context
from broker.workers import protocol as p
from broker.workers.finish_reports import outcome, stamp_ids

logger = logging.getLogger(__name__)  # task events: broker/observability/task_log.py


@dataclass(frozen=True)
class WorkerLinkConfig:
    host: str = "127.0.0.1"
    port: int = 7070
    heartbeat_interval_ms: int = 1000
    # A worker silent (or disconnected) this long is declared dead.
    heartbeat_timeout_ms: int = 10_000
    # A connection must send its hello within this (it is closed with an error frame after).
    hello_timeout_s: float = 5.0
    # Before the hello is accepted nothing longer is read: a hello carries 7 to 15 bytes
    # per task the worker still runs, so this fits a worker running over 17,000 tasks.
    max_hello_bytes: int = 256 * 1024
    # Connections still in their handshake (TLS done, hello not yet accepted); more are
    # refused with an error frame. Their buffers are bounded by max_hello_bytes each.
    max_unauthenticated: int = 64
    # Workers connect over TLS (the broker's certificate) when set.
    tls: TlsConfig | None = None
    max_frame_bytes: int = p.DEFAULT_MAX_FRAME_BYTES
    max_result_bytes: int = 1024 * 1024
    max_assignments_per_round: int = 2000
    max_reports_per_entry: int = 5000
    # Children one finish report may spawn, and the params size of each (like the API's).
    max_spawns_per_report: int = 10_000
    max_params_bytes: int = 64 * 1024
    # The shared worker token (legacy, unscoped): any worker holding it may connect.
    token: str | None = None
    # Authentication on: a task may spawn children only in its own tenant, using code
    # its tenant may use (a task must not act for another tenant).
    tenant_isolation: bool = False
    # Authentication on: worker credentials issued through the API (role "worker") are
    # accepted, and some credential is required even without a shared token.
    worker_credentials: bool = False
    # Task output kept on the leader (broker/api/output_store.py): in total, the least
    # recently written attempt evicted first (each attempt keeps its last 1 MiB).
    max_output_total_bytes: int = 256 * 1024 * 1024


class _Session:
    """One connected worker."""

    def __init__(
        self,
        worker_id: str,
        writer: asyncio.StreamWriter,
        max_frame_bytes: int,
        credential: str | None = None,
        peer: object = None,
    ) -> None:
        self.worker_id = worker_id
        self.peer = peer  # the connection's address, for logs
        self.writer = writer
        self.max_frame_bytes = max_frame_bytes
        self.credential = credential  # API worker credential id; None: the shared token
        self.answers_fetch = False  # its Hello said it answers FetchOutput
        self.last_seen = time.monotonic()
        self.closed = False

    def send(self, message: p.Message) -> None:
        if self.closed:
            return
        try:
            self.writer.write(p.encode_message(message, self.max_frame_bytes))
        except (ConnectionError, RuntimeError, p.ProtocolError) as exc:
            logger.warning("cannot send to worker %s: %s", self.worker_id, exc)
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()


class WorkerLink:
    def __init__(
        self, node: Node, config: WorkerLinkConfig, outputs: OutputStore | None = None
    ) -> None:
        self.node = node
        self.config = config
        # Where the workers' Output frames go; shared with the HTTP API's logs route.
        self.outputs = (
            outputs
            if outputs is not None
            else OutputStore(max_total_bytes=config.max_output_total_bytes)
        )
        self.sessions: dict[str, _Session] = {}
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._dirty = asyncio.Event()
        self._reports: list[tuple[_Session, p.TaskReport]] = []
        self._reports_ready = asyncio.Event()
        # When a worker the state counts as connected was last seen (monotonic).
        self._last_contact: dict[str, float] = {}
        self._declaring_dead: set[str] = set()
        self._unauthenticated = 0  # connections whose hello is not accepted yet
        self._refusals = RefusalLog(logger)
        # Worker ids whose Hello is being logged: a concurrent Hello for one is refused.
        self._registering: set[str] = set()
        self._started = time.monotonic()
        node.listeners.append(self._on_applied)

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        self._started = time.monotonic()
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
                **tls_options,
            )
        except OSError as exc:
            raise BrokerStartupError(
                f"cannot listen for workers on {self.config.host}:{self.config.port}: "
                f"{exc.strerror or exc}"
            ) from None
        self.outputs.fetcher = self._fetch_output
        self._tasks = [
            asyncio.create_task(self._schedule_loop(), name="steward-schedule"),
            asyncio.create_task(self._finish_loop(), name="steward-finish"),
            asyncio.create_task(self._heartbeat_loop(), name="steward-heartbeat"),
        ]
        self._dirty.set()
        logger.info(
            "worker endpoint on %s:%d%s",
            self.config.host,
            self.port,
            " (TLS)" if self.config.tls is not None else "",
        )

    async def stop(self) -> None:
        with contextlib.suppress(ValueError):
            self.node.listeners.remove(self._on_applied)
        if self.outputs.fetcher == self._fetch_output:
            self.outputs.fetcher = None
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
            # Anything else may have freed capacity or queued work.
            self._dirty.set()
        # One Cancel per (worker, reason): an entry may stop tasks for different reasons
        # (a cancel whose clock advance also fires deadlines).
        by_worker: dict[tuple[str, str], list[p.TaskAttempt]] = defaultdict(list)
        for stop in applied.stops:
            by_worker[stop.worker_id, stop.reason].append(p.TaskAttempt(stop.task_id, stop.attempt))
        for (worker_id, reason), attempts in by_worker.items():
            session = self.sessions.get(worker_id)
            if session is not None:
                session.send(p.Cancel(tasks=tuple(attempts), reason=reason))
        if isinstance(entry, e.RevokeToken) and not isinstance(result, Rejected):
            # A revoked worker credential loses its connections at once, not at reconnect.
            for session in list(self.sessions.values()):
                if session.credential == entry.token_id:
                    logger.warning(
                        "worker %s: its credential %s was revoked; disconnecting",
                        session.worker_id,
                        entry.token_id,
                    )
                    _send_error(session.writer, "unauthorized", "the worker credential was revoked")
                    session.close()

    # --- connections ----------------------------------------------------------------------

    async def _handle_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        peer = _peer_address(writer)
        if self._unauthenticated >= self.config.max_unauthenticated:
            self._refusals.warning(
                "worker port: refused %s: %d connections are already in their handshake",
                peer,
                self._unauthenticated,
            )
            _send_error(
                writer,
                "too_many_connections",
                f"over {self.config.max_unauthenticated} connections are in their handshake; "
                "retry later",
            )
            return
        self._unauthenticated += 1
        decoder = p.FrameDecoder(min(self.config.max_hello_bytes, self.config.max_frame_bytes))
        session: _Session | None = None
        try:
            try:
                hello = await asyncio.wait_for(
                    self._read_hello(reader, decoder), timeout=self.config.hello_timeout_s
                )
                session = await self._register(hello, writer, peer)
            finally:
                self._unauthenticated -= 1
            decoder.max_frame_bytes = self.config.max_frame_bytes
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                session.last_seen = time.monotonic()
                for message in decoder.feed(data):
                    self._dispatch(session, message)
                if session.closed:
                    break
        except p.ProtocolError as exc:
            if session is None:
                self._refusals.warning("worker port: refused %s: %s", peer, exc.message)
            else:
                logger.warning("worker %s at %s: %s", session.worker_id, peer, exc.message)
            _send_error(writer, exc.code, exc.message)
        except TimeoutError:
            self._refusals.warning(
                "worker port: refused %s: no hello within %s s", peer, self.config.hello_timeout_s
            )
            _send_error(writer, "timeout", "no hello within the handshake timeout")
        except BrokerUnavailableError as exc:
            _send_error(writer, "unavailable", str(exc))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if session is not None:
                session.close()
                if self.sessions.get(session.worker_id) is session:
                    del self.sessions[session.worker_id]
                    self._last_contact[session.worker_id] = time.monotonic()
                    logger.info("worker %s disconnected", session.worker_id)
            else:
                writer.close()

    async def _read_hello(self, reader: asyncio.StreamReader, decoder: p.FrameDecoder) -> p.Hello:
        while True:
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("closed before hello")
            try:
                messages = decoder.feed(data)
            except p.ProtocolError as exc:
                if exc.code == "frame_too_large":
                    raise p.ProtocolError("frame_too_large", f"{exc.message} of a hello") from None
                raise
            if messages:
                hello = messages[0]
                if not isinstance(hello, p.Hello):
                    raise p.ProtocolError("bad_handshake", "the first message must be hello")
                if len(messages) > 1:
                    raise p.ProtocolError("bad_handshake", "wait for welcome before sending more")
                return hello

    def _credential(self, hello: p.Hello) -> tuple[str | None, tuple[str, ...] | None]:
        """(credential id, tenants it may serve) of a Hello's token; ProtocolError when it
        names none. Credential None is the shared token (or authentication off); tenants
        None: every tenant."""
        expected = self.config.token
        presented = (hello.token or "").encode("utf-8", "surrogatepass")
        # constant time: the comparison must not leak how much of a guess was right
        if expected is not None and hmac.compare_digest(presented, expected.encode()):
            return None, None
        if self.config.worker_credentials and hello.token:
            state = self.node.state
            token_id = state.token_ids_by_hash.get(hash_token(hello.token))
            token = state.tokens.get(token_id) if token_id is not None else None
            if token is not None and token.role == CallerRole.WORKER.value:
                return token.id, tuple(token.tenants) or None
        if expected is None and not self.config.worker_credentials:
            return None, None  # authentication off
        raise p.ProtocolError("unauthorized", "wrong or missing worker token")

    def _live_session(self, worker_id: str) -> _Session | None:
        """The open connection of this worker id that still heartbeats, if any.

        A connection silent for three heartbeat intervals (a working worker beats every
        interval) is presumed half-open: a reconnect of its worker may replace it."""
        session = self.sessions.get(worker_id)
        if session is None or session.closed:
            return None
        silent_s = time.monotonic() - session.last_seen
        return session if silent_s <= 3 * self.config.heartbeat_interval_ms / 1000 else None

    async def _register(
        self, hello: p.Hello, writer: asyncio.StreamWriter, peer: object
    ) -> _Session:
        credential, scope = self._credential(hello)
        if not NAME_RE.match(hello.worker_id):
            raise p.ProtocolError("bad_handshake", "worker_id must be a valid name")
        if any(n < 0 for n in hello.task_types.values()) or any(
            not (a >= 0) for a in hello.resources.values()
        ):
            raise p.ProtocolError("bad_handshake", "capacities and resources must be >= 0")
        tenants = tuple(hello.tenants)
        if scope is not None:
            # A scoped credential serves its tenants only: "all" narrows to them, anything
            # beyond them is refused (a worker must not silently serve less than it asked).
            outside = sorted(set(tenants) - set(scope))
            if outside:
                raise p.ProtocolError(
                    "forbidden",
                    f"this worker credential may serve tenants {', '.join(scope)} only, "
                    f"not {', '.join(outside)}",
                )
            tenants = tenants or scope
        if self._live_session(hello.worker_id) is not None or hello.worker_id in self._registering:
            # Taking over a live connection would hand its tasks to whoever asked.
            raise p.ProtocolError(
                "worker_id_in_use",
                f"worker {hello.worker_id} is connected on another live connection; "
                "retry once it is gone, or use another --worker-id",
            )
        self._registering.add(hello.worker_id)
        try:
            return await self._register_checked(hello, writer, credential, tenants, peer)
        finally:
            self._registering.discard(hello.worker_id)

    async def _register_checked(
        self,
        hello: p.Hello,
        writer: asyncio.StreamWriter,
        credential: str | None,
        tenants: tuple[str, ...],
        peer: object,
    ) -> _Session:
        previous = self.sessions.pop(hello.worker_id, None)
        if previous is not None:
            # The same worker reconnected before we noticed the old (silent) connection died.
            previous.close()
        # Contact now: until the session is registered below, the heartbeat loop must
        # not judge this worker (connected in the state, no session) by an old contact.
        self._last_contact[hello.worker_id] = time.monotonic()
        address = writer.get_extra_info("peername")
        entry_running = tuple(e.TaskAttempt(r.task_id, r.attempt) for r in hello.running)
        result = await self.node.propose(
            lambda stamp: e.RegisterWorker(
                time_ms=stamp.now_ms,
                worker_id=hello.worker_id,
                address=f"{address[0]}:{address[1]}" if address else "",
                process_id=hello.process_id,
                resources=dict(hello.resources),
                task_types=dict(hello.task_types),
                tenants=tenants,
                running=entry_running,
                credential=credential,
            )
        )
        if isinstance(result, Rejected):
            code = "worker_id_in_use" if result.code == ErrorCode.CONFLICT else "bad_handshake"
            raise p.ProtocolError(code, result.message)
        assert isinstance(result, WorkerReconciled)
        keep = {(k.task_id, k.attempt) for k in result.keep}
        session = _Session(hello.worker_id, writer, self.config.max_frame_bytes, credential, peer)
        session.answers_fetch = hello.output
        session.send(
            p.Welcome(
                broker_id=self.node.config.broker_id,
                heartbeat_interval_ms=self.config.heartbeat_interval_ms,
                heartbeat_timeout_ms=self.config.heartbeat_timeout_ms,
                keep=tuple(p.TaskAttempt(t, a) for t, a in sorted(keep)),
                drop=tuple(r for r in hello.running if (r.task_id, r.attempt) not in keep),
                output=True,
            )
        )
        self.sessions[hello.worker_id] = session
        self._last_contact[hello.worker_id] = time.monotonic()
        logger.info(
            "worker %s connected (process %s), keeps %d tasks, lost %d",
            hello.worker_id,
            hello.process_id,
            len(keep),
            len(result.lost),
        )
        self._dirty.set()
        return session

    def _dispatch(self, session: _Session, message: p.Message) -> None:
        if isinstance(message, p.Heartbeat):
            return
        if isinstance(message, p.Finish):
            for report in message.reports:
                self._reports.append((session, report))
            self._reports_ready.set()
            return
        if isinstance(message, p.Output):
            self._on_output(session, message)
            return
        if isinstance(message, p.Error):
            logger.warning("worker %s reported: %s", session.worker_id, message.message)
            session.close()
            return
        raise p.ProtocolError(
            "unexpected_message", f"a worker may not send {message.__class__.__name__}"
        )

    # --- task output (not state: kept in self.outputs, never logged) ---------------------

    def _on_output(self, session: _Session, message: p.Output) -> None:
        """Keep an attempt's output if that attempt was assigned to this very connection
        (running, or ended on it) and its worker serves the task's tenant; else refuse it
        (logged): a worker must not write into another attempt's output."""
        key = (message.task_id, message.attempt)
        task = self.node.state.tasks.get(message.task_id)
        worker = self.node.state.workers.get(session.worker_id)
        problem = ""
        if task is None or task.attempt != message.attempt or task.worker != session.worker_id:
            problem = "an attempt not assigned to it"
        elif self.sessions.get(session.worker_id) is not session:
            problem = "an attempt of a replaced connection"
        elif worker is None or (worker.tenants and task.tenant not in worker.tenants):
            problem = "a tenant it does not serve"
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
            if not self.sessions or not self.node.writable:
                continue
            state = self.node.state
            assignments = schedule(
                state,
                max_assignments=self.config.max_assignments_per_round,
                eligible_workers=self.sessions.keys(),
            )
            if not assignments:
                continue
            batch = tuple(assignments)

            def build(stamp: Stamp, batch: tuple[e.Assignment, ...] = batch) -> e.Entry:
                return e.AssignTasks(time_ms=stamp.now_ms, assignments=batch)

            try:
                results = await self.node.propose(build)
            except BrokerUnavailableError:
                continue
            assert isinstance(results, list)
            self._push_assignments(batch, results)
            if len(batch) >= self.config.max_assignments_per_round:
                self._dirty.set()

    def _push_assignments(
        self, batch: tuple[e.Assignment, ...], results: list[TaskRef | Rejected]
    ) -> None:
        state = self.node.state
        by_worker: dict[str, list[p.AssignedTask]] = defaultdict(list)
        for assignment, result in zip(batch, results, strict=True):
            if isinstance(result, Rejected):
                continue
            task = state.tasks.get(assignment.task_id)
            if task is None or task.state != TaskState.RUNNING:
                continue  # already over (cancelled in the same instant)
            by_worker[assignment.worker_id].append(
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
        for worker_id, tasks in by_worker.items():
            session = self.sessions.get(worker_id)
            if session is not None:
                session.send(p.Assign(tasks=tuple(tasks)))
            # If it vanished meanwhile, it either reconnects without these tasks
            # (reconciliation re-queues them) or is declared dead.

    # --- finish reports ---------------------------------------------------------------------

    async def _finish_loop(self) -> None:
        while True:
            await self._reports_ready.wait()
            self._reports_ready.clear()
            while self._reports:
                limit = self.config.max_reports_per_entry
                batch, self._reports = self._reports[:limit], self._reports[limit:]
                # Reports of attempts that are already over (duplicates, late ones)
                # change nothing: acknowledge them without logging an entry.
                live: list[tuple[_Session, p.TaskReport]] = []
                stale: list[tuple[_Session, p.TaskReport]] = []
                for item in batch:
                    (live if self._is_running(*item) else stale).append(item)
                for session, report in stale:
                    self._log_foreign_report(session, report)
                if stale:
                    self._acknowledge(stale)
                batch = live
                if not batch:
                    continue
                outcomes = tuple(
                    outcome(self.config, self.node.state, session.worker_id, report)
                    for session, report in batch
                )

                def build(stamp: Stamp, outcomes: tuple[e.TaskOutcome, ...] = outcomes) -> e.Entry:
                    return e.FinishTasks(time_ms=stamp.now_ms, outcomes=stamp_ids(stamp, outcomes))

                try:
                    await self.node.propose(build)
                except BrokerUnavailableError:
                    # Not acknowledged: the worker resends after reconnecting.
                    self._reports.clear()
                    break
                self._acknowledge(batch)

    def _is_running(self, session: _Session, report: p.TaskReport) -> bool:
        """Whether the report is for an attempt running on this very connection: the
        task's worker is the session's and the session is that worker's current one (a
        replaced connection's queued reports are not its to make)."""
        task = self.node.state.tasks.get(report.task_id)
        return (
            task is not None
            and task.state == TaskState.RUNNING
            and task.worker == session.worker_id
            and task.attempt == report.attempt
            and self.sessions.get(session.worker_id) is session
        )

    def _log_foreign_report(self, session: _Session, report: p.TaskReport) -> None:
        """Log a report for an attempt running elsewhere (not a late duplicate): it is
        refused (acknowledged, so a confused worker stops resending, but not applied)."""
        task = self.node.state.tasks.get(report.task_id)
        if task is None or task.state != TaskState.RUNNING:
            return
        if task.worker == session.worker_id and self.sessions.get(session.worker_id) is session:
            return  # its own task, another attempt: a late duplicate
        logger.warning(
            "worker %s at %s: refused a report for task %d attempt %d, which runs on %s",
            session.worker_id,
            session.peer,
            report.task_id,
            report.attempt,
            "another connection" if task.worker == session.worker_id else task.worker,
            extra=task_fields(task.id, task.tenant),
        )

    def _acknowledge(self, batch: list[tuple[_Session, p.TaskReport]]) -> None:
        acks: dict[_Session, list[p.TaskAttempt]] = defaultdict(list)
        for session, report in batch:
            acks[session].append(p.TaskAttempt(report.task_id, report.attempt))
        for session, attempts in acks.items():
            session.send(p.FinishAck(tasks=tuple(attempts)))

    # --- heartbeats and dead workers -------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        interval_s = self.config.heartbeat_interval_ms / 1000
        timeout_s = self.config.heartbeat_timeout_ms / 1000
        seq = 0
        while True:
            await asyncio.sleep(interval_s)
            seq += 1
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if now - session.last_seen > timeout_s:
                    logger.warning("worker %s missed its heartbeat deadline", session.worker_id)
                    session.close()
                    continue
                session.send(p.Heartbeat(seq=seq))
            if self.node.writable:
                try:
                    await self._declare_dead_workers(now, timeout_s)
                except Exception:
                    logger.exception("declaring dead workers failed; retrying next beat")

    async def _declare_dead_workers(self, now: float, timeout_s: float) -> None:
        for worker in list(self.node.state.workers.values()):
            if worker.state != WorkerState.CONNECTED or worker.id in self.sessions:
                continue
            if worker.id in self._declaring_dead:
                continue
            last = self._last_contact.get(worker.id, self._started)
            if now - last <= timeout_s:
                continue
            self._declaring_dead.add(worker.id)
            dead = e.WorkerDead(
                time_ms=0,
                worker_id=worker.id,
                reason=f"no heartbeat for {self.config.heartbeat_timeout_ms} ms",
                connected_ms=worker.connected_ms,
            )

            def build(stamp: Stamp, dead: e.WorkerDead = dead) -> e.Entry:
                return msgspec.structs.replace(dead, time_ms=stamp.now_ms)

            try:
                await self.node.propose(build)
                logger.warning("worker %s declared dead", worker.id)
            except BrokerUnavailableError:
                return
            finally:
                self._declaring_dead.discard(worker.id)


def _peer_address(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "unknown peer"


def _send_error(writer: asyncio.StreamWriter, code: str, message: str) -> None:
    with contextlib.suppress(Exception):
        writer.write(p.encode_message(p.Error(code=code, message=message)))
        writer.close()
