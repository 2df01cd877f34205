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

:class:`Worker` here owns the reconnect loop, the handshake, the frames read and the
heartbeats; its collaborators own the rest: where to connect (``discovery.py``),
assigned tasks, deadlines and reports' hand-over (``assignments.py``), reports until
acknowledged (``reports.py``) and task output (``output.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import ssl
import uuid
from collections.abc import Callable
from typing import Any

from clients.worker.artifacts import CodeDrops
from clients.worker.config import WorkerConfig
from clients.worker.link.assignments import Assignments
from clients.worker.link.connection import Connection
from clients.worker.link.discovery import (
    BrokerError,
    BrokerLocator,
    Leader,
    LeaderUnknownError,
    LinkMisconfiguredError,
    Problems,
    find_leader,
    refusal,
    sniff_answer,
)
from clients.worker.link.output import TaskOutputs
from clients.worker.link.reports import ReportOutbox
from clients.worker.runtime.task_runtime import (
    TaskKey,
    TaskRuntime,
    released_notice,
    stopping_notice,
)
from clients.worker.spark.connect_server import SparkConnectServer
from clients.worker.spark.remote import RemoteSpark
from clients.worker.spark.tenant_servers import (
    SparkBackend,
    tenant_servers,
    tenant_servers_wanted,
)
from wire.conversation import Conversation, Role
from wire.worker_protocol import (
    MAX_HELLO_TASK_NAMES,
    Assign,
    Cancel,
    Error,
    FetchOutput,
    FinishAck,
    FrameDecoder,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    TaskReport,
    Welcome,
    encode_message,
)

__all__ = [
    "BrokerError",
    "Leader",
    "LeaderUnknownError",
    "LinkMisconfiguredError",
    "Worker",
    "find_leader",
    "run_worker",
]

logger = logging.getLogger("clients.worker.link")

_READ_BYTES = 256 * 1024


class Worker:
    """A Steward worker: connects to the broker and runs the tasks it is assigned."""

    def __init__(self, config: WorkerConfig, *, spark_server: SparkBackend | None = None) -> None:
        self.config = config
        self.process_id = uuid.uuid4().hex  # new per process start: tells restarts apart
        # A Spark Connect server per tenant (a root worker: clients/worker/spark/tenant_servers.py)
        # or
        # one per worker (clients/worker/spark/connect_server.py), started by run();
        # a given one (tests: one server for many workers) is the caller's to stop.
        self._owns_spark = False
        if (
            spark_server is None
            and config.spark == "connect"
            and config.task_isolation == "process"
            and config.may_run_spark()
        ):
            # --spark-remote: sessions on that server instead (clients/worker/spark/remote.py).
            if config.spark_remote:
                spark_server = RemoteSpark(config.spark_remote)
            elif tenant_servers_wanted(config):
                spark_server = tenant_servers(config)
            else:
                spark_server = SparkConnectServer.from_config(config)
            self._owns_spark = True
        self.spark_server = spark_server
        # Register extra task types with worker.runtime.register(name, fn).
        self.runtime = TaskRuntime(
            config, lambda report: self._tasks.report_from_thread(report), spark_server=spark_server
        )
        self.sessions = 0  # Welcomes received, for tests and metrics
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: Connection | None = None
        self._writer: asyncio.StreamWriter | None = None  # of the current connection
        # Its collaborators: task output, reports until acknowledged, assigned tasks.
        self._outputs = TaskOutputs(self.runtime)
        self._reports = ReportOutbox(config, self._outputs, lambda: self._conn)
        self._tasks = Assignments(self.runtime, self._reports)
        self._stopping = False  # no new tasks; still delivering reports
        self._final = asyncio.Event()  # set: close and leave run()
        self._done = asyncio.Event()
        self._stop_task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._welcomed = False  # the current/last connection got its Welcome
        self._locator = BrokerLocator(config, self.runtime.artifacts)
        self._problems = Problems(config)
        self._code_drops = CodeDrops(self.runtime.artifacts)

    # -- observation --

    @property
    def unacked(self) -> dict[TaskKey, TaskReport]:
        return dict(self._reports.unacked)

    @property
    def broker_address(self) -> str:
        """Where the current/last connection goes (found anew each time with brokers)."""
        return self._locator.broker_address

    @property
    def connected(self) -> bool:
        return self._conn is not None

    async def wait_connected(self) -> None:
        await self._connected.wait()

    # -- lifecycle --

    async def run(self) -> None:
        """Connect and serve until :meth:`stop`; reconnects on any failure, except that a
        misconfiguration failing it for ``give_up_after_s`` raises LinkMisconfiguredError."""
        if self._loop is not None:
            raise RuntimeError("Worker.run() can only be called once")
        self._loop = self._reports.loop = self._tasks.loop = asyncio.get_running_loop()
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
            self._tasks.close()
            self._reports.close()
            self._done.set()

    async def stop(self, *, wait: bool = True, timeout_s: float = 30.0) -> None:
        """Stop taking tasks, finish or cancel running ones, deliver reports, disconnect.

        ``wait``: let running tasks finish (up to ``timeout_s``, then cancel them);
        otherwise cancel them at once. Calling it again with ``wait=False`` hurries a
        graceful stop along.
        """
        if not self._stopping:
            stopping_notice(len(self.runtime.running()), timeout_s)
        self._stopping = True
        if not wait:
            released_notice(self.runtime.release_all("worker stopping"))
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._shutdown(timeout_s))
        await asyncio.shield(self._stop_task)

    async def _shutdown(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self._loop is not None:
            if not await self._wait_until(lambda: not self.runtime.running(), deadline):
                released_notice(self.runtime.release_all("worker stopping"))
                # Cancelled cooperative tasks stop within moments; don't wait for the rest.
                grace_s = min(2.0, self.config.cancel_grace_s)
                await self._wait_until(lambda: not self.runtime.running(), loop.time() + grace_s)
                self.runtime.report_released()  # the rest are ended with the worker
            self._reports.flush()
            # Also while disconnected: the next connection before the deadline delivers
            # (the given-back reports get a few seconds of their own after the grace).
            await self._wait_until(
                lambda: not self._reports.unacked, max(deadline, loop.time() + 5.0)
            )
            if self._reports.unacked:
                n = len(self._reports.unacked)
                logger.warning("stopping with %d unacknowledged task reports", n)
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
            self._reports.changed.clear()
            # Also poll: a task dropped without a report changes nothing on this loop.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reports.changed.wait(), min(left, 0.1))
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
            LinkMisconfiguredError,
        ) as exc:
            # One line per problem (then now and then); raises once it is time to give up.
            self._problems.failed(self.broker_address, exc)
        except Exception:
            logger.exception("connection to broker %s failed unexpectedly", self.broker_address)
        return self._welcomed

    async def _session(self) -> None:
        self._welcomed = False
        host, port, tls = await self._locator.find()
        # TLS verifies the certificate against the host we were told to connect to.
        ssl_options: dict[str, Any] = (
            {"ssl": self.config.ssl_context(), "server_hostname": host} if tls else {}
        )
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                reader, writer = await asyncio.open_connection(host, port, **ssl_options)
        except ssl.SSLError as exc:
            # Not a network hiccup: a plain endpoint, or a certificate this CA did not sign.
            hint = "a plain endpoint? drop --tls" if "WRONG_VERSION" in str(exc) else "--tls-ca"
            raise LinkMisconfiguredError(
                f"TLS with the worker endpoint {host}:{port} failed ({exc.reason or exc}): {hint}"
            ) from None
        self._writer = writer
        try:
            decoder = FrameDecoder(self.config.max_frame_bytes)
            conversation, hello = Conversation(Role.WORKER), self._hello()
            conversation.send(hello)
            writer.write(encode_message(hello, self.config.max_frame_bytes))
            welcome, rest = await self._read_welcome(reader, writer, decoder, conversation)
            conn = Connection(writer, welcome, self.config.max_frame_bytes, conversation)
            self._welcomed = True
            self._on_welcome(conn, welcome)
            heartbeats = asyncio.ensure_future(self._heartbeat_loop(conn))
            outputs = asyncio.ensure_future(self._outputs.loop(conn))
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
            running=self._tasks.held(),
            token=c.token,
            output=True,
            lists_unacked=True,  # held() lists unacknowledged reports too
            task_names=hello_task_names(self.runtime.task_names()),
        )

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
            tls = writer.get_extra_info("sslcontext") is not None
            if not data:
                # A TLS endpoint drops a plain connection without a word.
                hint = "" if tls else " (a TLS endpoint? use --tls)"
                raise EOFError(f"the broker closed the connection before Welcome{hint}")
            if decoder.buffered_bytes == 0:  # a frame starts here: is it one?
                misconfigured = sniff_answer(data, self.broker_address, tls=tls)
                if misconfigured is not None:
                    raise misconfigured
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
                    raise refusal(self.broker_address, BrokerError(first.code, first.message))
                assert isinstance(first, Welcome)
                return first, rest

    def _on_welcome(self, conn: Connection, welcome: Welcome) -> None:
        self._tasks.reconcile(welcome)
        if self.spark_server is not None:  # its tenants' fair pools (spark/pools.py)
            self.spark_server.set_tenant_weights(welcome.tenant_weights)
        self._conn = conn
        self.sessions += 1
        self._connected.set()
        self._problems.connected()
        logger.info(
            "connected to broker %s (%s): %d kept, %d dropped, %d reports to resend",
            self.broker_address,
            welcome.broker_id or "?",
            len(welcome.keep),
            len(welcome.drop),
            len(self._reports.unacked),
        )
        self._reports.send(list(self._reports.unacked))

    async def _serve(
        self,
        conn: Connection,
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

    async def _heartbeat_loop(self, conn: Connection) -> None:
        loop = asyncio.get_running_loop()
        while not conn.closed:
            try:
                conn.seq += 1
                conn.send(Heartbeat(seq=conn.seq))
                self._reports.resend_due(loop.time())
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

    # -- messages from the broker --

    def _handle(self, conn: Connection, message: Message) -> bool:
        """Act on one message; False ends the connection."""
        try:
            conn.conversation.receive(message)
        except ProtocolError as exc:  # a frame the broker may not send now
            logger.warning("%s; reconnecting", exc.message)
            self._send_error(conn.writer, exc.code, exc.message)
            return False
        if isinstance(message, Heartbeat):
            # Any frame proves the broker alive: the read timeout restarts.
            self._code_drops.on_heartbeat(message.dropped_code)
        elif isinstance(message, Assign):
            self._tasks.on_assign(message.tasks, stopping=self._stopping)
        elif isinstance(message, Cancel):
            reason = message.reason or "cancelled by the broker"
            for ta in message.tasks:
                self.runtime.cancel((ta.task_id, ta.attempt), reason)
        elif isinstance(message, FinishAck):
            self._reports.acked(conn, message.tasks)
        elif isinstance(message, FetchOutput):
            if conn.takes_output:
                self._outputs.on_fetch(conn, message)
        elif isinstance(message, Error):
            logger.warning("broker error %s: %s; reconnecting", message.code, message.message)
            return False
        return True

    # -- reports --

    @staticmethod
    def _send_error(writer: asyncio.StreamWriter, code: str, message: str) -> None:
        if not writer.is_closing():
            with contextlib.suppress(Exception):
                writer.write(encode_message(Error(code=code, message=message[:1000])))


def run_worker(config: WorkerConfig) -> None:
    """Run a worker until SIGINT/SIGTERM (blocking; for the CLI); raises
    LinkMisconfiguredError when what it was given cannot work (see :class:`Problems`).

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
        except LinkMisconfiguredError:
            # Giving up: end what runs (the Spark Connect server too) before exiting.
            await worker.stop(wait=False, timeout_s=0.0)
            raise
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


def hello_task_names(names: list[str]) -> tuple[str, ...] | None:
    """The task types a Hello lists (docs/DESIGN.md §6, "Served task types"): none past
    the limit, said in the log."""
    if len(names) <= MAX_HELLO_TASK_NAMES:
        return tuple(names)
    logger.warning(
        "this worker registered %d task types, over the %d a Hello lists: it lists none,"
        " so the broker does not refuse submits of types no worker serves",
        len(names),
        MAX_HELLO_TASK_NAMES,
    )
    return None
