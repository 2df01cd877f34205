"""The worker's connection to the broker: one TCP connection, kept up forever.

One asyncio task owns the connection at a time::

    [find leader] -> connect -> Hello(running tasks) -> Welcome(keep/drop) -> serve -> closed
    -> backoff -> ...

With ``brokers`` (HTTP URLs of a cluster) set, each connection attempt first asks them in
turn for ``GET /api/v1/cluster`` and connects to the leader's ``leader_worker_address``;
no leader known yet counts as a failed attempt (backoff, then ask again). So after a
disconnect the worker finds a new leader, and the Hello/Welcome reconcile runs there.

While serving: a Heartbeat goes out every interval; a broker silent for the Welcome's
heartbeat timeout is treated as dead (close, reconnect); Assign starts tasks (an attempt
already here is ignored); Cancel cancels; each deadline is enforced by a local timer.
Finished tasks' reports are coalesced (those arriving together, or for
``finish_batch_ms`` when set) into one Finish frame and kept until a FinishAck names
them: they are sent again after every reconnect and every
``finish_resend_s`` while connected, and reports of tasks finishing while disconnected
wait for the next connection. A ProtocolError or an Error frame ends the connection and
the worker reconnects with bounded exponential backoff (with jitter), until stopped.

Task output (to a broker whose Welcome takes it): each running attempt's new output goes
out in an Output frame at most once a second, and an ended attempt's whole kept tail just
before its report, on every connection the report is sent on; a FetchOutput is answered
from what the runtime still holds.

All protocol state lives on the event loop's thread; task threads only hand reports
over with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from broker.observability.logs import task_fields
from broker.workers.conversation import Conversation, Role
from broker.workers.protocol import (
    MAX_OUTPUT_BYTES,
    Assign,
    AssignedTask,
    Cancel,
    Error,
    FetchOutput,
    Finish,
    FinishAck,
    FrameDecoder,
    Heartbeat,
    Hello,
    Message,
    Output,
    ProtocolError,
    TaskAttempt,
    TaskReport,
    Welcome,
    encode_message,
)
from clients.worker.config import WorkerConfig, parse_host_port
from clients.worker.discovery import Leader as Leader  # re-exported: the old home
from clients.worker.discovery import LeaderUnknownError, find_leader
from clients.worker.runtime import TaskKey, TaskRuntime, split_dropped_note
from clients.worker.spark_connect import SparkConnectServer

logger = logging.getLogger(__name__)

_READ_BYTES = 256 * 1024
_REPORT_OVERHEAD_BYTES = 64  # msgpack framing of one report besides its payload
_OUTPUT_INTERVAL_S = 1.0  # running attempts' new output goes out at most this often


class BrokerError(Exception):
    """The broker sent an Error frame (it closes the connection after it)."""


class _Connection:
    """One welcomed connection: a writer plus the timing the broker asked for."""

    def __init__(
        self,
        writer: asyncio.StreamWriter,
        welcome: Welcome,
        max_frame_bytes: int,
        conversation: Conversation,
    ) -> None:
        self.writer = writer
        self.conversation = conversation  # docs/DESIGN.md §8: which frame may come when
        self.max_frame_bytes = max_frame_bytes
        self.heartbeat_interval_s = max(0.01, welcome.heartbeat_interval_ms / 1000)
        self.heartbeat_timeout_s = max(
            self.heartbeat_interval_s, welcome.heartbeat_timeout_ms / 1000
        )
        self.broker_id = welcome.broker_id
        self.seq = 0
        self.closed = False
        self.takes_output = welcome.output  # the broker accepts Output frames
        # Per attempt, the end offset of the output already sent on this connection, and
        # the attempts whose final output was sent (each connection starts afresh: a new
        # leader holds nothing).
        self.output_sent: dict[TaskKey, int] = {}
        self.final_output_sent: set[TaskKey] = set()

    def send(self, message: Message) -> bool:
        """Queue a frame on the transport (flow control: see the heartbeat loop's drain)."""
        if self.writer.is_closing() or self.conversation.closed:
            return False
        self.conversation.send(message)
        self.writer.write(encode_message(message, self.max_frame_bytes))
        return True

    def abort(self) -> None:
        self.writer.transport.abort()


class Worker:
    """A Steward worker: connects to the broker and runs the tasks it is assigned."""

    def __init__(
        self, config: WorkerConfig, *, spark_server: SparkConnectServer | None = None
    ) -> None:
        self.config = config
        self.process_id = uuid.uuid4().hex  # new per process start: tells restarts apart
        # One Spark Connect server per worker, started by run() (clients/worker/spark_connect.py);
        # a given one (tests: one server for many workers) is the caller's to stop.
        self._owns_spark = False
        if (
            spark_server is None
            and config.spark == "connect"
            and config.task_isolation == "process"
            and config.may_run_spark()
        ):
            spark_server = SparkConnectServer.from_config(config)
            self._owns_spark = True
        self.spark_server = spark_server
        # Register extra task types with worker.runtime.register(name, fn).
        self.runtime = TaskRuntime(config, self._report_from_thread, spark_server=spark_server)
        self.sessions = 0  # Welcomes received, for tests and metrics
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: _Connection | None = None
        self._writer: asyncio.StreamWriter | None = None  # of the current connection
        self._unacked: dict[TaskKey, TaskReport] = {}
        self._sent_at: dict[TaskKey, float] = {}  # loop time each unacked report went out
        self._outbox: list[TaskKey] = []
        self._flush_handle: asyncio.TimerHandle | asyncio.Handle | None = None
        self._deadlines: dict[TaskKey, asyncio.TimerHandle] = {}
        self._stopping = False  # no new tasks; still delivering reports
        self._final = asyncio.Event()  # set: close and leave run()
        self._done = asyncio.Event()
        self._stop_task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._welcomed = False  # the current/last connection got its Welcome
        self._changed = asyncio.Event()  # a report arrived or an ack: for stop()'s waits
        # Where the current/last connection goes (found anew each time with brokers).
        self.broker_address = config.broker if not config.brokers else ",".join(config.brokers)
        self._discovery_start = 0  # the broker that last named the leader is asked first

    # -- observation --

    @property
    def unacked(self) -> dict[TaskKey, TaskReport]:
        return dict(self._unacked)

    @property
    def connected(self) -> bool:
        return self._conn is not None

    async def wait_connected(self) -> None:
        await self._connected.wait()

    # -- lifecycle --

    async def run(self) -> None:
        """Connect and serve until :meth:`stop`; reconnects forever on any failure."""
        if self._loop is not None:
            raise RuntimeError("Worker.run() can only be called once")
        self._loop = asyncio.get_running_loop()
        if self._owns_spark and self.spark_server is not None:
            self.spark_server.start()  # in the background: the connect below does not wait
        backoff_s = self.config.reconnect_backoff_min_s
        try:
            while not self._final.is_set():
                welcomed = await self._run_one_session()
                if self._final.is_set():
                    break
                if welcomed:
                    backoff_s = self.config.reconnect_backoff_min_s
                delay_s = random.uniform(backoff_s / 2, backoff_s)
                backoff_s = min(backoff_s * 2, self.config.reconnect_backoff_max_s)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._final.wait(), delay_s)
        finally:
            for handle in self._deadlines.values():
                handle.cancel()
            self._deadlines.clear()
            if self._flush_handle is not None:
                self._flush_handle.cancel()
            self._done.set()

    async def stop(self, *, wait: bool = True, timeout_s: float = 30.0) -> None:
        """Stop taking tasks, finish or cancel running ones, deliver reports, disconnect.

        ``wait``: let running tasks finish (up to ``timeout_s``, then cancel them);
        otherwise cancel them at once. Calling it again with ``wait=False`` hurries a
        graceful stop along.
        """
        self._stopping = True
        if not wait:
            self.runtime.cancel_all("worker stopping")
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._shutdown(timeout_s))
        await asyncio.shield(self._stop_task)

    async def _shutdown(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self._loop is not None:
            if not await self._wait_until(lambda: not self.runtime.running(), deadline):
                self.runtime.cancel_all("worker stopping")
                # Cancelled cooperative tasks stop within moments; don't wait for the rest.
                grace_s = min(2.0, self.config.cancel_grace_s)
                await self._wait_until(lambda: not self.runtime.running(), loop.time() + grace_s)
            self._flush()
            # Also while disconnected: the next connection before the deadline delivers.
            await self._wait_until(lambda: not self._unacked, deadline)
            if self._unacked:
                logger.warning("stopping with %d unacknowledged task reports", len(self._unacked))
        self._final.set()
        if self._loop is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._done.wait(), 5.0)
        self.runtime.shutdown(wait=False)
        if self._owns_spark and self.spark_server is not None:
            await asyncio.to_thread(self.spark_server.stop)

    async def _wait_until(self, condition: Callable[[], bool], deadline: float) -> bool:
        """Wait for ``condition`` (checked on each report or ack) until loop time ``deadline``."""
        loop = asyncio.get_running_loop()
        while not condition():
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._changed.clear()
            # Also poll: a task dropped without a report changes nothing on this loop.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.1))
        return True

    # -- one connection --

    async def _run_one_session(self) -> bool:
        """Connect, handshake and serve until the connection ends; True if welcomed."""
        session = asyncio.ensure_future(self._session())
        final = asyncio.ensure_future(self._final.wait())
        try:
            await asyncio.wait({session, final}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            final.cancel()
            # On Python 3.11 a cancel can be lost in a wait_for that completes at the same
            # moment, so also cut the socket (every await in a session then ends), and
            # repeat until the session is over.
            while not session.done():
                if self._writer is not None:
                    self._writer.transport.abort()
                session.cancel()
                await asyncio.wait({session}, timeout=0.5)
        try:
            session.result()
        except asyncio.CancelledError:
            pass
        except (
            OSError,
            TimeoutError,
            ProtocolError,
            BrokerError,
            EOFError,
            LeaderUnknownError,
        ) as exc:
            logger.warning(
                "connection to broker %s failed: %s: %s",
                self.broker_address,
                type(exc).__name__,
                exc,
            )
        except Exception:
            logger.exception("connection to broker %s failed unexpectedly", self.broker_address)
        return self._welcomed

    async def _session(self) -> None:
        self._welcomed = False
        host, port, tls = await self._find_broker()
        # TLS verifies the certificate against the host we were told to connect to.
        ssl_options: dict[str, Any] = (
            {"ssl": self.config.ssl_context(), "server_hostname": host} if tls else {}
        )
        async with asyncio.timeout(self.config.connect_timeout_s):
            reader, writer = await asyncio.open_connection(host, port, **ssl_options)
        self._writer = writer
        try:
            decoder = FrameDecoder(self.config.max_frame_bytes)
            conversation, hello = Conversation(Role.WORKER), self._hello()
            conversation.send(hello)
            writer.write(encode_message(hello, self.config.max_frame_bytes))
            welcome, rest = await self._read_welcome(reader, writer, decoder, conversation)
            conn = _Connection(writer, welcome, self.config.max_frame_bytes, conversation)
            self._welcomed = True
            self._on_welcome(conn, welcome)
            heartbeats = asyncio.ensure_future(self._heartbeat_loop(conn))
            outputs = asyncio.ensure_future(self._output_loop(conn))
            try:
                await self._serve(conn, reader, decoder, rest)
            finally:
                conn.closed = True  # the heartbeat loop's exit, should its cancel be lost
                heartbeats.cancel()
                outputs.cancel()
                await asyncio.wait({heartbeats, outputs}, timeout=1.0)
        finally:
            self._conn = None
            self._writer = None
            self._connected.clear()
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()

    async def _find_broker(self) -> tuple[str, int, bool]:
        """Where to connect (host, port, with TLS): ``broker``, or the leader the brokers
        name right now."""
        c = self.config
        if not c.brokers:
            return *c.broker_address(), c.tls
        address, leader_url, self._discovery_start, worker_tls = await find_leader(
            c.brokers,
            timeout_s=c.discovery_timeout_s,
            token=c.token,
            start=self._discovery_start,
            ssl_context=c.ssl_context(),
        )
        if address != self.broker_address:
            logger.info("the leader's worker endpoint is %s (%s)", address, leader_url or "?")
        self.broker_address = address
        if c.download_from_leader and leader_url:
            # The leader holds every artifact a live task references (docs/DESIGN.md §4).
            self.runtime.artifacts.http_url = leader_url.rstrip("/")
        # Never downgrade: --tls forces TLS even if a broker announced none.
        return *parse_host_port(address), c.tls or worker_tls

    def _hello(self) -> Hello:
        c = self.config
        return Hello(
            worker_id=c.worker_id,
            process_id=self.process_id,
            version=c.version,
            # While stopping: still connect (reports must get out) but ask for nothing.
            task_types={"*": 0} if self._stopping else dict(c.task_types),
            resources=dict(c.resources),
            tenants=tuple(c.tenants),
            running=self._held_attempts(),
            token=c.token,
            output=True,
        )

    def _held_attempts(self) -> tuple[TaskAttempt, ...]:
        """What to reconcile: attempts still running, and attempts that finished while
        disconnected whose report the broker has not acknowledged. The broker must keep
        the latter as running on this worker so the resent report finishes them; left
        out, a new leader would re-queue them and run them twice."""
        held = {(ta.task_id, ta.attempt): ta for ta in self.runtime.running()}
        for task_id, attempt in self._unacked:
            held.setdefault((task_id, attempt), TaskAttempt(task_id, attempt))
        return tuple(held[key] for key in sorted(held))

    async def _read_welcome(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        decoder: FrameDecoder,
        conversation: Conversation,
    ) -> tuple[Welcome, list[Message]]:
        deadline = asyncio.get_running_loop().time() + self.config.handshake_timeout_s
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise TimeoutError(f"no Welcome within {self.config.handshake_timeout_s} s")
            async with asyncio.timeout(left):
                data = await reader.read(_READ_BYTES)
            if not data:
                # A TLS endpoint drops a plain connection without a word.
                hint = "" if writer.get_extra_info("sslcontext") else " (a TLS endpoint? use --tls)"
                raise EOFError(f"the broker closed the connection before Welcome{hint}")
            try:
                messages = decoder.feed(data)
            except ProtocolError as exc:
                self._send_error(writer, exc.code, exc.message)
                raise
            if messages:
                first, rest = messages[0], messages[1:]
                try:
                    conversation.receive(first)  # Welcome or Error
                except ProtocolError:
                    self._send_error(writer, "unexpected_message", f"expected welcome, got {first}")
                    raise
                if isinstance(first, Error):
                    raise BrokerError(f"{first.code}: {first.message}")
                assert isinstance(first, Welcome)
                return first, rest

    def _on_welcome(self, conn: _Connection, welcome: Welcome) -> None:
        for ta in welcome.drop:
            # Already re-queued or over at the broker: a report would only be stale.
            if self.runtime.cancel((ta.task_id, ta.attempt), "dropped by broker", report=False):
                logger.info(
                    "dropping task %d attempt %d (broker's Welcome)", ta.task_id, ta.attempt
                )
        listed = {(ta.task_id, ta.attempt) for ta in (*welcome.keep, *welcome.drop)}
        unlisted = [ta for ta in self.runtime.running() if (ta.task_id, ta.attempt) not in listed]
        if unlisted:
            logger.warning("Welcome neither keeps nor drops %s; keeping them", unlisted)
        self._conn = conn
        self.sessions += 1
        self._connected.set()
        logger.info(
            "connected to broker %s (%s): %d kept, %d dropped, %d reports to resend",
            self.broker_address,
            welcome.broker_id or "?",
            len(welcome.keep),
            len(welcome.drop),
            len(self._unacked),
        )
        self._send_reports(list(self._unacked))

    async def _serve(
        self,
        conn: _Connection,
        reader: asyncio.StreamReader,
        decoder: FrameDecoder,
        pending: list[Message],
    ) -> None:
        messages = pending
        while not self._final.is_set():
            for message in messages:
                if not self._handle(conn, message):
                    return
            try:
                async with asyncio.timeout(conn.heartbeat_timeout_s):
                    data = await reader.read(_READ_BYTES)
            except TimeoutError:
                logger.warning(
                    "broker silent for %.1f s (heartbeat timeout); reconnecting",
                    conn.heartbeat_timeout_s,
                )
                return
            if not data:
                logger.warning("the broker closed the connection")
                return
            try:
                messages = decoder.feed(data)
            except ProtocolError as exc:
                logger.warning("protocol error from broker: %s (%s)", exc.message, exc.code)
                self._send_error(conn.writer, exc.code, exc.message)
                return

    async def _heartbeat_loop(self, conn: _Connection) -> None:
        loop = asyncio.get_running_loop()
        while not conn.closed:
            try:
                conn.seq += 1
                conn.send(Heartbeat(seq=conn.seq))
                self._resend_due(loop.time())
                # A peer that stopped reading fills our buffers: that is a dead link too.
                async with asyncio.timeout(conn.heartbeat_timeout_s):
                    await conn.writer.drain()
            except (TimeoutError, ConnectionError) as exc:
                logger.warning("cannot write to the broker (%r); reconnecting", exc)
                conn.abort()
                return
            except Exception:
                # Without heartbeats the broker would declare us dead: start over instead.
                logger.exception("heartbeat loop failed; reconnecting")
                conn.abort()
                return
            await asyncio.sleep(conn.heartbeat_interval_s)

    # -- task output (shipped to the broker: GET /api/v1/tasks/{id}/logs) --

    async def _output_loop(self, conn: _Connection) -> None:
        """Send running attempts' new output, at most once per interval each."""
        if not conn.takes_output:
            return
        while not conn.closed:
            await asyncio.sleep(_OUTPUT_INTERVAL_S)
            running = {(ta.task_id, ta.attempt) for ta in self.runtime.running()}
            for key in [k for k in conn.output_sent if k not in running]:
                del conn.output_sent[key]
            for key in running:
                if key not in conn.final_output_sent:
                    self._send_live_output(conn, key)

    def _send_live_output(self, conn: _Connection, key: TaskKey) -> bool:
        """Send what is new of a running attempt's output; False: it has none here."""
        sent = conn.output_sent.get(key)
        live = self.runtime.live_output(key, since=sent or 0)
        if live is None:
            return False
        start, data = live
        end = start + len(data)
        if sent is not None and end <= sent:
            return True  # nothing new (or the attempt's output was just taken: it ended)
        if len(data) > MAX_OUTPUT_BYTES:
            start, data = end - MAX_OUTPUT_BYTES, data[-MAX_OUTPUT_BYTES:]
        conn.send(Output(task_id=key[0], attempt=key[1], offset=start, data=data))
        conn.output_sent[key] = end
        return True

    def _send_final_output(
        self, conn: _Connection, key: TaskKey, *, before_report: bool = True
    ) -> bool:
        """Send an ended attempt's whole kept output; False: the worker holds none.
        ``before_report``: remembered until the report's FinishAck (not resent)."""
        output = self.runtime.output(key)
        if output is None:
            return False
        start, data = split_dropped_note(output)
        if len(data) > MAX_OUTPUT_BYTES:
            start += len(data) - MAX_OUTPUT_BYTES
            data = data[-MAX_OUTPUT_BYTES:]
        conn.send(Output(task_id=key[0], attempt=key[1], offset=start, data=data, complete=True))
        if before_report:
            conn.final_output_sent.add(key)
        conn.output_sent.pop(key, None)
        return True

    def _on_fetch_output(self, conn: _Connection, message: FetchOutput) -> None:
        for ta in message.tasks:
            key = (ta.task_id, ta.attempt)
            if self._send_final_output(conn, key, before_report=False):
                continue
            conn.output_sent.pop(key, None)  # the broker lacks it: send all that is kept
            if not self._send_live_output(conn, key):
                conn.send(Output(task_id=ta.task_id, attempt=ta.attempt, missing=True))

    # -- messages from the broker --

    def _handle(self, conn: _Connection, message: Message) -> bool:
        """Act on one message; False ends the connection."""
        try:
            conn.conversation.receive(message)
        except ProtocolError as exc:  # a frame the broker may not send now
            logger.warning("%s; reconnecting", exc.message)
            self._send_error(conn.writer, exc.code, exc.message)
            return False
        if isinstance(message, Heartbeat):
            pass  # any frame proves the broker alive: the read timeout restarts
        elif isinstance(message, Assign):
            self._on_assign(message.tasks)
        elif isinstance(message, Cancel):
            reason = message.reason or "cancelled by the broker"
            for ta in message.tasks:
                self.runtime.cancel((ta.task_id, ta.attempt), reason)
        elif isinstance(message, FinishAck):
            for ta in message.tasks:
                key = (ta.task_id, ta.attempt)
                self._unacked.pop(key, None)
                self._sent_at.pop(key, None)
                conn.final_output_sent.discard(key)
            self._changed.set()
        elif isinstance(message, FetchOutput):
            if conn.takes_output:
                self._on_fetch_output(conn, message)
        elif isinstance(message, Error):
            logger.warning("broker error %s: %s; reconnecting", message.code, message.message)
            return False
        return True

    def _on_assign(self, tasks: Iterable[AssignedTask]) -> None:
        # Runs for one task process leave in one write when a frame assigns several.
        with self.runtime.batched():
            self._start_assigned(tasks)

    def _start_assigned(self, tasks: Iterable[AssignedTask]) -> None:
        for task in tasks:
            key = (task.task_id, task.attempt)
            if self.runtime.is_known(key) or key in self._unacked:
                # A repeat (e.g. the broker resent it): the running attempt or its
                # pending report stands.
                logger.debug(
                    "ignoring repeated assignment of task %d attempt %d",
                    *key,
                    extra=task_fields(task.task_id, task.tenant, attempt=task.attempt),
                )
                if key in self._unacked:
                    self._send_reports([key])
                continue
            if self._stopping:
                self._on_report(
                    TaskReport(
                        task.task_id, task.attempt, ok=False, error="cancelled: worker stopping"
                    )
                )
                continue
            for older in self.runtime.older_attempts(task.task_id, task.attempt):
                self.runtime.cancel(older, f"superseded by attempt {task.attempt}")
            if not self.runtime.start(task):
                continue
            if task.deadline_ms is not None:
                self._arm_deadline(key, task.deadline_ms)

    def _arm_deadline(self, key: TaskKey, deadline_ms: int) -> None:
        # deadline_ms is Unix time: this assumes broker and worker clocks roughly agree
        # (NTP); the broker enforces deadlines too.
        assert self._loop is not None
        delay_s = max(0.0, deadline_ms / 1000 - time.time())
        self._deadlines[key] = self._loop.call_later(delay_s, self._deadline_passed, key)

    def _task_fields(self, key: TaskKey) -> dict[str, object]:
        ctx = self.runtime.context(key)
        return task_fields(key[0], ctx.tenant if ctx is not None else "", attempt=key[1])

    def _deadline_passed(self, key: TaskKey) -> None:
        self._deadlines.pop(key, None)
        fields = self._task_fields(key)
        if self.runtime.cancel(key, "deadline exceeded"):
            logger.info("task %d attempt %d passed its deadline", *key, extra=fields)

    # -- reports --

    def _report_from_thread(self, report: TaskReport) -> None:
        loop = self._loop
        if loop is None:
            logger.error(
                "task report before the worker ran: %s",
                report,
                extra=self._task_fields((report.task_id, report.attempt)),
            )
            return
        try:
            loop.call_soon_threadsafe(self._on_report, report)
        except RuntimeError:  # the loop is closed: the process is going away
            logger.warning(
                "dropping the report of task %d: event loop closed",
                report.task_id,
                extra=self._task_fields((report.task_id, report.attempt)),
            )

    def _on_report(self, report: TaskReport) -> None:
        key = (report.task_id, report.attempt)
        self.runtime.forget(key)
        handle = self._deadlines.pop(key, None)
        if handle is not None:
            handle.cancel()
        self._unacked[key] = report
        self._outbox.append(key)
        self._changed.set()
        if self._flush_handle is None and self._loop is not None:
            # 0 (the default): flush on the next loop turn, so reports that arrive
            # together share a frame without holding a lone report back.
            delay_s = self.config.finish_batch_ms / 1000
            self._flush_handle = (
                self._loop.call_later(delay_s, self._flush)
                if delay_s > 0
                else self._loop.call_soon(self._flush)
            )

    def _flush(self) -> None:
        self._flush_handle = None
        keys, self._outbox = self._outbox, []
        # Disconnected: the reports stay unacknowledged and go out after the next Welcome.
        self._send_reports(keys)

    def _resend_due(self, now: float) -> None:
        due = [
            k
            for k in self._unacked
            if now - self._sent_at.get(k, 0.0) >= self.config.finish_resend_s
        ]
        if due:
            logger.debug("resending %d unacknowledged reports", len(due))
            self._send_reports(due)

    def _send_reports(self, keys: Iterable[TaskKey]) -> None:
        conn = self._conn
        if conn is None or self._loop is None:
            return
        now = self._loop.time()
        budget = conn.max_frame_bytes // 2
        batch: list[TaskReport] = []
        size = 0
        for key in dict.fromkeys(keys):
            report = self._unacked.get(key)
            if report is None:
                continue
            n = _REPORT_OVERHEAD_BYTES + len(report.result or b"") + len(report.error or "") * 4
            n += sum(_REPORT_OVERHEAD_BYTES + len(s.params) for s in report.spawn)
            if batch and size + n > budget:
                conn.send(Finish(reports=tuple(batch)))
                batch, size = [], 0
            if conn.takes_output and key not in conn.final_output_sent:
                # Before its report: once the broker logs the attempt over, it holds all
                # of its output (a follower of the logs stops at the end, missing nothing).
                self._send_final_output(conn, key)
            batch.append(report)
            size += n
            self._sent_at[key] = now
        if batch:
            conn.send(Finish(reports=tuple(batch)))

    @staticmethod
    def _send_error(writer: asyncio.StreamWriter, code: str, message: str) -> None:
        if not writer.is_closing():
            with contextlib.suppress(Exception):
                writer.write(encode_message(Error(code=code, message=message[:1000])))


def run_worker(config: WorkerConfig) -> None:
    """Run a worker until SIGINT/SIGTERM (blocking; for the CLI).

    The first signal stops gracefully (running tasks may finish, reports are delivered);
    a second one cancels the running tasks at once.
    """

    async def main() -> None:
        worker = Worker(config)
        loop = asyncio.get_running_loop()
        signals = 0
        stops: list[asyncio.Task[None]] = []

        def on_signal() -> None:
            nonlocal signals
            signals += 1
            logger.info("signal received: stopping%s", "" if signals == 1 else " now")
            stops.append(
                loop.create_task(worker.stop(wait=signals == 1, timeout_s=config.stop_timeout_s))
            )

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        try:
            await worker.run()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            if stops:
                await asyncio.gather(*stops, return_exceptions=True)

    # uvloop where available (as the broker): cheaper wake-ups and socket IO per task.
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(main())
    else:
        uvloop.run(main())
