"""The standalone broker: one process, file ledgers in its data dir, no ZooKeeper."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import gc
import logging
import signal
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from broker.api import api_models as m
from broker.api.edges import bounded_http_protocol
from broker.api.http_api import ApiApp, ApiConfig
from broker.api.webhooks import WebhookSender
from broker.artifacts.code_store import CodeStore
from broker.core import entries as e
from broker.core.records import Task, TaskRef
from broker.core.transitions import TaskState
from broker.leader.duties import broker_duties
from broker.observability.metrics import BrokerMetrics
from broker.observability.node_observer import observe_node
from broker.replication.node import (
    VERSION,
    BrokerStartupError,
    BrokerUnavailableError,
    DataDirLock,
    Node,
    NodeConfig,
    Stamp,
)
from broker.security.tls import TlsConfig, TlsConfigError, server_context
from broker.server.child_workers import ChildSpec, ChildWorkers, child_env
from broker.workers.worker_link import WorkerLink, WorkerLinkConfig
from log.file import FileLedgerListStore, FileLedgerStore
from snapshot.store import SnapshotStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StandaloneConfig:
    node: NodeConfig
    api: ApiConfig = field(default_factory=ApiConfig)
    workers: WorkerLinkConfig = field(default_factory=WorkerLinkConfig)
    child_workers: int = 0  # worker processes to start beside the broker
    # HTTPS and TLS on the worker endpoint (overrides workers.tls).
    tls: TlsConfig | None = None
    # On SIGTERM/SIGINT: how long running tasks may still finish before they are given
    # back to the queue (docs/DESIGN.md §6, "Stopping"); child workers get the same.
    stop_grace_s: float = 15.0
    # Code artifacts no task needed for this long are deleted (docs/DESIGN.md §7); 0: never.
    code_retention_ms: int = 0


def build_node(config: NodeConfig) -> Node:
    """A node on the data dir's file ledgers and snapshots, with its metrics and task log."""
    data_dir = config.data_dir
    node = Node(
        config,
        ledgers=FileLedgerStore(data_dir / "ledgers"),
        ledger_list=FileLedgerListStore(data_dir / "ledgers.list"),
        snapshots=SnapshotStore(data_dir / "snapshots", keep=config.snapshot_keep),
    )
    observe_node(node)
    return node


async def serve_standalone(config: StandaloneConfig, *, ready: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM, then shut down cleanly (drain, close ledger, snapshot)."""
    lock = DataDirLock(config.node.data_dir)
    lock.acquire()
    try:
        # Before the log is opened: a taken port fails in a second, naming the flag.
        check_port_free(config.api.host, config.api.port, HTTP_PORT)
        check_port_free(config.workers.host, config.workers.port, WORKER_PORT)
    except BrokerStartupError:
        lock.release()
        raise
    node = build_node(config.node)
    try:
        await node.start()
        # Boot created most long-lived objects: keep them out of GC passes (latency).
        gc.collect()
        gc.freeze()
        code_store = CodeStore(config.node.data_dir / "code")
        # Deletes replayed at start (or missed by a crash just after one) first, then
        # those applied from now on (docs/DESIGN.md §7).
        await asyncio.to_thread(code_store.remove_unknown, set(node.state.artifacts))
        node.listeners.append(code_store.on_applied)
        if isinstance(node.metrics, BrokerMetrics):
            node.metrics.bind_code_store(code_store.usage)
        # Open for writes since node.start(): the one term of a standalone broker.
        link = WorkerLink(node, dataclasses.replace(config.workers, tls=config.tls))
        webhooks = WebhookSender(node)
        duties = broker_duties(
            node, link, code_retention_ms=config.code_retention_ms, webhooks=webhooks
        )
        await duties.start()
        url = f"{http_scheme(config.tls)}://{config.api.host}:{config.api.port}"
        # The cluster view advertises the worker endpoint (GET /api/v1/cluster), so a
        # worker given this broker's URL finds it as it finds a cluster leader's.
        view = StandaloneView(
            node,
            url=url,
            worker_address=f"{config.workers.host}:{link.port}",
            worker_tls=config.tls is not None,
        )
        app = ApiApp(
            node, config.api, code_store, cluster=view, outputs=link.outputs, webhooks=webhooks
        )
        server, server_task = await start_http_server(app, config.api, tls=config.tls)
        stop = asyncio.Event()
        hurry = asyncio.Event()  # a second signal: give running tasks back now

        def on_signal() -> None:
            (hurry if stop.is_set() else stop).set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        logger.info("steward standalone serving on %s", url)
        tls_note = " over TLS" if config.tls is not None else ""
        print(
            f"steward standalone ready on {url} "
            f"(workers connect to {config.workers.host}:{link.port}{tls_note}; "
            f"data dir {config.node.data_dir})",
            flush=True,
        )
        children = ChildWorkers(
            child_worker_specs(config, link.port), child_env(config.workers.token)
        )
        await children.start()
        if ready is not None:
            ready.set()
        await asyncio.wait(
            [asyncio.create_task(stop.wait()), server_task], return_when=asyncio.FIRST_COMPLETED
        )
        logger.info("shutting down")
        # Running tasks may finish within the grace (the API still answers meanwhile),
        # the rest go back to the queue; then stop accepting, let in-flight requests
        # finish (the node still runs), drain and close the log.
        if not server_task.done():
            await let_tasks_finish(node, link, children, config.stop_grace_s, hurry)
        await stop_http_server(server, server_task, app)
        await children.stop()
        await duties.stop()
        await node.stop()
    finally:
        await node.ledgers.close()
        lock.release()


def http_scheme(tls: TlsConfig | None) -> str:
    return "https" if tls is not None else "http"


class StandaloneView:
    """The cluster around a standalone broker: itself alone, leading (ClusterView in
    broker/api/common.py). It lets GET /api/v1/cluster name its worker endpoint."""

    def __init__(self, node: Node, *, url: str, worker_address: str, worker_tls: bool) -> None:
        self._node = node
        self.url = url
        self.worker_address: str | None = worker_address
        self.worker_tls = worker_tls
        self.peer_ssl_context: ssl.SSLContext | None = None  # it has no peers

    def leader(self) -> m.BrokerSummary:
        node = self._node
        host, _, port = self.url.rpartition("//")[2].rpartition(":")
        return m.BrokerSummary(
            id=node.config.broker_id,
            host=host,
            port=int(port),
            uptime_secs=round((node.clock_ms() - node.stats.started_ms) / 1000, 3),
            is_leader=True,
            version=VERSION,
            position=m.Position(*node.position),
            role=str(node.role),
            url=self.url,
            worker_address=self.worker_address,
            worker_tls=self.worker_tls,
        )

    def brokers(self) -> list[m.BrokerSummary]:
        return []  # no other broker

    def broker_summaries(self, own: m.BrokerSummary) -> list[m.BrokerSummary]:
        return [own]

    def coordination_problem(self) -> str | None:
        return None  # no ZooKeeper


# How a clash starts (clients/dev/local_cluster.py and tests look for the HTTP one), which
# port it is, and the flag that moves it (clients/cli/options.py).
HTTP_PORT = ("could not serve HTTP on", "HTTP port", "--http")
WORKER_PORT = ("cannot listen for workers on", "worker port", "--worker-listen")


def check_port_free(host: str, port: int, which: tuple[str, str, str]) -> None:
    """BrokerStartupError in one line naming the flag that moves the port when ``host:port``
    cannot be listened on (another process has it, or the host is not this machine's)."""
    if port == 0:
        return  # a free port is picked
    lead, what, flag = which
    try:
        addresses = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise BrokerStartupError(
            f"{lead} {host}:{port}: {exc.strerror}: give this broker a {what} on an address "
            f"of this machine with {flag} HOST:PORT"
        ) from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            # As the servers themselves bind: a port in TIME_WAIT is no clash.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    problem = "address already in use (another process listens there): stop it or"
                else:
                    problem = f"{(exc.strerror or str(exc)).lower()}:"
                raise BrokerStartupError(
                    f"{lead} {host}:{port}: {problem} give this broker another {what} with "
                    f"{flag} HOST:PORT"
                ) from None


async def start_http_server(
    app: ApiApp, config: ApiConfig, *, tls: TlsConfig | None = None
) -> tuple[HttpServer, asyncio.Task[None]]:
    """Serve ``app`` with uvicorn (HTTPS with ``tls``); raises BrokerStartupError when it
    cannot listen or the certificate is unusable."""
    ssl_options: dict[str, Any] = {}
    if tls is not None:
        try:
            context = server_context(tls)  # fail here, clearly, on a bad certificate or key
        except TlsConfigError as exc:
            raise BrokerStartupError(str(exc)) from None
        ssl_options["ssl_context_factory"] = lambda _config, _default: context
    server = HttpServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            # uvicorn's own lines go through the root logger's handler (text or JSON).
            log_config=None,
            access_log=False,
            # No proxy sits in front of the broker that it would trust: X-Forwarded-* are
            # not read (uvicorn's middleware for them cost every request a wrapper call).
            proxy_headers=False,
            server_header=False,  # nothing for clients to learn from "server: uvicorn"
            lifespan="off",
            # httptools with the header bound, deadlines and connection cap it lacks.
            http=bounded_http_protocol(config.edges),
            ws="none",
            backlog=4096,
            timeout_keep_alive=30,
            **ssl_options,
        )
    )
    server_task = asyncio.create_task(server.serve())
    await asyncio.wait(
        [asyncio.create_task(server.startup_done.wait()), server_task],
        return_when=asyncio.FIRST_COMPLETED,
    )
    if not server.started:
        server.should_exit = True
        # Taken since the check at start (uvicorn logged why).
        lead, what, flag = HTTP_PORT
        raise BrokerStartupError(
            f"{lead} {config.host}:{config.port}: give this broker another {what} with "
            f"{flag} HOST:PORT"
        )
    return server, server_task


async def stop_http_server(
    server: HttpServer, server_task: asyncio.Task[None], app: ApiApp | None = None
) -> None:
    """Stop accepting and let in-flight requests finish (bounded); ``app``'s long polls
    and event streams are answered and ended at once rather than waited for."""
    server.should_exit = True
    if app is not None:
        app.context.end_waits()
    try:
        await asyncio.wait_for(server_task, timeout=15)
    except TimeoutError:
        logger.warning("HTTP server did not stop within 15 s")


def _running(node: Node) -> list[Task]:
    state = node.state
    return [state.tasks[i] for i in sorted(state.by_state[TaskState.RUNNING])]


def _say(message: str) -> None:
    # Logged, not printed: under --log-format json every line stays one JSON object.
    logger.warning("%s", message)


async def let_tasks_finish(
    node: Node,
    link: WorkerLink,
    children: ChildWorkers,
    grace_s: float,
    hurry: asyncio.Event,
) -> None:
    """The stop of a broker with running tasks (docs/DESIGN.md §6, "Stopping"): assign
    nothing new, let running tasks finish for up to ``grace_s`` (``hurry``: stop waiting),
    then give the rest back to the queue, not counted as failed attempts."""
    link.draining = True
    children.signal(signal.SIGTERM)  # they stop taking tasks and drain with the same grace
    running = len(_running(node))
    if not running:
        return
    _say(
        f"stopping: waiting for {running} running task{'s' if running != 1 else ''} to"
        f" finish (grace {grace_s:g} s, --stop-grace-s); then the rest go back to the queue."
        " Ctrl-C again gives them back now"
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while _running(node) and not hurry.is_set() and loop.time() < deadline:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(hurry.wait(), min(0.1, max(0.0, deadline - loop.time())))
    rest = _running(node)
    if not rest:
        _say("every running task finished; stopping")
        return
    outcomes = tuple(
        e.TaskOutcome(
            task_id=task.id,
            worker_id=task.worker or "",
            attempt=task.attempt,
            ok=False,
            error="given back: the broker stopped",
            released=True,
        )
        for task in rest
    )

    def build(stamp: Stamp) -> e.Entry:
        return e.finish_tasks(stamp.now_ms, outcomes)

    try:
        results = await node.propose(build)
    except BrokerUnavailableError as exc:
        _say(f"could not give {len(rest)} running tasks back ({exc}); they run on")
        return
    # One its worker gave back (or finished) meanwhile is not counted twice.
    given = sum(1 for r in results if isinstance(r, TaskRef)) if isinstance(results, list) else 0
    if given:
        _say(
            f"gave {given} running task{'s' if given != 1 else ''} back to the queue: they run"
            " again on a worker after the broker restarts (the attempt is not counted as failed)"
        )


def child_worker_specs(config: StandaloneConfig, worker_port: int) -> list[ChildSpec]:
    tls_args: list[str] = []
    if config.tls is not None:
        tls_args.append("--tls")
        if config.tls.ca_path is not None:
            tls_args += ["--tls-ca", str(config.tls.ca_path)]
    return [
        ChildSpec(
            worker_id,
            (
                "--broker",
                f"{config.workers.host}:{worker_port}",
                "--http-url",
                f"{http_scheme(config.tls)}://{config.api.host}:{config.api.port}",
                "--worker-id",
                worker_id,
                "--cache-dir",
                str(config.node.data_dir / "worker-cache"),
                "--stop-grace-s",
                str(config.stop_grace_s),
                *tls_args,
            ),
        )
        for worker_id in (
            f"{config.node.broker_id}-worker-{n + 1}" for n in range(config.child_workers)
        )
    ]


class HttpServer(uvicorn.Server):
    # The broker handles SIGINT/SIGTERM itself (drain, close the ledger, snapshot).
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.startup_done = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        except SystemExit:
            pass  # uvicorn exits when it cannot bind: start_http_server says so instead
        finally:
            self.startup_done.set()


def default_data_dir() -> Path:
    return Path("data")
